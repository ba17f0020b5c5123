"""The hook specifications: the whole contract between the core and its plugins.

Two groups, both under the pluggy project name ``speculant``:

* Discovery hooks, called once at start-up on every installed plugin (entry-point group
  ``speculant``). A plugin registers classes by name through the ``register`` callback.
* Speculator lifecycle hooks, called by the engine on the speculators of the active chain
  (``--spec-type a,b,c``). Each speculator object implements them as methods marked with
  ``speculant.hookimpl``; the engine keeps one small plugin manager per chain, so a call
  reaches only the chain's speculators, in the user's order.
"""
from __future__ import annotations

from typing import Any, Callable

import pluggy

from speculant.types import Draft, DraftLimits, SequenceView

hookspec = pluggy.HookspecMarker("speculant")
hookimpl = pluggy.HookimplMarker("speculant")


class DiscoverySpec:
    @hookspec
    def speculant_register_speculators(self, register: Callable[[str, type], None]) -> None:
        """Register speculator classes: ``register("ngram-simple", NgramSimple)``.

        The class is built as ``cls(config)`` with a :class:`speculant.SpeculatorConfig`
        (the target model, its tokenizer, spec options) and must implement the lifecycle hooks below.
        """

    @hookspec
    def speculant_register_backends(self, register: Callable[[str, type], None]) -> None:
        """Register backend classes by device name: ``register("cpu", CpuBackend)``.

        Register only when the device is usable here, so a CUDA plugin imports and stays
        silent on a machine without CUDA."""

    @hookspec
    def speculant_register_architectures(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register model builders by GGUF ``general.architecture``: ``register("qwen2", load_qwen2)``.

        A builder is called as ``builder(gguf_file, backend, progress)`` and returns a
        :class:`speculant.Model`."""


    @hookspec
    def speculant_add_options(self, parser: Any) -> None:
        """Add command-line flags (an ``argparse`` parser or group), as pytest_addoption does.

        Name them after llama.cpp's where the meaning is the same, e.g.
        ``--spec-ngram-simple-size-n``. Parsed values reach speculators as
        ``config.options[dest]`` (``dest`` as argparse derives it: ``spec_ngram_simple_size_n``)."""


class SpeculatorSpec:
    @hookspec
    def begin(self, seq: SequenceView) -> None:
        """A sequence starts (or restarts) with ``seq.tokens`` as its prompt. Forget any earlier
        state kept under ``seq.seq_id`` and index the prompt."""

    @hookspec(firstresult=True)
    def propose(self, seq: SequenceView, limits: DraftLimits) -> Draft | None:
        """Draft at most ``limits.n_max`` tokens to follow ``seq.tokens``. Return None when there
        is nothing to propose, so the next speculator in the chain is asked."""

    @hookspec
    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict[int, Any]) -> None:
        """The target verified ``draft`` and kept its first ``n_accepted`` tokens, then appended
        one token of its own; ``seq.tokens`` is the new history. ``draft`` is None on a step
        without a draft, or was made by another speculator of the chain. ``hidden`` maps
        each layer the speculator asked for (``hidden_layers``) to the target's hidden states
        of this step's rows, [rows, n_embd]."""

    @hookspec
    def truncate(self, seq: SequenceView, n: int) -> None:
        """The sequence's history was cut to its first ``n`` tokens; forget everything after."""

    @hookspec
    def checkpoint(self, seq: SequenceView, action: str) -> None:
        """``action`` is "save", "restore" or "discard": keep speculator state in step with a
        target whose state cannot be truncated (recurrent layers). "restore" returns to the
        state of the last "save"."""

    @hookspec
    def end(self, seq_id: int) -> None:
        """The sequence is finished; free what is kept for it."""
