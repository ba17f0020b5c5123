"""Token ids -> text, as llama.cpp's llama_token_to_piece / llama_detokenize, and incrementally.

A token's piece is its bytes: byte-level BPE characters mapped back through GPT-2's byte table, SPM
'▁' as a space, <0xXX> byte tokens as that byte, control and unknown tokens as their text (only when
special tokens are rendered), unused tokens as nothing.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from speculant.gguf.tokenizer.vocab import ATTR_BYTE, ATTR_NORMAL, ATTR_SPECIAL, ATTR_USER_DEFINED, Vocabulary


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


class Pieces:
    """Token id -> bytes (llama_token_to_piece), cached, and whole-sequence detokenization."""

    def __init__(self, vocab: Vocabulary) -> None:
        self._tokens, self._attrs = vocab.tokens, vocab.attrs
        self._spm = vocab.vocab_type == "spm"
        self._cache: dict[tuple[int, bool], bytes] = {}

    def token_bytes(self, id: int, special: bool = True) -> bytes:
        key = (id, special)
        piece = self._cache.get(key)
        if piece is None:
            piece = self._cache[key] = self._piece(id, special)
        return piece

    def _piece(self, id: int, special: bool) -> bytes:
        if not 0 <= id < len(self._tokens):
            raise ValueError(f"token id {id} is out of range for a vocabulary of {len(self._tokens)}")
        attr = self._attrs[id]
        text = self._tokens[id]
        if attr & ATTR_SPECIAL and not special:
            return b""
        if attr & (ATTR_SPECIAL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self._spm:
                return text.replace("▁", " ").encode("utf-8")
            out = bytearray()
            for ch in text:
                b = _UNICODE_TO_BYTE.get(ch)
                if b is None:
                    out += ch.encode("utf-8")
                else:
                    out.append(b)
            return bytes(out)
        if attr & ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""

    def text_bytes(self, id: int) -> int:
        """How many bytes of input text token `id` can stand for when text is encoded."""
        attr, text = self._attrs[id], self._tokens[id]
        if attr & ATTR_BYTE:
            return 1
        if attr & ATTR_NORMAL:
            return len(self._piece(id, True))
        return len((text.replace("▁", " ") if self._spm else text).encode("utf-8"))

    def max_text_bytes(self) -> int:
        """The largest text_bytes() of the vocabulary (at least 1)."""
        # a token's UTF-8 text is never shorter than what it stands for: look at the longest texts only
        by_len = sorted(((len(t.encode("utf-8")), i) for i, t in enumerate(self._tokens)), reverse=True)
        n = 1
        for upper, i in by_len:
            if upper <= n:
                break
            n = max(n, self.text_bytes(i))
        return n

    def detokenize(self, ids: Sequence[int], special: bool, remove_space: bool, clean_up_spaces: bool) -> str:
        """The pieces of `ids` joined (the first one's leading space dropped when `remove_space`), spaces
        cleaned up when the vocabulary asks for it, invalid UTF-8 as U+FFFD."""
        pieces = [self.token_bytes(i, special) for i in ids]
        if remove_space and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        data = b"".join(pieces)
        if clean_up_spaces:
            data = clean_spaces(data)
        return data.decode("utf-8", errors="replace")


def clean_spaces(data: bytes) -> bytes:
    """llama_detokenize's clean_up_tokenization_spaces passes (byte-level, as llama.cpp does them)."""
    if not data:
        return data
    s = bytearray(data)
    # " ?", " !", " .", " ," -> drop the space
    out = bytearray(s[:1])
    for i in range(1, len(s)):
        if s[i - 1] == 0x20 and s[i] in b"?!.,":
            out.pop()
        out.append(s[i])
    s = out
    # " ' " -> "'"
    out = bytearray(s[:1])
    i = 1
    while i < len(s):
        x = s[i]
        if x == 0x27 and i + 1 < len(s) and s[i - 1] == 0x20 and s[i + 1] == 0x20:
            out.pop()
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    s = out
    # " 's", " 'm", " 're", " 've" -> drop the space
    out = bytearray(s[:1])
    n = len(s)
    for i in range(1, n):
        x = s[i]
        if s[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = s[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < n and (bytes([x1, s[i + 2]]) in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return bytes(out)


class _HasTokenBytes(Protocol):
    def token_bytes(self, id: int, special: bool = True) -> bytes: ...


class StreamDecoder:
    """Incremental detokenizer: push(id) returns the text that is complete so far.

    Bytes of a UTF-8 character split across tokens (byte-fallback or byte-level tokens) are held back
    until the character is complete; flush() returns whatever is left (invalid bytes as U+FFFD). Pieces
    are llama_token_to_piece output, concatenated as llama-server streams them (no leading-space removal,
    no clean-up of spaces)."""

    def __init__(self, tokenizer: _HasTokenBytes, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._special = not skip_special
        self._pending = b""

    def push(self, id: int) -> str:
        data = self._pending + self._tok.token_bytes(id, self._special)
        cut = complete_prefix_len(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace") if cut else ""

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")

    @property
    def pending(self) -> bytes:
        return self._pending


def complete_prefix_len(data: bytes) -> int:
    """Length of `data` without a trailing, still incomplete UTF-8 sequence."""
    n = len(data)
    # look back at most 3 bytes for the lead byte of the last sequence
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        if b >= 0xF0:
            need = 4
        elif b >= 0xE0:
            need = 3
        elif b >= 0xC0:
            need = 2
        else:
            return n  # ASCII: nothing pending
        return n - back if back < need and b < 0xF8 else n
    return n
