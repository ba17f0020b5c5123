// The quantized linear layers' entry points: the C API (spk_linear, spk_linear_mode,
// spk_linear_prompt and their knobs), the choice of path for a call (AMX, tiled VNNI or the
// per-row VNNI kernels, by type, mode and row count), the activation quantization and the
// split of the work over the threads, and the dispatcher that turns a runtime row count into
// the row kernels' template argument. The row kernels are the zmm ones (vnni_*.h) or the ymm ones
// (avx2_*.h), by the ISA the library is built for (isa.h): the same functions, the same bits.
#include "kernels.h"
#include "pool.h"
#if SPK_AVX512
#include "vnni_b32.h"
#include "vnni_k.h"
#else
#include "avx2_b32.h"
#include "avx2_k.h"
#endif

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace spk SPK_HIDDEN {
namespace {

// The one place a runtime row count becomes a template argument: f(std::integral_constant<int, R>)
// with R = nr for 1 <= nr <= NR_MAX (NR_MAX for more).
template <int R = 1, class F>
inline void with_rows(int nr, F&& f) {
    if constexpr (R < NR_MAX) {
        if (nr > R) return with_rows<R + 1>(nr, std::forward<F>(f));
    }
    f(std::integral_constant<int, R>{});
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
// Q4_K calls with at least this many rows that do not take AMX take the tiled kernels (0:
// never); Q6_K ones in the forms with one sum per block too where their rows are long, and from
// twice as many where they are short (tiled_min_rows()). Measured on the 1.5B's matrices, 2 cores
// without AMX: 16 rows 2.0-2.6x the per-row kernels, 512 rows 2.2-2.8x; 8 rows (groups of 8 rows)
// 1.2-1.5x with the weights in cache, even in whole forwards (weights from memory), where 6 rows
// took 1.2x longer tiled (103 against 86 ms a forward) though 1.0-1.1x faster in cache.
int g_tiled_min_rows = 8;
// Q5_0 and Q4_0 calls with at least this many rows take dot_b32_tiled (0: never;
// spk_set_b32_tiled_min_rows). Measured on a Zen 3 (AVX2), the 0.5B's Q5_0 matrices, 2 threads:
// 8 rows 1.09x the per-row kernels, 16 rows 1.18x, 32 rows 1.30x, 64 rows 1.48x. On a Zen 4
// (AVX-512), whose per-row kernels decode a block for 8 rows at once as cheaply as they use it,
// the 0.5B's 0.84x / 0.98x / 1.22x / 1.20x at 8 / 16 / 32 / 64 rows, the EAGLE3 head's 0.84x /
// 1.02x / 1.11x / 1.23x: from 32 rows there.
int g_b32_tiled_min_rows = SPK_AVX512 ? 32 : 8;

// A tiled call's rows past its last whole group of 16 (on AVX2, of 9-15 rows those past the
// first 8), where there are at most this many, take the per-row kernels on each chunk of weight
// rows while the chunk is in cache, instead of a group padded to 16 rows that costs what 16 rows
// do (0: never).
// A verification of a 48-token draft is 49 rows. Measured in whole forwards of the 1.5B after
// 1500 cached tokens, 2 cores of a Zen 4: AVX-512, 17/20/33/49 rows 225/247/377/520 -> 166/211/
// 302/416 ms, and up to 8 rows past the groups as fast as the 8-row groups (tiled_pairs.cpp) or
// faster (40 rows 413 -> 364 ms); AVX2 17/33/49 rows 273/446/637 -> 227/402/568 ms, but 6-8 rows
// past the groups slower than a padded group (24 rows 288 -> 325 ms).
int g_tiled_tail_rows = SPK_AVX512 ? 8 : 4;

// Q6_K's rows of up to this many values stay on the per-row kernels longer: there 8 activation
// rows of k bytes stay in L1 while a weight row streams past, and a Q6_K block costs the tiled
// kernels more (16 scales to multiply in, against Q4_K's 8). The output head (k = 1536, 191 MB)
// took 12.5 ms on the per-row kernels at 8 rows against 15.1 tiled, and about even at 16 rows;
// the Q6_K FFN-down matrices (k = 8960) 0.93 against 0.60 ms at 8 rows.
constexpr int64_t Q6K_SHORT_ROW = 4096;

// The row count from which a call that does not take AMX takes the tiled kernels.
int tiled_min_rows(int qtype, int64_t k) {
    if (qtype == T_Q6_K && k <= Q6K_SHORT_ROW) return 2 * g_tiled_min_rows;
    return g_tiled_min_rows;
}
// the path of the last spk_linear call: 1 per-row, 2 AMX, 3 tiled on the AMX layout, 4 its groups
// of 8 rows, 5 tiled groups of 16 (AVX2: or the first 8 rows) and a per-row tail
int g_last_path = 0;

// A Q5_0 / Q4_0 work item's weight rows [0, nr) (row_bytes apart) decoded once to signed bytes
// and scales, `q` [nr][nb][32] and `dq` [nr][nb], for dot_b32_tiled (avx2_b32.h, vnni_b32.h) to
// read for every activation row: what the per-row kernels redo for every 8 rows.
template <class Block>
void decode_b32_rows(const uint8_t* rows, size_t row_bytes, int nr, int nb, std::vector<int8_t>& q, std::vector<float>& dq) {
    q.resize((size_t)nr * nb * 32);
    dq.resize((size_t)nr * nb);
    for (int t = 0; t < nr; ++t) {
        const Block* w = (const Block*)(rows + t * row_bytes);
        for (int b = 0; b < nb; ++b) {
            _mm256_storeu_si256((__m256i*)(q.data() + ((int64_t)t * nb + b) * 32), decode32(w[b]));
            dq[(int64_t)t * nb + b] = f16(w[b].d);
        }
    }
}

}  // namespace

// AVX-512 builds: one-row Q4_K decode takes the ymm kernel (w4_ymm.h) instead of the zmm one
// (0/1, SPECULANT_W4_YMM). Where 512-bit instructions run at full width (Zen 5), the zmm kernel
// streamed slower: the 1.5B's products at one row, alternated, 26.6 ms on the zmm kernel with its
// prefetch, 24.7 on the ymm one with the linear order 8 KiB ahead (docs/benchmarks.md, forty-first
// run). On the Zen 4 the AVX-512 build's one-row forward was the faster (fortieth run), so the
// other CPUs keep the zmm kernel until measured.
bool zen5_or_later() {
    __builtin_cpu_init();
    if (!__builtin_cpu_is("amd")) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xF, ext = (eax >> 20) & 0xFF;
    return (base == 0xF ? base + ext : base) >= 0x1A;
}
int default_w4_ymm() {
    if (const char* env = std::getenv("SPECULANT_W4_YMM"); env && *env) return std::atoi(env) != 0;
    return SPK_AVX512 && zen5_or_later();
}
int g_w4_ymm = default_w4_ymm();

// W4Prefetch's distance (unpack.h): the linear order this many bytes ahead, or 0 for the per-row
// order; SPECULANT_W4_PREFETCH sets it. The AVX-512 kernels take the per-row order (measured on
// Sapphire Rapids and on a Zen 4, where the linear one at 8-24 KiB is within 2% of it), but where
// one-row decode takes the ymm kernel (g_w4_ymm), the AVX2 build's 8 KiB. The AVX2
// kernels take the linear order, whose best distance differs by CPU: on a Zen 3 (AVX2 only) 4 KiB
// (8 KiB ran the engine 15% slower), on a Zen 4 (AVX-512, the AVX2 build forced) 6-24 KiB, where
// 4 KiB took the 1.5B's linear layers at one row 46 ms against 37 (scripts/bench_linear.py
// --w4-prefetch, docs/benchmarks.md, thirty-third run). Of those two, CPUs with AVX-512 take 8 KiB,
// the others 4 KiB.
int64_t default_w4_prefetch() {
    if (const char* env = std::getenv("SPECULANT_W4_PREFETCH"); env && *env) return std::atoll(env);
    if (!SPK_AVX2) return g_w4_ymm ? 8192 : 0;  // the ymm decode kernel's distance, as in the AVX2 build
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 8192 : 4096;
}
int64_t g_w4_prefetch_min = default_w4_prefetch();

}  // namespace spk

using namespace spk;

extern "C" {

int spk_abi_version() { return 10; }

// Calls with at least `rows` rows take the AMX path where it has the call's type and mode (0:
// never); returns the old value.
int spk_set_amx_min_rows(int rows) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int old = g_amx_min_rows;
    g_amx_min_rows = rows;
    return old;
}

// As spk_set_amx_min_rows, for the tiled VNNI kernels (tiled.cpp, tiled_pairs.cpp: activations in
// the AMX layout), which calls that do not take AMX take from this many rows (0: never; Q6_K with
// rows of up to 4096 values from twice as many, see tiled_min_rows).
int spk_set_tiled_min_rows(int rows) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int old = g_tiled_min_rows;
    g_tiled_min_rows = rows;
    return old;
}

