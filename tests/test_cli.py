"""`speculant generate` on tiny real GGUF files: streamed text, the stats line, and one-line user errors (exit 2)."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

import speculant.cli as cli
from speculant.cli import main
from speculant.testing.tiny_gguf import write_tiny_model

STATS = re.compile(r"^load [\d.]+ s \| prompt (\d+) tok, [\d.]+ tok/s \| decode (\d+) tok, [\d.]+ tok/s$")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-models")
    return {
        "qwen2": write_tiny_model(d / "qwen2.gguf", "qwen2"),
        "gemma3": write_tiny_model(d / "gemma3.gguf", "gemma3", tokenizer="llama", qtype="Q8_0"),
    }


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def generate(capsys, *args: str) -> tuple[int, str, str]:
    """`speculant generate ARGS` in this process; one thread, as tiny matmuls only lose from more."""
    rc = main(["generate", "--threads", "1", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def stats(err: str) -> tuple[int, int]:
    """(prompt tokens, generated tokens) from stderr, which must be exactly the stats line."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    m = STATS.match(lines[0])
    assert m, lines[0]
    return int(m[1]), int(m[2])


# --- generating --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_generate_streams_prompt_then_text_and_ends_with_stats(capsys, models, arch):
    rc, out, err = generate(capsys, "-m", models[arch], "-p", "def add", "-n", "8")
    assert rc == 0
    assert out.startswith("def add") and out.endswith("\n")
    assert len(out) > len("def add\n")
    n_prompt, n_gen = stats(err)
    assert n_prompt >= 2 and 1 <= n_gen <= 8


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_chat_wraps_the_prompt_in_the_template_and_does_not_echo_it(capsys, models, arch):
    _, _, raw_err = generate(capsys, "-m", models[arch], "-p", "hello", "-n", "4")
    rc, out, err = generate(capsys, "-m", models[arch], "-p", "hello", "-n", "4", "--chat")
    assert rc == 0
    assert not out.startswith("hello")
    assert stats(err)[0] > stats(raw_err)[0]  # the template's turn markers are prompt tokens too


def test_same_seed_same_text_other_seed_other_text(capsys, models):
    sampling = ["-m", models["qwen2"], "-p", "def", "-n", "16",
                "--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0"]
    a = generate(capsys, *sampling, "--seed", "7")[1]
    b = generate(capsys, *sampling, "--seed", "7")[1]
    c = generate(capsys, *sampling, "--seed", "8")[1]
    assert a == b
    assert a != c


def test_end_of_generation_tokens_are_not_printed(capsys, models, monkeypatch):
    real_load = cli.load

    def load_where_every_token_ends_generation(args):
        model = real_load(args)
        model.tokenizer.eog_ids = frozenset(range(model.tokenizer.n_vocab))
        return model

    monkeypatch.setattr(cli, "load", load_where_every_token_ends_generation)
    rc, out, err = generate(capsys, "-m", models["qwen2"], "-p", "def add", "-n", "8")
    assert rc == 0
    assert out == "def add\n"  # the one token generated is an end-of-generation token
    assert stats(err)[1] == 1


def test_n_predict_is_clamped_to_what_the_context_has_left(capsys, models):
    rc, _, err = generate(capsys, "-m", models["qwen2"], "-p", "def add", "-n", "100", "-c", "8")
    assert rc == 0
    n_prompt, n_gen = stats(err)
    assert 1 <= n_gen <= 8 - n_prompt


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("draft", [False, True], ids=["target", "with-draft"])
def test_threads_reach_the_backends_thread_pools(capsys, models, threads, draft, monkeypatch):
    """-t sets the native kernels' pool (and torch's threads without it), not only torch's; a
    draft model loaded after the target does not set it back to SPECULANT_THREADS or all cores."""
    from speculant_cpu import native

    monkeypatch.setenv("SPECULANT_THREADS", "3")
    args = ["generate", "-m", models["qwen2"], "-p", "def", "-n", "1", "--threads", str(threads)]
    assert main(args + (["-md", models["qwen2"], "--spec-type", "draft-simple"] if draft else [])) == 0
    lib = native.load()
    if lib is not None:
        assert lib.spk_threads() == threads
        assert torch.get_num_threads() == 1  # torch keeps one thread beside the native pool
    else:
        assert torch.get_num_threads() == threads


def test_help_exits_0(capsys):
    assert main(["generate", "--help"]) == 0
    assert "--top-p" in capsys.readouterr().out


