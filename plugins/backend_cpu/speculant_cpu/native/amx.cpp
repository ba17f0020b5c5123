// The AMX-INT8 kernel for Q4_K (every mode) and Q6_K (the modes with one integer sum per
// block): 16 weight rows against 16 activation rows per tile product, then the canonical
// epilogues lane-wise. Built only where the compiler targets AMX (SPK_AMX); cpu.cpp says
// whether it can run.
#include "kernels.h"

#ifdef SPK_AMX

#include "epilogue.h"
#include "unpack.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace spk SPK_HIDDEN {

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
void tiles_ready() {
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
    __m512i H;
    const __m512i s8 = q4k_headers4(h, H);
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

void amx_rows(bool q4k, bool prompt, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int g0, int ng,
              int64_t i0, int64_t i1, float* y, int64_t ldy, const uint8_t* pf, int64_t pf_bytes) {
    const auto chunk = q4k ? (prompt ? amx_chunk<true, true> : amx_chunk<true, false>)
                           : (prompt ? amx_chunk<false, true> : amx_chunk<false, false>);
    chunk(W, row_bytes, nb, nr, a, g0, ng, i0, i1, y, ldy, pf, pf_bytes);
}

}  // namespace spk

#endif  // SPK_AMX
