// Fused dequantize-and-multiply kernels for GGUF weights on x86 CPUs with AVX-512 VNNI (and
// AMX-INT8 where the CPU has it).
//
// y[m, n] = x[m, k] @ W[n, k]^T, with W left in its GGUF block format (read straight from the
// file's memory map) and x quantized per call the way llama.cpp's CPU backend does it: to
// Q8_K (blocks of 256, float scale) for the K-quants and to Q8_0 (blocks of 32, fp16 scale) for
// Q8_0 and Q5_0. Dot products are exact integer sums per block, scaled and accumulated in fp32.
//
// Batch invariance: a row's result does not depend on how many rows are computed with it (the
// engine's exactness needs it). For Q8_0/Q5_0/Q4_0 every output y[i, r] goes through the same
// per-lane operations whatever m is (one row in a ymm, or a pair of rows in the halves of a zmm,
// then the same reduction). Q4_K has two paths, AVX-512 VNNI for few rows and AMX tiles for more
// (spk_linear picks by m), and they agree bit for bit because both compute, per (weight row,
// activation row, 256-block), the same EXACT integers
//   Q4_K: isum = sum_j sc_j * (sum_{i in sub-block j} q_i x_i),  msum = sum_j min_j * bsum32_j
// and then the one canonical fp32 epilogue below (epilogue_q4k), in block order, lane-wise: 4
// activation rows per xmm in the VNNI kernels, 16 per zmm in the AMX kernel. The same holds for
// llama.cpp's prompt arithmetic (spk_linear_mode 1: Q4_K's sums per pair of sub-blocks, Q6_K's
// per block) and Q6_K's canonical form (mode 2); Q6_K in llama.cpp's decode arithmetic has the
// VNNI path only.
//
// The fp32 arithmetic is llama.cpp's, operation for operation, as its x86 CPU backend runs these
// types (AVX2 and up; checked against its tensors): Q4_K as its repacked 8x8 gemv/gemm (two FMA
// chains per output, for the scales and the mins, subtracted at the end), Q6_K as
// ggml_vec_dot_q6_K_q8_K (eight partial integer sums per block, each in its own FMA chain, then
// one fixed reduction tree), the 32-blocks as ggml_vec_dot_q8_0_q8_0. So our logits are theirs
// bit for bit where the inputs are, and greedy decoding follows llama.cpp's even at near-ties.
// The library is built with -ffp-contract=off: the only FMAs are the ones written here.
//
// Called through ctypes (no Python or torch headers: it builds in about a second). Threads come
#include "kernels.h"
#include "pool.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <vector>

namespace spk SPK_HIDDEN {
namespace {

// ---------------------------------------------------------------------------------------------
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
inline void epilogue_q4k(__m512& acc, __m512& macc, __m512 d, __m512 dmin, __m512 dx, __m512i isum, __m512i msum) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), acc);
    macc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmin, dx), macc);
}
inline void epilogue_q4k(__m128& acc, __m128& macc, __m128 d, __m128 dmin, __m128 dx, __m128i isum, __m128i msum) {
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(isum), _mm_mul_ps(d, dx), acc);
    macc = _mm_fmadd_ps(_mm_cvtepi32_ps(msum), _mm_mul_ps(dmin, dx), macc);
}
// Q6_K: v's 16 int32 lanes (lane t: the groups g % 16 == t, less the correction in lanes 0..7)
// folded to the eight of lane class g % 8, into that class's FMA chain.
inline __m256 epilogue_q6k(__m256 acc, float d_dx, __m512i v) {
    const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm256_fmadd_ps(_mm256_set1_ps(d_dx), _mm256_cvtepi32_ps(sum), acc);
}
// Q6_K past LLAMA_SPLIT_KV (see spk_linear_prompt): one sum per block, acc + (d * dx) * isum,
// the same operations lane-wise in the VNNI and AMX kernels.
inline __m128 epilogue_q6k_canon(__m128 acc, __m128 d, __m128 dx, __m128i isum) {
    return _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(d, dx), _mm_cvtepi32_ps(isum)));
}
inline __m512 epilogue_q6k_canon(__m512 acc, __m512 d, __m512 dx, __m512i isum) {
    return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum)));
}
// Q6_K prompt rows (llama.cpp's tiled matmul): one sum per block, fma((float)isum * d, dx, acc)
// (its code writes buf + result * dx; the compiler fuses it), lane-wise in the VNNI and AMX kernels.
inline __m128 epilogue_q6k_tiled(__m128 acc, __m128 d, __m128 dx, __m128i isum) {
    return _mm_fmadd_ps(_mm_mul_ps(_mm_cvtepi32_ps(isum), d), dx, acc);
}
inline __m512 epilogue_q6k_tiled(__m512 acc, __m512 d, __m512 dx, __m512i isum) {
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), d), dx, acc);
}
// llama.cpp's hsum_float_8: (a0 + a4) + (a2 + a6) + ((a1 + a5) + (a3 + a7)).
inline float hsum8(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// ---------------------------------------------------------------------------------------------
// VNNI kernels: one weight row against NR activation rows (Q8_0/Q5_0/Q4_0: fp32 accumulation in
// vector lanes, the same for every row; Q4_K/Q6_K: the integer sums reduced per block, then the
// canonical epilogue).

// Software prefetch distance for the weight stream: the hardware prefetcher alone leaves a
// single core at about half of its memory bandwidth on these kernels. Into L2 (T1), well ahead:
// measured over the 1.5B model's weights, calls alternating in one process, 6144 bytes into L2
// against 3072 into L1 took 1 row from 49.5 to 45.9 ms and 2 rows from 56.3 to 53.0 (3 and 4 rows
// the same; 3072 into L1 had made 2 and 3 rows 7% faster than 4096).
constexpr int PREFETCH_BYTES = 6144;

inline void prefetch(const void* block, int bytes) {
    const char* p = (const char*)block + PREFETCH_BYTES;
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

inline float hsum128(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

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
inline __m128i hsum4(const __m128i v[4]) {
    const __m128i ab = _mm_add_epi32(_mm_unpacklo_epi32(v[0], v[1]), _mm_unpackhi_epi32(v[0], v[1]));
    const __m128i cd = _mm_add_epi32(_mm_unpacklo_epi32(v[2], v[3]), _mm_unpackhi_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm_unpacklo_epi64(ab, cd), _mm_unpackhi_epi64(ab, cd));
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

// The 12 packed bytes of a Q4_K block hold eight 6-bit scales and eight 6-bit mins: unpacked
// into [sc0..sc7, mn0..mn7] as 16 bytes.
inline __m128i q4k_scales(const BlockQ4K& blk) {
    uint32_t u[4];
    std::memcpy(u, blk.scales, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3f;
    // (built in registers: loading u back through memory would stall on store forwarding)
    return _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
}

// Index vectors giving each zmm of a Q4_K block its two sub-block scales: zmm z pairs sub-blocks
// (0,2), (1,3), (4,6), (5,7); int16 lanes 0..15 take the first, 16..31 the second.
struct Q4Idx {
    __m512i idx[4];
    Q4Idx() {
        const int first[4] = {0, 1, 4, 5};
        for (int z = 0; z < 4; ++z) {
            alignas(64) int16_t v[32];
            for (int t = 0; t < 32; ++t) v[t] = (int16_t)(first[z] + (t < 16 ? 0 : 2));
            idx[z] = _mm512_load_si512(v);
        }
    }
};

const Q4Idx Q4;

// A Q4_K block's 256 4-bit values as four zmm, in the q4k order of the activations: the low and
// high nibbles of its first 64 packed bytes, then of the next 64.
inline void q4k_values(const BlockQ4K& blk, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i q0 = _mm512_loadu_si512(blk.qs), q1 = _mm512_loadu_si512(blk.qs + 64);
    q[0] = _mm512_and_si512(q0, m4);
    q[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
    q[2] = _mm512_and_si512(q1, m4);
    q[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
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
        for (int g = 0; g < NG; ++g) {
            __m512i acc[4];
            __m128i mm[4];
            float dx[4];
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

// Index vectors spreading 16 int16 scales over the 4 zmm of a Q6_K block: zmm g, int16 lane t
// (bytes 2t, 2t+1 = values 64g + 2t, +1) takes scale 4g + t/8.
struct Q6Idx {
    __m512i idx[4];
    Q6Idx() {
        for (int g = 0; g < 4; ++g) {
            alignas(64) int16_t v[32];
            for (int t = 0; t < 32; ++t) v[t] = (int16_t)(4 * g + t / 8);
            idx[g] = _mm512_load_si512(v);
        }
    }
};

const Q6Idx Q6;

// A Q6_K block's 256 6-bit values (stored as q + 32, 0..63) in natural order, 64 per zmm.
inline void q6k_values(const BlockQ6K& blk, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk.qh + 32 * h));
        const __m512i qhz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        const __m512i ql = _mm512_loadu_si512(blk.ql + 64 * h);
        const __m512i ha = _mm512_slli_epi16(_mm512_and_si512(qhz, m3), 4);
        const __m512i hb = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qhz, 4), m3), 4);
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), ha);
        q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hb);
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
        for (int g = 0; g < NG; ++g) {
            __m512i acc[4];
            float dx[4];
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


void dot_q6k_canon_w4(const uint8_t* row, size_t row_bytes, int nb, const Act& a, int i, float* y) {
    __m128 s = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const int64_t ab = (int64_t)i * a.nb + b;
        const int8_t* xq = a.qs.data() + ab * 256;
        __m512i x[4];
        load_x4(xq, x);
        const __m256i bs = _mm256_loadu_si256((const __m256i*)(a.bs16.data() + ab * 16));
        __m512i acc[4];
        float d[4];
        for (int t = 0; t < 4; ++t) {
            const BlockQ6K& blk = ((const BlockQ6K*)(row + t * row_bytes))[b];
            prefetch(&blk, sizeof(BlockQ6K));
            d[t] = f16(blk.d);
            __m512i q[4];
            q6k_values(blk, q);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)blk.scales));
            const __m512i sc16z = _mm512_castsi256_si512(sc16);
            const __m512i sg[4] = {_mm512_permutexvar_epi16(Q6.idx[0], sc16z), _mm512_permutexvar_epi16(Q6.idx[1], sc16z),
                                   _mm512_permutexvar_epi16(Q6.idx[2], sc16z), _mm512_permutexvar_epi16(Q6.idx[3], sc16z)};
            const __m512i v = scaled_dot4(q, sg, x);
            const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            acc[t] = _mm512_sub_epi32(v, _mm512_zextsi256_si512(corr));
        }
        s = epilogue_q6k_canon(s, _mm_loadu_ps(d), _mm_set1_ps(a.d[ab]), hsum4(acc));
    }
    _mm_storeu_ps(y, s);
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
    for (int b = 0; b < nb; ++b) {
        const int64_t ab = (int64_t)i * a.nb + b;
        const __m256i x = _mm256_loadu_si256((const __m256i*)(a.qs.data() + ab * 32));
        const float dx = a.d[ab];
        for (int t = 0; t < 4; ++t) {
            if (b % 2 == 0) prefetch(&w[t][b], 64);
            const __m256i q = decode32(w[t][b]);
            const __m256i acc = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
            fs[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(f16(w[t][b].d) * dx), fs[t]);
        }
    }
    for (int t = 0; t < 4; ++t) y[t] = hsum128(_mm_add_ps(_mm256_castps256_ps128(fs[t]), _mm256_extractf128_ps(fs[t], 1)));
}

