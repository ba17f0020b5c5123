"""SentencePiece-style vocabularies ('tokenizer.ggml.model' = 'llama': Llama 1/2, Gemma, Mistral v1, ...).

This is llama.cpp's llm_tokenizer_spm algorithm: greedy merge of the adjacent pair whose merged piece
has the highest score, leftmost first on ties; characters left over become <0xXX> byte tokens. It is
written here directly rather than through a `tokenizers` BPE model: that would need ~500k merges
synthesized from the scores (about 2.5 s for Gemma's 262k vocabulary) and breaks some score ties
differently.

The cost is linear in the text (a heap of candidate pairs), about 6 microseconds per character of
text without spaces in CPython; text with spaces is cut into words that are cached.
"""
from __future__ import annotations

import heapq
import re

from speculant.gguf.tokenizer.vocab import Vocabulary

_SPM_WORD_START = re.compile("(?<=[^▁])▁")  # a '▁' after another character: where an SPM word may start


class SpmEncoder:
    """Raw text fragments -> token ids for one SentencePiece vocabulary."""

    def __init__(self, vocab: Vocabulary, unk_id: int | None) -> None:
        index = vocab.index
        self._vocab_get = index.get
        self._scores = vocab.scores
        # llama.cpp's byte_to_token: '<0xXX>', else the byte itself as a one-character token
        self._byte_ids = [index.get(f"<0x{b:02X}>", index.get(chr(b), unk_id) if b < 0x80 else unk_id)
                          for b in range(256)]
        # Merges never join a symbol ending in a non-'▁' character to one starting with '▁' unless
        # some token has that shape inside it (Gemma: only '>▁</'). So the text can be cut before
        # such '▁'s -- except where one of those tokens occurs -- and the words tokenized (and
        # cached) one by one, with the same result as the whole text.
        crossing = []
        for t in vocab.tokens:
            if "▁" in t.lstrip("▁"):
                offs = tuple(j for j in range(1, len(t)) if t[j] == "▁" and t[j - 1] != "▁")
                crossing.append((t, offs))
        self._crossing: list[tuple[str, tuple[int, ...]]] | None = crossing if len(crossing) <= 64 else None
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, frags: list, out: list[int], add_space_prefix: bool) -> None:
        """Append the ids of `frags` (raw text pieces and special-token ids, as partitioned) to `out`.
        A text piece that starts the text or follows a special token gets a leading space when
        `add_space_prefix` (the vocabulary's flag)."""
        prev_special = True
        for frag in frags:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if add_space_prefix and prev_special:
                frag = " " + frag
            self.encode_text(frag.replace(" ", "▁"), out)
            prev_special = False

    def encode_text(self, text: str, out: list[int]) -> None:
        """SPM-tokenize one raw fragment (spaces already '▁'), word by word where that is exact."""
        crossing = self._crossing
        if crossing is None or len(text) < 16:
            self._tokenize(text, out)
            return
        protected: set[int] = set()
        for t, offs in crossing:
            start = text.find(t)
            while start >= 0:
                protected.update(start + j for j in offs)
                start = text.find(t, start + 1)
        cache = self._cache
        if len(cache) > 100_000:
            cache.clear()
        begin = 0
        for m in _SPM_WORD_START.finditer(text):
            p = m.start()
            if p in protected:
                continue
            self._word(text[begin:p], out, cache)
            begin = p
        self._word(text[begin:], out, cache)

    def _word(self, word: str, out: list[int], cache: dict[str, tuple[int, ...]]) -> None:
        ids = cache.get(word)
        if ids is None:
            buf: list[int] = []
            self._tokenize(word, buf)
            ids = cache[word] = tuple(buf)
        out.extend(ids)

    def _tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm_session::tokenize on whitespace-escaped text."""
        syms = list(text)
        n = len(syms)
        if n == 0:
            return
        vocab_get = self._vocab_get
        scores = self._scores
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            t = vocab_get(syms[i] + syms[i + 1])
            if t is not None:
                heap.append((-scores[t], i, i + 1, t))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        # Highest score first, then leftmost (llm_bigram_spm::comparator). An entry is stale once either
        # symbol has changed; then the pair's text no longer spells token t.
        while heap:
            _, left, right, t = pop(heap)
            sl, sr = syms[left], syms[right]
            if not sl or not sr or nxt[left] != right:
                continue
            merged = sl + sr
            if vocab_get(merged) != t:
                continue
            syms[left] = merged
            syms[right] = ""
            r2 = nxt[right]
            nxt[left] = r2
            if r2 >= 0:
                prv[r2] = left
            p = prv[left]
            if p >= 0:
                t2 = vocab_get(syms[p] + merged)
                if t2 is not None:
                    push(heap, (-scores[t2], p, left, t2))
            if r2 >= 0:
                t2 = vocab_get(merged + syms[r2])
                if t2 is not None:
                    push(heap, (-scores[t2], left, r2, t2))
        byte_ids = self._byte_ids
        i = 0
        while i != -1:
            s = syms[i]
            t = vocab_get(s)
            if t is not None:
                out.append(t)
            else:  # a character that is no token: its UTF-8 bytes as <0xXX> tokens
                for b in s.encode("utf-8"):
                    bid = byte_ids[b]
                    if bid is not None:
                        out.append(bid)
            i = nxt[i]
