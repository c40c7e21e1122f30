#!/usr/bin/env bash
# Prints the card the device machine lent: h200 (over 100 GiB) or h100. Queue scripts name their results by it
# and choose their arms by what fits (`card=$(bash bench/gpu/card.sh)`).
set -euo pipefail
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -gt 102400 ]; then echo h200; else echo h100; fi
