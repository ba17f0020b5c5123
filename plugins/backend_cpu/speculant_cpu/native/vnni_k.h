// The VNNI row kernels for the K-quants (Q4_K, Q6_K): one weight row against NR activation rows,
// or four weight rows against one or two (decode): the integer sums reduced per block, then the
// canonical epilogue (epilogue.h). Templates on the row count, instantiated by linear.cpp's
// dispatcher, so they stay in a header.
#pragma once
#include "epilogue.h"
#include "kernels.h"
#include "unpack.h"
#include "w4_ymm.h"

namespace spk SPK_HIDDEN {
namespace {  // internal to each file that includes it (see kernels.h)

// The Q4_K activations in quantize.cpp's q4k_order, which lines them up with q4k_values' zmm.
constexpr bool Q4K_ACT_INTERLEAVED = true;

inline __m128i fold512(__m512i v) {
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Lane t: the sum of the int32 lanes of v[t] (the four reduced together).
inline __m128i hsum4(const __m512i v[4]) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
    return fold512(_mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd)));
}

// The integer core shared by the Q4_K/Q6_K VNNI kernels: four zmm of unsigned weight values
// times four zmm of activations, pairs summed and weighted by their int16 scales into int32 lanes.
inline __m512i scaled_dot4(const __m512i q[4], const __m512i sc[4], const __m512i x[4]) {
    __m512i v = _mm512_madd_epi16(_mm512_maddubs_epi16(q[0], x[0]), sc[0]);
    v = _mm512_dpwssd_epi32(v, _mm512_maddubs_epi16(q[1], x[1]), sc[1]);
    v = _mm512_dpwssd_epi32(v, _mm512_maddubs_epi16(q[2], x[2]), sc[2]);
    return _mm512_dpwssd_epi32(v, _mm512_maddubs_epi16(q[3], x[3]), sc[3]);
}

inline void load_x4(const int8_t* xq, __m512i x[4]) {
    for (int z = 0; z < 4; ++z) x[z] = _mm512_loadu_si512(xq + 64 * z);
}

// The epilogue runs on four activation rows at once, lane-wise (the same operations as the scalar
// form, so the same results as the AMX kernel's lanes).
template <int NR>
void dot_q4k(const BlockQ4K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NG = (NR + 3) / 4;
    __m128 s[NG], sn[NG];  // the FMA chains of the scales and of the mins
    for (int g = 0; g < NG; ++g) s[g] = sn[g] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ4K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ4K));
        const float d = f16(blk.d), dmin = f16(blk.dmin);
        // spread the scales with one permute per zmm
        const __m256i sm = _mm256_cvtepu8_epi16(q4k_scales(blk));
        const __m512i smz = _mm512_castsi256_si512(sm);
        const __m512i sc[4] = {_mm512_permutexvar_epi16(Q4.idx[0], smz), _mm512_permutexvar_epi16(Q4.idx[1], smz),
                               _mm512_permutexvar_epi16(Q4.idx[2], smz), _mm512_permutexvar_epi16(Q4.idx[3], smz)};
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        __m512i q[4];
        q4k_values(blk, q);
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) {
            __m512i acc[4];
            __m128i mm[4];
            float dx[4];
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) {
                const int i = 4 * g + t;
                if (i >= NR) {
                    acc[t] = _mm512_setzero_si512();
                    mm[t] = _mm_setzero_si128();
                    dx[t] = 0.f;
                    continue;
                }
                const int64_t ab = (int64_t)(i0 + i) * a.nb + b;
                const int8_t* xq = a.qs.data() + ab * 256;
                __m512i x[4];
                load_x4(xq, x);
                acc[t] = scaled_dot4(q, sc, x);
                mm[t] = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)(a.bs32.data() + ab * 8)));
                dx[t] = a.d[ab];
            }
            epilogue_q4k(s[g], sn[g], _mm_set1_ps(d), _mm_set1_ps(dmin), _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]), hsum4(acc), hsum4(mm));
        }
    }
    for (int i = 0; i < NR; ++i) {
        alignas(16) float out[4];
        _mm_store_ps(out, _mm_sub_ps(s[i / 4], sn[i / 4]));
        y[i * ldy] = out[i % 4];
    }
}

