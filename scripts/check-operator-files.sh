#!/usr/bin/env bash
# Checks the operator files; exits non-zero if any check fails. Safe to run repeatedly.
#
#   config/prometheus/prometheus.yml   promtool check config (also loads alerts.yml)
#   config/prometheus/alerts.yml       promtool check rules
#   config/prometheus/alerts_test.yml  promtool test rules (unit tests of every alert)
#   config/grafana/seckill.json        valid JSON, ${DS_PROMETHEUS} datasource on every panel and
#                                      query, unique panel ids, every PromQL query parses (promtool)
#   alerts + dashboard                 every metric name they use occurs in src/ (typo/rename guard),
#                                      except the exporters' families on an explicit allow-list
#   deploy/systemd/*                   systemd-analyze verify, the instance-number guard of the
#                                      templates, systemd-analyze security (offline) exposure <= 2.5
#
# The systemd checks, and what they do not verify, are in scripts/check-systemd-units.sh.
#
# Tools: promtool comes from the Debian package `prometheus`, systemd-analyze from `systemd`;
# either is installed with apt-get when missing (needs root or password-less sudo). Note that
# installing `prometheus` also installs (and on a systemd host enables) the Prometheus server.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROM_DIR="$ROOT/config/prometheus"
DASHBOARD="$ROOT/config/grafana/seckill.json"
UNIT_DIR="$ROOT/deploy/systemd"
SRC_DIR="$ROOT/src"

failures=()
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

say() { printf '==> %s\n' "$*"; }
indent() { sed 's/^/    /'; }
pass() { printf '    ok: %s\n' "$*"; }
fail() {
    printf '    FAIL: %s\n' "$*"
    failures+=("$*")
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@"
    else
        echo "need root (or sudo) to run: $*" >&2
        return 1
    fi
}

apt_install() {
    local q=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@")
    if ! as_root "${q[@]}" >"$TMP/apt.log" 2>&1; then
        # Package lists may be missing or stale (fresh container): refresh once and retry.
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >>"$TMP/apt.log" 2>&1 || true
        if ! as_root "${q[@]}" >>"$TMP/apt.log" 2>&1; then
            tail -n 20 "$TMP/apt.log" >&2
            return 1
        fi
    fi
}

need_tool() { # need_tool <command> <debian package>
    if ! command -v "$1" >/dev/null 2>&1; then
        say "$1 not found: installing Debian package $2"
        apt_install "$2" || { echo "could not install $2 (provides $1)" >&2; exit 1; }
        command -v "$1" >/dev/null 2>&1 || { echo "$2 installed but $1 still missing" >&2; exit 1; }
    fi
}

run_check() { # run_check <description> <command...>: prints the output, records a failure
    local desc="$1"
    shift
    if "$@" >"$TMP/out" 2>&1; then
        indent <"$TMP/out"
        pass "$desc"
    else
        indent <"$TMP/out"
        fail "$desc"
    fi
}

need_tool promtool prometheus
need_tool systemd-analyze systemd
need_tool python3 python3

say "tools: $(promtool --version 2>&1 | head -n1); $(systemd-analyze --version | head -n1)"

# --------------------------------------------------------------------------------- Prometheus
say "Prometheus configuration"
# rule_files are resolved relative to prometheus.yml, so alerts.yml beside it is found from any
# working directory.
run_check "promtool check config prometheus.yml" promtool check config "$PROM_DIR/prometheus.yml"
run_check "promtool check rules alerts.yml" promtool check rules "$PROM_DIR/alerts.yml"
run_check "promtool test rules alerts_test.yml" \
    bash -c 'cd "$1" && promtool test rules alerts_test.yml' _ "$PROM_DIR"

# Every alert name has a unit test.
check_alerts_tested() {
    local missing=0 name
    for name in $(sed -n 's/^ *- alert: *\([A-Za-z0-9_]*\).*/\1/p' "$PROM_DIR/alerts.yml" | sort -u); do
        if grep -Eq "^ *alertname: *$name *$" "$PROM_DIR/alerts_test.yml"; then
            echo "$name: tested"
        else
            echo "$name: NO TEST in alerts_test.yml"
            missing=1
        fi
    done
    return "$missing"
}
run_check "every alert has a test case" check_alerts_tested

# ------------------------------------------------------------------------------------ Grafana
say "Grafana dashboard"
run_check "python3 -m json.tool seckill.json" \
    bash -c 'python3 -m json.tool "$1" >/dev/null && echo "valid JSON"' _ "$DASHBOARD"

