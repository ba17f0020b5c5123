"""The served-benchmark scripts' own logic: bench_interleaved.py's order of requests and
paths_table.py's ratios (per round, then the median; one configuration by its median)."""
from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

# Stands in for specbench.py: records which server got which workload, in order.
FAKE_SPECBENCH = """
import argparse, json
p = argparse.ArgumentParser()
for a in ("--url", "--workloads", "--label", "--only", "--out", "--extra"):
    p.add_argument(a)
a = p.parse_args()
with open(a.out, "a") as f:
    f.write(json.dumps({"workload": a.only, "decode_tok_s": 1.0, "ttft_s": 0.1, "text": "t", "completion_tokens": 2}) + "\\n")
with open(a.workloads + ".order", "a") as f:
    f.write(a.label + " " + a.only + "\\n")
"""


def test_each_request_goes_to_every_server_in_turn_their_order_rotating(tmp_path):
    (tmp_path / "server.py").write_text(FAKE_SERVER)
    (tmp_path / "specbench.py").write_text(FAKE_SPECBENCH)
    workloads = tmp_path / "w.json"
    workloads.write_text(json.dumps([{"name": n} for n in ("edit", "free", "table")]))
    servers = []
    for label in ("a", "b", "c"):
        port = free_port()
        servers += ["--server", f"{label} {port} {sys.executable} {tmp_path / 'server.py'} {port}"]
    out = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, str(SCRIPTS / "bench_interleaved.py"), "--specbench", str(tmp_path / "specbench.py"),
                    "--workloads", str(workloads), "--only", "table,edit", "--rounds", "2", "--out", str(out), *servers],
                   check=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
    order = (tmp_path / "w.json.order").read_text().split("\n")[:-1]
    # the file's order of workloads; round 1 starts at the second server, round 2 at the third
    assert order == ["b edit", "c edit", "a edit", "b table", "c table", "a table",
                     "c edit", "a edit", "b edit", "c table", "a table", "b table"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["label"], r["round"]) for r in lines] == [(x, n) for n in (1, 2) for x in "abc"]
    assert all([s["workload"] for s in r["single"]] == ["edit", "table"] for r in lines)


def test_an_out_path_that_is_a_directory_is_refused_before_any_server_starts(tmp_path):
    (tmp_path / "started").mkdir()
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_interleaved.py"), "--specbench", "x.py", "--workloads", "w.json",
                        "--server", f"a 1 touch {tmp_path / 'started' / 'a'}", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "a directory" in r.stderr
    assert not any((tmp_path / "started").iterdir())


def test_ratios_are_taken_within_a_round_and_one_configuration_is_best_by_its_median(tmp_path, capsys, monkeypatch):
    speeds = {  # label -> decode tok/s in rounds 1, 2, 3
        "llama-avx2-plain": (20, 10, 20), "llama-avx2-ngram-map-k": (25, 12, 25),
        "ours-avx2-plain": (20, 10, 22), "ours-avx2-spiky": (80, 12, 30), "ours-avx2-steady": (50, 26, 50),
    }
    lines = [{"label": label, "round": r + 1, "single": [{"workload": "edit", "decode_tok_s": v[r], "ttft_s": 1.0, "text": "same"}]}
             for label, v in speeds.items() for r in range(3)]
    path = tmp_path / "paths.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in reversed(lines)))  # rounds put back in order
    monkeypatch.setattr(sys, "argv", ["paths_table.py", str(path)])
    assert load("paths_table").main() == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| edit"))
    # steady / ours plain: 2.5, 2.6, 2.27 -> 2.50; against llama.cpp's faster: 2.0, 2.17, 2.0 -> 2.00
    assert "**2.50x** (2.50, 2.60, 2.27)" in row
    assert "**2.00x** (2.00, 2.17, 2.00), steady" in row  # spiky's median is 1.20x, though its round 1 is 3.2x
    assert "**1.00x** (1.00, 1.00, 1.10)" in row  # our plain / llama.cpp's plain
    assert "one; llama.cpp's avx2" in row
