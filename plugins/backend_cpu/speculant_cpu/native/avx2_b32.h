// The AVX2 row kernels for the blocks of 32 with one fp16 scale (Q8_0, Q5_0, Q4_0): vnni_b32.h's
// functions, same names and signatures, on ymm. Per block and row the same operations as there
// (and as llama.cpp's ggml_vec_dot_q8_0_q8_0): the exact integer dot of the block in eight int32
// lanes (AVX-VNNI's vpdpbusd, or vpmaddubsw + vpmaddwd: |w| * (x with w's sign) is at most
// 128 * 127, so a pair of them fits an int16), its conversion, the scale d * dx, one FMA per
// lane, and the same final reduction; so the bits are the AVX-512 kernels'.
#pragma once
#include "kernels.h"
#include "unpack.h"

#include <algorithm>

namespace spk SPK_HIDDEN {
namespace {  // internal to each file that includes it (see kernels.h)

inline float hsum128(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

inline __m256i decode32(const BlockQ8_0& blk) { return _mm256_loadu_si256((const __m256i*)blk.qs); }

inline __m256i nibbles32(const uint8_t* qs) {
    const __m128i q = _mm_loadu_si128((const __m128i*)qs);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m4)), _mm_and_si128(_mm_srli_epi16(q, 4), m4), 1);
}

// Q5_0: the fifth bits spread to bytes (llama.cpp's bytes_from_bits_32): byte i is 0xFF where bit
// i of qh is set; (nibble | 0x10 where set) - 16.
inline __m256i decode32(const BlockQ5_0& blk) {
    uint32_t qh;
    std::memcpy(&qh, blk.qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bits = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    const __m256i hi = _mm256_and_si256(bits, _mm256_set1_epi8(0x10));
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(blk.qs), hi), _mm256_set1_epi8(16));
}

inline __m256i decode32(const BlockQ4_0& blk) { return _mm256_sub_epi8(nibbles32(blk.qs), _mm256_set1_epi8(8)); }

// The eight int32 lanes of a block's dot product: lane l sums the products of bytes 4l .. 4l + 3.
inline __m256i dot32(__m256i aq, __m256i xs) {
#if SPK_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aq, xs);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), _mm256_set1_epi16(1));
#endif
}

inline float out8(__m256 v) { return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); }

// NR activation rows against one weight row, a ymm chain each.
template <class Block, int NR>
void dot_b32(const Block* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    __m256 f[NR];
    for (int r = 0; r < NR; ++r) f[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        if (b % 2 == 0) prefetch(&w[b], 64);
        const __m256i q = decode32(w[b]);
        const __m256i aq = _mm256_abs_epi8(q);
        const float d = f16(w[b].d);
        for (int r = 0; r < NR; ++r) {
            const int64_t ab = (int64_t)(i0 + r) * a.nb + b;
            const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(a.qs.data() + ab * 32)), q);
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(aq, xs)), _mm256_set1_ps(d * a.d[ab]), f[r]);
        }
    }
    for (int r = 0; r < NR; ++r) y[r * ldy] = out8(f[r]);
}

// Decode (one activation row): four weight rows at a time, four independent FMA chains.
template <class Block>
void dot_b32_w4(const uint8_t* row, size_t row_bytes, int nb, const Act& a, int i, float* y) {
    const Block* w[4];
    __m256 fs[4];
    for (int t = 0; t < 4; ++t) {
        w[t] = (const Block*)(row + t * row_bytes);
        fs[t] = _mm256_setzero_ps();
    }
    W4Prefetch pf(row, row_bytes, nb, sizeof(Block));
    for (int b = 0; b < nb; ++b) {
        const int64_t ab = (int64_t)i * a.nb + b;
        const __m256i x = _mm256_loadu_si256((const __m256i*)(a.qs.data() + ab * 32));
        const float dx = a.d[ab];
        for (int t = 0; t < 4; ++t) {
            if (b % 2 == 0) pf.fetch(t, 64);
            const __m256i q = decode32(w[t][b]);
            fs[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q))),
                                    _mm256_set1_ps(f16(w[t][b].d) * dx), fs[t]);
        }
        pf.next();
    }
    for (int t = 0; t < 4; ++t) y[t] = out8(fs[t]);
}

// Many activation rows of Q5_0 or Q4_0 (a draft model's prompt, a head's catch-up, such a
// target's prompt): the work item's weight rows decoded to signed bytes once (`q`, `dq`:
// [nr][nb][32] and [nr][nb]), then tiles of NW weight rows by NX activation rows, each decoded
// block's abs and each activation block's load shared by the tile. Per (weight row, activation
// row) the same operations in the same order as dot_b32 (the sign trick, the block's eight int32
// lanes, the scale d * dx as one float product, one FMA per lane, out8), so the bits are the
// same; what changes is that dot_b32 decodes each weight block again for every 8 activation rows,
// most of its time for these types (linear.cpp has the measurements).
template <int NW, int NX>
inline void b32_tile(const int8_t* q, const float* dq, int nb, const Act& a, int64_t i0, float* y, int64_t ldy) {
    __m256 f[NW][NX];
    for (int t = 0; t < NW; ++t)
        for (int r = 0; r < NX; ++r) f[t][r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m256i x[NX];
        float dx[NX];
        for (int r = 0; r < NX; ++r) {
            const int64_t ab = (i0 + r) * a.nb + b;
            x[r] = _mm256_loadu_si256((const __m256i*)(a.qs.data() + ab * 32));
            dx[r] = a.d[ab];
        }
        for (int t = 0; t < NW; ++t) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(q + ((int64_t)t * nb + b) * 32));
            const __m256i aw = _mm256_abs_epi8(w);
            const float d = dq[(int64_t)t * nb + b];
            for (int r = 0; r < NX; ++r)
                f[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(aw, _mm256_sign_epi8(x[r], w))), _mm256_set1_ps(d * dx[r]), f[t][r]);
        }
    }
    for (int t = 0; t < NW; ++t)
        for (int r = 0; r < NX; ++r) y[t + r * ldy] = out8(f[t][r]);
}

template <int NW>
inline void b32_tile_rows(int nx, const int8_t* q, const float* dq, int nb, const Act& a, int64_t i0, float* y, int64_t ldy) {
    switch (nx) {
        case 4: b32_tile<NW, 4>(q, dq, nb, a, i0, y, ldy); break;
        case 3: b32_tile<NW, 3>(q, dq, nb, a, i0, y, ldy); break;
        case 2: b32_tile<NW, 2>(q, dq, nb, a, i0, y, ldy); break;
        default: b32_tile<NW, 1>(q, dq, nb, a, i0, y, ldy); break;
    }
}

// Decoded weight rows [0, nr) (`q`, `dq`: linear.cpp's decode_b32_rows) against activation rows
// [a0, a1): y[i * ldy + r].
inline void dot_b32_tiled(const int8_t* q, const float* dq, int nr, int nb, const Act& a, int64_t a0, int64_t a1, float* y,
                          int64_t ldy) {
    for (int64_t i0 = a0; i0 < a1; i0 += 4) {
        const int nx = (int)std::min<int64_t>(4, a1 - i0);
        int t = 0;
        for (; t + 3 <= nr; t += 3) b32_tile_rows<3>(nx, q + (int64_t)t * nb * 32, dq + (int64_t)t * nb, nb, a, i0, y + i0 * ldy + t, ldy);
        for (; t < nr; ++t) b32_tile_rows<1>(nx, q + (int64_t)t * nb * 32, dq + (int64_t)t * nb, nb, a, i0, y + i0 * ldy + t, ldy);
    }
}

}  // namespace
}  // namespace spk
