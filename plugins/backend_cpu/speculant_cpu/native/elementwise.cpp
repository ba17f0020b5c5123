// Element-wise pieces of the forward pass with llama.cpp's CPU arithmetic, operation for
// operation, so that a forward's float results can be llama.cpp's bit for bit:
//   spk_swiglu      silu(x) * g with ggml's AVX-512 exp approximation (a degree-5 polynomial on
//                   the reduced argument, then scalef), libm's expf for a row's tail
//   spk_gelu_table  tanh-GELU of every fp16 value, rounded to fp16 (ggml evaluates GELU from
//                   such a table)
//   spk_rope_table  the rotary cos/sin of each position: the angle chained in float
//                   (theta *= base^(-2/d) per pair), then libm's cosf/sinf
//   spk_rope_apply  the rotation, with the FMAs llama.cpp's compiled code has
//   spk_rms_norm    RMSNorm with its sum of squares in double, in order
// The library is built with -ffp-contract=off: the FMAs are the ones written here, where ggml's
// compiled code has them.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

// exp(x) as ggml_v_expf computes it: n = round(x / ln 2) through the 1.5 * 2^23 shift, b = x -
// n ln 2 in two FMA steps (ln 2 split into a high and a low part), a polynomial in b, times 2^n;
// |n| > 192 saturates to +inf (n > 0) or 0.
inline __m512 exp_ggml(__m512 x) {
    const __m512 shift = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), shift);
    const __m512 n = _mm512_sub_ps(z, shift);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 out_of_range = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 hi = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                                      _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f)));
    const __m512 j = _mm512_fmadd_ps(hi, u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (!out_of_range) return res;
    const __m512 saturated = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                                  _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(out_of_range, res, saturated);
}

inline __m512 silu_ggml(__m512 x) {
    const __m512 e = exp_ggml(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

}  // namespace

extern "C" {

// y[r, i] = silu(x[r, i]) * g[r, i] for rows of n values: 16 at a time, the rest of a row in
// scalar code with libm's expf (as ggml does for a row's tail).
void spk_swiglu(const float* x, const float* g, float* y, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r, x += n, g += n, y += n) {
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(y + i, _mm512_mul_ps(silu_ggml(_mm512_loadu_ps(x + i)), _mm512_loadu_ps(g + i)));
        for (; i < n; ++i) y[i] = x[i] / (1.0f + expf(-x[i])) * g[i];
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
void spk_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; ++r, x += n, y += n) {
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) sum += (double)(x[i] * x[i]);
        const float mean = (float)(sum / (double)n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
    }
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
