// The tiled kernels on AVX2: tiled.cpp's arithmetic on the same activation layout
// (quantize_q8k_block_amx's 16-row groups), each group taken as two halves of 8 rows, a half's
// rows in the 8 int32 lanes of a ymm. Each weight dword is broadcast against them, so a lane's
// sum collects one (weight row, activation row) pair with no horizontal reduction: per run of
// values with one scale (a sub-block), the exact sum, which the scale multiplies. The same
// integers and the same epilogues lane-wise (epilogue.h), so the same bits (tests).
//
// With AVX-VNNI a vpdpbusd covers 4 values of 8 rows. Without it, vpmaddubsw gives the same 4
// values of 8 rows as int16 pairs, which add up in int16 over a whole Q4_K sub-block (16
// products of at most 15 x 128 a lane: no overflow) before one vpmaddwd applies the scale: 9
// multiplies a sub-block where the per-row kernels (avx2_k.h) take 16, a vpmaddubsw and a
// vpmaddwd per 32 values of each activation row. (Q6_K's values reach 63: two vpmaddubsw a
// vpmaddwd.)
#include "kernels.h"

#if SPK_AVX2

#include "epilogue.h"
#include "unpack.h"

#include <algorithm>
#include <cstring>

namespace spk SPK_HIDDEN {

// Weight rows per pass: their sums (4) and the sub-block's partial sums (4), the activation ymm
// and the broadcast weight fit in the 16 ymm registers.
constexpr int AVX2_TILED_ROWS = 4;

inline __m256i bcast32(const uint8_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return _mm256_set1_epi32(w);
}

// A sub-block scale as run_isums takes it: for vpdpbusd's sums a multiplier, for vpmaddwd's an int16
// pair (made once a block, not once a half group).
inline int32_t scale_operand(int v) { return SPK_AVXVNNI ? v : pair16((int16_t)v, (int16_t)v); }

// isum[r] += scale of row r (scale[r], as scale_operand makes it) * (the sum over N dwords of
// weight row r's dwords wt0.. against the half group's activation dwords bt0..): one run
// (sub-block) of every row of the pass.
template <int N>
inline void run_isums(const uint8_t (*qb)[256], const int8_t* Bh, int wt0, int bt0, const int32_t* scale, __m256i* isum) {
    constexpr int R = AVX2_TILED_ROWS;
#if SPK_AVXVNNI
    __m256i c[R];
    for (int r = 0; r < R; ++r) c[r] = _mm256_setzero_si256();
    for (int u = 0; u < N; ++u) {
        const __m256i bz = _mm256_loadu_si256((const __m256i*)(Bh + 64 * (bt0 + u)));  // the half's 8 lanes of dword bt0 + u
        for (int r = 0; r < R; ++r) {
            c[r] = _mm256_dpbusd_avx_epi32(c[r], bcast32(qb[r] + 4 * (wt0 + u)), bz);
            asm("" : "+x"(c[r]));  // in order: regrouped, one row's chain ran alone (latency bound)
        }
    }
    for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(c[r], _mm256_set1_epi32(scale[r])));
#else
    constexpr int IN16 = N == 8 ? 8 : 2;  // vpmaddubsw sums that fit in int16 (Q4_K: 8 of 15 x 128 x 2; Q6_K: 2 of 63 x 128 x 2)
    for (int u0 = 0; u0 < N; u0 += IN16) {
        __m256i c[R];
        for (int r = 0; r < R; ++r) c[r] = _mm256_setzero_si256();
        for (int u = u0; u < u0 + IN16; ++u) {
            const __m256i bz = _mm256_loadu_si256((const __m256i*)(Bh + 64 * (bt0 + u)));
            for (int r = 0; r < R; ++r) {
                c[r] = _mm256_add_epi16(c[r], _mm256_maddubs_epi16(bcast32(qb[r] + 4 * (wt0 + u)), bz));
                asm("" : "+x"(c[r]));  // in order: regrouped by the compiler, the products spill to the stack
            }
        }
        for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(c[r], _mm256_set1_epi32(scale[r])));
    }
#endif
}

// A Q4_K block's values in q4k_values' order (tiled.cpp): the low nibbles of packed bytes 0..63,
// their high nibbles, then the same of bytes 64..127; run k of 32 bytes is sub-block Q4K_RUN_SUB[k].
inline void q4k_values_ymm(const BlockQ4K& blk, uint8_t* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 2; ++t) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(blk.qs + 64 * h + 32 * t));
            _mm256_store_si256((__m256i*)(out + 128 * h + 32 * t), _mm256_and_si256(q, m4));
            _mm256_store_si256((__m256i*)(out + 128 * h + 64 + 32 * t), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
        }
}

