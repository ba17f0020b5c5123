"""speculant-suffix: suffix decoding for speculant, a third-party plugin.

It uses only speculant's public API and is found through its ``speculant`` entry point, like any
plugin installed with pip. See speculator.py for the method and README.md for the flags.
"""
from __future__ import annotations

from speculant import hookimpl

from speculant_suffix.automaton import SuffixAutomaton
from speculant_suffix.speculator import DEFAULTS, SuffixSpeculator

__all__ = ["DEFAULTS", "SuffixAutomaton", "SuffixSpeculator"]
__version__ = "0.1.0"


@hookimpl
def speculant_register_speculators(register):
    register("suffix", SuffixSpeculator)


@hookimpl
def speculant_add_options(parser):
    # Defaults stay None so the speculator applies DEFAULTS (also when built without the CLI).
    d = DEFAULTS
    parser.add_argument("--spec-suffix-max-depth", type=int, default=None, metavar="N",
                        help=f"suffix: longest suffix matched and counted, in tokens (default {d['max_depth']})")
    parser.add_argument("--spec-suffix-max-spec-factor", type=float, default=None, metavar="F",
                        help=f"suffix: draft at most F x the match length (default {d['max_spec_factor']})")
    parser.add_argument("--spec-suffix-min-token-prob", type=float, default=None, metavar="P",
                        help=f"suffix: stop drafting when the path's estimated probability falls below P "
                             f"(default {d['min_token_prob']})")
    parser.add_argument("--spec-suffix-max-cached-tokens", type=int, default=None, metavar="N",
                        help=f"suffix: tokens of ended outputs kept in the shared index, 0 = none "
                             f"(default {d['max_cached_tokens']}, ~0.4 KB each)")
