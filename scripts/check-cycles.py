#!/usr/bin/env python3
"""No circles in src/ (src/lib.rs's tour: nothing imports upward): imports between the top-level modules
(config, domain, mq, pg, redis, roles, ...) and between sibling files of one module form no
cycle. Reads `crate::a::b` and `super::x` paths outside #[cfg(test)]; exits 1 naming each cycle.

  scripts/check-cycles.py              check src/
  scripts/check-cycles.py --self-test  a scratch tree with a cycle fails, one without passes
"""
import os
import re
import sys
import tempfile


def modpath(root, p):
    rel = os.path.relpath(p, root)[:-3].split(os.sep)
    return tuple(rel[:-1]) if rel[-1] == "mod" else tuple(rel)


def sources(root):
    for d, _, fs in os.walk(root):
        for f in fs:
            if f.endswith(".rs"):
                p = os.path.join(d, f)
                s = open(p).read()
                i = s.find("#[cfg(test)]")
                yield p, s if i < 0 else s[:i]


def cycles(graph):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def check(root, quiet=False):
    files = {modpath(root, p): s for p, s in sources(root)}
    known = set(files)

    def resolve(parts):
        for k in range(len(parts), 0, -1):
            if tuple(parts[:k]) in known:
                return tuple(parts[:k])
        return None

    top, sibling = {}, {}
    for m, s in files.items():
        if m in (("lib",), ("main",)):
            continue
        for x in re.finditer(r"\bcrate((?:::[a-z_][a-z0-9_]*)+)", s):
            parts = x.group(1).split("::")[1:]
            if parts[0] != m[0]:
                top.setdefault(m[0], set()).add(parts[0])
            t = resolve(parts)
            if t and t != m and t != m[: len(t)] and t[:-1] == m[:-1]:
                sibling.setdefault(m, set()).add(t)
        for x in re.finditer(r"\bsuper((?:::[a-z_][a-z0-9_]*)+)", s):
            t = resolve(list(m[:-1]) + x.group(1).split("::")[1:])
            if t and t != m and t != m[: len(t)] and t[:-1] == m[:-1]:
                sibling.setdefault(m, set()).add(t)
    found = cycles(top) + cycles(sibling)
    for c in [] if quiet else found:
        print("check-cycles: a circle of imports: " + " <-> ".join("/".join(x) if isinstance(x, tuple) else x for x in c))
    return not found


def self_test():
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "a"))
        open(os.path.join(d, "lib.rs"), "w").write("mod a; mod b;")
        open(os.path.join(d, "a", "mod.rs"), "w").write("mod x; mod y;")
        open(os.path.join(d, "a", "x.rs"), "w").write("use super::y::Y;")
        open(os.path.join(d, "a", "y.rs"), "w").write("pub struct Y;")
        open(os.path.join(d, "b.rs"), "w").write("use crate::a::Y;")
        if not check(d, quiet=True):
            sys.exit("check-cycles self-test: a tree without circles was refused")
        open(os.path.join(d, "a", "y.rs"), "w").write("use super::x::X; pub struct Y;")
        if check(d, quiet=True):
            sys.exit("check-cycles self-test: sibling files importing each other passed")
        open(os.path.join(d, "a", "y.rs"), "w").write("use crate::b::B; pub struct Y;")
        open(os.path.join(d, "a", "x.rs"), "w").write("")
        if check(d, quiet=True):
            sys.exit("check-cycles self-test: two top-level modules importing each other passed")
    print("check-cycles self-test: ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
    else:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
        if not check(root):
            sys.exit(1)
        print("check-cycles: no circles between top-level modules or sibling files of src/")
