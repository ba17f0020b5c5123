"""Which conversation a request continues, as routing keys for the Ray Serve router.

A replica's prompt cache and suffix history pay off only when the next turn of a conversation
comes back to it. The router (ray_router.py) remembers which replica each key went to; this
module turns a request into its keys, most specific first:

* an explicit session: the ``x-session-id`` header (Ray Serve's own session header), else the
  OpenAI ``user`` field: one key, and nothing else is looked at;
* otherwise chained hashes of the conversation's prefixes: chat ``messages`` one message at a
  time, a text ``prompt`` in 256-character blocks, a token-id prompt in 64-token blocks. Turn
  k+1 of a chat repeats turn k's messages and adds two, so its prefix of turn k's length has
  the key of turn k's whole conversation, which the router recorded: it finds the longest
  prefix some earlier request sent whole, without a tokenizer in the ingress.

Pure functions on the raw body: no Ray, no torch.
"""
from __future__ import annotations

import hashlib
import json
from typing import Mapping

SESSION_HEADER = "x-session-id"
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion"})
TEXT_BLOCK = 256  # characters of a text prompt per key: a prompt shorter than one block has no key (cheap to prefill anywhere)
TOKEN_BLOCK = 64  # token ids per key
MAX_KEYS = 1024  # keys of one request at most (the first blocks': where a long prompt's cached state starts)


def affinity_keys(method: str, path: str, headers: Mapping[str, str], body: bytes) -> list[str]:
    """The request's routing keys, longest prefix first; [] for a request that continues nothing
    (not a generation, a body that is not a JSON object): it goes to the least loaded replica."""
    session = _header(headers, SESSION_HEADER)
    if session:
        return ["session:" + session]
    if method != "POST" or path not in GENERATION_PATHS:
        return []
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return []  # the replica answers the 400
    if not isinstance(data, dict):
        return []
    user = data.get("user")
    if isinstance(user, str) and user:
        return ["user:" + user]
    messages, prompt = data.get("messages"), data.get("prompt")
    if isinstance(messages, list) and messages:
        blocks = [json.dumps(m, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode() for m in messages]
        return _chained("chat:", blocks)
    if isinstance(prompt, str):
        blocks = [prompt[i : i + TEXT_BLOCK].encode("utf-8", "surrogatepass")
                  for i in range(0, len(prompt) - TEXT_BLOCK + 1, TEXT_BLOCK)]
        return _chained("text:", blocks)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        blocks = [",".join(map(str, prompt[i : i + TOKEN_BLOCK])).encode()
                  for i in range(0, len(prompt) - TOKEN_BLOCK + 1, TOKEN_BLOCK)]
        return _chained("tokens:", blocks)
    return []


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None:  # a plain dict of headers as sent: any case
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return (value or "").strip()


def _chained(kind: str, blocks: list[bytes]) -> list[str]:
    """Key i names blocks[0..i] together: a hash chained block by block (each block length-
    prefixed, so no two different lists of blocks share a key)."""
    h, keys = hashlib.blake2b(digest_size=16), []
    for block in blocks[:MAX_KEYS]:
        h.update(len(block).to_bytes(8, "little"))
        h.update(block)
        keys.append(kind + h.hexdigest())
    keys.reverse()
    return keys
