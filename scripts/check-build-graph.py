#!/usr/bin/env python3
"""The project's builds and the RocketMQ servers' build share their compiled crates.

scripts/install-rocketmq.sh builds the name server and broker in one cargo invocation with
seckill and seckill-bench, in the project's target directory; later project builds select only
seckill and seckill-bench. Cargo compiles a crate once for all of them only when it resolves the
same features and the same dependencies for it in every selection; otherwise every crate above
it is compiled a second time (minutes). Three pairs must agree:

- release: the project (make build, the benchmarks) and the project with the servers;
- debug, the failpoints feature on: the demo's binaries and the same with the servers;
- debug: the demo's binaries and the tests (`cargo test --all-targets --features failpoints`,
  whose dev-dependencies add features: Cargo.toml's `failpoints` feature turns them on).

Cargo.toml declares the features the servers' crates turn on; this check fails, naming the
crates, when a dependency change makes a pair differ again.

Reads `cargo tree` (resolution only, nothing is built). --self-test checks the comparison on
two small trees.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ["-p", "seckill", "-p", "seckill-bench"]
# The servers' package pulls rocketmq-namesrv and rocketmq-broker into the selection.
SERVERS = ["-p", "seckill-rocketmq-servers"]
FAILPOINTS = ["--features", "seckill/failpoints"]
NORMAL = ["-e", "normal,build"]
# With dev edges cargo resolves features as a test build does.
WITH_DEV = ["-e", "normal,build,dev"]
# Workspace members: a test build adds their dev-dependencies as children, which changes no
# compiled dependency, so only their features are compared.
MEMBERS = ("seckill ", "seckill-bench ", "seckill-rocketmq-servers ")
PAIRS = [
    ("release", PROJECT + NORMAL, PROJECT + SERVERS + NORMAL),
    ("debug with the servers", PROJECT + FAILPOINTS + NORMAL,
     PROJECT + SERVERS + FAILPOINTS + NORMAL),
    ("debug, the tests' build", PROJECT + FAILPOINTS + NORMAL, PROJECT + FAILPOINTS + WITH_DEV),
]


def parse(text):
    """{(name, features, children)} for every unit `cargo tree --prefix depth` prints."""
    units, children, stack = [], {}, []
    for line in text.splitlines():
        m = re.match(r"(\d+)(.*)", line)
        if not m:
            continue
        depth = int(m.group(1))
        rest = m.group(2).replace(" (*)", "").replace(" (proc-macro)", "")
        name, _, feats = rest.partition("|")
        name = re.sub(r" \(/.*\)", "", name).strip()
        stack = stack[:depth]
        node = (name, feats.strip(), len(units))
        units.append(node)
        children[node[2]] = set()
        if stack:
            children[stack[-1][2]].add((name, feats.strip()))
        stack.append(node)
    out = {}
    for name, feats, idx in units:
        key = (name, feats)
        out.setdefault(key, set()).update(children[idx])
    return {(n, f, frozenset(c)) for (n, f), c in out.items()}


def differences(project, unified):
    """The project's units that the unified selection resolves otherwise, by crate name."""
    def key(units):
        return {(n, f, frozenset() if n.startswith(MEMBERS) else k) for (n, f, k) in units}
    return sorted({name for (name, feats, kids) in key(project) - key(unified)})


def tree(selection):
    out = subprocess.run(
        ["cargo", "tree", "--locked", *selection, "--prefix", "depth", "-f", "{p}|{f}"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if out.returncode != 0:
        sys.exit(f"check-build-graph: cargo tree failed:\n{out.stderr}")
    return out.stdout


def self_test():
    a = "0app v1|default\n1tokio v1|rt\n2bytes v1|std\n"
    same = "0app v1|default\n1tokio v1|rt\n2bytes v1|std\n0srv v1|\n1bytes v1|\n"
    more = "0app v1|default\n1tokio v1|rt,net\n2bytes v1|std\n0srv v1|\n1tokio v1|rt,net\n"
    assert differences(parse(a), parse(same)) == [], "a host-only unit is not a difference"
    assert differences(parse(a), parse(more)) == ["app v1", "tokio v1"], differences(parse(a), parse(more))
    member = "0seckill v1|default\n1tokio v1|rt\n"
    with_dev = "0seckill v1|default\n1tokio v1|rt\n1yaml v1|\n"
    dev_feature = "0seckill v1|default\n1tokio v1|rt,test-util\n"
    assert differences(parse(member), parse(with_dev)) == [], "a member's dev-dependency is not a difference"
    assert differences(parse(member), parse(dev_feature)) == ["tokio v1"], "a feature a dev-dependency adds is"
    print("check-build-graph: self-test ok")


def main():
    if "--self-test" in sys.argv:
        self_test()
        return
    failed = False
    for label, first, second in PAIRS:
        project = parse(tree(first))
        diff = differences(project, parse(tree(second)))
        if diff:
            failed = True
            print(f"check-build-graph: {label}: these crates resolve differently in `cargo tree {' '.join(first)}`")
            print(f"and in `cargo tree {' '.join(second)}`, so each build would compile them (and all")
            print("above them) again:")
            for name in diff:
                print(f"  {name}")
        else:
            print(f"check-build-graph: {label}: {len(project)} units resolve the same")
    if failed:
        print("Add the features the other build turns on to Cargo.toml: the servers' in the block above")
        print("rocketmq-client-rust, the dev-dependencies' in the `failpoints` feature.")
        sys.exit(1)


if __name__ == "__main__":
    main()
