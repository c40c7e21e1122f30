#!/usr/bin/env bash
# A queue line's guard: `bench/gpu/if_h200.sh LINE` runs LINE (a .sh script, or a bench given to servers.sh,
# as queue.sh runs a line) only on an H200 (more than 100 GiB), and skips it on an H100, where the targets
# it checks (issue 46's image chats, issue 48's online goodput and 5,500 tok/s) were measured already: the
# device minutes go to what the H100 has not answered, and a later call can try again for an H200.
set -euo pipefail
card=$(bash bench/gpu/card.sh)
if [ "$card" != h200 ]; then echo "skipped on an $card (not an H200): $*"; exit 0; fi
case "$1" in
  *.sh) exec bash "$@" ;;
  *) exec bash bench/gpu/servers.sh "$@" ;;
esac
