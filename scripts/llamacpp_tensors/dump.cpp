// Every float32 tensor llama.cpp computes for a prompt (one batch) and then single-token decode
// steps, dumped through the graph's eval callback: OUTDIR/STEP_NAME.bin (a repeated name gets
// #1, #2...), each int64 ne[4] then the values in ggml order; STEP_LOGITS.bin holds the last row's
// logits. Step 0 is the prompt. For checking an architecture against llama.cpp tensor by tensor
// (compare.py). Build against a llama.cpp build tree (LLAMA = its source root):
//
//   g++ -O1 -std=c++17 -o dump dump.cpp -I$LLAMA/include -I$LLAMA/ggml/include -L$LLAMA/build/bin \
//       -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin
//   ./dump MODEL.gguf OUTDIR PROMPT_LEN tok tok ...   (the tokens after PROMPT_LEN one at a time)
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <map>
static std::string g_dir; static int g_step = 0; static std::map<std::string,int> g_seen;
static bool cb(struct ggml_tensor * t, bool ask, void *) {
    if (ask) return true;
    if (t->type != GGML_TYPE_F32) return true;
    std::string name = ggml_get_name(t);
    for (auto & c : name) if (c == '/' || c == ' ' || c == '(' || c == ')') c = '_';
    std::string key = std::to_string(g_step) + "_" + name;
    int k = g_seen[key]++;
    std::string path = g_dir + "/" + key + (k ? "#" + std::to_string(k) : "") + ".bin";
    size_t n = ggml_nelements(t);
    std::vector<float> buf(n);
    if (ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, buf.data(), 0, n * sizeof(float));
    } else {
        std::vector<char> raw(ggml_nbytes(t));
        ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
        size_t i = 0;
        for (int64_t i3 = 0; i3 < t->ne[3]; i3++) for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
        for (int64_t i1 = 0; i1 < t->ne[1]; i1++) for (int64_t i0 = 0; i0 < t->ne[0]; i0++)
            buf[i++] = *(float *)(raw.data() + i0*t->nb[0] + i1*t->nb[1] + i2*t->nb[2] + i3*t->nb[3]);
    }
    FILE * f = fopen(path.c_str(), "wb");
    int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
    fwrite(ne, sizeof(ne), 1, f); fwrite(buf.data(), sizeof(float), n, f); fclose(f);
    return true;
}
int main(int argc, char ** argv) {
    g_dir = argv[2]; int plen = atoi(argv[3]);
    std::vector<llama_token> toks; for (int i = 4; i < argc; i++) toks.push_back(atoi(argv[i]));
    llama_backend_init();
    auto mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_threads = 2; cp.n_threads_batch = 2;
    cp.cb_eval = cb; cp.cb_eval_user_data = nullptr; cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<llama_token> prompt(toks.begin(), toks.begin() + plen);
    if (llama_decode(ctx, llama_batch_get_one(prompt.data(), prompt.size()))) { fprintf(stderr, "decode failed\n"); return 1; }
    auto dump_logits = [&](void) {
        float * l = llama_get_logits_ith(ctx, -1);
        FILE * f = fopen((g_dir + "/" + std::to_string(g_step) + "_LOGITS.bin").c_str(), "wb");
        int64_t ne[4] = {n_vocab, 1, 1, 1}; fwrite(ne, sizeof(ne), 1, f); fwrite(l, sizeof(float), n_vocab, f); fclose(f);
    };
    dump_logits();
    for (size_t i = plen; i < toks.size(); i++) {
        g_step++;
        if (llama_decode(ctx, llama_batch_get_one(&toks[i], 1))) { fprintf(stderr, "decode failed\n"); return 1; }
        dump_logits();
    }
    llama_free(ctx); llama_model_free(model);
    return 0;
}
