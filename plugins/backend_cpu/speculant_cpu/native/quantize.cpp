// Quantizing the activations once per call, as llama.cpp's CPU backend does: Q8_K (blocks of
// 256) for the K-quants, in the VNNI layout (rows) or the AMX layout (16-row groups, also the
// tiled VNNI kernels'), and Q8_0 (blocks of 32) for the rest. The integers here are what every
// kernel's exact sums are built from.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace spk SPK_HIDDEN {

// llama.cpp's quantize_row_q8_K for one block of 256: the value of largest magnitude (the first
// such) maps to -127, round to nearest even. q in natural order; bs16/bs32: sums of each 16 / 32
// values. (Vectorized; the same IEEE operations as llama.cpp's scalar loop, on either ISA.)
#if SPK_AVX512
static void quantize_q8k_block(const float* x, int8_t* q, float* d, int16_t* bs16, int16_t* bs32) {
    __m512 v[16];
    __m512 am = _mm512_setzero_ps();
    for (int t = 0; t < 16; ++t) {
        v[t] = _mm512_loadu_ps(x + 16 * t);
        am = _mm512_max_ps(am, _mm512_abs_ps(v[t]));
    }
    const float amax = _mm512_reduce_max_ps(am);
    if (!(amax > 0.f)) {
        std::memset(q, 0, 256);
        *d = 0.f;
        std::memset(bs16, 0, 32);
        std::memset(bs32, 0, 16);
        return;
    }
    float max = 0.f;
    for (int t = 0; t < 16; ++t) {
        const __mmask16 hit = _mm512_cmpeq_ps_mask(_mm512_abs_ps(v[t]), _mm512_set1_ps(amax));
        if (hit) { max = x[16 * t + __builtin_ctz(hit)]; break; }
    }
    const float iscale = -127.f / max;
    const __m512 is = _mm512_set1_ps(iscale);
    // dword o of the packed result sits at dword 4 (o % 4) + o / 4 after the two in-lane packs
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    alignas(64) uint64_t sad[32];
    for (int z = 0; z < 4; ++z) {
        __m512i qi[4];
        for (int t = 0; t < 4; ++t)  // cvtps2dq rounds to nearest even (the default MXCSR), as nearbyint does
            qi[t] = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(is, v[4 * z + t])), _mm512_set1_epi32(127));
        const __m512i q8 = _mm512_permutexvar_epi32(order, _mm512_packs_epi16(_mm512_packs_epi32(qi[0], qi[1]), _mm512_packs_epi32(qi[2], qi[3])));
        _mm512_storeu_si512(q + 64 * z, q8);
        // sums of each 8 values, as unsigned bytes q + 128
        _mm512_store_si512(sad + 8 * z, _mm512_sad_epu8(_mm512_xor_si512(q8, _mm512_set1_epi8((char)0x80)), _mm512_setzero_si512()));
    }
    *d = 1.f / iscale;
    for (int g = 0; g < 16; ++g) bs16[g] = (int16_t)((int)(sad[2 * g] + sad[2 * g + 1]) - 16 * 128);
    for (int g = 0; g < 8; ++g) bs32[g] = (int16_t)(bs16[2 * g] + bs16[2 * g + 1]);
}
#else
static void quantize_q8k_block(const float* x, int8_t* q, float* d, int16_t* bs16, int16_t* bs32) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 am = _mm256_setzero_ps();
    for (int t = 0; t < 32; ++t) am = _mm256_max_ps(am, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * t)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    if (!(amax > 0.f)) {
        std::memset(q, 0, 256);
        *d = 0.f;
        std::memset(bs16, 0, 32);
        std::memset(bs32, 0, 16);
        return;
    }
    float max = 0.f;
    for (int t = 0; t < 32; ++t) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * t)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hit) { max = x[8 * t + __builtin_ctz(hit)]; break; }
    }
    const float iscale = -127.f / max;
    const __m256 is = _mm256_set1_ps(iscale);
    // dword o of the result is dword 4 (o % 2) + o / 2 of the in-lane packs
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    alignas(32) uint64_t sad[32];
    for (int z = 0; z < 8; ++z) {
        __m256i qi[4];
        for (int t = 0; t < 4; ++t)  // cvtps2dq rounds to nearest even (the default MXCSR), as nearbyint does
            qi[t] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(is, _mm256_loadu_ps(x + 32 * z + 8 * t))), _mm256_set1_epi32(127));
        const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
        _mm256_storeu_si256((__m256i*)(q + 32 * z), q8);
        // sums of each 8 values, as unsigned bytes q + 128
        _mm256_store_si256((__m256i*)(sad + 4 * z), _mm256_sad_epu8(_mm256_xor_si256(q8, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256()));
    }
    *d = 1.f / iscale;
    for (int g = 0; g < 16; ++g) bs16[g] = (int16_t)((int)(sad[2 * g] + sad[2 * g + 1]) - 16 * 128);
    for (int g = 0; g < 8; ++g) bs32[g] = (int16_t)(bs16[2 * g] + bs16[2 * g + 1]);
}
#endif