// Prompt rows, as llama.cpp's repacked Q4_K gemm computes them (the rows of a prompt batch in
// whole groups of four): the FMA chains take one step per pair of sub-blocks (0,1), (2,3), (4,5),
// (6,7) instead of one per block. The integers are the same; zmm z of q4k_values holds sub-blocks
// (0,2), (1,3), (4,6), (5,7) in its low and high eight lanes, so z0 + z1 gives pairs 0 and 1 in
// its halves and z2 + z3 pairs 2 and 3.
template <int NR>
void dot_q4k_pairs(const BlockQ4K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NG = (NR + 3) / 4;
    __m128 s[NG], sn[NG];
    for (int g = 0; g < NG; ++g) s[g] = sn[g] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ4K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ4K));
        const float d = f16(blk.d), dmin = f16(blk.dmin);
        const __m256i sm = _mm256_cvtepu8_epi16(q4k_scales(blk));
        const __m512i smz = _mm512_castsi256_si512(sm);
        const __m512i sc[4] = {_mm512_permutexvar_epi16(Q4.idx[0], smz), _mm512_permutexvar_epi16(Q4.idx[1], smz),
                               _mm512_permutexvar_epi16(Q4.idx[2], smz), _mm512_permutexvar_epi16(Q4.idx[3], smz)};
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        __m512i q[4];
        q4k_values(blk, q);
        for (int g = 0; g < NG; ++g) {
            __m512i part[4][4];  // [pair][row of the group]: the pair's lanes, the others zero
            __m128i mm[4];       // lane j: pair j's mins times block sums
            float dx[4];
            for (int t = 0; t < 4; ++t) {
                const int i = 4 * g + t;
                if (i >= NR) {
                    for (int j = 0; j < 4; ++j) part[j][t] = _mm512_setzero_si512();
                    mm[t] = _mm_setzero_si128();
                    dx[t] = 0.f;
                    continue;
                }
                const int64_t ab = (int64_t)(i0 + i) * a.nb + b;
                __m512i x[4];
                load_x4(a.qs.data() + ab * 256, x);
                const __m512i lo = _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(q[0], x[0]), sc[0]),
                                                       _mm512_maddubs_epi16(q[1], x[1]), sc[1]);
                const __m512i hi = _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(q[2], x[2]), sc[2]),
                                                       _mm512_maddubs_epi16(q[3], x[3]), sc[3]);
                part[0][t] = _mm512_maskz_mov_epi32(0x00FF, lo);
                part[1][t] = _mm512_maskz_mov_epi32(0xFF00, lo);
                part[2][t] = _mm512_maskz_mov_epi32(0x00FF, hi);
                part[3][t] = _mm512_maskz_mov_epi32(0xFF00, hi);
                mm[t] = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)(a.bs32.data() + ab * 8)));
                dx[t] = a.d[ab];
            }
            // mm transposed: lane t of mt[j] is row t's pair j
            const __m128i u0 = _mm_unpacklo_epi32(mm[0], mm[1]), u1 = _mm_unpackhi_epi32(mm[0], mm[1]);
            const __m128i u2 = _mm_unpacklo_epi32(mm[2], mm[3]), u3 = _mm_unpackhi_epi32(mm[2], mm[3]);
            const __m128i mt[4] = {_mm_unpacklo_epi64(u0, u2), _mm_unpackhi_epi64(u0, u2),
                                   _mm_unpacklo_epi64(u1, u3), _mm_unpackhi_epi64(u1, u3)};
            const __m128 dxv = _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]);
            for (int j = 0; j < 4; ++j)
                epilogue_q4k(s[g], sn[g], _mm_set1_ps(d), _mm_set1_ps(dmin), dxv, hsum4(part[j]), mt[j]);
        }
    }
    for (int i = 0; i < NR; ++i) {
        alignas(16) float out[4];
        _mm_store_ps(out, _mm_sub_ps(s[i / 4], sn[i / 4]));
        y[i * ldy] = out[i % 4];
    }
}

