#!/usr/bin/env bash
# The served comparison of docs/benchmarks.md: llama-server and speculant serve, one client and
# 8 concurrent, on the public workloads. LLAMA_SERVER=path/to/llama-server scripts/bench_vs_llamacpp.sh
set -u
cd "$(dirname "$0")/.."
M=~/.cache/speculant-models; T=$M/qwen2.5-coder-1.5b-instruct.gguf; D=$M/qwen2.5-coder-0.5b-instruct.gguf
SB="--specbench ${SPECBENCH:-../shared/bench/specbench.py} --workloads tests/data/workloads-public.json --out ${OUT:-serve.jsonl}"
PY=.venv/bin/python
LS=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary (see docs/benchmarks.md for the build)}
LB=$(dirname "$LS")/llama-bench
echo "== llama-bench"; $LB -m $T -p 0 -n 128 -t 2 -r 3 2>&1 | grep -E "tg|model"
for cfg in "plain:" "ngram-simple:--spec-type ngram-simple" "ngram-map-k:--spec-type ngram-map-k" "draft-simple:-md $D --spec-type draft-simple"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  echo "== llama.cpp $name"; $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8091 --label llama-$name -- $LS -m $T --port 8091 -t 2 -c 4096 -np 1 $flags
done
# the last two: the fastest configurations measured on code edits (docs/benchmarks.md, fifth run)
for cfg in "plain:" "ngram-simple:--spec-type ngram-simple" "ngram-map-k:--spec-type ngram-map-k" "suffix:--spec-type suffix" "suffix-32:--spec-type suffix --spec-draft-n-max 32" "draft-simple:-md $D --spec-type draft-simple" "ngram-simple,draft-simple:-md $D --spec-type ngram-simple,draft-simple" "ngram-map-k,draft-simple:-md $D --spec-type ngram-map-k,draft-simple" \
           "suffix,ngram-simple-32:--spec-type suffix,ngram-simple --spec-draft-n-max 32 --no-spec-adaptive" \
           "suffix,ngram-simple-47-d64:--spec-type suffix,ngram-simple --spec-draft-n-max 47 --spec-suffix-max-depth 64 --no-spec-adaptive"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  echo "== speculant $name"; $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8090 --label ours-$name -- .venv/bin/speculant serve -m $T --port 8090 -c 4096 -np 1 $flags
done
echo "== concurrency"
$PY scripts/serve_bench.py $SB --url http://127.0.0.1:8090 --label ours-np1-c8 --clients 8 --extra '{"max_tokens": 64}' -- .venv/bin/speculant serve -m $T --port 8090 -c 4096 -np 1
$PY scripts/serve_bench.py $SB --url http://127.0.0.1:8090 --label ours-np4-c8 --clients 8 --extra '{"max_tokens": 64}' -- .venv/bin/speculant serve -m $T --port 8090 -c 4096 -np 4
echo "== done"
