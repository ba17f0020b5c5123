// The tiled VNNI kernels' two-weight-row form, for calls whose last activation group would leave
// half of a zmm's 16 lanes empty (up to 8 rows, 17-24, ...): groups of 8 activation rows, each
// row in two adjacent lanes (quantize_q8k_block_amx's `pairs` layout), against two weight rows at
// once, one in the even lanes and one in the odd: a qword (row A's dword, row B's dword) broadcast
// with vpbroadcastq, a load like tiled.cpp's vpbroadcastd. So a group of 8 rows costs half of a
// 16-row group, and every lane does useful work. The integers of each (weight row, activation row)
// pair are tiled.cpp's, and the epilogues the same lane-wise: the same bits (tests).
// AVX-512 builds only.
#include "kernels.h"

#if SPK_AVX512

#include "epilogue.h"
#include "unpack.h"

#include <algorithm>
#include <cstring>

namespace spk SPK_HIDDEN {

// Weight-row pairs per pass: ROW_CHUNK weight rows, eight independent vpdpbusd chains.
constexpr int PAIRS = ROW_CHUNK / 2;
static_assert(PAIRS == 8, "eight chains of vpdpbusd cover its latency");

inline uint64_t pack2(uint32_t lo, uint32_t hi) { return (uint64_t)lo | ((uint64_t)hi << 32); }
inline uint64_t pack2f(float lo, float hi) {
    uint32_t a, b;
    std::memcpy(&a, &lo, 4);
    std::memcpy(&b, &hi, 4);
    return pack2(a, b);
}

// permutex2var indices: dwords 0..7 (lo) or 8..15 (hi) of two zmm, interleaved a0 b0 a1 b1 ...
struct Interleave {
    __m512i lo, hi;
    Interleave() {
        alignas(64) int32_t l[16], h[16];
        for (int t = 0; t < 16; ++t) {
            l[t] = t / 2 + (t % 2 ? 16 : 0);
            h[t] = 8 + t / 2 + (t % 2 ? 16 : 0);
        }
        lo = _mm512_load_si512(l);
        hi = _mm512_load_si512(h);
    }
};

const Interleave IL;

// One block of a pass's weight rows, decoded: pair p holds rows 2p (A, even lanes) and 2p + 1
// (B, odd lanes); rows past the call's stay zero (their sums are 0 and are not written out).
struct PairBlock {
    alignas(64) uint64_t w[PAIRS][64];  // dword t of the values (the kernel's order) of A, B
    alignas(64) uint64_t sc[PAIRS][16]; // the int32 scale of each run: Q4_K's 8 sub-blocks, Q6_K's 16
    alignas(64) uint64_t mn[PAIRS][8];  // int16 pairs: Q4_K's mins (pair k: 2k, 2k + 1), Q6_K's scales (for the -32 offset)
    uint64_t d[PAIRS][2];               // float scales: d, then (Q4_K) dmin
};

// The values of rows A and B (four zmm each) into w[p].
inline void store_pair_values(PairBlock& pb, int p, const __m512i* qa, const __m512i* qb) {
    for (int z = 0; z < 4; ++z) {
        _mm512_store_si512(pb.w[p] + 16 * z, _mm512_permutex2var_epi32(qa[z], IL.lo, qb[z]));
        _mm512_store_si512(pb.w[p] + 16 * z + 8, _mm512_permutex2var_epi32(qa[z], IL.hi, qb[z]));
    }
}

// isum[p] += sc[p][run] * (sum over N dwords of the weight dwords wt0.. against the group's B
// dwords bt0..): one run (sub-block) of every pair, the activation zmm loaded once for all eight.
template <int N>
inline void pair_run(const PairBlock& pb, const int8_t* B, int wt0, int bt0, int run, __m512i* isum) {
    __m512i c[PAIRS];
    for (int p = 0; p < PAIRS; ++p) c[p] = _mm512_setzero_si512();
    for (int u = 0; u < N; ++u) {
        const __m512i bz = _mm512_loadu_si512(B + 64 * (bt0 + u));
        for (int p = 0; p < PAIRS; ++p) c[p] = _mm512_dpbusd_epi32(c[p], _mm512_set1_epi64((long long)pb.w[p][wt0 + u]), bz);
    }
    for (int p = 0; p < PAIRS; ++p) isum[p] = _mm512_add_epi32(isum[p], _mm512_mullo_epi32(c[p], _mm512_set1_epi64((long long)pb.sc[p][run])));
}

inline __m512 pair_ps(uint64_t v) { return _mm512_castpd_ps(_mm512_set1_pd(__builtin_bit_cast(double, v))); }
inline __m512i pair_epi(uint64_t v) { return _mm512_set1_epi64((long long)v); }

// Writes lane 2j + e of group g (activation row (g0 + g) * 8 + j, weight row 2p + e) for the rows in [i0, i1).
static void store_pairs(const float (*acc)[PAIRS][16], const float (*macc)[PAIRS][16], int nr, int64_t g0, int ng, int64_t i0,
                        int64_t i1, float* y, int64_t ldy) {
    for (int g = 0; g < ng; ++g)
        for (int lane = 0; lane < 16; ++lane) {
            const int64_t i = (g0 + g) * 8 + lane / 2;
            if (i < i0 || i >= i1) continue;
            for (int r = lane % 2; r < nr; r += 2)
                y[i * ldy + r] = macc ? acc[g][r / 2][lane] - macc[g][r / 2][lane] : acc[g][r / 2][lane];
        }
}

// Q4_K, PROMPT: llama.cpp's prompt arithmetic (one epilogue step per pair of sub-blocks, the
// activations in natural order); else its decode arithmetic (one per block, q4k_order).
template <bool PROMPT>
static void q4k_pair_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0,
                          int64_t i1, float* y, int64_t ldy, ChunkPrefetch& pf) {
    static thread_local PairBlock pb;
    std::memset(&pb, 0, sizeof pb);
    alignas(64) float acc[PAIR_GROUPS_MAX][PAIRS][16], macc[PAIR_GROUPS_MAX][PAIRS][16];
    for (int g = 0; g < ng; ++g)
        for (int p = 0; p < PAIRS; ++p) {
            _mm512_store_ps(acc[g][p], _mm512_setzero_ps());
            _mm512_store_ps(macc[g][p], _mm512_setzero_ps());
        }
    const int np = (nr + 1) / 2;
    for (int b = 0; b < nb; ++b) {
        pf.block();
        for (int p = 0; p < np; ++p) {
            __m512i q[2][4];
            __m128i scm[2];    // [sc0..sc7, mn0..mn7]
            uint32_t dd[2] = {};  // fp16 (d, dmin)
            for (int e = 0; e < 2; ++e) {
                const int r = 2 * p + e;
                if (r >= nr) {
                    for (int z = 0; z < 4; ++z) q[e][z] = _mm512_setzero_si512();
                    scm[e] = _mm_setzero_si128();
                    continue;
                }
                const BlockQ4K& blk = ((const BlockQ4K*)(W + r * row_bytes))[b];
                    std::memcpy(&dd[e], &blk.d, 4);  // d, dmin: adjacent fp16
                scm[e] = q4k_scales(blk);
                q4k_values(blk, q[e]);
            }
            store_pair_values(pb, p, q[0], q[1]);
            // (dA, dminA, dB, dminB) -> d = (dA, dB), dmin = (dminA, dminB)
            const __m128 f = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)dd[1], (int)dd[0]));
            _mm_storeu_ps((float*)pb.d[p], _mm_shuffle_ps(f, f, _MM_SHUFFLE(3, 1, 2, 0)));
            // scales as int32 pairs: sc of sub-block s (A, B) is qword s
            _mm512_store_si512(pb.sc[p], _mm512_permutex2var_epi32(_mm512_cvtepu8_epi32(scm[0]), IL.lo, _mm512_cvtepu8_epi32(scm[1])));
            // mins as int16 pairs (dwords 4..7 of the words): qword k = (A's pair k, B's pair k)
            const __m128i ma = _mm256_extracti128_si256(_mm256_cvtepu8_epi16(scm[0]), 1);
            const __m128i mb = _mm256_extracti128_si256(_mm256_cvtepu8_epi16(scm[1]), 1);
            _mm_storeu_si128((__m128i*)pb.mn[p], _mm_unpacklo_epi32(ma, mb));
            _mm_storeu_si128((__m128i*)(pb.mn[p] + 2), _mm_unpackhi_epi32(ma, mb));
        }
        for (int g = 0; g < ng; ++g) {
            const int64_t gb = (g0 + g) * nb + b;
            const int8_t* B = a.bt.data() + gb * 4096;
            const __m512 dx = _mm512_loadu_ps(a.dt.data() + gb * 16);
            const int32_t* bp = a.bp.data() + gb * 64;  // int16 pairs of the 32-value sums, pair k: sub-blocks 2k, 2k + 1
            if constexpr (PROMPT) {
                for (int k = 0; k < 4; ++k) {
                    __m512i isum[PAIRS];
                    for (int p = 0; p < PAIRS; ++p) isum[p] = _mm512_setzero_si512();
                    // sub-block s: run Q4K_RUN_SUB[s] of the weights, dwords 8s.. of the natural-order tile
                    pair_run<8>(pb, B, 8 * Q4K_RUN_SUB[2 * k], 16 * k, 2 * k, isum);
                    pair_run<8>(pb, B, 8 * Q4K_RUN_SUB[2 * k + 1], 16 * k + 8, 2 * k + 1, isum);
                    const __m512i bpz = _mm512_loadu_si512(bp + 16 * k);
                    for (int p = 0; p < np; ++p) {
                        const __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pair_epi(pb.mn[p][k]), bpz);
                        __m512 s = _mm512_load_ps(acc[g][p]), sn = _mm512_load_ps(macc[g][p]);
                        epilogue_q4k(s, sn, pair_ps(pb.d[p][0]), pair_ps(pb.d[p][1]), dx, isum[p], msum);
                        _mm512_store_ps(acc[g][p], s);
                        _mm512_store_ps(macc[g][p], sn);
                    }
                }
                continue;
            }
            __m512i isum[PAIRS];
            for (int p = 0; p < PAIRS; ++p) isum[p] = _mm512_setzero_si512();
            for (int k = 0; k < 8; ++k) pair_run<8>(pb, B, 8 * k, 8 * k, Q4K_RUN_SUB[k], isum);  // both in q4k_order
            const __m512i bpz[4] = {_mm512_loadu_si512(bp), _mm512_loadu_si512(bp + 16),
                                    _mm512_loadu_si512(bp + 32), _mm512_loadu_si512(bp + 48)};
            for (int p = 0; p < np; ++p) {
                __m512i msum = _mm512_setzero_si512();
                for (int k = 0; k < 4; ++k) msum = _mm512_dpwssd_epi32(msum, pair_epi(pb.mn[p][k]), bpz[k]);
                __m512 s = _mm512_load_ps(acc[g][p]), sn = _mm512_load_ps(macc[g][p]);
                epilogue_q4k(s, sn, pair_ps(pb.d[p][0]), pair_ps(pb.d[p][1]), dx, isum[p], msum);
                _mm512_store_ps(acc[g][p], s);
                _mm512_store_ps(macc[g][p], sn);
            }
        }
    }
    store_pairs(acc, macc, nr, g0, ng, i0, i1, y, ldy);
}

