// The native library's C API: the one list of its functions. Each .cpp includes it, so the
// compiler checks every definition against it, and native/__init__.py builds the ctypes
// bindings from it (a function per line, parameters named; `//` comments only).
#pragma once
#include <cstdint>

extern "C" {

// A decoder layer of the llama family (layer.cpp): its weights, fixed at load. Every field 8
// bytes wide, so that the Python side mirrors the layout with plain ctypes fields.
struct SpkMatrix {
    int64_t qtype;
    const void* w;  // the GGUF rows (n rows of k values)
    int64_t n, k;
};
struct SpkLlamaLayer {
    int64_t d, n_head, n_kv, head_dim, n_ff, neox;
    double eps, attn_scale;  // used as float
    const float *attn_norm, *ffn_norm;
    const float *bq, *bk, *bv;  // the q, k, v biases, or null
    SpkMatrix wq, wk, wv, wo, w_gate_up, w_down;  // w_gate_up: the gate rows, then the up rows
};
// A sequence's rows [first, end) of a call and its layer's fp16 cache ([n_kv, capacity, head_dim]).
struct SpkRowGroup {
    int64_t first, end;
    uint16_t *k_cache, *v_cache;
    int64_t k_head_stride, v_head_stride;  // elements between kv heads
};
// What one forward passes each layer.
struct SpkLayerCall {
    const float *cos_t, *sin_t;       // [rows, head_dim / 2]
    const int64_t* positions;         // [rows]
    const uint8_t* kinds;             // spk_linear_prompt's row kinds for the products; null: decode rows
    const SpkRowGroup* groups;
    int64_t n_groups, window, exact_below;  // attention: see spk_attention_f16
};

// library and threads
int spk_abi_version();
int spk_isa();  // 1 AVX-512, 2 AVX2 + AVX-VNNI, 3 AVX2 (cpu.cpp)
void spk_set_threads(int n);
int spk_threads();
void spk_parallel_for(int64_t n, void (*fn)(int64_t, void*), void* ctx);  // for the other kernels; not bound

// quantized linear layers (linear.cpp)
int spk_supports(int qtype, int64_t k);
int spk_linear(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y);
int spk_linear_mode(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y, int mode);
int spk_linear_prompt(int qtype, const void* weights, int64_t n, int64_t k, const float* x, int64_t m, float* y, const uint8_t* kind);
void spk_prefault(const void* ptr, int64_t bytes);
void spk_copy(void* dst, const void* src, int64_t bytes);
int spk_amx_available();
int spk_amx_built();
int spk_set_amx_min_rows(int rows);
int spk_set_tiled_min_rows(int rows);
int spk_set_tiled_tail_rows(int rows);
int spk_set_b32_tiled_min_rows(int rows);
int64_t spk_set_w4_prefetch(int64_t bytes);
int spk_set_w4_ymm(int on);
int spk_last_path();

// the screen of greedy rows' logits (screen.cpp)
int spk_screen_select(const float* a, int64_t m, int64_t n, const float* q, const float* x_bound, float slack, int32_t* idx, int64_t cap, int64_t* counts);

// attention (attention.cpp)
int spk_attention_f16(const float* q, int64_t rows, int n_head, int n_kv, int dk, int dv, const uint16_t* k, const uint16_t* v, int64_t k_head_stride, int64_t v_head_stride, const int64_t* positions, int64_t window, float scale, float* out, int grouped, int64_t exact_below);
int64_t spk_exp_check(uint32_t first, uint32_t last, uint32_t step);
int spk_vexp(int which, const float* x, int64_t n, float* y);

// element-wise (elementwise.cpp)
void spk_swiglu(const float* x, const float* g, float* y, int64_t rows, int64_t n, int64_t ld);  // x, g rows ld apart; y [rows, n]
void spk_gelu_table(uint16_t* table);
void spk_rope_table(const int64_t* pos, int64_t n, int n_dims, float base, float freq_scale, float* cos_out, float* sin_out);
void spk_rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps);
void spk_rope_apply(float* x, const float* cos_t, const float* sin_t, int64_t rows, int64_t heads, int64_t d, int neox);

// whole layers (layer.cpp)
int spk_llama_layer(const SpkLlamaLayer* L, const SpkLayerCall* c, const float* x_in, float* x_out, int64_t rows);

// recurrent layers (deltanet.cpp)
int spk_gated_delta_net(float* state, const float* q, const float* k, const float* v, const float* decay, const float* beta, int64_t n, int hv, int dv, int dk, float scale, float* out, float* per_row);

}  // extern "C"
