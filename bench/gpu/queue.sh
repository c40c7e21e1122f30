#!/usr/bin/env bash
# A device session's benches, run one after another in the background on the CUDA machine, so the
# GPU never waits between calls and a call only watches (the machine goes back 30 s after a call
# ends: the fewer calls a session needs, the less it loses to a late one). From the project root:
#   PFLASH_TREE=COMMIT bash bench/gpu/queue.sh start QUEUE   # call 1, carrying .gpu: the setup
#                                         # (bench/gpu/servers.sh, ~6.5 min with the 8B target), then each
#                                         # line of QUEUE; COMMIT (`git rev-parse --short HEAD` on this side,
#                                         # pasted: the device's copy has no git) goes into each result's
#                                         # "machine", so reports merge reps of one tree
#   (better: `...start QUEUE; bash bench/gpu/queue.sh wait 570` in one call, so the machine is held
#   through the setup: a late second call found it gone with the queue on it)
#   bash bench/gpu/queue.sh wait [SECONDS]  # the next calls, back to back: waits until the queue is
#                                         # done (570 s at most), copies its results and logs into $OUT
# A line of QUEUE is a bench script and its arguments, given to bench/gpu/servers.sh (so --target,
# --drafter and --llama-server come from the setup); `--out /tmp/queue/NAME.json` keeps a result.
# A line naming a .sh script runs it as it is. Lines starting with # are skipped. VOCAB_EXTRA defaults to 127000 (the 128K-vocabulary models).
set -euo pipefail
DIR=/tmp/queue
case "${1:-}" in
  start)
    # the device's copy has no git: the commit comes from the caller's side, pasted into the command
    [ -n "${PFLASH_TREE:-}" ] || { echo "PFLASH_TREE is empty: pass the commit (git rev-parse --short HEAD, run here)" >&2; exit 2; }
    rm -rf "$DIR" && mkdir -p "$DIR" && cp "$2" "$DIR/queue"  # nothing of an earlier queue comes back
    setsid bash bench/gpu/queue.sh run > "$DIR/queue.log" 2>&1 < /dev/null &
    echo "queue started in the background (log $DIR/queue.log)" ;;
  run)  # the background part of `start`: its exit status goes into $DIR/rc, whatever ends it
    trap 'echo $? > "$DIR/rc"' EXIT
    export VOCAB_EXTRA=${VOCAB_EXTRA:-127000} PYTHONUNBUFFERED=1
    n=0
    grep -v '^\s*\(#\|$\)' "$DIR/queue" | while read -r line; do
      n=$((n + 1)); start=$(date +%s)
      # shellcheck disable=SC2086  # a line is words
      case "${line%% *}" in  # a shell script runs as it is; a bench through servers.sh
        *.sh) cmd="bash $line" ;;
        *) cmd="bash bench/gpu/servers.sh $line" ;;
      esac
      touch "$DIR/.line"
      $cmd > "$DIR/$n.log" 2>&1 < /dev/null && status=0 || status=$?
      if [ "$status" != 0 ]; then  # a server that would not start says why in its own log (bench/results/logs)
        find bench/results/logs -name '*.log' -newer "$DIR/.line" 2>/dev/null | while read -r server_log; do
          echo "== $server_log"; tail -20 "$server_log"; done >> "$DIR/$n.log"
      fi
      echo "$n: exit $status in $(( $(date +%s) - start )) s: $line"
    done ;;
  wait)
    # a machine that went cold comes back bare: say so at once rather than wait out the call
    [ -d "$DIR" ] || { echo "no queue was started (the machine went cold and came back bare?)"; exit 1; }
    end=$(( SECONDS + ${2:-570} ))
    # results and logs copied every 10 s, so a call cut off by the device budget still brings back
    # what finished (at most 8 files come back: the results and logs as one, the servers' logs too)
    keep() { tar czf "$OUT/queue-results.tar.gz" -C "$DIR" $(cd "$DIR" && ls -d ./*.json ./*.log ./logs ./spy 2>/dev/null) 2>/dev/null || true; }
    until [ -f "$DIR/rc" ] || [ $SECONDS -ge $end ]; do sleep 10; keep; done
    keep
    cat "$DIR/queue.log"
    if [ -f "$DIR/rc" ]; then echo "queue done: exit $(cat "$DIR/rc")"; else echo "queue still running"; fi
    for log in "$DIR"/[0-9]*.log; do
      if [ -f "$log" ]; then echo "== $log"; tail -3 "$log"; fi
    done ;;
  *)
    echo "usage: bash bench/gpu/queue.sh start QUEUE | wait [SECONDS]" >&2; exit 2 ;;
esac
