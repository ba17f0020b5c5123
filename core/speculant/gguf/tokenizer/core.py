"""The Tokenizer: text <-> token ids for one GGUF vocabulary, token-for-token as llama.cpp.

It puts together the vocabulary rules (vocab.py), the special-token cutter (special.py), one merge
engine (spm.py or bpe.py), detokenization (detokenize.py) and the chat template.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from speculant.gguf.file import read_gguf_metadata
from speculant.gguf.tokenizer.bpe import BpeEncoder
from speculant.gguf.tokenizer.chat import ChatPrompt
from speculant.gguf.tokenizer.detokenize import Pieces, StreamDecoder
from speculant.gguf.tokenizer.special import SpecialTokens
from speculant.gguf.tokenizer.spm import SpmEncoder
from speculant.gguf.tokenizer.vocab import (ATTR_CONTROL, ATTR_USER_DEFINED, Vocabulary, VocabSettings, chat_template_of,
                                            mark_special_tokens, read_settings, read_vocabulary)


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary, matching llama.cpp's llama_tokenize / llama_detokenize."""

    def __init__(self, metadata: dict[str, Any], path: str = "") -> None:
        self.path = path
        where = path or "model"
        vocab = read_vocabulary(metadata, where)  # kind, token texts, types, scores (checked)
        settings = read_settings(metadata, vocab, where)  # flags and special ids
        mark_special_tokens(metadata, vocab, settings)  # found by text, end of generation, per-model rules
        self._adopt(vocab, settings)
        self.chat_template: str | None = chat_template_of(metadata)
        self._specials = SpecialTokens(vocab)
        self._pieces = Pieces(vocab)
        self._engine = (SpmEncoder(vocab, settings.unk_id) if vocab.vocab_type == "spm"
                        else BpeEncoder(metadata, vocab, settings.regexes, settings.ignore_merges, where))

    def _adopt(self, vocab: Vocabulary, s: VocabSettings) -> None:
        """The vocabulary's public attributes."""
        self._vocab = vocab
        self._tokens, self._attrs = vocab.tokens, vocab.attrs
        self.model: str = vocab.model
        self.vocab_type: str = vocab.vocab_type
        self.pre: str = vocab.pre
        self.n_vocab: int = vocab.n
        self.add_space_prefix, self.add_bos, self.add_eos = s.add_space_prefix, s.add_bos, s.add_eos
        self.clean_spaces, self.ignore_merges = s.clean_spaces, s.ignore_merges
        self.bos_id, self.eos_id, self.unk_id = s.bos_id, s.eos_id, s.unk_id
        self.pad_id, self.sep_id, self.eot_id, self.eom_id = s.pad_id, s.sep_id, s.eot_id, s.eom_id
        self.fim_ids: dict[str, int | None] = s.fim_ids
        self.eog_ids: frozenset[int] = s.eog_ids

    @classmethod
    def from_metadata(cls, metadata: dict, path: str = "") -> "Tokenizer":
        """Build the tokenizer from `open_gguf(path).metadata` (tokenizer.* keys). `path` names errors."""
        return cls(metadata, path)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build the tokenizer straight from a .gguf file, reading only its metadata (no tensors)."""
        path = os.fspath(path)
        return cls(read_gguf_metadata(path), path)

    # -------------------------------------------------------------------------------------------------
    # encoding
    # -------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, as llama_tokenize(text, add_special, parse_special).

        add_special adds BOS (and EOS) where the model asks for them (add_bos / add_eos); parse_special
        maps the text of control tokens such as '<|im_start|>' to their ids. User-defined tokens are
        always matched, as in llama.cpp."""
        return self._encode(self._specials.partition(text, parse_special) if text else [], add_special)

    def _encode(self, frags: list, add_special: bool) -> list[int]:
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        self._engine.encode(frags, out, self.add_space_prefix)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    # -------------------------------------------------------------------------------------------------
    # decoding
    # -------------------------------------------------------------------------------------------------
    def token_text(self, id: int) -> str:
        """The raw vocabulary string of token `id` (e.g. 'Ġhello', '▁hello', '<0x0A>', '<|im_end|>')."""
        return self._tokens[id]

    def token_bytes(self, id: int, special: bool = True) -> bytes:
        """The bytes token `id` stands for (llama_token_to_piece). Control and unknown tokens give their
        text when `special`, else nothing; unused tokens give nothing. May be part of a UTF-8 character."""
        return self._pieces.token_bytes(id, special)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text for `ids`, as llama_detokenize(remove_special=skip_special, unparse_special=not skip_special).

        With skip_special, a leading BOS / trailing EOS that the model adds itself are dropped and control
        tokens render as nothing; otherwise control tokens render as their text. Invalid UTF-8 (a character
        cut in half) becomes U+FFFD."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return self._pieces.detokenize(ids, not skip_special, remove_space, self.clean_spaces)

    def is_eog(self, id: int) -> bool:
        return id in self.eog_ids

    def is_control(self, id: int) -> bool:
        return bool(self._attrs[id] & ATTR_CONTROL)

    def is_user_defined(self, id: int) -> bool:
        """A token the model's authors added (Qwen's `<tool_call>`): always matched as a whole."""
        return bool(self._attrs[id] & ATTR_USER_DEFINED)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token can stand for: a text of B bytes needs at least
        B / max_token_bytes tokens (special-token texts included)."""
        n = getattr(self, "_max_token_bytes", None)
        if n is None:
            self._max_token_bytes = n = self._pieces.max_text_bytes()
        return n

    # -------------------------------------------------------------------------------------------------
    # chat
    # -------------------------------------------------------------------------------------------------
    @property
    def bos_text(self) -> str:
        return self.token_bytes(self.bos_id, True).decode("utf-8", "replace") if self.bos_id is not None else ""

    @property
    def eos_text(self) -> str:
        return self.token_bytes(self.eos_id, True).decode("utf-8", "replace") if self.eos_id is not None else ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render `messages` with the GGUF's chat template (ChatML when the file has none, as llama.cpp does).

        bos_token / eos_token are the BOS/EOS token texts. As llama.cpp does, a BOS text at the very start
        of the result is removed when encode() adds BOS itself (and likewise a trailing EOS), so
        `encode(apply_chat_template(messages))` gives the prompt tokens llama.cpp would."""
        from speculant.gguf.chat_template import CHATML_TEMPLATE, render_chat

        bos, eos = self.bos_text, self.eos_text
        out = render_chat(self.chat_template or CHATML_TEMPLATE, messages, add_generation_prompt=add_generation_prompt,
                          bos_token=bos, eos_token=eos, **extra)
        if self.add_bos and bos and out.startswith(bos):
            out = out[len(bos):]
        if self.add_eos and eos and out.endswith(eos):
            out = out[:-len(eos)]
        return out

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, special_in_content: bool = False,
                    **extra: Any) -> ChatPrompt:
        """`messages` rendered with the chat template (its .text), to be tokenized by its encode().

        Only the template's own text yields control tokens: a control token's text inside a message
        (content, role, name, ...) or inside `extra` is tokenized as text, as encode(parse_special=False)
        would. When no message holds such a text, the tokens are `encode(apply_chat_template(...))`.
        special_in_content=True is that old behaviour in any case (a message may then open turns)."""
        def render(msgs: list[dict], kw: dict) -> str:
            return self.apply_chat_template(msgs, add_generation_prompt, **kw)

        return ChatPrompt(render, messages, extra, special_in_content, self._specials,
                          lambda frags: self._encode(frags, add_special=True))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, special_in_content: bool = False,
                    **extra: Any) -> list[int]:
        """The prompt tokens of `messages`: chat_prompt(...).encode()."""
        return self.chat_prompt(messages, add_generation_prompt, special_in_content, **extra).encode()

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, bos={self.bos_id}, "
                f"eos={self.eos_id}, add_bos={self.add_bos}, eog={sorted(self.eog_ids)})")