// ---------------------------------------------------------------------------------------------
// AMX-INT8 kernel: 16 weight rows (tile A, u8) against 16 activation rows (tile B, s8, in
// the VNNI layout B[v/4][row][v%4]), full K = 64 per TDPBUSD. The sub-block scales go into the
// weights themselves, split into two byte planes so the products stay u8, and the two planes'
// exact sums recombine in int32: sc = 8*hi + lo (hi, lo <= 7), plane1 = hi*q, plane2 = lo*q
// (<= 105): isum = 8*C1 + C2;  msum from the block sums (vpdpwssd), as in the VNNI kernel.
// Range: C <= 256*105*127 = 3.4M: int32. Then the canonical epilogue, lane-wise over the
// activation rows. Q4_K prompt rows (llama.cpp's gemm, one FMA step per pair of sub-blocks) take
// the planes and the activations in natural order instead, so that K step z is exactly pair z
// (values 64z .. 64z + 63, sub-blocks 2z, 2z + 1): each step's C1, C2 are stored apart and the
// pair's epilogue step runs on them, in pair order (isum_pair = 8*C1 + C2 <= 64*63*15*127 = 7.7M).
//
// Q6_K runs here in the forms with one sum per block: the canonical one and llama.cpp's tiled
// prompt matmul (their epilogues differ, their integers do not). llama.cpp's decode arithmetic
// keeps eight partial sums per block, each over a strided eighth of the values, which a K = 64
// tile product mixes. p = sc*(q - 32) + 4096 in [32, 8192], plane1 = p & 255, plane2 = p >> 8
// (<= 32): isum = C1 + 256*C2 - 4096*bsum256; C1 <= 256*255*127 = 8.3M, 256*C2 <= 266M,
// 4096*|bsum256| <= 133M: int32.


// ---------------------------------------------------------------------------------------------
// Q4_K on VNNI with the activations in the AMX layout (CPUs without AMX, from a few rows): the 16
// rows of an activation group sit in the 16 int32 lanes of a zmm, four bytes each (value v of
// row i at dword [v/4][i], q4k_order), and each weight dword is broadcast against them. A lane's
// sum then collects one (weight row, activation row) pair with no horizontal reduction: per 32
// values, 8 vpdpbusd give the sub-block's exact sum, which its 6-bit scale multiplies. That is the
// same integer isum and msum as dot_q4k's, and the same canonical epilogue lane-wise, so the bits
// are the other kernels' (the tests compare them).

// The sub-block of each 32-byte run of q4k_values' bytes: zmm z holds sub-blocks (0,2), (1,3), (4,6), (5,7).
constexpr int Q4K_RUN_SUB[8] = {0, 2, 1, 3, 4, 6, 5, 7};

// Up to R = 8 weight rows against ng activation groups: eight independent vpdpbusd chains (their
// latency needs about that many), each activation zmm loaded once for the eight rows (zmm loads
// are what runs out first), each weight block decoded once for all the groups.
constexpr int TILED_ROWS = 8;

