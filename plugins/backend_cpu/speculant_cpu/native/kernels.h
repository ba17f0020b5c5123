// The native library's internal interface: what crosses its files (the activation buffer, the
// work-item sizes, and the functions one file calls in another). spk.h stays the C API's one
// list; this header is for the library's own files. Every .cpp includes it (or spk.h).
//
// Fused dequantize-and-multiply kernels for GGUF weights on x86 CPUs with AVX-512 VNNI (and
// AMX-INT8 where the CPU has it), or, in a build for AVX2 (isa.h), with AVX2 (and AVX-VNNI where
// the CPU has it): the same results bit for bit.
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
// and then the one canonical fp32 epilogue (epilogue.h's epilogue_q4k), in block order, lane-wise: 4
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
// Called through ctypes (no Python or torch headers: it builds in a few seconds). Threads come
// from a small pool of our own (pool.h); the caller runs a share of the work too.
//
// Where things are: isa.h (which ISA the build targets), blocks.h (the GGUF block layouts),
// unpack.h (weight blocks into registers), epilogue.h (the shared fp32 epilogues), quantize.cpp
// (the activations), vnni_k.h and vnni_b32.h (the per-row VNNI kernels; avx2_k.h and avx2_b32.h
// the same on AVX2), tiled.cpp (tiled VNNI), tiled_pairs.cpp (its groups of 8 rows),
// avx2_tiled.cpp (tiled on AVX2), amx.cpp (AMX), linear.cpp (the path choice, the
// dispatcher and the spk_linear* C API), pool.h/.cpp (threads), cpu.cpp (AMX detection, the
// ISA), vec16.h (16-float vectors and the vector exps of attention.cpp and elementwise.cpp).
//
// Everything internal is in namespace spk with hidden visibility: nothing but spk_* is exported,
// and globals are reached without the GOT. The kernel headers (unpack.h, epilogue.h, vnni_k.h,
// vnni_b32.h, avx2_k.h, avx2_b32.h, vec16.h) put their code in an anonymous namespace inside it, so that each file including
// them has its own internal copy, as when all of this was one file: GCC then specializes the
// kernels to their one caller (constant-propagated clones, the same inlining), and the machine
// code of the row kernels is what it was before the split (compared function by function).
#pragma once
#include <immintrin.h>

#include "isa.h"
#include "spk.h"
#include "blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SPK_AMX 1
#endif

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace spk SPK_HIDDEN {

// Quantized activations. One buffer per call, rows of nb blocks.
struct Act {
    int nb = 0;                 // blocks per row
    int bsize = 0;              // 256 (Q8_K) or 32 (Q8_0)
    // VNNI layout
    std::vector<int8_t> qs;     // [m, nb, bsize]
    std::vector<float> d;       // [m, nb]
    std::vector<int16_t> bs16;  // Q8_K: sums of each 16 values [m, nb, 16]
    std::vector<int16_t> bs32;  // Q8_K: sums of each 32 values [m, nb, 8]
    std::vector<int8_t> xp;     // Q8_0, m >= 2: rows in pairs [m/2, nb, 2, 32] (for dot_b32's zmm)
    std::vector<float> dp;      // Q8_0, m >= 2: their scales, each broadcast to 8 lanes [m/2, nb, 2, 8]
    // AMX layout (Q8_K only): groups of 16 rows, the last one padded with zero rows.
    std::vector<int8_t> bt;     // [group, nb, 64, 16, 4]: a tile B per block (value v of row i at [v/4][i][v%4])
    std::vector<float> dt;      // [group, nb, 16]: scales, lane = row in the group
    std::vector<int32_t> bp;    // [group, nb, 64]: Q4_K: int16 pairs of the sums of each 32 values [4][16]
                                //                  (pair p: sub-blocks 2p, 2p+1);
                                //                  Q6_K: the sums of all 256 values [16]
    std::vector<int32_t> bq;    // Q6_K for q6k_tiled: [group, nb, 8, 16]: int16 pairs of the sums of
                                // each 16 values (pair p: 2p, 2p+1); empty otherwise
};

constexpr int ROW_CHUNK = 16;   // weight rows per work item
constexpr int ACT_TILE = 64;    // activation rows per work item: keeps them in L2 while weights stream
constexpr int NR_MAX = 8;       // activation rows sharing one decode of a weight block
constexpr int TILED_GROUPS_MAX = 4;  // activation groups of a tiled VNNI work item: ACT_TILE / 16
constexpr int AMX_GROUPS_MAX = 4;    // activation groups of 16 rows per AMX work item (ACT_TILE / 16)
constexpr int PAIR_GROUPS_MAX = 8;   // activation groups of 8 rows per tiled-pairs work item (ACT_TILE / 8)
static_assert(ROW_CHUNK == 16 && ACT_TILE % 16 == 0 && ACT_TILE <= 16 * AMX_GROUPS_MAX &&
              ACT_TILE <= 16 * TILED_GROUPS_MAX && ACT_TILE <= 8 * PAIR_GROUPS_MAX, "work items");

// quantize.cpp: the activations, as llama.cpp's CPU backend quantizes them.
void quantize_q8k_row(const float* x, int nb, bool q4k_order, int8_t* qs, float* d, int16_t* bs16, int16_t* bs32);
void quantize_q8k_block_amx(const float* x, int64_t m, int64_t k, int nb, bool q4k, bool q4k_order, int64_t g, int b, Act& a,
                            bool pairs);
void quantize_q80_row(const float* x, int nb, int8_t* qs, float* d);

// cpu.cpp: can the AMX kernel run here (CPU, build, OS permission, SPECULANT_AMX)?
bool amx_ok();

// pool.cpp: the threads (pool.h has the class) and the lock that serializes the library's calls.
class Pool;
Pool& pool();
extern std::mutex g_call_mu;  // one matmul at a time: the pool and the activation buffer are shared

// tiled.cpp (AVX-512 builds; avx2_tiled.cpp in AVX2 builds): weight rows [0, nr) against activation groups g0 .. g0 + ng - 1 (ng <= TILED_GROUPS_MAX)
// in the AMX layout, on VNNI (Q4_K in decode arithmetic, Q6_K canonical; `prompt`: both in
// llama.cpp's prompt arithmetic); [next, next + next_bytes), the next chunk, streams into L2 meanwhile.
void linear_tiled(int qtype, bool prompt, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0, int ng,
                  int64_t i0, int64_t i1, float* y, int64_t ldy, const uint8_t* next, int64_t next_bytes);
// tiled_pairs.cpp (AVX-512 builds): the same on groups of 8 activation rows (the `pairs` layout of
// quantize_q8k_block_amx), two weight rows per zmm (ng <= PAIR_GROUPS_MAX).
void linear_tiled_pairs(int qtype, bool prompt, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int64_t g0,
                        int ng, int64_t i0, int64_t i1, float* y, int64_t ldy, const uint8_t* next, int64_t next_bytes);

#ifdef SPK_AMX
// amx.cpp: a chunk of nr <= 16 weight rows against activation groups g0 .. g0 + ng - 1 on AMX
// tiles; [pf, pf + pf_bytes) is prefetched meanwhile. tiles_ready(): this thread's tile config.
void amx_rows(bool q4k, bool prompt, const uint8_t* W, size_t row_bytes, int nb, int nr, const Act& a, int g0, int ng,
              int64_t i0, int64_t i1, float* y, int64_t ldy, const uint8_t* pf, int64_t pf_bytes);
void tiles_ready();
#endif

}  // namespace spk
