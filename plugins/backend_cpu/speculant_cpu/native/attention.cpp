// Attention of query rows over an fp16 KV cache, one row at a time, the way llama.cpp's CPU
// flash-attention computes a decode step: the query rounded to fp16, fp32 dot products with the
// keys, an online softmax, and the weighted sum of values accumulated in fp16. Following its
// numerics keeps our greedy output close to llama.cpp's; computing each row on its own keeps a
// row's result independent of the other rows in the batch (the engine's exactness).
// Rows at positions from `exact_below` on take plain fp32 flash attention instead (16-key blocks
// at fixed offsets, a block-wise online softmax): llama.cpp splits the keys of such rows between
// threads, so its bits cannot be had there anyway, and the fp16 rounding after every key is most
// of the cost of a long context.
// The vectors are vec16.h's 16 floats (a zmm, or two ymm on AVX2), so the bits are the same on
// every ISA; the loops that hold many vectors in registers block them by the ISA's register count.
#include <immintrin.h>

#include "spk.h"
#include "vec16.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <vector>
#include <cstring>

namespace {

using namespace spk;

// fp32 dot of two fp16 vectors: four 16-lane accumulators over steps of 64, then pairwise.
inline float dot_f16(const uint16_t* x, const uint16_t* y, int n) {
    vf16 sum[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
    const int np = n & ~63;
    for (int i = 0; i < np; i += 64)
        for (int j = 0; j < 4; ++j) sum[j] = v_fmadd(v_load_f16(x + i + 16 * j), v_load_f16(y + i + 16 * j), sum[j]);
    sum[0] = v_add(sum[0], sum[2]);
    sum[1] = v_add(sum[1], sum[3]);
    sum[0] = v_add(sum[0], sum[1]);
    double rest = v_reduce_add(sum[0]);
    for (int i = np; i < n; ++i) rest += (double)_cvtsh_ss(x[i]) * (double)_cvtsh_ss(y[i]);
    return (float)rest;
}

// y = fp16(y * v), elementwise
inline void scale_f16(uint16_t* y, float v, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) v_store_f16(y + i, v_mul(v_load_f16(y + i), v_set1(v)));
    for (; i < n; ++i) y[i] = _cvtss_sh(_cvtsh_ss(y[i]) * v, _MM_FROUND_TO_NEAREST_INT);
}

// y = fp16(x * v + y), elementwise (one fp32 fma, then rounding to fp16)
inline void mad_f16(uint16_t* y, const uint16_t* x, float v, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) v_store_f16(y + i, v_fmadd(v_load_f16(x + i), v_set1(v), v_load_f16(y + i)));
    for (; i < n; ++i) y[i] = _cvtss_sh(std::fma(_cvtsh_ss(x[i]), v, _cvtsh_ss(y[i])), _MM_FROUND_TO_NEAREST_INT);
}

}  // namespace


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
    int64_t exact_below;          // rows at positions from here on take the fp32 arithmetic
};

constexpr int MAX_HEAD_DIM = 1024;

int64_t first_key(const AttentionCall& c, int64_t p) { return c.window > 0 ? std::max<int64_t>(0, p + 1 - c.window) : 0; }

// exp16_fast and exp_fast (the fp32 path), exp16_like_libm (llama.cpp's): vec16.h.

constexpr int KEY_BLOCK = 16;
// fp32 pairs scored together (their accumulators in registers: 4 chains each, 24 of 32 zmm)
constexpr int GROUP_MAX = 6;
constexpr int DOT_CHAINS = 4;  // a score is 4 fma chains over the dims d % 4, summed as a tree
// vf16 accumulators the value loops keep in registers: on AVX2 those shared by a group of pairs
// (AVX-512: values_per_pass), and one pair's (at most 8). AVX2's 16 ymm hold a quarter of what
// AVX-512's 32 zmm hold of them.
constexpr int ACC_VECS = 4, ONE_VECS = SPK_AVX512 ? 8 : 4;

