#!/usr/bin/env bash
# On a CUDA machine, from the project root with .gpu/ carried and ../shared/gpu/build-llama-server.sh
# copied into .gpu/: builds llama-server (beside the llama-cpp-python build, once per machine), writes
# the random-weight models (bench/gpu/setup.sh), then runs a bench script that compares ours with it:
#   bash bench/gpu/servers.sh bench/gpu/concurrent_gpu.py --out $OUT/concurrent_gpu.json [args...]
set -euo pipefail
script=$1; shift
# servers left by an earlier call that ended inside a hang keep their GPU busy: stop them first (only
# those of the bench's models: bench/gpu/quality_gpu.sh's gate on the demo model may be running beside)
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do
  if grep -qs /tmp/models/ "/proc/$pid/cmdline"; then kill -9 "$pid"; fi
done
server=$(ls /tmp/ls-src/*/vendor/llama.cpp/build/bin/llama-server 2>/dev/null || true)
if [ -z "$server" ] && [ -z "${NO_LLAMA_SERVER:-}" ]; then  # NO_LLAMA_SERVER=1: arms that need none
  bash .gpu/build-llama-server.sh > /tmp/ls-build-out.log 2>&1 &
  building=$!
fi
source bench/gpu/setup.sh
if [ -n "${building:-}" ]; then
  wait "$building" || { cat /tmp/ls-build-out.log; exit 1; }
  server=$(tail -1 /tmp/ls-build-out.log)
  head -n -1 /tmp/ls-build-out.log
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
python3 "$script" --target "$TARGET" --drafter "$DRAFTER" --llama-server "${server:-none}" "$@"
