// The fp32 arithmetic every path shares: the canonical epilogues that turn a block's exact
// integer sums into the fp32 accumulators, and llama.cpp's reduction tree. The VNNI, tiled and
// AMX kernels call these lane-wise, which is why their results agree bit for bit; keep them here,
// inline, so that they compile into each kernel's inner loop.
#pragma once
#include <immintrin.h>

#include "blocks.h"

namespace spk SPK_HIDDEN {
namespace {  // internal to each file that includes it (see kernels.h)

// The canonical Q4_K epilogue: one block's exact integer sums into the two fp32 accumulators of a
// (weight row, activation row), per lane, as llama.cpp's repacked Q4_K kernels do it
//   acc = fma((float)isum, d * dx, acc),  macc = fma((float)msum, dmin * dx, macc)
// and y = acc - macc after the last block (d, dmin: the weight block's scales, dx: the activation
// block's). Q6_K: eight int32 partial sums per block, lane l holding the 4-value groups g with
// g % 8 == l less 32 * (sc_2l * bsum16_2l + sc_2l+1 * bsum16_2l+1); acc_l = fma(d * dx,
// (float)sum_l, acc_l), and y = the reduction tree of hsum8 over the eight lanes. Integer
// range: |x| <= 127; Q4_K: q <= 15, sc, min <= 63, so |isum| <= 8*63*32*15*127 = 30.7M and |msum|
// <= 8*63*32*127 = 2.0M; Q6_K: q <= 63, |sc| <= 128, so |isum| <= 16*128*16*63*127 +
// 32*16*128*16*127 = 395M: all within int32. (float)isum: cvtdq2ps, rounding to nearest (MXCSR).
#if SPK_AVX512
inline void epilogue_q4k(__m512& acc, __m512& macc, __m512 d, __m512 dmin, __m512 dx, __m512i isum, __m512i msum) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), acc);
    macc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), macc);
}
#endif
inline void epilogue_q4k(__m128& acc, __m128& macc, __m128 d, __m128 dmin, __m128 dx, __m128i isum, __m128i msum) {
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_mul_ps(d, dx), acc);
    macc = _mm_fmadd_ps(_mm_cvtepi32_ps(msum), _mm_mul_ps(dmin, dx), macc);
}
inline void epilogue_q4k(__m256& acc, __m256& macc, __m256 d, __m256 dmin, __m256 dx, __m256i isum, __m256i msum) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx), acc);
    macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), macc);
}
// Q6_K: v's 16 int32 lanes (lane t: the groups g % 16 == t, less the correction in lanes 0..7)
// folded to the eight of lane class g % 8, into that class's FMA chain.
// (AVX2: the eight lanes come folded already.)
inline __m256 epilogue_q6k(__m256 acc, float d_dx, __m256i sum) {
    return _mm256_fmadd_ps(_mm256_set1_ps(d_dx), _mm256_cvtepi32_ps(sum), acc);
}
#if SPK_AVX512
inline __m256 epilogue_q6k(__m256 acc, float d_dx, __m512i v) {
    return epilogue_q6k(acc, d_dx, _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)));
}
#endif
// Q6_K past LLAMA_SPLIT_KV (see spk_linear_prompt): one sum per block, acc + (d * dx) * isum,
// the same operations lane-wise in the VNNI and AMX kernels.
inline __m128 epilogue_q6k_canon(__m128 acc, __m128 d, __m128 dx, __m128i isum) {
    return _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d, dx), _mm_cvtepi32_ps(isum)));
}
inline __m256 epilogue_q6k_canon(__m256 acc, __m256 d, __m256 dx, __m256i isum) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum)));
}
#if SPK_AVX512
inline __m512 epilogue_q6k_canon(__m512 acc, __m512 d, __m512 dx, __m512i isum) {
    return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum)));
}
#endif
// Q6_K prompt rows (llama.cpp's tiled matmul): one sum per block, fma((float)isum * d, dx, acc)
// (its code writes buf + result * dx; the compiler fuses it), lane-wise in the VNNI and AMX kernels.
inline __m128 epilogue_q6k_tiled(__m128 acc, __m128 d, __m128 dx, __m128i isum) {
    return _mm_fmadd_ps(_mm_mul_ps(_mm_cvtepi32_ps(isum), d), dx, acc);
}
inline __m256 epilogue_q6k_tiled(__m256 acc, __m256 d, __m256 dx, __m256i isum) {
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), d), dx, acc);
}
#if SPK_AVX512
inline __m512 epilogue_q6k_tiled(__m512 acc, __m512 d, __m512 dx, __m512i isum) {
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), d), dx, acc);
}
#endif
// llama.cpp's hsum_float_8: (a0 + a4) + (a2 + a6) + ((a1 + a5) + (a3 + a7)).
inline float hsum8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

}  // namespace
}  // namespace spk
