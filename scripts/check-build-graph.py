#!/usr/bin/env python3
"""The project's build and the RocketMQ servers' build share their compiled crates.

scripts/install-rocketmq.sh builds the name server and broker in one cargo invocation with
seckill and seckill-bench, in the project's target directory; later project builds (make demo,
the benchmarks) select only seckill and seckill-bench. Cargo compiles a crate once for both only
when it resolves the same features and the same dependencies for it in both selections;
otherwise every crate above it is compiled a second time (minutes). Cargo.toml declares the
features the servers' crates turn on; this check fails, naming the crates, when a dependency
change makes the two resolutions differ again.

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
WITH_SERVERS = PROJECT + ["-p", "seckill-rocketmq-servers"]


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
    return sorted({name for (name, feats, kids) in project - unified})


def tree(selection):
    out = subprocess.run(
        ["cargo", "tree", "--locked", *selection, "-e", "normal,build", "--prefix", "depth",
         "-f", "{p}|{f}"],
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
    print("check-build-graph: self-test ok")


def main():
    if "--self-test" in sys.argv:
        self_test()
        return
    project, unified = parse(tree(PROJECT)), parse(tree(WITH_SERVERS))
    diff = differences(project, unified)
    if diff:
        print("check-build-graph: these crates resolve differently with the RocketMQ servers in the")
        print("build, so the project and the servers would each compile them (and all above them):")
        for name in diff:
            print(f"  {name}")
        print("Add the features the servers turn on to Cargo.toml's block above rocketmq-client-rust.")
        sys.exit(1)
    print(f"check-build-graph: {len(project)} units resolve the same with and without the servers")


if __name__ == "__main__":
    main()
