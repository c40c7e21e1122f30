#!/usr/bin/env bash
# A queue line: mix8's short requests' client TTFT against llama-server's (issue 48 item 4), with the
# GIL arm (a second 8B server of ours, --gil_switch_ms 0.5) only where it fits beside llama-server:
# a card of over 100 GiB (the H200); an H100's 80 GB takes the line without it (session 63's s63.txt).
# The result is named by the card, so the two never overwrite each other.
set -euo pipefail
card=$(bash bench/gpu/card.sh)
if [ "$card" = h200 ]; then gil=--gil_arm; else gil=; fi
# shellcheck disable=SC2086  # $gil is one word or none
bash bench/gpu/servers.sh bench/gpu/concurrent_gpu.py --groups peer --workloads mix8 --reps 3 --first_rep 15 \
  $gil --slot_ctx 22560 --out "/tmp/queue/concurrent_mix8_clock_$card.json"