// As spk_set_tiled_min_rows, for the 32-blocks' tiled kernel (dot_b32_tiled, AVX2 and AVX-512).
int spk_set_b32_tiled_min_rows(int rows) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int old = g_b32_tiled_min_rows;
    g_b32_tiled_min_rows = rows;
    return old;
}

// As spk_set_tiled_min_rows, for the rows of a tiled call past its last whole group of 16 that
// take the per-row kernels instead of a padded group: up to this many (0: never).
int spk_set_tiled_tail_rows(int rows) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int old = g_tiled_tail_rows;
    g_tiled_tail_rows = rows;
    return old;
}

// Whether the AVX-512 build's one-row Q4_K decode takes the ymm kernel (g_w4_ymm; the AVX2 build
// always does); returns the old value.
int spk_set_w4_ymm(int on) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int old = g_w4_ymm;
    g_w4_ymm = on;
    return old;
}

// The four-row decode kernels' prefetch (W4Prefetch): the linear order `bytes` ahead, or 0 for the
// per-row order; returns the old value.
int64_t spk_set_w4_prefetch(int64_t bytes) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const int64_t old = g_w4_prefetch_min;
    g_w4_prefetch_min = bytes;
    return old;
}

// Which path the last spk_linear call took: 1 the per-row kernels, 2 the AMX kernel, 3 the tiled
// kernels (VNNI, or AVX2's vpmaddubsw), 4 the tiled VNNI kernels on groups of 8 rows (tiled_pairs.cpp),
// 5 the tiled kernels on whole groups of 16 and the per-row kernels on the rest.
int spk_last_path() { return g_last_path; }

