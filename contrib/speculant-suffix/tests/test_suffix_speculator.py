"""The suffix speculator's own behaviour: what it drafts from, sharing between sequences, the
thresholds, the memory cap. (speculant's contract suite checks the lifecycle rules.)"""
from __future__ import annotations

import pytest

from speculant import DraftLimits, SequenceView, SpeculantError
from speculant.speculator import SpeculatorConfig

from speculant_suffix import SuffixSpeculator
from speculant_suffix.speculator import GlobalIndex

LIMITS = DraftLimits(n_max=16)


def make(**options) -> SuffixSpeculator:
    return SuffixSpeculator(SpeculatorConfig("suffix", {f"spec_suffix_{k}": v for k, v in options.items()}))


def view(seq_id, tokens, n_prompt=None):
    return SequenceView(seq_id, tuple(tokens), len(tokens) if n_prompt is None else n_prompt)


def draft(spec, seq_id, tokens, n_prompt=None, limits=LIMITS):
    d = spec.propose(view(seq_id, tokens, n_prompt), limits)
    return None if d is None else list(d.tokens)


def generate(spec, seq_id, prompt, output):
    """begin, then accept the output token by token, then end (the output joins the shared index)."""
    spec.begin(view(seq_id, prompt))
    for i in range(1, len(output) + 1):
        spec.accept(view(seq_id, prompt + output[:i], len(prompt)))
    spec.end(seq_id)


def test_drafts_the_continuation_from_the_prompt():
    spec = make()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41, 1, 2, 3]
    spec.begin(view(0, prompt))
    # "1 2 3" (match length 3, max_spec_factor 1) -> at most 3 tokens
    assert draft(spec, 0, prompt) == [4, 5, 6]
    assert draft(spec, 0, prompt, limits=DraftLimits(n_max=2)) == [4, 5]
    assert make(max_spec_factor=4.0).propose(view(0, prompt), LIMITS).tokens == (4, 5, 6, 7, 8, 9, 40, 41, 1, 2, 3)
    assert draft(spec, 0, [90, 91]) is None  # nothing known about these tokens


def test_outputs_are_shared_once_their_sequence_ends():
    spec = make(max_spec_factor=8.0)
    out = [20, 21, 22, 23, 24, 25, 26, 27]
    spec.begin(view(0, [1, 2]))
    for i in range(1, len(out) + 1):
        spec.accept(view(0, [1, 2] + out[:i], 2))
    spec.begin(view(1, [5, 6, 20, 21]))
    assert draft(spec, 1, [5, 6, 20, 21]) is None  # sequence 0 is still running: its text is its own
    spec.end(0)
    assert draft(spec, 1, [5, 6, 20, 21]) == [22, 23, 24, 25, 26, 27]
    assert len(spec.global_index) == len(out)  # the output only, not the prompt
    spec.begin(view(2, [1, 2]))
    assert draft(spec, 2, [1, 2]) is None


def test_most_frequent_continuation_and_min_token_prob():
    spec = make(max_spec_factor=4.0, min_token_prob=0.5)
    for i, tail in enumerate([[9, 9], [9, 9], [8, 8]]):
        generate(spec, i, [0], [30, 31, 32] + tail)
    assert draft(spec, 10, [50, 30, 31, 32]) == [9, 9]  # 2 of 3 continue with 9, then 9 for sure
    spec = make(max_spec_factor=4.0, min_token_prob=0.5)
    for i, tail in enumerate([[7], [8], [9]]):
        generate(spec, i, [0], [30, 31, 32] + tail)
    assert draft(spec, 10, [50, 30, 31, 32]) is None  # 1/3 each: below 0.5
    assert draft(spec, 10, [50, 30, 31, 32], limits=DraftLimits(n_max=16, p_min=0.9)) is None


def test_global_index_is_bounded_and_forgets_the_oldest_outputs():
    idx = GlobalIndex(max_depth=8, max_tokens=40)  # two generations of 20 tokens
    outputs = [[100 + 10 * i + j for j in range(8)] for i in range(10)]
    for i, out in enumerate(outputs):
        idx.add(out)
        assert len(idx) <= 40
    found = [any(a.match(out[:3])[1] == 3 for a in idx.automata()) for out in outputs]
    assert found == [False] * 6 + [True] * 4  # the oldest generation went whole
    idx.add(list(range(500, 600)))  # longer than a generation: its last 20 tokens are kept
    assert len(idx.young) == 20 and len(idx) <= 40
    assert idx.young.match([580, 581])[1] == 2 and idx.young.match([579])[1] == 0


def test_no_shared_index():
    spec = make(max_cached_tokens=0)
    generate(spec, 0, [1], [20, 21, 22, 23])
    assert len(spec.global_index) == 0 and draft(spec, 1, [20, 21]) is None


def test_state_nbytes_counts_the_sequences_own_index():
    spec = make()
    spec.begin(view(0, list(range(50))))
    small = spec.state_nbytes(0)
    spec.accept(view(0, list(range(50)) + list(range(100, 600)), 50))
    assert 0 < small < spec.state_nbytes(0)
    spec.end(0)  # its output moves to the shared index, which no sequence is charged for
    assert spec.state_nbytes(0) is None


def test_a_shorter_history_without_truncate_rebuilds():
    spec = make(max_spec_factor=4.0)
    prompt = [1, 2, 3, 4, 5, 1, 2]
    spec.begin(view(0, prompt))
    assert draft(spec, 0, prompt + [3, 4, 5, 1, 2]) == [3, 4, 5, 1, 2, 3, 4, 5]
    # the caller went back without telling (as after a failed step): the index follows the history
    assert draft(spec, 0, [1, 2, 3, 9, 1, 2]) == [3, 9, 1, 2]
    assert spec.seqs[0].tokens == [1, 2, 3, 9, 1, 2]


@pytest.mark.parametrize("name,value,message", [
    ("max_depth", 1, "--spec-suffix-max-depth must be in [2, 1024], got 1"),
    ("max_depth", 2.5, "--spec-suffix-max-depth must be an integer, got 2.5"),
    ("min_token_prob", 1.5, "--spec-suffix-min-token-prob must be in [0.0, 1.0], got 1.5"),
    ("max_spec_factor", -1.0, "--spec-suffix-max-spec-factor must be in [0.0, inf], got -1.0"),
    ("max_cached_tokens", "many", "--spec-suffix-max-cached-tokens must be an integer, got 'many'"),
])
def test_bad_options_name_their_flag(name, value, message):
    with pytest.raises(SpeculantError) as e:
        make(**{name: value})
    assert str(e.value) == message


def test_flags_reach_the_speculator():
    import argparse

    from speculant.plugins import load_registry
    from speculant.speculator import build_speculators

    reg = load_registry()
    parser = argparse.ArgumentParser()
    reg.add_options(parser)
    args = parser.parse_args(["--spec-suffix-max-depth", "12", "--spec-suffix-min-token-prob", "0.3",
                              "--spec-suffix-max-spec-factor", "2", "--spec-suffix-max-cached-tokens", "64"])
    spec = build_speculators(["suffix"], vars(args), registry=reg)[0]
    assert isinstance(spec, SuffixSpeculator)
    assert (spec.max_depth, spec.min_token_prob, spec.max_spec_factor, spec.global_index.max_tokens) == (12, 0.3, 2.0, 64)
    defaults = build_speculators(["suffix"], vars(parser.parse_args([])), registry=reg)[0]
    assert (defaults.max_depth, defaults.min_token_prob, defaults.max_spec_factor) == (24, 0.1, 1.0)
