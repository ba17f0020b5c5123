"""speculant's token-only speculators as a vLLM custom proposer (`method: "custom_class"`).

vLLM 0.33.0's contract, read from its source (the tests drive the class the same way):

* vllm/v1/spec_decode/custom_class_proposer.py:49 builds the class named by
  `speculative_config.model` as `cls(vllm_config)`; it must have a callable `propose`.
* vllm/v1/worker/gpu_model_runner.py:4744-4751 calls, once per step, after the step's
  bookkeeping (so each row's tokens already end with what was sampled this step):

      propose(sampled_token_ids,                 # list[list[int]], one per row: the tokens the
                                                 #   target accepted this step plus its own; []
                                                 #   for a row still in prefill (no draft then)
              input_batch.num_tokens_no_spec,    # np.ndarray int32 [max_num_reqs]: row length
              input_batch.token_ids_cpu,         # np.ndarray int32 [max_num_reqs, max_model_len]
              slot_mappings=...)                 # KV slots, of no use to a token-only drafter

  and takes back list[list[int]], a draft per row, [] for none (any length up to
  num_speculative_tokens, as its ngram and suffix proposers return).
* gpu_model_runner.py:5011 calls `load_model(target_model)` when the class has it.

The speculators are speculant's, built from the plugin registry and driven through their hooks
(vllm_speculant.chain); rows are matched to sequences by history (vllm_speculant.rows).
"""
from __future__ import annotations

from typing import Any, Sequence

from speculant import DraftLimits, DraftRequest, SequenceView, SpeculantError
from speculant.logs import get_logger

from vllm_speculant import options as options_mod
from vllm_speculant.chain import Chain
from vllm_speculant.rows import Rows

log = get_logger(__name__)


def build(spec_types: Sequence[str], values: dict[str, Any]) -> list[Any]:
    """The speculators, from speculant's registry; token-only ones, since vLLM hands a custom
    proposer no hidden states and no draft model of ours."""
    from speculant.speculator import build_speculators

    try:
        specs = build_speculators(list(spec_types), values)
    except SpeculantError as e:
        raise SpeculantError(f"{e} (vllm-speculant runs token-only speculators: n-gram types, suffix; "
                             "for an EAGLE3 head, export it with `speculant export-vllm` and use vLLM's eagle3)") from None
    for s in specs:
        if tuple(getattr(s, "hidden_layers", ()) or ()):
            raise SpeculantError(f"spec type '{s.spec_type}' reads the target's hidden states, which vLLM does not give a "
                                 "custom proposer; export the head instead (`speculant export-vllm`)")
    return specs


class SpeculantProposer:
    """A vLLM proposer running a chain of speculant speculators. The spec types come from
    `--spec-type` in $SPECULANT_VLLM_ARGS, or from a subclass's `spec_types` (the named classes
    of vllm_speculant)."""

    spec_types: tuple[str, ...] = ()

    def __init__(self, vllm_config: Any, args: str | None = None):
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        opts = options_mod.parse(tuple(self.spec_types), args)
        self.n_min = opts.n_min
        self.chain = Chain(build(opts.spec_types, opts.values))
        self.rows = Rows()
        log.info("vllm-speculant proposer ready", spec_types=",".join(opts.spec_types),
                 num_speculative_tokens=self.num_speculative_tokens)

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: the speculators draft from tokens."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings: Any = None) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        requests: list[DraftRequest] = []
        where: list[int] = []  # requests[k] is row where[k]
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a partial prefill: vLLM wants no draft, nothing is known yet
                continue
            n = int(num_tokens_no_spec[i])
            seq, new = self.rows.match(token_ids_cpu[i, :n], len(sampled))
            if new:
                self.chain.begin(SequenceView(seq.seq_id, seq.tokens[: seq.n_prompt], seq.n_prompt))
            view = SequenceView(seq.seq_id, seq.tokens, seq.n_prompt)
            self.chain.accept(view, *self._verified(seq.draft, sampled))
            seq.draft = None
            n_max = min(self.num_speculative_tokens, self.max_model_len - n - 1)
            if n_max > 0:  # vLLM skips a row at the context's end too
                requests.append(DraftRequest(view, DraftLimits(n_max=n_max, n_min=self.n_min)))
                where.append(i)
        for seq_id in self.rows.finish():
            self.chain.end(seq_id)
        for i, r, draft in zip(where, requests, self.chain.propose(requests)):
            if draft is not None and len(draft) > 0 and len(draft) >= self.n_min:
                self.rows.seqs[r.seq.seq_id].draft = draft
                out[i] = list(draft.tokens)
        return out

    @staticmethod
    def _verified(draft, sampled: list[int]):
        """(draft, n_accepted) for `accept`: the draft this row was given last step, and how much of
        it the target kept (all sampled tokens but the target's own last one). vLLM may have
        verified only a prefix of it (its scheduler can cut drafts); the kept tokens are a prefix of
        the draft either way. Anything else (no draft, or tokens that are not ours) is a step
        without a draft of ours."""
        k = len(sampled) - 1
        if draft is not None and k <= len(draft) and tuple(sampled[:k]) == tuple(draft.tokens[:k]):
            return draft, k
        return None, 0

    def request_count(self) -> int:
        """Sequences holding state now (for tests and logs)."""
        return len(self.rows)
