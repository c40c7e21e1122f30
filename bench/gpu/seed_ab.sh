#!/usr/bin/env bash
# A queue line: session 74's GPU step rules on the seed's closed bursts (mix8, qa8), which only the online load
# had measured: ours (the cap grown while few answers decode, short finishing prompts first) against ours with
# --prefill_per_answer 0 (arm full-pa0: the 512 cap not grown) and llama-server, reps interleaved. mix8's
# short requests' client TTFT against llama-server's is issue 48's item 4 (target: within 1.2x).
# --slot_ctx 22560 (the two workloads' own context) lets ours-4 twice and llama-server share an H200; an H100's
# 80 GB gives llama-server a phase of its own (ours restarted each rep: slower, the same arms).
set -euo pipefail
card=$(bash bench/gpu/card.sh)
if [ "$card" = h200 ]; then apart=; else apart=--llama_server_apart; fi
# shellcheck disable=SC2086  # $apart is one word or none
bash bench/gpu/servers.sh bench/gpu/concurrent_gpu.py --groups peer --workloads mix8 qa8 --reps "${SEED_AB_REPS:-4}" \
  --first_rep 20 --pa0_arm $apart --slot_ctx 22560 --out "/tmp/queue/concurrent_seed_ab_$card.json"