// The fp32 path for one pair, scalar, in the grouped kernel's operation order: the reference it
// is tested against bit for bit. Blocks of 16 keys start at multiples of 16 of the key index, so a
// pair's blocks (and bits) depend only on its own key range, never on the pairs computed with it.
void fast_reference(const AttentionCall& c, const float* qh, const uint16_t* kh, const uint16_t* vh, int64_t lo, int64_t p, float* o) {
    float q[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
    for (int d = 0; d < c.dk; ++d) q[d] = qh[d] * c.scale;
    std::fill(acc, acc + c.dv, 0.f);
    float M = -INFINITY, S = 0.f;
    for (int64_t j0 = lo & ~(int64_t)(KEY_BLOCK - 1); j0 <= p; j0 += KEY_BLOCK) {
        const int ua = (int)std::max<int64_t>(0, lo - j0), ub = (int)std::min<int64_t>(KEY_BLOCK, p - j0 + 1);
        float s[KEY_BLOCK], e[KEY_BLOCK] = {}, bmax = -INFINITY;
        for (int u = ua; u < ub; ++u) {
            float a[DOT_CHAINS] = {};
            for (int d = 0; d < c.dk; ++d) a[d % DOT_CHAINS] = std::fma(q[d], _cvtsh_ss(kh[(j0 + u) * c.dk + d]), a[d % DOT_CHAINS]);
            s[u] = (a[0] + a[1]) + (a[2] + a[3]);
            bmax = std::max(bmax, s[u]);
        }
        const float m = std::max(M, bmax), corr = M == -INFINITY ? 0.f : exp_fast(M - m);
        for (int u = ua; u < ub; ++u) e[u] = exp_fast(s[u] - m);
        float h[KEY_BLOCK], g[KEY_BLOCK];  // v_sum16's tree
        for (int i = 0; i < 16; ++i) h[i] = e[i] + e[i ^ 8];
        for (int i = 0; i < 16; ++i) g[i] = h[i] + h[i ^ 4];
        for (int i = 0; i < 16; ++i) h[i] = g[i] + g[i ^ 2];
        S = std::fma(S, corr, h[0] + h[1]);
        for (int d = 0; d < c.dv; ++d) {
            float a = acc[d] * corr;
            for (int u = ua; u < ub; ++u) a = std::fma(e[u], _cvtsh_ss(vh[(j0 + u) * c.dv + d]), a);
            acc[d] = a;
        }
        M = m;
    }
    const float s_inv = S == 0.f ? 0.f : 1.f / S;
    for (int d = 0; d < c.dv; ++d) o[d] = acc[d] * s_inv;
}

// One (row, head) pair on its own: the definition of the numerics, kept as the reference the
// grouped kernel below is tested against bit for bit.
void attend_one(int64_t item, void* ctx) {
    const AttentionCall& c = *(const AttentionCall*)ctx;
    const int64_t r = item / c.n_head;
    const int h = (int)(item % c.n_head);
    const int64_t p = c.positions[r];
    if (p >= c.exact_below) {
        fast_reference(c, c.q + (r * c.n_head + h) * c.dk, c.k + (int64_t)(h / c.group) * c.k_head_stride,
                       c.v + (int64_t)(h / c.group) * c.v_head_stride, first_key(c, p), p, c.out + (r * c.n_head + h) * c.dv);
        return;
    }
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

// The same arithmetic as attend_one for a chunk of the pairs that share one kv head (the query
// heads of a GQA group, over one or more rows), in blocks of 16 keys: each key and value row is
// converted from fp16 once for the whole chunk, a pair's 16 dot products are independent work,
// and the block's exps are one vector call. Each pair still sees its keys in order with the same
// operations as attend_one, so the bits are the same. Pairs on the fp32 path (rows from
// exact_below on) share the block's converted keys and values, the keys also transposed (16 keys
// per dim) so that a pair's 16 scores are dk broadcast FMAs with no horizontal sums, each key
// vector loaded once for a group of up to GROUP_MAX pairs (a decode row's six query heads of a
// kv head in Qwen2.5: one group). A group's values read the fp16 cache directly when it is the
// block's only group, so a decode row converts no value row to a buffer. The scores' and values'
// FMAs are about half of the time on Zen 4 (one zmm FMA a cycle); the key transposes a fifth.

struct KeyWeight {
    float ms, vs;
    bool inside, rescale;  // the key is in the pair's range; it raised the running maximum
};

inline void to_f32(float* y, const uint16_t* x, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) v_store(y + i, v_load_f16(x + i));
    for (; i < n; ++i) y[i] = _cvtsh_ss(x[i]);
}

struct PairState {
    const float* q;
    float* out;
    int64_t lo, hi;
    float M, S;
};

#if SPK_AVX512
// 16 vectors of 16 floats transposed in registers: r[i][u] becomes r[u][i].
inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // r[4i + k], 128-bit lane l: column 4l + k of rows 4i..4i+3
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
        t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);
        t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    }
    for (int k = 0; k < 4; ++k) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xDD);
        r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xDD);
    }
}

