#!/usr/bin/env bash
# On a CUDA machine with two GPUs, from the project root with .gpu/ carried and
# ../shared/gpu/build-llama-server.sh copied into .gpu/: builds llama-server (beside the
# llama-cpp-python build, once per machine), then runs bench/gpu/multi_gpu.py with the given arguments.
#   bash bench/gpu/multi_gpu.sh --out $OUT/multi_gpu.json [multi_gpu.py args...]
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the host's rule
nvidia-smi topo -m || true
exec bash bench/gpu/servers.sh bench/gpu/multi_gpu.py "$@"
