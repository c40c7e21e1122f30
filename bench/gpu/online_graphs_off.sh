#!/usr/bin/env bash
# A queue line: ours alone at the online bench's 8 req/s with ggml's CUDA graphs off for the whole process
# (ours' --cuda_graphs auto keeps them on at 32 slots). Ours aborted there with graphs on: "CUDA error: an
# illegal instruction was encountered" in ggml_backend_cuda_synchronize (1f4ca1a H100; 8ada373's H200 run ended
# the same way, 39 of 64 requests): does it without them? The second run has each kernel launch wait for its
# kernel (CUDA_LAUNCH_BLOCKING=1), so that an abort names the ggml op whose kernel faulted ("in function ...":
# ggml checks each op's launch). An illegal instruction is what a kernel's __trap() raises, and ggml-cuda's
# NO_DEVICE_CODE (a kernel variant not compiled for this arch) is a printf and a __trap(): its line, if printed,
# is in the server's log.
set -u
GGML_CUDA_DISABLE_GRAPHS=1 bash bench/gpu/servers.sh bench/gpu/online_gpu.py --arms ours --rates 8 --reps 2 \
  --budget-s 150 --out /tmp/queue/online_graphs_off.json
CUDA_LAUNCH_BLOCKING=1 GGML_CUDA_DISABLE_GRAPHS=1 bash bench/gpu/servers.sh bench/gpu/online_gpu.py --arms ours \
  --rates 8 --reps 1 --budget-s 120 --out /tmp/queue/online_graphs_off_blocking.json
grep -h -B2 -A3 "no device code\|illegal instruction" /tmp/queue/logs/*.log 2>/dev/null | head -40
