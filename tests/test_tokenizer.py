"""Tokenizer from GGUF metadata: llama.cpp-exact token ids, detokenization and streaming.

Ground truth: the llama.cpp reference outputs (prompt_tokens / completion_text of every reference
file), plus inline edge cases whose ids were produced by llama.cpp's llama_tokenize (llama-cpp-python
0.3.36, vocab_only) with (add_special, parse_special) = (True, True) and (False, False). Tests needing
the real models skip when the files are absent (SPECULANT_MODELS overrides the model directory).
"""
import os
import time
from pathlib import Path

import pytest

from speculant.errors import ModelFileError
from speculant.gguf.tokenizer import StreamDecoder, Tokenizer, read_gguf_metadata
from speculant.testing.tiny_gguf import tiny_vocab

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))
QWEN_15 = "qwen2.5-coder-1.5b-instruct.gguf"
QWEN_05 = "qwen2.5-coder-0.5b-instruct.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"
REF_MODELS = {  # reference file -> model file
    "qwen2.5-coder-1.5b.raw.json": QWEN_15,
    "qwen2.5-coder-1.5b.public.json": QWEN_15,
    "qwen2.5-coder-0.5b.raw.json": QWEN_05,
    "gemma-3-270m.raw.json": GEMMA,
}


def reference_dir() -> Path | None:
    candidates = [os.environ.get("SPECULANT_REFERENCE"), ROOT / "tests" / "data" / "llamacpp-outputs",
                  ROOT.parent / "shared" / "reference" / "llamacpp-outputs"]
    for c in candidates:
        if c and Path(c).is_dir() and any(Path(c).glob("*.json")):
            return Path(c)
    return None


_TOKENIZERS: dict[str, Tokenizer] = {}
_LOAD_SECONDS: dict[str, float] = {}


