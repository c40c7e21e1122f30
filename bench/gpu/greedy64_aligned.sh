#!/usr/bin/env bash
# A queue line (issue 48's 5,500 tok/s at 64 greedy clients): the bench's 128K vocabulary is 1,341 + 127,000 =
# 128,341 tokens, which no released model has; at Llama 3's 128,256 (a multiple of 8) cuBLAS leaves its align1
# kernel for the output projection, 0.5-0.9 ms of a 64-row step on an H100 (vocab_align.sh at 3b415d2,
# docs/decode_scale.md). Ours (the default: host sampling) against llama-server -bs at 64 greedy clients, 3 reps,
# at 128,256 tokens; the result is named by the card.
set -euo pipefail
card=$(bash bench/gpu/card.sh)
VOCAB_EXTRA=126915 bash bench/gpu/servers.sh bench/gpu/decode_scale.py --drafter none --arms servers \
  --servers ours-host-sampling llama-server-bs --modes greedy --clients 64 --reps 3 --limit-s 40 \
  --out "/tmp/queue/decode_scale_aligned_64_$card.json"