// The exact integer sums of one activation group against R decoded weight rows: for each run of
// RUN bytes (a sub-block), RUN / 4 vpdpbusd of the weight dwords broadcast against the group's
// activation zmm, times the run's scale; isum[r] = sum over runs of scale(r, run) * run sum.
template <int R, int RUN, class Scale>
inline void tiled_isums(const uint8_t (*qb)[256], const int8_t* B, Scale scale, __m512i* isum) {
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int k = 0; k < 256 / RUN; ++k) {
        __m512i c[R];
        for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_si512();
        for (int t = 0; t < RUN / 4; ++t) {
            const __m512i bz = _mm512_loadu_si512(B + 64 * (RUN / 4 * k + t));  // not 64-aligned: loadu
            for (int r = 0; r < R; ++r) {
                int32_t w;
                std::memcpy(&w, qb[r] + RUN * k + 4 * t, 4);
                c[r] = _mm512_dpbusd_epi32(c[r], _mm512_set1_epi32(w), bz);
            }
        }
        for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(c[r], _mm512_set1_epi32(scale(r, k))));
    }
}

void q4k_tiled_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0, int64_t i1,
                    float* y, int64_t ldy) {
    constexpr int R = TILED_ROWS;
    alignas(64) uint8_t qb[R][256];
    alignas(16) uint8_t scm[R][16];  // [sc0..sc7, mn0..mn7] of each row
    alignas(64) float acc[TILED_GROUPS_MAX][R][16], macc[TILED_GROUPS_MAX][R][16];
    float d[R] = {}, dmin[R] = {};
    std::memset(qb, 0, sizeof qb);  // rows past nr stay zero: their sums are 0
    std::memset(scm, 0, sizeof scm);
    for (int g = 0; g < ng; ++g)
        for (int r = 0; r < R; ++r) {
            _mm512_store_ps(acc[g][r], _mm512_setzero_ps());
            _mm512_store_ps(macc[g][r], _mm512_setzero_ps());
        }
    for (int b = 0; b < nb; ++b) {
        for (int r = 0; r < nr; ++r) {
            const BlockQ4K& blk = ((const BlockQ4K*)(W + r * row_bytes))[b];
            prefetch(&blk, sizeof(BlockQ4K));
            d[r] = f16(blk.d);
            dmin[r] = f16(blk.dmin);
            _mm_store_si128((__m128i*)scm[r], q4k_scales(blk));
            __m512i q[4];
            q4k_values(blk, q);
            for (int z = 0; z < 4; ++z) _mm512_store_si512(qb[r] + 64 * z, q[z]);
        }
        for (int g = 0; g < ng; ++g) {
            const int64_t gb = (g0 + g) * nb + b;
            __m512i isum[R];  // the 32-value runs of q4k_values' order, one sub-block each
            tiled_isums<R, 32>(qb, a.bt.data() + gb * 4096, [&](int r, int k) { return (int32_t)scm[r][Q4K_RUN_SUB[k]]; }, isum);
            const __m512 dx = _mm512_loadu_ps(a.dt.data() + gb * 16);
            const int32_t* bp = a.bp.data() + gb * 64;
            const __m512i bpz[4] = {_mm512_loadu_si512(bp), _mm512_loadu_si512(bp + 16),
                                    _mm512_loadu_si512(bp + 32), _mm512_loadu_si512(bp + 48)};
            for (int r = 0; r < nr; ++r) {
                const uint8_t* mn = scm[r] + 8;
                __m512i msum = _mm512_setzero_si512();
                for (int p = 0; p < 4; ++p)
                    msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(pair16(mn[2 * p], mn[2 * p + 1])), bpz[p]);
                __m512 s = _mm512_load_ps(acc[g][r]), sn = _mm512_load_ps(macc[g][r]);
                epilogue_q4k(s, sn, _mm512_set1_ps(d[r]), _mm512_set1_ps(dmin[r]), dx, isum[r], msum);
                _mm512_store_ps(acc[g][r], s);
                _mm512_store_ps(macc[g][r], sn);
            }
        }
    }
    for (int g = 0; g < ng; ++g)
        for (int lane = 0; lane < 16; ++lane) {
            const int64_t i = (g0 + g) * 16 + lane;
            if (i < i0 || i >= i1) continue;
            for (int r = 0; r < nr; ++r) y[i * ldy + r] = acc[g][r][lane] - macc[g][r][lane];
        }
}

// Weight rows [0, nr) against activation groups g0 .. g0 + ng - 1 (ng <= TILED_GROUPS_MAX).

// Q6_K's canonical form (Q6K_CANON) the same way: per 16 values, 4 vpdpbusd of the unsigned 6-bit
// values give sum q x, its int8 scale multiplies it, and the -32 offset comes off at the end as
// 32 * sum_j sc_j * bsum16_j (the activations' 16-value sums, from the quantizer): the same exact
// isum as dot_q6k_canon's, and its epilogue lane-wise.
void q6k_tiled_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0, int64_t i1,
                    float* y, int64_t ldy) {
    constexpr int R = TILED_ROWS;
    alignas(64) uint8_t qb[R][256];
    alignas(16) int8_t scs[R][16];
    alignas(64) float acc[TILED_GROUPS_MAX][R][16];
    float d[R] = {};
    std::memset(qb, 0, sizeof qb);
    std::memset(scs, 0, sizeof scs);
    for (int g = 0; g < ng; ++g)
        for (int r = 0; r < R; ++r) _mm512_store_ps(acc[g][r], _mm512_setzero_ps());
    for (int b = 0; b < nb; ++b) {
        for (int r = 0; r < nr; ++r) {
            const BlockQ6K& blk = ((const BlockQ6K*)(W + r * row_bytes))[b];
            prefetch(&blk, sizeof(BlockQ6K));
            d[r] = f16(blk.d);
            std::memcpy(scs[r], blk.scales, 16);
            __m512i q[4];
            q6k_values(blk, q);
            for (int z = 0; z < 4; ++z) _mm512_store_si512(qb[r] + 64 * z, q[z]);
        }
        for (int g = 0; g < ng; ++g) {
            const int64_t gb = (g0 + g) * nb + b;
            __m512i isum[R];  // the 16-value sub-blocks in natural order
            tiled_isums<R, 16>(qb, a.bt.data() + gb * 4096, [&](int r, int j) { return (int32_t)scs[r][j]; }, isum);
            const __m512 dx = _mm512_loadu_ps(a.dt.data() + gb * 16);
            const int32_t* bq = a.bq.data() + gb * 128;
            for (int r = 0; r < nr; ++r) {
                __m512i corr = _mm512_setzero_si512();
                for (int p = 0; p < 8; ++p)
                    corr = _mm512_dpwssd_epi32(corr, _mm512_set1_epi32(pair16(scs[r][2 * p], scs[r][2 * p + 1])), _mm512_loadu_si512(bq + 16 * p));
                const __m512i v = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(corr, 5));
                _mm512_store_ps(acc[g][r], epilogue_q6k_canon(_mm512_load_ps(acc[g][r]), _mm512_set1_ps(d[r]), dx, v));
            }
        }
    }
    for (int g = 0; g < ng; ++g)
        for (int lane = 0; lane < 16; ++lane) {
            const int64_t i = (g0 + g) * 16 + lane;
            if (i < i0 || i >= i1) continue;
            for (int r = 0; r < nr; ++r) y[i * ldy + r] = acc[g][r][lane];
        }
}

// Weight rows [0, nr) against activation groups g0 .. g0 + ng - 1 (ng <= TILED_GROUPS_MAX).
void linear_tiled(int qtype, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0,
                  int64_t i1, float* y, int64_t ldy) {
    const auto kernel = qtype == T_Q4_K ? q4k_tiled_rows : q6k_tiled_rows;
    for (int r = 0; r < nr; r += TILED_ROWS)
        kernel(W + r * row_bytes, row_bytes, nb, std::min(TILED_ROWS, nr - r), a, g0, ng, i0, i1, y + r, ldy);
}

#ifdef SPK_AMX

