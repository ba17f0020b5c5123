// GGUF's block layouts for the weight types the kernels read, and the small scalar helpers on
// them (fp16, int16 pairs). Every kernel file reads weights through these structs.
#pragma once
#include <immintrin.h>

#include "isa.h"

#include <cstddef>
#include <cstdint>

#ifndef SPK_HIDDEN
#define SPK_HIDDEN __attribute__((visibility("hidden")))  // internal: not exported, no GOT loads
#endif

namespace spk SPK_HIDDEN {

// GGML type ids (ggml.h)
enum : int { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

struct BlockQ4K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ6K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };
static_assert(sizeof(BlockQ4K) == 144 && sizeof(BlockQ6K) == 210 && sizeof(BlockQ8_0) == 34 &&
              sizeof(BlockQ5_0) == 22 && sizeof(BlockQ4_0) == 18, "GGUF block sizes");

inline float f16(uint16_t h) { return _cvtsh_ss(h); }

inline int32_t pair16(int16_t lo, int16_t hi) { return (int32_t)((uint32_t)(uint16_t)lo | ((uint32_t)(uint16_t)hi << 16)); }

inline size_t block_bytes(int qtype) {
    switch (qtype) {
        case T_Q4_K: return sizeof(BlockQ4K);
        case T_Q6_K: return sizeof(BlockQ6K);
        case T_Q8_0: return sizeof(BlockQ8_0);
        case T_Q5_0: return sizeof(BlockQ5_0);
        case T_Q4_0: return sizeof(BlockQ4_0);
    }
    return 0;
}

inline int block_values(int qtype) { return (qtype == T_Q4_K || qtype == T_Q6_K) ? 256 : 32; }

}  // namespace spk
