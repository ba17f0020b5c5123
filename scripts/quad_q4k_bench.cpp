// A Q4_K kernel for 3-4 activation rows on AVX2 that the library does not ship, timed beside the
// per-row kernels it would replace (avx2_k.h's dot_q4k<R>). docs/benchmarks.md, "Thirty-first run",
// has the figures and why it stayed out: 1.4x faster a block in cache, about 1.1x from memory, no
// gain in a whole verification forward.
//
//   g++ -O3 -ffp-contract=off -std=c++17 -march=haswell -Iplugins/backend_cpu/speculant_cpu/native \
//       scripts/quad_q4k_bench.cpp -o /tmp/quad_q4k_bench
//   /tmp/quad_q4k_bench [WEIGHT_ROWS=64] [K=1536] [PASSES_AHEAD=1]
//
// 64 rows of 1536 values stay in L2; 524288 rows (453 MB) come from memory (65536, 56 MB, partly
// stay in a 32 MB L3). One thread; every figure is the best of 5, ns per (weight row, block).
//
// The kernel: lane l of a ymm pairs weight row (l & 1) of a pair with activation row l / 2, so a
// vpmaddubsw takes a dword of two weight rows (a broadcast qword of their unpacked, interleaved
// values) against the same dword of the four activation rows (laid out duplicated once a call),
// int16 sums over a sub-block, one vpmaddwd for the scale: 36 multiplies a weight row's block
// against dot_q4k<4>'s 64, and no horizontal sums. Same integers and epilogue, same bits (checked).
#include "kernels.h"
#include "avx2_k.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

using namespace spk;

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Qword j of an unpacked pair's 32-value run holds dword SLOT[j] of both rows (vpunpckl/hdq's order).
static const int SLOT[8] = {0, 1, 4, 5, 2, 3, 6, 7};
static int g_ahead = 1;  // the prefetched pass: this many passes ahead

// Four activation rows, each dword twice: [nb][8 sub-blocks][8 slots][8 lanes], lane l = row l / 2.
struct Quad {
    int nb = 0;
    std::vector<int32_t> x, bp;  // bp: int16 pairs of 32-value sums [nb][4][8]
    std::vector<float> dx;       // [nb][8]
};

static Quad quad_layout(const Act& a) {
    Quad q;
    q.nb = a.nb;
    q.x.resize((size_t)a.nb * 512);
    q.bp.resize((size_t)a.nb * 32);
    q.dx.resize((size_t)a.nb * 8);
    for (int b = 0; b < a.nb; ++b)
        for (int l = 0; l < 8; ++l) {
            const int64_t ab = (int64_t)(l / 2) * a.nb + b;
            for (int s = 0; s < 8; ++s)
                for (int j = 0; j < 8; ++j) std::memcpy(&q.x[(size_t)b * 512 + 64 * s + 8 * j + l], a.qs.data() + ab * 256 + 32 * s + 4 * SLOT[j], 4);
            const int16_t* bs = a.bs32.data() + ab * 8;
            for (int k = 0; k < 4; ++k) q.bp[(size_t)b * 32 + 8 * k + l] = pair16(bs[2 * k], bs[2 * k + 1]);
            q.dx[(size_t)b * 8 + l] = a.d[ab];
        }
    return q;
}

template <int NP>
struct Unpacked {
    alignas(32) uint8_t v[NP][512];
    alignas(32) int64_t sc[NP][8], mn[NP][4];  // (row 2p, row 2p + 1) int16 pairs as vpmaddwd takes them
    alignas(8) float d[NP][2], dmin[NP][2];
};