struct alignas(64) TileCfg {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    TileCfg() { for (int t = 0; t < 8; ++t) { rows[t] = 16; colsb[t] = 64; } }
};

// All eight tiles 16 x 64 bytes: tmm0, 1 = C (plane 1, 2); tmm2, 3 = A plane 1; tmm4, 5 = A plane 2;
// tmm6, 7 = B (alternating over the four K steps of a block).
const TileCfg TILE_CFG;

// Each thread makes sure of the tile config when its share of a call starts. Other code on the
// same thread (oneDNN's AMX kernels under torch, on the calling thread) loads its own config and
// releases the tiles when done, so a config loaded once is not necessarily still there (and a tile
// op without it is SIGILL): read the current one back (cheap) and load ours if it differs. We do
// not release the tiles after a call: a release lets the AMX unit power down, and waking it costs
// more than the call's whole tile work on small matrices.
inline void tiles_ready() {
    TileCfg cur;
    _tile_storeconfig(&cur);
    if (std::memcmp(&cur, &TILE_CFG, sizeof cur) != 0) _tile_loadconfig(&TILE_CFG);
}


// Index vectors for a vpermw source holding two rows' 16 scale words (row parity p reads words
// 16p + ...): idx[0] as Q4.idx, for the planes in q4k_order (zmm z: sub-blocks (0,2), (1,3),
// (4,6), (5,7)); idx[1] for natural order (zmm z: sub-blocks 2z, 2z + 1).
struct Q4PairIdx {
    __m512i idx[2][2][4];
    Q4PairIdx() {
        for (int p = 0; p < 2; ++p)
            for (int z = 0; z < 4; ++z) {
                idx[0][p][z] = _mm512_add_epi16(Q4.idx[z], _mm512_set1_epi16((short)(16 * p)));
                alignas(64) int16_t v[32];
                for (int t = 0; t < 32; ++t) v[t] = (int16_t)(16 * p + 2 * z + (t < 16 ? 0 : 1));
                idx[1][p][z] = _mm512_load_si512(v);
            }
    }
};

const Q4PairIdx Q4P;

// Block b of four weight rows r0 .. r0 + 3 of a chunk (rows past nr read row nr - 1's header and
// get no planes) into the two planes (256 bytes a row, in the order of the activations' B tiles:
// q4k_order, or natural for PAIRS), the int16 pairs of their mins and dd[r] = (d, dmin). The
// 12-byte scale fields of the four rows unpack together.
template <bool PAIRS>
inline void amx_decode_q4k(const uint8_t* W, size_t row_bytes, int b, int r0, int nr, uint8_t* P1, uint8_t* P2,
                           int32_t (*mins)[4], float (*dd)[2]) {
    const uint8_t* h[4];
    for (int l = 0; l < 4; ++l) h[l] = W + (size_t)std::min(r0 + l, nr - 1) * row_bytes + (size_t)b * sizeof(BlockQ4K);
    // each 128-bit lane: the dwords (d | dmin, u0, u1, u2) of a row; q4k_scales lane-wise:
    // (u0 & 3f, (u2 & 0f) | (u0 >> 2 & 30), u1 & 3f, (u2 >> 4 & 0f) | (u1 >> 2 & 30))
    __m512i H = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)h[0]));
    H = _mm512_inserti32x4(H, _mm_loadu_si128((const __m128i*)h[1]), 1);
    H = _mm512_inserti32x4(H, _mm_loadu_si128((const __m128i*)h[2]), 2);
    H = _mm512_inserti32x4(H, _mm_loadu_si128((const __m128i*)h[3]), 3);
    const __m512i shifts = _mm512_set4_epi32(4, 0, 0, 0);
    const __m512i mask_x = _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f);
    const __m512i mask_y = _mm512_set4_epi32(0x30303030, 0, 0x30303030, 0);
    const __m512i X = _mm512_srlv_epi32(_mm512_shuffle_epi32(H, (_MM_PERM_ENUM)0xED), shifts);                  // (u0, u2, u1, u2)
    const __m512i Y = _mm512_and_si512(_mm512_srli_epi32(_mm512_shuffle_epi32(H, (_MM_PERM_ENUM)0xA5), 2), mask_y);  // (u0, u0, u1, u1)
    const __m512i s8 = _mm512_ternarylogic_epi32(X, mask_x, Y, 0xEA);                                            // (X & mask_x) | Y
    const __m512i w[2] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(s8)), _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(s8, 1))};
    // the mins' int16 pairs (mn_2p, mn_2p+1): the upper 16 bytes of each row's 32 scale words
    _mm256_store_si256((__m256i*)mins[r0], _mm512_castsi512_si256(_mm512_maskz_compress_epi64(0xCC, w[0])));
    _mm256_store_si256((__m256i*)mins[r0 + 2], _mm512_castsi512_si256(_mm512_maskz_compress_epi64(0xCC, w[1])));
    _mm256_store_ps(dd[r0], _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_maskz_compress_epi32(0x1111, H))));
    const __m512i m4 = _mm512_set1_epi8(0x0F), seven = _mm512_set1_epi16(7);
    const __m512i hi[2] = {_mm512_srli_epi16(w[0], 3), _mm512_srli_epi16(w[1], 3)};
    const __m512i lo[2] = {_mm512_and_si512(w[0], seven), _mm512_and_si512(w[1], seven)};
    for (int l = 0; l < 4 && r0 + l < nr; ++l) {
        const uint8_t* qs = h[l] + offsetof(BlockQ4K, qs);
        const __m512i q0 = _mm512_loadu_si512(qs), q1 = _mm512_loadu_si512(qs + 64);
        __m512i v[4] = {_mm512_and_si512(q0, m4), _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4),
                        _mm512_and_si512(q1, m4), _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4)};
        if constexpr (PAIRS) {  // natural order: the low then the high nibbles of bytes 32z .. 32z + 31
            const __m512i n0 = v[0], n1 = v[1], n2 = v[2], n3 = v[3];
            v[0] = _mm512_shuffle_i64x2(n0, n1, 0x44);
            v[1] = _mm512_shuffle_i64x2(n0, n1, 0xEE);
            v[2] = _mm512_shuffle_i64x2(n2, n3, 0x44);
            v[3] = _mm512_shuffle_i64x2(n2, n3, 0xEE);
        }
        uint8_t* p1 = P1 + 256 * (r0 + l);
        uint8_t* p2 = P2 + 256 * (r0 + l);
        for (int z = 0; z < 4; ++z) {
            // (q_even + 256 q_odd) * s = q_even s + 256 q_odd s: both products < 256, so the
            // 16-bit multiply gives the bytes' products in place.
            const __m512i idx = Q4P.idx[PAIRS][l & 1][z];
            _mm512_store_si512(p1 + 64 * z, _mm512_mullo_epi16(v[z], _mm512_permutexvar_epi16(idx, hi[l / 2])));
            _mm512_store_si512(p2 + 64 * z, _mm512_mullo_epi16(v[z], _mm512_permutexvar_epi16(idx, lo[l / 2])));
        }
    }
}

