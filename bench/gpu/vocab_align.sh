#!/usr/bin/env bash
# A queue line (issue 48's greedy target): the bench's 128K vocabulary is 1,341 + 127,000 = 128,341 tokens, a
# size no released model has (Llama 3's 128,256 is a multiple of 8), and the CUPTI trace at 50dc092 (H100)
# showed its output projection in cuBLAS's `..._align1` kernel: 1.21 ms of a 64-row step's 11.0 ms of kernels,
# where reading its 1.05 GB of weights takes ~0.31 ms at 3.35 TB/s. The engine's 64-row greedy steps traced at
# both sizes, 128,256 first: what an aligned vocabulary does to the step (the models are written once per size).
set -euo pipefail
bash bench/gpu/cupti_build.sh
for extra in 126915 127000; do
  VOCAB_EXTRA=$extra bash bench/gpu/servers.sh bench/gpu/decode_scale.py --drafter none --arms engine --modes greedy \
    --reps 1 --limit-s 40 --trace /tmp/cupti_trace.so --out "/tmp/queue/decode_scale_vocab_$extra.json"
done