// Keys 0..nb-1 of k (rows of dk fp16) to fp32 and transposed: kt[d * 16 + u] = k[u][d], 0 for u >= nb.
inline void keys_transposed(float* kt, const uint16_t* k, int nb, int dk) {
    for (int d0 = 0; d0 < dk; d0 += 16) {
        const int w = std::min(16, dk - d0);
        const __mmask16 m = (__mmask16)((1u << w) - 1);
        __m512 r[16];
        for (int u = 0; u < 16; ++u)
            r[u] = u < nb ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, k + (int64_t)u * dk + d0)) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < w; ++i) _mm512_storeu_ps(kt + (d0 + i) * 16, r[i]);
    }
}
#else
// 8 vectors of 8 floats transposed in registers: r[i][u] becomes r[u][i].
inline void transpose8(__m256 r[8]) {
    __m256 t[8], q[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // q[4i + k], 128-bit lane l: column 4l + k of rows 4i..4i+3
        q[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        q[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        q[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        q[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
        r[k] = _mm256_permute2f128_ps(q[k], q[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(q[k], q[4 + k], 0x31);
    }
}

// Keys 0..nb-1 of k (rows of dk fp16) to fp32 and transposed: kt[d * 16 + u] = k[u][d], 0 for u >= nb.
inline void keys_transposed(float* kt, const uint16_t* k, int nb, int dk) {
    const int d8 = dk & ~7;
    for (int d0 = 0; d0 < d8; d0 += 8)
        for (int h = 0; h < 2; ++h) {  // keys 8h .. 8h + 7
            __m256 r[8];
            for (int u = 0; u < 8; ++u)
                r[u] = 8 * h + u < nb ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(k + (int64_t)(8 * h + u) * dk + d0))) : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d0 + i) * 16 + 8 * h, r[i]);
        }
    for (int d = d8; d < dk; ++d)
        for (int u = 0; u < 16; ++u) kt[d * 16 + u] = u < nb ? _cvtsh_ss(k[(int64_t)u * dk + d]) : 0.f;
}
#endif

// The 16 scores of P pairs (queries q[i]) against a block of keys transposed (kt): each key row
// loaded once for the P pairs, DOT_CHAINS fma chains per pair. The arithmetic of a pair is the
// same whatever P (and on AVX2, where the lanes go in two halves of 8, two pairs at a time).
#if SPK_AVX512
template <int P>
inline void block_scores(const float* const* q, const float* kt, int dk, vf16* s) {
    __m512 a[P][DOT_CHAINS];
    for (int i = 0; i < P; ++i)
        for (int w = 0; w < DOT_CHAINS; ++w) a[i][w] = _mm512_setzero_ps();
    int d = 0;
    for (; d + DOT_CHAINS <= dk; d += DOT_CHAINS)
        for (int w = 0; w < DOT_CHAINS; ++w) {
            const __m512 kd = _mm512_loadu_ps(kt + (d + w) * 16);
            for (int i = 0; i < P; ++i) a[i][w] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d + w]), kd, a[i][w]);
        }
    for (; d < dk; ++d) {
        const __m512 kd = _mm512_loadu_ps(kt + d * 16);
        for (int i = 0; i < P; ++i) a[i][d % DOT_CHAINS] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), kd, a[i][d % DOT_CHAINS]);
    }
    for (int i = 0; i < P; ++i) s[i] = _mm512_add_ps(_mm512_add_ps(a[i][0], a[i][1]), _mm512_add_ps(a[i][2], a[i][3]));
}
#else
// AVX2: the same four chains a score, one chain at a time. Chain w takes the dims d = w mod 4 in
// order and the chains are summed as the same tree afterwards, so the bits are the AVX-512
// kernel's; but one chain at a time, the P pairs' two halves need 2P accumulators, not 8P, so
// all of a decode row's six pairs fit in the 16 ymm and each broadcast query value and key load
// serves 12 FMAs (two pairs at a time with four chains live, the loads had bound the loop:
// three loads for two FMAs).
template <int P>
inline void block_scores(const float* const* q, const float* kt, int dk, vf16* s) {
    __m256 chain[DOT_CHAINS][P][2];
    for (int w = 0; w < DOT_CHAINS; ++w) {
        __m256 a[P][2];
        for (int i = 0; i < P; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int d = w; d < dk; d += DOT_CHAINS) {
            const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
            for (int i = 0; i < P; ++i) {
                const __m256 qd = _mm256_broadcast_ss(q[i] + d);
                a[i][0] = _mm256_fmadd_ps(qd, k0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qd, k1, a[i][1]);
            }
        }
        for (int i = 0; i < P; ++i) chain[w][i][0] = a[i][0], chain[w][i][1] = a[i][1];
    }
    for (int i = 0; i < P; ++i) {
        __m256 h[2];
        for (int j = 0; j < 2; ++j)
            h[j] = _mm256_add_ps(_mm256_add_ps(chain[0][i][j], chain[1][i][j]), _mm256_add_ps(chain[2][i][j], chain[3][i][j]));
        s[i] = {h[0], h[1]};
    }
}
#endif

