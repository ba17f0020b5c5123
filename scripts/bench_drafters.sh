#!/usr/bin/env bash
# The hidden-state drafters served side by side in one sitting (issues 18 and 20; docs/benchmarks.md):
# plain decoding, suffix, draft-simple and every head given (EAGLE3, MTP, DFlash; alone and after
# suffix) on our server, and llama.cpp's plain, ngram-map-k, draft-simple and its own draft-eagle3 /
# draft-dflash on the same heads. Public workloads, full length, one client, -t 2 -c 4096 -np 1.
# llama.cpp's EAGLE3 and DFlash drafters need the target's layer inputs, which its qwen2 graph does
# not export: they run the same weights relabelled as llama (scripts/qwen2_as_llama.py); it has no
# MTP graph for qwen2 at all.
#
#   LLAMA_SERVER=.../llama-server EAGLE3=head.gguf MTP=mtp.gguf DFLASH=dflash.gguf scripts/bench_drafters.sh
#
# Heads left unset are skipped; LLAMA_SERVER unset skips llama.cpp. ROUNDS=N repeats the whole list
# N times (interleaved, for medians on a noisy box). CONFIGS="llama-plain ours-eagle3 ..." runs only
# those labels. Results append to $OUT (drafters.jsonl); scripts/drafters_table.py makes the table.
set -u
cd "$(dirname "$0")/.."
M=~/.cache/speculant-models; T=$M/qwen2.5-coder-1.5b-instruct.gguf; D=$M/qwen2.5-coder-0.5b-instruct.gguf
TL=${TARGET_AS_LLAMA:-/tmp/qwen2.5-coder-1.5b-as-llama.gguf}
SB="--specbench ${SPECBENCH:-../shared/bench/specbench.py} --workloads tests/data/workloads-public.json --out ${OUT:-drafters.jsonl}"
PY=.venv/bin/python
E3=${EAGLE3:-}; MT=${MTP:-}; DF=${DFLASH:-}; LS=${LLAMA_SERVER:-}

ours=("plain:" "suffix:--spec-type suffix" "draft-simple:-md $D --spec-type draft-simple")
[ -n "$E3" ] && ours+=("eagle3:-md $E3 --spec-type eagle3" "suffix,eagle3:-md $E3 --spec-type suffix,eagle3")
[ -n "$MT" ] && ours+=("mtp:-md $MT --spec-type mtp" "suffix,mtp:-md $MT --spec-type suffix,mtp")
[ -n "$DF" ] && ours+=("dflash:-md $DF --spec-type dflash" "suffix,dflash:-md $DF --spec-type suffix,dflash")
wanted() { [ -z "${CONFIGS:-}" ] || [[ " $CONFIGS " == *" $1 "* ]]; }

theirs=()
if [ -n "$LS" ]; then
  theirs=("plain:-m $T" "ngram-map-k:-m $T --spec-type ngram-map-k" "draft-simple:-m $T -md $D --spec-type draft-simple")
  [ -n "$E3" ] && theirs+=("draft-eagle3:-m $TL -md $E3 --spec-type draft-eagle3")
  [ -n "$DF" ] && theirs+=("draft-dflash:-m $TL -md $DF --spec-type draft-dflash")
  # the relabelled target (a 1 GB write), only where one of those two runs
  if { { [ -n "$E3" ] && wanted llama-draft-eagle3; } || { [ -n "$DF" ] && wanted llama-draft-dflash; }; } && [ ! -f "$TL" ]; then
    $PY scripts/qwen2_as_llama.py "$T" "$TL"
  fi
fi

for round in $(seq 1 "${ROUNDS:-1}"); do
  for cfg in "${theirs[@]}"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    wanted llama-$name || continue
    echo "== round $round: llama.cpp $name"
    $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8091 --label llama-$name -- $LS --port 8091 -t 2 -c 4096 -np 1 $flags
  done
  for cfg in "${ours[@]}"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    wanted ours-$name || continue
    echo "== round $round: speculant $name"
    $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8090 --label ours-$name -- \
      .venv/bin/speculant serve -m $T --port 8090 -c 4096 -np 1 $flags
  done
done
echo "== done"
