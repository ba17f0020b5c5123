"""Tokenizer built from GGUF metadata, token-for-token compatible with llama.cpp.

Two vocabulary kinds are supported, named by 'tokenizer.ggml.model':

* 'gpt2' -- byte-level BPE (Qwen2, Llama 3, GPT-2, StarCoder, ...). The merges run in the HF `tokenizers`
  library: a BPE model built from the GGUF vocabulary and merges, behind the pre-tokenizer regexes that
  llama.cpp uses for the file's 'tokenizer.ggml.pre' and a ByteLevel step.
* 'llama' -- SentencePiece-style vocabulary with scores (Llama 1/2, Gemma, Mistral v1, ...). This is
  llama.cpp's llm_tokenizer_spm algorithm (greedy merge of the adjacent pair whose merged piece has the
  highest score, leftmost first on ties; characters left over become <0xXX> byte tokens). It is written
  here directly rather than through a BPE model: an HF BPE model would need ~500k merges synthesized from
  the scores (about 2.5 s for Gemma's 262k vocabulary) and breaks some score ties differently.

Around both, the llama.cpp conventions: control / user-defined / unknown tokens are cut out of the text
before the merges (longest token text first; control and unknown ones only when parse_special is set),
BOS/EOS are added per 'tokenizer.ggml.add_bos_token' / 'add_eos_token', end-of-generation ids are
found by token text, and detokenization follows llama_token_to_piece / llama_detokenize.
"""
from __future__ import annotations

import heapq
import os
import re
from typing import Any, Iterable, Sequence

from speculant.errors import ModelFileError
from speculant.gguf.file import read_gguf_metadata  # re-exported: the metadata-only reader lives with the GGUF parser

# GGUF token types (tokenizer.ggml.token_type), as llama.cpp's llama_token_type.
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Token attribute bits, as llama.cpp's llama_token_attr.
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}
_ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL  # rendered only when detokenizing with special=True

# Token texts that llama.cpp treats as end-of-turn / end-of-generation (llama-vocab.cpp, vocab load).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

# ---------------------------------------------------------------------------------------------------
# BPE pre-tokenizers: llama.cpp's regex list per 'tokenizer.ggml.pre' (original HF spelling of each
# regex; they run in the `tokenizers` library's Oniguruma engine). Each entry: (regexes, flags).
# ---------------------------------------------------------------------------------------------------
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_DEFAULT = ([r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], {})
_PRE_TYPES: dict[str, tuple[list[str], dict[str, bool]]] = {}


def _pre(names: Iterable[str], regexes: list[str], **flags: bool) -> None:
    for name in names:
        _PRE_TYPES[name] = (regexes, flags)


_pre(["default"], _PRE_DEFAULT[0])
_pre(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
      "smaug-bpe"], [_RE_LLAMA3], ignore_merges=True, add_bos=True)
