// Attention of query rows over an fp16 KV cache, one row at a time, the way llama.cpp's CPU
// flash-attention computes a decode step: the query rounded to fp16, fp32 dot products with the
// keys, an online softmax, and the weighted sum of values accumulated in fp16. Following its
// numerics keeps our greedy output close to llama.cpp's; computing each row on its own keeps a
// row's result independent of the other rows in the batch (the engine's exactness).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <vector>
#include <cstring>

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
extern "C" int spk_threads();

namespace {

struct AttentionCall {
    const float* q;
    int64_t rows;
    int n_head, n_kv, group, dk, dv;
    const uint16_t *k, *v;
    int64_t k_head_stride, v_head_stride;
    const int64_t* positions;
    int64_t window;
    float scale;
    float* out;
    int64_t chunks, chunk_pairs;  // the (row, head) pairs of one kv head, split into chunks
};

constexpr int MAX_HEAD_DIM = 1024;

int64_t first_key(const AttentionCall& c, int64_t p) { return c.window > 0 ? std::max<int64_t>(0, p + 1 - c.window) : 0; }

// One (row, head) pair on its own: the definition of the numerics, kept as the reference the
// grouped kernel below is tested against bit for bit.
void attend_one(int64_t item, void* ctx) {
    const AttentionCall& c = *(const AttentionCall*)ctx;
    const int64_t r = item / c.n_head;
    const int h = (int)(item % c.n_head);
    const int64_t p = c.positions[r];
    uint16_t q16[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    const float* qh = c.q + (r * c.n_head + h) * c.dk;
    for (int d = 0; d < c.dk; ++d) q16[d] = _cvtss_sh(qh[d], _MM_FROUND_TO_NEAREST_INT);
    const uint16_t* kh = c.k + (int64_t)(h / c.group) * c.k_head_stride;
    const uint16_t* vh = c.v + (int64_t)(h / c.group) * c.v_head_stride;
    std::fill(acc, acc + c.dv, 0);
    float M = -INFINITY, S = 0.f;
    for (int64_t j = first_key(c, p); j <= p; ++j) {
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
        S = std::fma(S, ms, vs);  // llama.cpp's compiled S*ms + vs is one FMA
    }
    const float s_inv = S == 0.f ? 0.f : 1.f / S;
    float* o = c.out + (r * c.n_head + h) * c.dv;
    for (int d = 0; d < c.dv; ++d) o[d] = _cvtsh_ss(acc[d]) * s_inv;
}

// expf of 16 floats with the bits of glibc's expf (the algorithm of its x86-64 FMA build: a
// 32-entry table of 2^(i/32) and a cubic in double precision), checked against libm for every
// float in [-104, 0] (spk_exp_check). Softmax calls exp once per key and (row, head); one vector
// call per 16 keys instead of 16 library calls, with the numerics unchanged.
struct ExpTable {
    uint64_t t[32];
    ExpTable() {
        for (int i = 0; i < 32; ++i) {
            const double v = (double)exp2l((long double)i / 32);
            uint64_t bits;
            std::memcpy(&bits, &v, 8);
            t[i] = bits - ((uint64_t)i << 47);
        }
    }
};
const ExpTable g_exp_table;

inline __m256 exp8_like_libm(__m256 x) {
    const __m512d inv_ln2_n = _mm512_set1_pd(0x1.71547652b82fep+0 * 32), shift = _mm512_set1_pd(0x1.8p+52);
    const __m512d c0 = _mm512_set1_pd(0x1.c6af84b912394p-5 / (32.0 * 32 * 32));
    const __m512d c1 = _mm512_set1_pd(0x1.ebfce50fac4f3p-3 / (32.0 * 32));
    const __m512d c2 = _mm512_set1_pd(0x1.62e42ff0c52d6p-1 / 32);
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d z = _mm512_mul_pd(inv_ln2_n, xd);
    __m512d kd = _mm512_add_pd(z, shift);  // round to nearest integer
    const __m512i ki = _mm512_castpd_si512(kd);
    kd = _mm512_sub_pd(kd, shift);
    const __m512d r = _mm512_fmadd_pd(inv_ln2_n, xd, _mm512_sub_pd(_mm512_setzero_pd(), kd));
    __m512i t = _mm512_i64gather_epi64(_mm512_and_si512(ki, _mm512_set1_epi64(31)), (const long long*)g_exp_table.t, 8);
    t = _mm512_add_epi64(t, _mm512_slli_epi64(ki, 47));
    const __m512d sc = _mm512_castsi512_pd(t);
    const __m512d p = _mm512_fmadd_pd(c0, r, c1);
    const __m512d r2 = _mm512_mul_pd(r, r);
    __m512d y = _mm512_fmadd_pd(c2, r, _mm512_set1_pd(1.0));
    y = _mm512_mul_pd(_mm512_fmadd_pd(p, r2, y), sc);
    __m256 out = _mm512_cvtpd_ps(y);
    // below log(2^-150) the result is 0 (also -inf); above log(2^128), +inf; NaN stays NaN
    out = _mm256_mask_blend_ps(_mm256_cmp_ps_mask(x, _mm256_set1_ps(-0x1.9fe368p6f), _CMP_LT_OQ), out, _mm256_setzero_ps());
    out = _mm256_mask_blend_ps(_mm256_cmp_ps_mask(x, _mm256_set1_ps(0x1.62e42ep6f), _CMP_GT_OQ), out, _mm256_set1_ps(INFINITY));
    return out;
}

inline __m512 exp16_like_libm(__m512 x) {
    const __m256 lo = exp8_like_libm(_mm512_castps512_ps256(x));
    const __m256 hi = exp8_like_libm(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// The same arithmetic as attend_one for a chunk of the pairs that share one kv head (the query
// heads of a GQA group, over one or more rows), in blocks of 16 keys: each key and value row is
// converted from fp16 once for the whole chunk, a pair's 16 dot products are independent work,
// and the block's exps are one vector call. Each pair still sees its keys in order with the same
// operations as attend_one, so the bits are the same.
constexpr int KEY_BLOCK = 16;

struct KeyWeight {
    float ms, vs;
    bool inside, rescale;  // the key is in the pair's range; it raised the running maximum
};

inline void to_f32(float* y, const uint16_t* x, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + i))));
    for (; i < n; ++i) y[i] = _cvtsh_ss(x[i]);
}

