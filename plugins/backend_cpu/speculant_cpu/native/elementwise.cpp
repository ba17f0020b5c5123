// Element-wise pieces of the forward pass with llama.cpp's CPU arithmetic, operation for
// operation, so that a forward's float results can be llama.cpp's bit for bit:
//   spk_swiglu      silu(x) * g with ggml's AVX-512 exp approximation (a degree-5 polynomial on
//                   the reduced argument, then scalef; vec16.h, the same bits on AVX2), libm's
//                   expf for a row's last values short of 16
//   spk_gelu_table  tanh-GELU of every fp16 value, rounded to fp16 (ggml evaluates GELU from
//                   such a table)
//   spk_rope_table  the rotary cos/sin of each position: the angle chained in float
//                   (theta *= base^(-2/d) per pair), then libm's cosf/sinf
//   spk_rope_apply  the rotation, with the FMAs llama.cpp's compiled code has
//   spk_rms_norm    RMSNorm with its sum of squares in double, in order
// The library is built with -ffp-contract=off: the FMAs are the ones written here, where ggml's
// compiled code has them.
#include <immintrin.h>

#include "spk.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>


namespace {

constexpr int64_t SWIGLU_PIECE = 2048;  // values per work item (a multiple of 16)
constexpr int64_t RMS_ROWS = 8;         // rows whose sums of squares run side by side

using namespace spk;

// silu(x) = x / (1 + exp(-x)), with ggml's AVX-512 vector exp (vec16.h's exp16_ggml, on every ISA)
inline vf16 silu_ggml(vf16 x) {
    const vf16 e = exp16_ggml(v_sub(v_zero(), x));
    return v_div(x, v_add(v_set1(1.0f), e));
}

// One RMSNorm for R rows side by side (spk_rms_norm).
template <int R>
void rms_norm_rows(const float* x, const float* w, float* y, int64_t n, float eps) {
    double sum[R] = {};
    for (int64_t i = 0; i < n; ++i)
        for (int t = 0; t < R; ++t) sum[t] += (double)(x[t * n + i] * x[t * n + i]);
    for (int t = 0; t < R; ++t) {
        const float mean = (float)(sum[t] / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < n; ++i) y[t * n + i] = x[t * n + i] * scale * w[i];
    }
}

}  // namespace

