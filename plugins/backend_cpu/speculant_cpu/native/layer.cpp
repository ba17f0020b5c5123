// One pre-norm decoder layer of the llama family (llama, qwen2) in one call: the same native
// kernels, in the same order, as the architecture's Python forward calls them one by one
// (spk_rms_norm, spk_linear_prompt, the bias adds, spk_rope_apply, the fp16 cache writes,
// spk_attention_f16, spk_swiglu), so the bits are the same; what goes is the Python and torch
// around some fifteen calls a layer (about 80 us a layer, 2-3 ms a forward of the 1.5B).
//
//   h = norm(x) ; q, k, v = Wq h + bq, Wk h + bk, Wv h + bv ; rotate q, k ; cache k, v
//   x += Wo attn(q, cache) ; h = norm(x) ; gu = Wgu h ; x += Wd (silu(gu[:n_ff]) * gu[n_ff:])
#include <immintrin.h>

#include "spk.h"

#include <cstring>
#include <vector>

namespace {

// y [rows, m.n] = x [rows, m.k] @ W^T (+ bias), every row as `kinds` says (null: decode rows).
int product(const SpkMatrix& m, const float* x, int64_t rows, float* y, const float* bias, const uint8_t* kinds) {
    const int failed = kinds ? spk_linear_prompt((int)m.qtype, m.w, m.n, m.k, x, rows, y, kinds)
                             : spk_linear((int)m.qtype, m.w, m.n, m.k, x, rows, y);
    if (failed || !bias) return failed;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < m.n; ++i) y[r * m.n + i] += bias[i];
    return 0;
}

// rows of n floats, fp32 to fp16 with round to nearest even (as torch's copy into the cache)
inline void to_f16(uint16_t* y, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

}  // namespace

extern "C" {

// x_out [rows, d] = the layer applied to x_in [rows, d] (they may not overlap). Returns 0, or -1
// where a kernel refused its input (nothing is then known about x_out or the cache rows).
int spk_llama_layer(const SpkLlamaLayer* L, const SpkLayerCall* c, const float* x_in, float* x_out, int64_t rows) {
    const int64_t d = L->d, hd = L->head_dim, nq = L->n_head * hd, nkv = L->n_kv * hd, n_ff = L->n_ff;
    thread_local std::vector<float> h, q, k, v, attn, gu, act;
    h.resize(rows * d);
    q.resize(rows * nq);
    k.resize(rows * nkv);
    v.resize(rows * nkv);
    attn.resize(rows * nq);
    gu.resize(rows * 2 * n_ff);
    act.resize(rows * n_ff);
    const float eps = (float)L->eps;

    spk_rms_norm(x_in, L->attn_norm, h.data(), rows, d, eps);
    if (product(L->wq, h.data(), rows, q.data(), L->bq, c->kinds) || product(L->wk, h.data(), rows, k.data(), L->bk, c->kinds) ||
        product(L->wv, h.data(), rows, v.data(), L->bv, c->kinds))
        return -1;
    spk_rope_apply(q.data(), c->cos_t, c->sin_t, rows, L->n_head, hd, (int)L->neox);
    spk_rope_apply(k.data(), c->cos_t, c->sin_t, rows, L->n_kv, hd, (int)L->neox);
    for (int64_t g = 0; g < c->n_groups; ++g) {
        const SpkRowGroup& G = c->groups[g];
        const int64_t start = c->positions[G.first];
        for (int64_t r = G.first; r < G.end; ++r)
            for (int64_t j = 0; j < L->n_kv; ++j) {
                to_f16(G.k_cache + j * G.k_head_stride + (start + r - G.first) * hd, k.data() + r * nkv + j * hd, hd);
                to_f16(G.v_cache + j * G.v_head_stride + (start + r - G.first) * hd, v.data() + r * nkv + j * hd, hd);
            }
        if (spk_attention_f16(q.data() + G.first * nq, G.end - G.first, (int)L->n_head, (int)L->n_kv, (int)hd, (int)hd, G.k_cache,
                              G.v_cache, G.k_head_stride, G.v_head_stride, c->positions + G.first, c->window, (float)L->attn_scale,
                              attn.data() + G.first * nq, 1, c->exact_below))
            return -1;
    }
    if (product(L->wo, attn.data(), rows, x_out, nullptr, c->kinds)) return -1;
    for (int64_t i = 0; i < rows * d; ++i) x_out[i] = x_in[i] + x_out[i];

    spk_rms_norm(x_out, L->ffn_norm, h.data(), rows, d, eps);
    if (product(L->w_gate_up, h.data(), rows, gu.data(), nullptr, c->kinds)) return -1;
    spk_swiglu(gu.data(), gu.data() + n_ff, act.data(), rows, n_ff, 2 * n_ff);
    if (product(L->w_down, act.data(), rows, h.data(), nullptr, c->kinds)) return -1;
    for (int64_t i = 0; i < rows * d; ++i) x_out[i] = x_out[i] + h[i];
    return 0;
}

}  // extern "C"
