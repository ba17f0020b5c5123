"""MTP: drafting with a NextN / multi-token-prediction block on the target's own hidden state.

``--spec-type mtp`` (llama.cpp's name ``draft-mtp`` works too): the block from the target's GGUF
itself (``{arch}.nextn_predict_layers`` > 0, e.g. Qwen3.5), or from a sidecar GGUF holding only
the block (``-md mtp-....gguf``, llama.cpp's layout); alone or in a chain (``suffix,mtp``).
``speculant train mtp`` trains a block for a target that has none (see speculant_mtp.train).
"""
from __future__ import annotations

from speculant import hookimpl
from speculant.options import int_in

from speculant_mtp.head import MtpHead
from speculant_mtp.layout import MtpConfig, has_nextn, read_config, split_sidecar, write_sidecar
from speculant_mtp.speculator import Mtp


class DraftMtp(Mtp):
    """llama.cpp's name for the same speculator."""

    spec_type = "draft-mtp"


SPECULATORS = {Mtp.spec_type: Mtp, DraftMtp.spec_type: DraftMtp}

__all__ = ["DraftMtp", "Mtp", "MtpConfig", "MtpHead", "SPECULATORS", "has_nextn", "read_config", "split_sidecar",
           "write_sidecar"]


@hookimpl
def speculant_register_speculators(register):
    for name, cls in SPECULATORS.items():
        register(name, cls)


@hookimpl
def speculant_add_options(parser):
    parser.add_argument("--spec-mtp-full-vocab", action="store_true", default=None,
                        help="mtp: draft over the whole vocabulary even where the MTP file names a draft vocabulary "
                             "(speculant.mtp.draft_vocab, which speculant train mtp writes)")
    parser.add_argument("--spec-mtp-window", type=int_in(0), default=None, metavar="N",
                        help="mtp: the block attends over its last N positions (0: all of them); default: the window "
                             "it was trained on where the file records one (speculant train writes it), else all")


@hookimpl
def speculant_add_trainers(subparsers, register):
    """`speculant train mtp ...`."""
    from speculant_mtp.train.command import add_parser, run

    add_parser(subparsers)
    register("mtp", run)
