"""The local files the training recipes read (``speculant.training``, ``speculant.distill``):
which globs by default, and every matching file in an order that is the same on every run."""
from __future__ import annotations

import glob
import hashlib
import os
import sysconfig

__all__ = ["default_sources", "source_files"]


def default_sources() -> list[str]:
    """Globs of the files the default recipe reads: Python's standard library, then the packages
    installed beside it (their .py files, and C/C++ headers)."""
    std, site = sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]
    return [f"{std}/**/*.py", f"{site}/**/*.py", f"{site}/**/*.h"]


def source_files(globs: list[str]) -> list[str]:
    """Every matching file, in a fixed pseudo-random order (a hash of the path), so a rerun and
    another machine with the same files take them in the same order. Tests and files under
    200 bytes are left out."""
    files = {os.path.realpath(f) for g in globs for f in glob.glob(g, recursive=True) if os.path.isfile(f)}
    files = [f for f in files if "/test" not in f and os.path.getsize(f) > 200]
    return sorted(files, key=lambda f: hashlib.sha256(f.encode()).hexdigest())