// A key block's value rows: fp32, converted once for the many pairs of a chunk (F32Rows), or
// straight from the fp16 cache (F16Rows: a few pairs, each vector converted as it is loaded,
// no copy). The same values either way (the conversion is exact).
struct F32Rows {
    const float* p;
    int stride;
    vf16 load(int u, int i) const { return v_load(p + (int64_t)u * stride + 16 * i); }
};
struct F16Rows {
    const uint16_t* p;
    int stride;
    vf16 load(int u, int i) const { return v_load_f16(p + (int64_t)u * stride + 16 * i); }
};

// acc[16 v0, 16 (v0 + NV)) = acc * corr + sum of w[u] V_u over keys ua..ub-1, the NV vectors in
// registers through the keys (one broadcast per key for NV fmas).
template <int NV, class Rows>
inline void accumulate(float* acc, const Rows& vr, int v0, const float* w, int ua, int ub, vf16 corr) {
    vf16 x[NV];
    for (int i = 0; i < NV; ++i) x[i] = v_mul(v_load(acc + 16 * (v0 + i)), corr);
    for (int u = ua; u < ub; ++u) {
        const vf16 wu = v_set1(w[u]);
        for (int i = 0; i < NV; ++i) x[i] = v_fmadd(wu, vr.load(u, v0 + i), x[i]);
    }
    for (int i = 0; i < NV; ++i) v_store(acc + 16 * (v0 + i), x[i]);
}

// The online softmax step of a group of P pairs on the fp32 path for a block (fast_reference's
// arithmetic), given their scores s[i]: each pair's block weights w[i] (0 outside its keys
// ua..ub-1) and the factor corr[i] that rescales what it has accumulated so far. The P
// rescaling exps are one vector exp, lane i pair i's (lane by lane the arithmetic of exp_fast).
inline void softmax_group(int P, PairState* const* st, vf16* s, const int* ua, const int* ub, float (*w)[KEY_BLOCK], vf16* corr) {
    alignas(64) float arg[16] = {}, m[16] = {}, c[16];
    for (int i = 0; i < P; ++i) {
        // keys outside the pair's range weigh exactly 0, whatever the cache holds there
        s[i] = v_blend(m_range(ua[i], ub[i]), v_set1(-INFINITY), s[i]);
        m[i] = std::max(st[i]->M, v_reduce_max(s[i]));
        arg[i] = st[i]->M == -INFINITY ? 0.f : st[i]->M - m[i];
    }
    v_store(c, exp16_fast(v_load(arg)));
    for (int i = 0; i < P; ++i) {
        const float ci = st[i]->M == -INFINITY ? 0.f : c[i];
        const vf16 e = v_maskz(m_range(ua[i], ub[i]), exp16_fast(v_sub(s[i], v_set1(m[i]))));
        st[i]->S = std::fma(st[i]->S, ci, v_sum16(e));
        st[i]->M = m[i];
        v_store(w[i], e);
        corr[i] = v_set1(ci);
    }
}

