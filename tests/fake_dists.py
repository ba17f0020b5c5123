"""Installed-looking distributions for plugin-discovery tests: a real `*.dist-info` directory with
METADATA and entry_points.txt plus module files, so importlib.metadata finds them as it would a
pip-installed package once `root` is on sys.path."""
from __future__ import annotations

import importlib
import textwrap
from pathlib import Path


def write_dist(root: Path, dist: str, version: str, entry_points: dict[str, str], files: dict[str, str]) -> None:
    """entry_points: name -> module in the `speculant` group; files: path under root -> source."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[speculant]\n{eps}")
    for path, source in files.items():
        dest = root / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(textwrap.dedent(source))
    importlib.invalidate_caches()
