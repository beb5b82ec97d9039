# Sourced by the scripts that start roles (chaos, demo, schemathesis, soak, the upgrade test):
# the waits they share. until_consumed logs through the caller's `log`.

# until_ready URL [SECONDS=30] [PID]: returns 0 once URL answers 2xx; 1 after SECONDS, or as
# soon as PID (the process that should serve it) has exited.
until_ready() {
  local url="$1" secs="${2:-30}" pid="${3:-}" i
  for ((i = 0; i < secs * 5; i++)); do
    curl -fsS -m 2 "$url" >/dev/null 2>&1 && return 0
    if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
      return 1
    fi
    sleep 0.2
  done
  return 1
}

# until_consumed PORT [SECONDS=300]: waits until the consume role whose ops port is PORT reports
# no order-create message left (mq_consumer_lag_messages); 0 then, 1 after SECONDS. A sale's
# topics outlive a run (soak, upgrade test): what an earlier run left in them is consumed first,
# so that its age does not pause admission mid-sale.
until_consumed() {
  local port="$1" secs="${2:-300}" lag="" i
  for ((i = 0; i < secs; i++)); do
    lag="$(curl -fsS "http://127.0.0.1:$port/metrics" 2>/dev/null \
      | sed -n 's/^mq_consumer_lag_messages{topic="order_create"} \([0-9.e+]*\)$/\1/p')"
    [[ "$lag" == 0 ]] && return 0
    sleep 1
  done
  log "order-create lag still ${lag:-unknown} after $secs s"
  return 1
}
