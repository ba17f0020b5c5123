#!/usr/bin/env bash
# Issue 21 item 5: every kernel path served against llama.cpp in one sitting (docs/benchmarks.md).
# Paths: AMX (where the CPU has it), AVX-512 VNNI without AMX (SPECULANT_AMX=0), AVX2 (SPECULANT_ISA=
# avx2: with AVX-VNNI where the CPU has it, as on Intel since Alder Lake; without, as on AMD Zen 2-4).
# The peer: llama.cpp's AVX-512 build for the first two (ggml has no AMX path for these types in
# that build) and its AVX2 build for the third. Each: plain decoding and the best speculative
# configuration measured on code edits (ours: suffix,ngram-simple, 47 tokens, depth 64, with the
# adaptive controller off as "best" and on, the default, as "adaptive", and both again with the
# MTP head after suffix; llama.cpp: ngram-map-k).
# ROUNDS=N runs N rounds (medians on a noisy box; INTERLEAVE=1 interleaves them request by request,
# below); ONLY=workload limits the workloads
# (default code-edit-bisect; ONLY= for all); PATHS="avx2 ..." and CONFIGS="plain adaptive ..." keep
# only those paths (and their llama.cpp build) and those configurations of ours.
#
#   LLAMA_SERVER=.../build/bin/llama-server LLAMA_SERVER_AVX2=.../build-avx2/bin/llama-server scripts/bench_paths.sh
set -u
cd "$(dirname "$0")/.."
M=~/.cache/speculant-models; T=$M/qwen2.5-coder-1.5b-instruct.gguf
ONLY=${ONLY-code-edit-bisect}
SB="--specbench ${SPECBENCH:-../shared/bench/specbench.py} --workloads tests/data/workloads-public.json --out ${OUT:-paths.jsonl}"
[ -n "$ONLY" ] && SB="$SB --only $ONLY"
PY=.venv/bin/python
SERVER_ARGS="-m $T -t 2 -c 4096 -np 1"  # every server, ours and llama.cpp's: one slot, two threads
# On a CPU without AVX-512 (AMD Zen 2-3, Intel's consumer parts) only the AVX2 path exists: set
# LLAMA_SERVER_AVX2 alone.
has_avx512=0; grep -qw avx512_vnni /proc/cpuinfo && has_avx512=1
if [ $has_avx512 = 1 ]; then
  LS=${LLAMA_SERVER:?set LLAMA_SERVER to the AVX-512 llama-server of llama.cpp (docs/benchmarks.md has the build)}
else
  LS=
fi
LS2=${LLAMA_SERVER_AVX2:-}
# On a CPU with AVX-VNNI (Intel since Alder Lake, AMD since Zen 5) the avx2 path uses it; the path
# of AVX2 CPUs without it (AMD Zen 2-4, older Intel) runs here too as "avx2novnni"
# (SPECULANT_ISA=avx2-novnni) against llama.cpp's AVX2 build without AVX-VNNI:
# LLAMA_SERVER_AVX2_NOVNNI, the "AVX2 path" cmake line with -DGGML_AVX_VNNI=OFF (docs/benchmarks.md).
LS3=${LLAMA_SERVER_AVX2_NOVNNI:-}
[ -z "$LS$LS2" ] && { echo "set LLAMA_SERVER_AVX2 to llama.cpp's AVX2 llama-server (no AVX-512 on this CPU)" >&2; exit 2; }
# Drafts of at most 47 tokens: with the bonus row a verification is 48 rows, three whole groups of
# the tiled kernels (49 rows cost 416 ms against 389 after 1500 tokens on AVX-512, where 47 ran
# 4-8% faster than 48 on the development workloads; on a Zen 3's AVX2 path no difference showed:
# docs/benchmarks.md, "Sixteenth run").
SPEC="--spec-type suffix,ngram-simple --spec-draft-n-max 47 --spec-suffix-max-depth 64"
# The same with the shipped MTP head after suffix instead of ngram-simple ("best-mtp", "adaptive-mtp"):
# where suffix finds nothing to copy the head drafts (until its token's probability falls below
# 0.5) where ngram-simple's guesses were mostly rejected (docs/benchmarks.md, "Eighteenth run").
# Run where the heads are in heads/ (MTP=0 leaves them out).
MTP_HEAD=heads/mtp-qwen2.5-coder-1.5b-instruct.gguf
SPEC_MTP="--spec-type suffix,mtp -md $MTP_HEAD --spec-draft-n-max 47 --spec-suffix-max-depth 64 --spec-draft-p-min 0.5"
# And with the shipped EAGLE3 head after suffix ("adaptive-eagle3"): on a Zen 4's AVX-512 path it and
# the MTP one ran medians of 1.88x and 1.94x llama.cpp's best over three rounds, the n47 ngram-simple
# one 1.76x (docs/benchmarks.md, "Thirty-second run").
E3_HEAD=heads/qwen2.5-coder-1.5b-instruct-eagle3.gguf
SPEC_E3="--spec-type suffix,eagle3 -md $E3_HEAD --spec-draft-n-max 47 --spec-suffix-max-depth 64 --spec-draft-p-min 0.5"
# And with copy-edits first ("edits-mtp", controller on): the answer's own changes made again where
# the copy comes to the same text (a signature's type hints on the next signature of the same
# parameters), suffix's copy elsewhere (docs/benchmarks.md, "Thirty-sixth run"). Suffix's drafts
# grow by 1.5x the match instead of 1x, so a copy resumed after a change reaches 47 tokens a step
# sooner: +3.1% / +1.5% on twelve development edits (AVX-512 / AVX2 cost profiles), extract-table
# +7.4% (docs/benchmarks.md, "Thirty-seventh run").
SPEC_EDITS="--spec-type copy-edits,suffix,mtp -md $MTP_HEAD --spec-draft-n-max 47 --spec-suffix-max-depth 64 --spec-suffix-max-spec-factor 1.5 --spec-draft-p-min 0.5"
configs=("plain:" "best:$SPEC --no-spec-adaptive" "adaptive:$SPEC")
[ "${MTP:-1}" != 0 ] && [ -f $MTP_HEAD ] && configs+=("best-mtp:$SPEC_MTP --no-spec-adaptive" "adaptive-mtp:$SPEC_MTP" "edits-mtp:$SPEC_EDITS")
[ "${MTP:-1}" != 0 ] && [ -f $E3_HEAD ] && configs+=("adaptive-eagle3:$SPEC_E3")

