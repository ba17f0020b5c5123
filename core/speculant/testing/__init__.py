"""Test helpers: tiny synthetic GGUF models (see tiny_gguf)."""
