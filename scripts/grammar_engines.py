"""Compare grammar engines on a real vocabulary: build, compile and per-token mask cost.

    pip install llguidance xgrammar outlines-core   # in a scratch venv; only llguidance is a dependency
    python scripts/grammar_engines.py -m ~/.cache/speculant-models/qwen2.5-coder-1.5b-instruct.gguf

Every engine is built from our own tokenizer (speculant.gguf's, the token bytes of the GGUF
vocabulary), never from a downloaded one. For each engine and grammar (a JSON-extraction schema,
and any JSON object) it reports: the time to build the engine's vocabulary object, to compile
the grammar, and per token of a valid document (tokenized with our tokenizer) the time to compute
the next-token mask over the whole vocabulary and to advance the matcher by the token. Engines
that are not installed are skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "languages", "address", "employed"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "languages": ["English", "French", "Italian"],
       "address": {"city": "London", "zip": "W1J 7NT"}, "employed": False}


def token_table(tok):
    """Per token id its bytes; control tokens (and user-defined ones that look like them) marked."""
    out = []
    for i in range(tok.n_vocab):
        b = tok.token_bytes(i, True)
        special = tok.is_control(i) or (b.startswith(b"<") and b.endswith(b">") and tok._attrs[i] & 16)
        out.append((b, special))
    return out


def stats(xs):
    xs = sorted(xs)
    return (f"mean {statistics.mean(xs) * 1e3:.3f} ms, p50 {xs[len(xs) // 2] * 1e3:.3f}, "
            f"p90 {xs[int(len(xs) * 0.9)] * 1e3:.3f}, max {xs[-1] * 1e3:.3f} ms over {len(xs)} tokens")


def bench_llguidance(tok, table, doc_tokens, grammars):
    import llguidance
    import llguidance.torch as lt

    class Wrap:
        def __init__(self):
            self.eos_token_id = tok.eos_id
            self.bos_token_id = tok.bos_id
            self.tokens = [b"\xff" + b if s else b for b, s in table]
            self.special_token_ids = [i for i, (_, s) in enumerate(table) if s]

        def __call__(self, s):
            if isinstance(s, bytes):
                s = s.decode("utf-8", "surrogateescape")
            return tok.encode(s, add_special=False, parse_special=False)

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrap()), n_vocab=tok.n_vocab,
                                   eos_token=sorted(tok.eog_ids))
    print(f"llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}: tokenizer {time.perf_counter() - t0:.2f} s")
    for name, schema in grammars.items():
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = llguidance.LLMatcher(lltok, g)
        assert not m.is_error(), m.get_error()
        t_compile = time.perf_counter() - t0
        bm = lt.allocate_token_bitmask(1, tok.n_vocab)
        masks, advances = [], []
        for t in doc_tokens:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, bm, 0)
            masks.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ok = m.consume_token(t)
            advances.append(time.perf_counter() - t0)
            assert ok, (name, m.get_error())
        print(f"  {name}: compile {t_compile * 1e3:.1f} ms; mask {stats(masks)}; advance mean {statistics.mean(advances) * 1e6:.0f} us")


def bench_xgrammar(tok, table, doc_tokens, grammars):
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [b"" if s else b for b, s in table]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.n_vocab, stop_token_ids=sorted(tok.eog_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    import importlib.metadata as md
    print(f"xgrammar {md.version('xgrammar')}: tokenizer {time.perf_counter() - t0:.2f} s")
    for name, schema in grammars.items():
        t0 = time.perf_counter()
        if schema == {"type": "object"}:
            cg = compiler.compile_builtin_json_grammar()
        else:
            cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        m = xgr.GrammarMatcher(cg)
        t_compile = time.perf_counter() - t0
        bm = xgr.allocate_token_bitmask(1, tok.n_vocab)
        masks, advances = [], []
        for t in doc_tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            masks.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ok = m.accept_token(t)
            advances.append(time.perf_counter() - t0)
            assert ok, name
        print(f"  {name}: compile {t_compile * 1e3:.1f} ms; mask {stats(masks)}; advance mean {statistics.mean(advances) * 1e6:.0f} us")


def bench_outlines(tok, table, doc_tokens, grammars):
    import outlines_core as oc
    import torch

    t0 = time.perf_counter()
    by_text: dict = {}
    eos = tok.eos_id
    for i, (b, s) in enumerate(table):
        if s or not b or i == eos:
            continue
        by_text.setdefault(b, []).append(i)
    vocab = oc.Vocabulary(eos, by_text)
    print(f"outlines-core: vocabulary {time.perf_counter() - t0:.2f} s")
    for name, schema in grammars.items():
        if schema == {"type": "object"}:
            print(f"  {name}: not expressible (outlines-core compiles regular expressions; any JSON object is not regular)")
            continue
        t0 = time.perf_counter()
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
        index = oc.Index(regex, vocab)
        guide = oc.Guide(index)
        t_compile = time.perf_counter() - t0
        mask = torch.zeros((tok.n_vocab + 31) // 32, dtype=torch.int32)
        masks, advances = [], []
        for t in doc_tokens:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            masks.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            guide.advance(t)
            advances.append(time.perf_counter() - t0)
        print(f"  {name}: compile {t_compile * 1e3:.1f} ms; mask {stats(masks)}; advance mean {statistics.mean(advances) * 1e6:.0f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines")
    args = ap.parse_args()
    from speculant.gguf import Tokenizer

    tok = Tokenizer.from_gguf(args.model)
    table = token_table(tok)
    text = json.dumps(DOC)
    doc_tokens = tok.encode(text, add_special=False, parse_special=False)
    grammars = {"json_schema": SCHEMA, "json_object": {"type": "object"}}
    print(f"vocabulary {tok.n_vocab} tokens; the document is {len(doc_tokens)} tokens: {text}")
    for engine in args.engines.split(","):
        fn = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines": bench_outlines}[engine]
        try:
            fn(tok, table, doc_tokens, grammars)
        except ImportError as e:
            print(f"{engine}: not installed ({e})")


if __name__ == "__main__":
    main()
