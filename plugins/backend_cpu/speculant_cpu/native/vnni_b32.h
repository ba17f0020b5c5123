// The VNNI row kernels for the blocks of 32 with one fp16 scale (Q8_0, Q5_0, Q4_0): fp32
// accumulation in vector lanes, the same operations for every row. Templates on the block type
// and row count, instantiated by linear.cpp's dispatcher, so they stay in a header.
#pragma once
#include "kernels.h"
#include "unpack.h"

namespace spk SPK_HIDDEN {
namespace {  // internal to each file that includes it (see kernels.h)

inline float hsum128(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

// Blocks of 32 with one fp16 scale (Q8_0, Q5_0, Q4_0): decode to signed bytes, then the same
// sign trick llama.cpp uses (|w| as unsigned times x with w's sign) for VNNI's u8 x s8 product.
inline __m256i decode32(const BlockQ8_0& blk) { return _mm256_loadu_si256((const __m256i*)blk.qs); }

inline __m256i decode32(const BlockQ5_0& blk) {
    const __m128i qs = _mm_loadu_si128((const __m128i*)blk.qs);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(qs, m4)),
                                              _mm_and_si128(_mm_srli_epi16(qs, 4), m4), 1);
    uint32_t qh;
    std::memcpy(&qh, blk.qh, 4);
    const __m256i hi = _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10));
    return _mm256_sub_epi8(_mm256_or_si256(q, hi), _mm256_set1_epi8(16));
}

inline __m256i decode32(const BlockQ4_0& blk) {
    const __m128i qs = _mm_loadu_si128((const __m128i*)blk.qs);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(qs, m4)),
                                              _mm_and_si128(_mm_srli_epi16(qs, 4), m4), 1);
    return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
}

// NR activation rows against one weight row. Rows go in pairs, one zmm per pair (lanes 0-7 the
// first row's, 8-15 the second's), from the pair-interleaved copies Act::xp / Act::dp; an odd
// last row takes a ymm. Per row and lane these are the operations of the one-row form (the
// integer dot of 4 bytes, its conversion, the scale d * dx, one FMA into the lane), so the bits do
// not depend on the pairing. (AVX-512 has no vpsignb: x is negated under the mask of q < 0, which
// differs from vpsignb only where q == 0, and there |q| = 0 makes the product 0 either way.)
template <class Block, int NR>
void dot_b32(const Block* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NP = NR / 2;
    __m512 fp[NP > 0 ? NP : 1];
    __m256 fs = _mm256_setzero_ps();
    for (int p = 0; p < NP; ++p) fp[p] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        if (b % 2 == 0) prefetch(&w[b], 64);
        const __m256i q = decode32(w[b]);
        const __m256i aq = _mm256_abs_epi8(q);
        const float d = f16(w[b].d);
        if constexpr (NP > 0) {
            const __m512i aq2 = _mm512_inserti64x4(_mm512_castsi256_si512(aq), aq, 1);
            const __mmask64 neg = _mm512_movepi8_mask(_mm512_inserti64x4(_mm512_castsi256_si512(q), q, 1));
            const __m512 d2 = _mm512_set1_ps(d);
            for (int p = 0; p < NP; ++p) {
                const int64_t pb = (int64_t)((i0 >> 1) + p) * a.nb + b;
                const __m512i x = _mm512_loadu_si512(a.xp.data() + pb * 64);
                const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                const __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aq2, xs);
                fp[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d2, _mm512_loadu_ps(a.dp.data() + pb * 16)), fp[p]);
            }
        }
        if constexpr (NR % 2 == 1) {
            const int64_t ab = (int64_t)(i0 + NR - 1) * a.nb + b;
            const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(a.qs.data() + ab * 32)), q);
            const __m256i acc = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, xs);
            fs = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(d * a.d[ab]), fs);
        }
    }
    auto out = [](__m256 v) { return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); };
    for (int p = 0; p < NP; ++p) {
        y[(2 * p) * ldy] = out(_mm512_castps512_ps256(fp[p]));
        y[(2 * p + 1) * ldy] = out(_mm512_extractf32x8_ps(fp[p], 1));
    }
    if constexpr (NR % 2 == 1) y[(NR - 1) * ldy] = out(fs);
}

// Decode (one activation row): four weight rows at a time. dot_b32<Block, 1> is bound by the
// latency of its one fp32 accumulator chain (an FMA per block of 32 values); four rows give four
// independent chains. Each row's operations are dot_b32's, so the bits are the same.
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
            const __m256i acc = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
            fs[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(f16(w[t][b].d) * dx), fs[t]);
        }
        pf.next();
    }
    for (int t = 0; t < 4; ++t) y[t] = hsum128(_mm_add_ps(_mm256_castps256_ps128(fs[t]), _mm256_extractf128_ps(fs[t], 1)));
}

