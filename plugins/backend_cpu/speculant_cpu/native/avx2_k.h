// The AVX2 row kernels for the K-quants (Q4_K, Q6_K): vnni_k.h's functions, same names and
// signatures, on ymm (AVX-VNNI's vpdpwssd where the build has it, vpmaddwd + vpaddd otherwise).
// Each computes the same exact integer sums as its zmm counterpart, only spread over other lanes
// before they are reduced (integer sums: the spread does not change them), and then runs the same
// epilogue (epilogue.h) on them, so the results are the AVX-512 kernels' bit for bit. Q6_K's eight
// lane sums for llama.cpp's decode arithmetic come out lane for lane as there: lane l holds the
// 4-value groups g with g % 8 == l, less 32 * (sc_2l * bsum16_2l + sc_2l+1 * bsum16_2l+1), which
// is how llama.cpp's own AVX2 ggml_vec_dot_q6_K_q8_K computes them.
//
// Layout: a ymm of a Q4_K block's packed bytes 32p .. 32p+31 holds sub-block 2p (values 64p ..
// 64p+31) in its low nibbles and 2p+1 in its high ones, so the activations stay in natural order
// (Q4K_ACT_INTERLEAVED false: quantize.cpp's q4k_order is for the zmm kernels). A Q6_K block is
// eight ymm of 32 values in natural order (llama.cpp's AVX2 unpacking).
#pragma once
#include "epilogue.h"
#include "kernels.h"
#include "unpack.h"
#include "w4_ymm.h"

namespace spk SPK_HIDDEN {
namespace {  // internal to each file that includes it (see kernels.h)

constexpr bool Q4K_ACT_INTERLEAVED = false;

// pshufb controls. Q4_K: every int16 lane of ymm j <- byte j, zero-extended (sub-block scale j
// from a block's [sc0..sc7, mn0..mn7] in both 128-bit lanes). Q6_K (on the 16 scale bytes):
// bytes 0-7 <- scale 2k, 8-15 <- scale 2k+1, for ymm k's two 16-value groups.
struct Shuffles {
    __m256i q4[8];
    __m128i q6[8];
    Shuffles() {
        for (int j = 0; j < 8; ++j) {
            alignas(32) int8_t v[32];
            for (int t = 0; t < 16; ++t) {
                v[2 * t] = (int8_t)j;
                v[2 * t + 1] = (int8_t)0x80;
            }
            q4[j] = _mm256_load_si256((const __m256i*)v);
            for (int t = 0; t < 16; ++t) v[t] = (int8_t)(2 * j + t / 8);
            q6[j] = _mm_load_si128((const __m128i*)v);
        }
    }
};
const Shuffles SHUF;

// A Q4_K block's scales: the bytes [sc0..sc7, mn0..mn7] in both lanes, and the mins as int16.
struct Q4Scales {
    __m256i sc;
    __m128i mins;
};
inline Q4Scales q4k_scales2(const BlockQ4K& blk) {
    const __m128i s = q4k_scales(blk);
    return {_mm256_broadcastsi128_si256(s), _mm_cvtepu8_epi16(_mm_srli_si128(s, 8))};
}

// Per activation row r: pair p (sub-blocks 2p and 2p+1) of sum_j sc_j * (q_j . x_j) in the
// int32 lanes of part[r][p] when PAIRS, else the whole block's in part[r][0].
// (Always inlined: called out of line, as GCC chose for the one-sum kernels' several row counts,
// the sums go through memory: Q6_K canonical rows at 4 rows took twice dot_q6k<4>'s time.)
template <int R, bool PAIRS>
__attribute__((always_inline)) inline void q4k_dots(const BlockQ4K& blk, const __m256i sc, const int8_t* const* xq, __m256i (*part)[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < (PAIRS ? 4 : 1); ++p) part[r][p] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
        const __m256i q = load256(blk.qs + 32 * p);
        const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        const __m256i slo = _mm256_shuffle_epi8(sc, SHUF.q4[2 * p]), shi = _mm256_shuffle_epi8(sc, SHUF.q4[2 * p + 1]);
        for (int r = 0; r < R; ++r) {
            __m256i& acc = part[r][PAIRS ? p : 0];
            acc = dpwssd(acc, _mm256_maddubs_epi16(lo, load256(xq[r] + 64 * p)), slo);
            acc = dpwssd(acc, _mm256_maddubs_epi16(hi, load256(xq[r] + 64 * p + 32)), shi);
            if constexpr (R >= 3) asm("" : "+x"(acc));  // in order: regrouped, the products spill (fewer rows: the chains are the limit)
        }
    }
}

// Per activation row r: v[r]'s lane l = the 4-value groups g % 8 == l of sum sc * q * x (the
// stored values, q + 32), less 32 * (sc_2l * bsum16_2l + sc_2l+1 * bsum16_2l+1).
template <int R>
__attribute__((always_inline)) inline void q6k_dots(const BlockQ6K& blk, const int8_t* const* xq, const int16_t* const* bs, __m256i* v) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    const __m128i sc8 = _mm_loadu_si128((const __m128i*)blk.scales);
    for (int r = 0; r < R; ++r) v[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
        const __m256i qh = load256(blk.qh + 32 * h);
        const __m256i l0 = load256(blk.ql + 64 * h), l1 = load256(blk.ql + 64 * h + 32);
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4))};
        for (int c = 0; c < 4; ++c) {
            const int k = 4 * h + c;  // values 32k .. 32k + 31
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, SHUF.q6[k]));
            for (int r = 0; r < R; ++r) {
                v[r] = dpwssd(v[r], _mm256_maddubs_epi16(q[c], load256(xq[r] + 32 * k)), sc);
                if constexpr (R >= 3) asm("" : "+x"(v[r]));  // as in q4k_dots
            }
        }
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    for (int r = 0; r < R; ++r)
        v[r] = _mm256_sub_epi32(v[r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, load256(bs[r])), 5));
}