struct PairState {
    const float* q;
    float* out;
    int64_t lo, hi;
    float M, S;
};

void attend_chunk(int64_t item, void* ctx) {
    const AttentionCall& c = *(const AttentionCall*)ctx;
    const int kvh = (int)(item / c.chunks);
    const int64_t per_kv = c.rows * c.group;
    const int64_t t0 = (item % c.chunks) * c.chunk_pairs, t1 = std::min(per_kv, t0 + c.chunk_pairs);
    if (t0 >= t1) return;
    const int n = (int)(t1 - t0);
    const int nv = c.dv / 16, np = c.dk & ~63;
    thread_local std::vector<float> qbuf, kbuf, vbuf;
    thread_local std::vector<uint16_t> accbuf;
    thread_local std::vector<PairState> pairs;
    thread_local std::vector<KeyWeight> weights;
    weights.resize((size_t)KEY_BLOCK * n);
    qbuf.resize((size_t)n * c.dk);
    kbuf.resize((size_t)KEY_BLOCK * c.dk);
    vbuf.resize((size_t)KEY_BLOCK * c.dv);
    accbuf.assign((size_t)n * c.dv, 0);
    pairs.resize(n);
    int64_t jlo = INT64_MAX, jhi = -1;
    for (int t = 0; t < n; ++t) {
        const int64_t r = (t0 + t) / c.group;
        const int h = kvh * c.group + (int)((t0 + t) % c.group);
        const float* qh = c.q + (r * c.n_head + h) * c.dk;
        float* qf = qbuf.data() + (size_t)t * c.dk;  // the query rounded to fp16, held as fp32
        for (int d = 0; d < c.dk; ++d) qf[d] = _cvtsh_ss(_cvtss_sh(qh[d], _MM_FROUND_TO_NEAREST_INT));
        const int64_t p = c.positions[r];
        pairs[t] = PairState{qf, c.out + (r * c.n_head + h) * c.dv, first_key(c, p), p, -INFINITY, 0.f};
        jlo = std::min(jlo, pairs[t].lo);
        jhi = std::max(jhi, p);
    }
    const uint16_t* kh = c.k + (int64_t)kvh * c.k_head_stride;
    const uint16_t* vh = c.v + (int64_t)kvh * c.v_head_stride;
    for (int64_t j0 = jlo; j0 <= jhi; j0 += KEY_BLOCK) {
        const int nb = (int)std::min<int64_t>(KEY_BLOCK, jhi - j0 + 1);
        for (int u = 0; u < nb; ++u) {
            to_f32(kbuf.data() + u * c.dk, kh + (j0 + u) * c.dk, c.dk);
            to_f32(vbuf.data() + u * c.dv, vh + (j0 + u) * c.dv, c.dv);
        }
        for (int t = 0; t < n; ++t) {
            PairState& st = pairs[t];
            const int ua = (int)std::max<int64_t>(0, st.lo - j0), ub = (int)std::min<int64_t>(nb, st.hi - j0 + 1);
            if (ua >= ub) {
                for (int u = 0; u < KEY_BLOCK; ++u) weights[(size_t)u * n + t] = {1.f, 0.f, false, false};
                continue;
            }
            // dot_f16(K_j, q) for each key of the block: the same accumulators, order and reduction
            alignas(64) float s[KEY_BLOCK], arg[KEY_BLOCK], e[KEY_BLOCK];
            for (int u = ua; u < ub; ++u) {
                const float* kf = kbuf.data() + u * c.dk;
                __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int i = 0; i < np; i += 64)
                    for (int w = 0; w < 4; ++w)
                        sum[w] = _mm512_fmadd_ps(_mm512_loadu_ps(kf + i + 16 * w), _mm512_loadu_ps(st.q + i + 16 * w), sum[w]);
                sum[0] = _mm512_add_ps(sum[0], sum[2]);
                sum[1] = _mm512_add_ps(sum[1], sum[3]);
                sum[0] = _mm512_add_ps(sum[0], sum[1]);
                double rest = _mm512_reduce_add_ps(sum[0]);
                for (int i = np; i < c.dk; ++i) rest += (double)kf[i] * (double)st.q[i];
                s[u] = (float)rest * c.scale;
            }
            // the online softmax's running maximum, then all the block's exps at once
            uint32_t new_max = 0;
            float M = st.M;
            for (int u = 0; u < KEY_BLOCK; ++u) arg[u] = 0.f;
            for (int u = ua; u < ub; ++u) {
                if (s[u] > M) {
                    arg[u] = M - s[u];
                    M = s[u];
                    new_max |= 1u << u;
                } else {
                    arg[u] = s[u] - M;
                }
            }
            st.M = M;
            _mm512_store_ps(e, exp16_like_libm(_mm512_load_ps(arg)));
            for (int u = 0; u < KEY_BLOCK; ++u) {  // (ms, vs) of each key of the pair's range
                const bool inside = u >= ua && u < ub, grew = new_max >> u & 1;
                weights[(size_t)u * n + t] = {grew ? e[u] : 1.f, grew ? 1.f : e[u], inside, inside && grew};
            }
        }
        // The value rows: key by key, the pairs in turn, so that consecutive updates are of
        // different accumulators and their latency chains overlap.
        for (int u = 0; u < nb; ++u) {
            const float* vf = vbuf.data() + u * c.dv;
            for (int t = 0; t < n; ++t) {
                const KeyWeight w = weights[(size_t)u * n + t];
                if (!w.inside) continue;
                uint16_t* acc = accbuf.data() + (size_t)t * c.dv;
                if (w.rescale) scale_f16(acc, w.ms, c.dv);
                // mad_f16(acc, V_j, vs) with V_j already converted
                const __m512 vv = _mm512_set1_ps(w.vs);
                for (int i = 0; i < nv; ++i) {
                    const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(acc + 16 * i)));
                    _mm256_storeu_si256((__m256i*)(acc + 16 * i),
                                        _mm512_cvtps_ph(_mm512_fmadd_ps(_mm512_loadu_ps(vf + 16 * i), vv, b), _MM_FROUND_TO_NEAREST_INT));
                }
                for (int i = 16 * nv; i < c.dv; ++i)
                    acc[i] = _cvtss_sh(std::fma(vf[i], w.vs, _cvtsh_ss(acc[i])), _MM_FROUND_TO_NEAREST_INT);
                pairs[t].S = std::fma(pairs[t].S, w.ms, w.vs);  // as attend_one
            }
        }
    }
    for (int t = 0; t < n; ++t) {
        const PairState& st = pairs[t];
        const uint16_t* acc = accbuf.data() + (size_t)t * c.dv;
        const float s_inv = st.S == 0.f ? 0.f : 1.f / st.S;
        for (int d = 0; d < c.dv; ++d) st.out[d] = _cvtsh_ss(acc[d]) * s_inv;
    }
}

