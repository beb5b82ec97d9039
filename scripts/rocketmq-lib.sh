# Sourced by scripts/rocketmq-up.sh: how one server (a name server or a broker) is started,
# checked and stopped. Uses its settings: MARKER, RUN_DIR, DATA_DIR, BUILD, START_TIMEOUT, the
# ports, and log.

# Free space (MiB) on the file system holding $1.
free_mib() { df -Pm "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'; }

die() {
  # $1 message, $2 optional log file whose lines since this script's start marker explain it.
  # The message comes last, after the evidence, so that a truncated CI log still shows it.
  if [[ -n "${2:-}" && -f "$2" ]]; then
    echo "---- $2 since this start (last 40 lines) ----" >&2
    awk -v m="$MARKER" 'index($0, m) { keep = 1; n = 0 } keep { buf[++n] = $0 }
      END { s = n > 40 ? n - 40 : 0; for (i = s + 1; i <= n; i++) print buf[i];
            if (!keep) print "(no start marker: the log file could not be written)" }' "$2" >&2
  fi
  {
    echo "---- listeners on the RocketMQ ports ----"
    ss -ltnp 2>/dev/null | grep -E ":($NAMESRV_PORT|$BROKER_PORT|${NAMESRV_HEALTH##*:}|${BROKER_HEALTH##*:})\b" || echo "(none)"
    echo "---- free space ----"
    df -h "$RUN_DIR" "$DATA_DIR" 2>/dev/null || true
  } >&2
  echo "rocketmq-up: ERROR: $1" >&2
  exit 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A broker is ready when its health endpoint ($1) says so and its port ($2) accepts.
ready_at() {
  [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://$1/readyz" || true)" == 200 ]] &&
    port_open "$2"
}

# Alive and really ours (the pid in the file could have been reused).
pid_alive() {
  local pidfile="$1" name="$2" pid
  [[ -f "$pidfile" ]] || return 1
  pid="$(cat "$pidfile")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  grep -q "$name" "/proc/$pid/cmdline" 2>/dev/null
}

# True when the live server of pid file $1 runs another binary than $2 (the other build).
runs_other_bin() {
  local exe
  [[ "$BUILD" != any ]] || return 1
  pid_alive "$1" rocketmq- || return 1
  exe="$(readlink "/proc/$(cat "$1")/exe" 2>/dev/null)" || return 1
  [[ "${exe% (deleted)}" != "$2" ]]
}

start_detached() {
  # $1 pid file, $2 log file, $3.. command. setsid puts the server in its own session, so it
  # outlives this script and the process group that ran it; the child records its own pid
  # before exec'ing the server, since setsid may fork.
  local pidfile="$1" logfile="$2"
  shift 2
  # Keep one older log beside the current one; a long-lived machine would otherwise grow them.
  if [[ -f "$logfile" ]] && (($(stat -c %s "$logfile") > 64 * 1024 * 1024)); then
    mv -f "$logfile" "$logfile.1"
  fi
  if ! echo "$MARKER $(date -u +%FT%TZ): $*" >>"$logfile"; then
    die "cannot write $logfile (only $(free_mib "$RUN_DIR") MiB free)"
  fi
  # A full disk shows up as a server that cannot write its pid, log or store: say so plainly.
  local free min="${SECKILL_MQ_MIN_FREE_MIB:-1024}"
  free="$(free_mib "$DATA_DIR")"
  if [[ -n "$free" ]] && ((free < min)); then
    die "only ${free} MiB free for $DATA_DIR (need ${min}; SECKILL_MQ_MIN_FREE_MIB)" "$logfile"
  fi
  local attempt i
  for attempt in 1 2 3; do
    rm -f "$pidfile"
    # 9>&-: the server must not inherit (and keep holding) this script's lock.
    setsid bash -c 'echo $$ >"$0"; exec "$@"' "$pidfile" "$@" >>"$logfile" 2>&1 </dev/null 9>&- &
    for i in $(seq 100); do
      [[ -s "$pidfile" ]] && return 0
      sleep 0.1
    done
    log "attempt $attempt: no pid file $pidfile after 10 s"
  done
  die "could not launch: $*" "$logfile"
}

# A server we started earlier that is alive but does not answer (hung, or half shut down)
# would hold its ports or its store: stop it before starting another.
stop_stale() {
  local pidfile="$1" name="$2" pid
  pid_alive "$pidfile" "$name" || return 0
  pid="$(cat "$pidfile")"
  log "$name (pid $pid): stopping it first"
  kill -CONT "$pid" 2>/dev/null || true
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -KILL "$pid" 2>/dev/null || true
  sleep 0.5
}

wait_until() {
  # $1 description, $2 log file, $3.. readiness command
  local what="$1" logfile="$2" pidfile="$3" name="$4"
  shift 4
  local deadline=$((SECONDS + START_TIMEOUT))
  until "$@"; do
    # Asked twice: a process caught in the middle of its exec has an empty cmdline for a
    # moment (seen once on a loaded machine: a name server declared dead while it listened).
    if ! pid_alive "$pidfile" "$name" && ! { sleep 0.5; pid_alive "$pidfile" "$name"; }; then
      die "$what exited during start-up" "$logfile"
    fi
    if ((SECONDS >= deadline)); then
      die "$what not ready after ${START_TIMEOUT}s" "$logfile"
    fi
    sleep 0.2
  done
}