// The values of a block for P pairs with the same key range ua..ub-1: acc_i = acc_i * corr_i + sum
// of w_i[u] V_u, key by key, each accumulator vector of each pair in its own register (the
// operations of accumulate<> for each pair), every value vector loaded once for the P pairs.
// Vectors [v0, v0 + NV) of the rows.
template <int P, int NV, class Rows>
inline void accumulate_pairs(float* const* acc, const Rows& vr, const float* const* w, int ua, int ub, const vf16* corr, int v0) {
    vf16 x[P][NV];
    for (int i = 0; i < P; ++i)
        for (int j = 0; j < NV; ++j) x[i][j] = v_mul(v_load(acc[i] + 16 * (v0 + j)), corr[i]);
    for (int u = ua; u < ub; ++u) {
        vf16 vu[NV];
        for (int j = 0; j < NV; ++j) vu[j] = vr.load(u, v0 + j);
        for (int i = 0; i < P; ++i) {
            const vf16 wu = v_set1(w[i][u]);
            for (int j = 0; j < NV; ++j) x[i][j] = v_fmadd(wu, vu[j], x[i][j]);
        }
    }
    for (int i = 0; i < P; ++i)
        for (int j = 0; j < NV; ++j) v_store(acc[i] + 16 * (v0 + j), x[i][j]);
}

// The value vectors a pass of accumulate_pairs<P> keeps in registers for each of the P pairs: AVX-512,
// P * NV accumulators, NV value vectors and a weight within the 32 zmm, NV a power of two (the
// 128-value heads' 8 vectors in whole passes); AVX2, ACC_VECS / P.
constexpr int values_per_pass(int P) {
    if (!SPK_AVX512) return std::max(1, ACC_VECS / P);
    int nv = 8;
    while (nv > 1 && P * nv + nv + 1 > 32) nv /= 2;
    return nv;
}

// The values of a block for P pairs (2 <= P <= GROUP_MAX) that share the key range ua..ub-1.
template <int P, class Rows>
inline void values_shared(float* const* acc, const Rows& vr, int nvec, const float* const* w, int ua, int ub, const vf16* corr) {
    constexpr int NV = values_per_pass(P);
    int v0 = 0;
    for (; v0 + NV <= nvec; v0 += NV) accumulate_pairs<P, NV>(acc, vr, w, ua, ub, corr, v0);
    for (; v0 < nvec; ++v0) accumulate_pairs<P, 1>(acc, vr, w, ua, ub, corr, v0);
}

// The values of a block for one pair (its own key range).
template <class Rows>
inline void values_one(float* acc, const Rows& vr, int nvec, const float* w, int ua, int ub, vf16 cv) {
    for (int v0 = 0; v0 < nvec; v0 += ONE_VECS) {
        switch (std::min(ONE_VECS, nvec - v0)) {
            case 8: accumulate<8>(acc, vr, v0, w, ua, ub, cv); break;
            case 7: accumulate<7>(acc, vr, v0, w, ua, ub, cv); break;
            case 6: accumulate<6>(acc, vr, v0, w, ua, ub, cv); break;
            case 5: accumulate<5>(acc, vr, v0, w, ua, ub, cv); break;
            case 4: accumulate<4>(acc, vr, v0, w, ua, ub, cv); break;
            case 3: accumulate<3>(acc, vr, v0, w, ua, ub, cv); break;
            case 2: accumulate<2>(acc, vr, v0, w, ua, ub, cv); break;
            default: accumulate<1>(acc, vr, v0, w, ua, ub, cv); break;
        }
    }
}

// The values of a group of P pairs: shared where they all have the same key range (every block
// but a pair's first and last), else pair by pair.
template <class Rows>
inline void group_values(int P, float* const* acc, const Rows& vr, int nvec, const float* const* w, const int* ua, const int* ub,
                         const vf16* corr) {
    bool same = true;
    for (int i = 1; i < P; ++i) same = same && ua[i] == ua[0] && ub[i] == ub[0];
    if (!same || P == 1) {
        for (int i = 0; i < P; ++i) values_one(acc[i], vr, nvec, w[i], ua[i], ub[i], corr[i]);
        return;
    }
    switch (P) {
        case 6: values_shared<6>(acc, vr, nvec, w, ua[0], ub[0], corr); break;
        case 5: values_shared<5>(acc, vr, nvec, w, ua[0], ub[0], corr); break;
        case 4: values_shared<4>(acc, vr, nvec, w, ua[0], ub[0], corr); break;
        case 3: values_shared<3>(acc, vr, nvec, w, ua[0], ub[0], corr); break;
        default: values_shared<2>(acc, vr, nvec, w, ua[0], ub[0], corr); break;
    }
}