constexpr int64_t MAX_CHUNK_PAIRS = 32;  // a chunk's queries and accumulators stay in L1

}  // namespace

extern "C" {

// q [rows, n_head, dk] fp32; k [n_kv, *, dk] and v [n_kv, *, dv] fp16 with `head_stride`
// elements between kv heads (keys of one head are contiguous); positions [rows]. Row r at
// position p attends to keys lo..p, lo = p + 1 - window when window > 0. out [rows, n_head, dv].
// Returns -1 (and does nothing) for head sizes above MAX_HEAD_DIM. `grouped` 0 runs the one
// pair at a time reference (for tests); the results are the same bits.
int spk_attention_f16(const float* q, int64_t rows, int n_head, int n_kv, int dk, int dv,
                      const uint16_t* k, const uint16_t* v, int64_t k_head_stride, int64_t v_head_stride,
                      const int64_t* positions, int64_t window, float scale, float* out, int grouped) {
    if (dk > MAX_HEAD_DIM || dv > MAX_HEAD_DIM || n_kv <= 0 || n_head % n_kv != 0) return -1;
    AttentionCall call{q, rows, n_head, n_kv, n_head / n_kv, dk, dv, k, v, k_head_stride, v_head_stride, positions, window, scale, out, 1, 1};
    if (!grouped) {
        spk_parallel_for(rows * n_head, attend_one, &call);
        return 0;
    }
    // Enough chunks to give every thread work and to keep each chunk small; the split changes
    // only which thread computes a pair, never its bits.
    const int64_t per_kv = rows * call.group, threads = std::max(1, spk_threads());
    call.chunks = std::max((threads + n_kv - 1) / n_kv, (per_kv + MAX_CHUNK_PAIRS - 1) / MAX_CHUNK_PAIRS);
    call.chunks = std::min(call.chunks, per_kv);
    call.chunk_pairs = (per_kv + call.chunks - 1) / call.chunks;
    spk_parallel_for(n_kv * call.chunks, attend_chunk, &call);
    return 0;
}

// Floats x with bit patterns first, first + step, ... <= last where the vector exp differs from
// libm's expf: 0 is what the attention's bit-for-bit guarantee rests on (a test runs this).
int64_t spk_exp_check(uint32_t first, uint32_t last, uint32_t step) {
    int64_t bad = 0;
    alignas(64) float x[16], y[16];
    int n = 0;
    auto flush = [&]() {
        _mm512_store_ps(y, exp16_like_libm(_mm512_load_ps(x)));
        for (int i = 0; i < n; ++i) {
            const float ref = std::exp(x[i]);
            bad += std::memcmp(&ref, &y[i], 4) != 0;
        }
        n = 0;
    };
    for (uint64_t b = first; b <= last; b += step) {
        const uint32_t bits = (uint32_t)b;
        std::memcpy(&x[n++], &bits, 4);
        if (n == 16) flush();
    }
    if (n) {
        for (int i = n; i < 16; ++i) x[i] = 0.f;
        flush();
    }
    return bad;
}

}  // extern "C"