template <int NR>
void dot_q6k(const BlockQ6K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    __m256 s[NR];
    for (int i = 0; i < NR; ++i) s[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ6K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ6K));
        const float d = f16(blk.d);
        __m512i q[4];
        q6k_values(blk, q);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)blk.scales));
        const __m512i sc16z = _mm512_castsi256_si512(sc16);
        __m512i sg[4];
        for (int g = 0; g < 4; ++g) sg[g] = _mm512_permutexvar_epi16(Q6.idx[g], sc16z);
        for (int i = 0; i < NR; ++i) {
            const int64_t ab = (int64_t)(i0 + i) * a.nb + b;
            const int8_t* xq = a.qs.data() + ab * 256;
            __m512i x[4];
            load_x4(xq, x);
            const __m512i v = scaled_dot4(q, sg, x);
            // The stored values are q + 32: subtract 32 * sum_g scale_g * sum(x in group g).
            const __m256i bs = _mm256_loadu_si256((const __m256i*)(a.bs16.data() + ab * 16));
            const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            s[i] = epilogue_q6k(s[i], a.d[ab] * d, _mm512_sub_epi32(v, _mm512_zextsi256_si512(corr)));
        }
    }
    for (int i = 0; i < NR; ++i) y[i * ldy] = hsum8(s[i]);
}

// Q6_K with one integer sum per block, four rows per xmm (the AMX kernel's lanes), then the
// epilogue of the arithmetic: TILED, llama.cpp's tiled matmul for the rows of a prompt batch of
// eight rows or more, acc = fma((float)isum * d, dx, acc); else the canonical one, for rows
// past LLAMA_SPLIT_KV (and long prompts), acc + (d * dx) * isum.
template <int NR, bool TILED>
void dot_q6k_one_sum(const BlockQ6K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NG = (NR + 3) / 4;
    __m128 s[NG];
    for (int g = 0; g < NG; ++g) s[g] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ6K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ6K));
        const float d = f16(blk.d);
        __m512i q[4];
        q6k_values(blk, q);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)blk.scales));
        const __m512i sc16z = _mm512_castsi256_si512(sc16);
        __m512i sg[4];
        for (int g = 0; g < 4; ++g) sg[g] = _mm512_permutexvar_epi16(Q6.idx[g], sc16z);
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) {
            __m512i acc[4];
            float dx[4];
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) {
                const int i = 4 * g + t;
                if (i >= NR) {
                    acc[t] = _mm512_setzero_si512();
                    dx[t] = 0.f;
                    continue;
                }
                const int64_t ab = (int64_t)(i0 + i) * a.nb + b;
                const int8_t* xq = a.qs.data() + ab * 256;
                __m512i x[4];
                load_x4(xq, x);
                const __m512i v = scaled_dot4(q, sg, x);
                // The stored values are q + 32: subtract 32 * sum_g scale_g * sum(x in group g).
                const __m256i bs = _mm256_loadu_si256((const __m256i*)(a.bs16.data() + ab * 16));
                const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
                acc[t] = _mm512_sub_epi32(v, _mm512_zextsi256_si512(corr));
                dx[t] = a.d[ab];
            }
            const __m128 dxv = _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]);
            s[g] = TILED ? epilogue_q6k_tiled(s[g], _mm_set1_ps(d), dxv, hsum4(acc)) : epilogue_q6k_canon(s[g], _mm_set1_ps(d), dxv, hsum4(acc));
        }
    }
    for (int i = 0; i < NR; ++i) {
        alignas(16) float out[4];
        _mm_store_ps(out, s[i / 4]);
        y[i * ldy] = out[i % 4];
    }
}

// Q4.idx for the int16 scales of the row in the upper half of a zmm of two rows' scales.
struct Q4HiIdx {
    __m512i idx[4];
    Q4HiIdx() {
        for (int z = 0; z < 4; ++z) idx[z] = _mm512_add_epi16(Q4.idx[z], _mm512_set1_epi16(16));
    }
};
const Q4HiIdx Q4Hi;