// Q6_K's forms with one integer sum per block (tiled.cpp's q6k_tiled_rows): PROMPT llama.cpp's
// tiled prompt matmul, else the canonical epilogue.
template <bool PROMPT>
static void q6k_pair_rows(const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng, int64_t i0,
                          int64_t i1, float* y, int64_t ldy, ChunkPrefetch& pf) {
    static thread_local PairBlock pb;
    std::memset(&pb, 0, sizeof pb);
    alignas(64) float acc[PAIR_GROUPS_MAX][PAIRS][16];
    for (int g = 0; g < ng; ++g)
        for (int p = 0; p < PAIRS; ++p) _mm512_store_ps(acc[g][p], _mm512_setzero_ps());
    const int np = (nr + 1) / 2;
    for (int b = 0; b < nb; ++b) {
        pf.block();
        for (int p = 0; p < np; ++p) {
            __m512i q[2][4];
            __m128i sc[2];  // the 16 int8 scales
            float d[2] = {};
            for (int e = 0; e < 2; ++e) {
                const int r = 2 * p + e;
                if (r >= nr) {
                    for (int z = 0; z < 4; ++z) q[e][z] = _mm512_setzero_si512();
                    sc[e] = _mm_setzero_si128();
                    continue;
                }
                const BlockQ6K& blk = ((const BlockQ6K*)(W + r * row_bytes))[b];
                    d[e] = f16(blk.d);
                sc[e] = _mm_loadu_si128((const __m128i*)blk.scales);
                q6k_values(blk, q[e]);
            }
            store_pair_values(pb, p, q[0], q[1]);
            // scales as int32 pairs, qword j = (A's sc_j, B's sc_j); as int16 pairs, qword k = (A's (sc_2k, sc_2k+1), B's)
            const __m512i sa = _mm512_cvtepi8_epi32(sc[0]), sb = _mm512_cvtepi8_epi32(sc[1]);
            _mm512_store_si512(pb.sc[p], _mm512_permutex2var_epi32(sa, IL.lo, sb));
            _mm512_store_si512(pb.sc[p] + 8, _mm512_permutex2var_epi32(sa, IL.hi, sb));
            _mm512_store_si512(pb.mn[p], _mm512_permutex2var_epi32(_mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc[0])), IL.lo,
                                                                   _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc[1]))));
            pb.d[p][0] = pack2f(d[0], d[1]);
        }
        for (int g = 0; g < ng; ++g) {
            const int64_t gb = (g0 + g) * nb + b;
            const int8_t* B = a.bt.data() + gb * 4096;
            __m512i isum[PAIRS];
            for (int p = 0; p < PAIRS; ++p) isum[p] = _mm512_setzero_si512();
            for (int j = 0; j < 16; ++j) pair_run<4>(pb, B, 4 * j, 4 * j, j, isum);  // the 16-value sub-blocks, natural order
            const __m512 dx = _mm512_loadu_ps(a.dt.data() + gb * 16);
            const int32_t* bq = a.bq.data() + gb * 128;
            for (int p = 0; p < np; ++p) {
                __m512i corr = _mm512_setzero_si512();
                for (int k = 0; k < 8; ++k) corr = _mm512_dpwssd_epi32(corr, pair_epi(pb.mn[p][k]), _mm512_loadu_si512(bq + 16 * k));
                const __m512i v = _mm512_sub_epi32(isum[p], _mm512_slli_epi32(corr, 5));
                const __m512 s = _mm512_load_ps(acc[g][p]), dr = pair_ps(pb.d[p][0]);
                _mm512_store_ps(acc[g][p], PROMPT ? epilogue_q6k_tiled(s, dr, dx, v) : epilogue_q6k_canon(s, dr, dx, v));
            }
        }
    }
    store_pairs(acc, nullptr, nr, g0, ng, i0, i1, y, ldy);
}

void linear_tiled_pairs(int qtype, bool prompt, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0,
                        int ng, int64_t i0, int64_t i1, float* y, int64_t ldy, const uint8_t* next, int64_t next_bytes) {
    const auto kernel = qtype == T_Q4_K ? (prompt ? q4k_pair_rows<true> : q4k_pair_rows<false>)
                                        : (prompt ? q6k_pair_rows<true> : q6k_pair_rows<false>);
    const int passes = (nr + ROW_CHUNK - 1) / ROW_CHUNK;
    for (int k = 0; k < passes; ++k) {
        const int64_t from = next_bytes * k / passes, to = next_bytes * (k + 1) / passes;
        ChunkPrefetch pf(next + from, to - from, nb);
        const int r = k * ROW_CHUNK;
        kernel(W + r * row_bytes, row_bytes, nb, std::min(ROW_CHUNK, nr - r), a, g0, ng, i0, i1, y + r, ldy, pf);
    }
}

}  // namespace spk

#endif  // SPK_AVX512
