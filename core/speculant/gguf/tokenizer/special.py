"""Special tokens cut out of the text before the merges (llama.cpp's tokenizer_st_partition).

Control, user-defined and unknown tokens are matched by their text, longest first; control and
unknown ones only when parse_special is set (user-defined ones always, as in llama.cpp).
"""
from __future__ import annotations

from speculant.gguf.tokenizer.vocab import ATTR_CUT, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_SPECIAL, Vocabulary

_ASCII_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, used for LSTRIP/RSTRIP

Fragments = list  # list[str | int]: raw text pieces and token ids, in order


class SpecialTokens:
    """The vocabulary's special tokens, longest text (in UTF-8 bytes) first."""

    def __init__(self, vocab: Vocabulary) -> None:
        tokens, attrs = vocab.tokens, vocab.attrs
        cut = [i for i, a in enumerate(attrs) if a & ATTR_CUT]
        cut.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._attrs = attrs
        # (id, text, gated): gated tokens (control, unknown) are matched only with parse_special
        self._tokens: list[tuple[int, str, bool]] = [(i, tokens[i], bool(attrs[i] & ATTR_SPECIAL)) for i in cut]
        # Presence filter: tokens grouped by their first 4 characters; a group is looked at only when its
        # prefix occurs in the text (Gemma has ~6k '<unusedN>' control tokens).
        groups: dict[str, list[int]] = {}
        for k, (_, text, _) in enumerate(self._tokens):
            groups.setdefault(text[:4], []).append(k)
        self._groups: list[tuple[str, list[int]]] = list(groups.items())

    def _present(self, text: str) -> list[int]:
        """Indexes (longest first) of the tokens whose text occurs in `text`."""
        tokens = self._tokens
        present = [k for prefix, members in self._groups if prefix in text for k in members if tokens[k][1] in text]
        present.sort()
        return present

    def partition(self, text: str, parse_special: bool) -> Fragments:
        """`text` as raw pieces and special-token ids. Tokens are taken longest first; each one splits
        every raw fragment at all its occurrences; LSTRIP / RSTRIP tokens eat the spaces beside them."""
        frags: Fragments = [text]
        for k in self._present(text):
            tid, ttext, gated = self._tokens[k]
            if gated and not parse_special:
                continue
            attr = self._attrs[tid]
            new: Fragments = []
            for f in frags:
                if isinstance(f, int) or ttext not in f:
                    new.append(f)
                    continue
                parts = f.split(ttext)
                for j, part in enumerate(parts):
                    if j:
                        new.append(tid)
                    if attr & ATTR_LSTRIP and j + 1 < len(parts):
                        part = part.rstrip(_ASCII_SPACE)
                    if attr & ATTR_RSTRIP and j > 0:
                        part = part.lstrip(_ASCII_SPACE)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def gated_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of the texts of control and unknown tokens that partition(text, True) would
        cut out (all special tokens are taken longest first, as there), in order."""
        spans: list[tuple[int, int]] = []
        free = [(0, len(text))]  # the stretches of `text` not taken yet
        for k in self._present(text):
            _, ttext, gated = self._tokens[k]
            rest = []
            for a, b in free:
                p = text.find(ttext, a, b)
                while p >= 0:
                    if gated:
                        spans.append((p, p + len(ttext)))
                    if p > a:
                        rest.append((a, p))
                    a = p + len(ttext)
                    p = text.find(ttext, a, b)
                if a < b:
                    rest.append((a, b))
            free = rest
        spans.sort()
        return spans