// NR activation rows against one weight row; the epilogue four activation rows per xmm.
template <int NR>
void dot_q4k(const BlockQ4K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NG = (NR + 3) / 4;
    __m128 s[NG], sn[NG];  // the FMA chains of the scales and of the mins
    for (int g = 0; g < NG; ++g) s[g] = sn[g] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ4K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ4K));
        const float d = f16(blk.d), dmin = f16(blk.dmin);
        const Q4Scales sc = q4k_scales2(blk);
        // More than four rows (5-8: a verification of a 4-7 token draft, every group of a
        // prompt but its last) share one pass over the block's values: its nibbles split and
        // its scales spread once, not once a group of four. (5-7 rows had taken a second pass for
        // the rows past four: 5 rows cost 1.73x what 4 did on a Zen 3, gate/up from memory.)
        constexpr int NS = NR > 4 ? NR : 1;
        __m256i partn[NS][4];
        if constexpr (NR > 4) {
            const int8_t* xqn[NS];
            for (int t = 0; t < NS; ++t) xqn[t] = a.qs.data() + ((int64_t)(i0 + t) * a.nb + b) * 256;
            q4k_dots<NS, false>(blk, sc.sc, xqn, partn);
        }
        for (int g = 0; g < NG; ++g) {
            const int rows = std::min(4, NR - 4 * g);
            const int8_t* xq[4];
            __m256i part[4][4];
            __m256i acc[4];
            __m128i mm[4];
            float dx[4];
            for (int t = 0; t < 4; ++t) xq[t] = a.qs.data() + ((int64_t)(i0 + 4 * g + std::min(t, rows - 1)) * a.nb + b) * 256;
            if constexpr (NR > 4) {
                for (int t = 0; t < 4; ++t) part[t][0] = partn[4 * g + std::min(t, rows - 1)][0];
            } else if (rows == 4) q4k_dots<4, false>(blk, sc.sc, xq, part);
            else if (rows == 3) q4k_dots<3, false>(blk, sc.sc, xq, part);
            else if (rows == 2) q4k_dots<2, false>(blk, sc.sc, xq, part);
            else q4k_dots<1, false>(blk, sc.sc, xq, part);
            for (int t = 0; t < 4; ++t) {
                if (t >= rows) {
                    acc[t] = _mm256_setzero_si256();
                    mm[t] = _mm_setzero_si128();
                    dx[t] = 0.f;
                    continue;
                }
                const int64_t ab = (int64_t)(i0 + 4 * g + t) * a.nb + b;
                acc[t] = part[t][0];
                mm[t] = _mm_madd_epi16(sc.mins, _mm_loadu_si128((const __m128i*)(a.bs32.data() + ab * 8)));
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

// Prompt rows, as llama.cpp's repacked Q4_K gemm computes them: the FMA chains take one step per
// pair of sub-blocks (0,1), (2,3), (4,5), (6,7), which here is one ymm of packed bytes each.
template <int NR>
void dot_q4k_pairs(const BlockQ4K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NG = (NR + 3) / 4;
    __m128 s[NG], sn[NG];
    for (int g = 0; g < NG; ++g) s[g] = sn[g] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ4K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ4K));
        const float d = f16(blk.d), dmin = f16(blk.dmin);
        const Q4Scales sc = q4k_scales2(blk);
        for (int g = 0; g < NG; ++g) {
            const int rows = std::min(4, NR - 4 * g);
            const int8_t* xq[4];
            __m256i part[4][4];  // [row of the group][pair]
            for (int t = 0; t < 4; ++t) xq[t] = a.qs.data() + ((int64_t)(i0 + 4 * g + std::min(t, rows - 1)) * a.nb + b) * 256;
            if (rows == 4) q4k_dots<4, true>(blk, sc.sc, xq, part);
            else if (rows == 3) q4k_dots<3, true>(blk, sc.sc, xq, part);
            else if (rows == 2) q4k_dots<2, true>(blk, sc.sc, xq, part);
            else q4k_dots<1, true>(blk, sc.sc, xq, part);
            __m128i mm[4];  // lane j: pair j's mins times block sums
            float dx[4];
            for (int t = 0; t < 4; ++t) {
                if (t >= rows) {
                    for (int j = 0; j < 4; ++j) part[t][j] = _mm256_setzero_si256();
                    mm[t] = _mm_setzero_si128();
                    dx[t] = 0.f;
                    continue;
                }
                const int64_t ab = (int64_t)(i0 + 4 * g + t) * a.nb + b;
                mm[t] = _mm_madd_epi16(sc.mins, _mm_loadu_si128((const __m128i*)(a.bs32.data() + ab * 8)));
                dx[t] = a.d[ab];
            }
            // mm transposed: lane t of mt[j] is row t's pair j
            const __m128i u0 = _mm_unpacklo_epi32(mm[0], mm[1]), u1 = _mm_unpackhi_epi32(mm[0], mm[1]);
            const __m128i u2 = _mm_unpacklo_epi32(mm[2], mm[3]), u3 = _mm_unpackhi_epi32(mm[2], mm[3]);
            const __m128i mt[4] = {_mm_unpacklo_epi64(u0, u2), _mm_unpackhi_epi64(u0, u2),
                                   _mm_unpacklo_epi64(u1, u3), _mm_unpackhi_epi64(u1, u3)};
            const __m128 dxv = _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]);
            for (int j = 0; j < 4; ++j) {
                const __m256i pj[4] = {part[0][j], part[1][j], part[2][j], part[3][j]};
                epilogue_q4k(s[g], sn[g], _mm_set1_ps(d), _mm_set1_ps(dmin), dxv, hsum4(pj), mt[j]);
            }
        }
    }
    for (int i = 0; i < NR; ++i) {
        alignas(16) float out[4];
        _mm_store_ps(out, _mm_sub_ps(s[i / 4], sn[i / 4]));
        y[i * ldy] = out[i % 4];
    }
}

