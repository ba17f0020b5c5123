// Reading Q4_K and Q6_K weight blocks into registers: the unpacked scales and values, the index
// vectors that spread the scales, and the software prefetch of the weight stream. Shared by the
// VNNI, tiled and AMX kernels (the scales and the prefetch by the AVX2 ones too), inline so it
// compiles into their inner loops.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "blocks.h"

namespace spk SPK_HIDDEN {
// The four-row decode kernels' prefetch distance (W4Prefetch; linear.cpp, spk_set_w4_prefetch).
extern int64_t g_w4_prefetch_min;
// AVX-512 builds: one-row Q4_K decode on the ymm kernel (w4_ymm.h; linear.cpp, spk_set_w4_ymm).
extern int g_w4_ymm;

namespace {  // internal to each file that includes it (see kernels.h)

// Software prefetch distance for the weight stream: the hardware prefetcher alone leaves a
// single core at about half of its memory bandwidth on these kernels. Into L2 (T1), well ahead:
// measured over the 1.5B model's weights, calls alternating in one process, 6144 bytes into L2
// against 3072 into L1 took 1 row from 49.5 to 45.9 ms and 2 rows from 56.3 to 53.0 (3 and 4 rows
// the same; 3072 into L1 had made 2 and 3 rows 7% faster than 4096).
constexpr int PREFETCH_BYTES = 6144;

// acc + the int16 pairs of a times b, summed into int32 lanes (the ymm kernels: AVX-VNNI's
// vpdpwssd where the build has it, AVX-512 VNNI's on ymm in the AVX-512 build, vpmaddwd + vpaddd
// otherwise)
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) {
#if SPK_AVX512
    return _mm256_dpwssd_epi32(acc, a, b);
#elif SPK_AVXVNNI
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

inline void prefetch(const void* block, int bytes) {
    const char* p = (const char*)block + PREFETCH_BYTES;
    for (int o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

// The four-row decode kernels (the _w4 ones) read block b of four consecutive weight rows at a
// time: four streams row_bytes apart, each moving forward a block per step, over a span of memory
// (the four rows) that the next four rows continue. Two orders of prefetch, chosen at run time by
// g_w4_prefetch_min (spk_set_w4_prefetch):
// - linear (g_w4_prefetch_min > 0): the span in address order, one step's share (four blocks'
//   bytes) per b, g_w4_prefetch_min bytes or the span's length ahead (whichever is more, so that
//   every row of the span has been fetched before it is read): the hardware sees one forward
//   stream. The per-row order below had made the four prefetch streams jump back and forth inside
//   a few kilobytes where rows are short (k = 1536: 864 bytes a Q4_K row), and on a Zen 3 (2
//   cores, AVX2) rows of 1536 values streamed at 5-10 GB/s where rows of 8960 streamed at 11-15
//   (docs/benchmarks.md, seventeenth run). How far ahead depends on the CPU: 4 KiB was best there,
//   and on a Zen 4 the AVX2 kernels lose a fifth of their speed at 4 KiB against 6-24 KiB
//   (thirty-third run); linear.cpp picks the distance by CPU (default_w4_prefetch).
// - per row (0): block b + P of each of the four rows, P = PREFETCH_BYTES / (4 x block bytes), or
//   past the rows' end a block of the four rows after them (contiguous); the AVX-512 default.
// Per b: fetch(t) for each of the four rows, then next().
struct W4Prefetch {
    const uint8_t* row;
    size_t row_bytes, block_bytes;
    const char* cur;  // linear: the next byte to prefetch
    int nb, rem = 0, groups = 0;  // per row: block b + P is block `rem` of the rows `groups` x 4 rows further
    bool linear;
    // (always inlined: a call out of line in a kernel's loop spills its vector registers)
    __attribute__((always_inline)) W4Prefetch(const uint8_t* row, size_t row_bytes, int nb, size_t block_bytes)
        : row(row), row_bytes(row_bytes), block_bytes(block_bytes), nb(nb), linear(g_w4_prefetch_min > 0) {
        if (linear) {
            cur = (const char*)row + std::max<int64_t>(4 * (int64_t)row_bytes, g_w4_prefetch_min);
        } else {
            const int ahead = std::max(1, (int)(PREFETCH_BYTES / (4 * block_bytes)));
            groups = ahead / nb;
            rem = ahead % nb;
        }
    }
    __attribute__((always_inline)) void fetch(int t, int bytes) const {
        if (linear) return;
        const char* p = (const char*)row + ((int64_t)4 * groups + t) * row_bytes + rem * block_bytes;
        for (int o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
    }
    __attribute__((always_inline)) void next() {  // the next b
        if (linear) {
            const int64_t step = 4 * (int64_t)block_bytes;
            for (int64_t o = 0; o < step; o += 64) _mm_prefetch(cur + o, _MM_HINT_T1);
            cur += step;
        } else if (++rem == nb) {
            rem = 0, ++groups;
        }
    }
};

// The tiled kernels' weight stream: they read block b of 8 or 16 weight rows at a time, rows that
// are only 864 bytes long in the 1.5B's k = 1536 matrices, so prefetch() a fixed distance ahead
// lands in the chunk being computed. Instead, while a chunk computes, the next chunk (contiguous:
// the rows that follow) streams into L2, an even share of it per block, as the AMX kernel does.
// Measured in whole forwards without AMX (cold weights), Q4_K 8960x1536 at 8 rows: see tiled.cpp.
struct ChunkPrefetch {
    const char* cur;
    const char* end;
    int64_t per_block;
    ChunkPrefetch(const uint8_t* next, int64_t bytes, int nb)
        : cur((const char*)next), end((const char*)next + bytes), per_block((bytes + nb - 1) / nb) {}
    void block() {  // this block's share
        const char* e = std::min(end, cur + per_block);
        for (; cur < e; cur += 64) _mm_prefetch(cur, _MM_HINT_T1);
    }
};

// The 12 packed bytes of a Q4_K block hold eight 6-bit scales and eight 6-bit mins: unpacked
// into [sc0..sc7, mn0..mn7] as 16 bytes. Lane-wise on the dwords (d | dmin, u0, u1, u2) of the
// block's first 16 bytes: (u0 & 3f, (u2 & 0f) | (u0 >> 2 & 30), u1 & 3f, (u2 >> 4 & 0f) |
// (u1 >> 2 & 30)). (In vector registers: the scalar form through a dword array cost a quarter
// of the one-row kernel's time.)
inline __m128i q4k_scales(const BlockQ4K& blk) {
    const __m128i h = _mm_loadu_si128((const __m128i*)&blk);
    const __m128i x = _mm_srlv_epi32(_mm_shuffle_epi32(h, 0xED), _mm_setr_epi32(0, 0, 0, 4));  // (u0, u2, u1, u2)
    const __m128i y = _mm_srli_epi32(_mm_shuffle_epi32(h, 0xA5), 2);                            // (u0, u0, u1, u1) >> 2
    return _mm_or_si128(_mm_and_si128(x, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
                        _mm_and_si128(y, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}

// d and dmin of block b of four weight rows `row_bytes` apart, as two vectors (lane t: row t).
inline void q4k_d_dmin4(const uint8_t* row, size_t row_bytes, int b, __m128& d, __m128& dmin) {
    const uint8_t* h = row + (size_t)b * sizeof(BlockQ4K);
    uint32_t w[4];
    for (int t = 0; t < 4; ++t) std::memcpy(&w[t], h + t * row_bytes, 4);
    const __m128i dd = _mm_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
    const __m256 f = _mm256_cvtph_ps(_mm_shuffle_epi8(dd, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)));
    d = _mm256_castps256_ps128(f);
    dmin = _mm256_extractf128_ps(f, 1);
}

// The sub-block of each 32-byte run of q4k_values' bytes (zmm z holds sub-blocks (0,2), (1,3),
// (4,6), (5,7); avx2_tiled.cpp lays its ymm out the same way); the map is its own inverse:
// sub-block s is run Q4K_RUN_SUB[s].
constexpr int Q4K_RUN_SUB[8] = {0, 2, 1, 3, 4, 6, 5, 7};

#if SPK_AVX512  // the zmm forms (avx2_k.h has the ymm ones)

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
__attribute__((always_inline)) inline void q4k_values(const BlockQ4K& blk, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i q0 = _mm512_loadu_si512(blk.qs), q1 = _mm512_loadu_si512(blk.qs + 64);
    q[0] = _mm512_and_si512(q0, m4);
    q[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
    q[2] = _mm512_and_si512(q1, m4);
    q[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
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
// (Always inlined: GCC called it out of line from the decode kernels, the values through memory.)
__attribute__((always_inline)) inline void q6k_values(const BlockQ6K& blk, __m512i q[4]) {
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

// The headers of block b of four weight rows (h[t]: row t's block): H, each 128-bit lane the
// dwords (d | dmin, u0, u1, u2) of a row, and, returned, their scales unpacked lane-wise as
// q4k_scales does one row's: lane t holds row t's [sc0..sc7, mn0..mn7] as bytes.
inline __m512i q4k_headers4(const uint8_t* const h[4], __m512i& H) {
    H = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)h[0]));
    H = _mm512_inserti32x4(H, _mm_loadu_si128((const __m128i*)h[1]), 1);
    H = _mm512_inserti32x4(H, _mm_loadu_si128((const __m128i*)h[2]), 2);
    H = _mm512_inserti32x4(H, _mm_loadu_si128((const __m128i*)h[3]), 3);
    const __m512i shifts = _mm512_set4_epi32(4, 0, 0, 0);
    const __m512i mask_x = _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f);
    const __m512i mask_y = _mm512_set4_epi32(0x30303030, 0, 0x30303030, 0);
    const __m512i X = _mm512_srlv_epi32(_mm512_shuffle_epi32(H, (_MM_PERM_ENUM)0xED), shifts);                  // (u0, u2, u1, u2)
    const __m512i Y = _mm512_and_si512(_mm512_srli_epi32(_mm512_shuffle_epi32(H, (_MM_PERM_ENUM)0xA5), 2), mask_y);  // (u0, u0, u1, u1)
    return _mm512_ternarylogic_epi32(X, mask_x, Y, 0xEA);                                                       // (X & mask_x) | Y
}

#endif  // SPK_AVX512

}  // namespace
}  // namespace spk
