"""The vocabulary and llama.cpp's rules around it: validation, flags, special ids, per-model rules.

Everything here is read once from the GGUF metadata ('tokenizer.ggml.*'), in the order llama.cpp's
llama_vocab::load applies it:

1. read_vocabulary: the vocabulary kind, the token texts (validated), their types as attribute bits
   and the SentencePiece scores;
2. read_settings: the flags (add BOS/EOS, space prefix, ...) and special ids, llama.cpp's defaults
   per vocabulary kind and BPE pre-tokenizer first, then the metadata;
3. mark_special_tokens: the special tokens llama.cpp recognizes by their text (end of turn, FIM,
   end of generation) and the per-model attribute fixes.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import attrs

from speculant.errors import ModelFileError
from speculant.gguf.file import plain_array

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

ATTR_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL  # rendered only when detokenizing with special=True; parsed only with parse_special
ATTR_CUT = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # cut out of the text before the merges

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}

# Token texts that llama.cpp treats as end-of-turn / end-of-generation (llama-vocab.cpp, vocab load).
EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
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
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

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

PRE_TYPES: dict[str, tuple[list[str], dict[str, bool]]] = {}


def _pre(names: Iterable[str], regexes: list[str], **flags: bool) -> None:
    for name in names:
        PRE_TYPES[name] = (regexes, flags)


_pre(["default"], [r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
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


# ---------------------------------------------------------------------------------------------------
# 1. the vocabulary
# ---------------------------------------------------------------------------------------------------
@attrs.define(eq=False)
class Vocabulary:
    """The token texts of one GGUF vocabulary and their attributes (attrs may still be adjusted by
    mark_special_tokens)."""

    model: str  # 'tokenizer.ggml.model': 'llama' or 'gpt2'
    vocab_type: str  # 'spm' or 'bpe'
    pre: str  # 'tokenizer.ggml.pre' ('default' when absent)
    tokens: list[str]  # id -> text; empty texts named '[EMPTY_<id>]' as llama.cpp does
    index: dict[str, int]  # text -> id
    attrs: list[int]  # id -> ATTR_* bits
    scores: list[float]  # id -> SentencePiece score (empty for BPE)

    @property
    def n(self) -> int:
        return len(self.tokens)


def array_of(metadata: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> list | None:
    """metadata[key] when it is an array of `kind` (None when absent); anything else, a scalar
    where an array belongs included, is one ModelFileError naming the key."""
    value = plain_array(metadata.get(key))
    if value is None:
        return None
    ok = lambda x: isinstance(x, kind) and not isinstance(x, bool)
    if isinstance(value, (list, tuple)) and all(map(ok, value)):
        return value
    what = {str: "strings", int: "integers"}.get(kind, "numbers")
    a = lambda x: ("an " if type(x).__name__[0] in "aeiou" else "a ") + type(x).__name__
    got = f"an array holding {a(next(x for x in value if not ok(x)))}" if isinstance(value, (list, tuple)) else a(value)
    raise ModelFileError(f"{where}: metadata '{key}' must be an array of {what}, got {got}")


def read_vocabulary(metadata: dict[str, Any], where: str) -> Vocabulary:
    """The vocabulary kind, token texts, types and scores, checked; ModelFileError names `where`."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFileError(f"{where}: no tokenizer in the file (metadata key 'tokenizer.ggml.model' is missing)")
    model = str(model)
    vocab_type = {"llama": "spm", "gpt2": "bpe"}.get(model)
    if vocab_type is None:
        raise ModelFileError(
            f"{where}: tokenizer model '{model}' is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece)")
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")

    tokens = array_of(metadata, "tokenizer.ggml.tokens", str, where)
    if not tokens:
        raise ModelFileError(f"{where}: tokenizer vocabulary 'tokenizer.ggml.tokens' is missing or empty")
    n = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp does
    index = {t: i for i, t in enumerate(tokens)}
    if len(index) != n:
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise ModelFileError(f"{where}: duplicate token {dup!r} in the tokenizer vocabulary")

    scores = array_of(metadata, "tokenizer.ggml.scores", (int, float), where)
    if scores is not None and len(scores) < n:
        raise ModelFileError(f"{where}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    types = array_of(metadata, "tokenizer.ggml.token_type", int, where)
    if types is not None and len(types) < n:
        raise ModelFileError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    if types is None:
        token_attrs = [ATTR_NORMAL] * n
    else:
        get = _TYPE_TO_ATTR.get
        token_attrs = [get(t, ATTR_UNDEFINED) for t in types[:n]]
    if vocab_type == "spm":
        spm_scores = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
    else:
        spm_scores = []
    return Vocabulary(model, vocab_type, pre, tokens, index, token_attrs, spm_scores)


# ---------------------------------------------------------------------------------------------------
# 2. flags and special ids
# ---------------------------------------------------------------------------------------------------
@attrs.define(eq=False)
class VocabSettings:
    """How text becomes tokens and back, beyond the token texts: llama.cpp's defaults per vocabulary
    kind (and BPE pre-tokenizer), overridden by the metadata."""

    add_space_prefix: bool
    add_bos: bool
    add_eos: bool
    clean_spaces: bool  # detokenization's clean_up_tokenization_spaces
    ignore_merges: bool  # BPE: a word that is a token is taken whole
    regexes: list[str]  # BPE pre-tokenizer regexes (empty for SPM)
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    sep_id: int | None
    eot_id: int | None
    eom_id: int | None
    fim_ids: dict[str, int | None]  # fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep
    eog_ids: frozenset[int] = frozenset()  # set by mark_special_tokens


def _meta_id(metadata: dict, key: str) -> int | None:
    v = metadata.get(key)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def read_settings(metadata: dict[str, Any], vocab: Vocabulary, where: str) -> VocabSettings:
    """The flags and special ids; ModelFileError for an unknown BPE pre-tokenizer or a BOS/EOS that
    the file asks to add but does not name."""
    n = vocab.n
    if vocab.vocab_type == "spm":
        bos, eos, unk = 1, 2, 0
        regexes: list[str] = []
        add_space_prefix, add_bos, add_eos, clean_spaces, ignore_merges = True, True, False, False, False
    else:
        bos, eos, unk = 11, 11, None
        if vocab.pre not in PRE_TYPES:
            raise ModelFileError(
                f"{where}: BPE pre-tokenizer '{vocab.pre}' (tokenizer.ggml.pre) is not supported; supported: "
                + ", ".join(sorted(PRE_TYPES)))
        regexes, flags = PRE_TYPES[vocab.pre]
        add_space_prefix, add_bos, add_eos = False, flags.get("add_bos", False), False
        clean_spaces, ignore_merges = flags.get("clean_spaces", True), flags.get("ignore_merges", False)
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_prefix))

    def special(key: str, default: int | None) -> int | None:
        if default is not None and not 0 <= default < n:
            default = None
        v = _meta_id(metadata, f"tokenizer.ggml.{key}")
        return v if v is not None and 0 <= v < n else default

    fim = {k: special(f"{k}_token_id", None) for k in FIM_TEXTS}
    for old, new in (("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid")):
        if fim[new] is None:
            fim[new] = special(f"{old}_token_id", None)
    s = VocabSettings(
        add_space_prefix, add_bos, add_eos, clean_spaces, ignore_merges, regexes,
        bos_id=special("bos_token_id", bos), eos_id=special("eos_token_id", eos), unk_id=special("unknown_token_id", unk),
        pad_id=special("padding_token_id", None), sep_id=special("seperator_token_id", None),
        eot_id=special("eot_token_id", None), eom_id=special("eom_token_id", None), fim_ids=fim)
    if "tokenizer.ggml.add_bos_token" in metadata:
        s.add_bos = bool(metadata["tokenizer.ggml.add_bos_token"])
    if "tokenizer.ggml.add_eos_token" in metadata:
        s.add_eos = bool(metadata["tokenizer.ggml.add_eos_token"])
    if s.add_bos and s.bos_id is None:
        raise ModelFileError(f"{where}: tokenizer.ggml.add_bos_token is true, but the BOS token id is not set")
    if s.add_eos and s.eos_id is None:
        raise ModelFileError(f"{where}: tokenizer.ggml.add_eos_token is true, but the EOS token id is not set")
    return s


