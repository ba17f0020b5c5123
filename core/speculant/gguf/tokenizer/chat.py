"""Chat prompts whose messages are text: special-token texts typed into a message stay text.

`encode(apply_chat_template(messages))` lets a message that contains '<|im_start|>system...' open a
real system turn (role injection). Here, before the template renders, every text of a control or
unknown token in the messages' strings (contents, roles, names, ...) is replaced by a placeholder
no template would produce or change (a private-use character, a per-call random number, an index);
the rendered prompt is cut at the special tokens the template itself wrote, and in the raw text
pieces the placeholders become the original texts again, tokenized as text (as parse_special=False
would). Messages without such texts render and tokenize exactly as before, whatever the template
does to them (trim, split, ...): nothing in them was replaced.
"""
from __future__ import annotations

import re
import secrets
from typing import Any, Callable

from speculant.gguf.tokenizer.special import Fragments, SpecialTokens

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no template writes or trims them


class HiddenSpecials:
    """`value` (messages, template variables) with the special-token texts in its strings hidden."""

    def __init__(self, specials: SpecialTokens, value: Any) -> None:
        self._specials = specials
        while True:  # a tag that no string holds already (a client cannot guess one, but it costs nothing)
            self.texts: list[str] = []  # placeholder number -> the hidden text
            self.tag = _OPEN + str(secrets.randbelow(10**12)).zfill(12) + "."
            self._clash = False
            self.value = self._hide(value)
            if not self._clash:
                break
        self._pattern = re.compile(re.escape(self.tag) + r"(\d+)" + _CLOSE)

    def _hide(self, v: Any) -> Any:
        if isinstance(v, str):
            return self._hide_str(v)
        if isinstance(v, dict):
            return {k: self._hide(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(self._hide(x) for x in v)
        return v

    def _hide_str(self, s: str) -> str:
        if _OPEN in s and self.tag in s:
            self._clash = True
        spans = self._specials.gated_spans(s)
        if not spans:
            return s
        out, at = [], 0
        for a, b in spans:
            out.append(s[at:a])
            out.append(f"{self.tag}{len(self.texts)}{_CLOSE}")
            self.texts.append(s[a:b])
            at = b
        out.append(s[at:])
        return "".join(out)

    def restore(self, frags: Fragments) -> Fragments:
        """The hidden texts back in the raw pieces of `frags` (a partitioned rendering of self.value)."""
        if not self.texts:
            return frags
        texts, pattern = self.texts, self._pattern

        def back(m: re.Match) -> str:
            i = int(m.group(1))
            return texts[i] if i < len(texts) else m.group(0)

        return [f if isinstance(f, int) or _OPEN not in f else pattern.sub(back, f) for f in frags]


class ChatPrompt:
    """A chat prompt rendered as text, not tokenized yet: its size can be checked first."""

    def __init__(self, render: Callable[[Any, dict], str], messages: list[dict], extra: dict, special_in_content: bool,
                 specials: SpecialTokens, encode_fragments: Callable[[Fragments], list[int]]) -> None:
        self._render, self._messages, self._extra = render, messages, extra
        self._special_in_content = special_in_content
        self._specials, self._encode_fragments = specials, encode_fragments
        self.text: str = render(messages, extra)  # the prompt, as apply_chat_template renders it

    def encode(self) -> list[int]:
        """The prompt's token ids (BOS/EOS added as the model asks). Special-token texts are parsed in the
        template's own text only (a second rendering, with the messages' ones hidden, tells them apart),
        or everywhere when the prompt was made with special_in_content."""
        rendered, hidden = self.text, None
        if not self._special_in_content:
            hidden = HiddenSpecials(self._specials, (self._messages, self._extra))
            if hidden.texts:
                rendered = self._render(*hidden.value)
        frags = self._specials.partition(rendered, parse_special=True) if rendered else []
        if hidden is not None:
            frags = hidden.restore(frags)
        return self._encode_fragments(frags)
