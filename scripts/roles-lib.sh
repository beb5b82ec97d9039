# Sourced by the scripts that run a sale's roles as child processes (chaos, soak, the demos):
# the one way they start, wait for and stop them.
#
# start_role / wait_role_ready / stop_roles_by_name expect BIN (the seckill binary), LOG_DIR
# (each role's log, <role>.log), PORT (an associative array: role -> its ops port, /readyz)
# and log (a function); they keep each role's pid in PID.

source "$(dirname "${BASH_SOURCE[0]}")/ready-lib.sh"

declare -A PID=()

# stop_pids SECONDS PID...: SIGTERM to each (a graceful stop: stop taking work, drain, exit),
# then SIGKILL to any still running SECONDS after its turn came.
stop_pids() {
  local secs="$1" pid i
  shift
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "$@"; do
    for ((i = 0; i < secs * 5; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

# start_role ROLE: `seckill ROLE` in the background, appending to LOG_DIR/ROLE.log.
start_role() {
  "$BIN" "$1" >>"$LOG_DIR/$1.log" 2>&1 &
  PID[$1]=$!
}

# wait_role_ready ROLE: its /readyz answers within 30 s (1, logged, if not or if it died).
wait_role_ready() {
  until_ready "http://127.0.0.1:${PORT[$1]}/readyz" 30 "${PID[$1]}" && return 0
  log "$1 not ready after 30 s (log $LOG_DIR/$1.log)"
  return 1
}

# stop_roles_by_name: every role started by start_role, 20 s each to drain.
stop_roles_by_name() {
  local pids=() r
  for r in "${!PID[@]}"; do pids+=("${PID[$r]}"); done
  ((${#pids[@]} == 0)) || stop_pids 20 "${pids[@]}"
}
