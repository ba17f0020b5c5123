// Attention of query rows over an fp16 KV cache, one row at a time, the way llama.cpp's CPU
// flash-attention computes a decode step: the query rounded to fp16, fp32 dot products with the
// keys, an online softmax, and the weighted sum of values accumulated in fp16. Following its
// numerics keeps our greedy output close to llama.cpp's; computing each row on its own keeps a
// row's result independent of the other rows in the batch (the engine's exactness).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <algorithm>

namespace {

// fp32 dot of two fp16 vectors: four 16-lane accumulators over steps of 64, then pairwise.
inline float dot_f16(const uint16_t* x, const uint16_t* y, int n) {
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int np = n & ~63;
    for (int i = 0; i < np; i += 64)
        for (int j = 0; j < 4; ++j) {
            const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + i + 16 * j)));
            const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(y + i + 16 * j)));
            sum[j] = _mm512_fmadd_ps(a, b, sum[j]);
        }
    sum[0] = _mm512_add_ps(sum[0], sum[2]);
    sum[1] = _mm512_add_ps(sum[1], sum[3]);
    sum[0] = _mm512_add_ps(sum[0], sum[1]);
    double rest = _mm512_reduce_add_ps(sum[0]);
    for (int i = np; i < n; ++i) rest += (double)_cvtsh_ss(x[i]) * (double)_cvtsh_ss(y[i]);
    return (float)rest;
}

// y = fp16(y * v), elementwise
inline void scale_f16(uint16_t* y, float v, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 a = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(y + i))), _mm512_set1_ps(v));
        _mm256_storeu_si256((__m256i*)(y + i), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; ++i) y[i] = _cvtss_sh(_cvtsh_ss(y[i]) * v, _MM_FROUND_TO_NEAREST_INT);
}

// y = fp16(x * v + y), elementwise (one fp32 fma, then rounding to fp16)
inline void mad_f16(uint16_t* y, const uint16_t* x, float v, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + i)));
        const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(y + i)));
        _mm256_storeu_si256((__m256i*)(y + i), _mm512_cvtps_ph(_mm512_fmadd_ps(a, _mm512_set1_ps(v), b), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; ++i) y[i] = _cvtss_sh(std::fma(_cvtsh_ss(x[i]), v, _cvtsh_ss(y[i])), _MM_FROUND_TO_NEAREST_INT);
}

}  // namespace

extern "C" void spk_parallel_for(int64_t n, void (*fn)(int64_t, void*), void* ctx);  // qmatmul.cpp

namespace {

struct AttentionCall {
    const float* q;
    int n_head, group, dk, dv;
    const uint16_t *k, *v;
    int64_t k_head_stride, v_head_stride;
    const int64_t* positions;
    int64_t window;
    float scale;
    float* out;
};

constexpr int MAX_HEAD_DIM = 1024;

// One (row, head) pair: its result depends on nothing else, so any split over threads gives the
// same bits.
void attend_one(int64_t item, void* ctx) {
    const AttentionCall& c = *(const AttentionCall*)ctx;
    const int64_t r = item / c.n_head;
    const int h = (int)(item % c.n_head);
    const int64_t p = c.positions[r];
    const int64_t lo = c.window > 0 ? std::max<int64_t>(0, p + 1 - c.window) : 0;
    uint16_t q16[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    const float* qh = c.q + (r * c.n_head + h) * c.dk;
    for (int d = 0; d < c.dk; ++d) q16[d] = _cvtss_sh(qh[d], _MM_FROUND_TO_NEAREST_INT);
    const uint16_t* kh = c.k + (int64_t)(h / c.group) * c.k_head_stride;
    const uint16_t* vh = c.v + (int64_t)(h / c.group) * c.v_head_stride;
    std::fill(acc, acc + c.dv, 0);
    float M = -INFINITY, S = 0.f;
    for (int64_t j = lo; j <= p; ++j) {
        const float s = dot_f16(kh + j * c.dk, q16, c.dk) * c.scale;
        const float m_old = M;
        float ms = 1.f, vs = 1.f;
        if (s > M) {  // a new maximum: rescale what was summed so far
            M = s;
            ms = std::exp(m_old - M);
            scale_f16(acc, ms, c.dv);
        } else {
            vs = std::exp(s - M);
        }
        mad_f16(acc, vh + j * c.dv, vs, c.dv);
        S = S * ms + vs;
    }
    const float s_inv = S == 0.f ? 0.f : 1.f / S;
    float* o = c.out + (r * c.n_head + h) * c.dv;
    for (int d = 0; d < c.dv; ++d) o[d] = _cvtsh_ss(acc[d]) * s_inv;
}

}  // namespace

extern "C" {

// q [rows, n_head, dk] fp32; k [n_kv, *, dk] and v [n_kv, *, dv] fp16 with `head_stride`
// elements between kv heads (keys of one head are contiguous); positions [rows]. Row r at
// position p attends to keys lo..p, lo = p + 1 - window when window > 0. out [rows, n_head, dv].
// Returns -1 (and does nothing) for head sizes above MAX_HEAD_DIM.
int spk_attention_f16(const float* q, int64_t rows, int n_head, int n_kv, int dk, int dv,
                      const uint16_t* k, const uint16_t* v, int64_t k_head_stride, int64_t v_head_stride,
                      const int64_t* positions, int64_t window, float scale, float* out) {
    if (dk > MAX_HEAD_DIM || dv > MAX_HEAD_DIM || n_kv <= 0 || n_head % n_kv != 0) return -1;
    AttentionCall call{q, n_head, n_head / n_kv, dk, dv, k, v, k_head_stride, v_head_stride, positions, window, scale, out};
    spk_parallel_for(rows * n_head, attend_one, &call);
    return 0;
}

}  // extern "C"