// The headers (d | dmin and the 12 scale bytes) of block b of four weight rows unpacked together,
// lane-wise as q4k_scales: w[h] holds rows 2h and 2h + 1's [sc0..sc7, mn0..mn7] as int16 (one per
// 256-bit half); d and dmin the rows' scales. A scalar unpack per row cost a quarter of the
// kernel's time at one row.
struct Q4Headers4 {
    __m512i w[2];
    __m128 d, dmin;
    Q4Headers4(const uint8_t* row, size_t row_bytes, int b) {
        const uint8_t* h0 = row + (size_t)b * sizeof(BlockQ4K);
        const uint8_t* const h[4] = {h0, h0 + row_bytes, h0 + 2 * row_bytes, h0 + 3 * row_bytes};
        __m512i H;
        const __m512i s8 = q4k_headers4(h, H);
        w[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(s8));
        w[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(s8, 1));
        // the four d | dmin dwords, their halves regrouped as (d0..d3, dmin0..dmin3)
        const __m128i dd = _mm512_castsi512_si128(_mm512_maskz_compress_epi32(0x1111, H));
        const __m256 f = _mm256_cvtph_ps(_mm_shuffle_epi8(dd, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)));
        d = _mm256_castps256_ps128(f);
        dmin = _mm256_extractf128_ps(f, 1);
    }
    void scales(int t, __m512i sc[4]) const {  // row t's int16 scale of each byte pair, per zmm of values
        const __m512i* idx = (t & 1) ? Q4Hi.idx : Q4.idx;
        for (int z = 0; z < 4; ++z) sc[z] = _mm512_permutexvar_epi16(idx[z], w[t / 2]);
    }
    __m128i mins(int t) const {  // row t's eight int16 mins
        return (t & 1) ? _mm512_extracti32x4_epi32(w[t / 2], 3) : _mm512_extracti32x4_epi32(w[t / 2], 1);
    }
};

// One activation row against four weight rows (decode): the four outputs' integer sums are
// reduced together, one transpose-reduce for four results instead of one per result, and the
// canonical epilogue runs on them lane-wise (lane t: weight row t). Per output the same IEEE
// operations in the same order as the kernels above, so the bits are the same.
// R activation rows (1: decode; 2 or 3: a short draft's verification, see linear.cpp) against
// four weight rows, each weight block decoded once for all R. Output y[(i0 + r) * ldy + t] for
// weight row t.
template <int R>
void dot_q4k_w4_rows(const uint8_t* row, size_t row_bytes, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    __m128 s[R], sn[R];
    for (int r = 0; r < R; ++r) s[r] = sn[r] = _mm_setzero_ps();
    W4Prefetch pf(row, row_bytes, nb, sizeof(BlockQ4K));
    for (int b = 0; b < nb; ++b) {
        __m512i x[R][4];
        __m128i bs[R];
        for (int r = 0; r < R; ++r) {
            const int64_t ab = (int64_t)(i0 + r) * a.nb + b;
            load_x4(a.qs.data() + ab * 256, x[r]);
            bs[r] = _mm_loadu_si128((const __m128i*)(a.bs32.data() + ab * 8));
        }
        const Q4Headers4 hd(row, row_bytes, b);
        __m512i acc[R][4];
        __m128i mm[R][4];
        for (int t = 0; t < 4; ++t) {
            const BlockQ4K& blk = ((const BlockQ4K*)(row + t * row_bytes))[b];
            pf.fetch(t, sizeof(BlockQ4K));
            __m512i sc[4];
            hd.scales(t, sc);
            __m512i q[4];
            q4k_values(blk, q);
            const __m128i mins = hd.mins(t);
            for (int r = 0; r < R; ++r) {
                acc[r][t] = scaled_dot4(q, sc, x[r]);
                mm[r][t] = _mm_madd_epi16(mins, bs[r]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t ab = (int64_t)(i0 + r) * a.nb + b;
            epilogue_q4k(s[r], sn[r], hd.d, hd.dmin, _mm_set1_ps(a.d[ab]), hsum4(acc[r]), hsum4(mm[r]));
        }
        pf.next();
    }
    for (int r = 0; r < R; ++r) _mm_storeu_ps(y + (i0 + r) * ldy, _mm_sub_ps(s[r], sn[r]));
}

// linear.cpp's Q4_K kernel for R = 1-3 activation rows from i0 (decode, a one- or two-token
// draft's verification): weight rows r.. of W four at a time while four remain; returns the first
// row left to the per-row kernels. Output y[(i0 + i) * ldy + row], as every ISA's.
template <int R>
inline int64_t dot_q4k_few_rows(const uint8_t* W, size_t row_bytes, int64_t r, int64_t r1, int nb, const Act& a, int i0,
                                float* y, int64_t ldy) {
    if (R == 1 && g_w4_ymm) {
        for (; r + 4 <= r1; r += 4) dot_q4k_w4_one<Q4K_ACT_INTERLEAVED>(W + r * row_bytes, row_bytes, nb, a, i0, y + i0 * ldy + r);
        return r;
    }
    for (; r + 4 <= r1; r += 4) dot_q4k_w4_rows<R>(W + r * row_bytes, row_bytes, nb, a, i0, y + r, ldy);
    return r;
}

}  // namespace
}  // namespace spk
