// The library's thread pool (a class, so that run() can take any callable and inline it).
// pool.cpp holds the one instance and the C API for it.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels.h"

namespace spk SPK_HIDDEN {

// A pool of worker threads. Workers spin briefly between jobs (consecutive matmuls of a layer
// follow each other within microseconds), then sleep on a condition variable.
class Pool {
  public:
    explicit Pool(int n) { resize(n); }
    ~Pool() { stop_workers(); }

    int size() const { return (int)workers_.size() + 1; }

    void resize(int n) {
        stop_workers();
        stop_ = false;
        // Workers start from the current generation: one that starts late must still see the next job.
        const uint64_t now = generation_.load();
        for (int t = 1; t < std::max(1, n); ++t) workers_.emplace_back([this, t, now] { loop(t, now); });
    }

    template <class F>
    void run(F&& f) {  // f(thread index, thread count) on every thread, the caller included
        const int n = size();
        if (n == 1) { f(0, 1); return; }
        job_ = [&f, n](int t) { f(t, n); };
        pending_.store(n - 1, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lock(mu_);
            generation_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        job_(0);
        // Wait for the workers; yield the core after a while in case one of them needs it.
        for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
            if (spins < 2000) _mm_pause();
            else std::this_thread::yield();
        }
    }

  private:
    void loop(int t, uint64_t seen) {
        for (;;) {
            int spins = 0;
            while (generation_.load(std::memory_order_acquire) == seen && !stop_.load()) {
                if (++spins < 4000) { _mm_pause(); continue; }
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
            }
            if (stop_.load()) return;
            seen = generation_.load(std::memory_order_acquire);
            job_(t);
            pending_.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

    void stop_workers() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& w : workers_) w.join();
        workers_.clear();
    }

    std::vector<std::thread> workers_;
    std::function<void(int)> job_;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<bool> stop_{false};
    std::mutex mu_;
    std::condition_variable cv_;
};

}  // namespace spk