// Many activation rows of Q5_0 or Q4_0 (a draft model's prompt, a head's catch-up, such a
// target's prompt), as avx2_b32.h's dot_b32_tiled: the work item's weight rows decoded to signed
// bytes once (`q`, `dq`: [nr][nb][32] and [nr][nb], linear.cpp's decode_b32_rows), then tiles of NW weight rows by NP pairs of
// activation rows, each decoded block's abs and sign mask and each activation pair's load shared by
// the tile. Per (weight row, activation row) the operations of dot_b32 in its order (a pair's zmm
// from Act::xp / Act::dp, an odd last row's ymm with vpsignb), so the bits are the same; dot_b32
// decodes each weight block again for every 8 activation rows, most of its time for these types.
template <int NW, int NP>
inline void b32_tile_pairs(const int8_t* q, const float* dq, int nb, const Act& a, int64_t i0, float* y, int64_t ldy) {
    __m512 f[NW][NP];
    for (int t = 0; t < NW; ++t)
        for (int p = 0; p < NP; ++p) f[t][p] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m512i x[NP];
        __m512 dx[NP];
        for (int p = 0; p < NP; ++p) {
            const int64_t pb = ((i0 >> 1) + p) * a.nb + b;
            x[p] = _mm512_loadu_si512(a.xp.data() + pb * 64);
            dx[p] = _mm512_loadu_ps(a.dp.data() + pb * 16);
        }
        for (int t = 0; t < NW; ++t) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(q + ((int64_t)t * nb + b) * 32));
            const __m256i aw = _mm256_abs_epi8(w);
            const __m512i aw2 = _mm512_inserti64x4(_mm512_castsi256_si512(aw), aw, 1);
            const __mmask64 neg = _mm512_movepi8_mask(_mm512_inserti64x4(_mm512_castsi256_si512(w), w, 1));
            const __m512 d2 = _mm512_set1_ps(dq[(int64_t)t * nb + b]);
            for (int p = 0; p < NP; ++p) {
                const __m512i xs = _mm512_mask_sub_epi8(x[p], neg, _mm512_setzero_si512(), x[p]);
                const __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw2, xs);
                f[t][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d2, dx[p]), f[t][p]);
            }
        }
    }
    auto out = [](__m256 v) { return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))); };
    for (int t = 0; t < NW; ++t)
        for (int p = 0; p < NP; ++p) {
            y[t + (i0 + 2 * p) * ldy] = out(_mm512_castps512_ps256(f[t][p]));
            y[t + (i0 + 2 * p + 1) * ldy] = out(_mm512_extractf32x8_ps(f[t][p], 1));
        }
}

// One activation row (a call's odd last row) against NW decoded weight rows: dot_b32's ymm form.
template <int NW>
inline void b32_tile_odd(const int8_t* q, const float* dq, int nb, const Act& a, int64_t i, float* y) {
    __m256 f[NW];
    for (int t = 0; t < NW; ++t) f[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const int64_t ab = i * a.nb + b;
        const __m256i x = _mm256_loadu_si256((const __m256i*)(a.qs.data() + ab * 32));
        const float dx = a.d[ab];
        for (int t = 0; t < NW; ++t) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(q + ((int64_t)t * nb + b) * 32));
            const __m256i acc = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            f[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(dq[(int64_t)t * nb + b] * dx), f[t]);
        }
    }
    for (int t = 0; t < NW; ++t) y[t] = hsum128(_mm_add_ps(_mm256_castps256_ps128(f[t]), _mm256_extractf128_ps(f[t], 1)));
}

template <int NW>
inline void b32_tile_rows(int64_t n_rows, const int8_t* q, const float* dq, int nb, const Act& a, int64_t i0, float* y, int64_t ldy) {
    switch (n_rows >= 8 ? 4 : n_rows / 2) {
        case 4: b32_tile_pairs<NW, 4>(q, dq, nb, a, i0, y, ldy); break;
        case 3: b32_tile_pairs<NW, 3>(q, dq, nb, a, i0, y, ldy); break;
        case 2: b32_tile_pairs<NW, 2>(q, dq, nb, a, i0, y, ldy); break;
        case 1: b32_tile_pairs<NW, 1>(q, dq, nb, a, i0, y, ldy); break;
        default: b32_tile_odd<NW>(q, dq, nb, a, i0, y + i0 * ldy); break;
    }
}

// Decoded weight rows [0, nr) (`q`, `dq`) against activation rows [a0, a1), a0 even (the pairs
// of Act::xp start at even rows): y[i * ldy + r].
inline void dot_b32_tiled(const int8_t* q, const float* dq, int nr, int nb, const Act& a, int64_t a0, int64_t a1, float* y,
                          int64_t ldy) {
    for (int64_t i0 = a0; i0 < a1;) {
        const int64_t left = a1 - i0, take = left >= 8 ? 8 : left >= 2 ? left & ~int64_t(1) : 1;
        int t = 0;
        for (; t + 3 <= nr; t += 3) b32_tile_rows<3>(take, q + (int64_t)t * nb * 32, dq + (int64_t)t * nb, nb, a, i0, y + t, ldy);
        for (; t < nr; ++t) b32_tile_rows<1>(take, q + (int64_t)t * nb * 32, dq + (int64_t)t * nb, nb, a, i0, y + t, ldy);
        i0 += take;
    }
}

}  // namespace
}  // namespace spk
