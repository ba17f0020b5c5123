"""Chat templates: HF-transformers-style Jinja rendering, and the GGUF's own template against llama.cpp.

The public workloads rendered with Qwen2.5-Coder's template must equal, character for character, the
prompt_text llama.cpp produced for them (qwen2.5-coder-1.5b.public.json), and tokenize to its prompt_tokens.
"""
import datetime
import json
import os
from pathlib import Path

import pytest

from speculant.errors import SpeculantError
from speculant.gguf.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat
from speculant.gguf.tokenizer import Tokenizer, read_gguf_metadata
from speculant.testing.tiny_gguf import tiny_vocab

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))
USER = [{"role": "user", "content": "hi"}]


def _first_existing(*candidates) -> Path | None:
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


_TOKENIZERS: dict[str, Tokenizer] = {}


def real_tokenizer(name: str) -> Tokenizer:
    path = MODEL_DIR / name
    if not path.exists():
        pytest.skip(f"{path} is absent: run `python scripts/fetch_models.py` (or set SPECULANT_MODELS)")
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = Tokenizer.from_metadata(read_gguf_metadata(str(path)), str(path))
    return _TOKENIZERS[name]


# ---------------------------------------------------------------------------------------------------
# the rendering environment
# ---------------------------------------------------------------------------------------------------
def test_chatml_render_and_generation_prompt():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert render_chat(CHATML_TEMPLATE, msgs) == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(CHATML_TEMPLATE, msgs, add_generation_prompt=False).endswith("hi<|im_end|>\n")
    assert render_chat(CHATML_TEMPLATE, []) == "<|im_start|>assistant\n"


def test_trim_and_lstrip_blocks_as_transformers():
    tpl = "{% for m in messages %}\n  {% if m.role == 'user' %}\n  [{{ m.content }}]\n  {% endif %}\n{% endfor %}"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert render_chat(tpl, msgs) == "  [a]\n  [c]\n"


def test_variables_filters_and_globals():
    tpl = "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ extra_flag }}|{{ strftime_now('%Y') }}"
    out = render_chat(tpl, USER, bos_token="<s>", eos_token="</s>", tools=[{"name": "f", "d": "caf\xe9 \u65e5"}], extra_flag=True)
    year = datetime.datetime.now().year
    assert out in (f'<s>|</s>|[{{"name": "f", "d": "caf\xe9 \u65e5"}}]|True|{y}' for y in (year, year + 1))  # non-ASCII kept
    assert render_chat("{{ x | tojson(indent=2) }}", USER, x={"a": [1]}) == '{\n  "a": [\n    1\n  ]\n}'
    assert render_chat("{{ x | tojson(sort_keys=true) }}", USER, x={"b": 1, "a": 2}) == '{"a": 2, "b": 1}'


def test_raise_exception_is_a_user_facing_error():
    tpl = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    assert render_chat(tpl, USER) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user") as e:
        render_chat(tpl, [{"role": "assistant", "content": "x"}])
    assert isinstance(e.value, SpeculantError)


def test_generation_block_and_loop_controls():
    tpl = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
           "{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}")
    msgs = [{"role": "user", "content": str(i)} for i in range(5)]
    assert render_chat(tpl, msgs) == "<0><1>"
    assert render_chat("{% for i in range(4) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}", USER) == "023"


def test_bad_templates_and_sandbox():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", USER)
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[0].content.__class__.__mro__[1].__subclasses__() }}", USER)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError):  # immutable sandbox: the template cannot change the messages
        render_chat("{% set _ = messages.append(1) %}", msgs)
    assert msgs == [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[0]['content'] + 1 }}", USER)


def test_tiny_vocab_templates_through_the_tokenizer():
    qwenish = Tokenizer.from_metadata(tiny_vocab("gpt2"))
    assert qwenish.apply_chat_template(USER) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gemmaish = Tokenizer.from_metadata(tiny_vocab("llama"))
    # the template starts with {{ bos_token }}; encode() adds BOS itself, so (as llama.cpp) it is removed here
    text = gemmaish.apply_chat_template([{"role": "system", "content": "Be brief."}] + USER)
    assert text == "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = gemmaish.encode(text)
    assert ids[0] == gemmaish.bos_id and ids.count(gemmaish.bos_id) == 1
    no_template = dict(tiny_vocab("gpt2"))
    del no_template["tokenizer.chat_template"]
    assert Tokenizer.from_metadata(no_template).apply_chat_template(USER, add_generation_prompt=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"  # ChatML when the file has no template, as llama.cpp


# ---------------------------------------------------------------------------------------------------
# real templates
# ---------------------------------------------------------------------------------------------------
def _public_cases():
    workloads = _first_existing(os.environ.get("SPECULANT_WORKLOADS"), ROOT / "tests" / "data" / "workloads-public.json",
                                ROOT.parent / "shared" / "bench" / "workloads" / "public.json")
    refs = _first_existing(
        os.environ.get("SPECULANT_REFERENCE") and Path(os.environ["SPECULANT_REFERENCE"]) / "qwen2.5-coder-1.5b.public.json",
        ROOT / "tests" / "data" / "llamacpp-outputs" / "qwen2.5-coder-1.5b.public.json",
        ROOT.parent / "shared" / "reference" / "llamacpp-outputs" / "qwen2.5-coder-1.5b.public.json")
    if workloads is None or refs is None:
        pytest.skip("public workloads or the llama.cpp reference outputs are absent (shared/ not beside the repo)")
    by_name = {w["name"]: w for w in json.loads(workloads.read_text())}
    cases = [(by_name[r["name"]], r) for r in json.loads(refs.read_text())["references"] if r["name"] in by_name]
    assert cases
    return cases


def test_qwen_template_renders_public_workloads_exactly_as_llamacpp():
    tok = real_tokenizer("qwen2.5-coder-1.5b-instruct.gguf")
    for workload, ref in _public_cases():
        text = tok.apply_chat_template(workload["messages"])
        assert text == ref["prompt_text"], ref["name"]
        assert tok.encode(text) == ref["prompt_tokens"], ref["name"]


def test_qwen_template_default_system_prompt_and_tools():
    tok = real_tokenizer("qwen2.5-coder-0.5b-instruct.gguf")
    assert tok.apply_chat_template(USER) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    msgs = USER + [{"role": "assistant", "content": "",
                    "tool_calls": [{"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
                   {"role": "tool", "content": "12:00"}]
    out = tok.apply_chat_template(msgs, tools=tools)
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in out
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>' in out
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in out


def test_gemma_file_has_no_template_so_chatml_is_used():
    tok = real_tokenizer("gemma-3-270m-q4_k_m.gguf")
    assert tok.chat_template is None
    assert tok.apply_chat_template(USER) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