// A Q6_K block's values (q + 32, 0..63) in natural order (llama.cpp's AVX2 unpacking).
inline void q6k_values_ymm(const BlockQ6K& blk, uint8_t* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk.qh + 32 * h));
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk.ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk.ql + 64 * h + 32));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4))};
        for (int c = 0; c < 4; ++c) _mm256_store_si256((__m256i*)(out + 128 * h + 32 * c), q[c]);
    }
}

// The halves of group g that hold rows of [i0, i1).
inline bool half_used(int64_t g, int h, int64_t i0, int64_t i1) {
    const int64_t first = g * 16 + 8 * h;
    return first < i1 && first + 8 > i0;
}

// Q4_K, PROMPT: llama.cpp's prompt arithmetic (one epilogue step per pair of sub-blocks, the
// activations in natural order); else its decode arithmetic (one per block, q4k_order).
template <bool PROMPT>
static void q4k_tiled_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0,
                           int64_t i1, float* y, int64_t ldy, ChunkPrefetch& pf) {
    constexpr int R = AVX2_TILED_ROWS;
    alignas(32) uint8_t qb[R][256];
    alignas(16) uint8_t scm[R][16];  // [sc0..sc7, mn0..mn7] of each row
    alignas(32) float acc[TILED_GROUPS_MAX][2][R][8], macc[TILED_GROUPS_MAX][2][R][8];
    float d[R] = {}, dmin[R] = {};
    std::memset(qb, 0, sizeof qb);  // rows past nr stay zero: their sums are 0
    std::memset(scm, 0, sizeof scm);
    std::memset(acc, 0, sizeof acc);
    std::memset(macc, 0, sizeof macc);
    for (int b = 0; b < nb; ++b) {
        pf.block();
        for (int r = 0; r < nr; ++r) {
            const BlockQ4K& blk = ((const BlockQ4K*)(W + r * row_bytes))[b];
            d[r] = f16(blk.d);
            dmin[r] = f16(blk.dmin);
            _mm_store_si128((__m128i*)scm[r], q4k_scales(blk));
            q4k_values_ymm(blk, qb[r]);
        }
        int32_t sc[8][R];  // sub-block s's scale of each row
        for (int s = 0; s < 8; ++s)
            for (int r = 0; r < R; ++r) sc[s][r] = scale_operand(scm[r][s]);
        for (int g = 0; g < ng; ++g)
            for (int h = 0; h < 2; ++h) {
                if (!half_used(g0 + g, h, i0, i1)) continue;
                const int64_t gb = (g0 + g) * nb + b;
                const int8_t* Bh = a.bt.data() + gb * 4096 + 32 * h;  // lanes 8h .. 8h + 7 of each dword
                const __m256 dx = _mm256_loadu_ps(a.dt.data() + gb * 16 + 8 * h);
                const int32_t* bp = a.bp.data() + gb * 64 + 8 * h;  // int16 pairs of the 32-value sums, pair k at 16k
                if constexpr (PROMPT) {
                    for (int k = 0; k < 4; ++k) {
                        __m256i isum[R];
                        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
                        // sub-block s: run Q4K_RUN_SUB[s] of the weights, dwords 8s.. of the natural-order tile
                        run_isums<8>(qb, Bh, 8 * Q4K_RUN_SUB[2 * k], 16 * k, sc[2 * k], isum);
                        run_isums<8>(qb, Bh, 8 * Q4K_RUN_SUB[2 * k + 1], 16 * k + 8, sc[2 * k + 1], isum);
                        const __m256i bpk = _mm256_loadu_si256((const __m256i*)(bp + 16 * k));
                        for (int r = 0; r < nr; ++r) {
                            const uint8_t* mn = scm[r] + 8;
                            const __m256i msum = dpwssd(_mm256_setzero_si256(), _mm256_set1_epi32(pair16(mn[2 * k], mn[2 * k + 1])), bpk);
                            __m256 s = _mm256_load_ps(acc[g][h][r]), sn = _mm256_load_ps(macc[g][h][r]);
                            epilogue_q4k(s, sn, _mm256_set1_ps(d[r]), _mm256_set1_ps(dmin[r]), dx, isum[r], msum);
                            _mm256_store_ps(acc[g][h][r], s);
                            _mm256_store_ps(macc[g][h][r], sn);
                        }
                    }
                    continue;
                }
                __m256i isum[R];
                for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
                for (int k = 0; k < 8; ++k) run_isums<8>(qb, Bh, 8 * k, 8 * k, sc[Q4K_RUN_SUB[k]], isum);  // both in q4k_order
                for (int r = 0; r < nr; ++r) {
                    const uint8_t* mn = scm[r] + 8;
                    __m256i msum = _mm256_setzero_si256();
                    for (int k = 0; k < 4; ++k)
                        msum = dpwssd(msum, _mm256_set1_epi32(pair16(mn[2 * k], mn[2 * k + 1])),
                                      _mm256_loadu_si256((const __m256i*)(bp + 16 * k)));
                    __m256 s = _mm256_load_ps(acc[g][h][r]), sn = _mm256_load_ps(macc[g][h][r]);
                    epilogue_q4k(s, sn, _mm256_set1_ps(d[r]), _mm256_set1_ps(dmin[r]), dx, isum[r], msum);
                    _mm256_store_ps(acc[g][h][r], s);
                    _mm256_store_ps(macc[g][h][r], sn);
                }
            }
    }
    for (int g = 0; g < ng; ++g)
        for (int lane = 0; lane < 16; ++lane) {
            const int64_t i = (g0 + g) * 16 + lane;
            if (i < i0 || i >= i1) continue;
            for (int r = 0; r < nr; ++r) y[i * ldy + r] = acc[g][lane / 8][r][lane % 8] - macc[g][lane / 8][r][lane % 8];
        }
}

