#!/usr/bin/env bash
# A queue line: ours alone at the online bench's 8 req/s with ggml's CUDA graphs off for the whole process
# (ours' --cuda_graphs auto keeps them on at 32 slots). Ours aborted there with graphs on: "CUDA error: an
# illegal instruction was encountered" in ggml_backend_cuda_synchronize (1f4ca1a H100; 8ada373's H200 run ended
# the same way, 39 of 64 requests): does it without them?
set -eu
GGML_CUDA_DISABLE_GRAPHS=1 bash bench/gpu/servers.sh bench/gpu/online_gpu.py --arms ours --rates 8 --reps 2 \
  --budget-s 150 --out /tmp/queue/online_graphs_off.json
