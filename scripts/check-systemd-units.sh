# The systemd part of scripts/check-operator-files.sh, sourced by it (its helpers run_check,
# say, pass and fail, its TMP and UNIT_DIR): deploy/systemd/* through systemd-analyze verify,
# the templates' instance-number guard, and systemd-analyze security (offline) exposure <= 2.5.
#
# What the systemd check does and does not verify: `systemd-analyze verify` refuses a unit whose
# ExecStart binary is missing, and /usr/local/bin/seckill is not installed on a build machine. So
# the units are first verified as they are, accepting only the "Command /usr/local/bin/seckill is
# not executable" complaint, and then as copies in a temp dir whose /usr/local/bin/seckill is
# replaced by /bin/true, where any complaint about a seckill unit fails. That checks syntax, every
# key and value (unknown keys, bad time spans, sandbox options), specifiers (%i), the
# timer -> service link and dependencies. It does NOT check that the `seckill` user exists (verify
# does not resolve users), that the subcommands and flags exist in the binary, that the sandbox
# lets the real binary work (only a real start on a systemd host shows that), or /etc/seckill.

say "systemd units"
UNITS=(seckill-api.service seckill-consume@.service seckill-scan@.service
    seckill-timeout-cancel.service seckill-migrate.service seckill-reconcile.service
    seckill-reconcile.timer)
# What verify loads: templates through an instance.
VERIFY=(seckill-api.service seckill-consume@01.service seckill-scan@01.service
    seckill-timeout-cancel.service seckill-migrate.service seckill-reconcile.service
    seckill-reconcile.timer)

check_units_present() {
    local u missing=0
    for u in "${UNITS[@]}"; do
        if [ -f "$UNIT_DIR/$u" ]; then echo "$u"; else echo "missing: $u"; missing=1; fi
    done
    return "$missing"
}
run_check "unit files present" check_units_present

mkdir -p "$TMP/as-is" "$TMP/stub"
for u in "${UNITS[@]}"; do
    cp "$UNIT_DIR/$u" "$TMP/as-is/$u"
    sed 's#/usr/local/bin/seckill#/bin/true#g' "$UNIT_DIR/$u" >"$TMP/stub/$u"
done

verify_units() { # verify_units <dir> <allowed complaint regex or ''>
    local dir="$1" allowed="$2" rc=0 bad
    (cd / && systemd-analyze verify --man=no "${VERIFY[@]/#/$dir/}") >"$TMP/verify.out" 2>&1 || rc=$?
    cat "$TMP/verify.out"
    # Complaints about our units fail the check, except the allowed one; lines about other
    # (system) units are shown but do not.
    bad="$(grep -E 'seckill' "$TMP/verify.out" | { if [ -n "$allowed" ]; then grep -Ev "$allowed"; else cat; fi; } || true)"
    if [ -n "$bad" ]; then
        echo "complaints about seckill units (above)"
        return 1
    fi
    if [ "$rc" -ne 0 ] && [ -z "$allowed" ]; then
        echo "systemd-analyze verify exited $rc"
        return 1
    fi
    echo "no complaints${allowed:+ other than the missing /usr/local/bin/seckill}"
}
run_check "systemd-analyze verify (units as shipped; only the missing binary is tolerated)" \
    verify_units "$TMP/as-is" 'Command /usr/local/bin/seckill is not executable'
run_check "systemd-analyze verify (copies with ExecStart=/bin/true)" verify_units "$TMP/stub" ''

# The templates refuse an instance that is not two digits (it becomes the metrics port 92NN/93NN).
check_instance_guard() {
    python3 - "$UNIT_DIR/seckill-consume@.service" "$UNIT_DIR/seckill-scan@.service" <<'PY'
import shlex, subprocess, sys
bad = 0
for path in sys.argv[1:]:
    pre = [l.split("=", 1)[1] for l in open(path) if l.startswith("ExecStartPre=")]
    if len(pre) != 1:
        print(f"{path}: expected one ExecStartPre guard, found {len(pre)}"); bad = 1; continue
    for inst, want_ok in (("01", True), ("42", True), ("99", True), ("1", False), ("100", False), ("ab", False)):
        argv = shlex.split(pre[0].replace("%i", inst))
        ok = subprocess.run(argv, capture_output=True).returncode == 0
        print(f"{path.rsplit('/', 1)[1]} instance {inst!r}: {'accepted' if ok else 'refused'}")
        if ok != want_ok:
            print("  ^ wrong"); bad = 1
sys.exit(bad)
PY
}
run_check "template instance guard (two digits)" check_instance_guard

check_security() {
    if ! systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
        echo "systemd-analyze security --offline not supported by this systemd: skipped"
        return 0
    fi
    local u rc=0 line
    for u in "${VERIFY[@]}"; do
        case "$u" in *.timer) continue ;; esac
        line="$(cd "$TMP/stub" && systemd-analyze security --offline=true --no-pager "$u" 2>&1 |
            grep -E 'Overall exposure level' || true)"
        echo "${line:-$u: no exposure level reported}"
        if ! (cd "$TMP/stub" && systemd-analyze security --offline=true --threshold=25 --no-pager "$u" >/dev/null 2>&1); then
            echo "  ^ exposure above 2.5"
            rc=1
        fi
    done
    return "$rc"
}
run_check "systemd-analyze security --offline (exposure <= 2.5)" check_security
