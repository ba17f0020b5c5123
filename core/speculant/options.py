"""argparse value types that give one-line errors, for the CLI and for plugins' own flags
(``speculant_add_options``): ``type=int_in(1, 1024)``, ``type=float_where("a number in [0, 1]", lambda v: 0 <= v <= 1)``."""
from __future__ import annotations

import argparse
import math


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]."""
    expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value
    return parse


def float_where(expected: str, ok):
    """An argparse type: a finite float for which ok(value) holds; `expected` describes the range."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value
    return parse
