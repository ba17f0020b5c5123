"""The hook specifications: the whole contract between the core and its plugins.

Two groups, both under the pluggy project name ``speculant``:

* Discovery hooks, called once at start-up on every installed plugin (entry-point group
  ``speculant``). A plugin registers classes by name through the ``register`` callback.
* Speculator lifecycle hooks, called by the engine on the speculators of the active chain
  (``--spec-type a,b,c``). Each speculator object implements them as methods marked with
  ``speculant.hookimpl``; the engine keeps one small plugin manager per chain, so a call
  reaches only the chain's speculators, in the user's order. Each step the engine asks for
  drafts for all active sequences at once: a speculator implements ``propose`` (one sequence
  per call) or ``propose_batch`` (all the sequences it is asked for in one call, for drafters
  that batch work across sequences, such as a draft model).
"""
from __future__ import annotations

from typing import Any, Callable

import pluggy

from speculant.types import Draft, DraftLimits, DraftRequest, SequenceView, SpeculatorState

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

        The class is built as ``cls()``, or ``cls(threads=N)`` when the user set ``-t N``: a
        backend takes that keyword and applies it to every thread pool it runs.

        Register only when the device is usable here, so a CUDA plugin imports and stays
        silent on a machine without CUDA; a backend that finds out only when it is built raises
        :class:`speculant.DeviceUnavailable` from its constructor (the contract suite then skips
        it with that reason)."""

    @hookspec
    def speculant_register_architectures(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register model builders by GGUF ``general.architecture``: ``register("qwen2", load_qwen2)``.

        A builder is called as ``builder(gguf_file, backend, progress)`` and returns a
        :class:`speculant.Model`."""


    @hookspec
    def speculant_add_commands(self, subparsers: Any, register: Callable[[str, Callable[[Any], int]], None]) -> None:
        """Add subcommands to ``speculant``: ``p = subparsers.add_parser("serve", help=...)``, its
        flags, then ``register("serve", run)``. ``run(args)`` gets the parsed arguments and
        returns the exit code; a :class:`speculant.SpeculantError` it raises is printed as one
        line with exit code 2. ``speculant.flags`` has the flags every command shares
        (``add_model_args``, ``add_sampling_args``, ``add_spec_args``) and what turns them into
        a model, an EngineConfig and speculators (``load``, ``engine_setup``)."""

    @hookspec
    def speculant_add_trainers(self, subparsers: Any, register: Callable[[str, Callable[[Any], int]], None]) -> None:
        """Add a method to ``speculant train`` (for a drafter that needs weights trained for a
        target, such as an EAGLE3 head): ``p = subparsers.add_parser("eagle3", help=...)``, its
        flags, then ``register("eagle3", run)``. ``speculant train METHOD ...`` then calls
        ``run(args)`` as a command's run is called. The ``train`` command exists once some
        installed plugin adds a method; two plugins adding the same method is an error."""

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
        is nothing to propose, so the next speculator in the chain is asked.

        ``limits.n_max`` may be smaller than the configured maximum: the engine's cost model
        asks for only as many tokens as it expects to pay off (a speculator it expects not to
        pay off at all is not asked). ``limits.n_min``: a shorter draft is not verified, so a
        speculator may return None instead (llama.cpp's model drafters do). ``limits.p_min``:
        model drafters stop where their next token's probability falls below it."""

    @hookspec(firstresult=True)
    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft | None] | None:
        """Optional, instead of ``propose``: draft for several sequences at once.

        Each step the engine asks the chain for a draft for every active sequence together. A
        speculator that implements this hook gets, in one call, the requests of all sequences
        still without a draft that it may serve (``request.seq``, ``request.limits``, the same
        as ``propose``'s arguments), so it can batch its work across sequences: a draft model
        runs one forward per draft step for all of them instead of one per sequence. A
        speculator with only ``propose`` is asked once per sequence, as before.

        Return a list with one entry per request, in the requests' order: a :class:`Draft` of
        at most ``request.limits.n_max`` tokens (longer ones are cut), or None when there is
        nothing to propose for that sequence, so the next speculator of the chain is asked for
        it. Chain semantics are per sequence, as with ``propose``: each sequence gets the first
        non-empty draft in chain order; an empty Draft answers for the sequence with no draft
        (the rest of the chain is not asked for it). With the adaptive controller on, the engine
        may pass a cheap speculator's draft over for the speculators after it: where the draft
        would not be verified, or where a costly one after it (a hidden-state head) is expected to
        emit more tokens a second. If none of those drafts, it is verified where it pays on its
        own; else it is compared with what the sequence emits, so its kind of draft is still
        judged on its record. A speculator is never asked for a sequence
        whose request restricts the spec types (a server request's ``speculative.type``) to
        others. Returning None instead of a list means nothing for any request.

        If the call raises, speculation is turned off for every sequence of the call (they go
        on with plain decoding); the other sequences are unaffected. When a speculator
        implements both hooks, the chain uses this one."""

    @hookspec
    def accept(self, seq: SequenceView, draft: Draft | None, n_accepted: int, hidden: dict[int, Any],
               hidden_start: int) -> None:
        """The target verified ``draft`` and kept its first ``n_accepted`` tokens, then appended
        one token of its own; ``seq.tokens`` is the new history. ``draft`` is None on a step
        without a draft, or was made by another speculator of the chain. ``hidden`` maps
        each layer the speculator asked for (``hidden_layers``: a tuple of layer indices, as an
        attribute of the speculator) to the target's hidden states of this step's rows,
        [rows, n_embd], each row the output of that layer: the rows fed since the last step (on a
        sequence's first step, the last chunk of its prompt, with its last token), then the
        draft's. ``hidden_start`` is the position of the first row; rows past
        ``hidden_start + rows - len(draft) + n_accepted`` belong to rejected draft tokens."""

    @hookspec
    def prefill(self, seq: SequenceView, start: int, hidden: dict[int, Any]) -> None:
        """A chunk of the prompt, positions ``start`` to ``start + rows``, went into the target
        without a decode step; ``hidden`` as in ``accept``. Called only when some speculator of
        the chain asks for hidden states, so a drafter that reads them sees every position of
        the prompt (the last chunk comes with the first ``accept``)."""

    @hookspec
    def truncate(self, seq: SequenceView, n: int) -> None:
        """The sequence's history was cut to its first ``n`` tokens; forget everything after.

        Also how a sequence continues into a new request (the prompt cache): the engine keeps
        a finished sequence's state, and a later request whose prompt starts the same way
        continues it under the same ``seq.seq_id``. It calls ``truncate`` instead of ``begin``,
        with ``seq`` the new request (``seq.tokens`` its prompt, ``seq.n_prompt`` its length):
        keep what you hold for the first ``n`` tokens, and take the tokens past ``n`` as new,
        as you take tokens that ``accept`` appends. ``end`` is called only when the kept state
        is finally dropped, which may be several requests later."""

    @hookspec
    def checkpoint(self, seq: SequenceView, action: str) -> None:
        """``action`` is "save", "restore" or "discard": keep speculator state in step with a
        target whose state cannot be truncated (recurrent layers). "restore" returns to the
        state of the last "save"."""

    @hookspec(firstresult=True)
    def export_state(self, seq_id: int, n: int) -> SpeculatorState | None:
        """Optional: a copy of what you keep for the first ``n`` positions of sequence ``seq_id``
        (a finished request's state, held by the prompt cache), so that a slot file carries it
        beside the target's rows (llama-server's ``/slots?action=save``). Return None where you
        rebuild everything from the tokens in ``begin`` (an n-gram index), or hold less than ``n``
        positions. A drafter on hidden states must implement it and ``import_state``: a restored
        slot hands the target's rows but no hidden states, and without its own it drafts nothing
        for that conversation. Set the state's ``key`` to what the tensors are valid for."""

    @hookspec(firstresult=True)
    def import_state(self, seq: SequenceView, state: SpeculatorState, n: int) -> bool | None:
        """A request continues from a state read back from a slot file: ``begin`` was called with
        ``seq``, and ``state`` is what your ``export_state`` returned in the process that saved
        it. Take its first ``n`` positions (the new request shares only those with the file)
        and return True; return False, taking nothing, where ``state.key`` is not yours or the
        tensors do not fit."""

    @hookspec
    def state_nbytes(self, seq_id: int) -> int | None:
        """Optional: the bytes of memory you hold for sequence ``seq_id`` (a draft model's KV rows,
        a head's states), capacity included. A finished conversation kept by the prompt cache
        costs what the target and every speculator hold for it, and the server's ``--cache-ram``
        limit counts all of it: a drafter that keeps much per token and does not say so lets
        the cache grow past the limit by that much. Return None (or leave it out) for state
        too small to count (an n-gram index)."""

    @hookspec
    def end(self, seq_id: int) -> None:
        """The sequence is finished; free what is kept for it."""
