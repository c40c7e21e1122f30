#!/usr/bin/env bash
# One device call for the draft's open questions (docs/pflash_draft_profile.md), from the project root
# with .gpu/ carried (../shared/gpu/prepare-bundle.sh), each step bounded so the whole ends within
# the device's 10-minute limit:
#   bash bench/gpu/draft_campaign.sh
# 1. lanes against one context, pinned and not, and pinned windows of 4096 (whose ubatches replay 7 of 8
#    times; scores differ by design) (draft alone, interleaved, 64K and 128K);
# 2. over HTTP at 64K: the drafter with and without lanes and the pin (a server per arm, ~65 s each);
# 3. the 8B target as its own drafter, with and without lanes (draft alone).
set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s); deadline=$((t0 + 570))
left() { echo $((deadline - $(date +%s))); }
source bench/gpu/setup.sh || exit 1
echo "setup done at $(( $(date +%s) - t0 )) s"
cd bench/gpu
D10=/tmp/models/drafter-0.6b-10l.gguf
timeout "$(left)" python3 draft_forward.py --model $D10 --layers 9 --lengths 65536 131072 --reps 2 --warmup 4096 \
  --configs W2048-ub512 W2048-ub512-l2 W2048-ub512-l3 W2048-ub512-nopin W4096-ub512 --out "$OUT/draft_lanes_drafter.json" 2>&1 \
  | grep -E 'wall_us_per_token|rror' | cut -c1-200
timeout "$(left)" python3 pflash_http.py --target "$TARGET" --drafter "$DRAFTER" --lengths 65536 --reps 3 \
  --arms drafter-l1 drafter-l2 drafter-nopin-l1 --out "$OUT/pflash_http_lanes.json" 2>&1 \
  | grep -v '"rep"' | cut -c1-300
[ "$(left)" -gt 60 ] && timeout "$(left)" python3 draft_forward.py --model "$TARGET" --layers 10 --lengths 65536 \
  --reps 2 --warmup 4096 --configs W2048-ub512 W2048-ub512-l2 --out "$OUT/draft_lanes_target.json" 2>&1 \
  | grep -E 'wall_us_per_token|rror' | cut -c1-200
echo "all done at $(( $(date +%s) - t0 )) s"