// The key and value rows of the block at key j (up to jhi) into L2. A decode row's attention
// reads its cache from memory (the layer's weights have streamed through the caches since), and
// with a block of compute between a block's loads the hardware prefetcher leaves it waiting: one
// Zen 4 core pulled about 4.5 GB/s. Two blocks ahead, into L2: the 1.5B's shapes (12 query heads,
// 2 kv heads), one row after 1500 tokens, 28 layers' caches in turn, 2 cores, medians of five
// alternated runs 168-211 -> 155-174 us a call (88 with the cache in L2); 2 rows 233 -> 212;
// 16 rows and more, where the FMAs bound it, unchanged. Into L1 (T0) it was slower: 219-230, one
// block ahead, its misses filling the L1's buffers.
constexpr int PREFETCH_BLOCKS = 2;
inline void prefetch_block(const uint16_t* kh, const uint16_t* vh, const AttentionCall& c, int64_t j, int64_t jhi) {
    if (j > jhi) return;
    const int64_t keys = std::min<int64_t>(KEY_BLOCK, jhi - j + 1);
    const char* k = (const char*)(kh + j * c.dk);
    const char* v = (const char*)(vh + j * c.dv);
    for (int64_t o = 0; o < keys * c.dk * 2; o += 64) _mm_prefetch(k + o, _MM_HINT_T1);
    for (int64_t o = 0; o < keys * c.dv * 2; o += 64) _mm_prefetch(v + o, _MM_HINT_T1);
}

