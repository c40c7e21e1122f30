#!/usr/bin/env bash
# On a CUDA machine with two GPUs, from the project root with .gpu/ carried and
# ../shared/gpu/build-llama-server.sh copied into .gpu/: builds llama-server (beside the
# llama-cpp-python build, once per machine), then runs bench/gpu/multi_gpu.py with the given arguments.
#   bash bench/gpu/multi_gpu.sh --out $OUT/multi_gpu.json [multi_gpu.py args...]
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the host's rule
# servers left by an earlier call that ended inside a hang keep their GPU busy: stop them first
nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9
server=$(ls /tmp/ls-src/*/vendor/llama.cpp/build/bin/llama-server 2>/dev/null || true)
if [ -z "$server" ] && [ -z "${NO_LLAMA_SERVER:-}" ]; then  # NO_LLAMA_SERVER=1: the replicas arms need none
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
nvidia-smi topo -m || true
python3 bench/gpu/multi_gpu.py --target "$TARGET" --drafter "$DRAFTER" \
  --llama-server "$server" "$@"