// Q6_K: one weight row's block into the two planes (natural order) and dd = (d, 0).
inline void amx_decode_q6k(const BlockQ6K& blk, uint8_t* P1, uint8_t* P2, float* dd) {
    __m512i q[4];
    q6k_values(blk, q);
    const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)blk.scales)));
    const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
    for (int z = 0; z < 4; ++z) {
        const __m512i s = _mm512_permutexvar_epi16(Q6.idx[z], sc);  // int16 scale of each byte pair
        const __m512i k = _mm512_sub_epi16(_mm512_set1_epi16(4096), _mm512_slli_epi16(s, 5));
        // sc * q of the even / odd bytes as int16 (one product per pair: exact), then + 4096 - 32 sc
        const __m512i pe = _mm512_add_epi16(_mm512_maddubs_epi16(q[z], _mm512_and_si512(s, _mm512_set1_epi16(0xFF))), k);
        const __m512i po = _mm512_add_epi16(_mm512_maddubs_epi16(q[z], _mm512_slli_epi16(s, 8)), k);
        _mm512_store_si512(P1 + 64 * z, _mm512_mask_blend_epi8(odd, pe, _mm512_slli_epi16(po, 8)));
        _mm512_store_si512(P2 + 64 * z, _mm512_mask_blend_epi8(odd, _mm512_srli_epi16(pe, 8), po));
    }
    dd[0] = f16(blk.d);
    dd[1] = 0.f;
}

// Weight rows [0, nr) (nr <= 16) of a chunk against activation groups g0 .. g0 + ng - 1; the
// result for activation row i (i0 <= i < i1) goes to y[i * ldy + r]. [pf, pf + pf_bytes): the
// next chunk, prefetched a little at a time while this one is computed. PROMPT: llama.cpp's
// prompt arithmetic (Q4_K: one epilogue step per pair of sub-blocks; Q6_K: its tiled epilogue),
// else Q4_K's per-block epilogue and Q6_K's canonical one.
template <bool Q4, bool PROMPT>
void amx_chunk(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int g0, int ng, int64_t i0, int64_t i1,
               float* y, int64_t ldy, const uint8_t* pf, int64_t pf_bytes) {
    constexpr bool PAIRS = Q4 && PROMPT;
    constexpr int NC = PAIRS ? 4 : 1;  // C1, C2 kept per K step (pair of sub-blocks) or per block
    alignas(64) uint8_t P1[2][16 * 256], P2[2][16 * 256];  // double-buffered: block b+1 is decoded while b's tiles run
    alignas(64) int32_t C1[NC][16][16], C2[NC][16][16];
    alignas(64) int32_t mins[2][16][4]; // the mins of each row as int16 pairs
    alignas(64) float dd[2][16][2];     // (d, dmin) of each row
    alignas(64) float acc[AMX_GROUPS_MAX][16][16], macc[AMX_GROUPS_MAX][16][16];
    for (int u = 0; u < 2; ++u)
        for (int r = nr; r < 16; ++r) {  // rows past the weights: zeros
            std::memset(P1[u] + 256 * r, 0, 256);
            std::memset(P2[u] + 256 * r, 0, 256);
        }
    std::memset(mins, 0, sizeof mins);
    std::memset(dd, 0, sizeof dd);
    for (int g = 0; g < ng; ++g)
        for (int r = 0; r < 16; ++r) {
            _mm512_store_ps(acc[g][r], _mm512_setzero_ps());
            _mm512_store_ps(macc[g][r], _mm512_setzero_ps());
        }
    // The next chunk streams in while this one computes: a share of it per block, its prefetches
    // spread over the block's phases so that the memory requests never stop.
    const char* pf_cur = (const char*)pf;
    const char* const pf_end = pf_cur + pf_bytes;
    const int64_t pf_block = (pf_bytes + nb - 1) / nb;
    int64_t pf_base = 0;  // this block's share starts here
    auto prefetch_to = [&](int64_t share) {  // up to `share` (of 64) of this block's share
        const char* e = std::min(pf_end, (const char*)pf + pf_base + pf_block * share / 64);
        for (; pf_cur < e; pf_cur += 64) _mm_prefetch(pf_cur, _MM_HINT_T1);
    };
    auto decode = [&](int b, int u) {  // prefetches shares 16..48
        if constexpr (Q4) {
            for (int r0 = 0; r0 < nr; r0 += 4) {
                prefetch_to(16 + 8 * (r0 / 4 + 1));
                amx_decode_q4k<PAIRS>(W, row_bytes, b, r0, nr, P1[u], P2[u], mins[u], dd[u]);
            }
        } else {
            for (int r = 0; r < nr; ++r) {
                prefetch_to(16 + 2 * (r + 1));
                amx_decode_q6k(((const BlockQ6K*)(W + r * row_bytes))[b], P1[u] + 256 * r, P2[u] + 256 * r, dd[u][r]);
            }
        }
    };
    decode(0, 0);
    for (int b = 0; b < nb; ++b, pf_base += pf_block) {
        prefetch_to(16);
        const int u = b & 1;
        const uint8_t* p1 = P1[u];
        const uint8_t* p2 = P2[u];
        for (int g = 0; g < ng; ++g) {
            const int64_t gb = (int64_t)(g0 + g) * nb + b;
            const int8_t* B = a.bt.data() + gb * 4096;
            // Four K steps of 64 values, their tiles alternating so that one step's loads overlap
            // the previous step's products. PAIRS: each step is one pair of sub-blocks, its sums
            // stored apart before the next step starts; else the block's sums accumulate.
            for (int z = 0; z < 4; ++z) {
                if (PAIRS || z == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                }
                // C1 (tmm0) += plane 1 x B, C2 (tmm1) += plane 2 x B; tile numbers are immediates
                if (z % 2 == 0) {
                    _tile_loadd(6, B + 1024 * z, 64);
                    _tile_loadd(2, p1 + 64 * z, 256);
                    _tile_loadd(4, p2 + 64 * z, 256);
                    _tile_dpbusd(0, 2, 6);
                    _tile_dpbusd(1, 4, 6);
                } else {
                    _tile_loadd(7, B + 1024 * z, 64);
                    _tile_loadd(3, p1 + 64 * z, 256);
                    _tile_loadd(5, p2 + 64 * z, 256);
                    _tile_dpbusd(0, 3, 7);
                    _tile_dpbusd(1, 5, 7);
                }
                if (PAIRS || z == 3) {
                    _tile_stored(0, C1[PAIRS ? z : 0], 64);
                    _tile_stored(1, C2[PAIRS ? z : 0], 64);
                }
            }
            if (g == 0 && b + 1 < nb) decode(b + 1, u ^ 1);  // vector work while the tiles run
            const __m512 dx = _mm512_loadu_ps(a.dt.data() + gb * 16);
            if constexpr (!Q4) {
                const __m512i bsum = _mm512_slli_epi32(_mm512_loadu_si512(a.bp.data() + gb * 64), 12);
                for (int r = 0; r < nr; ++r) {
                    if (g == 0) prefetch_to(48 + r + 1);
                    const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_load_si512(C1[0][r]), _mm512_slli_epi32(_mm512_load_si512(C2[0][r]), 8)), bsum);
                    const __m512 s = _mm512_load_ps(acc[g][r]), d = _mm512_set1_ps(dd[u][r][0]);
                    _mm512_store_ps(acc[g][r], PROMPT ? epilogue_q6k_tiled(s, d, dx, isum) : epilogue_q6k_canon(s, d, dx, isum));
                }
                continue;
            }
            const int32_t* bp = a.bp.data() + gb * 64;
            const __m512i bpz[4] = {_mm512_loadu_si512(bp), _mm512_loadu_si512(bp + 16),
                                    _mm512_loadu_si512(bp + 32), _mm512_loadu_si512(bp + 48)};
            for (int r = 0; r < nr; ++r) {
                if (g == 0) prefetch_to(48 + r + 1);
                const int32_t* mn = mins[u][r];
                const __m512 d = _mm512_set1_ps(dd[u][r][0]), dmin = _mm512_set1_ps(dd[u][r][1]);
                __m512 s = _mm512_load_ps(acc[g][r]), sn = _mm512_load_ps(macc[g][r]);
                if constexpr (PAIRS) {
                    for (int z = 0; z < 4; ++z) {
                        const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C1[z][r]), 3), _mm512_load_si512(C2[z][r]));
                        const __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(mn[z]), bpz[z]);
                        epilogue_q4k(s, sn, d, dmin, dx, isum, msum);
                    }
                } else {
                    const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(C1[0][r]), 3), _mm512_load_si512(C2[0][r]));
                    __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(mn[0]), bpz[0]);
                    msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(mn[1]), bpz[1]);
                    msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(mn[2]), bpz[2]);
                    msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(mn[3]), bpz[3]);
                    epilogue_q4k(s, sn, d, dmin, dx, isum, msum);
                }
                _mm512_store_ps(acc[g][r], s);
                _mm512_store_ps(macc[g][r], sn);
            }
        }
        prefetch_to(64);
    }
    for (int g = 0; g < ng; ++g)
        for (int lane = 0; lane < 16; ++lane) {
            const int64_t i = (int64_t)(g0 + g) * 16 + lane;
            if (i < i0 || i >= i1) continue;
            for (int r = 0; r < nr; ++r) y[i * ldy + r] = acc[g][r][lane] - macc[g][r][lane];  // Q6_K: macc stays 0
        }
}