template <int NP>
static void unpack(const uint8_t* W, size_t row_bytes, int b, Unpacked<NP>& u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < NP; ++p) {
        const BlockQ4K& A = ((const BlockQ4K*)(W + 2 * p * row_bytes))[b];
        const BlockQ4K& B = ((const BlockQ4K*)(W + (2 * p + 1) * row_bytes))[b];
        u.d[p][0] = f16(A.d), u.d[p][1] = f16(B.d), u.dmin[p][0] = f16(A.dmin), u.dmin[p][1] = f16(B.dmin);
        const __m128i sa = q4k_scales(A), sb = q4k_scales(B);
        const __m128i a16 = _mm_cvtepu8_epi16(sa), b16 = _mm_cvtepu8_epi16(sb);
        const __m128i aa0 = _mm_unpacklo_epi16(a16, a16), aa1 = _mm_unpackhi_epi16(a16, a16);
        const __m128i bb0 = _mm_unpacklo_epi16(b16, b16), bb1 = _mm_unpackhi_epi16(b16, b16);
        _mm_store_si128((__m128i*)(u.sc[p] + 0), _mm_unpacklo_epi32(aa0, bb0));
        _mm_store_si128((__m128i*)(u.sc[p] + 2), _mm_unpackhi_epi32(aa0, bb0));
        _mm_store_si128((__m128i*)(u.sc[p] + 4), _mm_unpacklo_epi32(aa1, bb1));
        _mm_store_si128((__m128i*)(u.sc[p] + 6), _mm_unpackhi_epi32(aa1, bb1));
        const __m128i ma = _mm_cvtepu8_epi16(_mm_srli_si128(sa, 8)), mb = _mm_cvtepu8_epi16(_mm_srli_si128(sb, 8));
        _mm_store_si128((__m128i*)(u.mn[p] + 0), _mm_unpacklo_epi32(ma, mb));
        _mm_store_si128((__m128i*)(u.mn[p] + 2), _mm_unpackhi_epi32(ma, mb));
        for (int t = 0; t < 4; ++t) {  // packed bytes 32t ..: sub-block 2t low, 2t + 1 high
            const __m256i qa = load256(A.qs + 32 * t), qb = load256(B.qs + 32 * t);
            const __m256i alo = _mm256_and_si256(qa, m4), ahi = _mm256_and_si256(_mm256_srli_epi16(qa, 4), m4);
            const __m256i blo = _mm256_and_si256(qb, m4), bhi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
            uint8_t* o = u.v[p] + 128 * t;
            _mm256_store_si256((__m256i*)(o + 0), _mm256_unpacklo_epi32(alo, blo));
            _mm256_store_si256((__m256i*)(o + 32), _mm256_unpackhi_epi32(alo, blo));
            _mm256_store_si256((__m256i*)(o + 64), _mm256_unpacklo_epi32(ahi, bhi));
            _mm256_store_si256((__m256i*)(o + 96), _mm256_unpackhi_epi32(ahi, bhi));
        }
    }
}

static __m256i bcast64(const void* p) {
    int64_t v;
    std::memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}

// 2 * NP weight rows against the quad: y[w * 4 + r].
template <int NP>
__attribute__((noinline)) void quad_q4k(const uint8_t* W, size_t row_bytes, const Quad& q, float* y) {
    ChunkPrefetch pf(W + (size_t)g_ahead * 2 * NP * row_bytes, 2 * NP * row_bytes, q.nb);
    // Two buffers: block b + 1 unpacks while b computes. Stored and read back at once, the
    // broadcasts waited on the stores (30 ns a block against 19).
    Unpacked<NP> buf[2];
    __m256 acc[NP], macc[NP];
    for (int p = 0; p < NP; ++p) acc[p] = macc[p] = _mm256_setzero_ps();
    unpack(W, row_bytes, 0, buf[0]);
    for (int b = 0; b < q.nb; ++b) {
        pf.block();
        if (b + 1 < q.nb) unpack(W, row_bytes, b + 1, buf[(b + 1) & 1]);
        const Unpacked<NP>& u = buf[b & 1];
        const int32_t* xb = q.x.data() + (size_t)b * 512;
        __m256i isum[NP];
        for (int p = 0; p < NP; ++p) isum[p] = _mm256_setzero_si256();
        for (int s = 0; s < 8; ++s) {
            __m256i x[8];
            for (int j = 0; j < 8; ++j) {
                x[j] = load256(xb + 64 * s + 8 * j);
                asm("" : "+x"(x[j]));  // in registers for every pair
            }
            for (int p = 0; p < NP; ++p) {
                __m256i c = _mm256_setzero_si256();
                for (int j = 0; j < 8; ++j) c = _mm256_add_epi16(c, _mm256_maddubs_epi16(bcast64(u.v[p] + 64 * s + 8 * j), x[j]));
                isum[p] = _mm256_add_epi32(isum[p], _mm256_madd_epi16(c, _mm256_set1_epi64x(u.sc[p][s])));
            }
        }
        const __m256 dx = _mm256_loadu_ps(q.dx.data() + (size_t)b * 8);
        for (int p = 0; p < NP; ++p) {
            __m256i msum = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k)
                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(_mm256_set1_epi64x(u.mn[p][k]), load256(q.bp.data() + (size_t)b * 32 + 8 * k)));
            epilogue_q4k(acc[p], macc[p], _mm256_castpd_ps(_mm256_broadcast_sd((const double*)u.d[p])),
                         _mm256_castpd_ps(_mm256_broadcast_sd((const double*)u.dmin[p])), dx, isum[p], msum);
        }
    }
    for (int p = 0; p < NP; ++p) {
        alignas(32) float o[8];
        _mm256_store_ps(o, _mm256_sub_ps(acc[p], macc[p]));
        for (int l = 0; l < 8; ++l) y[(2 * p + (l & 1)) * 4 + l / 2] = o[l];
    }
}

