"""Chat templates (the Jinja source in 'tokenizer.chat_template'), rendered as HF transformers does.

The environment mirrors transformers' `apply_chat_template`: a sandboxed Jinja2 environment with
trim_blocks and lstrip_blocks, the loopcontrols extension, a `{% generation %}` block that just renders
its body, a `tojson` filter that keeps non-ASCII characters, and the globals `raise_exception` and
`strftime_now`. Template problems become ChatTemplateError, a SpeculantError (one clear line).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from speculant.errors import SpeculantError

# What llama.cpp uses when the model file has no chat template (common/chat.cpp, CHATML_TEMPLATE_SRC).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)


class ChatTemplateError(SpeculantError):
    """The chat template does not compile, or it rejected the messages (raise_exception)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (used by transformers to mark assistant turns)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"chat template does not compile{line}: {e.message or e}") from None


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "", **extra: Any) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) with the Jinja chat `template`.

    `extra` become further template variables (tools, documents, enable_thinking, ...)."""
    import jinja2

    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **extra)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        raise ChatTemplateError(f"chat template failed on these messages ({type(e).__name__}: {e})") from None
