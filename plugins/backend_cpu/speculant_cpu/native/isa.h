// Which instruction set this build of the library targets, from the compiler's flags (native/
// __init__.py picks them: SPECULANT_ISA). Every file includes it (through blocks.h or directly).
//   SPK_AVX512  AVX-512 F/BW/VL/VNNI (-march=native on such a CPU): the zmm kernels (vnni_k.h,
//               vnni_b32.h, tiled.cpp), and AMX where the compiler targets it (SPK_AMX, kernels.h)
//   SPK_AVX2    AVX2, FMA and F16C (-march=haswell): the ymm kernels (avx2_k.h, avx2_b32.h,
//               avx2_vec.h, the tiled avx2_tiled.cpp), with AVX-VNNI's vpdpbusd/vpdpwssd where
//               -mavxvnni is given (SPK_AVXVNNI), maddubs + madd otherwise
// Both compute the same numbers, bit for bit: every integer sum is exact on both, and the float
// operations are the same ones in the same order, lane for lane (see kernels.h).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define SPK_AVX512 1
#define SPK_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPK_AVX512 0
#define SPK_AVX2 1
#else
#error "speculant's native kernels need AVX-512 F/BW/VL/VNNI, or AVX2 with FMA and F16C"
#endif

#if SPK_AVX2 && defined(__AVXVNNI__)
#define SPK_AVXVNNI 1
#else
#define SPK_AVXVNNI 0
#endif

// spk_isa(): 1 AVX-512, 2 AVX2 with AVX-VNNI, 3 AVX2 without
#if SPK_AVX512
#define SPK_ISA_ID 1
#elif SPK_AVXVNNI
#define SPK_ISA_ID 2
#else
#define SPK_ISA_ID 3
#endif
