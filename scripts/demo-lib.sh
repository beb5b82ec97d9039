# Shared by scripts/demo.sh and scripts/demo-cluster.sh (sourced, not run). Expects BIN (the
# seckill binary) and RUN_DIR (where the logs go); keeps the started roles' pids in `pids`.

source "$(dirname "${BASH_SOURCE[0]}")/roles-lib.sh"

# setup ARGS...: a one-shot `seckill` command; its log lines go to setup.log, and a failure
# ends the demo with DEMO FAILED reason=setup_<command>.
setup() {
  "$BIN" "$@" 2>>"$RUN_DIR/setup.log" && return 0
  tail -20 "$RUN_DIR/setup.log"; echo "DEMO FAILED reason=setup_$1"; exit 1
}

pids=()
# SIGTERM to every started role, SIGKILL to any still running 30 s later.
stop_roles() {
  ((${#pids[@]} == 0)) || stop_pids 30 "${pids[@]}"
  pids=()
}

# wait_ready URL...: each /readyz answers within 30 s, or the demo ends with
# DEMO FAILED reason=roles_not_ready.
wait_ready() {
  local url
  for url in "$@"; do
    until_ready "$url" || {
      echo "[demo] $url not ready; logs in $RUN_DIR"; tail -20 "$RUN_DIR"/*.log
      echo "DEMO FAILED reason=roles_not_ready"; exit 1
    }
  done
}