#endif  // SPK_AMX

// One activation row against four weight rows (decode): the four outputs' integer sums are
// reduced together, one transpose-reduce for four results instead of one per result, and the
// canonical epilogue runs on them lane-wise (lane t: weight row t). Per output the same IEEE
// operations in the same order as the kernels above, so the bits are the same.
// R activation rows (1: decode; 2: a one-token draft's verification, 7% faster than dot_q4k<2>
// over the 1.5B model's weights; 3 gained nothing) against four weight rows, each weight block
// decoded once for all R. Output y[(i0 + r) * ldy + t] for weight row t.
template <int R>
void dot_q4k_w4_rows(const uint8_t* row, size_t row_bytes, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    __m128 s[R], sn[R];
    for (int r = 0; r < R; ++r) s[r] = sn[r] = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m512i x[R][4];
        __m128i bs[R];
        for (int r = 0; r < R; ++r) {
            const int64_t ab = (int64_t)(i0 + r) * a.nb + b;
            load_x4(a.qs.data() + ab * 256, x[r]);
            bs[r] = _mm_loadu_si128((const __m128i*)(a.bs32.data() + ab * 8));
        }
        __m512i acc[R][4];
        __m128i mm[R][4];
        float d[4], dmin[4];
        for (int t = 0; t < 4; ++t) {
            const BlockQ4K& blk = ((const BlockQ4K*)(row + t * row_bytes))[b];
            prefetch(&blk, sizeof(BlockQ4K));
            d[t] = f16(blk.d);
            dmin[t] = f16(blk.dmin);
            const __m256i sm = _mm256_cvtepu8_epi16(q4k_scales(blk));
            const __m512i smz = _mm512_castsi256_si512(sm);
            const __m512i sc[4] = {_mm512_permutexvar_epi16(Q4.idx[0], smz), _mm512_permutexvar_epi16(Q4.idx[1], smz),
                                   _mm512_permutexvar_epi16(Q4.idx[2], smz), _mm512_permutexvar_epi16(Q4.idx[3], smz)};
            __m512i q[4];
            q4k_values(blk, q);
            const __m128i mins = _mm256_extracti128_si256(sm, 1);
            for (int r = 0; r < R; ++r) {
                acc[r][t] = scaled_dot4(q, sc, x[r]);
                mm[r][t] = _mm_madd_epi16(mins, bs[r]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t ab = (int64_t)(i0 + r) * a.nb + b;
            epilogue_q4k(s[r], sn[r], _mm_loadu_ps(d), _mm_loadu_ps(dmin), _mm_set1_ps(a.d[ab]), hsum4(acc[r]), hsum4(mm[r]));
        }
    }
    for (int r = 0; r < R; ++r) _mm_storeu_ps(y + (i0 + r) * ldy, _mm_sub_ps(s[r], sn[r]));
}

void dot_q6k_w4(const uint8_t* row, size_t row_bytes, int nb, const Act& a, int i, float* y) {
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; ++b) {
        const int64_t ab = (int64_t)i * a.nb + b;
        const int8_t* xq = a.qs.data() + ab * 256;
        __m512i x[4];
        load_x4(xq, x);
        const __m256i bs = _mm256_loadu_si256((const __m256i*)(a.bs16.data() + ab * 16));
        for (int t = 0; t < 4; ++t) {
            const BlockQ6K& blk = ((const BlockQ6K*)(row + t * row_bytes))[b];
            prefetch(&blk, sizeof(BlockQ6K));
            __m512i q[4];
            q6k_values(blk, q);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)blk.scales));
            const __m512i sc16z = _mm512_castsi256_si512(sc16);
            const __m512i sg[4] = {_mm512_permutexvar_epi16(Q6.idx[0], sc16z), _mm512_permutexvar_epi16(Q6.idx[1], sc16z),
                                   _mm512_permutexvar_epi16(Q6.idx[2], sc16z), _mm512_permutexvar_epi16(Q6.idx[3], sc16z)};
            const __m512i v = scaled_dot4(q, sg, x);
            const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            s[t] = epilogue_q6k(s[t], a.d[ab] * f16(blk.d), _mm512_sub_epi32(v, _mm512_zextsi256_si512(corr)));
        }
    }
    for (int t = 0; t < 4; ++t) y[t] = hsum8(s[t]);
}

template <int NR>
void dot_one(int qtype, const uint8_t* row, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    switch (qtype) {
        case T_Q4_K: dot_q4k<NR>((const BlockQ4K*)row, nb, a, i0, y, ldy); break;
        case T_Q6_K: dot_q6k<NR>((const BlockQ6K*)row, nb, a, i0, y, ldy); break;
        case T_Q8_0: dot_b32<BlockQ8_0, NR>((const BlockQ8_0*)row, nb, a, i0, y, ldy); break;
        case T_Q5_0: dot_b32<BlockQ5_0, NR>((const BlockQ5_0*)row, nb, a, i0, y, ldy); break;
        case T_Q4_0: dot_b32<BlockQ4_0, NR>((const BlockQ4_0*)row, nb, a, i0, y, ldy); break;
    }
}


void dot_tile(int nr, int qtype, const uint8_t* row, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    with_rows(nr, [&](auto R) { dot_one<decltype(R)::value>(qtype, row, nb, a, i0, y, ldy); });
}

// The prompt-row kernels (mode 1: Q4_K as llama.cpp's gemm, mode 2: Q6_K as its tiled matmul).
void dot_tile_prompt(int nr, int qtype, const uint8_t* row, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    with_rows(nr, [&](auto R) {
        constexpr int NR = decltype(R)::value;
        if (qtype == T_Q4_K) dot_q4k_pairs<NR>((const BlockQ4K*)row, nb, a, i0, y, ldy);
        else dot_q6k_one_sum<NR, true>((const BlockQ6K*)row, nb, a, i0, y, ldy);
    });
}

void dot_tile_canon(int nr, const uint8_t* row, int nb, const Act& a, int i0, float* y, int64_t ldy) {
    with_rows(nr, [&](auto R) { dot_q6k_one_sum<decltype(R)::value, false>((const BlockQ6K*)row, nb, a, i0, y, ldy); });
}


