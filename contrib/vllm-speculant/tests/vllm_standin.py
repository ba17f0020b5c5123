"""Stand-ins for what vLLM 0.33.0 hands a custom proposer, and its model runner's bookkeeping
around the `propose` call, read from the 0.33.0 wheel's source (file:line below). Only the
attributes vLLM passes or reads exist here, so a proposer that touched anything else would fail.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def vllm_config(num_speculative_tokens: int, max_model_len: int, model: str = "vllm_speculant.Suffix"):
    """What custom_class_proposer.py:49 passes as `cls(vllm_config)`: the attributes the
    proposer reads (config/speculative.py:413 num_speculative_tokens, :416 model, :419 method;
    the target's model_config.max_model_len, read by ngram_proposer.py:27 too)."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="custom_class", model=model,
                                           num_speculative_tokens=num_speculative_tokens),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )


class Request:
    """A request as the scheduler sees it: a prompt, the text the target will produce (a script:
    verification accepts a draft up to its first token that differs), how many tokens it may
    generate, and how many prefill chunks its prompt takes."""

    def __init__(self, req_id: str, prompt: list[int], script: list[int], max_tokens: int, chunks: int = 1):
        self.req_id, self.prompt, self.script = req_id, list(prompt), list(script)
        self.max_tokens, self.chunks_left = max_tokens, chunks
        self.output: list[int] = []
        self.draft: list[int] = []  # scheduled spec tokens for the next step

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_tokens


class Runner:
    """GPUModelRunner's persistent batch and the path to `propose`, for one proposer.

    * rows: gpu_input_batch.py:345-385 add_request puts a request in the first free row (one a
      removed request left) or appends it, writing its prompt into token_ids_cpu and its length
      into num_tokens_no_spec; gpu_model_runner.py:1200 removes finished requests and :1496
      condenses, gpu_input_batch.py:698-766 moving the last rows down into the holes, tokens
      and all.
    * a step: gpu_input_batch.py:505-519 writes the scheduled spec tokens past num_tokens_no_spec;
      the target verifies them; gpu_model_runner.py:3525-3541 (_bookkeeping_sync) writes the
      sampled tokens at num_tokens_no_spec and advances it; a row still in prefill, or whose
      sample is discarded, gets [] (3487-3490); then :4744-4751 calls
      propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...).
    * the returned drafts become the next step's scheduled spec tokens; `cut` imitates the
      scheduler scheduling fewer than proposed (token budget).
    """

    def __init__(self, proposer, max_num_reqs: int = 8, max_model_len: int = 256, cut=None):
        self.proposer, self.cut = proposer, cut
        self.rows: list[Request | None] = []
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.max_num_reqs = max_num_reqs
        self.steps = 0

    def add(self, req: Request) -> None:
        free = [i for i, r in enumerate(self.rows) if r is None]
        i = free[0] if free else len(self.rows)
        assert i < self.max_num_reqs
        if i == len(self.rows):
            self.rows.append(req)
        else:
            self.rows[i] = req
        self.token_ids_cpu[i, : len(req.prompt)] = req.prompt
        self.num_tokens_no_spec[i] = len(req.prompt)

    def _remove_finished(self) -> list[Request]:
        done = [r for r in self.rows if r is not None and r.finished]
        self.rows = [None if r is not None and r.finished else r for r in self.rows]
        # condense: the last live row fills the lowest hole, until no hole is below a live row
        while True:
            holes = [i for i, r in enumerate(self.rows) if r is None]
            live = [i for i, r in enumerate(self.rows) if r is not None]
            if not holes or not live or holes[0] > live[-1]:
                break
            src, dst = live[-1], holes[0]
            n = int(self.num_tokens_no_spec[src])
            self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
            self.num_tokens_no_spec[dst] = n
            self.rows[dst], self.rows[src] = self.rows[src], None
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        return done

    def step(self, arrivals: list[Request] = ()) -> dict[str, list[int]]:
        """One engine step; returns the drafts by request id (what the scheduler will schedule)."""
        self._remove_finished()
        for r in arrivals:
            self.add(r)
        sampled: list[list[int]] = []
        for i, r in enumerate(self.rows):
            if r.chunks_left > 1:  # a partial prefill: its sample is discarded
                r.chunks_left -= 1
                sampled.append([])
                continue
            r.chunks_left = 0
            start = int(self.num_tokens_no_spec[i])
            draft = r.draft
            self.token_ids_cpu[i, start : start + len(draft)] = draft  # spec tokens, overwritten below
            at = len(r.tokens)
            n_acc = 0
            while n_acc < len(draft) and draft[n_acc] == r.script[at + n_acc]:
                n_acc += 1
            new = r.script[at : at + n_acc + 1][: r.max_tokens - len(r.output)]
            r.output.extend(new)
            self.token_ids_cpu[i, start : start + len(new)] = new
            self.num_tokens_no_spec[i] = start + len(new)
            sampled.append(new)
        drafts = self.proposer.propose(sampled, self.num_tokens_no_spec, self.token_ids_cpu, slot_mappings={})
        assert isinstance(drafts, list) and len(drafts) == len(self.rows)
        out = {}
        for r, d in zip(self.rows, drafts):
            assert isinstance(d, list) and all(type(t) is int for t in d)
            r.draft = list(d) if self.cut is None else list(d)[: self.cut(r, d)]
            out[r.req_id] = list(d)
        self.steps += 1
        return out

    def active(self) -> int:
        return sum(1 for r in self.rows if r is not None and not r.finished)