// llama.cpp's decode arithmetic: eight lane chains per (weight row, activation row).
template <int NR>
void dot_q6k(const BlockQ6K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    __m256 s[NR];
    for (int i = 0; i < NR; ++i) s[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ6K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ6K));
        const float d = f16(blk.d);
        const int8_t* xq[NR];
        const int16_t* bs[NR];
        for (int i = 0; i < NR; ++i) {
            const int64_t ab = (int64_t)(i0 + i) * a.nb + b;
            xq[i] = a.qs.data() + ab * 256;
            bs[i] = a.bs16.data() + ab * 16;
        }
        __m256i v[NR];
        q6k_dots<NR>(blk, xq, bs, v);
        for (int i = 0; i < NR; ++i) s[i] = epilogue_q6k(s[i], a.d[(int64_t)(i0 + i) * a.nb + b] * d, v[i]);
    }
    for (int i = 0; i < NR; ++i) y[i * ldy] = hsum8(s[i]);
}

// Q6_K with one integer sum per block, four rows per xmm, then the epilogue of the arithmetic:
// TILED, llama.cpp's tiled matmul, acc = fma((float)isum * d, dx, acc); else the canonical one,
// acc + (d * dx) * isum.
template <int NR, bool TILED>
void dot_q6k_one_sum(const BlockQ6K* w, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NG = (NR + 3) / 4;
    __m128 s[NG];
    for (int g = 0; g < NG; ++g) s[g] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const BlockQ6K& blk = w[b];
        prefetch(&blk, sizeof(BlockQ6K));
        const float d = f16(blk.d);
        // More than four rows share one decode of the block (as dot_q4k's), their sums read in
        // place, groups of four padded with zeros: copied into a group's array, the halves GCC
        // stores them in are read back as ymm, a failed store forward per sum (8 rows took 2.2x
        // the time of 7 on the output head).
        constexpr bool SHARED = NR > 4;
        __m256i accn[SHARED ? 4 * NG : 1];
        if constexpr (SHARED) {
            const int8_t* xqn[NR];
            const int16_t* bsn[NR];
            for (int t = 0; t < NR; ++t) {
                const int64_t ab = (int64_t)(i0 + t) * a.nb + b;
                xqn[t] = a.qs.data() + ab * 256;
                bsn[t] = a.bs16.data() + ab * 16;
            }
            q6k_dots<NR>(blk, xqn, bsn, accn);
            for (int t = NR; t < 4 * NG; ++t) accn[t] = _mm256_setzero_si256();
        }
        for (int g = 0; g < NG; ++g) {
            const int rows = std::min(4, NR - 4 * g);
            __m256i acc[4];
            const __m256i* sums = acc;
            if constexpr (SHARED) {
                sums = accn + 4 * g;
            } else {
                const int8_t* xq[4];
                const int16_t* bs[4];
                for (int t = 0; t < 4; ++t) {
                    const int64_t ab = (int64_t)(i0 + 4 * g + std::min(t, rows - 1)) * a.nb + b;
                    xq[t] = a.qs.data() + ab * 256;
                    bs[t] = a.bs16.data() + ab * 16;
                }
                if (rows == 4) q6k_dots<4>(blk, xq, bs, acc);
                else if (rows == 3) q6k_dots<3>(blk, xq, bs, acc);
                else if (rows == 2) q6k_dots<2>(blk, xq, bs, acc);
                else q6k_dots<1>(blk, xq, bs, acc);
                for (int t = rows; t < 4; ++t) acc[t] = _mm256_setzero_si256();
            }
            float dx[4];
            for (int t = 0; t < 4; ++t) dx[t] = t < rows ? a.d[(int64_t)(i0 + 4 * g + t) * a.nb + b] : 0.f;
            const __m128 dxv = _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]);
            s[g] = TILED ? epilogue_q6k_tiled(s[g], _mm_set1_ps(d), dxv, hsum4(sums)) : epilogue_q6k_canon(s[g], _mm_set1_ps(d), dxv, hsum4(sums));
        }
    }
    for (int i = 0; i < NR; ++i) {
        alignas(16) float out[4];
        _mm_store_ps(out, s[i / 4]);
        y[i * ldy] = out[i % 4];
    }
}

