"""How fast could speculation go on a workload, and what holds the speculators back?

    .venv/bin/python scripts/spec_bounds.py -m MODEL.gguf --workload code-edit-bisect

Three measurements, in one process:

1. plain decoding (its tokens are the answer every speculator must reproduce);
2. an *oracle* speculator that drafts the answer's own next tokens, so every draft is accepted in
   full: the upper bound the target's verification cost allows, per draft cap (--n-max);
3. a replay of suffix decoding (contrib/speculant-suffix) along the answer under several
   policies, each step priced with the forward cost measured by row count (1 to the largest
   draft cap + 1) at the workload's context length: how many steps each policy needs and what tok/s that implies. No model runs
   in the replay, so many policies cost nothing.

docs/benchmarks.md ("Why code-edit-bisect stops short of 2x") quotes its output.
"""
from __future__ import annotations

import argparse
import statistics
import time

from speculant import Draft, hookimpl
from speculant.bench import load_workloads, prompt_tokens, run_once
from speculant.engine import EngineConfig
from speculant.loader import load_model
from speculant.types import Batch


class Oracle:
    """Drafts the known answer's next tokens."""

    spec_type = "oracle"

    def __init__(self, prompt: list[int], answer: list[int], n_max: int):
        self.n_prompt, self.answer, self.n_max = len(prompt), answer, n_max

    @hookimpl
    def propose(self, seq, limits):
        done = len(seq.tokens) - self.n_prompt
        draft = self.answer[done : done + min(self.n_max, limits.n_max)]
        return Draft(tuple(draft), self.spec_type) if draft else None


def forward_costs(model, context_len: int, max_rows: int, repeats: int = 5) -> dict[int, float]:
    """Median ms of a forward over 1..max_rows rows after context_len cached tokens."""
    context = model.new_context(context_len + max_rows)
    model.forward(Batch.for_sequence(0, 0, [(31 * i + 7) % 1000 for i in range(context_len)], logits="none"), context)
    costs = {}
    for rows in range(1, max_rows + 1):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.forward(Batch.for_sequence(0, context_len, [(17 * i + 101) % 1000 for i in range(rows)], logits="all"), context)
            times.append(time.perf_counter() - t0)
            context.truncate(0, context_len)
        costs[rows] = 1000 * statistics.median(times)
    return costs


def replay_suffix(prompt, answer, costs, depth=24, factor=1.0, min_prob=0.1, n_max=16, min_match=0):
    """Suffix drafting along `answer` as the engine would run it without adaptive trimming:
    (tok/s implied by the costs, steps, drafts that failed at their first token). The draft is
    SuffixSpeculator.propose's over the sequence's own index, written out here because the
    replay also needs the match length (for `min_match`), which the speculator does not expose:
    keep the two in step."""
    from speculant_suffix.automaton import SuffixAutomaton

    index = SuffixAutomaton(depth)
    index.extend(prompt)
    context, t, ms, steps, first_fail = list(prompt), 0, 0.0, 0, 0
    while t < len(answer):
        state, n = index.match(context)
        best, best_score, best_m = None, 0.0, 0
        for s, m in index.suffixes(state, n):
            k = min(n_max, int(factor * m + 1e-9))
            if k <= 0:
                break
            tokens, score = index.greedy_path(s, m, k, min_prob)
            if score > best_score:
                best, best_score, best_m = tokens, score, m
        if best and best_m < min_match:
            best = None
        accepted = 0
        while best and accepted < len(best) and t + accepted < len(answer) and best[accepted] == answer[t + accepted]:
            accepted += 1
        first_fail += bool(best) and accepted == 0
        ms += costs[1 + len(best or ())]
        steps += 1
        new = answer[t : t + accepted + 1]
        index.extend(new)
        context += new
        t += len(new)
    return 1000 * len(answer) / ms, steps, first_fail


POLICIES = [  # (max_depth, max_spec_factor, min_token_prob, draft cap, min match length)
    (24, 1.0, 0.1, 16, 0), (24, 1.0, 0.1, 32, 0), (64, 1.0, 0.1, 32, 0), (64, 1.0, 0.1, 48, 0),
    (24, 1.0, 0.1, 32, 2), (24, 1.0, 0.1, 32, 3), (64, 2.0, 0.1, 32, 0), (64, 1.0, 0.3, 32, 0),
    (64, 1.0, 0.5, 32, 0),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--workloads", default="tests/data/workloads-public.json")
    p.add_argument("--workload", default="code-edit-bisect")
    p.add_argument("--n-max", type=int, nargs="+", default=[8, 16, 32], help="oracle draft caps")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    model = load_model(args.model, progress=False)
    workload = next(w for w in load_workloads(args.workloads) if w.get("name") == args.workload)
    prompt, n = prompt_tokens(model, workload), int(workload.get("max_tokens", 256))
    plain = [run_once(model, prompt, n, EngineConfig(), []) for _ in range(args.repeats)]
    answer = plain[0]["tokens"]
    print(f"{args.workload}: {len(prompt)} prompt tokens, {len(answer)} generated")
    print(f"plain decoding      {statistics.median(r['decode_tok_s'] for r in plain):7.2f} tok/s")
    for n_max in args.n_max:
        runs = [run_once(model, prompt, n, EngineConfig(draft_n_max=n_max, adaptive=False), [Oracle(prompt, answer, n_max)])
                for _ in range(args.repeats)]
        assert all(r["tokens"] == answer for r in runs), "the oracle changed the output"
        print(f"oracle, drafts of {n_max:<2} {statistics.median(r['decode_tok_s'] for r in runs):7.2f} tok/s")

    costs = forward_costs(model, len(prompt) + len(answer) // 2, 1 + max(cap for *_, cap, _ in POLICIES))
    print("forward ms by rows: " + " ".join(f"{k}:{v:.1f}" for k, v in costs.items()))
    print("suffix replay: depth factor min_prob cap min_match -> tok/s, steps, drafts failing at their first token")
    for depth, factor, min_prob, cap, min_match in POLICIES:
        speed, steps, fails = replay_suffix(prompt, answer, costs, depth, factor, min_prob, cap, min_match)
        print(f"    {depth:>3} {factor:>4} {min_prob:>4} {cap:>3} {min_match:>2} -> {speed:6.1f} tok/s {steps:>4} steps {fails:>3}")


if __name__ == "__main__":
    main()
