"""DFlash: a block-diffusion drafter that fills a block of tokens from the target's hidden states.

``--spec-type dflash`` (llama.cpp's name ``draft-dflash`` works too) with ``-md HEAD.gguf``, a
drafter in llama.cpp's ``dflash`` GGUF layout; alone or in a chain (``suffix,dflash``). One
forward of the drafter proposes up to block_size - 1 tokens for every drafting sequence at once.
``speculant train dflash`` trains one for a target (see speculant_dflash.train).
"""
from __future__ import annotations

from speculant import hookimpl
from speculant.options import int_in

from speculant_dflash.head import DFlashHead
from speculant_dflash.layout import ARCH, DFlashConfig, default_target_layers, read_config, write_head
from speculant_dflash.speculator import DFlash


class DraftDFlash(DFlash):
    """llama.cpp's name for the same speculator."""

    spec_type = "draft-dflash"


SPECULATORS = {DFlash.spec_type: DFlash, DraftDFlash.spec_type: DraftDFlash}

__all__ = ["ARCH", "DFlash", "DFlashConfig", "DFlashHead", "DraftDFlash", "SPECULATORS", "default_target_layers",
           "read_config", "write_head"]


@hookimpl
def speculant_register_speculators(register):
    for name, cls in SPECULATORS.items():
        register(name, cls)


@hookimpl
def speculant_register_architectures(register):
    register(ARCH, lambda gguf, backend, progress: DFlashHead.load(gguf, backend, progress))


@hookimpl
def speculant_add_options(parser):
    parser.add_argument("--spec-dflash-window", type=int_in(0), default=None, metavar="N",
                        help="dflash: a block sees the context of a window of N positions (its last N - block size + 1 "
                             "rows; 0: all of them); default: the window it was trained on where the file records one "
                             "(speculant train writes it), else all")


@hookimpl
def speculant_add_trainers(subparsers, register):
    """`speculant train dflash ...`."""
    from speculant_dflash.train.command import add_parser, run

    add_parser(subparsers)
    register("dflash", run)