def real_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of a real model, loaded once per test session (skips if the file is absent)."""
    path = MODEL_DIR / name
    if not path.exists():
        pytest.skip(f"{path} is absent: run `python scripts/fetch_models.py` (or set SPECULANT_MODELS)")
    if name not in _TOKENIZERS:
        metadata = read_gguf_metadata(str(path))
        t0 = time.perf_counter()
        _TOKENIZERS[name] = Tokenizer.from_metadata(metadata, str(path))
        _LOAD_SECONDS[name] = time.perf_counter() - t0
    return _TOKENIZERS[name]


@pytest.fixture(scope="module")
def qwen():
    return real_tokenizer(QWEN_05)


@pytest.fixture(scope="module")
def gemma():
    return real_tokenizer(GEMMA)


def references(ref_file: str) -> list[dict]:
    import json

    d = reference_dir()
    if d is None or not (d / ref_file).exists():
        pytest.skip(f"llama.cpp reference file {ref_file} is absent (set SPECULANT_REFERENCE)")
    return json.loads((d / ref_file).read_text())["references"]


# ids from llama.cpp: (text, tokenize(add_special=True, parse_special=True), tokenize(False, False))
QWEN_EDGE = [
    ('',
     [],
     []),
    (' ',
     [220],
     [220]),
    ('  ',
     [256],
     [256]),
    ('\n',
     [198],
     [198]),
    ('\n\n\n',
     [1406],
     [1406]),
    ('Hello world',
     [9707, 1879],
     [9707, 1879]),
    (' Hello  world ',
     [21927, 220, 1879, 220],
     [21927, 220, 1879, 220]),
    ('multiple     spaces\tand\ttabs',
     [35673, 257, 12621, 52477, 3244, 3435],
     [35673, 257, 12621, 52477, 3244, 3435]),
    ('line1\n\n\nline4\r\n',
     [1056, 16, 1406, 1056, 19, 319],
     [1056, 16, 1406, 1056, 19, 319]),
    ('1234567890',
     [16, 17, 18, 19, 20, 21, 22, 23, 24, 15],
     [16, 17, 18, 19, 20, 21, 22, 23, 24, 15]),
    ('3.14159 + 2,000,000',
     [18, 13, 16, 19, 16, 20, 24, 488, 220, 17, 11, 15, 15, 15, 11, 15, 15, 15],
     [18, 13, 16, 19, 16, 20, 24, 488, 220, 17, 11, 15, 15, 15, 11, 15, 15, 15]),
    ('emoji \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1e9\U0001f1ea',
     [37523, 90316, 144349, 145375, 61804, 101, 378, 235, 145233, 378, 235, 145665, 11162, 229, 102, 145336],
     [37523, 90316, 144349, 145375, 61804, 101, 378, 235, 145233, 378, 235, 145665, 11162, 229, 102, 145336]),
    ('na\xefve caf\xe9 \u65e5\u672c\u8a9e \u041f\u0440\u0438\u0432\u0435\u0442',
     [3376, 37572, 586, 51950, 75402, 21894, 102819, 79484, 26991, 8178],
     [3376, 37572, 586, 51950, 75402, 21894, 102819, 79484, 26991, 8178]),
    ('combining e\u0301 and NBSP a\xa0b',
     [21873, 5740, 384, 53839, 323, 34979, 4592, 264, 4102, 65],
     [21873, 5740, 384, 53839, 323, 34979, 4592, 264, 4102, 65]),
    ('zero\u200bwidth \ufeffbom',
     [14154, 15692, 3098, 75780, 65, 316],
     [14154, 15692, 3098, 75780, 65, 316]),
    ('<|im_start|>user\nhi<|im_end|>\n',
     [151644, 872, 198, 6023, 151645, 198],
     [27, 91, 318, 4906, 91, 29, 872, 198, 6023, 27, 91, 318, 6213, 91, 397]),
    ('text<|im_end|>more<|endoftext|>',
     [1318, 151645, 6384, 151643],
     [1318, 27, 91, 318, 6213, 91, 29, 6384, 27, 91, 8691, 723, 427, 91, 29]),
    ('<start_of_turn>user\nhi<end_of_turn>\n',
     [27, 2468, 3575, 37274, 29, 872, 198, 6023, 27, 408, 3575, 37274, 397],
     [27, 2468, 3575, 37274, 29, 872, 198, 6023, 27, 408, 3575, 37274, 397]),
    ('<bos><eos><unk>',
     [33177, 436, 1784, 84399, 1784, 3122, 29],
     [33177, 436, 1784, 84399, 1784, 3122, 29]),
    ("don't I'LL we're",
     [15007, 944, 358, 6, 4086, 582, 2299],
     [15007, 944, 358, 6, 4086, 582, 2299]),
    ('    def f(x):\n        return x  # comment\n',
     [262, 707, 282, 2075, 982, 286, 470, 856, 220, 671, 3980, 198],
     [262, 707, 282, 2075, 982, 286, 470, 856, 220, 671, 3980, 198]),
    ('</s> <s> [PAD151665] <unused0>',
     [128247, 366, 82, 29, 508, 43818, 16, 20, 16, 21, 21, 20, 60, 366, 24713, 15, 29],
     [522, 82, 29, 366, 82, 29, 508, 43818, 16, 20, 16, 21, 21, 20, 60, 366, 24713, 15, 29]),
    ('\u2581already \u0120escaped',
     [10417, 223, 45484, 9843, 254, 65826],
     [10417, 223, 45484, 9843, 254, 65826]),
    ('<0x41> byte-looking',
     [27, 15, 87, 19, 16, 29, 4922, 30248],
     [27, 15, 87, 19, 16, 29, 4922, 30248]),
    ('<table><tr><td>1</td></tr></table>',
     [20993, 1784, 376, 1784, 1296, 29, 16, 522, 1296, 1472, 376, 1472, 2005, 29],
     [20993, 1784, 376, 1784, 1296, 29, 16, 522, 1296, 1472, 376, 1472, 2005, 29]),
    ('<tool_call>{"a": 1}</tool_call>',
     [151657, 4913, 64, 788, 220, 16, 92, 151658],
     [151657, 4913, 64, 788, 220, 16, 92, 151658]),
]

GEMMA_EDGE = [
    ('',
     [2],
     []),
    (' ',
     [2, 236743],
     [236743]),
    ('  ',
     [2, 138],
     [138]),
    ('\n',
     [2, 107],
     [107]),
    ('\n\n\n',
     [2, 109],
     [109]),
    ('Hello world',
     [2, 9259, 1902],
     [9259, 1902]),
    (' Hello  world ',
     [2, 26352, 138, 12392, 236743],
     [26352, 138, 12392, 236743]),
    ('multiple     spaces\tand\ttabs',
     [2, 43819, 141, 35220, 255968, 624, 255968, 39218],
     [43819, 141, 35220, 255968, 624, 255968, 39218]),
    ('line1\n\n\nline4\r\n',
     [2, 1257, 236770, 109, 1257, 236812, 251, 107],
     [1257, 236770, 109, 1257, 236812, 251, 107]),
    ('1234567890',
     [2, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771],
     [236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771]),
    ('3.14159 + 2,000,000',
     [2, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 900, 236743, 236778, 236764, 236771, 236771, 236771, 236764, 236771, 236771, 236771],
     [236800, 236761, 236770, 236812, 236770, 236810, 236819, 900, 236743, 236778, 236764, 236771, 236771, 236771, 236764, 236771, 236771, 236771]),
    ('emoji \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1e9\U0001f1ea',
     [2, 67906, 163543, 240493, 242713, 236743, 243874, 237243, 243767, 237243, 244814, 236743, 246841, 245562],
     [67906, 163543, 240493, 242713, 236743, 243874, 237243, 243767, 237243, 244814, 236743, 246841, 245562]),
    ('na\xefve caf\xe9 \u65e5\u672c\u8a9e \u041f\u0440\u0438\u0432\u0435\u0442',
     [2, 1789, 238527, 560, 33443, 33375, 238582, 15745, 8362],
     [1789, 238527, 560, 33443, 33375, 238582, 15745, 8362]),
    ('combining e\u0301 and NBSP a\xa0b',
     [2, 20024, 4049, 545, 238288, 532, 162383, 236791, 496, 432, 398, 236763],
     [20024, 4049, 545, 238288, 532, 162383, 236791, 496, 432, 398, 236763]),
    ('zero\u200bwidth \ufeffbom',
     [2, 13321, 237141, 2690, 39131, 76365],
     [13321, 237141, 2690, 39131, 76365]),
    ('<|im_start|>user\nhi<|im_end|>\n',
     [2, 236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 2202, 236820, 236909, 548, 236779, 643, 111038, 107],
     [236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 2202, 236820, 236909, 548, 236779, 643, 111038, 107]),
    ('text<|im_end|>more<|endoftext|>',
     [2, 1005, 236820, 236909, 548, 236779, 643, 111038, 5576, 236820, 236909, 643, 1340, 1005, 111038],
     [1005, 236820, 236909, 548, 236779, 643, 111038, 5576, 236820, 236909, 643, 1340, 1005, 111038]),
    ('<start_of_turn>user\nhi<end_of_turn>\n',
     [2, 105, 2364, 107, 2202, 106, 107],
     [236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 2202, 236820, 643, 236779, 1340, 236779, 887, 236813, 107]),
    ('<bos><eos><unk>',
     [2, 2, 1, 3],
     [236820, 46757, 1798, 211827, 1798, 4984, 236813]),
    ("don't I'LL we're",
     [2, 13246, 236789, 236745, 564, 236789, 2182, 692, 236789, 500],
     [13246, 236789, 236745, 564, 236789, 2182, 692, 236789, 500]),
    ('    def f(x):\n        return x  # comment\n',
     [2, 140, 2063, 517, 236769, 236781, 1473, 107, 144, 2060, 1123, 138, 236865, 5739, 107],
     [140, 2063, 517, 236769, 236781, 1473, 107, 144, 2060, 1123, 138, 236865, 5739, 107]),
    ('</s> <s> [PAD151665] <unused0>',
     [2, 212, 236743, 203, 870, 67074, 236770, 236810, 236770, 236825, 236825, 236810, 236842, 236743, 6],
     [954, 236751, 236813, 236743, 203, 870, 67074, 236770, 236810, 236770, 236825, 236825, 236810, 236842, 655, 63634, 236771, 236813]),
    ('\u2581already \u0120escaped',
     [2, 3016, 236743, 245237, 80565, 524],
     [3016, 236743, 245237, 80565, 524]),
    ('<0x41> byte-looking',
     [2, 236820, 236771, 236781, 236812, 236770, 236813, 16812, 236772, 18985],
     [236820, 236771, 236781, 236812, 236770, 236813, 16812, 236772, 18985]),
    ('<table><tr><td>1</td></tr></table>',
     [2, 168, 173, 175, 236770, 183, 181, 176],
     [168, 173, 175, 236770, 183, 181, 176]),
    ('<tool_call>{"a": 1}</tool_call>',
     [2, 236820, 13205, 236779, 6639, 236813, 14937, 236746, 1083, 236743, 236770, 17001, 13205, 236779, 6639, 236813],
     [236820, 13205, 236779, 6639, 236813, 14937, 236746, 1083, 236743, 236770, 17001, 13205, 236779, 6639, 236813]),
]

ROUND_TRIP = [t for t, _, _ in QWEN_EDGE] + [
    "a", "x" * 300, " " * 17, "\n" * 9, "\t \t", "0", "007", "-1e-10", "a\u0300\u0301\u0302", "\U0001f9d1\u200d\U0001f4bb",
    "\u202eright-to-left", "\x00\x01\x7f", "\r", "\u2028\u2029", "\U00020000 \U000f0000", "\ufffd", "mixed<|im_end|>in<eos>the middle",
]


# ---------------------------------------------------------------------------------------------------
# llama.cpp reference outputs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref_file", sorted(REF_MODELS))
def test_reference_prompts_encode_exactly(ref_file):
    tok = real_tokenizer(REF_MODELS[ref_file])
    for ref in references(ref_file):
        text, want = ref["prompt_text"], ref["prompt_tokens"]
        # The references list the prompt without the BOS that the model adds (llama-server's /tokenize
        # default add_special=false): for Gemma (add_bos) encode() puts BOS in front of exactly those ids.
        assert tok.encode(text) == [tok.bos_id] * tok.add_bos + want, ref["name"]
        assert tok.encode(text, add_special=False, parse_special=True) == want, ref["name"]


@pytest.mark.parametrize("ref_file", sorted(REF_MODELS))
def test_reference_completions_decode_exactly(ref_file):
    tok = real_tokenizer(REF_MODELS[ref_file])
    for ref in references(ref_file):
        assert tok.decode(ref["completion_tokens"]) == ref["completion_text"], ref["name"]
        stream = StreamDecoder(tok)
        pieces = [stream.push(t) for t in ref["completion_tokens"]]
        assert "".join(pieces) + stream.flush() == ref["completion_text"], ref["name"]


# ---------------------------------------------------------------------------------------------------
# edge cases checked against llama.cpp
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,with_special,plain", QWEN_EDGE, ids=[ascii(t)[:30] for t, _, _ in QWEN_EDGE])
def test_qwen_edge_cases_match_llamacpp(qwen, text, with_special, plain):
    assert qwen.encode(text, add_special=True, parse_special=True) == with_special
    assert qwen.encode(text, add_special=False, parse_special=False) == plain


@pytest.mark.parametrize("text,with_special,plain", GEMMA_EDGE, ids=[ascii(t)[:30] for t, _, _ in GEMMA_EDGE])
def test_gemma_edge_cases_match_llamacpp(gemma, text, with_special, plain):
    assert gemma.encode(text, add_special=True, parse_special=True) == with_special
    assert gemma.encode(text, add_special=False, parse_special=False) == plain


def test_qwen_1_5b_and_0_5b_share_the_vocabulary(qwen):
    big = real_tokenizer(QWEN_15)
    text = GEMMA_EDGE[11][0] + "<|im_start|>x<|im_end|>"
    assert big.encode(text) == qwen.encode(text)
    assert big.eog_ids == qwen.eog_ids


def test_gemma_hand_checked(gemma):
    """Read off the vocabulary by hand: BOS first, '▁' for a space inside a piece, user-defined
    whitespace tokens ('    ', '\\n') cut out before the merges, control tokens parsed, byte fallback."""
    cases = [
        ("Hello world", ["<bos>", "Hello", "▁world"], [2, 9259, 1902]),
        ("    def f(x):\n", ["<bos>", "    ", "def", "▁f", "(", "x", "):", "\n"], [2, 140, 2063, 517, 236769, 236781, 1473, 107]),
        ("<start_of_turn>user\nhi<end_of_turn>\n", ["<bos>", "<start_of_turn>", "user", "\n", "hi", "<end_of_turn>", "\n"],
         [2, 105, 2364, 107, 2202, 106, 107]),
        ("\U00020000", ["<bos>", "<0xF0>", "<0xA0>", "<0x80>", "<0x80>"], [2, 478, 398, 366, 366]),
        # the one Gemma piece with a '▁' after another character: words are not cut apart inside it
        ("a> </b", ["<bos>", "a", ">\u2581</", "b"], [2, 236746, 107068, 236763]),
    ]
    for text, pieces, ids in cases:
        got = gemma.encode(text)
        assert [gemma.token_text(i) for i in got] == pieces, text
        assert got == ids, text
        assert gemma.decode(got[1:]) == text
    assert gemma.decode([2, 9259, 1902]) == "<bos>Hello world"
    assert gemma.bos_id == 2 and gemma.eos_id == 1 and gemma.add_bos is True and gemma.add_space_prefix is False
    assert gemma.n_vocab == 262144


def test_special_token_text_only_parsed_when_asked(qwen, gemma):
    assert qwen.encode("a<|im_end|>b", parse_special=True) == [64, 151645, 65]
    assert 151645 not in qwen.encode("a<|im_end|>b", parse_special=False)
    # user-defined tokens are always cut out (llama.cpp): <tool_call> for Qwen, '<table>' for Gemma
    assert qwen.encode("<tool_call>", parse_special=False) == [151657]
    assert gemma.encode("<table>", add_special=False, parse_special=False) == [168]
    assert gemma.encode("<end_of_turn>", add_special=False, parse_special=True) == [106]
    assert 106 not in gemma.encode("<end_of_turn>", add_special=False, parse_special=False)


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_round_trips(which, request):
    tok = request.getfixturevalue(which)
    for text in ROUND_TRIP + [t for t, _, _ in GEMMA_EDGE]:
        if which == "gemma" and "\u2581" in text:
            continue  # SentencePiece spells a space '▁': a literal '▁' in the text comes back as ' '
        for parse_special in (False, True):
            ids = tok.encode(text, add_special=False, parse_special=parse_special)
            assert tok.decode(ids) == text, (ascii(text), parse_special)
        ids = tok.encode(text)
        assert ids[:tok.add_bos] == [tok.bos_id] * tok.add_bos
        assert tok.decode(ids[tok.add_bos:]) == text


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_stream_decoder_never_splits_a_character(which, request):
    tok = request.getfixturevalue(which)
    text = "emoji \U0001f600\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U00020000\u65e5\u672c\u8a9e caf\xe9 \u2603\n"
    ids = tok.encode(text, add_special=False)
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == text
    assert any(p == "" for p in pieces)  # some tokens carried only part of a character


def test_eog_ids_as_llamacpp(qwen, gemma):
    # llama.cpp: eos, eot, the FIM pad/repo/file-sep tokens and tokens named like end-of-turn markers
    # (its list includes '</s>', which both vocabularies happen to contain)
    assert qwen.eog_ids == {151643, 151645, 151662, 151663, 151664, 128247}
    assert {qwen.token_text(i) for i in qwen.eog_ids} == {
        "<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "</s>"}
    assert qwen.eot_id == 151645 and qwen.eos_id == 151645 and qwen.bos_id == 151643 and not qwen.add_bos
    assert gemma.eog_ids == {1, 106, 212}
    assert gemma.eot_id == 106


def test_unused_and_control_tokens_detokenize_like_llamacpp(qwen):
    assert qwen.decode([151665]) == ""  # [PAD151665] is UNUSED: no text at all
    assert qwen.decode([151644, 872]) == "<|im_start|>user"
    assert qwen.decode([151644, 872], skip_special=True) == "user"
    assert qwen.token_bytes(151657, special=False) == b"<tool_call>"  # user-defined: always rendered
    assert qwen.token_text(9707) == "Hello" and qwen.token_text(1879) == "\u0120world"


def test_loading_is_fast(qwen, gemma):
    """Tokenizer.from_metadata for the 262k-token Gemma vocabulary takes ~0.15 s, Qwen's ~0.4 s."""
    assert _LOAD_SECONDS[GEMMA] < 3.0
    assert _LOAD_SECONDS[QWEN_05] < 3.0


