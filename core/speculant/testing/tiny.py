"""The tiny models the contract suite runs speculators on, with plain decoding's outputs."""
from __future__ import annotations

import os
import random
from typing import Any

import attrs

from speculant.testing.driver import script, segment_pool
from speculant.testing.tiny_gguf import write_tiny_pair

N_PROMPTS = 8
N_NEW = 48


@attrs.define
class TinyModels:
    target: Any  # the loaded target (qwen2, 2 layers, vocabulary 512, F32 weights)
    target_path: str
    draft_path: str  # its first layer as a draft model (same vocabulary), for draft-model speculators
    prompts: list[list[int]]  # repeated segments of byte tokens, 24 to 40 tokens long
    greedy: list[list[int]]  # plain decoding's N_NEW tokens for each prompt, temperature 0
    n_new: int = N_NEW
    directory: str = ""
    drafts: dict = attrs.field(factory=dict)

    def draft_for(self, speculator_class) -> str:
        """The -md file for a speculator class: its `contract_draft_model` for this target (made
        once), else the plain draft model."""
        make = getattr(speculator_class, "contract_draft_model", None)
        if make is None:
            return self.draft_path
        if make not in self.drafts:
            sub = os.path.join(self.directory, f"draft-{len(self.drafts)}")
            os.makedirs(sub, exist_ok=True)
            self.drafts[make] = make(self.target_path, sub)
        return self.drafts[make]

    @classmethod
    def create(cls, directory: str | os.PathLike, registry) -> "TinyModels":
        from speculant.engine import Engine, EngineConfig
        from speculant.loader import load_model
        from speculant.sampling import SamplingParams

        target_path, draft_path = write_tiny_pair(directory, "qwen2")
        target = load_model(target_path, registry=registry, progress=False)
        rng = random.Random(99)
        alphabet = range(0, 128)
        prompts = [script(rng, segment_pool(rng, alphabet), rng.randint(24, 40), alphabet) for _ in range(N_PROMPTS)]
        engine = Engine(target, EngineConfig(n_ctx=256))
        seqs = [engine.add(p, N_NEW, SamplingParams()) for p in prompts]
        while engine.active():
            engine.step()
        return cls(target, target_path, draft_path, prompts, [s.tokens[s.n_prompt:] for s in seqs], directory=str(directory))
