"""EAGLE3: a one-layer head that drafts from the target's own hidden states.

``--spec-type eagle3`` (llama.cpp's name ``draft-eagle3`` works too) with ``-md HEAD.gguf``, a
head in llama.cpp's ``eagle3`` GGUF layout; alone or in a chain (``suffix,eagle3``).
``speculant train eagle3`` trains one for a target (see speculant_eagle3.train).
"""
from __future__ import annotations

from speculant import hookimpl
from speculant.options import int_in

from speculant_eagle3.head import Eagle3Head
from speculant_eagle3.layout import ARCH, HeadConfig, default_target_layers, read_config, write_head
from speculant_eagle3.speculator import Eagle3


class DraftEagle3(Eagle3):
    """llama.cpp's name for the same speculator."""

    spec_type = "draft-eagle3"


SPECULATORS = {Eagle3.spec_type: Eagle3, DraftEagle3.spec_type: DraftEagle3}

__all__ = ["ARCH", "DraftEagle3", "Eagle3", "Eagle3Head", "HeadConfig", "SPECULATORS", "default_target_layers",
           "read_config", "write_head"]


@hookimpl
def speculant_register_speculators(register):
    for name, cls in SPECULATORS.items():
        register(name, cls)


@hookimpl
def speculant_register_architectures(register):
    register(ARCH, lambda gguf, backend, progress: Eagle3Head.load(gguf, backend, progress))


@hookimpl
def speculant_add_options(parser):
    parser.add_argument("--spec-eagle3-window", type=int_in(0), default=None, metavar="N",
                        help="eagle3: the head attends over its last N positions (0: all of them); default: the window "
                             "it was trained on where the file records one (speculant train writes it), else all")


@hookimpl
def speculant_add_trainers(subparsers, register):
    """`speculant train eagle3 ...`."""
    from speculant_eagle3.train.command import add_parser, run

    add_parser(subparsers)
    register("eagle3", run)
