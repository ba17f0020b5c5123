"""Tiny synthetic GGUF models for fast tests, written with `gguf.GGUFWriter`.

    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", qtype="Q8_0", seed=1)
    target, draft = write_tiny_pair(tmp_path, "gemma3", tokenizer="llama")

Each file has the tensor names, shapes (ggml order: ne0 = input features) and metadata keys
that llama.cpp's `convert_hf_to_gguf.py` writes for the architecture, mirrored from real files
(Qwen2.5-Coder and Gemma-3-270m GGUFs):

    llama   token_embd, output_norm, output (unless tied), blk.N.{attn_norm, attn_q, attn_k,
            attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down}; llama.vocab_size and
            llama.rope.dimension_count as LlamaModel writes them
    qwen2   the same plus blk.N.attn_{q,k,v}.bias
    qwen3   llama's set plus blk.N.attn_q_norm / attn_k_norm ([head_dim]); key/value_length
    gemma3  qwen3's set plus blk.N.post_attention_norm / post_ffw_norm; key/value_length and
            attention.sliding_window; output.weight tied to token_embd by default (as the
            converter does).  Norm weights are stored as llama.cpp's converter stores them,
            i.e. they already include Gemma's "+1" and are used as plain multipliers.
    lfm2    (hybrid) token_embd, token_embd_norm (the final norm), blk.N.{attn_norm, ffn_norm,
            ffn_gate, ffn_up, ffn_down} and per block either attention (attn_q, attn_k, attn_v,
            attn_q_norm, attn_k_norm, attn_output) or a short convolution (shortconv.in_proj,
            shortconv.conv F32, shortconv.out_proj); head_count_kv is a per-layer array, 0 for
            the conv blocks; lfm2.shortconv.l_cache and lfm2.vocab_size; tied by default.

Weights: deterministic for (seed, tensor name, shape) -- every tensor has its own random stream,
so two files with the same seed and dimensions but different `n_layers` share token_embd,
output, output_norm and the first layers (that is what `write_tiny_pair` uses for a related
draft).  Linear weights are normal * gain/sqrt(fan_in); norms are 1 + 0.1*normal; logits come
out with a standard deviation of ~3 (peaked, not one-hot) and depend on the context, not only
on the last token.  Untied, token_embd has unit scale (Gemma: 1/sqrt(n_embd), since Gemma
multiplies the embedding by sqrt(n_embd)).  Tied, token_embd is small and output_norm is large
(~3*sqrt(n_embd)/2): with a big tied embedding a random model mostly predicts the token it was
fed.  Checked against a NumPy reference forward of the four architectures: no degenerate
outputs; the default `write_tiny_pair` draft agrees with its target's argmax ~50% of the time
(untied; ~20% for tied gemma3), a same-depth draft with draft_qtype="Q4_0" ~75%.

Quantization: `qtype` applies to all 2-D weights (token_embd and output included unless
`embd_qtype` says otherwise); norms and biases stay F32.  F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/
Q8_0 go through `gguf.quants.quantize`; the K-quants Q2_K..Q6_K, which gguf-py cannot quantize,
use the simple round-to-nearest quantizers below (`quantize_k`), whose output gguf-py's own
`dequantize` reads back within the expected error.  Every row length must be a multiple of the
type's block size: 32 for the legacy types, 256 for K-quants (so n_embd, n_ff and
n_head*head_dim must be multiples of 256 for K-quants, e.g. n_embd=256, n_ff=512).

Tokenizers (both usable end to end, learned deterministically from the built-in `CORPUS`):

    "gpt2"   byte-level BPE like Qwen2: the 256 byte tokens in GPT-2 `bytes_to_unicode` order,
             then tokens from greedily learned merges ("a b" strings), then the specials
             <|endoftext|> <|im_start|> <|im_end|> (CONTROL); pre='qwen2'; ChatML template.
             As in the real Qwen2.5-instruct file, eos = <|im_end|>, bos = padding =
             <|endoftext|>, add_bos_token False.  Minimum n_vocab: 259.
    "llama"  SentencePiece-style like Gemma: <pad> <eos> <bos> <unk> <start_of_turn>
             <end_of_turn> (CONTROL, score -1000), 256 byte-fallback tokens <0x00>..<0xFF>
             (BYTE, score 0), learned '▁'-prefixed / continuation pieces (NORMAL, score
             -rank), then the single characters (printable ASCII with ' ' as '▁', '\\n',
             '\\t'); add_bos_token True, add_space_prefix False, Gemma-style chat template.
             Minimum n_vocab: 359.

If the corpus runs out of merges before n_vocab is reached, the rest is filled with unused
tokens ("[PAD<i>]" UNUSED for gpt2, "<unused<i>>" CONTROL for llama, as the real files do).
"""
from __future__ import annotations