_pre(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "hunyuan", "solar-open"], [_RE_QWEN2], clean_spaces=False)
_pre(["stablelm2"], [_RE_QWEN2])
_pre(["qwen35"], [_RE_QWEN35], clean_spaces=False)
_pre(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "mpt", "olmo", "jais", "exaone4"], [_RE_GPT2])
_pre(["trillion", "granite-docling"], [_RE_GPT2], clean_spaces=False)
_pre(["starcoder", "refact", "codeshell", "exaone", "minerva-7b"], [r"\p{N}", _RE_GPT2])
_pre(["command-r", "smollm"], [r"\p{N}", _RE_GPT2], clean_spaces=False)
_pre(["gpt-4o", "llama4"], [_RE_GPT4O], clean_spaces=False)
_pre(["tekken"], [_RE_TEKKEN], clean_spaces=False, ignore_merges=True, add_bos=True)
_pre(["chatglm-bpe", "glm4"], [_RE_LLAMA3])
_pre(["deepseek-coder"], [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"], clean_spaces=False)
_pre(["deepseek-v3"], [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                       r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"], clean_spaces=False)
_pre(["falcon"], [r"[\p{P}\$\+<=>\^~\|`]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                  r"[0-9][0-9][0-9]"])


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


_BYTE_TO_UNICODE = bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}
_ASCII_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale, used for LSTRIP/RSTRIP
_SPM_WORD_START = re.compile("(?<=[^▁])▁")  # a '▁' after another character: where an SPM word may start


def _meta_id(metadata: dict, key: str) -> int | None:
    v = metadata.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary, matching llama.cpp's llama_tokenize / llama_detokenize."""

    def __init__(self, metadata: dict[str, Any], path: str = "") -> None:
        self.path = path
        where = path or "model"
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError(f"{where}: no tokenizer in the file (metadata key 'tokenizer.ggml.model' is missing)")
        self.model: str = str(model)
        if self.model == "llama":
            self.vocab_type = "spm"
        elif self.model == "gpt2":
            self.vocab_type = "bpe"
        else:
            raise ModelFileError(
                f"{where}: tokenizer model '{self.model}' is not supported (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece)")
        self.pre: str = str(metadata.get("tokenizer.ggml.pre") or "default")

        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise ModelFileError(f"{where}: tokenizer vocabulary 'tokenizer.ggml.tokens' is missing or empty")
        n = len(tokens)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            seen: set[str] = set()
            dup = next(t for t in tokens if t in seen or seen.add(t))
            raise ModelFileError(f"{where}: duplicate token {dup!r} in the tokenizer vocabulary")
        self._tokens: list[str] = tokens
        self._vocab: dict[str, int] = vocab
        self.n_vocab: int = n

        scores = metadata.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) < n:
            raise ModelFileError(f"{where}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        types = metadata.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise ModelFileError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        if types is None:
            attrs = [ATTR_NORMAL] * n
        else:
            get = _TYPE_TO_ATTR.get
            attrs = [get(t, ATTR_UNDEFINED) for t in types[:n]]
        self._attrs: list[int] = attrs

        # -- flags and special ids: llama.cpp defaults per vocab type, then the metadata ------------------
        if self.vocab_type == "spm":
            bos, eos, unk = 1, 2, 0
            self.add_space_prefix, self.add_bos, self.add_eos, self.clean_spaces = True, True, False, False
            self.ignore_merges = False
            self._scores: list[float] = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
        else:
            bos, eos, unk = 11, 11, None
            if self.pre not in _PRE_TYPES:
                raise ModelFileError(
                    f"{where}: BPE pre-tokenizer '{self.pre}' (tokenizer.ggml.pre) is not supported; supported: "
                    + ", ".join(sorted(_PRE_TYPES)))
            regexes, flags = _PRE_TYPES[self.pre]
            self.add_space_prefix = False
            self.add_bos = flags.get("add_bos", False)
            self.add_eos = False
            self.clean_spaces = flags.get("clean_spaces", True)
            self.ignore_merges = flags.get("ignore_merges", False)
            self._scores = []
        self.add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix))

        def special(key: str, default: int | None) -> int | None:
            if default is not None and not 0 <= default < n:
                default = None
            v = _meta_id(metadata, f"tokenizer.ggml.{key}")
            return v if v is not None and 0 <= v < n else default

        self.bos_id: int | None = special("bos_token_id", bos)
        self.eos_id: int | None = special("eos_token_id", eos)
        self.unk_id: int | None = special("unknown_token_id", unk)
        self.pad_id: int | None = special("padding_token_id", None)
        self.sep_id: int | None = special("seperator_token_id", None)
        self.eot_id: int | None = special("eot_token_id", None)
        self.eom_id: int | None = special("eom_token_id", None)
        fim = {k: special(f"{k}_token_id", None) for k in _FIM_TEXTS}
        for old, new in (("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid")):
            if fim[new] is None:
                fim[new] = special(f"{old}_token_id", None)
        if "tokenizer.ggml.add_bos_token" in metadata:
            self.add_bos = bool(metadata["tokenizer.ggml.add_bos_token"])
        if "tokenizer.ggml.add_eos_token" in metadata:
            self.add_eos = bool(metadata["tokenizer.ggml.add_eos_token"])
        if self.add_bos and self.bos_id is None:
            raise ModelFileError(f"{where}: tokenizer.ggml.add_bos_token is true, but the BOS token id is not set")
        if self.add_eos and self.eos_id is None:
            raise ModelFileError(f"{where}: tokenizer.ggml.add_eos_token is true, but the EOS token id is not set")

        # -- auto-detected special tokens, by text, as llama.cpp does --------------------------------------
        def find(texts: Sequence[str]) -> int | None:
            for t in texts:
                i = vocab.get(t)
                if i is not None:
                    return i
            return None

        def force_control(i: int) -> None:
            attrs[i] |= ATTR_CONTROL

        if self.eot_id is None:
            self.eot_id = find(_EOT_TEXTS)
            if self.eot_id is not None:
                force_control(self.eot_id)
        if self.eom_id is None:
            self.eom_id = find(_EOM_TEXTS)
            if self.eom_id is not None:
                force_control(self.eom_id)
        for k, texts in _FIM_TEXTS.items():
            if fim[k] is None:
                fim[k] = find(texts)
                if fim[k] is not None:
                    force_control(fim[k])
        self.fim_ids: dict[str, int | None] = fim

        specials = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        for i in specials:  # control tokens named "unused..." are unused
            if attrs[i] & ATTR_CONTROL and "unused" in tokens[i]:
                attrs[i] |= ATTR_UNUSED

        eog = {i for i in (fim["fim_pad"], fim["fim_rep"], fim["fim_sep"]) if i is not None}
        for t in _EOG_TEXTS:
            i = vocab.get(t)
            if i is not None:
                eog.add(i)
                force_control(i)
        for t in _ALWAYS_RENDERED:
            i = vocab.get(t)
            if i is not None:
                attrs[i] = ATTR_USER_DEFINED
        eog.update(i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None)
        texts_eog = {tokens[i]: i for i in eog}
        if "<|end|>" in texts_eog and (("<|return|>" in texts_eog and ("<|call|>" in texts_eog or "<|calls|>" in texts_eog))
                                       or (("<|call|>" in texts_eog or "<|calls|>" in texts_eog) and "<|flush|>" in texts_eog)):
            eog.discard(texts_eog["<|end|>"])
            attrs[texts_eog["<|end|>"]] = ATTR_USER_DEFINED
        if "<|tool_response>" in texts_eog and "</s>" in texts_eog:
            eog.discard(texts_eog["</s>"])
            attrs[texts_eog["</s>"]] = ATTR_NORMAL
        self.eog_ids: frozenset[int] = frozenset(eog)

        # per-token strip attributes that llama.cpp sets by model name
        name = str(metadata.get("general.name", "")).lower()
        if any(s in self.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
                s in str(metadata.get("general.architecture", "")) for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in vocab:
                attrs[vocab["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in specials:
                attrs[i] |= ATTR_RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if t in vocab:
                    attrs[vocab[t]] = attrs[vocab[t]] | ATTR_RSTRIP if on else attrs[vocab[t]] & ~ATTR_RSTRIP

        # tokens cut out of the text before the merges: longest text (in UTF-8 bytes) first
        specials = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        specials.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._special_tokens: list[tuple[int, str, bool]] = [
            (i, tokens[i], bool(attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN))) for i in specials]
        # Presence filter: tokens grouped by their first 4 characters; a group is looked at only when its
        # prefix occurs in the text (Gemma has ~6k '<unusedN>' control tokens).
        groups: dict[str, list[int]] = {}
        for k, (_, ttext, _) in enumerate(self._special_tokens):
            groups.setdefault(ttext[:4], []).append(k)
        self._special_groups: list[tuple[str, list[int]]] = list(groups.items())

        # llama.cpp falls back to the tool-use template, then to ChatML (see apply_chat_template)
        self.chat_template: str | None = (metadata.get("tokenizer.chat_template")
                                          or metadata.get("tokenizer.chat_template.tool_use") or None)
        self._piece_cache: dict[tuple[int, bool], bytes] = {}

        # -- the merge engine -----------------------------------------------------------------------------
        if self.vocab_type == "spm":
            # llama.cpp's byte_to_token: '<0xXX>', else the byte itself as a one-character token
            self._byte_ids = [vocab.get(f"<0x{b:02X}>", vocab.get(chr(b), self.unk_id) if b < 0x80 else self.unk_id)
                              for b in range(256)]
            # Merges never join a symbol ending in a non-'▁' character to one starting with '▁' unless
            # some token has that shape inside it (Gemma: only '>▁</'). So the text can be cut before
            # such '▁'s -- except where one of those tokens occurs -- and the words tokenized (and
            # cached) one by one, with the same result as the whole text.
            crossing = []
            for t in tokens:
                if "▁" in t.lstrip("▁"):
                    offs = tuple(j for j in range(1, len(t)) if t[j] == "▁" and t[j - 1] != "▁")
                    crossing.append((t, offs))
            self._spm_crossing: list[tuple[str, tuple[int, ...]]] | None = crossing if len(crossing) <= 64 else None
            self._spm_cache: dict[str, tuple[int, ...]] = {}
            self._hf = None
        else:
            self._hf = self._build_hf_bpe(metadata, regexes, where)

    # -------------------------------------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metadata: dict, path: str = "") -> "Tokenizer":
        """Build the tokenizer from `open_gguf(path).metadata` (tokenizer.* keys). `path` names errors."""
        return cls(metadata, path)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build the tokenizer straight from a .gguf file, reading only its metadata (no tensors)."""
        path = os.fspath(path)
        return cls(read_gguf_metadata(path), path)

    def _build_hf_bpe(self, metadata: dict, regexes: list[str], where: str):
        from tokenizers import Regex, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        merges_raw = metadata.get("tokenizer.ggml.merges")
        if not merges_raw:
            raise ModelFileError(f"{where}: BPE tokenizer without merges (tokenizer.ggml.merges is missing)")
        vocab = self._vocab
        merges: list[tuple[str, str]] = []
        for m in merges_raw:
            pos = m.find(" ", 1)
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1:]
            # llama.cpp keeps merges whose parts are not tokens; they can never fire on a byte-level vocab
            if a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
        try:
            model = BPE(vocab=vocab, merges=merges, ignore_merges=self.ignore_merges)
        except TypeError:  # tokenizers < 0.19 has no ignore_merges
            model = BPE(vocab=vocab, merges=merges)
        tok = HFTokenizer(model)
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        return tok

    # -------------------------------------------------------------------------------------------------
    # encoding
    # -------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, as llama_tokenize(text, add_special, parse_special).

        add_special adds BOS (and EOS) where the model asks for them (add_bos / add_eos); parse_special
        maps the text of control tokens such as '<|im_start|>' to their ids. User-defined tokens are
        always matched, as in llama.cpp."""
        fragments = self._partition(text, parse_special) if text else []
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        if self.vocab_type == "spm":
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_encode(frag.replace(" ", "▁"), out)
                prev_special = False
        else:
            hf = self._hf
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    out.extend(hf.encode(frag, add_special_tokens=False).ids)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special-token texts out of `text` (llama.cpp's tokenizer_st_partition).

        Tokens are taken longest first; each one splits every raw fragment at all its occurrences."""
        frags: list[str | int] = [text]
        # a fragment holds a token text only if the whole text does
        present = [k for prefix, members in self._special_groups if prefix in text
                   for k in members if self._special_tokens[k][1] in text]
        present.sort()
        for k in present:
            tid, ttext, control = self._special_tokens[k]
            if control and not parse_special:
                continue
            attr = self._attrs[tid]
            new: list[str | int] = []
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

    def _spm_encode(self, text: str, out: list[int]) -> None:
        """SPM-tokenize one raw fragment (spaces already '▁'), word by word where that is exact."""
        crossing = self._spm_crossing
        if crossing is None or len(text) < 16:
            self._spm_tokenize(text, out)
            return
        protected: set[int] = set()
        for t, offs in crossing:
            start = text.find(t)
            while start >= 0:
                protected.update(start + j for j in offs)
                start = text.find(t, start + 1)
        cache = self._spm_cache
        if len(cache) > 100_000:
            cache.clear()
        begin = 0
        for m in _SPM_WORD_START.finditer(text):
            p = m.start()
            if p in protected:
                continue
            self._spm_word(text[begin:p], out, cache)
            begin = p
        self._spm_word(text[begin:], out, cache)

    def _spm_word(self, word: str, out: list[int], cache: dict[str, tuple[int, ...]]) -> None:
        ids = cache.get(word)
        if ids is None:
            buf: list[int] = []
            self._spm_tokenize(word, buf)
            ids = cache[word] = tuple(buf)
        out.extend(ids)

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm_session::tokenize on whitespace-escaped text."""
        syms = list(text)
        n = len(syms)
        if n == 0:
            return
        vocab_get = self._vocab.get
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

    # -------------------------------------------------------------------------------------------------
    # decoding
    # -------------------------------------------------------------------------------------------------
    def token_text(self, id: int) -> str:
        """The raw vocabulary string of token `id` (e.g. 'Ġhello', '▁hello', '<0x0A>', '<|im_end|>')."""
        return self._tokens[id]

    def token_bytes(self, id: int, special: bool = True) -> bytes:
        """The bytes token `id` stands for (llama_token_to_piece). Control and unknown tokens give their
        text when `special`, else nothing; unused tokens give nothing. May be part of a UTF-8 character."""
        key = (id, special)
        piece = self._piece_cache.get(key)
        if piece is None:
            piece = self._piece(id, special)
            self._piece_cache[key] = piece
        return piece

    def _piece(self, id: int, special: bool) -> bytes:
        if not 0 <= id < self.n_vocab:
            raise ValueError(f"token id {id} is out of range for a vocabulary of {self.n_vocab}")
        attr = self._attrs[id]
        text = self._tokens[id]
        if attr & _ATTR_SPECIAL and not special:
            return b""
        if attr & (_ATTR_SPECIAL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.vocab_type == "spm":
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
        special = not skip_special
        pieces = [self.token_bytes(i, special) for i in ids]
        if remove_space and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        data = b"".join(pieces)
        if self.clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", errors="replace")

    def is_eog(self, id: int) -> bool:
        return id in self.eog_ids

    def is_control(self, id: int) -> bool:
        return bool(self._attrs[id] & ATTR_CONTROL)

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

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

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, bos={self.bos_id}, "
                f"eos={self.eos_id}, add_bos={self.add_bos}, eog={sorted(self.eog_ids)})")


def _clean_spaces(data: bytes) -> bytes:
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


class StreamDecoder:
    """Incremental detokenizer: push(id) returns the text that is complete so far.

    Bytes of a UTF-8 character split across tokens (byte-fallback or byte-level tokens) are held back
    until the character is complete; flush() returns whatever is left (invalid bytes as U+FFFD). Pieces
    are llama_token_to_piece output, concatenated as llama-server streams them (no leading-space removal,
    no clean-up of spaces)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._special = not skip_special
        self._pending = b""

    def push(self, id: int) -> str:
        data = self._pending + self._tok.token_bytes(id, self._special)
        cut = _complete_prefix_len(data)
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


def _complete_prefix_len(data: bytes) -> int:
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
