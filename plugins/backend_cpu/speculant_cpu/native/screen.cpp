// The screen of a greedy row's logits (speculant_cpu/screen.py): from approximate logits a[n]
// with a bound |exact_v - a_v| <= half_v = q_v * x_bound + slack, the tokens whose exact logit
// can still be the largest. The lowest upper bound of the best lower bound: every token whose
// upper bound a_v + half_v reaches max_u (a_u - half_u) is kept; no other can be the argmax.
#include <immintrin.h>

#include "spk.h"

#include <cmath>
#include <cstdint>

// Rows i of a[m, n]: their candidates' indices (ascending) into idx[i * cap ...], their count
// into counts[i]; a row with more than cap candidates gets counts[i] = -1 (screen it no further).
int spk_screen_select(const float* a, int64_t m, int64_t n, const float* q, const float* x_bound, float slack, int32_t* idx,
                      int64_t cap, int64_t* counts) {
    for (int64_t i = 0; i < m; ++i) {
        const float* row = a + i * n;
        const float xb = x_bound[i];
        // pass 1: the best lower bound
        __m256 best = _mm256_set1_ps(-INFINITY);
        const __m256 xv = _mm256_set1_ps(xb), sv = _mm256_set1_ps(slack);
        int64_t v = 0;
        for (; v + 8 <= n; v += 8) {
            const __m256 half = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(q + v), xv), sv);
            best = _mm256_max_ps(best, _mm256_sub_ps(_mm256_loadu_ps(row + v), half));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, best);
        float lo = lanes[0];
        for (int t = 1; t < 8; ++t) lo = lanes[t] > lo ? lanes[t] : lo;
        for (; v < n; ++v) {
            const float l = row[v] - (q[v] * xb + slack);
            lo = l > lo ? l : lo;
        }
        // pass 2: every upper bound that reaches it
        int64_t c = 0;
        int32_t* out = idx + i * cap;
        const __m256 lov = _mm256_set1_ps(lo);
        for (v = 0; v + 8 <= n && c >= 0; v += 8) {
            const __m256 half = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(q + v), xv), sv);
            unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(row + v), half), lov, _CMP_GE_OQ));
            while (mask) {
                if (c == cap) { c = -1; break; }
                out[c++] = (int32_t)(v + __builtin_ctz(mask));
                mask &= mask - 1;
            }
        }
        for (; v < n && c >= 0; ++v) {
            if (row[v] + (q[v] * xb + slack) >= lo) {
                if (c == cap) { c = -1; break; }
                out[c++] = (int32_t)v;
            }
        }
        counts[i] = c;
    }
    return 0;
}