void attend_chunk(int64_t item, void* ctx) {
    const AttentionCall& c = *(const AttentionCall*)ctx;
    const int kvh = (int)(item / c.chunks);
    const int64_t per_kv = c.rows * c.group;
    const int64_t t0 = (item % c.chunks) * c.chunk_pairs, t1 = std::min(per_kv, t0 + c.chunk_pairs);
    if (t0 >= t1) return;
    const int n = (int)(t1 - t0);
    const int nv = c.dv / 16, np = c.dk & ~63;
    const int dvp = (c.dv + 15) & ~15;  // value rows and fp32 accumulators padded to whole vectors
    thread_local std::vector<float> qbuf, kbuf, vbuf, ktbuf, accf;
    thread_local std::vector<uint16_t> accbuf;
    thread_local std::vector<PairState> pairs;
    thread_local std::vector<int> exact, fast, active;  // the pairs on each path; those with keys in a block
    thread_local std::vector<KeyWeight> weights;
    weights.resize((size_t)KEY_BLOCK * n);
    qbuf.resize((size_t)n * c.dk);
    kbuf.resize((size_t)KEY_BLOCK * c.dk);
    ktbuf.resize((size_t)KEY_BLOCK * c.dk);
    vbuf.resize((size_t)KEY_BLOCK * dvp);
    accbuf.assign((size_t)n * c.dv, 0);
    accf.assign((size_t)n * dvp, 0.f);
    pairs.resize(n);
    exact.clear();
    fast.clear();
    int64_t jlo = INT64_MAX, jhi = -1;
    for (int t = 0; t < n; ++t) {
        const int64_t r = (t0 + t) / c.group;
        const int h = kvh * c.group + (int)((t0 + t) % c.group);
        const float* qh = c.q + (r * c.n_head + h) * c.dk;
        const int64_t p = c.positions[r];
        float* qf = qbuf.data() + (size_t)t * c.dk;
        if (p >= c.exact_below) {
            for (int d = 0; d < c.dk; ++d) qf[d] = qh[d] * c.scale;
            fast.push_back(t);
        } else {
            for (int d = 0; d < c.dk; ++d) qf[d] = _cvtsh_ss(_cvtss_sh(qh[d], _MM_FROUND_TO_NEAREST_INT));  // rounded to fp16
            exact.push_back(t);
        }
        pairs[t] = PairState{qf, c.out + (r * c.n_head + h) * c.dv, first_key(c, p), p, -INFINITY, 0.f};
        jlo = std::min(jlo, pairs[t].lo);
        jhi = std::max(jhi, p);
    }
    const uint16_t* kh = c.k + (int64_t)kvh * c.k_head_stride;
    const uint16_t* vh = c.v + (int64_t)kvh * c.v_head_stride;
    // Blocks start at multiples of 16 (the fp32 path's blocks; for the exact path only the key
    // order matters).
    for (int64_t j0 = jlo & ~(int64_t)(KEY_BLOCK - 1); j0 <= jhi; j0 += KEY_BLOCK) {
        const int nb = (int)std::min<int64_t>(KEY_BLOCK, jhi - j0 + 1);
        prefetch_block(kh, vh, c, j0 + PREFETCH_BLOCKS * KEY_BLOCK, jhi);
        active.clear();
        for (const int t : fast)
            if (pairs[t].lo < j0 + nb && pairs[t].hi >= j0) active.push_back(t);
        // A few fp32 pairs (a decode row's query heads) read the value rows straight from the fp16
        // cache; many share one fp32 copy of them, as the exact path's pairs do.
        const bool fold_v = c.dv % 16 == 0 && (int)active.size() <= GROUP_MAX;
        const bool v_f32 = !exact.empty() || !fold_v;
        for (int u = 0; u < nb; ++u) {
            if (!exact.empty()) to_f32(kbuf.data() + u * c.dk, kh + (j0 + u) * c.dk, c.dk);
            if (v_f32) to_f32(vbuf.data() + u * dvp, vh + (j0 + u) * c.dv, c.dv);
        }
        if (!active.empty()) {
            keys_transposed(ktbuf.data(), kh + j0 * c.dk, nb, c.dk);
            const F32Rows v32{vbuf.data(), dvp};
            const F16Rows v16{vh + j0 * c.dv, c.dv};
            for (size_t f = 0; f < active.size(); f += GROUP_MAX) {  // scores GROUP_MAX pairs at a time
                const int P = (int)std::min<size_t>(GROUP_MAX, active.size() - f);
                const float* qs[GROUP_MAX];
                vf16 s[GROUP_MAX];
                for (int i = 0; i < P; ++i) qs[i] = pairs[active[f + i]].q;
                switch (P) {
                    case 6: block_scores<6>(qs, ktbuf.data(), c.dk, s); break;
                    case 5: block_scores<5>(qs, ktbuf.data(), c.dk, s); break;
                    case 4: block_scores<4>(qs, ktbuf.data(), c.dk, s); break;
                    case 3: block_scores<3>(qs, ktbuf.data(), c.dk, s); break;
                    case 2: block_scores<2>(qs, ktbuf.data(), c.dk, s); break;
                    default: block_scores<1>(qs, ktbuf.data(), c.dk, s); break;
                }
                alignas(64) float w[GROUP_MAX][KEY_BLOCK];
                const float* wp[GROUP_MAX];
                float* accs[GROUP_MAX];
                PairState* st[GROUP_MAX];
                vf16 corr[GROUP_MAX];
                int ua[GROUP_MAX], ub[GROUP_MAX];
                for (int i = 0; i < P; ++i) {
                    const int t = active[f + i];
                    st[i] = &pairs[t];
                    ua[i] = (int)std::max<int64_t>(0, st[i]->lo - j0);
                    ub[i] = (int)std::min<int64_t>(nb, st[i]->hi - j0 + 1);
                    wp[i] = w[i];
                    accs[i] = accf.data() + (size_t)t * dvp;
                }
                softmax_group(P, st, s, ua, ub, w, corr);
                if (fold_v) group_values(P, accs, v16, c.dv / 16, wp, ua, ub, corr);
                else group_values(P, accs, v32, dvp / 16, wp, ua, ub, corr);
            }
        }
        for (const int t : exact) {
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
                vf16 sum[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
                for (int i = 0; i < np; i += 64)
                    for (int w = 0; w < 4; ++w) sum[w] = v_fmadd(v_load(kf + i + 16 * w), v_load(st.q + i + 16 * w), sum[w]);
                sum[0] = v_add(sum[0], sum[2]);
                sum[1] = v_add(sum[1], sum[3]);
                sum[0] = v_add(sum[0], sum[1]);
                double rest = v_reduce_add(sum[0]);
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
            v_store(e, exp16_like_libm(v_load(arg)));
            for (int u = 0; u < KEY_BLOCK; ++u) {  // (ms, vs) of each key of the pair's range
                const bool inside = u >= ua && u < ub, grew = new_max >> u & 1;
                weights[(size_t)u * n + t] = {grew ? e[u] : 1.f, grew ? 1.f : e[u], inside, inside && grew};
            }
        }
        // The value rows: key by key, the pairs in turn, so that consecutive updates are of
        // different accumulators and their latency chains overlap.
        for (int u = 0; u < nb; ++u) {
            const float* vf = vbuf.data() + u * dvp;
            for (const int t : exact) {
                const KeyWeight w = weights[(size_t)u * n + t];
                if (!w.inside) continue;
                uint16_t* acc = accbuf.data() + (size_t)t * c.dv;
                if (w.rescale) scale_f16(acc, w.ms, c.dv);
                // mad_f16(acc, V_j, vs) with V_j already converted
                const vf16 vv = v_set1(w.vs);
                for (int i = 0; i < nv; ++i) v_store_f16(acc + 16 * i, v_fmadd(v_load(vf + 16 * i), vv, v_load_f16(acc + 16 * i)));
                for (int i = 16 * nv; i < c.dv; ++i)
                    acc[i] = _cvtss_sh(std::fma(vf[i], w.vs, _cvtsh_ss(acc[i])), _MM_FROUND_TO_NEAREST_INT);
                pairs[t].S = std::fma(pairs[t].S, w.ms, w.vs);  // as attend_one
            }
        }
    }
    for (const int t : exact) {
        const PairState& st = pairs[t];
        const uint16_t* acc = accbuf.data() + (size_t)t * c.dv;
        const float s_inv = st.S == 0.f ? 0.f : 1.f / st.S;
        for (int d = 0; d < c.dv; ++d) st.out[d] = _cvtsh_ss(acc[d]) * s_inv;
    }
    for (const int t : fast) {
        const PairState& st = pairs[t];
        const float* acc = accf.data() + (size_t)t * dvp;
        const float s_inv = st.S == 0.f ? 0.f : 1.f / st.S;
        for (int d = 0; d < c.dv; ++d) st.out[d] = acc[d] * s_inv;
    }
}

constexpr int64_t MAX_CHUNK_PAIRS = 288;  // a kv head's pairs in one chunk up to 48 rows (qwen2.5: 6 query heads a kv head): its keys and values converted once

}  // namespace