# --- user errors: exit 2, one line on stderr, nothing on stdout ---------------------------------
def one_error_line(capsys, *args: str) -> str:
    rc, out, err = generate(capsys, *args)
    assert rc == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def write_unsupported_arch(path) -> str:
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_unsupported_tensor_type(path) -> str:
    w = GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 66), dtype=np.uint8), raw_dtype=GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_missing_file(capsys, tmp_path):
    line = one_error_line(capsys, "-m", str(tmp_path / "absent.gguf"), "-p", "hi")
    assert "absent.gguf" in line and "no such file" in line


def test_not_a_gguf(capsys, tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("just some text, not a model\n")
    line = one_error_line(capsys, "-m", str(path), "-p", "hi")
    assert "notes.gguf" in line and "not a GGUF" in line


def test_truncated_file(capsys, tmp_path, models):
    data = open(models["qwen2"], "rb").read()
    path = tmp_path / "half.gguf"
    path.write_bytes(data[: len(data) // 2])
    line = one_error_line(capsys, "-m", str(path), "-p", "hi")
    assert "half.gguf" in line and "truncated" in line


def test_unsupported_architecture(capsys, tmp_path):
    path = write_unsupported_arch(tmp_path / "mamba.gguf")
    line = one_error_line(capsys, "-m", path, "-p", "hi")
    assert "mamba.gguf" in line and "architecture 'mamba' is not supported" in line


def test_unsupported_tensor_type(capsys, tmp_path):
    path = write_unsupported_tensor_type(tmp_path / "iq2.gguf")
    line = one_error_line(capsys, "-m", path, "-p", "hi")
    assert "iq2.gguf" in line and "IQ2_XXS" in line and "not supported" in line


def test_unreadable_file_is_one_line_naming_it(capsys, models, monkeypatch):
    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("speculant.loader.open_gguf", refuse)
    line = one_error_line(capsys, "-m", models["qwen2"], "-p", "hi")
    assert "qwen2.gguf" in line and "Permission denied" in line


def test_prompt_longer_than_the_context(capsys, models):
    line = one_error_line(capsys, "-m", models["qwen2"], "-p", "def add(a, b): return a + b " * 4, "-c", "16")
    assert re.search(r"prompt has \d+ tokens, the context holds 16\b", line), line


@pytest.mark.parametrize("flag, value", [
    ("--temp", "-0.5"), ("--temp", "nan"), ("--temp", "hot"),
    ("--top-p", "0"), ("--top-p", "1.5"),
    ("--min-p", "-0.1"), ("--min-p", "1.01"),
    ("--top-k", "-1"), ("-n", "0"), ("-c", "1"), ("--threads", "0"), ("--seed", "x"), ("--seed", str(2**64)),
])
def test_bad_flag_values(capsys, models, flag, value):
    line = one_error_line(capsys, "-m", models["qwen2"], "-p", "hi", flag, value)
    assert flag in line and value in line


def test_missing_required_flag(capsys):
    line = one_error_line(capsys, "-p", "hi")
    assert "-m/--model" in line


def test_console_run_exits_2_without_traceback(tmp_path):
    missing = str(tmp_path / "absent.gguf")
    r = subprocess.run([sys.executable, "-m", "speculant.cli", "generate", "-m", missing, "-p", "hi"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == f"speculant: error: {missing}: no such file\n"


def test_bench_runs_plain_and_speculative_with_identical_outputs(models, tmp_path, capsys):
    import json

    workloads = tmp_path / "w.json"
    workloads.write_text(json.dumps([{"name": "repeat", "prompt": "a b c a b c a b c a b", "max_tokens": 12}]))
    out_json = tmp_path / "bench.json"
    assert main(["bench", "-m", str(models["qwen2"]), "--workloads", str(workloads), "--spec-type", "ngram-simple",
                 "--json", str(out_json), "-t", "1"]) == 0
    text = capsys.readouterr().out
    assert "peak RSS" in text and "ngram-simple" in text
    results = json.loads(out_json.read_text())["results"]
    assert [r["spec"] for r in results] == ["none", "ngram-simple"] and all(r["identical"] for r in results)


def test_bench_kernels_prints_the_cost_ratio_by_rows(models, capsys):
    assert main(["bench", "-m", str(models["qwen2"]), "--kernels", "--kernels-context", "8", "-t", "1"]) == 0
    text = capsys.readouterr().out
    for rows in (1, 2, 4, 8, 16):
        assert re.search(rf"^\s+{rows}\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", text, re.M), text
    assert "time split at 16 row(s)" in text


def test_bench_without_workloads_or_kernels_is_one_line(models, capsys):
    assert main(["bench", "-m", str(models["qwen2"])]) == 2
    assert "--workloads" in capsys.readouterr().err
