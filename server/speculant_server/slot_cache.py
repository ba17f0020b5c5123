"""Which kept state a new request continues from: llama-server's prompt cache, on the engine's
``CachedPrompt`` entries.

Each slot keeps the state of its last request. A new request goes to the idle slot whose state
shares the longest prefix with its prompt, if that prefix is more than `similarity` of the prompt
(llama-server's ``--slot-prompt-similarity``), else to the least recently used idle slot. The
slot's own state is continued from when it shares enough with the prompt (from a copy of the
shared rows when the state is another conversation's, which then stays whole); otherwise
it moves, whole, to a host-memory LRU (``--cache-ram``), and the request takes the entry of that
LRU that shares most with it, if any. States cost nothing to move here: they stay where they
are in memory, only their owner changes. Only the engine thread calls this.
"""
from __future__ import annotations

import collections
import time

from speculant.engine import CachedPrompt, Engine


# A kept state holding this much past what a new prompt shares with it is another branch, kept
# whole (the prompt takes a copy of the shared rows) rather than cut: more than 32 tokens, and
# more than 1/8 of the shared part. Below, it is the same conversation with its tail changed (a
# re-tokenized answer, an edited last turn), and a near copy kept beside it would only fill the
# LRU (a 6-turn session would leave five).
BRANCH_MIN_TOKENS = 32
BRANCH_MIN_SHARE = 8


class SlotCache:
    def __init__(self, engine: Engine, n_slots: int, ram_bytes: int | None, similarity: float):
        """`ram_bytes`: the LRU's size limit (None: no limit, 0: no LRU, a slot's state that is
        not continued is dropped)."""
        self.engine = engine
        self.ram_bytes = ram_bytes
        self.similarity = similarity
        self.slots: list[CachedPrompt | None] = [None] * n_slots
        self.last_used = [0.0] * n_slots
        self.ram: collections.OrderedDict[int, CachedPrompt] = collections.OrderedDict()  # by seq id, oldest first

    @property
    def ram_used(self) -> int:
        return sum(e.n_bytes for e in self.ram.values())

    def _shared(self, entry: CachedPrompt | None, prompt: list[int]) -> int:
        return 0 if entry is None else entry.common_prefix(prompt)

    def _similar(self, entry: CachedPrompt | None, prompt: list[int]) -> bool:
        """llama-server's rule: the shared prefix is more than `similarity` of the prompt."""
        return self._shared(entry, prompt) / max(1, len(prompt)) > self.similarity

    def pick_slot(self, prompt: list[int], free: list[int]) -> int:
        """The idle slot for `prompt`: the one whose state shares the longest prefix with it,
        above the similarity threshold, else the least recently used."""
        best, best_len = None, 0
        for i in free:
            n = self._shared(self.slots[i], prompt)
            if n > best_len and self._similar(self.slots[i], prompt):
                best, best_len = i, n
        if best is not None:
            return best
        return min(free, key=lambda i: self.last_used[i])

    def take(self, slot: int, prompt: list[int], use_cache: bool = True) -> CachedPrompt | None:
        """The entry the request on `slot` continues from (None: a cold start). Whatever the slot
        held and the request does not continue from goes to the LRU."""
        self.last_used[slot] = time.monotonic()
        own, self.slots[slot] = self.slots[slot], None
        if not use_cache:
            self._to_ram(own)
            return None
        # Too little in common is not worth giving up the rest of a state for.
        n_own = self._shared(own, prompt) if self._similar(own, prompt) else 0
        # Look in the LRU before the slot's own state goes there: it could push out the best match.
        best = max(self.ram.values(), key=lambda e: e.common_prefix(prompt), default=None)
        if best is not None and self._similar(best, prompt) and self._shared(best, prompt) > n_own:
            entry = self._continue(best, prompt)  # before the slot's state goes in and pushes it out
            self._to_ram(own)
            return entry
        if n_own == 0:
            self._to_ram(own)
            return None
        return self._continue(own, prompt)

    def _continue(self, entry: CachedPrompt, prompt: list[int]) -> CachedPrompt | None:
        """What the request continues from, given the state that shares most with it (the slot's
        own, or one in the LRU). A state the prompt extends, or nearly (an edited last turn, a
        re-tokenized answer), is used up. One with more past the shared part (more than
        BRANCH_MIN_TOKENS, and more than 1/BRANCH_MIN_SHARE of the shared part) is another
        conversation's that only starts the same way (a system prompt): continuing from it would
        cut away the rest, which that conversation's next turn needs. The request then takes a copy of the rows it can reuse and the state
        stays whole in the LRU, as llama-server keeps a slot's prompt in its cache before the
        slot takes another. (Where the target's state cannot be copied, it is used up.)"""
        shared = entry.common_prefix(prompt)
        rest = len(entry.tokens) - shared
        if rest > BRANCH_MIN_TOKENS and rest * BRANCH_MIN_SHARE > shared:
            n = self.engine.reusable(entry, prompt)
            copy = self.engine.copy_cached(entry, n) if n > 0 else None
            if copy is not None or n == 0:
                if entry.seq_id not in self.ram:
                    self._to_ram(entry)
                else:
                    self.ram.move_to_end(entry.seq_id)
                return copy
        self.ram.pop(entry.seq_id, None)
        return entry

    def put(self, slot: int, entry: CachedPrompt | None) -> None:
        """The state `slot`'s request leaves behind (None: nothing to keep)."""
        self._to_ram(self.slots[slot])
        self.slots[slot] = entry
        self.last_used[slot] = time.monotonic()

    def erase(self, slot: int) -> int:
        """Drop the slot's state; returns how many tokens it held."""
        entry, self.slots[slot] = self.slots[slot], None
        if entry is None:
            return 0
        self.engine.drop_cached(entry)
        return len(entry.tokens)

    def _to_ram(self, entry: CachedPrompt | None) -> None:
        """Move a state to the LRU (dropped if it does not fit), oldest states out past the limit."""
        if entry is None:
            return
        if not entry.tokens or self.ram_bytes == 0 or (self.ram_bytes is not None and entry.n_bytes > self.ram_bytes):
            self.engine.drop_cached(entry)
            return
        # One copy of a prefix: a state that another holds whole (the same request again, an
        # earlier turn of a conversation whose later turn is kept) serves no request the other
        # does not. Without this the same few prompts filled the LRU with copies (a 30-minute
        # soak on 14 prompts: +562 MB and growing).
        n = len(entry.tokens)
        for other in list(self.ram.values()):
            shared = other.common_prefix(list(entry.tokens))
            if shared == n:  # the new one is inside an older one: keep that, as the newest
                self.engine.drop_cached(entry)
                self.ram.move_to_end(other.seq_id)
                return
            if shared == len(other.tokens):  # an older one is inside the new one
                del self.ram[other.seq_id]
                self.engine.drop_cached(other)
        self.ram[entry.seq_id] = entry
        while self.ram_bytes is not None and self.ram_used > self.ram_bytes:
            _, oldest = self.ram.popitem(last=False)
            self.engine.drop_cached(oldest)