extern "C" {

// q [rows, n_head, dk] fp32; k [n_kv, *, dk] and v [n_kv, *, dv] fp16 with `head_stride`
// elements between kv heads (keys of one head are contiguous); positions [rows]. Row r at
// position p attends to keys lo..p, lo = p + 1 - window when window > 0. out [rows, n_head, dv].
// Returns -1 (and does nothing) for head sizes above MAX_HEAD_DIM. `grouped` 0 runs the one
// pair at a time reference (for tests); the results are the same bits. Rows at positions from
// `exact_below` on take the fp32 flash-attention arithmetic, the others llama.cpp's.
int spk_attention_f16(const float* q, int64_t rows, int n_head, int n_kv, int dk, int dv,
                      const uint16_t* k, const uint16_t* v, int64_t k_head_stride, int64_t v_head_stride,
                      const int64_t* positions, int64_t window, float scale, float* out, int grouped, int64_t exact_below) {
    if (dk > MAX_HEAD_DIM || dv > MAX_HEAD_DIM || n_kv <= 0 || n_head % n_kv != 0) return -1;
    if (rows <= 0) return 0;  // nothing to attend (and no chunks to divide the pairs into)
    AttentionCall call{q, rows, n_head, n_kv, n_head / n_kv, dk, dv, k, v, k_head_stride, v_head_stride, positions, window, scale, out, 1, 1, exact_below};
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

// y[i] = exp(x[i]) by one of the library's vector exps (for tests: every ISA must give the same
// bits): 0 the libm-exact one (llama.cpp's attention), 1 the fp32 attention's, 2 ggml's (SwiGLU).
// Returns -1 for another `which`.
int spk_vexp(int which, const float* x, int64_t n, float* y) {
    if (which < 0 || which > 2) return -1;
    alignas(64) float in[16], out[16];
    for (int64_t i = 0; i < n; i += 16) {
        const int w = (int)std::min<int64_t>(16, n - i);
        for (int j = 0; j < 16; ++j) in[j] = j < w ? x[i + j] : 0.f;
        const vf16 v = v_load(in);
        v_store(out, which == 0 ? exp16_like_libm(v) : which == 1 ? exp16_fast(v) : exp16_ggml(v));
        std::memcpy(y + i, out, 4 * w);
    }
    return 0;
}

// Floats x with bit patterns first, first + step, ... <= last where the vector exp differs from
// libm's expf: 0 is what the attention's bit-for-bit guarantee rests on (a test runs this).
int64_t spk_exp_check(uint32_t first, uint32_t last, uint32_t step) {
    int64_t bad = 0;
    alignas(64) float x[16], y[16];
    int n = 0;
    auto flush = [&]() {
        v_store(y, exp16_like_libm(v_load(x)));
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
