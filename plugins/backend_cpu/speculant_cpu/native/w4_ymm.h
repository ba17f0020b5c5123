// One activation row against four Q4_K weight rows on ymm (decode), shared by the AVX2 build and
// the AVX-512 one: llama.cpp's arithmetic, the bits of vnni_k.h's dot_q4k_w4_rows<1>. The AVX-512
// build stores the activations in q4k_order (quantize.cpp), which this kernel reads by moving its
// loads (chunk_at); the AVX2 build in natural order.
#pragma once
#include "epilogue.h"
#include "kernels.h"
#include "unpack.h"

namespace spk SPK_HIDDEN {
namespace {  // internal to each file that includes it (see kernels.h)

inline __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// Lane t: the sum of the int32 lanes of v[t] (the four reduced together), for four xmm or four ymm
// (vnni_k.h has the zmm one).
inline __m128i hsum4(const __m128i v[4]) {
    const __m128i ab = _mm_add_epi32(_mm_unpacklo_epi32(v[0], v[1]), _mm_unpackhi_epi32(v[0], v[1]));
    const __m128i cd = _mm_add_epi32(_mm_unpacklo_epi32(v[2], v[3]), _mm_unpackhi_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm_unpacklo_epi64(ab, cd), _mm_unpackhi_epi64(ab, cd));
}
inline __m128i hsum4(const __m256i v[4]) {
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
    const __m256i s = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// q4k_scales on two blocks at once, one per 128-bit lane.
inline __m256i q4k_scales_pair(__m256i h) {
    const __m256i x = _mm256_srlv_epi32(_mm256_shuffle_epi32(h, 0xED), _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4));
    const __m256i y = _mm256_srli_epi32(_mm256_shuffle_epi32(h, 0xA5), 2);
    return _mm256_or_si256(_mm256_and_si256(x, _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                           _mm256_and_si256(y, _mm256_setr_epi32(0, 0x30303030, 0, 0x30303030, 0, 0x30303030, 0, 0x30303030)));
}

// Where the activations' natural chunk c of 32 values (0..7) sits in a block: q4k_order stores
// each 128 values as [0..31, 64..95, 32..63, 96..127].
template <bool INTERLEAVED>
constexpr int chunk_at(int c) {
    return INTERLEAVED ? (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1) : c;
}

// Decode: one activation row against four weight rows, as vnni_k.h's dot_q4k_w4_rows<1> computes
// it (same integer sums, same epilogue) in fewer instructions and loads, which bound it on AVX2 (one
// thread, weights in L1, Zen 4: 21.6 -> 18.7 cycles a row's block; the compiler had regrouped
// the sums and spilled the products, which the asm statements below forbid). Each 64
// activation values are loaded once for the four rows; the sub-block scales reach vpmaddwd as
// broadcast loads of int16 pairs written once a block (no pshufb a sub-block, no shuffle-control
// registers to spill); headers and mins are unpacked two rows to a ymm. Measured on Zen 4, two
// threads, alternated in one process: 1536 x 8960 with the weights in cache 42.3 -> 47.5 GB/s;
// the 28 layers' gate/up products from memory 26.3 -> 27.1 GB/s.
template <bool INTERLEAVED>
void dot_q4k_w4_one(const uint8_t* row, size_t row_bytes, int nb, const Act& a, int i0, float* y) {
    __m128 s = _mm_setzero_ps(), sn = _mm_setzero_ps();
    W4Prefetch pf(row, row_bytes, nb, sizeof(BlockQ4K));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    // pshufb controls: scale j (j < 4: PAIR_LO, else PAIR_HI) as an int16 pair in dword j % 4;
    // mins (bytes 8-15) zero-extended to int16
    const __m256i PAIR_LO = _mm256_setr_epi8(0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3, -128,
                                             0, -128, 0, -128, 1, -128, 1, -128, 2, -128, 2, -128, 3, -128, 3, -128);
    const __m256i PAIR_HI = _mm256_add_epi8(PAIR_LO, _mm256_and_si256(_mm256_set1_epi8(4), _mm256_cmpgt_epi8(PAIR_LO, _mm256_set1_epi8(-1))));
    const __m256i MINS = _mm256_setr_epi8(8, -128, 9, -128, 10, -128, 11, -128, 12, -128, 13, -128, 14, -128, 15, -128,
                                          8, -128, 9, -128, 10, -128, 11, -128, 12, -128, 13, -128, 14, -128, 15, -128);
    alignas(32) int32_t sp[2][2][8];  // [row pair][scales 0-3, 4-7][row of the pair x 4 + j % 4]
    for (int b = 0; b < nb; ++b) {
        const int64_t ab = (int64_t)i0 * a.nb + b;
        const int8_t* xq = a.qs.data() + ab * 256;
        const BlockQ4K* blk[4];
        for (int t = 0; t < 4; ++t) blk[t] = (const BlockQ4K*)(row + t * row_bytes) + b;
        const __m256i h01 = _mm256_loadu2_m128i((const __m128i*)blk[1], (const __m128i*)blk[0]);
        const __m256i h23 = _mm256_loadu2_m128i((const __m128i*)blk[3], (const __m128i*)blk[2]);
        const __m256i sc01 = q4k_scales_pair(h01), sc23 = q4k_scales_pair(h23);
        _mm256_store_si256((__m256i*)sp[0][0], _mm256_shuffle_epi8(sc01, PAIR_LO));
        _mm256_store_si256((__m256i*)sp[0][1], _mm256_shuffle_epi8(sc01, PAIR_HI));
        _mm256_store_si256((__m256i*)sp[1][0], _mm256_shuffle_epi8(sc23, PAIR_LO));
        _mm256_store_si256((__m256i*)sp[1][1], _mm256_shuffle_epi8(sc23, PAIR_HI));
        // sum_j mn_j * bsum_j: lanes [row 0 x4 | row 1 x4] and [row 2 | row 3], reduced to lane t = row t
        const __m256i bs = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(a.bs32.data() + ab * 8)));
        const __m256i mm01 = _mm256_madd_epi16(_mm256_shuffle_epi8(sc01, MINS), bs);
        const __m256i mm23 = _mm256_madd_epi16(_mm256_shuffle_epi8(sc23, MINS), bs);
        const __m256i mh = _mm256_hadd_epi32(mm01, mm23);  // [r0 r0 r2 r2 | r1 r1 r3 r3]
        const __m256i mh2 = _mm256_hadd_epi32(mh, mh);      // [r0 r2 r0 r2 | r1 r3 r1 r3]
        const __m128i msum = _mm_unpacklo_epi32(_mm256_castsi256_si128(mh2), _mm256_extracti128_si256(mh2, 1));
        asm volatile("" ::: "memory");  // the pairs are read back below as broadcast loads
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
            const __m256i xl = load256(xq + 32 * chunk_at<INTERLEAVED>(2 * p)), xh = load256(xq + 32 * chunk_at<INTERLEAVED>(2 * p + 1));
            for (int t = 0; t < 4; ++t) {
                const int32_t* pr = sp[t >> 1][p >> 1] + 4 * (t & 1);  // sub-blocks 2p, 2p+1: dwords (2p, 2p+1) % 4
                __m256i q = load256(blk[t]->qs + 32 * p);
                asm("" : "+x"(q));  // one load, not a second as vpand's memory operand
                const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                acc[t] = dpwssd(acc[t], _mm256_maddubs_epi16(lo, xl), _mm256_set1_epi32(pr[(2 * p) & 3]));
                acc[t] = dpwssd(acc[t], _mm256_maddubs_epi16(hi, xh), _mm256_set1_epi32(pr[(2 * p + 1) & 3]));
                asm("" : "+x"(acc[t]));  // keep the sums in order: regrouped, the products spill
            }
        }
        for (int t = 0; t < 4; ++t) pf.fetch(t, sizeof(BlockQ4K));
        __m128 d, dmin;
        q4k_d_dmin4(row, row_bytes, b, d, dmin);
        epilogue_q4k(s, sn, d, dmin, _mm_set1_ps(a.d[ab]), hsum4(acc), msum);
        pf.next();
    }
    _mm_storeu_ps(y, _mm_sub_ps(s, sn));
}

}  // namespace
}  // namespace spk