# ---------------------------------------------------------------------------------------------------
# synthetic vocabularies (no model files needed)
# ---------------------------------------------------------------------------------------------------
def test_unsupported_tokenizer_model_names_path_and_model():
    md = dict(tiny_vocab("gpt2"), **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelFileError, match=r"some/model\.gguf.*'bert'"):
        Tokenizer.from_metadata(md, "some/model.gguf")
    with pytest.raises(ModelFileError, match="no tokenizer"):
        Tokenizer.from_metadata({}, "x.gguf")
    md = dict(tiny_vocab("gpt2"), **{"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ModelFileError, match="no-such-pre"):
        Tokenizer.from_metadata(md, "x.gguf")
    md = dict(tiny_vocab("gpt2"))
    del md["tokenizer.ggml.merges"]
    with pytest.raises(ModelFileError, match="merges"):
        Tokenizer.from_metadata(md, "x.gguf")
    md = dict(tiny_vocab("llama"))
    md["tokenizer.ggml.tokens"] = ["a", "b", "a"]
    md["tokenizer.ggml.scores"] = [0.0] * 3
    md["tokenizer.ggml.token_type"] = [1] * 3
    with pytest.raises(ModelFileError, match="duplicate"):
        Tokenizer.from_metadata(md, "x.gguf")


@pytest.mark.parametrize("kind, key, value, got", [
    ("gpt2", "tokenizer.ggml.merges", 7, "an int"),
    ("gpt2", "tokenizer.ggml.merges", ["a b", 3], "an array holding an int"),
    ("gpt2", "tokenizer.ggml.token_type", 1, "an int"),
    ("gpt2", "tokenizer.ggml.tokens", "abc", "a str"),
    ("llama", "tokenizer.ggml.scores", 0.5, "a float"),
    ("llama", "tokenizer.ggml.token_type", ["1"] * 400, "an array holding a str"),
    ("llama", "tokenizer.ggml.tokens", [1, 2, 3], "an array holding an int"),
])
def test_metadata_of_the_wrong_shape_is_one_line(kind, key, value, got):
    """A scalar where an array belongs, or an array of the wrong type, names the key: it raised
    TypeError or AttributeError inside the tokenizer before."""
    md = dict(tiny_vocab(kind), **{key: value})
    with pytest.raises(ModelFileError, match=rf"x\.gguf: metadata '{key}' must be an array of \w+, got {got}$"):
        Tokenizer.from_metadata(md, "x.gguf")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tiny_vocabularies_round_trip(kind):
    tok = Tokenizer.from_metadata(tiny_vocab(kind), "tiny.gguf")
    text = "Each token is a number, and the tokenizer turns numbers back into text.\n    def f(x):  return x\n"
    for s in (text, "", " ", "  \n\n", "caf\xe9 \U0001f600", "\u65e5\u672c"):
        ids = tok.encode(s, add_special=False)
        assert tok.decode(ids) == s
    ids = tok.encode(text)
    assert (ids[0] == tok.bos_id) == tok.add_bos
    assert len(ids) < len(text) / 2  # merges happen
    specials = "<|im_start|>" if kind == "gpt2" else "<start_of_turn>"
    sid = tok.encode(specials, add_special=False)
    assert len(sid) == 1 and tok.is_control(sid[0])
    assert len(tok.encode(specials, add_special=False, parse_special=False)) > 1


def test_spm_byte_fallback_and_space_prefix():
    md = dict(tiny_vocab("llama"))
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("\xe9", add_special=False)  # not in the tiny vocabulary: UTF-8 bytes C3 A9
    assert [tok.token_text(i) for i in ids] == ["<0xC3>", "<0xA9>"]
    stream = StreamDecoder(tok)
    assert stream.push(ids[0]) == "" and stream.pending == b"\xc3"
    assert stream.push(ids[1]) == "\xe9"
    assert stream.push(ids[0]) == "" and stream.flush() == "\ufffd"  # an incomplete character at the end

    md["tokenizer.ggml.add_space_prefix"] = True  # Llama-2 style: a space in front of the text
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("the end", add_special=False)
    assert tok.token_text(ids[0]).startswith("\u2581")
    assert tok.decode(ids) == "the end"  # llama_detokenize drops that space again
    bos_ids = tok.encode("the end")
    assert tok.decode(bos_ids, skip_special=True) == " the end"  # ... but not after a removed BOS, as llama.cpp
    # after a special token the text gets the space prefix again (llama.cpp's is_prev_special)
    turn = tok.encode("<start_of_turn>", add_special=False)
    assert tok.encode("<start_of_turn>the end", add_special=False) == turn + ids


def test_eog_detection_by_text():
    gpt2 = Tokenizer.from_metadata(tiny_vocab("gpt2"))
    assert {gpt2.token_text(i) for i in gpt2.eog_ids} == {"<|im_end|>", "<|endoftext|>"}
    spm = Tokenizer.from_metadata(tiny_vocab("llama"))
    assert {spm.token_text(i) for i in spm.eog_ids} == {"<eos>", "<end_of_turn>"}
    assert spm.eot_id == spm.encode("<end_of_turn>", add_special=False)[0]


def test_read_gguf_metadata_matches_open_gguf(tmp_path):
    from speculant.gguf.file import open_gguf
    from speculant.testing.tiny_gguf import write_tiny_model

    for kind in ("gpt2", "llama"):
        path = write_tiny_model(tmp_path / f"{kind}.gguf", "qwen2" if kind == "gpt2" else "gemma3", tokenizer=kind)
        full = open_gguf(path).metadata
        assert read_gguf_metadata(str(path), prefixes=()) == full
        assert read_gguf_metadata(str(path)) == {k: v for k, v in full.items() if k.startswith(("tokenizer.", "general."))}
        tok = Tokenizer.from_gguf(path)
        assert tok.encode("hello world") == Tokenizer.from_metadata(full).encode("hello world")


def test_from_gguf_errors_name_the_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelFileError, match="bad.gguf.*not a GGUF"):
        Tokenizer.from_gguf(bad)
    from speculant.testing.tiny_gguf import write_tiny_model

    good = write_tiny_model(tmp_path / "t.gguf", "qwen2", tokenizer="gpt2")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(good).read_bytes()[:5000])
    with pytest.raises(ModelFileError, match="cut.gguf"):
        Tokenizer.from_gguf(cut)


def test_clean_up_spaces_for_gpt2_style_pre_tokenizers():
    """llama_detokenize's clean_spaces passes (on for 'gpt-2'/'default'/'llama3', off for 'qwen2')."""
    tok = Tokenizer.from_metadata(dict(tiny_vocab("gpt2"), **{"tokenizer.ggml.pre": "gpt-2"}))
    assert tok.clean_spaces
    text = "Hello , world ! It ' s ok . I 'm sure you 're right , we 've done it ; we 'll see 't"
    assert tok.decode(tok.encode(text)) == "Hello, world! It's ok. I'm sure you're right, we've done it ; we 'll see 't"
    assert not Tokenizer.from_metadata(tiny_vocab("gpt2")).clean_spaces
