"""`speculant serve --ray` on a local Ray cluster on this machine: two engine replicas of the tiny
model, one thread each, behind the ingress. A conversation stays on its replica (its prompt cache
is hit), streams and errors come through as from one server, /metrics adds the replicas up, and a
replica killed under requests comes back with no request lost or answered twice.

One cluster for the module (about 25 s to start on two cores); it is shut down at the end and no
Ray process may outlive it."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra (in [dev]) is not installed")

from speculant.flags import OneLineParser  # noqa: E402
from speculant.testing.tiny_gguf import write_tiny_model  # noqa: E402
from speculant_server.cli import add_serve_args  # noqa: E402
from speculant_server.ray_ingress import REPLICA_HEADER  # noqa: E402

# A guard against a hang, not a speed check: on a 2-core box shared with another job a request
# retried after a replica's death waited 42 s in its new replica's queue (the stop-41 run), so
# the margin is wide.
TIMEOUT = 180


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from speculant_server import ray_app

    model = write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2.gguf", "qwen2")
    parser = OneLineParser()
    add_serve_args(parser)
    args = parser.parse_args(["-m", str(model), "--ray", "--ray-replicas", "2", "-t", "1", "-np", "2", "-c", "1024",
                              "--port", "0", "--max-body-size", "100000", "--shutdown-timeout", "2"])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    url, started = ray_app.deploy(args)
    assert started
    try:
        yield url
    finally:
        before = descendants(os.getpid())
        ray_app.shutdown(started)
        for sig, handler in handlers.items():  # ray.init installs its own
            signal.signal(sig, handler)
        deadline = time.time() + 20
        while time.time() < deadline and any(alive(p) for p in before):
            time.sleep(0.2)
        left = [p for p in before if alive(p)]
        assert not left, f"Ray processes left behind: {left}"


def call(url, path, body=None, headers=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def chat(url, messages, **extra):
    status, headers, body = call(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, **extra})
    assert status == 200, body
    return json.loads(body), headers[REPLICA_HEADER]


def metric(url, name, labels="") -> float:
    _, _, text = call(url, "/metrics")
    line = next(line for line in text.decode().splitlines() if line.startswith(name + labels + " "))
    return float(line.split()[-1])


def conversation(url, i, turns=3, start=None):
    """Turns of one conversation: (replica, cached prompt tokens) per turn."""
    messages = [{"role": "system", "content": "You write short programs."},
                {"role": "user", "content": f"conversation {i}: write a loop that counts to {i + 3}"}]
    out = []
    if start is not None:  # the first turns arrive together: each new one sees the others' load
        start.wait(TIMEOUT)
    for t in range(turns):
        answer, replica = chat(url, messages)
        out.append((replica, answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
        messages += [answer["choices"][0]["message"], {"role": "user", "content": f"and now step {t}"}]
    return out


def test_a_conversation_stays_on_its_replica(endpoint):
    hits = metric(endpoint, "speculant:ray_routed_total", '{outcome="hit"}')
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        start = threading.Barrier(4)
        runs = list(pool.map(lambda i: conversation(endpoint, i, start=start), range(4)))
    for run in runs:
        assert len({replica for replica, _ in run}) == 1, run  # every turn on the replica of the first
        assert all(cached > 0 for _, cached in run[1:]), run  # and its prompt cache took the earlier turns
    assert len({run[0][0] for run in runs}) == 2  # new conversations went to the less loaded replica
    assert metric(endpoint, "speculant:ray_routed_total", '{outcome="hit"}') - hits == 8


def test_explicit_session_pins_unrelated_requests(endpoint):
    seen = {chat(endpoint, [{"role": "user", "content": f"question {i}"}], user="alice")[1] for i in range(3)}
    assert len(seen) == 1
    _, _, _ = call(endpoint, "/v1/completions", {"prompt": "a", "max_tokens": 2}, headers={"x-session-id": "s"})
    statuses = {call(endpoint, "/v1/completions", {"prompt": f"b{i}", "max_tokens": 2}, headers={"x-session-id": "s"})[1][REPLICA_HEADER]
                for i in range(3)}
    assert len(statuses) == 1


def test_streaming_comes_through_as_sse(endpoint):
    messages = [{"role": "user", "content": "stream me a short poem about loops"}]
    whole, replica = chat(endpoint, messages, user="streamer")
    status, headers, body = call(endpoint, "/v1/chat/completions",
                                 {"messages": messages, "max_tokens": 8, "stream": True, "user": "streamer"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers[REPLICA_HEADER] == replica
    events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]  # greedy: the same answer, streamed
    assert [c["choices"][0]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1


def test_errors_keep_openai_shape(endpoint):
    def error(status, body):
        err = json.loads(body)["error"]
        assert set(err) >= {"message", "type", "code"} and err["code"] == status
        return err

    status, _, body = call(endpoint, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1})
    assert status == 400 and "max_tokens" in error(status, body)["message"]  # the replica's own validation
    status, _, body = call(endpoint, "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and error(status, body)["type"] == "invalid_request_error"
    status, _, body = call(endpoint, "/v1/nowhere", {})
    assert status == 404 and error(status, body)
    status, _, body = call(endpoint, "/v1/completions", raw=json.dumps({"prompt": "x" * 200_000}).encode())
    assert status == 413 and error(status, body)  # the ingress's --max-body-size
    status, _, body = call(endpoint, "/slots/0?action=erase", {})
    assert status == 501 and error(status, body)
    status, _, body = call(endpoint, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_metrics_add_up_the_replicas(endpoint):
    before = metric(endpoint, "speculant:requests_finished_total")
    for i in range(3):
        chat(endpoint, [{"role": "user", "content": f"count {i}"}])
    assert metric(endpoint, "speculant:requests_finished_total") - before == 3
    assert metric(endpoint, "speculant:ray_replicas") == 2
    status, _, body = call(endpoint, "/slots")
    slots = json.loads(body)
    assert status == 200 and len(slots) == 4 and len({s["replica"] for s in slots}) == 2
    # The router's own count of requests in flight, which it balances by, is back to 0 once they ended.
    _, _, text = call(endpoint, "/metrics")
    loads = [float(line.split()[-1]) for line in text.decode().splitlines() if line.startswith("speculant:ray_replica_load{")]
    assert loads == [0.0, 0.0]


def test_a_client_that_goes_away_cancels_its_request(endpoint):
    before = metric(endpoint, "speculant:requests_cancelled_total")
    body = {"messages": [{"role": "user", "content": "write a very long story"}], "max_tokens": 900, "stream": True}
    req = urllib.request.Request(endpoint + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        assert r.read(64).startswith(b"data: ")  # it is streaming; now hang up
    deadline = time.time() + 20
    while time.time() < deadline and metric(endpoint, "speculant:requests_cancelled_total") == before:
        time.sleep(0.2)
    assert metric(endpoint, "speculant:requests_cancelled_total") == before + 1  # the replica stopped it


def kill_replica(unique_id: str) -> None:
    """SIGKILL-like: the replica's actor ends at once, without Serve's graceful shutdown."""
    name = next(a for a in ray.util.list_named_actors(all_namespaces=True) if unique_id in a["name"])
    ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)


def running_on(url, replica: str) -> int:
    _, _, body = call(url, "/slots")
    return sum(s["is_processing"] for s in json.loads(body) if s["replica"] == replica)


def test_a_killed_replica_comes_back_and_no_request_is_lost(endpoint):
    messages = [{"role": "system", "content": "You write long programs."}, {"role": "user", "content": "write a long C file"}]
    _, victim = chat(endpoint, messages)
    long = {"messages": messages, "max_tokens": 900}
    deaths = metric(endpoint, "speculant:ray_replica_deaths_total")

    streaming = threading.Event()

    def one(i):
        stream = i == 0
        # Each its own next turn of the conversation: its replica takes them at once (requests
        # for the very same prompt would wait for one another there, to share its prefill).
        turn = {**long, "messages": messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"part {i}"}]}
        if not stream:
            status, headers, body = call(endpoint, "/v1/chat/completions", turn)
            return stream, status, headers.get(REPLICA_HEADER), body
        req = urllib.request.Request(endpoint + "/v1/chat/completions", data=json.dumps({**turn, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            first = r.readline()
            streaming.set()
            return stream, r.status, r.headers.get(REPLICA_HEADER), first + r.read()

    # Four requests of the conversation: all on its replica (--ray-max-ongoing is 2 x -np = 4),
    # two generating in its slots and two waiting in its queue when it is killed.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(4)]
        t0 = time.time()
        assert streaming.wait(TIMEOUT)
        while running_on(endpoint, victim) < 2 and time.time() < t0 + TIMEOUT:
            time.sleep(0.02)
        kill_replica(victim)
        results = [f.result(timeout=TIMEOUT) for f in futures]

    for stream, status, replica, body in results:
        if stream:  # its bytes had started: it ends with an error event, and [DONE] once
            events = [e[6:] for e in body.decode().split("\n\n") if e.startswith("data: ")]
            assert status == 200 and replica == victim and events.count("[DONE]") == 1
            assert "error" in json.loads(events[-2]), events[-2]
        else:  # a whole answer, once: from the victim if it ended before the kill, else retried
            assert status == 200, (status, body[:200])
            answer = json.loads(body)
            assert len(answer["choices"]) == 1 and answer["choices"][0]["finish_reason"] in ("length", "stop")
    retried = [i for i, (stream, _, replica, _) in enumerate(results) if not stream and replica != victim]
    assert retried  # the one in the victim's other slot at least
    assert metric(endpoint, "speculant:ray_replica_deaths_total") - deaths == 1 + len(retried)
    assert metric(endpoint, "speculant:ray_requests_failed_total") == 1  # the stream; the others were retried
    survivor = {results[i][2] for i in retried}
    assert len(survivor) == 1

    deadline = time.time() + 90  # Serve starts a new replica in the victim's place
    while time.time() < deadline:
        if metric(endpoint, "speculant:ray_replicas") == 2:
            break
        time.sleep(1)
    else:
        pytest.fail("the killed replica was not replaced")
    _, _, body = call(endpoint, "/slots")
    replicas = {s["replica"] for s in json.loads(body)}
    assert victim not in replicas and len(replicas) == 2
    # A retried turn's conversation now lives where it ran: its next turns stay there.
    turn = messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"part {retried[0]}"},
                       {"role": "assistant", "content": "(shortened)"}, {"role": "user", "content": "more"}]
    assert {chat(endpoint, turn)[1] for _ in range(3)} == survivor


def test_a_replica_that_cannot_load_its_model_is_a_one_line_error(tmp_path):
    """`speculant serve --ray` with a file that is not a model: the replicas' own error in one
    line, exit status 2, and the local cluster it started gone with it."""
    import subprocess
    import sys

    def ray_daemons() -> set[int]:
        out = set()
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() in ("raylet", "gcs_server"):
                        out.add(int(entry))
            except OSError:
                pass
        return out

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model" * 100)
    before = ray_daemons()
    speculant = os.path.join(os.path.dirname(sys.executable), "speculant")
    proc = subprocess.run([speculant, "serve", "--ray", "--ray-replicas", "1", "-t", "1", "-m", str(bad), "--port", "0"],
                          capture_output=True, text=True, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("speculant: error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert errors == [f"speculant: error: the replicas did not start: {bad}: not a GGUF file (bad magic bytes)"]
    deadline = time.time() + 20
    while time.time() < deadline and not ray_daemons() <= before:
        time.sleep(0.2)
    assert ray_daemons() <= before, "the cluster outlived the command"
