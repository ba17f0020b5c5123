#!/usr/bin/env bash
# EAGLE3 served against llama.cpp in one sitting (docs/benchmarks.md): plain decoding and the best
# speculative configurations of both, llama.cpp's own draft-eagle3 with our head, on the public
# workloads, full length, one client. llama.cpp's EAGLE3 drafter needs the target's layer inputs,
# which its qwen2 graph does not export: it runs the same weights relabelled as llama
# (scripts/qwen2_as_llama.py). LLAMA_SERVER=path/to/llama-server HEAD=head.gguf scripts/bench_eagle3.sh
set -u
cd "$(dirname "$0")/.."
M=~/.cache/speculant-models; T=$M/qwen2.5-coder-1.5b-instruct.gguf; D=$M/qwen2.5-coder-0.5b-instruct.gguf
H=${HEAD:-heads/qwen2.5-coder-1.5b-instruct-eagle3.gguf}
TL=${TARGET_AS_LLAMA:-/tmp/qwen2.5-coder-1.5b-as-llama.gguf}
SB="--specbench ${SPECBENCH:-../shared/bench/specbench.py} --workloads tests/data/workloads-public.json --out ${OUT:-eagle3.jsonl}"
PY=.venv/bin/python
LS=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary (see docs/benchmarks.md for the build)}
[ -f "$TL" ] || $PY scripts/qwen2_as_llama.py "$T" "$TL"
for cfg in "plain:-m $T" "ngram-map-k:-m $T --spec-type ngram-map-k" "draft-simple:-m $T -md $D --spec-type draft-simple" \
           "draft-eagle3:-m $TL -md $H --spec-type draft-eagle3"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  echo "== llama.cpp $name"; $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8091 --label llama-$name -- $LS --port 8091 -t 2 -c 4096 -np 1 $flags
done
for cfg in "plain:" "draft-simple:-md $D --spec-type draft-simple" "eagle3:-md $H --spec-type eagle3" \
           "suffix,eagle3:-md $H --spec-type suffix,eagle3"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  echo "== speculant $name"; $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8090 --label ours-$name -- .venv/bin/speculant serve -m $T --port 8090 -c 4096 -np 1 $flags
done
echo "== done"