import os
import re
import zlib
from functools import lru_cache
from typing import Any

import numpy as np
import gguf
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from speculant.gguf import kquants  # the public name is speculant.gguf.quantize_k
from speculant.gguf.tokenizer import bytes_to_unicode  # the same table the tokenizer decodes with

__all__ = [
    "ARCHS", "CORPUS", "HYBRID_ARCHS", "MIN_VOCAB", "TOKENIZERS", "bytes_to_unicode", "quantize", "quantize_k",
    "tiny_vocab", "write_tiny_model", "write_tiny_pair",
]

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
HYBRID_ARCHS = ("lfm2",)  # recurrent layers interleaved with attention (see `write_tiny_model`)
TOKENIZERS = ("gpt2", "llama")

# ---------------------------------------------------------------------------------------------
# Built-in training text for the tokenizers: plain English plus a little Python.
# ---------------------------------------------------------------------------------------------

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away.
Speculative decoding is a way to make a large language model generate text faster. A small
draft model proposes a few tokens, and the target model checks all of them in one forward pass.
When the draft is right, the target accepts the tokens and we save time. When the draft is
wrong, the target rejects the first bad token and the sequence continues from the correct one.
The output is exactly the same as if the target model had generated every token by itself.
This is the main idea: the draft guesses, the target verifies, and the result does not change.
A model reads a prompt, turns it into tokens, and predicts the next token one step at a time.
Each token is a number, and the tokenizer turns numbers back into text for the user to read.
There are many ways to choose the next token: greedy search takes the most likely one, while
sampling with a temperature draws one at random from the distribution over the vocabulary.
It is important that the draft and the target share the same vocabulary and the same tokens.
Hello, world! How are you today? I am fine, thank you. What time is it? It is 10:30 in the morning.
The numbers are 0 1 2 3 4 5 6 7 8 9, and 42 is the answer. The year 2024 had 366 days.
We can write a function that returns the sum of a list of numbers, and a test that checks it.
Once upon a time, in a small village near the sea, there lived an old man who loved to read.
Every morning he walked to the market to buy bread, fresh fruit and a newspaper for the day.
He would sit by the window with a cup of tea and read the news while the children played outside.
People said that he knew the answer to every question, because he had read every book in town.
One day a young girl asked him why the sky is blue. He smiled and said that light is scattered
by the air, and blue light is scattered more than red light, so we see blue in every direction.
The weather today is sunny with a light wind from the west. Tomorrow there will be rain in the
afternoon, and the temperature will drop to about twelve degrees in the evening and at night.
Please send me the report by Friday. If you have any questions, let me know and I will help you.
Thank you for your message. We have received your order and it will be shipped within two days.
The server listens on port 8080 and accepts requests in JSON. Each request has a prompt, a list
of messages, and optional settings such as max_tokens, temperature, top_p and a random seed.
The response contains the generated text, the number of tokens used, and the reason it stopped.
A cache stores the keys and values of the attention layers, so old tokens are not computed again.
Memory is limited, so the cache has a fixed size, and old sequences are removed when it is full.

{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}

def add(a, b):
    return a + b


def total(values):
    result = 0
    for value in values:
        result = result + value
    return result


class Model:
    def __init__(self, name, layers=2):
        self.name = name
        self.layers = layers

    def forward(self, tokens):
        if not tokens:
            return []
        return [token + 1 for token in tokens]


def main():
    model = Model("tiny", layers=4)
    print(model.forward([1, 2, 3]))
    print("Hello, world!")


if __name__ == "__main__":
    main()

import numpy as np

x = np.zeros((4, 4), dtype=np.float32)
for i in range(4):
    x[i, i] = 1.0
print(x.sum())


