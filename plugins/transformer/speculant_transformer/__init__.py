"""llama-family and gemma3 decoder architectures."""
