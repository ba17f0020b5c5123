// The tiled VNNI kernels: Q4_K (decode and prompt arithmetic) and Q6_K (canonical form and
// prompt arithmetic) with the
// activations in the AMX layout, for CPUs without AMX (or with it turned off) from a few rows.
// 16 activation rows sit in a zmm's lanes, so the block sums need no horizontal reduction.
// AVX-512 builds only (avx2_tiled.cpp has them on ymm for AVX2).
#include "kernels.h"

#if SPK_AVX512

#include "epilogue.h"
#include "unpack.h"

#include <algorithm>
#include <cstring>

namespace spk SPK_HIDDEN {

// Q4_K on VNNI with the activations in the AMX layout (CPUs without AMX, from a few rows): the 16
// rows of an activation group sit in the 16 int32 lanes of a zmm, four bytes each (value v of
// row i at dword [v/4][i], q4k_order), and each weight dword is broadcast against them. A lane's
// sum then collects one (weight row, activation row) pair with no horizontal reduction: per 32
// values, 8 vpdpbusd give the sub-block's exact sum, which its 6-bit scale multiplies. That is the
// same integer isum and msum as dot_q4k's, and the same canonical epilogue lane-wise, so the bits
// are the other kernels' (the tests compare them).

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

// The integer sums of one sub-block pair (sub-blocks 2z, 2z + 1) of R decoded weight rows against
// an activation group in natural order (llama.cpp's prompt arithmetic, one epilogue step per pair):
// sub-block s sits at run Q4K_RUN_SUB[s] of the decoded weights (the map is its own inverse) and
// at dwords 8s .. 8s + 7 of the group's B tile.
template <int R>
inline void tiled_pair_isums(const uint8_t (*qb)[256], const int8_t* B, const uint8_t (*scm)[16], int z, __m512i* isum) {
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 2 * z; s < 2 * z + 2; ++s) {
        const int run = Q4K_RUN_SUB[s];
        __m512i c[R];
        for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_si512();
        for (int t = 0; t < 8; ++t) {
            const __m512i bz = _mm512_loadu_si512(B + 64 * (8 * s + t));
            for (int r = 0; r < R; ++r) {
                int32_t w;
                std::memcpy(&w, qb[r] + 32 * run + 4 * t, 4);
                c[r] = _mm512_dpbusd_epi32(c[r], _mm512_set1_epi32(w), bz);
            }
        }
        for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(c[r], _mm512_set1_epi32(scm[r][s])));
    }
}

// PAIRS: llama.cpp's prompt arithmetic (its repacked gemm: the FMA chains step once per pair of
// sub-blocks, the activations in natural order); else its decode arithmetic (one step per block,
// the activations in q4k_order).
template <bool PAIRS>
static void q4k_tiled_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0,
                           int64_t i1, float* y, int64_t ldy, ChunkPrefetch& pf) {
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
        pf.block();
        for (int r = 0; r < nr; ++r) {
            const BlockQ4K& blk = ((const BlockQ4K*)(W + r * row_bytes))[b];
            d[r] = f16(blk.d);
            dmin[r] = f16(blk.dmin);
            _mm_store_si128((__m128i*)scm[r], q4k_scales(blk));
            __m512i q[4];
            q4k_values(blk, q);
            for (int z = 0; z < 4; ++z) _mm512_store_si512(qb[r] + 64 * z, q[z]);
        }
        for (int g = 0; g < ng; ++g) {
            const int64_t gb = (g0 + g) * nb + b;
            const int8_t* B = a.bt.data() + gb * 4096;
            const __m512 dx = _mm512_loadu_ps(a.dt.data() + gb * 16);
            const int32_t* bp = a.bp.data() + gb * 64;  // int16 pairs of the 32-value sums, pair p: sub-blocks 2p, 2p + 1
            if constexpr (PAIRS) {
                for (int z = 0; z < 4; ++z) {
                    __m512i isum[R];
                    tiled_pair_isums<R>(qb, B, scm, z, isum);
                    const __m512i bpz = _mm512_loadu_si512(bp + 16 * z);
                    for (int r = 0; r < nr; ++r) {
                        const uint8_t* mn = scm[r] + 8;
                        const __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(pair16(mn[2 * z], mn[2 * z + 1])), bpz);
                        __m512 s = _mm512_load_ps(acc[g][r]), sn = _mm512_load_ps(macc[g][r]);
                        epilogue_q4k(s, sn, _mm512_set1_ps(d[r]), _mm512_set1_ps(dmin[r]), dx, isum[r], msum);
                        _mm512_store_ps(acc[g][r], s);
                        _mm512_store_ps(macc[g][r], sn);
                    }
                }
                continue;
            }
            __m512i isum[R];  // the 32-value runs of q4k_values' order, one sub-block each
            tiled_isums<R, 32>(qb, B, [&](int r, int k) { return (int32_t)scm[r][Q4K_RUN_SUB[k]]; }, isum);
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

// Q6_K's canonical form (Q6K_CANON) the same way: per 16 values, 4 vpdpbusd of the unsigned 6-bit
// values give sum q x, its int8 scale multiplies it, and the -32 offset comes off at the end as
// 32 * sum_j sc_j * bsum16_j (the activations' 16-value sums, from the quantizer): the same exact
// isum as dot_q6k_canon's, and its epilogue lane-wise. PROMPT: llama.cpp's tiled prompt matmul
// instead (the same integer, epilogue_q6k_tiled's rounding).
template <bool PROMPT>
static void q6k_tiled_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0,
                           int64_t i1, float* y, int64_t ldy, ChunkPrefetch& pf) {
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
        pf.block();
        for (int r = 0; r < nr; ++r) {
            const BlockQ6K& blk = ((const BlockQ6K*)(W + r * row_bytes))[b];
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
                const __m512 s = _mm512_load_ps(acc[g][r]), dr = _mm512_set1_ps(d[r]);
                _mm512_store_ps(acc[g][r], PROMPT ? epilogue_q6k_tiled(s, dr, dx, v) : epilogue_q6k_canon(s, dr, dx, v));
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

// Weight rows [0, nr) against activation groups g0 .. g0 + ng - 1 (ng <= TILED_GROUPS_MAX), while
// [next, next + next_bytes) streams into L2 (each pass of TILED_ROWS rows takes its share).
void linear_tiled(int qtype, bool prompt, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng,
                  int64_t i0, int64_t i1, float* y, int64_t ldy, const uint8_t* next, int64_t next_bytes) {
    const auto kernel = qtype == T_Q4_K ? (prompt ? q4k_tiled_rows<true> : q4k_tiled_rows<false>)
                                        : (prompt ? q6k_tiled_rows<true> : q6k_tiled_rows<false>);
    const int passes = (nr + TILED_ROWS - 1) / TILED_ROWS;
    for (int k = 0; k < passes; ++k) {
        const int64_t from = next_bytes * k / passes, to = next_bytes * (k + 1) / passes;
        ChunkPrefetch pf(next + from, to - from, nb);
        const int r = k * TILED_ROWS;
        kernel(W + r * row_bytes, row_bytes, nb, std::min(TILED_ROWS, nr - r), a, g0, ng, i0, i1, y + r, ldy, pf);
    }
}

}  // namespace spk

#endif  // SPK_AVX512