Act g_act;

// Q4_K calls (and Q6_K ones in the modes it has) with at least this many rows take the AMX
// kernel (0: never): its cost is about flat from 1 to 16 rows, the VNNI kernels' grows with each
// row (measured on a Sapphire Rapids core, the 1.5B model's weights, one thread: about even at 5
// rows for Q4_K's decode arithmetic).
int g_amx_min_rows = 5;
// Q4_K calls in its decode arithmetic with at least this many rows (Q6_K ones in its canonical
// form: twice as many) that do not take AMX take the tiled VNNI kernels (0: never). Measured on
// the 1.5B's Q4_K FFN matrices, 2 cores without AMX: 8 rows 1.0-1.3x the per-row kernels, 16 rows
// 2.0-2.6x, 512 rows 2.2-2.8x.
int g_tiled_min_rows = 8;
int g_last_path = 0;  // the path of the last spk_linear call: 1 VNNI, 2 AMX, 3 VNNI on the AMX layout
}  // namespace
}  // namespace spk

using namespace spk;

extern "C" {

int spk_abi_version() { return 5; }

// Calls with at least `rows` rows take the AMX path where it has the call's type and mode (0:
// never); returns the old value.
int spk_set_amx_min_rows(int rows) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int old = g_amx_min_rows;
    g_amx_min_rows = rows;
    return old;
}

// As spk_set_amx_min_rows, for the tiled VNNI kernels (q4k_tiled_rows, q6k_tiled_rows: activations in the
// AMX layout), which calls that do not take AMX take from this many rows (0: never).
int spk_set_tiled_min_rows(int rows) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int old = g_tiled_min_rows;
    g_tiled_min_rows = rows;
    return old;
}

// Which path the last spk_linear call took: 1 the VNNI kernels, 2 the AMX kernel, 3 the tiled VNNI kernels.
int spk_last_path() { return g_last_path; }

// Does the library have a kernel for this GGML type and row length?
int spk_supports(int qtype, int64_t k) {
    return block_bytes(qtype) != 0 && k % block_values(qtype) == 0;
}

// How a call's rows are computed (spk_linear_prompt).
enum Mode { LLAMA_DECODE = 0, LLAMA_PROMPT = 1, Q6K_CANON = 2 };

// The body of spk_linear and spk_linear_prompt.
static int linear(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y, Mode mode) {
    const bool prompt = mode == LLAMA_PROMPT, canon = mode == Q6K_CANON && qtype == T_Q6_K;
    Pool& p = pool();
    const int bv = block_values(qtype);
    const int nb = (int)(k / bv);
    const size_t row_bytes = nb * block_bytes(qtype);
#ifdef SPK_AMX
    // every Q4_K mode, and the Q6_K modes with one integer sum per block
    const bool amx = (qtype == T_Q4_K || (qtype == T_Q6_K && (prompt || canon))) && g_amx_min_rows > 0 && m >= g_amx_min_rows && amx_ok();
#else
    const bool amx = false;
#endif
    // Q6_K from twice the rows: one activation group's 16 lanes cost the same however many are
    // used, and the output head (k = 1536, 191 MB of Q6_K) at 8 rows took 13.9 ms tiled against
    // 8.0 on the per-row kernels (even at 16 rows; its FFN matrices, k = 8960, gain from 8).
    const int tiled_from = qtype == T_Q6_K ? 2 * g_tiled_min_rows : g_tiled_min_rows;
    const bool tiled = !amx && ((qtype == T_Q4_K && mode == LLAMA_DECODE) || canon) && g_tiled_min_rows > 0 && m >= tiled_from;
    g_last_path = amx ? 2 : tiled ? 3 : 1;
    Act& a = g_act;
    a.nb = nb;
    a.bsize = bv;
    const int64_t groups = (m + 15) / 16;
    if (amx || tiled) {
        a.bt.resize((size_t)groups * nb * 4096);
        a.dt.resize((size_t)groups * nb * 16);
        a.bp.resize((size_t)groups * nb * 64);
        a.bq.resize(tiled && qtype == T_Q6_K ? (size_t)groups * nb * 128 : 0);
    } else {
        a.qs.resize((size_t)m * nb * bv);
        a.d.resize((size_t)m * nb);
        if (bv == 256) {
            a.bs16.resize((size_t)m * nb * 16);
            a.bs32.resize((size_t)m * nb * 8);
        }
    }
    // Work items: the rows, or for AMX each (group, block) of the B tiles.
    const int64_t items = amx || tiled ? groups * nb : m;
    auto quantize = [&](int64_t i) {
        if (amx || tiled)
            quantize_q8k_block_amx(x, m, k, nb, qtype == T_Q4_K, qtype == T_Q4_K && !prompt, i / nb, (int)(i % nb), a);
        else if (bv == 256)
            quantize_q8k_row(x + i * k, nb, qtype == T_Q4_K, a.qs.data() + i * nb * 256, a.d.data() + i * nb,
                             a.bs16.data() + i * nb * 16, a.bs32.data() + i * nb * 8);
        else
            quantize_q80_row(x + i * k, nb, a.qs.data() + i * nb * 32, a.d.data() + i * nb);
    };
    if (m < 4 || items < 2) {
        for (int64_t i = 0; i < items; ++i) quantize(i);
    } else {
        std::atomic<int64_t> next{0};
        p.run([&](int, int) {
            for (int64_t i; (i = next.fetch_add(1)) < items;) quantize(i);
        });
    }

    if (bv == 32 && m >= 2) {  // the row pairs of dot_b32
        a.xp.resize((size_t)(m / 2) * nb * 64);
        a.dp.resize((size_t)(m / 2) * nb * 16);
        for (int64_t i = 0; i + 1 < m; i += 2)
            for (int b = 0; b < nb; ++b)
                for (int h = 0; h < 2; ++h) {
                    const int64_t ab = (i + h) * nb + b, pb = (i / 2) * nb + b;
                    std::memcpy(a.xp.data() + pb * 64 + 32 * h, a.qs.data() + ab * 32, 32);
                    std::fill(a.dp.data() + pb * 16 + 8 * h, a.dp.data() + pb * 16 + 8 * h + 8, a.d[ab]);
                }
    }

    const uint8_t* W = (const uint8_t*)weights;
#ifdef SPK_AMX
    const int64_t w_bytes = n * (int64_t)row_bytes;
#endif
    auto rows = [&](int64_t r0, int64_t r1, int64_t a0, int64_t a1) {
#ifdef SPK_AMX
        if (amx) {  // r1 - r0 <= ROW_CHUNK = 16, a0 a multiple of 16, a1 - a0 <= ACT_TILE
            const int64_t pf0 = std::min(w_bytes, r1 * (int64_t)row_bytes);
            const int64_t pf1 = std::min(w_bytes, (2 * r1 - r0) * (int64_t)row_bytes);
            const int g0 = (int)(a0 / 16), ng = (int)((a1 - a0 + 15) / 16);
            const auto chunk = qtype == T_Q4_K ? (prompt ? amx_chunk<true, true> : amx_chunk<true, false>)
                                               : (prompt ? amx_chunk<false, true> : amx_chunk<false, false>);
            chunk(W + r0 * row_bytes, row_bytes, nb, (int)(r1 - r0), a, g0, ng, a0, a1, y + r0, n, W + pf0, pf1 - pf0);
            return;
        }
#endif
        if (tiled) {  // a0 a multiple of 16, a1 - a0 <= ACT_TILE
            const int64_t g0 = a0 / 16;
            const int ng = (int)((a1 - a0 + 15) / 16);
            linear_tiled(qtype, W + r0 * row_bytes, row_bytes, nb, (int)(r1 - r0), a, g0, ng, a0, a1, y + r0, n);
            return;
        }
        if (a1 - a0 == 1 && !prompt) {  // decode: four weight rows at a time
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4) {
                const uint8_t* w4 = W + r * row_bytes;
                float* y4 = y + a0 * n + r;
                switch (qtype) {
                    case T_Q4_K: dot_q4k_w4_rows<1>(w4, row_bytes, nb, a, (int)a0, y + r, n); break;
                    case T_Q6_K:
                        if (canon) dot_q6k_canon_w4(w4, row_bytes, nb, a, (int)a0, y4);
                        else dot_q6k_w4(w4, row_bytes, nb, a, (int)a0, y4);
                        break;
                    case T_Q8_0: dot_b32_w4<BlockQ8_0>(w4, row_bytes, nb, a, (int)a0, y4); break;
                    case T_Q5_0: dot_b32_w4<BlockQ5_0>(w4, row_bytes, nb, a, (int)a0, y4); break;
                    case T_Q4_0: dot_b32_w4<BlockQ4_0>(w4, row_bytes, nb, a, (int)a0, y4); break;
                }
            }
            for (; r < r1; ++r) {
                if (canon) dot_tile_canon(1, W + r * row_bytes, nb, a, (int)a0, y + a0 * n + r, n);
                else dot_tile(1, qtype, W + r * row_bytes, nb, a, (int)a0, y + a0 * n + r, n);
            }
            return;
        }
        if (qtype == T_Q4_K && !prompt && a1 - a0 == 2) {  // a one-token draft's verification: as decode
            int64_t r = r0;
            for (; r + 4 <= r1; r += 4) dot_q4k_w4_rows<2>(W + r * row_bytes, row_bytes, nb, a, (int)a0, y + r, n);
            for (; r < r1; ++r) dot_tile(2, qtype, W + r * row_bytes, nb, a, (int)a0, y + a0 * n + r, n);
            return;
        }
        for (int64_t i0 = a0; i0 < a1; i0 += NR_MAX) {
            const int nr = (int)std::min<int64_t>(NR_MAX, a1 - i0);
            for (int64_t r = r0; r < r1; ++r) {
                if (prompt) dot_tile_prompt(nr, qtype, W + r * row_bytes, nb, a, (int)i0, y + i0 * n + r, n);
                else if (canon) dot_tile_canon(nr, W + r * row_bytes, nb, a, (int)i0, y + i0 * n + r, n);
                else dot_tile(nr, qtype, W + r * row_bytes, nb, a, (int)i0, y + i0 * n + r, n);
            }
        }
    };
    if (m <= ACT_TILE) {
        // Few rows: the weights stream from memory once. Each thread starts on its own span of
        // weight rows and walks it chunk by chunk in order (one sequential stream, which the
        // hardware prefetcher follows); a thread that finishes early helps with the others'
        // spans, so a thread the OS descheduled does not hold up the call.
        const int nt = p.size();
        const int64_t n_chunks = (n + ROW_CHUNK - 1) / ROW_CHUNK;
        std::vector<std::atomic<int64_t>> cursor(nt);
        std::vector<int64_t> end(nt);
        for (int s = 0; s < nt; ++s) {
            cursor[s].store(n_chunks * s / nt);
            end[s] = n_chunks * (s + 1) / nt;
        }
        p.run([&](int t, int) {
#ifdef SPK_AMX
            if (amx) tiles_ready();
#endif
            for (int k = 0; k < nt; ++k) {
                const int s = (t + k) % nt;
                for (int64_t c; (c = cursor[s].fetch_add(1)) < end[s];)
                    rows(c * ROW_CHUNK, std::min(n, (c + 1) * ROW_CHUNK), 0, m);
            }
        });
    } else {
        // Many rows (a prompt): tiles of activation rows that stay in L2 against chunks of
        // weight rows, handed out in order.
        const int64_t n_chunks = (n + ROW_CHUNK - 1) / ROW_CHUNK;
        const int64_t n_tiles = (m + ACT_TILE - 1) / ACT_TILE;
        std::atomic<int64_t> next{0};
        p.run([&](int, int) {
#ifdef SPK_AMX
            if (amx) tiles_ready();
#endif
            for (int64_t item; (item = next.fetch_add(1)) < n_chunks * n_tiles;) {
                const int64_t tile = item / n_chunks, chunk = item % n_chunks;
                rows(chunk * ROW_CHUNK, std::min(n, (chunk + 1) * ROW_CHUNK), tile * ACT_TILE, std::min(m, (tile + 1) * ACT_TILE));
            }
        });
    }
    return 0;
}

