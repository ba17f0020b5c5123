"""Byte-level BPE vocabularies ('tokenizer.ggml.model' = 'gpt2': Qwen2, Llama 3, GPT-2, StarCoder, ...).

The merges run in the HF `tokenizers` library: a BPE model built from the GGUF vocabulary and merges,
behind the pre-tokenizer regexes that llama.cpp uses for the file's 'tokenizer.ggml.pre' (see
vocab.PRE_TYPES) and a ByteLevel step. The library is imported only when such a vocabulary loads.
"""
from __future__ import annotations

from typing import Any

from speculant.errors import ModelFileError
from speculant.gguf.tokenizer.vocab import Vocabulary, array_of


class BpeEncoder:
    """Raw text fragments -> token ids for one byte-level BPE vocabulary."""

    def __init__(self, metadata: dict[str, Any], vocab: Vocabulary, regexes: list[str], ignore_merges: bool,
                 where: str) -> None:
        self._hf = _build_hf_bpe(metadata, vocab, regexes, ignore_merges, where)

    def encode(self, frags: list, out: list[int], add_space_prefix: bool = False) -> None:
        """Append the ids of `frags` (raw text pieces and special-token ids, as partitioned) to `out`
        (add_space_prefix: not a BPE flag in llama.cpp, ignored)."""
        hf = self._hf
        for frag in frags:
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.extend(hf.encode(frag, add_special_tokens=False).ids)


def _build_hf_bpe(metadata: dict[str, Any], vocab: Vocabulary, regexes: list[str], ignore_merges: bool, where: str):
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    merges_raw = array_of(metadata, "tokenizer.ggml.merges", str, where)
    if not merges_raw:
        raise ModelFileError(f"{where}: BPE tokenizer without merges (tokenizer.ggml.merges is missing)")
    index = vocab.index
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        pos = m.find(" ", 1)
        if pos < 0:
            continue
        a, b = m[:pos], m[pos + 1:]
        # llama.cpp keeps merges whose parts are not tokens; they can never fire on a byte-level vocab
        if a in index and b in index and a + b in index:
            merges.append((a, b))
    try:
        model = BPE(vocab=index, merges=merges, ignore_merges=ignore_merges)
    except TypeError:  # tokenizers < 0.19 has no ignore_merges
        model = BPE(vocab=index, merges=merges)
    tok = HFTokenizer(model)
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return tok