# Structure: datasource input/variable, unique ids; writes every query (Grafana's $__ variables
# replaced by fixed ranges) as a recording rule so promtool parses it.
check_dashboard() {
    python3 - "$DASHBOARD" "$TMP/dashboard_queries.yml" <<'PY'
import json, sys
path, out = sys.argv[1], sys.argv[2]
d = json.load(open(path))
errors = []
if not any(i.get("name") == "DS_PROMETHEUS" and i.get("pluginId") == "prometheus" for i in d.get("__inputs", [])):
    errors.append("no __inputs entry DS_PROMETHEUS (prometheus)")
if not any(v.get("name") == "DS_PROMETHEUS" and v.get("type") == "datasource" for v in d.get("templating", {}).get("list", [])):
    errors.append("no datasource variable DS_PROMETHEUS")
ids, exprs = set(), []
def walk(panels):
    for p in panels:
        pid = p.get("id")
        if pid in ids:
            errors.append(f"duplicate panel id {pid}")
        ids.add(pid)
        if p.get("type") != "row":
            if p.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
                errors.append(f"panel {pid} {p.get('title')!r}: datasource is not ${{DS_PROMETHEUS}}")
            if not p.get("targets"):
                errors.append(f"panel {pid} {p.get('title')!r}: no queries")
            for t in p.get("targets", []):
                if t.get("datasource", {}).get("uid") != "${DS_PROMETHEUS}":
                    errors.append(f"panel {pid} query {t.get('refId')}: datasource is not ${{DS_PROMETHEUS}}")
                exprs.append((pid, t.get("refId"), t.get("expr", "")))
        walk(p.get("panels", []))
walk(d.get("panels", []))
with open(out, "w") as f:
    f.write("groups:\n  - name: dashboard_queries\n    rules:\n")
    for pid, ref, e in exprs:
        e = e.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "1h")
        f.write(f"      - record: dashboard:panel{pid}:{ref}\n        expr: {json.dumps(e)}\n")
print(f"{len(ids)} panels, {len(exprs)} queries, title {d.get('title')!r}, schemaVersion {d.get('schemaVersion')}")
for e in errors:
    print("ERROR:", e)
sys.exit(1 if errors else 0)
PY
}
run_check "dashboard structure (datasource, ids)" check_dashboard
run_check "every dashboard query parses (promtool)" promtool check rules "$TMP/dashboard_queries.yml"

# --------------------------------------------------------------------- metric names vs src/
say "Metric names used by the alerts and the dashboard"
check_metric_names() {
    if [ ! -d "$SRC_DIR" ]; then
        echo "no $SRC_DIR: skipped"
        return 0
    fi
    python3 - "$PROM_DIR/alerts.yml" "$DASHBOARD" "$SRC_DIR" <<'PY'
import os, re, sys
alerts, dashboard, src = sys.argv[1:4]
# Metric families of this project end in one of these words; histogram series add _bucket etc.
name_re = re.compile(r"\b([a-z][a-z0-9_]*_(?:total|seconds|messages|pending|paused|acquired|budget|inflight|dead|drift|emitted|share))(?:_bucket|_sum|_count)?\b")
# Allow-list: metric families of the exporters scraped in prometheus.yml (saturation panels),
# which are not in src/. Only these prefixes are exempt, as narrow as the families used, so a
# misspelt name of this project is still caught - in particular its own pg_* names
# (pg_pool_wait_seconds, pg_deadlock_total, pg_serialization_retry_total) are NOT exempt.
EXPORTER_PREFIXES = (
    "node_",          # prometheus-node-exporter 1.5.0 (Debian bookworm)
    "pg_stat_",       # prometheus-postgres-exporter 0.11.1: database, bgwriter, activity
    "pg_settings_",   #   and pg_settings_* collectors
    "pg_wal_",        #   its custom WAL query in prometheus.yml (pg_wal_lsn_bytes)
    "redis_",         # prometheus-redis-exporter 1.45.0
    "rocketmq_",      # rocketmq-broker-rust 1.0.0 built with --features prometheus
)
used = set()
for path in (alerts, dashboard):
    used |= set(name_re.findall(open(path, encoding="utf-8").read()))
code = ""
for base, _, files in os.walk(src):
    for f in files:
        if f.endswith(".rs"):
            code += open(os.path.join(base, f), encoding="utf-8").read()
# As a whole word: most names are string literals ("mq_publish_total"), reconcile's textfile
# names are inside format strings.
exporters = sorted(n for n in used if n.startswith(EXPORTER_PREFIXES))
own = sorted(n for n in used if not n.startswith(EXPORTER_PREFIXES))
missing = [n for n in own if not re.search(r"(?<![A-Za-z0-9_])" + re.escape(n) + r"(?![A-Za-z0-9_])", code)]
print(f"{len(own)} metric names of this project used: " + ", ".join(own))
print(f"{len(exporters)} exporters' names used (allow-listed prefixes, not checked against src/): " + ", ".join(exporters))
for n in missing:
    print(f"ERROR: {n} does not occur in src/ (renamed, misspelt or not exported yet)")
sys.exit(1 if missing else 0)
PY
}
run_check "metric names exist in src/" check_metric_names

# ------------------------------------------------------------------------------------ systemd
# shellcheck source=scripts/check-systemd-units.sh
source "$ROOT/scripts/check-systemd-units.sh"

# ------------------------------------------------------------------------------------ summary
if [ "${#failures[@]}" -gt 0 ]; then
    printf '\nOPERATOR FILES: %d check(s) FAILED:\n' "${#failures[@]}"
    printf '  - %s\n' "${failures[@]}"
    exit 1
fi
printf '\nOPERATOR FILES OK\n'