// y[m, n] (row stride n) = x[m, k] @ W^T where W holds n rows of k values in GGML type qtype.
int spk_linear(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y) {
    if (!spk_supports(qtype, k) || n <= 0 || m <= 0) return -1;
    std::lock_guard<std::mutex> lock(g_call_mu);
    return linear(qtype, weights, n, k, x, m, y, LLAMA_DECODE);
}

// As spk_linear, every row computed the one way `mode` says (0: llama.cpp's decode arithmetic,
// 1: its prompt arithmetic, 2: Q6_K's canonical epilogue; see spk_linear_prompt).
int spk_linear_mode(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y, int mode) {
    if (!spk_supports(qtype, k) || n <= 0 || m <= 0 || mode < 0 || mode > 2) return -1;
    std::lock_guard<std::mutex> lock(g_call_mu);
    return linear(qtype, weights, n, k, x, m, y, (Mode)mode);
}

// As spk_linear, with row i computed as kind[i] says:
//   bit 0: a Q4_K row in the whole groups of four of a llama.cpp prompt batch (its repacked gemm;
//          the other rows, and every decode row, take its gemv, which is spk_linear's);
//   bit 1: a Q6_K row of a llama.cpp prompt batch of eight rows or more (its tiled matmul);
//   bit 2: a Q6_K row where llama.cpp's own arithmetic is not reproduced anyway (past
//          LLAMA_SPLIT_KV cached tokens, see backend.py): the canonical epilogue, which the AMX
//          kernel shares, instead of llama.cpp's eight lane chains, which it cannot do.
// The kind of a row must follow from the row alone (its position, its prompt), so that a row
// computes the same with any other rows.
int spk_linear_prompt(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y,
                      const uint8_t* kind) {
    if (!spk_supports(qtype, k) || n <= 0 || m <= 0) return -1;
    std::lock_guard<std::mutex> lock(g_call_mu);
    if (qtype != T_Q4_K && qtype != T_Q6_K) return linear(qtype, weights, n, k, x, m, y, LLAMA_DECODE);
    auto mode_of = [&](uint8_t kd) {
        if (qtype == T_Q4_K) return (kd & 1) ? LLAMA_PROMPT : LLAMA_DECODE;
        return (kd & 2) ? LLAMA_PROMPT : (kd & 4) ? Q6K_CANON : LLAMA_DECODE;
    };
    for (int64_t a = 0; a < m;) {  // runs of rows of one kind
        const Mode mode = mode_of(kind[a]);
        int64_t b = a + 1;
        while (b < m && mode_of(kind[b]) == mode) ++b;
        linear(qtype, weights, n, k, x + a * k, b - a, y + a * n, mode);
        a = b;
    }
    return 0;
}

}  // extern "C"