// Q6_K's forms with one integer sum per block: PROMPT llama.cpp's tiled prompt matmul, else the
// canonical epilogue (tiled.cpp's q6k_tiled_rows).
template <bool PROMPT>
static void q6k_tiled_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0,
                           int64_t i1, float* y, int64_t ldy, ChunkPrefetch& pf) {
    constexpr int R = AVX2_TILED_ROWS;
    alignas(32) uint8_t qb[R][256];
    int32_t sc[16][R] = {};  // sub-block j's scale of each row
    int8_t scs[R][16] = {};
    alignas(32) float acc[TILED_GROUPS_MAX][2][R][8];
    float d[R] = {};
    std::memset(qb, 0, sizeof qb);
    std::memset(acc, 0, sizeof acc);
    for (int b = 0; b < nb; ++b) {
        pf.block();
        for (int r = 0; r < nr; ++r) {
            const BlockQ6K& blk = ((const BlockQ6K*)(W + r * row_bytes))[b];
            d[r] = f16(blk.d);
            std::memcpy(scs[r], blk.scales, 16);
            for (int j = 0; j < 16; ++j) sc[j][r] = scale_operand(blk.scales[j]);
            q6k_values_ymm(blk, qb[r]);
        }
        for (int g = 0; g < ng; ++g)
            for (int h = 0; h < 2; ++h) {
                if (!half_used(g0 + g, h, i0, i1)) continue;
                const int64_t gb = (g0 + g) * nb + b;
                const int8_t* Bh = a.bt.data() + gb * 4096 + 32 * h;
                __m256i isum[R];
                for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
                for (int j = 0; j < 16; ++j) run_isums<4>(qb, Bh, 4 * j, 4 * j, sc[j], isum);  // the 16-value sub-blocks
                const __m256 dx = _mm256_loadu_ps(a.dt.data() + gb * 16 + 8 * h);
                const int32_t* bq = a.bq.data() + gb * 128 + 8 * h;
                for (int r = 0; r < nr; ++r) {
                    __m256i corr = _mm256_setzero_si256();
                    for (int p = 0; p < 8; ++p)
                        corr = dpwssd(corr, _mm256_set1_epi32(pair16(scs[r][2 * p], scs[r][2 * p + 1])),
                                      _mm256_loadu_si256((const __m256i*)(bq + 16 * p)));
                    const __m256i v = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(corr, 5));
                    const __m256 s = _mm256_load_ps(acc[g][h][r]), dr = _mm256_set1_ps(d[r]);
                    _mm256_store_ps(acc[g][h][r], PROMPT ? epilogue_q6k_tiled(s, dr, dx, v) : epilogue_q6k_canon(s, dr, dx, v));
                }
            }
    }
    for (int g = 0; g < ng; ++g)
        for (int lane = 0; lane < 16; ++lane) {
            const int64_t i = (g0 + g) * 16 + lane;
            if (i < i0 || i >= i1) continue;
            for (int r = 0; r < nr; ++r) y[i * ldy + r] = acc[g][lane / 8][r][lane % 8];
        }
}

// tiled.cpp's entry point, for the AVX2 + AVX-VNNI build.
void linear_tiled(int qtype, bool prompt, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng,
                  int64_t i0, int64_t i1, float* y, int64_t ldy, const uint8_t* next, int64_t next_bytes) {
    const auto kernel = qtype == T_Q4_K ? (prompt ? q4k_tiled_rows<true> : q4k_tiled_rows<false>)
                                        : (prompt ? q6k_tiled_rows<true> : q6k_tiled_rows<false>);
    constexpr int R = AVX2_TILED_ROWS;
    const int passes = (nr + R - 1) / R;
    for (int k = 0; k < passes; ++k) {
        const int64_t from = next_bytes * k / passes, to = next_bytes * (k + 1) / passes;
        ChunkPrefetch pf(next + from, to - from, nb);
        const int r = k * R;
        kernel(W + r * row_bytes, row_bytes, nb, std::min(R, nr - r), a, g0, ng, i0, i1, y + r, ldy, pf);
    }
}

}  // namespace spk

#endif  // SPK_AVX2
