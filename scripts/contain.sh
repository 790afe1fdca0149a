#!/usr/bin/env bash
# Run a command so that nothing it started outlives it: `scripts/contain.sh CMD [ARGS...]` (what .ci/run does
# with the test command). The command runs in a session and process group of its own, and every process it
# starts inherits a marker in its environment (SWITCHYARD_CONTAINED). On any exit (a pass, a failure, a hang that
# faulthandler ended with os._exit, a SIGTERM from CI) the group and every marked process are stopped: engines
# lead sessions of their own, so the group alone would miss them and their children (vLLM's EngineCore).
# Exits with the command's status.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/contain.sh CMD [ARGS...]" >&2; exit 2; }

marker="run-$$-$(date +%s%N)"
export SWITCHYARD_CONTAINED="$marker"
# Not a group leader (no job control here), so setsid runs the command itself: pid = pgid. A background command
# of a shell without job control starts with SIGINT and SIGQUIT ignored, which every Python below it would
# inherit (a test's SIGINT to `switchyard serve` would do nothing): env puts them back to their defaults.
setsid env --default-signal=INT,QUIT "$@" &
leader=$!

marked_pids() {  # every process whose environment carries this run's marker (read from /proc)
  local file pid
  for file in /proc/[0-9]*/environ; do
    pid=${file#/proc/}; pid=${pid%/environ}
    [ "$pid" = "$$" ] && continue
    grep -qzxF "SWITCHYARD_CONTAINED=$marker" "$file" 2>/dev/null && echo "$pid"
  done
}

reap() {
  unset SWITCHYARD_CONTAINED  # the commands below must not carry the marker themselves
  kill -TERM -- "-$leader" 2>/dev/null
  local left pid
  left=$(marked_pids)
  [ -z "$left" ] && return 0
  echo "contain: stopping $(echo "$left" | wc -w) process(es) the command left behind:" >&2
  for pid in $left; do
    echo "  $pid $(tr '\0' ' ' </proc/"$pid"/cmdline 2>/dev/null | cut -c1-120)" >&2
  done
  # shellcheck disable=SC2086
  kill -TERM $left 2>/dev/null
  for _ in $(seq 50); do  # up to 5 s for a graceful exit, then SIGKILL
    left=$(marked_pids)
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -KILL -- "-$leader" $left 2>/dev/null
  return 0
}
trap reap EXIT
trap 'exit 143' TERM INT HUP

wait "$leader"
exit $?