# ---------------------------------------------------------------------------------------------------
# 3. special tokens found by text, end of generation, per-model attributes
# ---------------------------------------------------------------------------------------------------
def mark_special_tokens(metadata: dict[str, Any], vocab: Vocabulary, s: VocabSettings) -> None:
    """llama.cpp's special-token rules, applied to `vocab.attrs` and `s` in place."""
    _find_by_text(vocab, s)
    cut = [i for i, a in enumerate(vocab.attrs) if a & ATTR_CUT]
    for i in cut:  # control tokens named "unused..." are unused
        if vocab.attrs[i] & ATTR_CONTROL and "unused" in vocab.tokens[i]:
            vocab.attrs[i] |= ATTR_UNUSED
    s.eog_ids = _end_of_generation(vocab, s)
    _strip_rules(metadata, vocab, cut)


def _find(vocab: Vocabulary, texts: Sequence[str]) -> int | None:
    for t in texts:
        i = vocab.index.get(t)
        if i is not None:
            return i
    return None


def _find_by_text(vocab: Vocabulary, s: VocabSettings) -> None:
    """End-of-turn, end-of-message and FIM ids the metadata does not name, found by their text (and
    made control tokens)."""
    if s.eot_id is None:
        s.eot_id = _find(vocab, EOT_TEXTS)
        if s.eot_id is not None:
            vocab.attrs[s.eot_id] |= ATTR_CONTROL
    if s.eom_id is None:
        s.eom_id = _find(vocab, EOM_TEXTS)
        if s.eom_id is not None:
            vocab.attrs[s.eom_id] |= ATTR_CONTROL
    for k, texts in FIM_TEXTS.items():
        if s.fim_ids[k] is None:
            i = s.fim_ids[k] = _find(vocab, texts)
            if i is not None:
                vocab.attrs[i] |= ATTR_CONTROL


