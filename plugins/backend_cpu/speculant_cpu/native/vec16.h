// Vectors of 16 floats for the attention and element-wise kernels (attention.cpp,
// elementwise.cpp), and the three vector exps they use. On AVX-512 a vf16 is a zmm and every
// operation one instruction; on AVX2 it is two ymm (lanes 0-7 and 8-15) and the operations AVX2
// lacks are built from others with the same results: scalef (two exact power-of-two products, the
// second rounding once, as vscalefps rounds), the masks (all-ones lanes), and the reductions in
// the AVX-512 forms' fixed trees (GCC's _mm512_reduce_add_ps / _max_ps, sum16's). Every operation
// is lane-wise IEEE arithmetic or one of those trees, so a kernel written on vf16 gives the same
// bits on both; where a kernel blocks its loops by register count (AVX2 has 16 ymm, AVX-512 32
// zmm), only the order of independent lanes changes, never a lane's own operations.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"

#ifndef SPK_HIDDEN
#define SPK_HIDDEN __attribute__((visibility("hidden")))
#endif

namespace spk SPK_HIDDEN {
namespace {  // internal to each file that includes it (see kernels.h)

#if SPK_AVX512

using vf16 = __m512;
using mask16 = __mmask16;

inline vf16 v_zero() { return _mm512_setzero_ps(); }
inline vf16 v_set1(float x) { return _mm512_set1_ps(x); }
inline vf16 v_load(const float* p) { return _mm512_loadu_ps(p); }
inline void v_store(float* p, vf16 v) { _mm512_storeu_ps(p, v); }
inline vf16 v_load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void v_store_f16(uint16_t* p, vf16 v) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
inline vf16 v_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
inline vf16 v_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
inline vf16 v_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
inline vf16 v_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
inline vf16 v_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }    // a*b + c
inline vf16 v_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a*b
inline vf16 v_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
inline vf16 v_min(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
inline vf16 v_abs(vf16 a) { return _mm512_abs_ps(a); }
inline vf16 v_round(vf16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// y * 2^n, rounded once (n integral)
inline vf16 v_scalef(vf16 y, vf16 n) { return _mm512_scalef_ps(y, n); }
inline float v_lane0(vf16 x) { return _mm512_cvtss_f32(x); }
inline float v_reduce_add(vf16 x) { return _mm512_reduce_add_ps(x); }
inline float v_reduce_max(vf16 x) { return _mm512_reduce_max_ps(x); }
// The sum of 16 lanes in a fixed tree: halves, quarters, pairs (lane i plus lane i ^ 8, then ^ 4,
// ^ 2, ^ 1; attention.cpp's fast_reference spells it out).
inline float v_sum16(vf16 x) {
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_cvtss_f32(x);
}
inline mask16 m_range(int ua, int ub) { return (mask16)(((1u << ub) - 1) & ~((1u << ua) - 1)); }  // lanes ua .. ub-1
inline mask16 m_gt(vf16 a, vf16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline mask16 m_le(vf16 a, vf16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline bool m_any(mask16 m) { return m != 0; }
inline vf16 v_blend(mask16 m, vf16 a, vf16 b) { return _mm512_mask_blend_ps(m, a, b); }  // m ? b : a
inline vf16 v_maskz(mask16 m, vf16 a) { return _mm512_maskz_mov_ps(m, a); }             // m ? a : 0

#else  // AVX2: two ymm

struct vf16 { __m256 lo, hi; };
struct mask16 { __m256 lo, hi; };  // all-ones lanes

inline vf16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v_store(float* p, vf16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline vf16 v_load_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
inline void v_store_f16(uint16_t* p, vf16 v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT));
    _mm_storeu_si128((__m128i*)(p + 8), _mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT));
}
inline vf16 v_add(vf16 a, vf16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf16 v_sub(vf16 a, vf16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf16 v_mul(vf16 a, vf16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf16 v_div(vf16 a, vf16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf16 v_fmadd(vf16 a, vf16 b, vf16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf16 v_fnmadd(vf16 a, vf16 b, vf16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf16 v_max(vf16 a, vf16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf16 v_min(vf16 a, vf16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf16 v_abs(vf16 a) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline vf16 v_round(vf16 x) {
    return {_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
            _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^k for integers -126 <= k <= 127, exactly
inline __m256 pow2i(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }
// y * 2^n as vscalefps computes it, for n integral with |n| <= 252 and y in [0.5, 2) (the exps'
// arguments: their polynomial near 1): y * 2^(n >> 1) is exact (a normal float), and the second
// power of two rounds the product once, subnormal results and overflow to inf included.
inline __m256 scalef8(__m256 y, __m256 n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i p = _mm256_srai_epi32(ni, 1);
    return _mm256_mul_ps(_mm256_mul_ps(y, pow2i(p)), pow2i(_mm256_sub_epi32(ni, p)));
}
inline vf16 v_scalef(vf16 y, vf16 n) { return {scalef8(y.lo, n.lo), scalef8(y.hi, n.hi)}; }
inline float v_lane0(vf16 x) { return _mm256_cvtss_f32(x.lo); }
// GCC's _mm512_reduce_add_ps: (high half + low half), then its halves, then (0 + 2) + (1 + 3)
inline float v_reduce_add(vf16 x) {
    const __m256 t3 = _mm256_add_ps(x.hi, x.lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
// GCC's _mm512_reduce_max_ps, operand for operand (max is not symmetric in its zeros and NaNs)
inline float v_reduce_max(vf16 x) {
    const __m256 t3 = _mm256_max_ps(x.hi, x.lo);
    const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m128 t10 = _mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
    return _mm_cvtss_f32(t10);
}
inline float v_sum16(vf16 x) {
    const __m256 a = _mm256_add_ps(x.lo, x.hi);                                 // i + (i ^ 8)
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // ^ 4
    b = _mm_add_ps(b, _mm_permute_ps(b, _MM_SHUFFLE(1, 0, 3, 2)));                // ^ 2
    b = _mm_add_ps(b, _mm_permute_ps(b, _MM_SHUFFLE(2, 3, 0, 1)));                // ^ 1
    return _mm_cvtss_f32(b);
}
inline mask16 m_range(int ua, int ub) {
    const __m256i lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_add_epi32(lo, _mm256_set1_epi32(8));
    const __m256i a = _mm256_set1_epi32(ua - 1), b = _mm256_set1_epi32(ub);
    auto in = [&](__m256i i) { return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(i, a), _mm256_cmpgt_epi32(b, i))); };
    return {in(lo), in(hi)};
}
inline mask16 m_gt(vf16 a, vf16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
inline mask16 m_le(vf16 a, vf16 b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_LE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LE_OQ)}; }
inline bool m_any(mask16 m) { return _mm256_movemask_ps(_mm256_or_ps(m.lo, m.hi)) != 0; }
inline vf16 v_blend(mask16 m, vf16 a, vf16 b) { return {_mm256_blendv_ps(a.lo, b.lo, m.lo), _mm256_blendv_ps(a.hi, b.hi, m.hi)}; }
inline vf16 v_maskz(mask16 m, vf16 a) { return {_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)}; }

#endif

// --- the vector exps -----------------------------------------------------------------------

// expf of 16 floats within 1.5 ulp (Cephes' polynomial on [-ln2/2, ln2/2], then 2^n; checked on
// every float in [-87, 0]), for the fp32 attention. Arguments are clamped below at -104, where the
// result is 0 or a denormal; callers zero the lanes that must weigh nothing.
inline vf16 exp16_fast(vf16 x) {
    x = v_min(v_max(x, v_set1(-104.f)), v_set1(88.7f));
    const vf16 n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf16 r = v_fnmadd(n, v_set1(0.693359375f), x);
    r = v_fnmadd(n, v_set1(-2.12194440e-4f), r);
    vf16 y = v_set1(1.9875691500e-4f);
    y = v_fmadd(y, r, v_set1(1.3981999507e-3f));
    y = v_fmadd(y, r, v_set1(8.3334519073e-3f));
    y = v_fmadd(y, r, v_set1(4.1665795894e-2f));
    y = v_fmadd(y, r, v_set1(1.6666665459e-1f));
    y = v_fmadd(y, r, v_set1(5.0000001201e-1f));
    y = v_add(v_fmadd(y, v_mul(r, r), r), v_set1(1.f));
    return v_scalef(y, n);
}

inline float exp_fast(float x) { return v_lane0(exp16_fast(v_set1(x))); }

// exp(x) as ggml_v_expf computes it in ggml's AVX-512 build: n = round(x / ln 2) through the
// 1.5 * 2^23 shift, b = x - n ln 2 in two FMA steps (ln 2 split into a high and a low part), a
// polynomial in b, times 2^n; |n| > 192 saturates to +inf (n > 0) or 0. (ggml's AVX2 build
// computes exp otherwise; ours keeps the AVX-512 form on every ISA, so the bits do not depend on it.)
inline vf16 exp16_ggml(vf16 x) {
    const vf16 shift = v_set1(0x1.8p23f);
    const vf16 z = v_fmadd(x, v_set1(0x1.715476p+0f), shift);
    const vf16 n = v_sub(z, shift);
    const vf16 b = v_fnmadd(n, v_set1(0x1.7f7d1cp-20f), v_fnmadd(n, v_set1(0x1.62e4p-1f), x));
    const mask16 out_of_range = m_gt(v_abs(n), v_set1(192));
    const vf16 u = v_mul(b, b);
    const vf16 hi = v_fmadd(v_fmadd(v_set1(0x1.0e4020p-7f), b, v_set1(0x1.573e2ep-5f)), u,
                            v_fmadd(v_set1(0x1.555e66p-3f), b, v_set1(0x1.fffdb6p-2f)));
    const vf16 j = v_fmadd(hi, u, v_fmadd(v_set1(0x1.ffffecp-1f), b, v_set1(1.0f)));
    const vf16 res = v_scalef(j, n);
    if (!m_any(out_of_range)) return res;
    const vf16 saturated = v_blend(m_le(n, v_zero()), v_set1(INFINITY), v_zero());
    return v_blend(out_of_range, res, saturated);
}

// expf of 16 floats with the bits of glibc's expf (the algorithm of its x86-64 FMA build: a
// 32-entry table of 2^(i/32) and a cubic in double precision), checked against libm for every
// float in [-104, 0] (spk_exp_check). Softmax calls exp once per key and (row, head); one vector
// call per 16 keys instead of 16 library calls, with the numerics unchanged.
struct ExpTable {
    uint64_t t[32];
    ExpTable() {
        for (int i = 0; i < 32; ++i) {
            const double v = (double)exp2l((long double)i / 32);
            uint64_t bits;
            std::memcpy(&bits, &v, 8);
            t[i] = bits - ((uint64_t)i << 47);
        }
    }
};
const ExpTable g_exp_table;

constexpr double EXP_INV_LN2_N = 0x1.71547652b82fep+0 * 32, EXP_SHIFT = 0x1.8p+52;
constexpr double EXP_C0 = 0x1.c6af84b912394p-5 / (32.0 * 32 * 32), EXP_C1 = 0x1.ebfce50fac4f3p-3 / (32.0 * 32),
                 EXP_C2 = 0x1.62e42ff0c52d6p-1 / 32;
constexpr float EXP_ZERO_BELOW = -0x1.9fe368p6f, EXP_INF_ABOVE = 0x1.62e42ep6f;  // log(2^-150), log(2^128)

#if SPK_AVX512
inline __m256 exp8_like_libm(__m256 x) {
    const __m512d inv_ln2_n = _mm512_set1_pd(EXP_INV_LN2_N), shift = _mm512_set1_pd(EXP_SHIFT);
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d z = _mm512_mul_pd(inv_ln2_n, xd);
    __m512d kd = _mm512_add_pd(z, shift);  // round to nearest integer
    const __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, shift);
    const __m512d r = _mm512_fmadd_pd(inv_ln2_n, xd, _mm512_sub_pd(_mm512_setzero_pd(), kd));
    __m512i t = _mm512_i64gather_epi64(_mm512_and_si512(ki, _mm512_set1_epi64(31)), (const long long*)g_exp_table.t, 8);
    t = _mm512_add_epi64(t, _mm512_slli_epi64(ki, 47));
    const __m512d sc = _mm512_castsi512_pd(t);
    const __m512d p = _mm512_fmadd_pd(_mm512_set1_pd(EXP_C0), r, _mm512_set1_pd(EXP_C1));
    const __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(_mm512_set1_pd(EXP_C2), r, _mm512_set1_pd(1.0));
    y = _mm512_mul_pd(_mm512_fmadd_pd(p, r2, y), sc);
    __m256 out = _mm512_cvtpd_ps(y);
    // below log(2^-150) the result is 0 (also -inf); above log(2^128), +inf; NaN stays NaN
    out = _mm256_mask_blend_ps(_mm256_cmp_ps_mask(x, _mm256_set1_ps(EXP_ZERO_BELOW), _CMP_LT_OQ), out, _mm256_setzero_ps());
    out = _mm256_mask_blend_ps(_mm256_cmp_ps_mask(x, _mm256_set1_ps(EXP_INF_ABOVE), _CMP_GT_OQ), out, _mm256_set1_ps(INFINITY));
    return out;
}

inline vf16 exp16_like_libm(vf16 x) {
    const __m256 lo = exp8_like_libm(_mm512_castps512_ps256(x));
    const __m256 hi = exp8_like_libm(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
#else
// The same double-precision steps, four lanes per ymm of doubles.
inline __m128 exp4_like_libm(__m128 x) {
    const __m256d inv_ln2_n = _mm256_set1_pd(EXP_INV_LN2_N), shift = _mm256_set1_pd(EXP_SHIFT);
    const __m256d xd = _mm256_cvtps_pd(x);
    const __m256d z = _mm256_mul_pd(inv_ln2_n, xd);
    __m256d kd = _mm256_add_pd(z, shift);
    const __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, shift);
    const __m256d r = _mm256_fmadd_pd(inv_ln2_n, xd, _mm256_sub_pd(_mm256_setzero_pd(), kd));
    __m256i t = _mm256_i64gather_epi64((const long long*)g_exp_table.t, _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    t = _mm256_add_epi64(t, _mm256_slli_epi64(ki, 47));
    const __m256d sc = _mm256_castsi256_pd(t);
    const __m256d p = _mm256_fmadd_pd(_mm256_set1_pd(EXP_C0), r, _mm256_set1_pd(EXP_C1));
    const __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(_mm256_set1_pd(EXP_C2), r, _mm256_set1_pd(1.0));
    y = _mm256_mul_pd(_mm256_fmadd_pd(p, r2, y), sc);
    __m128 out = _mm256_cvtpd_ps(y);
    out = _mm_blendv_ps(out, _mm_setzero_ps(), _mm_cmp_ps(x, _mm_set1_ps(EXP_ZERO_BELOW), _CMP_LT_OQ));
    out = _mm_blendv_ps(out, _mm_set1_ps(INFINITY), _mm_cmp_ps(x, _mm_set1_ps(EXP_INF_ABOVE), _CMP_GT_OQ));
    return out;
}

inline __m256 exp8_like_libm(__m256 x) {
    return _mm256_set_m128(exp4_like_libm(_mm256_extractf128_ps(x, 1)), exp4_like_libm(_mm256_castps256_ps128(x)));
}

inline vf16 exp16_like_libm(vf16 x) { return {exp8_like_libm(x.lo), exp8_like_libm(x.hi)}; }
#endif

}  // namespace
}  // namespace spk