extern "C" {

// y[r, i] = silu(x[r, i]) * g[r, i] for rows of n values: 16 at a time, the rest of a row in
// scalar code with libm's expf (as ggml does for a row's tail). Element-wise, so the pool's
// threads take pieces of SWIGLU_PIECE values (whole vectors) in any order: the division in silu
// makes a row of 8960 about 3.5 us on one thread (48 rows: 182 -> 106 us on two).
void spk_swiglu(const float* x, const float* g, float* y, int64_t rows, int64_t n, int64_t ld) {
    struct Call { const float *x, *g; float* y; int64_t n, ld, pieces; } c{x, g, y, n, ld, (n + SWIGLU_PIECE - 1) / SWIGLU_PIECE};
    auto piece = [](int64_t item, void* ctx) {
        const Call& c = *(const Call*)ctx;
        const int64_t r = item / c.pieces, i0 = (item % c.pieces) * SWIGLU_PIECE, i1 = std::min(c.n, i0 + SWIGLU_PIECE);
        const float *x = c.x + r * c.ld, *g = c.g + r * c.ld;
        float* y = c.y + r * c.n;
        int64_t i = i0;
        for (; i + 16 <= i1; i += 16)
            v_store(y + i, v_mul(silu_ggml(v_load(x + i)), v_load(g + i)));
        for (; i < i1; ++i) y[i] = x[i] / (1.0f + expf(-x[i])) * g[i];
    };
    if (rows == 1) {  // a decode row: not worth waking the pool
        for (int64_t item = 0; item < c.pieces; ++item) piece(item, &c);
    } else {
        spk_parallel_for(rows * c.pieces, piece, &c);
    }
}

// table[h] = fp16(gelu(float(fp16 h))) for every 16-bit pattern h, with
// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))) in float, libm's tanhf, and the one
// contraction a compiler makes of it: 1 + (0.044715 x) x as an FMA.
void spk_gelu_table(uint16_t* table) {
    const float a = 0.044715f, s = 0.79788456080286535587989211986876f;
    for (uint32_t h = 0; h < 65536; ++h) {
        const float x = _cvtsh_ss((uint16_t)h);
        const float inner = std::fma(a * x, x, 1.0f);
        const float v = 0.5f * x * (1.0f + tanhf(s * x * inner));
        table[h] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    }
}

// cos/sin [n, n_dims / 2] for the positions pos[0..n): per position, theta = pos (as float), then
// for each pair: theta' = freq_scale * theta, cosf(theta'), sinf(theta'), theta *= base^(-2/n_dims).
void spk_rope_table(const int64_t* pos, int64_t n, int n_dims, float base, float freq_scale, float* cos_out, float* sin_out) {
    const float theta_scale = powf(base, -2.0f / n_dims);
    const int half = n_dims / 2;
    for (int64_t r = 0; r < n; ++r) {
        float theta = (float)pos[r];
        for (int i = 0; i < half; ++i) {
            const float t = freq_scale * theta;
            cos_out[r * half + i] = cosf(t);
            sin_out[r * half + i] = sinf(t);
            theta *= theta_scale;
        }
    }
}

// RMSNorm of rows of n floats, times the weight: the squares (rounded to float) summed in double
// one after the other, the mean rounded to float, scale = 1 / sqrtf(mean + eps), y = (x * scale) * w.
// The in-order sum is a chain of n dependent adds, so RMS_ROWS rows run side by side (one chain
// each) and groups of them go to the pool's threads.
void spk_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
    struct Call { const float *x, *w; float* y; int64_t rows, n; float eps; } c{x, w, y, rows, n, eps};
    auto group = [](int64_t item, void* ctx) {
        const Call& c = *(const Call*)ctx;
        const int64_t r = item * RMS_ROWS, off = r * c.n;
        switch (std::min<int64_t>(RMS_ROWS, c.rows - r)) {
            case 8: rms_norm_rows<8>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
            case 7: rms_norm_rows<7>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
            case 6: rms_norm_rows<6>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
            case 5: rms_norm_rows<5>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
            case 4: rms_norm_rows<4>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
            case 3: rms_norm_rows<3>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
            case 2: rms_norm_rows<2>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
            default: rms_norm_rows<1>(c.x + off, c.w, c.y + off, c.n, c.eps); break;
        }
    };
    const int64_t groups = (rows + RMS_ROWS - 1) / RMS_ROWS;
    if (groups == 1) group(0, &c);  // not worth waking the pool
    else spk_parallel_for(groups, group, &c);
}

// Rotate x [rows, heads, d] in place by cos/sin [rows, d / 2]: pairs (i, i + d/2) when neox, else
// (2i, 2i + 1); x0' = fma(x0, cos, -(x1 * sin)), x1' = fma(x0, sin, x1 * cos), as llama.cpp's
// compiled rotation rounds.
void spk_rope_apply(float* x, const float* cos_t, const float* sin_t, int64_t rows, int64_t heads, int64_t d, int neox) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            float* v = x + (r * heads + h) * d;
            for (int64_t i = 0; i < half; ++i) {
                const float c = cos_t[r * half + i], s = sin_t[r * half + i];
                float* a = neox ? v + i : v + 2 * i;
                float* b = neox ? v + i + half : v + 2 * i + 1;
                const float x0 = *a, x1 = *b;
                *a = std::fma(x0, c, -(x1 * s));
                *b = std::fma(x0, s, x1 * c);
            }
        }
}

}  // extern "C"
