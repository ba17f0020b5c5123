import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # toy_models and friends

MODEL_DIR = Path(os.environ.get("SPECULANT_MODELS", Path.home() / ".cache" / "speculant-models"))
REFERENCE_DIR = Path(os.environ.get("SPECULANT_REFERENCE", Path(__file__).parent / "data" / "llamacpp-outputs"))
TARGET = "qwen2.5-coder-1.5b-instruct.gguf"
DRAFT = "qwen2.5-coder-0.5b-instruct.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"


def model_path(name: str) -> Path:
    path = MODEL_DIR / name
    if not path.exists():
        pytest.skip(f"{path} is absent: run `python scripts/fetch_models.py` (or set SPECULANT_MODELS)")
    return path


_loaded: dict = {}


def load_cached(name: str):
    """Load a real model once per test session (loading the 1.5B takes seconds)."""
    from speculant.loader import load_model

    path = model_path(name)
    if name not in _loaded:
        _loaded[name] = load_model(str(path), progress=False)
    return _loaded[name]
