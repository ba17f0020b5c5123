"""The small random hybrid models checked against llama.cpp (scripts/hybrid_references.py
writes each case's GGUF with `write_tiny_model(path, arch, **writer)`, runs llama-server on it and
stores its greedy tokens and top log-probabilities in tests/data/llamacpp-outputs/hybrid/NAME.json).

A case: {"name", "arch", "writer": write_tiny_model kwargs, "prompts": token-id lists, "n_predict"}.
"""
from __future__ import annotations

LFM2_CASES: list[dict] = []

QWEN35_CASES: list[dict] = []

CASES = LFM2_CASES + QWEN35_CASES