def test_add():
    assert add(1, 2) == 3
    assert total([1, 2, 3, 4]) == 10


def generate(model, prompt, max_tokens=16, temperature=0.0):
    tokens = model.tokenize(prompt)
    output = []
    while len(output) < max_tokens:
        logits = model.forward(tokens + output)
        next_token = int(logits.argmax()) if temperature == 0.0 else model.sample(logits, temperature)
        if next_token == model.eos_token_id:
            break
        output.append(next_token)
    return model.detokenize(output)
"""

# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

SPM_SPACE = "\u2581"  # '▁'
GPT2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
# Single characters of the "llama" vocabulary: printable ASCII (space spelled '▁'), \n and \t.
SPM_CHARS = tuple([SPM_SPACE] + [chr(c) for c in range(0x21, 0x7F)] + ["\n", "\t"])
MIN_VOCAB = {"gpt2": 256 + len(GPT2_SPECIALS), "llama": len(SPM_SPECIALS) + 256 + len(SPM_CHARS)}

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Qwen2's pre-tokenizer regex with \p{L} -> [A-Za-z] and \p{N} -> [0-9] (the corpus is ASCII).
_QWEN2_PRE_ASCII = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# SentencePiece-style chunks: a word with its leading '▁', runs of '▁' (indentation), newlines.
_SPM_CHUNKS = re.compile(f"{SPM_SPACE}+(?={SPM_SPACE}[^{SPM_SPACE}\\n])|{SPM_SPACE}?[^{SPM_SPACE}\\n]+|{SPM_SPACE}+|\\n+")




def _learn_bpe(chunks: list[tuple[str, ...]], known: set[str], n_new: int) -> tuple[list[str], list[str]]:
    """Greedy BPE: merge the most frequent adjacent pair (ties: smallest pair) until `n_new`
    new tokens exist or no pair occurs twice.  Returns (merges as "a b", new tokens in order)."""
    words: dict[tuple[str, ...], int] = {}
    for c in chunks:
        if len(c) > 1:
            words[c] = words.get(c, 0) + 1
    known = set(known)
    merges: list[str] = []
    new_tokens: list[str] = []
    while len(new_tokens) < n_new:
        counts: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        if counts[best] < 2:
            break
        a, b = best
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            known.add(merged)
            new_tokens.append(merged)
        new_words: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            if len(w) > 1 and a in w:
                out: list[str] = []
                i = 0
                while i < len(w):
                    if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                        out.append(merged)
                        i += 2
                    else:
                        out.append(w[i])
                        i += 1
                w = tuple(out)
            if len(w) > 1:
                new_words[w] = new_words.get(w, 0) + c
        words = new_words
    return merges, new_tokens


@lru_cache(maxsize=16)
def _gpt2_vocab(n_vocab: int) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    b2u = bytes_to_unicode()
    byte_tokens = list(b2u.values())
    chunks = [tuple(b2u[b] for b in piece.encode("utf-8")) for piece in _QWEN2_PRE_ASCII.findall(CORPUS)]
    merges, new_tokens = _learn_bpe(chunks, set(byte_tokens), n_vocab - MIN_VOCAB["gpt2"])
    tokens = byte_tokens + new_tokens + list(GPT2_SPECIALS)
    types = [TokenType.NORMAL] * (len(tokens) - len(GPT2_SPECIALS)) + [TokenType.CONTROL] * len(GPT2_SPECIALS)
    pad = n_vocab - len(tokens)
    tokens += [f"[PAD{len(tokens) + i}]" for i in range(pad)]
    types += [TokenType.UNUSED] * pad
    return tuple(tokens), tuple(int(t) for t in types), tuple(merges)


@lru_cache(maxsize=16)
def _spm_vocab(n_vocab: int) -> tuple[tuple[str, ...], tuple[int, ...], tuple[float, ...]]:
    text = CORPUS.replace(" ", SPM_SPACE)
    chunks = [tuple(piece) for piece in _SPM_CHUNKS.findall(text)]
    _, pieces = _learn_bpe(chunks, set(SPM_CHARS), n_vocab - MIN_VOCAB["llama"])
    tokens = list(SPM_SPECIALS)
    types = [TokenType.CONTROL] * len(SPM_SPECIALS)
    scores = [-1000.0] * len(SPM_SPECIALS)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    scores += [0.0] * 256
    tokens += pieces + list(SPM_CHARS)
    types += [TokenType.NORMAL] * (len(pieces) + len(SPM_CHARS))
    scores += [-float(i) for i in range(len(pieces) + len(SPM_CHARS))]
    pad = n_vocab - len(tokens)
    tokens += [f"<unused{i}>" for i in range(pad)]
    types += [TokenType.CONTROL] * pad
    scores += [-1000.0] * pad
    return tuple(tokens), tuple(int(t) for t in types), tuple(scores)


def tiny_vocab(tokenizer: str = "gpt2", n_vocab: int = 512) -> dict[str, Any]:
    """The tokenizer metadata `write_tiny_model` writes, as plain Python values keyed by GGUF key."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {TOKENIZERS}")
    if n_vocab < MIN_VOCAB[tokenizer]:
        raise ValueError(f"n_vocab={n_vocab} is too small for the {tokenizer!r} tokenizer (minimum {MIN_VOCAB[tokenizer]})")
    if tokenizer == "gpt2":
        tokens, types, merges = _gpt2_vocab(n_vocab)
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": list(tokens),
            "tokenizer.ggml.token_type": list(types),
            "tokenizer.ggml.merges": list(merges),
            "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
            "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
            "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": CHATML_TEMPLATE,
        }
    tokens, types, scores = _spm_vocab(n_vocab)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.scores": list(scores),
        "tokenizer.ggml.token_type": list(types),
        "tokenizer.ggml.bos_token_id": tokens.index("<bos>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<eos>"),
        "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<pad>"),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_sep_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": GEMMA_TEMPLATE,
    }


