"""N-gram speculators (llama.cpp's ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod).

They draft from the sequence's own history, no draft model needed. Semantics, defaults and flag
names follow llama.cpp's common/speculative.cpp, ngram-map.cpp and ngram-mod.cpp.
"""
from __future__ import annotations

from speculant import hookimpl, int_in

from speculant_ngram.map import NgramMapK, NgramMapK4v
from speculant_ngram.mod import NgramMod, NgramModPool
from speculant_ngram.simple import NgramSimple

SPECULATORS = {cls.spec_type: cls for cls in (NgramSimple, NgramMapK, NgramMapK4v, NgramMod)}

__all__ = ["NgramMapK", "NgramMapK4v", "NgramMod", "NgramModPool", "NgramSimple", "SPECULATORS"]


@hookimpl
def speculant_register_speculators(register):
    for name, cls in SPECULATORS.items():
        register(name, cls)


@hookimpl
def speculant_add_options(parser):
    # Defaults stay None so each class applies llama.cpp's own default (and an unset flag is
    # distinguishable from one set to the default value).
    for kind in ("simple", "map-k", "map-k4v"):
        parser.add_argument(f"--spec-ngram-{kind}-size-n", type=int_in(1, 1024), default=None, metavar="N",
                            help=f"ngram-{kind}: n-gram length looked up in the history (default 12)")
        parser.add_argument(f"--spec-ngram-{kind}-size-m", type=int_in(1, 1024), default=None, metavar="M",
                            help=f"ngram-{kind}: most tokens drafted after a match (default 48)")
        note = {"simple": "; unused, as in llama.cpp", "map-k": "; unused in key-only mode, as in llama.cpp"}.get(kind, "")
        parser.add_argument(f"--spec-ngram-{kind}-min-hits", type=int_in(1), default=None, metavar="N",
                            help=f"ngram-{kind}: lookups of a key before it drafts (default 1{note})")
    parser.add_argument("--spec-ngram-mod-n-match", type=int_in(1, 1024), default=None, metavar="N",
                        help="ngram-mod: n-gram length hashed into the shared pool (default 24)")
    parser.add_argument("--spec-ngram-mod-n-min", type=int_in(0, 1024), default=None, metavar="N",
                        help="ngram-mod: drop drafts shorter than this (default 48)")
    parser.add_argument("--spec-ngram-mod-n-max", type=int_in(0, 1024), default=None, metavar="N",
                        help="ngram-mod: most tokens drafted (default 64)")
