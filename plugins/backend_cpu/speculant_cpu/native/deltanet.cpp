// The Gated DeltaNet recurrence (Qwen3.5's linear-attention layers) with llama.cpp's CPU
// arithmetic, so that a row's output is its bits whatever the rows around it:
//   spk_gated_delta_net  per row t, per head h (S = the head's [d_v, d_k] state, one row per
//                        value channel j):
//                          S *= decay[t, h]                               (ggml_vec_scale_f32)
//                          delta_j = (v[t, h, j] - dot(S_j, k[t, h])) * beta[t, h]
//                          S_j += delta_j * k[t, h]                       (FMAs, ggml_vec_mad_f32)
//                          out[t, h, j] = dot(S_j, q[t, h]) * scale
//                        dot is ggml_vec_dot_f32 as llama.cpp's AVX-512 build computes it: 4
//                        accumulators of 16 lanes over the first d - d % 64 values, FMAs after
//                        the first product, summed (0+2)+(1+3), the lanes by halves down to four,
//                        then as _mm512_reduce_add_ps ((0+2)+(1+3)); the rest of the values one
//                        by one, product then sum. The AVX2 builds too: every ISA of this library
//                        computes the AVX-512 build's bits, as every other kernel does (llama.cpp's
//                        AVX2 build sums in 8 lanes with two hadds here, and differs in attention's
//                        fp16 dots and SwiGLU's exp too, which follow the AVX-512 build: matching
//                        its order here alone would match neither build; docs/architecture.md).
// A row's channels are independent, so each is taken through all four steps at once while it
// sits in L1. Heads run in parallel on the pool. Built with -ffp-contract=off: every FMA is a
// written fmaf (the loops vectorise to vfmadd), every other product is rounded by itself.
#include "spk.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int EPR = 16;  // llama.cpp's AVX-512 build, on every ISA (above)
constexpr int ARR = 4;
constexpr int STEP = EPR * ARR;

inline float ggml_dot(const float* x, const float* y, int n) {
    const int n_simd = n - n % STEP;
    float s = 0.0f;
    if (n_simd) {
        float acc[ARR][EPR];
        for (int a = 0; a < ARR; ++a)
            for (int l = 0; l < EPR; ++l) acc[a][l] = x[a * EPR + l] * y[a * EPR + l];
        for (int b = STEP; b < n_simd; b += STEP)
            for (int a = 0; a < ARR; ++a)
                for (int l = 0; l < EPR; ++l) acc[a][l] = fmaf(x[b + a * EPR + l], y[b + a * EPR + l], acc[a][l]);
        float t[EPR];
        for (int l = 0; l < EPR; ++l) t[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
        for (int w = EPR / 2; w >= 4; w /= 2)
            for (int l = 0; l < w; ++l) t[l] = t[l + w] + t[l];
        s = (t[0] + t[2]) + (t[1] + t[3]);
    }
    for (int i = n_simd; i < n; ++i) {
        const float p = x[i] * y[i];
        s = s + p;
    }
    return s;
}

struct DeltaNetJob {
    float* state;
    const float *q, *k, *v, *decay, *beta;
    int64_t n;
    int hv, dv, dk;
    float scale;
    float* out;
    float* per_row;
};

void delta_net_head(int64_t h, void* p) {
    const DeltaNetJob& J = *static_cast<const DeltaNetJob*>(p);
    const int64_t head_size = (int64_t)J.dv * J.dk;
    float* S = J.state + h * head_size;
    for (int64_t t = 0; t < J.n; ++t) {
        const int64_t th = t * J.hv + h;
        const float g = J.decay[th], b = J.beta[th];
        const float* kt = J.k + th * J.dk;
        const float* qt = J.q + th * J.dk;
        const float* vt = J.v + th * J.dv;
        float* o = J.out + th * J.dv;
        for (int j = 0; j < J.dv; ++j) {
            float* Sj = S + (int64_t)j * J.dk;
            for (int i = 0; i < J.dk; ++i) Sj[i] = Sj[i] * g;
            const float delta = (vt[j] - ggml_dot(Sj, kt, J.dk)) * b;
            for (int i = 0; i < J.dk; ++i) Sj[i] = fmaf(delta, kt[i], Sj[i]);
            o[j] = ggml_dot(Sj, qt, J.dk) * J.scale;
        }
        if (J.per_row) std::memcpy(J.per_row + th * head_size, S, head_size * sizeof(float));
    }
}

}  // namespace

extern "C" {

// state [hv, dv, dk] is updated in place; q, k [n, hv, dk], v [n, hv, dv], decay, beta [n, hv],
// out [n, hv, dv]; per_row (or null) [n, hv, dv, dk] receives the state after each row.
int spk_gated_delta_net(float* state, const float* q, const float* k, const float* v, const float* decay, const float* beta, int64_t n, int hv, int dv, int dk, float scale, float* out, float* per_row) {
    if (n < 0 || hv <= 0 || dv <= 0 || dk <= 0) return 0;
    DeltaNetJob job{state, q, k, v, decay, beta, n, hv, dv, dk, scale, out, per_row};
    spk_parallel_for(hv, delta_net_head, &job);
    return 1;
}

}  // extern "C"
