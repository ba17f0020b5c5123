"""Real clients against a real `python -m speculant_server` process on a free port: the official
`openai` package (chat and completions, streaming and not) and ../shared/bench/specbench.py."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from speculant.testing.tiny_gguf import write_tiny_model

openai = pytest.importorskip("openai")

SPECBENCH = Path(os.environ.get("SPECULANT_SPECBENCH", Path(__file__).parents[1].parent / "shared" / "bench" / "specbench.py"))
MESSAGES = [{"role": "user", "content": "def add(a, b): return a + b. Now write total(values)."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path, log_path, *extra):
    port = free_port()
    env = {**os.environ, "SPECULANT_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "speculant_server", "-m", str(model_path), "-c", "1024", "--port", str(port),
           "-t", "1", "-np", "2", "--alias", "tiny", *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start: {Path(log_path).read_text()}")
        time.sleep(0.2)


def real_openai_client(tmp_path_factory, name: str, *extra, timeout: float = 300):
    """An openai client of `python -m speculant_server` on the real target (skips with the reason
    when the model is absent), for a module fixture: `yield from real_openai_client(...)`."""
    import openai

    from conftest import TARGET, model_path

    path = model_path(TARGET)
    proc, url = start_server(path, tmp_path_factory.mktemp(name) / "server.log", *extra)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    model = write_tiny_model(d / "tiny-qwen2.gguf", "qwen2")
    proc, url = start_server(model, d / "server.log", "--spec-type", "ngram-simple" if _has("ngram-simple") else "none")
    yield url, d / "server.log"
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def _has(spec_type: str) -> bool:
    from speculant.plugins import default_registry

    return spec_type in default_registry().names("speculator")


def test_openai_chat(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    text = r.choices[0].message.content
    assert r.model == "tiny" and r.choices[0].finish_reason == "length" and text
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20

    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20

    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_openai_completions(server):
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model="tiny", prompt="class Model:", max_tokens=16, temperature=0, stop=["\n\n\n"])
    text = r.choices[0].text
    assert r.usage.completion_tokens <= 16 and r.choices[0].finish_reason in ("length", "stop")
    streamed = client.completions.create(model="tiny", prompt="class Model:", max_tokens=16, temperature=0,
                                         stop=["\n\n\n"], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    r2 = client.completions.create(model="tiny", prompt="class Model:", max_tokens=16, temperature=0.9, seed=5)
    r3 = client.completions.create(model="tiny", prompt="class Model:", max_tokens=16, temperature=0.9, seed=5)
    assert r2.choices[0].text == r3.choices[0].text


@pytest.mark.skipif(not SPECBENCH.exists(), reason=f"{SPECBENCH} is absent")
def test_specbench_against_the_server(server, tmp_path):
    url, log = server
    workloads = [{"name": "tiny-chat", "kind": "free", "messages": MESSAGES, "max_tokens": 24},
                 {"name": "tiny-repeat", "kind": "grounded", "max_tokens": 24,
                  "messages": [{"role": "user", "content": "Repeat: " + "one two three four " * 6}]}]
    wl = tmp_path / "workloads.json"
    wl.write_text(json.dumps(workloads))
    out = tmp_path / "results.jsonl"
    p = subprocess.run([sys.executable, str(SPECBENCH), "--url", url, "--workloads", str(wl), "--label", "speculant",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["workload"] for r in rows] == ["tiny-chat", "tiny-repeat"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for w, r in zip(workloads, rows):
        assert r["completion_tokens"] == r["timings"]["predicted_n"] and 0 < r["completion_tokens"] <= 24
        assert r["ttft_s"] is not None and r["ttft_s"] > 0 and r["decode_tok_s"] and r["decode_tok_s"] > 0
        assert {"draft_n", "draft_n_accepted"} <= set(r["timings"])
        same = client.chat.completions.create(model="tiny", messages=w["messages"], max_tokens=24, temperature=0)
        assert r["text"] == same.choices[0].message.content  # specbench's greedy stream = our greedy answer
    assert "event='request'" in log.read_text()