// VNNI layout. `q4k_order` stores each 128 values as [0..31, 64..95, 32..63, 96..127] so that a
// 64-byte load lines up with the low or high nibbles of a Q4_K block's 64 packed bytes.
void quantize_q8k_row(const float* x, int nb, bool q4k_order, int8_t* qs, float* d, int16_t* bs16, int16_t* bs32) {
    for (int b = 0; b < nb; ++b, x += 256) {
        int8_t q[256];
        quantize_q8k_block(x, q, d + b, bs16 + 16 * b, bs32 + 8 * b);
        int8_t* out = qs + 256 * b;
        if (q4k_order) {
            for (int h = 0; h < 2; ++h) {
                const int8_t* src = q + 128 * h;
                int8_t* dst = out + 128 * h;
                std::memcpy(dst, src, 32);
                std::memcpy(dst + 32, src + 64, 32);
                std::memcpy(dst + 64, src + 32, 32);
                std::memcpy(dst + 96, src + 96, 32);
            }
        } else {
            std::memcpy(out, q, 256);
        }
    }
}

// AMX layout: row i of the call goes to lane i % 16 of group i / 16, its values in the order of
// the weight planes: q4k_order for Q4_K by blocks, natural for Q4_K by pairs of sub-blocks and for
// Q6_K; rows past m are zero rows. One work item is block b of group g, all 16 lanes: a B tile
// interleaves the lanes every 4 bytes, so two threads each writing their own rows into it would
// fight over every cache line of it (that made quantizing cost more than the matmul on small
// calls). `pairs` (the tiled kernels' two-weight-row form, tiled_pairs.cpp): groups of 8 rows,
// row i in lanes 2 (i % 8) and 2 (i % 8) + 1 of group i / 8, so that one weight row meets the
// group in the even lanes and another in the odd ones.
void quantize_q8k_block_amx(const float* x, int64_t m, int64_t k, int nb, bool q4k, bool q4k_order, int64_t g, int b, Act& a,
                            bool pairs) {
    const int rows = pairs ? 8 : 16;   // rows per group
    const int shift = pairs ? 1 : 0;   // lane >> shift: the lane's row in the group
    alignas(64) int8_t q[16][256];
    int16_t bs16[16][16], bs32[16][8];
    float d[16];
    const int64_t gb = g * nb + b;
    for (int j = 0; j < rows; ++j) {
        const int64_t i = g * rows + j;
        d[j] = 0.f;
        if (i < m) {
            quantize_q8k_block(x + i * k + 256 * b, q[j], &d[j], bs16[j], bs32[j]);
        } else {
            std::memset(q[j], 0, 256);
            std::memset(bs16[j], 0, sizeof bs16[j]);
            std::memset(bs32[j], 0, sizeof bs32[j]);
        }
    }
    for (int lane = 0; lane < 16; ++lane) a.dt[gb * 16 + lane] = d[lane >> shift];
    // the tile: dword v of every lane, v = 0 .. 63; q4k_order: within each 128 values, the
    // 32-value segments in the order 0, 2, 1, 3
    int32_t* bt = (int32_t*)(a.bt.data() + gb * 4096);
    for (int v = 0; v < 64; ++v) {
        const int w = v % 32, seg = w / 8;
        const int src = q4k_order ? (v - w) + (seg == 1 ? 2 : seg == 2 ? 1 : seg) * 8 + w % 8 : v;
        for (int lane = 0; lane < 16; ++lane) std::memcpy(bt + 16 * v + lane, q[lane >> shift] + 4 * src, 4);
    }
    int32_t* bp = a.bp.data() + gb * 64;
    if (!q4k && !a.bq.empty()) {
        int32_t* bq = a.bq.data() + gb * 128;
        for (int lane = 0; lane < 16; ++lane)
            for (int p = 0; p < 8; ++p) bq[16 * p + lane] = pair16(bs16[lane >> shift][2 * p], bs16[lane >> shift][2 * p + 1]);
    }
    for (int lane = 0; lane < 16; ++lane) {
        const int j = lane >> shift;
        if (q4k) {
            for (int p = 0; p < 4; ++p) bp[16 * p + lane] = pair16(bs32[j][2 * p], bs32[j][2 * p + 1]);
        } else {
            int s = 0;
            for (int t = 0; t < 16; ++t) s += bs16[j][t];
            bp[lane] = s;
        }
    }
}

// llama.cpp's x86 quantize_row_q8_0: scale amax/127 stored as fp16, values x*127/amax rounded
// to nearest even.
void quantize_q80_row(const float* x, int nb, int8_t* qs, float* d) {
    for (int b = 0; b < nb; ++b, x += 32) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < 32; ++j) qs[32 * b + j] = (int8_t)(int)std::nearbyint(x[j] * id);
        d[b] = f16(_cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT));
    }
}

}  // namespace spk