// Decode arithmetic, R = 2 or 3 activation rows (a one- or two-token draft's verification)
// against two weight rows: each block's values unpacked once for all R rows, the sums' epilogue in
// xmm of four (lane 2i + t: activation row i, weight row t). AVX-512's four weight rows
// (dot_q4k_w4_rows) need twice the registers the 16 ymm have (its ymm port spilled and was slower on
// a Zen 3); two fit. The per-row kernels (dot_q4k<R>) unpack each block for one weight row and pay a
// four-lane epilogue a weight row.
template <int R>
void dot_q4k_w2_rows(const uint8_t* row, size_t row_bytes, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    constexpr int NL = (2 * R + 3) / 4;  // xmm of four sums
    __m128 s[NL], sn[NL];
    for (int g = 0; g < NL; ++g) s[g] = sn[g] = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int b = 0; b < nb; ++b) {
        const BlockQ4K* blk[2] = {(const BlockQ4K*)row + b, (const BlockQ4K*)(row + row_bytes) + b};
        prefetch(blk[0], sizeof(BlockQ4K));
        prefetch(blk[1], sizeof(BlockQ4K));
        const Q4Scales sc[2] = {q4k_scales2(*blk[0]), q4k_scales2(*blk[1])};
        const float dw[2] = {f16(blk[0]->d), f16(blk[1]->d)}, dminw[2] = {f16(blk[0]->dmin), f16(blk[1]->dmin)};
        int64_t ab[R];
        const int8_t* xq[R];
        for (int i = 0; i < R; ++i) {
            ab[i] = (int64_t)(i0 + i) * a.nb + b;
            xq[i] = a.qs.data() + ab[i] * 256;
        }
        __m256i acc[4 * NL];
        for (int k = 0; k < 4 * NL; ++k) acc[k] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p)
            for (int t = 0; t < 2; ++t) {
                const __m256i q = load256(blk[t]->qs + 32 * p);
                const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                const __m256i slo = _mm256_shuffle_epi8(sc[t].sc, SHUF.q4[2 * p]), shi = _mm256_shuffle_epi8(sc[t].sc, SHUF.q4[2 * p + 1]);
                for (int i = 0; i < R; ++i) {
                    __m256i& v = acc[2 * i + t];
                    v = dpwssd(v, _mm256_maddubs_epi16(lo, load256(xq[i] + 64 * p)), slo);
                    v = dpwssd(v, _mm256_maddubs_epi16(hi, load256(xq[i] + 64 * p + 32)), shi);
                    asm("" : "+x"(v));  // in order, as q4k_dots
                }
            }
        __m128i mm[4 * NL];
        float d[4 * NL], dmin[4 * NL], dx[4 * NL];
        for (int k = 0; k < 4 * NL; ++k) {
            const int i = k / 2, t = k % 2;
            if (i >= R) {
                mm[k] = _mm_setzero_si128();
                d[k] = dmin[k] = dx[k] = 0.f;
                continue;
            }
            mm[k] = _mm_madd_epi16(sc[t].mins, _mm_loadu_si128((const __m128i*)(a.bs32.data() + ab[i] * 8)));
            d[k] = dw[t];
            dmin[k] = dminw[t];
            dx[k] = a.d[ab[i]];
        }
        for (int g = 0; g < NL; ++g)
            epilogue_q4k(s[g], sn[g], _mm_loadu_ps(d + 4 * g), _mm_loadu_ps(dmin + 4 * g), _mm_loadu_ps(dx + 4 * g), hsum4(acc + 4 * g),
                         hsum4(mm + 4 * g));
    }
    for (int g = 0; g < NL; ++g) {
        alignas(16) float out[4];
        _mm_store_ps(out, _mm_sub_ps(s[g], sn[g]));
        for (int k = 4 * g; k < std::min(4 * g + 4, 2 * R); ++k) y[(k / 2) * ldy + k % 2] = out[k % 4];
    }
}

// linear.cpp's Q4_K kernel for R = 1-3 activation rows from i0, as vnni_k.h's: decode four weight
// rows a call (dot_q4k_w4_one), a one- or two-token draft's verification two (dot_q4k_w2_rows:
// AVX-512's four need twice the 16 ymm). Weight rows r.. of W while a whole group remains;
// returns the first row left to the per-row kernels. Output y[(i0 + i) * ldy + row].
template <int R>
inline int64_t dot_q4k_few_rows(const uint8_t* W, size_t row_bytes, int64_t r, int64_t r1, int nb, const Act& a, int i0,
                                float* y, int64_t ldy) {
    if constexpr (R == 1) {
        for (; r + 4 <= r1; r += 4) dot_q4k_w4_one<false>(W + r * row_bytes, row_bytes, nb, a, i0, y + i0 * ldy + r);
    } else {
        for (; r + 2 <= r1; r += 2) dot_q4k_w2_rows<R>(W + r * row_bytes, row_bytes, nb, a, i0, y + i0 * ldy + r, ldy);
    }
    return r;
}

}  // namespace
}  // namespace spk