// Does the library have a kernel for this GGML type and row length?
int spk_supports(int qtype, int64_t k) {
    return block_bytes(qtype) != 0 && k % block_values(qtype) == 0;
}

// How a call's rows are computed (spk_linear_prompt).
enum Mode { LLAMA_DECODE = 0, LLAMA_PROMPT = 1, Q6K_CANON = 2 };

// The body of spk_linear and spk_linear_prompt.
static int linear(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y, Mode mode) {
    // The modes are the K-quants' arithmetic: for the 32-value blocks every mode is decode's
    // (mode 1 sent them to the Q6_K prompt kernel, which read past their activation buffers).
    const bool k_quant = qtype == T_Q4_K || qtype == T_Q6_K;
    const bool prompt = mode == LLAMA_PROMPT && k_quant, canon = mode == Q6K_CANON && qtype == T_Q6_K;
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
    const int tiled_from = tiled_min_rows(qtype, k);
    // Every Q4_K mode, and Q6_K's forms with one integer sum per block (as AMX).
    // (AVX-512, or AVX2: avx2_tiled.cpp)
    const bool tiled = (SPK_AVX512 || SPK_AVX2) && !amx && (qtype == T_Q4_K || (qtype == T_Q6_K && (prompt || canon))) && g_tiled_min_rows > 0 &&
                       m >= tiled_from;
    // Rows past the last whole group of 16 that take the per-row kernels (g_tiled_tail_rows); on
    // AVX2, of 9-15 rows those past the first 8 (a ymm half of a group: 9/10 rows 183/186 ->
    // 150/164 ms, as above), where on AVX-512 8 rows in groups of 8 and the rest on the per-row
    // kernels cost what one group of 16 does or more (12 rows 140 -> 157 ms).
    const int64_t whole = m > 16 ? m - m % 16 : SPK_AVX512 ? m : 8;
    const int64_t tail = tiled && m > 8 && m % 16 != 0 && m - whole <= g_tiled_tail_rows ? m - whole : 0;
    const int64_t m_tiled = m - tail;  // the rows the tiled kernels take
    // The tiled kernels' groups of 8 rows (two weight rows per zmm) where 16-row groups would
    // leave the last one half empty or worse and the per-row tail does not take those rows: calls
    // of 8 rows or fewer (and 17-24, 33-40, 49-56 where the tail is set shorter).
    const bool pairs = SPK_AVX512 && tiled && m_tiled <= ACT_TILE && m_tiled % 16 != 0 && m_tiled % 16 <= 8;
    g_last_path = amx ? 2 : tail ? 5 : pairs ? 4 : tiled ? 3 : 1;
    Act& a = g_act;
    a.nb = nb;
    a.bsize = bv;
    const int group_rows = pairs ? 8 : 16;
    const int64_t groups = (m_tiled + group_rows - 1) / group_rows;
    if (amx || tiled) {
        a.bt.resize((size_t)groups * nb * 4096);
        a.dt.resize((size_t)groups * nb * 16);
        a.bp.resize((size_t)groups * nb * 64);
        a.bq.resize(tiled && qtype == T_Q6_K ? (size_t)groups * nb * 128 : 0);
    }
    if (!(amx || tiled) || tail) {  // the per-row layout (indexed by row: only the tail's are written)
        a.qs.resize((size_t)m * nb * bv);
        a.d.resize((size_t)m * nb);
        if (bv == 256) {
            a.bs16.resize((size_t)m * nb * 16);
            a.bs32.resize((size_t)m * nb * 8);
        }
    }
    // Work items: the rows, or for AMX and the tiled kernels each (group, block) of the B tiles
    // and then the tail's rows.
    const int64_t tile_items = amx || tiled ? groups * nb : 0;
    const int64_t items = tile_items + (amx || tiled ? tail : m);
    auto quantize = [&](int64_t i) {
        if (i < tile_items) {
            quantize_q8k_block_amx(x, m_tiled, k, nb, qtype == T_Q4_K, qtype == T_Q4_K && !prompt, i / nb, (int)(i % nb), a, pairs);
            return;
        }
        if (amx || tiled) i = m_tiled + (i - tile_items);  // a tail row
        if (bv == 256)
            quantize_q8k_row(x + i * k, nb, qtype == T_Q4_K && Q4K_ACT_INTERLEAVED, a.qs.data() + i * nb * 256, a.d.data() + i * nb,
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

    if (SPK_AVX512 && bv == 32 && m >= 2) {  // the row pairs of the zmm dot_b32
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
    const int64_t w_bytes = n * (int64_t)row_bytes;
    auto rows = [&](int64_t r0, int64_t r1, int64_t a0, int64_t a1) {
        // the next chunk of weight rows, which the AMX and tiled kernels prefetch while computing this one
        [[maybe_unused]] const int64_t pf0 = std::min(w_bytes, r1 * (int64_t)row_bytes);
        [[maybe_unused]] const int64_t pf1 = std::min(w_bytes, (2 * r1 - r0) * (int64_t)row_bytes);
#ifdef SPK_AMX
        if (amx) {  // r1 - r0 <= ROW_CHUNK = 16, a0 a multiple of 16, a1 - a0 <= ACT_TILE
            const int g0 = (int)(a0 / 16), ng = (int)((a1 - a0 + 15) / 16);
            amx_rows(qtype == T_Q4_K, prompt, W + r0 * row_bytes, row_bytes, nb, (int)(r1 - r0), a, g0, ng, a0, a1, y + r0, n,
                     W + pf0, pf1 - pf0);
            return;
        }
#endif
#if SPK_AVX512
        if (pairs) {  // the few-row path: a0 = 0, a1 = m <= ACT_TILE
            linear_tiled_pairs(qtype, prompt, W + r0 * row_bytes, row_bytes, nb, (int)(r1 - r0), a, 0, (int)((m_tiled + 7) / 8), a0,
                               m_tiled, y + r0, n, W + pf0, pf1 - pf0);
            if (a1 <= m_tiled) return;
            a0 = m_tiled;  // the tail's rows: the per-row kernels below
        }
#endif
#if SPK_AVX512 || SPK_AVX2
        if (tiled && !pairs) {  // a0 a multiple of 16, a1 - a0 <= ACT_TILE
            const int64_t t1 = std::min(a1, m_tiled);
            if (t1 > a0) {
                const int64_t g0 = a0 / 16;
                const int ng = (int)((t1 - a0 + 15) / 16);
                linear_tiled(qtype, prompt, W + r0 * row_bytes, row_bytes, nb, (int)(r1 - r0), a, g0, ng, a0, t1, y + r0, n, W + pf0,
                             pf1 - pf0);
            }
            if (a1 <= m_tiled) return;
            a0 = std::max(a0, m_tiled);  // the tail's rows, on the weight rows just read: the per-row kernels below
        }
#endif
        // Decode: four weight rows at a time, but Q6_K's one at a time. Its four-row kernels
        // (removed) computed the same bits and streamed slower: in weights on 2 MiB pages, Zen 4,
        // 2 cores, alternated in one process, 1536 x 8960 33.0 -> 37.1 GB/s one at a time, the
        // 151936 x 1536 head 28.4 -> 30.8, 256 x 1536 23.9 -> 28.4 on AVX-512; on AVX2 1536 x
        // 8960 even, the head 28.5 -> 29.6, 256 x 1536 17.5 -> 20.3 (docs/benchmarks.md, fortieth run).
        if (a1 - a0 == 1 && !prompt) {
            int64_t r = qtype == T_Q4_K ? dot_q4k_few_rows<1>(W, row_bytes, r0, r1, nb, a, (int)a0, y, n) : r0;
            const bool b32 = qtype == T_Q8_0 || qtype == T_Q5_0 || qtype == T_Q4_0;  // the 32-value blocks' four-row kernels
            for (; b32 && r + 4 <= r1; r += 4) {
                const uint8_t* w4 = W + r * row_bytes;
                float* y4 = y + a0 * n + r;
                switch (qtype) {
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
        // A one- or two-token draft's verification (2-3 rows): as decode, several weight rows a
        // call (dot_q4k_few_rows). AVX-512, four: measured on Zen 4 with the weights in cache,
        // 8960x1536, 3 rows 340-347 -> 298-317 us; at 4 rows the registers spill and the per-row
        // kernels are faster (388 against 451 us). AVX2, two (its four-row port spilled: on a Zen 3
        // the 1.5B's matrices at 2 rows took 91.3 ms against 76.3 on the per-row kernels); Zen 4,
        // whole verification forwards at 2 rows after 200 cached tokens: 49.0 / 53.7 ms on the
        // per-row kernels, 45.8 / 46.1 with the two-row one.
        if (qtype == T_Q4_K && !prompt && a1 - a0 <= 3) {
            const int R = (int)(a1 - a0);
            int64_t r = R == 2 ? dot_q4k_few_rows<2>(W, row_bytes, r0, r1, nb, a, (int)a0, y, n)
                               : dot_q4k_few_rows<3>(W, row_bytes, r0, r1, nb, a, (int)a0, y, n);
            for (; r < r1; ++r) dot_tile(R, qtype, W + r * row_bytes, nb, a, (int)a0, y + a0 * n + r, n);
            return;
        }
#if SPK_AVX2 || SPK_AVX512
        // Q5_0 and Q4_0 from g_b32_tiled_min_rows rows: each weight row decoded once for all the
        // item's activation rows, then tiles (avx2_b32.h's and vnni_b32.h's dot_b32_tiled; the
        // same bits as below). Q8_0, whose decode is a load, gains 3-5% at 32-64 rows on AVX2 and
        // loses at 8: it stays below. (a0 is even here, as the zmm pairs of Act::xp need.)
        if ((qtype == T_Q5_0 || qtype == T_Q4_0) && g_b32_tiled_min_rows > 0 && a1 - a0 >= g_b32_tiled_min_rows && a0 % 2 == 0) {
            thread_local std::vector<int8_t> q;
            thread_local std::vector<float> dq;
            const int nr = (int)(r1 - r0);
            if (qtype == T_Q5_0) decode_b32_rows<BlockQ5_0>(W + r0 * row_bytes, row_bytes, nr, nb, q, dq);
            else decode_b32_rows<BlockQ4_0>(W + r0 * row_bytes, row_bytes, nr, nb, q, dq);
            dot_b32_tiled(q.data(), dq.data(), nr, nb, a, a0, a1, y + r0, n);
            return;
        }
#endif
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
