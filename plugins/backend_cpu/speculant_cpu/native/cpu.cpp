// CPU feature detection: whether the AMX kernel can run here (the CPU has AMX-TILE and
// AMX-INT8, the library was built with them, Linux granted this process the tile state, and
// SPECULANT_AMX is not 0), and the C API that reports it and the ISA the library was built for.
#include "kernels.h"

#ifdef SPK_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdlib>

namespace spk SPK_HIDDEN {

bool amx_ok() {
    static const bool ok = [] {
#ifdef SPK_AMX
        const char* env = std::getenv("SPECULANT_AMX");
        if (env && env[0] == '0') return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
        // Linux hands out the tile state only on request, once per process.
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
        return false;
#endif
    }();
    return ok;
}

}  // namespace spk

using spk::amx_ok;

extern "C" {

// 1 when the Q4_K/Q6_K AMX path can run here (the CPU has AMX-INT8, the library was built with
// it, Linux granted the tile state, SPECULANT_AMX is not 0).
int spk_amx_available() { return amx_ok() ? 1 : 0; }

// The instruction set the library was built for (isa.h): 1 AVX-512 (VNNI), 2 AVX2 with AVX-VNNI,
// 3 AVX2 without it.
int spk_isa() { return SPK_ISA_ID; }

// 1 when the library was compiled with the AMX kernel (a compiler that knows AMX, -march=native on
// a CPU that has it).
int spk_amx_built() {
#ifdef SPK_AMX
    return 1;
#else
    return 0;
#endif
}

}  // extern "C"