def _end_of_generation(vocab: Vocabulary, s: VocabSettings) -> frozenset[int]:
    attrs_, index, tokens = vocab.attrs, vocab.index, vocab.tokens
    eog = {i for i in (s.fim_ids["fim_pad"], s.fim_ids["fim_rep"], s.fim_ids["fim_sep"]) if i is not None}
    for t in EOG_TEXTS:
        i = index.get(t)
        if i is not None:
            eog.add(i)
            attrs_[i] |= ATTR_CONTROL
    for t in ALWAYS_RENDERED:
        i = index.get(t)
        if i is not None:
            attrs_[i] = ATTR_USER_DEFINED
    eog.update(i for i in (s.eos_id, s.eot_id, s.eom_id) if i is not None)
    texts_eog = {tokens[i]: i for i in eog}
    call = "<|call|>" in texts_eog or "<|calls|>" in texts_eog
    if "<|end|>" in texts_eog and (("<|return|>" in texts_eog and call) or (call and "<|flush|>" in texts_eog)):
        # gpt-oss: <|end|> ends a message, not the generation
        eog.discard(texts_eog["<|end|>"])
        attrs_[texts_eog["<|end|>"]] = ATTR_USER_DEFINED
    if "<|tool_response>" in texts_eog and "</s>" in texts_eog:
        eog.discard(texts_eog["</s>"])
        attrs_[texts_eog["</s>"]] = ATTR_NORMAL
    return frozenset(eog)


def _strip_rules(metadata: dict[str, Any], vocab: Vocabulary, cut: list[int]) -> None:
    """Per-token strip attributes that llama.cpp sets by model name (`cut`: the special tokens as they
    were before the end-of-generation rules)."""
    attrs_, index = vocab.attrs, vocab.index
    name = str(metadata.get("general.name", "")).lower()
    if any(s in vocab.pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in str(metadata.get("general.architecture", "")) for s in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in index:
            attrs_[index["<mask>"]] |= ATTR_LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i in cut:
            attrs_[i] |= ATTR_RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in index:
                attrs_[index[t]] = attrs_[index[t]] | ATTR_RSTRIP if on else attrs_[index[t]] & ~ATTR_RSTRIP


def chat_template_of(metadata: dict[str, Any]) -> str | None:
    """The file's chat template; llama.cpp falls back to the tool-use one (then to ChatML, see
    Tokenizer.apply_chat_template)."""
    return metadata.get("tokenizer.chat_template") or metadata.get("tokenizer.chat_template.tool_use") or None
