"""Tokenizer built from GGUF metadata, token-for-token compatible with llama.cpp.

Two vocabulary kinds are supported, named by 'tokenizer.ggml.model':

* 'gpt2' -- byte-level BPE (Qwen2, Llama 3, GPT-2, StarCoder, ...), merged by the HF `tokenizers`
  library behind llama.cpp's pre-tokenizer regexes (bpe.py);
* 'llama' -- SentencePiece-style vocabulary with scores (Llama 1/2, Gemma, Mistral v1, ...): llama.cpp's
  llm_tokenizer_spm algorithm, written here (spm.py).

Around both, the llama.cpp conventions: control / user-defined / unknown tokens are cut out of the text
before the merges (special.py), BOS/EOS are added per 'tokenizer.ggml.add_bos_token' / 'add_eos_token',
end-of-generation ids are found by token text (vocab.py), and detokenization follows
llama_token_to_piece / llama_detokenize (detokenize.py). Chat prompts whose messages stay text: chat.py.

The names below are the public ones; the submodules are internal.
"""
from __future__ import annotations

from speculant.gguf.file import read_gguf_metadata  # re-exported: the metadata-only reader lives with the GGUF parser
from speculant.gguf.tokenizer.core import Tokenizer
from speculant.gguf.tokenizer.detokenize import StreamDecoder, bytes_to_unicode
from speculant.gguf.tokenizer.vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_RSTRIP,
                                            ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_USER_DEFINED,
                                            TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
                                            TOKEN_TYPE_UNDEFINED, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_UNUSED,
                                            TOKEN_TYPE_USER_DEFINED)

__all__ = [
    "Tokenizer", "StreamDecoder", "bytes_to_unicode", "read_gguf_metadata",
    "TOKEN_TYPE_UNDEFINED", "TOKEN_TYPE_NORMAL", "TOKEN_TYPE_UNKNOWN", "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED", "TOKEN_TYPE_UNUSED", "TOKEN_TYPE_BYTE",
    "ATTR_UNDEFINED", "ATTR_UNKNOWN", "ATTR_UNUSED", "ATTR_NORMAL", "ATTR_CONTROL", "ATTR_USER_DEFINED",
    "ATTR_BYTE", "ATTR_LSTRIP", "ATTR_RSTRIP",
]
