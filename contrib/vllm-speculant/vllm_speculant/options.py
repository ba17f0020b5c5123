"""Which speculators a vLLM proposer runs, and their options: speculant's own flags.

vLLM's `speculative_config` has fixed fields (a pydantic dataclass), so nothing of ours can ride
in it but the class path. The rest comes from the environment, which vLLM's worker processes
inherit from the process that starts them:

    SPECULANT_VLLM_ARGS="--spec-type suffix,ngram-simple --spec-suffix-max-depth 32"

parsed with exactly the parser `speculant generate` uses for its speculation flags, so a flag
means here what it means there (plugins' own flags included).
"""
from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

import attrs

from speculant import SpeculantError

ENV = "SPECULANT_VLLM_ARGS"


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises instead of exiting: inside a vLLM worker a bad flag must surface as
    the proposer's construction error, not end the process."""

    def error(self, message: str):
        raise SpeculantError(f"{ENV}: {message}")


@attrs.frozen
class ProposerOptions:
    spec_types: tuple[str, ...]
    values: dict[str, Any]  # every parsed flag by its argparse dest, as SpeculatorConfig.options
    n_min: int  # --spec-draft-n-min: shorter drafts are not returned


def parse(fixed_types: tuple[str, ...] = (), text: str | None = None, require_types: bool = True) -> ProposerOptions:
    """The options from `text` (default: the environment). `fixed_types`: the spec types a named
    proposer class stands for; then `--spec-type` may not name others. `require_types`: no spec
    type at all is an error (False: only checking the flags, as the vLLM plugin hook does)."""
    from speculant.flags import add_spec_args
    from speculant.speculator import parse_spec_types

    text = os.environ.get(ENV, "") if text is None else text
    parser = _RaisingParser(prog=ENV, add_help=False)
    add_spec_args(parser)
    try:
        args = parser.parse_args(shlex.split(text))
    except ValueError as e:  # shlex: an unclosed quote
        raise SpeculantError(f"{ENV}: {e}") from None
    named = tuple(parse_spec_types(args.spec_type)) if args.spec_type else ()
    if fixed_types and named and named != fixed_types:
        raise SpeculantError(f"{ENV} names --spec-type {args.spec_type}, but the proposer class stands for "
                             f"{','.join(fixed_types)}: use vllm_speculant.SpeculantProposer to pick the types by flag")
    types = fixed_types or named
    if not types and require_types:
        raise SpeculantError(f"no spec type: set {ENV}='--spec-type TYPE[,TYPE...]' or use a named proposer class "
                             "(vllm_speculant.Suffix, vllm_speculant.NgramSimple, ...)")
    if fixed_types:
        parse_spec_types(",".join(fixed_types))  # installed? (a named class for a plugin that is not)
    return ProposerOptions(spec_types=types, values=vars(args), n_min=args.spec_draft_n_min)
