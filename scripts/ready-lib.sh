# Sourced by the scripts that start roles (chaos, demo, schemathesis, soak): the one
# readiness wait they share.

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
