// The one thread pool every kernel of the library shares (the linear layers, attention, the
// element-wise kernels through spk_parallel_for), the lock that serializes calls, and the C API
// for threads: spk_set_threads, spk_threads, spk_parallel_for, spk_prefault, spk_copy.
#include "kernels.h"
#include "pool.h"

#include <cstring>

namespace spk SPK_HIDDEN {

Pool* g_pool = nullptr;
std::mutex g_call_mu;

Pool& pool() {
    if (!g_pool) g_pool = new Pool((int)std::max(1u, std::thread::hardware_concurrency()));
    return *g_pool;
}

}  // namespace spk

using spk::g_call_mu;
using spk::pool;

extern "C" {

void spk_set_threads(int n) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    pool().resize(n);
}

int spk_threads() { return pool().size(); }

// Touch every page of [p, p + bytes) from all threads, so a model's first forward does not pay
// for hundreds of thousands of page faults.
void spk_prefault(const void* ptr, int64_t bytes) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    const volatile uint8_t* b = (const volatile uint8_t*)ptr;
    std::atomic<int64_t> next{0};
    const int64_t step = 1 << 20;
    pool().run([&](int, int) {
        for (int64_t off; (off = next.fetch_add(step)) < bytes;) {
            const int64_t end = std::min(bytes, off + step);
            for (int64_t o = off; o < end; o += 4096) (void)b[o];
        }
    });
}

// dst[0, bytes) = src[0, bytes) from all threads: weights copied into fresh memory at load
// (hugepages.py), whose page faults then run on every core. In a VM whose free memory goes back
// to the host, each fresh 2 MiB page is backed again when first written: 900 MB took 5.5 s from
// one thread, 1.8 s from two (a 2-core Firecracker guest).
void spk_copy(void* dst, const void* src, int64_t bytes) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    std::atomic<int64_t> next{0};
    const int64_t step = 2 << 20;
    pool().run([&](int, int) {
        for (int64_t off; (off = next.fetch_add(step)) < bytes;)
            std::memcpy((char*)dst + off, (const char*)src + off, (size_t)std::min(step, bytes - off));
    });
}

// Run fn(i, ctx) for i in [0, n) on the pool's threads (for the other kernels of the library,
// such as attention.cpp, so that one set of threads serves all of them).
void spk_parallel_for(int64_t n, void (*fn)(int64_t, void*), void* ctx) {
    std::lock_guard<std::mutex> lock(g_call_mu);
    std::atomic<int64_t> next{0};
    pool().run([&](int, int) {
        for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i, ctx);
    });
}

}  // extern "C"