paths=()
grep -qw amx_tile /proc/cpuinfo && paths+=("amx:")
[ $has_avx512 = 1 ] && paths+=("avx512:SPECULANT_AMX=0")
[ -n "$LS2" ] && paths+=("avx2:SPECULANT_ISA=avx2")
[ -n "$LS3" ] && paths+=("avx2novnni:SPECULANT_ISA=avx2-novnni")
keep() { [ -z "$2" ] || [[ " $2 " == *" $1 "* ]]; }  # is $1 in the list $2 (or is the list empty)?
kept=(); for p in "${paths[@]}"; do keep "${p%%:*}" "${PATHS:-}" && kept+=("$p"); done; paths=("${kept[@]}")
kept=(); for c in "${configs[@]}"; do keep "${c%%:*}" "${CONFIGS:-}" && kept+=("$c"); done; configs=("${kept[@]}")
keep avx512 "${PATHS:-}" || keep amx "${PATHS:-}" || LS=
keep avx2 "${PATHS:-}" || LS2=
keep avx2novnni "${PATHS:-}" || LS3=

# INTERLEAVE=1: all servers of a round up at once, each request sent to every server in turn
# (scripts/bench_interleaved.py), so a slow spell of a shared host lands on all of them.
if [ "${INTERLEAVE:-0}" = 1 ]; then
  servers=(); port=8090
  add() { servers+=(--server "$1 $port $2 --port $port"); port=$((port + 1)); }
  for cfg in "plain:" "ngram-map-k:--spec-type ngram-map-k"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    [ -n "$LS" ] && add llama-avx512-$name "$LS $SERVER_ARGS $flags"
    [ -n "$LS2" ] && add llama-avx2-$name "$LS2 $SERVER_ARGS $flags"
    [ -n "$LS3" ] && add llama-avx2novnni-$name "$LS3 $SERVER_ARGS $flags"
  done
  for p in "${paths[@]}"; do
    path=${p%%:*}; envs=${p#*:}
    for cfg in "${configs[@]}"; do
      add ours-$path-${cfg%%:*} "env $envs .venv/bin/speculant serve $SERVER_ARGS ${cfg#*:}"
    done
  done
  $PY scripts/bench_interleaved.py $SB --rounds "${ROUNDS:-1}" "${servers[@]}"
  echo "== done"; exit 0
fi

for round in $(seq 1 "${ROUNDS:-1}"); do
  for cfg in "plain:" "ngram-map-k:--spec-type ngram-map-k"; do
    name=${cfg%%:*}; flags=${cfg#*:}
    if [ -n "$LS" ]; then
      echo "== round $round: llama.cpp avx512 $name"
      $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8091 --label llama-avx512-$name -- $LS $SERVER_ARGS --port 8091 $flags
    fi
    if [ -n "$LS2" ]; then
      echo "== round $round: llama.cpp avx2 $name"
      $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8091 --label llama-avx2-$name -- $LS2 $SERVER_ARGS --port 8091 $flags
    fi
    if [ -n "$LS3" ]; then
      echo "== round $round: llama.cpp avx2novnni $name"
      $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8091 --label llama-avx2novnni-$name -- $LS3 $SERVER_ARGS --port 8091 $flags
    fi
  done
  for p in "${paths[@]}"; do
    path=${p%%:*}; envs=${p#*:}
    for cfg in "${configs[@]}"; do
      name=${cfg%%:*}; flags=${cfg#*:}
      echo "== round $round: speculant $path $name"
      $PY scripts/serve_bench.py $SB --url http://127.0.0.1:8090 --label ours-$path-$name -- \
        env $envs .venv/bin/speculant serve $SERVER_ARGS --port 8090 $flags
    done
  done
done
echo "== done"
