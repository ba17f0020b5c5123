"""Helpers shared by the n-gram speculators: option parsing, n-gram search in a token history,
and vectorised polynomial hashes.

Conventions. llama.cpp's drafters get ``prompt`` (every token already in the target's context)
and ``id_last`` (the token just sampled, not yet decoded). Our ``SequenceView.tokens`` is the
whole history *including* that last token, so throughout this package

    T = seq.tokens,  L = len(T) - 1 = len(prompt),  prompt[j] = T[j] for j < L,  id_last = T[L].

An n-gram "at j" is ``T[j:j+n]``.
"""
from __future__ import annotations

import numpy as np

from speculant import SpeculantError

# Below this many candidate start positions a plain Python scan of the tuple beats converting the
# whole history to an int32 byte image (~50 us for 2k tokens) for a C-speed substring search.
SCAN_IN_PYTHON = 48


def int_option(config, name: str, default: int, low: int, high: int | None = None) -> int:
    """``config.option(name, default)`` checked to be an integer in [low, high] (the flags are
    checked by argparse already; this catches options given programmatically)."""
    value = config.option(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SpeculantError(f"--{name.replace('_', '-')} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise SpeculantError(f"--{name.replace('_', '-')} must be {bounds}, got {value}")
    return value


def tokens_of(seq) -> tuple[int, ...]:
    """``seq.tokens`` as a tuple (it is one from the engine; slices and dict keys rely on it)."""
    t = seq.tokens
    return t if type(t) is tuple else tuple(t)


class History:
    """One call's view of ``seq.tokens`` with a lazily built int32 byte image.

    The image lets ``bytes.rfind``/``bytes.find`` search n-grams at C speed; it is built only when
    a search range is too long for a Python scan, so the common incremental case (a handful of
    new positions per decode step) never pays for the conversion."""

    __slots__ = ("tokens", "_image")

    def __init__(self, tokens: tuple[int, ...]):
        self.tokens = tokens
        self._image: bytes | None = None

    def image(self) -> bytes:
        if self._image is None:
            self._image = np.fromiter(self.tokens, dtype=np.int32, count=len(self.tokens)).tobytes()
        return self._image

    def array(self) -> np.ndarray:
        return np.frombuffer(self.image(), dtype=np.int32)

    def rfind(self, key: tuple[int, ...], lo: int, hi: int) -> int:
        """The highest j in [lo, hi] with T[j:j+len(key)] == key, or -1 (a descending scan's first hit)."""
        if hi < lo:
            return -1
        t, n = self.tokens, len(key)
        if hi - lo < SCAN_IN_PYTHON:
            k0 = key[0]
            for j in range(hi, lo - 1, -1):
                if t[j] == k0 and t[j : j + n] == key:
                    return j
            return -1
        img, pat = self.image(), np.asarray(key, dtype=np.int32).tobytes()
        start, end = 4 * lo, 4 * (hi + n)
        while True:
            p = img.rfind(pat, start, end)
            if p < 0:
                return -1
            if p % 4 == 0:
                return p // 4
            end = p + len(pat) - 1  # a hit straddling token boundaries: look strictly before it

    def find_all(self, key: tuple[int, ...], lo: int, hi: int) -> list[int]:
        """Every j in [lo, hi] with T[j:j+len(key)] == key, ascending (overlaps included)."""
        if hi < lo:
            return []
        t, n = self.tokens, len(key)
        if hi - lo < SCAN_IN_PYTHON:
            k0 = key[0]
            return [j for j in range(lo, hi + 1) if t[j] == k0 and t[j : j + n] == key]
        img, pat = self.image(), np.asarray(key, dtype=np.int32).tobytes()
        out, start, end = [], 4 * lo, 4 * (hi + n)
        while True:
            p = img.find(pat, start, end)
            if p < 0:
                return out
            if p % 4 == 0:
                out.append(p // 4)
                start = p + 4
            else:
                start = p + 1


def hash_powers(mul: int, n: int, word_bits: int, mask: int) -> np.ndarray:
    """Weights w_k = mul^(n-1-k) (mod 2^word_bits, then & mask) of the polynomial hash
    h = h*mul + t over n tokens: h = sum_k t_k * w_k."""
    word = (1 << word_bits) - 1
    return np.array([pow(mul, n - 1 - k, 1 << word_bits) & word & mask for k in range(n)], dtype=np.int64)


def window_hashes(arr: np.ndarray, lo: int, count: int, powers: np.ndarray, mask: int) -> np.ndarray:
    """``hash(arr[j:j+n]) & mask`` for the ``count`` windows starting at lo, lo+1, ...

    The tables are indexed by ``hash mod size`` with size a power of two that divides the hash's
    word (2^32 or 2^64), so only the hash's low bits matter and they can be computed exactly in
    int64 from tokens and weights reduced by the same mask: each product is < 2^44 and a sum of
    at most 1024 of them stays below 2^63."""
    n = len(powers)
    x = arr[lo : lo + count + n - 1].astype(np.int64) & mask
    acc = np.zeros(count, dtype=np.int64)
    for k in range(n):
        acc += x[k : k + count] * powers[k]
    return acc & mask


def hash_low_bits(tokens, mul_low: int, mask: int) -> int:
    """The same masked hash for one window, in Python ints."""
    h = 0
    for t in tokens:
        h = (h * mul_low + t) & mask
    return h