def _add_tokenizer(w: GGUFWriter, vocab: dict[str, Any]) -> None:
    w.add_tokenizer_model(vocab["tokenizer.ggml.model"])
    w.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
    w.add_token_list(vocab["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" in vocab:
        w.add_token_scores(vocab["tokenizer.ggml.scores"])
    w.add_token_types(vocab["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in vocab:
        w.add_token_merges(vocab["tokenizer.ggml.merges"])
    w.add_bos_token_id(vocab["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(vocab["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.unknown_token_id" in vocab:
        w.add_unk_token_id(vocab["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(vocab["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(vocab["tokenizer.ggml.add_bos_token"])
    if "tokenizer.ggml.add_sep_token" in vocab:
        w.add_add_sep_token(vocab["tokenizer.ggml.add_sep_token"])
        w.add_add_eos_token(vocab["tokenizer.ggml.add_eos_token"])
        w.add_add_space_prefix(vocab["tokenizer.ggml.add_space_prefix"])
    w.add_chat_template(vocab["tokenizer.chat_template"])


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------

_SUPPORTED_QTYPES = tuple(GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))

_FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q2_K": LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": LlamaFileType.MOSTLY_Q3_K_M, "Q4_K": LlamaFileType.MOSTLY_Q4_K_M, "Q5_K": LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}


def _as_qtype(qtype: str | GGMLQuantizationType) -> GGMLQuantizationType:
    if isinstance(qtype, str):
        try:
            qtype = GGMLQuantizationType[qtype.upper()]
        except KeyError:
            raise ValueError(f"unknown quantization type {qtype!r}") from None
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _SUPPORTED_QTYPES:
        raise ValueError(f"{qtype.name} is not supported; use one of {[q.name for q in _SUPPORTED_QTYPES]}")
    return qtype


_K_QUANT_TYPES = (GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
                  GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def quantize_k(data: np.ndarray, qtype: str | GGMLQuantizationType) -> np.ndarray:
    """Round-to-nearest K-quant (Q2_K..Q6_K) of a float array whose last dim is a multiple of 256
    (speculant.gguf.kquants). Returns uint8 of shape (*data.shape[:-1], row_bytes)."""
    qtype = _as_qtype(qtype)
    if qtype not in _K_QUANT_TYPES:
        raise ValueError(f"{qtype.name} is not a K-quant")
    return kquants.quantize_k(data, qtype)


def quantize(data: np.ndarray, qtype: str | GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.quantize`, falling back to `quantize_k` for the K-quants gguf-py cannot do."""
    qtype = _as_qtype(qtype)
    data = np.asarray(data, dtype=np.float32)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {block}, got {data.shape[-1]}")
    try:
        return gguf.quants.quantize(data, qtype)
    except NotImplementedError:
        return quantize_k(data, qtype)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

_ARCH_DEFAULTS = {  # rope.freq_base, rms eps as the real configs have them
    "llama": (10000.0, 1e-5),
    "qwen2": (1000000.0, 1e-6),
    "qwen3": (1000000.0, 1e-6),
    "gemma3": (1000000.0, 1e-6),
    "lfm2": (1000000.0, 1e-5),
}


_TIED_GAIN = 2.0  # tied models: embedding row norm _TIED_GAIN/sqrt(n_embd); see _tensor_plan


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _tensor_plan(arch: str, *, n_vocab: int, n_embd: int, n_layers: int, n_head: int, n_kv_head: int,
                 head_dim: int, n_ff: int, tie: bool, attn_layers: tuple[int, ...] = (),
                 l_cache: int = 3) -> list[tuple[str, tuple[int, ...], str, float, float]]:
    """(name, numpy shape = (out, in) for matrices, kind, std, mean) in file order.
    kind: 'embd' / 'linear' (quantized), 'norm' / 'bias' / 'conv' (F32); values are mean + std*N(0, 1).

    Scales: logits have a standard deviation of ~3, so the next-token distribution is peaked but
    not one-hot.  Untied, the first layer sees an input of RMS ~1 (Gemma multiplies the embedding
    by sqrt(n_embd)).  Tied, the embedding rows are small (norm _TIED_GAIN/sqrt(n_embd)) so the current
    token's own embedding is a small part of the final hidden state -- otherwise a tied model
    mostly predicts the token it was just fed -- and output_norm (3*sqrt(n_embd)/_TIED_GAIN) carries the gain."""
    q_dim, kv_dim = n_head * head_dim, n_kv_head * head_dim
    inv = 1.0 / np.sqrt(n_embd)
    if tie:
        embd_std, out_norm = _TIED_GAIN / n_embd, 3.0 * np.sqrt(n_embd) / _TIED_GAIN
    else:
        embd_std, out_norm = (inv if arch == "gemma3" else 1.0), 1.0
    plan: list[tuple[str, tuple[int, ...], str, float, float]] = []
    plan.append(("token_embd.weight", (n_vocab, n_embd), "embd", embd_std, 0.0))
    if arch == "lfm2":
        return plan + _lfm2_plan(n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers, q_dim=q_dim, kv_dim=kv_dim,
                                 head_dim=head_dim, n_ff=n_ff, tie=tie, out_norm=out_norm,
                                 attn_layers=attn_layers, l_cache=l_cache)
    for i in range(n_layers):
        b = f"blk.{i}"
        plan.append((f"{b}.attn_norm.weight", (n_embd,), "norm", 0.1, 1.0))
        plan.append((f"{b}.attn_q.weight", (q_dim, n_embd), "linear", inv, 0.0))
        plan.append((f"{b}.attn_k.weight", (kv_dim, n_embd), "linear", inv, 0.0))
        plan.append((f"{b}.attn_v.weight", (kv_dim, n_embd), "linear", inv, 0.0))
        if arch == "qwen2":
            plan.append((f"{b}.attn_q.bias", (q_dim,), "bias", 0.1, 0.0))
            plan.append((f"{b}.attn_k.bias", (kv_dim,), "bias", 0.1, 0.0))
            plan.append((f"{b}.attn_v.bias", (kv_dim,), "bias", 0.1, 0.0))
        if arch in ("qwen3", "gemma3"):
            plan.append((f"{b}.attn_q_norm.weight", (head_dim,), "norm", 0.1, 1.0))
            plan.append((f"{b}.attn_k_norm.weight", (head_dim,), "norm", 0.1, 1.0))
        plan.append((f"{b}.attn_output.weight", (n_embd, q_dim), "linear", 0.5 / np.sqrt(q_dim), 0.0))
        if arch == "gemma3":
            plan.append((f"{b}.post_attention_norm.weight", (n_embd,), "norm", 0.1, 1.0))
        plan.append((f"{b}.ffn_norm.weight", (n_embd,), "norm", 0.1, 1.0))
        plan.append((f"{b}.ffn_gate.weight", (n_ff, n_embd), "linear", inv, 0.0))
        plan.append((f"{b}.ffn_up.weight", (n_ff, n_embd), "linear", inv, 0.0))
        plan.append((f"{b}.ffn_down.weight", (n_embd, n_ff), "linear", 0.5 / np.sqrt(n_ff), 0.0))
        if arch == "gemma3":
            plan.append((f"{b}.post_ffw_norm.weight", (n_embd,), "norm", 0.1, 1.0))
    plan.append(("output_norm.weight", (n_embd,), "norm", 0.1 * out_norm, out_norm))
    if not tie:
        plan.append(("output.weight", (n_vocab, n_embd), "embd", 3.0 * inv, 0.0))
    return plan


def _lfm2_plan(*, n_vocab: int, n_embd: int, n_layers: int, q_dim: int, kv_dim: int, head_dim: int, n_ff: int,
               tie: bool, out_norm: float, attn_layers: tuple[int, ...], l_cache: int):
    """LFM2 as llama.cpp's loader reads it (src/models/lfm2.cpp): every block has attn_norm (the
    "operator norm") and a dense FFN; attention blocks add attn_q/k/v/output and per-head
    attn_q_norm/attn_k_norm, conv blocks shortconv.in_proj [3*n_embd out], shortconv.conv
    (F32, numpy [n_embd, l_cache]: the converter squeezes the HF [n_embd, 1, L] weight) and
    shortconv.out_proj. The final norm is named token_embd_norm (llama.cpp's
    LLM_TENSOR_OUTPUT_NORM_LFM2)."""
    inv = 1.0 / np.sqrt(n_embd)
    plan: list[tuple[str, tuple[int, ...], str, float, float]] = []
    for i in range(n_layers):
        b = f"blk.{i}"
        plan.append((f"{b}.attn_norm.weight", (n_embd,), "norm", 0.1, 1.0))
        if i in attn_layers:
            plan.append((f"{b}.attn_q.weight", (q_dim, n_embd), "linear", inv, 0.0))
            plan.append((f"{b}.attn_k.weight", (kv_dim, n_embd), "linear", inv, 0.0))
            plan.append((f"{b}.attn_v.weight", (kv_dim, n_embd), "linear", inv, 0.0))
            plan.append((f"{b}.attn_q_norm.weight", (head_dim,), "norm", 0.1, 1.0))
            plan.append((f"{b}.attn_k_norm.weight", (head_dim,), "norm", 0.1, 1.0))
            plan.append((f"{b}.attn_output.weight", (n_embd, q_dim), "linear", 0.5 / np.sqrt(q_dim), 0.0))
        else:
            plan.append((f"{b}.shortconv.conv.weight", (n_embd, l_cache), "conv", 1.0 / np.sqrt(l_cache), 0.0))
            plan.append((f"{b}.shortconv.in_proj.weight", (3 * n_embd, n_embd), "linear", inv, 0.0))
            plan.append((f"{b}.shortconv.out_proj.weight", (n_embd, n_embd), "linear", 0.5 * inv, 0.0))
        plan.append((f"{b}.ffn_norm.weight", (n_embd,), "norm", 0.1, 1.0))
        plan.append((f"{b}.ffn_gate.weight", (n_ff, n_embd), "linear", inv, 0.0))
        plan.append((f"{b}.ffn_up.weight", (n_ff, n_embd), "linear", inv, 0.0))
        plan.append((f"{b}.ffn_down.weight", (n_embd, n_ff), "linear", 0.5 / np.sqrt(n_ff), 0.0))
    plan.append(("token_embd_norm.weight", (n_embd,), "norm", 0.1 * out_norm, out_norm))
    if not tie:
        plan.append(("output.weight", (n_vocab, n_embd), "embd", 3.0 * inv, 0.0))
    return plan


def _own_writers(write):
    """write_tiny_model, except for the architectures with a writer module of their own:
    "qwen35" (Gated DeltaNet hybrid, speculant.testing.tiny_qwen35.write_qwen35, whose keyword
    arguments it takes: the ones here plus full_attention_interval, recurrent_layers, ssm_d_state,
    ssm_n_group, ssm_dt_rank, ssm_d_conv, n_rot, rope_sections, nextn_layers, qtype_overrides)."""
    import functools
    import sys

    @functools.wraps(write)
    def dispatch(path, arch="qwen2", **kwargs):
        if arch == "qwen35":  # it is handed this module's quantizers, tokenizers and random streams
            from speculant.testing.tiny_qwen35 import write_qwen35
            return write_qwen35(path, sys.modules[__name__], **kwargs)
        return write(path, arch, **kwargs)
    return dispatch


@_own_writers
def write_tiny_model(path: str | os.PathLike, arch: str = "qwen2", *, qtype: str | GGMLQuantizationType = "F32",
                     seed: int = 0, n_vocab: int = 512, n_embd: int = 64, n_layers: int = 2, n_head: int = 4,
                     n_kv_head: int = 2, head_dim: int | None = None, n_ff: int = 128, n_ctx: int = 256,
                     sliding_window: int | None = None, tokenizer: str = "gpt2", tie_embeddings: bool | None = None,
                     embd_qtype: str | GGMLQuantizationType | None = None, rope_theta: float | None = None,
                     rms_eps: float | None = None, name: str | None = None,
                     attn_layers: tuple[int, ...] | list[int] | None = None, l_cache: int = 3) -> str:
    """Write a tiny random `arch` model with a working `tokenizer` to `path`; returns the path as str.

    head_dim defaults to n_embd // n_head; tie_embeddings defaults to True for gemma3 and lfm2
    (no output.weight, like the converter) and False otherwise; embd_qtype (token_embd and output)
    defaults to qtype; rope_theta / rms_eps default to the architecture's usual values.
    `sliding_window` (default 8) is written for gemma3, and for lfm2 only when given (then its
    attention layers use it, as llama.cpp reads an LFM2 file with the key).  Minimum n_vocab:
    259 (gpt2), 359 (llama).

    lfm2 (LiquidAI's LFM2, as convert_hf_to_gguf.py writes it): `attn_layers` are the attention
    blocks (default: the odd ones), the others short-convolution blocks with kernel `l_cache`;
    `lfm2.attention.head_count_kv` is the per-layer array with 0 for conv blocks (what llama.cpp
    reads the layer kind from), `lfm2.shortconv.l_cache` and `lfm2.vocab_size` are written, the
    final norm is `token_embd_norm`, n_head * head_dim must equal n_embd.
    """
    if arch not in ARCHS + HYBRID_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS + HYBRID_ARCHS}")
    vocab = tiny_vocab(tokenizer, n_vocab)
    wq, eq = _as_qtype(qtype), _as_qtype(qtype if embd_qtype is None else embd_qtype)
    if head_dim is None:
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}; pass head_dim")
        head_dim = n_embd // n_head
    if n_head % n_kv_head:
        raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}")
    if arch == "lfm2":
        if n_head * head_dim != n_embd:
            raise ValueError(f"lfm2: n_head * head_dim ({n_head} * {head_dim}) must equal n_embd={n_embd}")
        attn_layers = tuple(range(1, n_layers, 2)) if attn_layers is None else tuple(sorted(set(attn_layers)))
        if any(not 0 <= i < n_layers for i in attn_layers):
            raise ValueError(f"lfm2: attn_layers {attn_layers} outside 0..{n_layers - 1}")
        if l_cache < 2:
            raise ValueError(f"lfm2: l_cache={l_cache} must be at least 2")
    else:
        attn_layers = tuple(range(n_layers))
    tie = (arch in ("gemma3", "lfm2")) if tie_embeddings is None else bool(tie_embeddings)
    default_theta, default_eps = _ARCH_DEFAULTS[arch]
    rope_theta = default_theta if rope_theta is None else float(rope_theta)
    rms_eps = default_eps if rms_eps is None else float(rms_eps)

    plan = _tensor_plan(arch, n_vocab=n_vocab, n_embd=n_embd, n_layers=n_layers, n_head=n_head,
                        n_kv_head=n_kv_head, head_dim=head_dim, n_ff=n_ff, tie=tie, attn_layers=attn_layers,
                        l_cache=l_cache)
    for tname, shape, kind, _, _ in plan:
        qt = eq if kind == "embd" else wq if kind == "linear" else None
        if qt is not None and shape[-1] % gguf.GGML_QUANT_SIZES[qt][0]:
            raise ValueError(f"{tname}: row length {shape[-1]} is not a multiple of the {qt.name} block size "
                             f"{gguf.GGML_QUANT_SIZES[qt][0]} (K-quants need n_embd, n_ff and n_head*head_dim "
                             f"to be multiples of 256)")

    path = os.fspath(path)
    w = GGUFWriter(path, arch)
    w.add_type("model")
    w.add_name(name or f"Tiny {arch} test model (seed {seed})")
    if arch == "gemma3":  # the converter's key order for Gemma 3
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layers)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_layer_norm_rms_eps(rms_eps)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(rope_theta)
        w.add_sliding_window(8 if sliding_window is None else sliding_window)
        w.add_head_count_kv(n_kv_head)
    elif arch == "lfm2":  # the converter's keys (TextModel's, then LFM2Model's own)
        w.add_block_count(n_layers)
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_head_count(n_head)
        w.add_head_count_kv([n_kv_head if i in attn_layers else 0 for i in range(n_layers)])
        w.add_rope_freq_base(rope_theta)
        w.add_vocab_size(n_vocab)
        w.add_shortconv_l_cache(l_cache)
        w.add_layer_norm_rms_eps(rms_eps)
        w.add_feed_forward_length(n_ff)
        if sliding_window is not None:
            w.add_sliding_window(sliding_window)
    else:
        w.add_block_count(n_layers)
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_kv_head)
        w.add_rope_freq_base(rope_theta)
        w.add_layer_norm_rms_eps(rms_eps)
        if arch == "qwen3" or head_dim != n_embd // n_head:  # configs with an explicit head_dim
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
    w.add_file_type(_FILE_TYPES[wq.name])
    if arch == "llama":
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
    _add_tokenizer(w, vocab)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for tname, shape, kind, std, mean in plan:
        x = _rng(seed, tname).standard_normal(shape, dtype=np.float32) * np.float32(std) + np.float32(mean)
        if kind in ("norm", "bias", "conv"):  # llama.cpp keeps the short-conv kernel F32 too
            w.add_tensor(tname, x)
        else:
            qt = eq if kind == "embd" else wq
            data = quantize(x, qt)
            if data.dtype == np.uint8:
                w.add_tensor(tname, data, raw_dtype=qt)
            else:
                w.add_tensor(tname, data)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_pair(dir: str | os.PathLike, arch: str = "qwen2", *, seed: int = 0, draft_seed: int | None = None,
                    target_layers: int = 2, draft_layers: int = 1, qtype: str | GGMLQuantizationType = "F32",
                    draft_qtype: str | GGMLQuantizationType | None = None,
                    draft_overrides: dict[str, Any] | None = None, **common: Any) -> tuple[str, str]:
    """Write `<arch>-target.gguf` and `<arch>-draft.gguf` into `dir`; returns (target, draft) paths.

    Both share the vocabulary (`common` kwargs such as n_vocab, tokenizer, n_embd go to both).
    With the defaults the draft is the target's first `draft_layers` layers (same seed and dims,
    so identical token_embd/output/norms and leading blocks): a smaller model whose predictions
    correlate with the target's, which gives realistic acceptance rates.  Pass `draft_seed` and/or
    `draft_overrides` (e.g. {"n_embd": 32, "n_head": 2, "n_kv_head": 1, "n_ff": 64}) for an
    unrelated draft.
    """
    os.makedirs(dir, exist_ok=True)
    target_kwargs = {"name": f"Tiny {arch} target model", **common, "qtype": qtype, "seed": seed,
                     "n_layers": target_layers}
    draft_kwargs = {"name": f"Tiny {arch} draft model", **common,
                    "qtype": qtype if draft_qtype is None else draft_qtype,
                    "seed": seed if draft_seed is None else draft_seed, "n_layers": draft_layers,
                    **(draft_overrides or {})}
    target = write_tiny_model(os.path.join(dir, f"{arch}-target.gguf"), arch, **target_kwargs)
    draft = write_tiny_model(os.path.join(dir, f"{arch}-draft.gguf"), arch, **draft_kwargs)
    return target, draft
