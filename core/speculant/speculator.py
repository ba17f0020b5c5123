"""Building the speculator chain named by ``--spec-type a,b,c`` from the registered plugins."""
from __future__ import annotations

from typing import Any, Mapping

import attrs

from speculant.errors import SpeculantError
from speculant.plugins import Registry, default_registry


@attrs.frozen
class SpeculatorConfig:
    """What a speculator class is built with: ``cls(config)``.

    ``options`` holds every parsed flag (plugins add theirs through ``speculant_add_options``);
    ``target`` is the loaded target model (its tokenizer and vocabulary); ``draft_model`` the
    path given with ``-md``; ``backend`` the device name."""

    spec_type: str
    options: Mapping[str, Any] = attrs.field(factory=dict)
    target: Any = None
    draft_model: str | None = None
    backend: str = "cpu"

    def option(self, name: str, default: Any) -> Any:
        value = self.options.get(name)
        return default if value is None else value


def parse_spec_types(text: str | None, registry: Registry | None = None) -> list[str]:
    """'ngram-simple,ngram-mod' -> names in the user's order; 'none' or empty -> []."""
    registry = registry or default_registry()
    names = [n.strip() for n in (text or "").split(",") if n.strip() and n.strip() != "none"]
    known = registry.names("speculator")
    for n in names:
        if n not in known:
            raise SpeculantError(f"unknown spec type '{n}' (available: {', '.join(known) or 'none installed'})")
    if len(set(names)) != len(names):
        raise SpeculantError(f"spec type listed twice in '{text}'")
    return names


def build_speculators(names: list[str], options: Mapping[str, Any], target: Any = None, draft_model: str | None = None,
                      backend: str = "cpu", registry: Registry | None = None) -> list[Any]:
    registry = registry or default_registry()
    out = []
    for name in names:
        cls = registry.get("speculator", name)
        spec = cls(SpeculatorConfig(name, dict(options), target, draft_model, backend))
        spec.spec_type = name
        out.append(spec)
    return out
