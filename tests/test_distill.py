"""Self-distillation data (speculant.distill) and the recipes of speculant.training: requests
built from local files, the target's greedy answers written resumably, shards collected over
them, and trainers mixing data directories."""
from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from speculant import load_model
from speculant.distill import SCRATCH_ASKS, SCRATCH_TAILS, TASK_LANGUAGES, answer, documents, requests
from speculant.distill_tasks import EXCLUDED, TASK_ASKS, TASK_TAILS, TASKS
from speculant.engine import Engine, EngineConfig
from speculant.recording import StateRecorder
from speculant.testing.tiny_gguf import write_tiny_model
from speculant import training
from speculant.training import Shards, collect, held_out_by_directory, split

SOURCES = ["core/speculant/*.py", "plugins/*/speculant_*/*.py"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    path = write_tiny_model(tmp_path_factory.mktemp("distill") / "qwen2.gguf", "qwen2", n_layers=2, n_embd=64, n_ctx=4096)
    return load_model(str(path))


def test_requests_are_varied_deterministic_and_not_the_workloads():
    first = [m for _, m in zip(range(120), requests(SOURCES))]
    again = [m for _, m in zip(range(120), requests(SOURCES))]
    assert first == again
    users = [m[-1]["content"] for m in first]
    assert all(m[-1]["role"] == "user" for m in first)
    kinds = {"code": sum("```python" in u for u in users), "spec": sum(u.startswith(("Write a", "Implement", "In Python")) for u in users),
             "data": sum(u.split("\n")[0].endswith(("table.", ".", "list.")) and ("{" in u or "," in u.split("\n", 1)[-1]) and "```" not in u
                         for u in users)}
    assert all(v > 5 for v in kinds.values()), kinds
    assert len({m[0]["content"] for m in first if m[0]["role"] == "system"}) >= 3
    # Never the benchmark workloads: none of their requests' text is in ours.
    workloads = json.load(open("tests/data/workloads-public.json"))
    for w in workloads if isinstance(workloads, list) else workloads["workloads"]:
        text = w["messages"][-1]["content"][:80]
        assert not any(text in u for u in users)


def test_scratch_requests_ask_for_code_from_a_description():
    first = [m for _, m in zip(range(60), requests(SOURCES, "scratch"))]
    assert first == [m for _, m in zip(range(60), requests(SOURCES, "scratch"))]
    users = [m[-1]["content"] for m in first]
    assert len(users) == 60 and not any("```" in u for u in users)  # nothing given to work on
    assert sum(any(u.startswith(a.split("{")[0]) for u in users) for a in SCRATCH_ASKS) == len(SCRATCH_ASKS)
    assert sum(f" {lang}" in u for u in users for lang in ("C++", "Rust", "Go", "Python")) > 20
    assert all(u.endswith(tuple(t or "" for t in SCRATCH_TAILS)) for u in users)
    assert not any("Python's" in u and " in Python:" in u for u in users)
    workloads = json.load(open("tests/data/workloads-public.json"))
    for w in workloads if isinstance(workloads, list) else workloads["workloads"]:
        assert not any(w["messages"][-1]["content"][:60] in u for u in users)
    with pytest.raises(ValueError, match="unknown request kind"):
        next(requests(SOURCES, "other"))


def test_task_requests_cover_the_catalog_and_leave_the_measured_asks_out():
    """The tasks kind: every (task, language) pair once, in a fixed order, phrased every way; no
    request names what a head is measured on (the public free-quicksort-c, the --free check's asks)."""
    asked = list(requests([], "tasks"))
    assert asked == list(requests([], "tasks")) and len(asked) == len(TASKS) * len(TASK_LANGUAGES)
    users = [m[-1]["content"] for m in asked]
    assert len(set(users)) == len(users)
    for _, what in TASKS:  # each task's description is asked in every language
        assert sum(what[1:] in u for u in users) == len(TASK_LANGUAGES), what
    for lang in TASK_LANGUAGES:
        named = re.compile(rf"\b(in|a) {re.escape(lang)}(?![\w+])")
        assert sum(bool(named.search(u)) for u in users) == len(TASKS), lang
    assert all(any(u.startswith(a.split("{")[0]) for u in users) for a in TASK_ASKS)
    assert all(sum(u.endswith(t) for u in users) > 20 for t in TASK_TAILS if t)
    assert " a a" not in " ".join(users) and " a e" not in " ".join(users)  # articles agree
    text = [" ".join(part["content"] for part in m).lower() for m in asked]
    assert not any(word in t for t in text for word in EXCLUDED)
    assert {"quicksort", "lru", "stack"} <= set(EXCLUDED)
    workloads = json.load(open("tests/data/workloads-public.json"))
    for w in workloads if isinstance(workloads, list) else workloads["workloads"]:
        assert not any(w["messages"][-1]["content"][:40] in u for u in users)


def test_answers_are_the_targets_greedy_answers_and_resume(tiny, tmp_path):
    path = tmp_path / "answers.jsonl"
    held = answer(tiny, str(path), 600, SOURCES, batch=3, max_tokens=12, max_prompt=400, log=lambda m: None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert held >= 600 and held == sum(len(r["prompt"]) + len(r["answer"]) for r in rows)
    # Batched answers are each request's own greedy answer, decoded alone.
    for r in rows[:3]:
        alone = Engine(tiny, EngineConfig(n_ctx=512, spec_deadline=None))
        assert list(alone.generate(r["prompt"], 12)) == r["answer"]
    # A torn last line is dropped and the request answered again; more tokens resume after.
    path.write_text(path.read_text() + '{"index": 99, "prom')
    more = answer(tiny, str(path), 1200, SOURCES, batch=3, max_tokens=12, max_prompt=400, log=lambda m: None)
    rows2 = [json.loads(line) for line in path.read_text().splitlines()]
    assert more >= 1200 and rows2[: len(rows)] == rows
    indices = [r["index"] for r in rows2]
    assert len(indices) == len(set(indices))
    assert [ids for _, ids in documents(str(path))] == [r["prompt"] + r["answer"] for r in rows2]
    # The scratch kind: its own requests, from `start` on, answered the same way.
    scratch = tmp_path / "scratch.jsonl"
    answer(tiny, str(scratch), 300, SOURCES, batch=3, max_tokens=12, max_prompt=400, start=2, kind="scratch", log=lambda m: None)
    srows = [json.loads(line) for line in scratch.read_text().splitlines()]
    asked = {i: m for i, m in zip(range(40), requests(SOURCES, "scratch"))}
    assert srows and min(r["index"] for r in srows) >= 2
    assert all(r["prompt"] == tiny.tokenizer.encode_chat(asked[r["index"]]) for r in srows)
    # Speculators decode the same answers.
    fast = tmp_path / "fast.jsonl"
    answer(tiny, str(fast), 600, SOURCES, batch=3, max_tokens=12, max_prompt=400, spec_types="ngram-simple,ngram-map-k",
           log=lambda m: None)
    by_index = lambda rs: sorted(rs, key=lambda r: r["index"])  # they may finish in another order
    assert by_index(json.loads(line) for line in fast.read_text().splitlines()) == by_index(rows)


def test_collect_self_recipe_and_mixing(tiny, tmp_path):
    n = tiny.info.n_layers
    quiet = lambda m: None
    self_dir, read_dir = tmp_path / "self", tmp_path / "read"
    m = collect(tiny, str(self_dir), 800, SOURCES, (n,), recipe="self", answer_batch=4, answer_tokens=16, log=quiet)
    assert m["recipe"] == "self" and m["tokens"] >= 800
    answers = [ids for _, ids in documents(m["answers"])]
    shards = Shards(str(self_dir))
    s = shards.shards[0]
    # The rows are the answered chat turns, but their last token (never fed while answering).
    assert s["tokens"][: len(answers[0]) - 1].tolist() == answers[0][:-1]
    # The same directory refuses the other recipe; another one mixes with it in training.
    with pytest.raises(ValueError, match="recipe"):
        collect(tiny, str(self_dir), 1600, SOURCES, (n,), recipe="read", log=quiet)
    collect(tiny, str(read_dir), 500, SOURCES, (n,), piece_tokens=100, log=quiet)
    both = Shards([str(self_dir), str(read_dir)])
    assert len(both.documents()) == len(Shards(str(self_dir)).documents()) + len(Shards(str(read_dir)).documents())
    # What a training run on both holds out, told apart by directory (the held-out scripts' split)
    _, held = split(both.documents(), held_every=3)  # a few documents here: every third held out
    _, by_dir = held_out_by_directory([str(self_dir), str(read_dir)], held_every=3)
    assert list(by_dir) == [str(self_dir), str(read_dir)] and all(by_dir.values())
    assert sorted(sum(by_dir.values(), [])) == sorted(held)
    first = len(Shards(str(self_dir)).shards)
    assert all(doc[0] < first for doc in by_dir[str(self_dir)]) and all(doc[0] >= first for doc in by_dir[str(read_dir)])
    other = tmp_path / "other"
    collect(tiny, str(other), 300, SOURCES, (n - 1,), piece_tokens=100, log=quiet)
    with pytest.raises(ValueError, match="cannot be mixed"):
        Shards([str(self_dir), str(other)])


def _rows(shards: Shards) -> list[dict]:
    return [{k: np.asarray(shards.shards[i][k][a:b]) for k in ("tokens", "hidden", "top_ids", "top_p")}
            for i, a, b in shards.documents()]


def test_states_kept_while_answering_equal_the_target_reading_the_answers_again(tiny, tmp_path, monkeypatch):
    """New answers' rows are recorded as the target computes them while it answers (a second
    pass over them is what the collection used to cost); they equal the rows the target gives
    reading the written answers back, a run that dies loses only its open shard, and an answer
    whose rows the recorder lacks is read again."""
    n = tiny.info.n_layers
    quiet = lambda m: None
    answers = str(tmp_path / "answers.jsonl")
    kept = collect(tiny, str(tmp_path / "kept"), 1500, SOURCES, (0, n), recipe="self", answers=answers, answer_batch=3,
                   answer_tokens=16, log=quiet)
    docs = [ids for _, ids in documents(answers)]
    assert kept["pieces"] == len(docs) >= 3 and kept["tokens"] == sum(len(d) - 1 for d in docs) >= 1500
    # Another directory reads the same answers back (all of them: no new answers are made).
    read = collect(tiny, str(tmp_path / "read"), sum(map(len, docs)), SOURCES, (0, n), recipe="self", answers=answers,
                   log=quiet)
    assert read["pieces"] == len(docs) and [ids for _, ids in documents(answers)] == docs
    recorded, again = _rows(Shards(str(tmp_path / "kept"))), _rows(Shards(str(tmp_path / "read")))
    assert len(recorded) == len(again) == len(docs)
    for r, a, ids in zip(recorded, again, docs):
        assert r["tokens"].tolist() == ids[:-1] and a["tokens"].tolist() == ids
        assert r["hidden"].shape == (len(ids) - 1, 2 * tiny.info.n_embd)
        np.testing.assert_allclose(r["hidden"].astype(np.float32), a["hidden"][:-1].astype(np.float32), atol=2e-3, rtol=1e-2)
        assert (r["top_ids"][:, 0] == a["top_ids"][:-1, 0]).mean() > 0.98
        np.testing.assert_allclose(r["top_p"][:, 0].astype(np.float32), a["top_p"][:-1, 0].astype(np.float32), atol=2e-3)
    # An answer row's recorded top-1 is the token the target answered with; the answers are the
    # target's greedy answers, decoded alone (the recorder drafts nothing). The probabilities are
    # stored as float16, where two next tokens can tie (the prompts depend on where the checkout
    # lies: sources.py orders files by a hash of their path): the answer is then one of the two.
    for r, row in zip(recorded, (json.loads(line) for line in open(answers))):
        n_prompt = len(row["prompt"])
        top_ids, top_p = r["top_ids"][n_prompt - 1:, :2].tolist(), r["top_p"][n_prompt - 1:, :2]
        for j, token in enumerate(row["answer"][: len(r["tokens"]) - n_prompt + 1]):
            assert top_ids[j][0] == token or (top_ids[j][1] == token and top_p[j, 0] == top_p[j, 1]), (j, top_ids[j], token)
        # room for the prompt and the 16 tokens: how long the prompts are depends on the checkout's path
        alone = Engine(tiny, EngineConfig(n_ctx=n_prompt + 16, spec_deadline=None))
        assert list(alone.generate(row["prompt"], 16)) == row["answer"]
    # A run that died with its last shard open: the next one reads those answers back, in order.
    monkeypatch.setattr(training, "SHARD_TOKENS", 600)
    directory = tmp_path / "kept-small"
    kept = collect(tiny, str(directory), 1500, SOURCES, (0, n), recipe="self", answers=str(tmp_path / "more.jsonl"),
                   answer_batch=3, answer_tokens=16, log=quiet)
    more = [ids for _, ids in documents(str(tmp_path / "more.jsonl"))]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 2
    lost = Shards(str(directory)).shards[-1]
    manifest["tokens"] -= len(lost["tokens"])
    manifest["pieces"] -= len(lost["docs"]) - 1
    manifest["shards"].pop()
    (directory / "manifest.json").write_text(json.dumps(manifest))
    resumed = collect(tiny, str(directory), manifest["tokens"] + sum(map(len, more[manifest["pieces"]:])), SOURCES, (0, n),
                      recipe="self", answers=str(tmp_path / "more.jsonl"), log=quiet)
    assert resumed["pieces"] == len(more) == kept["pieces"]
    assert [r["tokens"].tolist() for r in _rows(Shards(str(directory)))] == \
        [ids[:-1] for ids in more[: manifest["pieces"]]] + more[manifest["pieces"]:]
    # A sequence the recorder holds no rows of (its hook raised, say) is read again.
    got = []
    recorder = StateRecorder(tiny, (0, n), 8, lambda *a: got.append(a))
    assert recorder.finish(7, docs[0]) == len(docs[0]) - 1 and recorder.recomputed == 1 and recorder.rows == len(docs[0]) - 1
    tokens, hidden, top_ids, top_p = got[0]
    assert tokens == docs[0][:-1]
    np.testing.assert_allclose(hidden.numpy(), again[0]["hidden"][:-1].astype(np.float32), atol=2e-3, rtol=1e-2)
    assert (top_ids[:, 0].numpy() == again[0]["top_ids"][:-1, 0]).mean() > 0.98


def test_train_mtp_on_its_own_answers_mixed_with_read_data(tmp_path):
    """`speculant train mtp --recipe self --mix DIR`: answers, shards, a sidecar whose summary
    names the recipe and the mix and counts the rows of both directories."""
    from speculant.cli import main
    from speculant.gguf import open_gguf

    torch.set_num_threads(1)
    model = write_tiny_model(tmp_path / "qwen2.gguf", "qwen2", n_layers=2, n_embd=64, n_ctx=2048)
    common = ["-m", str(model), "--source", SOURCES[0], "--batch", "2", "--window", "32", "--ffn", "32", "--steps", "4",
              "--save-every", "2", "--qtype", "F32", "--precision", "fp32", "-t", "1", "--train-vocab", "100"]
    read_dir = tmp_path / "read"
    assert main(["train", "mtp", "-o", str(tmp_path / "a.gguf"), "--data", str(read_dir), "--tokens", "400",
                 "--piece-tokens", "100", *common]) == 0
    out = tmp_path / "mtp.gguf"
    assert main(["train", "mtp", "-o", str(out), "--data", str(tmp_path / "self"), "--tokens", "600", "--recipe", "self",
                 "--answer-tokens", "16", "--answer-batch", "4", "--mix", str(read_dir), *common]) == 0
    summary = json.loads(open_gguf(str(out)).metadata["speculant.training"])
    assert summary["recipe"] == "self" and summary["mix"] == [str(read_dir)]
    rows = [json.loads((d / "manifest.json").read_text())["tokens"] for d in (tmp_path / "self", read_dir)]
    assert summary["tokens"] == sum(rows) and min(rows) > 0  # the rows trained on: --data's and --mix's
    assert (tmp_path / "self" / "answers.jsonl").exists()


def test_training_gets_the_cores_back_from_the_loaded_target():
    """Loading a target with the native CPU kernels leaves torch one thread; the trainers call
    training_threads after collecting, which gives torch every core this process may use (or
    the user's -t)."""
    import os

    from speculant.training import training_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cores = len(os.sched_getaffinity(0))
        assert training_threads(None) == cores == torch.get_num_threads()
        assert training_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_answers_tail_holds_what_a_training_with_those_tokens_did_not_read(tmp_path):
    # A training with --tokens N reads documents in file order up to the one that crosses N;
    # the tail is every answer after that one, and reading it back yields exactly its rows.
    rows = [{"index": i, "prompt": [1] * (3 + i), "answer": [2] * 4, "finish": "stop"} for i in range(6)]
    src = tmp_path / "answers.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = tmp_path / "tail.jsonl"
    script = Path(__file__).resolve().parent.parent / "scripts" / "answers_tail.py"
    # documents of 7, 8, 9, ... rows: 15 rows end with the second, 16 end inside the third
    for tokens, kept in ((15, [2, 3, 4, 5]), (16, [3, 4, 5])):
        done = subprocess.run([sys.executable, str(script), str(src), str(tokens), str(out)], capture_output=True, text=True,
                              check=True)
        assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == kept
        read = sum(map(len, (ids for _, ids in documents(str(out)))))
        assert read == sum(3 + i + 4 for i in kept)
        assert f"{len(kept)} answers after the first {6 - len(kept)}, {read} rows" in done.stdout