template <class F>
static void timed(const char* name, int reps, double blocks, F&& f) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
        const double t0 = now();
        for (int it = 0; it < reps; ++it) f();
        best = std::min(best, now() - t0);
    }
    printf("%-12s %6.2f ns\n", name, best / (reps * blocks) * 1e9);
}

int main(int argc, char** argv) {
    const int NW = argc > 1 ? atoi(argv[1]) : 64, K = argc > 2 ? atoi(argv[2]) : 1536, nb = K / 256;
    g_ahead = argc > 3 ? atoi(argv[3]) : 1;
    const size_t row_bytes = nb * sizeof(BlockQ4K);
    std::mt19937 g(1);
    std::vector<BlockQ4K> w((size_t)NW * nb);
    for (auto& b : w) {
        for (size_t i = 0; i < sizeof b; ++i) ((uint8_t*)&b)[i] = (uint8_t)g();
        b.d = 0x3c00 + g() % 512, b.dmin = 0x3800 + g() % 512;
    }
    Act a;
    a.nb = nb, a.bsize = 256;
    a.qs.resize(4 * nb * 256);
    for (auto& v : a.qs) v = (int8_t)(g() % 255 - 127);
    a.d.resize(4 * nb);
    for (auto& v : a.d) v = 0.001f * (1 + g() % 100);
    a.bs32.resize(4 * nb * 8);  // dot_q4k reads the 32-value sums only (bs16 is Q6_K's)
    for (size_t i = 0; i < a.bs32.size(); ++i) {
        int s = 0;
        for (int t = 0; t < 32; ++t) s += a.qs[32 * i + t];
        a.bs32[i] = (int16_t)s;
    }
    const Quad q = quad_layout(a);
    const uint8_t* W = (const uint8_t*)w.data();
    std::vector<float> ref((size_t)4 * NW), got((size_t)4 * NW);
    for (int r = 0; r < NW; ++r) dot_q4k<4>(w.data() + (size_t)r * nb, nb, a, 0, ref.data() + r, NW);
    for (int r = 0; r + 8 <= NW; r += 8) {
        float t[32];
        quad_q4k<4>(W + r * row_bytes, row_bytes, q, t);
        for (int k = 0; k < 32; ++k) got[(size_t)(k % 4) * NW + r + k / 4] = t[k];
    }
    int differ = 0;
    for (int r = 0; r < NW / 8 * 8; ++r)
        for (int i = 0; i < 4; ++i) differ += std::memcmp(&ref[(size_t)i * NW + r], &got[(size_t)i * NW + r], 4) != 0;
    printf("%d weight rows of %d values, prefetch %d pass(es) ahead; results differing from dot_q4k<4>'s: %d\n", NW, K, g_ahead, differ);
    const int reps = std::max(2, (int)(8e6 / ((double)NW * nb)));
    const double blocks = (double)NW * nb;
    std::vector<float> y((size_t)4 * NW);
    for (int round = 0; round < 2; ++round) {
        timed("dot_q4k<1>", reps, blocks, [&] { for (int r = 0; r < NW; ++r) dot_q4k<1>(w.data() + (size_t)r * nb, nb, a, 0, y.data() + r, NW); });
        timed("dot_q4k<2>", reps, blocks, [&] { for (int r = 0; r < NW; ++r) dot_q4k<2>(w.data() + (size_t)r * nb, nb, a, 0, y.data() + r, NW); });
        timed("dot_q4k<3>", reps, blocks, [&] { for (int r = 0; r < NW; ++r) dot_q4k<3>(w.data() + (size_t)r * nb, nb, a, 0, y.data() + r, NW); });
        timed("dot_q4k<4>", reps, blocks, [&] { for (int r = 0; r < NW; ++r) dot_q4k<4>(w.data() + (size_t)r * nb, nb, a, 0, y.data() + r, NW); });
        timed("quad, 4 rows", reps, blocks, [&] { for (int r = 0; r + 8 <= NW; r += 8) quad_q4k<4>(W + r * row_bytes, row_bytes, q, y.data() + 4 * r); });
    }
    return differ != 0;
}
