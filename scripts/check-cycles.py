#!/usr/bin/env python3
"""No circles in src/ or bench/src/ (src/lib.rs's tour: nothing imports upward): imports
between the top-level modules (config, domain, mq, pg, redis, roles, ...) and between sibling
files of one module form no cycle, and no child file calls a function of the parent module that
reaches into it (its steps belong where the parent can show them). Reads `crate::a::b`,
`super::x` and their brace groups (`super::{a, b::C}`) outside #[cfg(test)]; exits 1 naming each
cycle.

  scripts/check-cycles.py              check src/ and bench/src/
  scripts/check-cycles.py --self-test  scratch trees with each kind of cycle fail, one without passes
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
                s = s if i < 0 else s[:i]
                # Comments name paths without using them (doc links to a parent's item).
                yield p, re.sub(r"//[^\n]*", "", s)


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


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def paths(s, head):
    """Every path after `head` (`crate` or `super`), brace groups expanded: `super::{a, b::C}`
    gives [a] and [b, C]."""
    out = []

    def expand(prefix, text):
        # text starts right after `prefix::`
        if text.startswith("{"):
            depth, i, start = 0, 0, 1
            for i, ch in enumerate(text):
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        break
            inner = text[1:i]
            parts, depth, cur = [], 0, ""
            for ch in inner:
                if ch == "," and depth == 0:
                    parts.append(cur)
                    cur = ""
                    continue
                depth += ch == "{"
                depth -= ch == "}"
                cur += ch
            parts.append(cur)
            for part in parts:
                part = part.strip()
                if part and part != "self":
                    expand(prefix, part)
            return
        m = re.match(rf"({IDENT})(::)?", text)
        if not m:
            out.append(prefix)
            return
        if m.group(2):
            expand(prefix + [m.group(1)], text[m.end():])
        else:
            out.append(prefix + [m.group(1)])

    for x in re.finditer(rf"\b{head}::", s):
        expand([], s[x.end():])
    return [p for p in out if p]


def check(root, quiet=False):
    files = {modpath(root, p): s for p, s in sources(root)}
    known = set(files)

    def resolve(parts):
        for k in range(len(parts), 0, -1):
            if tuple(parts[:k]) in known:
                return tuple(parts[:k])
        return None

    top, sibling = {}, {}

    def edge(m, full):
        """The file `m` names the path `full` (from the crate's root)."""
        t = resolve(full)
        if t and t != m and t != m[: len(t)] and t[:-1] == m[:-1]:
            sibling.setdefault(m, set()).add(t)
        # A child calling a function of its parent (`super::write_outcomes`, not a type,
        # constant or submodule) while the parent reaches into the child: a circle of calls.
        if t and t == m[:-1] and len(full) == len(t) + 1 and re.fullmatch(r"[a-z_][a-z0-9_]*", full[-1]):
            if re.search(rf"\b{m[-1]}::", files.get(t, "")):
                sibling.setdefault(m, set()).add(t)
                sibling.setdefault(t, set()).add(m)

    for m, s in files.items():
        if m in (("lib",), ("main",)):
            continue
        for parts in paths(s, "crate"):
            if parts[0] != m[0] and tuple(parts[:1]) in known:
                top.setdefault(m[0], set()).add(parts[0])
            edge(m, parts)
        for parts in paths(s, "super"):
            edge(m, list(m[:-1]) + parts)
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
    with tempfile.TemporaryDirectory() as d:
        # A circle hidden in brace groups, as bench/src/run had one (ceilings <-> scenarios).
        os.makedirs(os.path.join(d, "run"))
        open(os.path.join(d, "main.rs"), "w").write("mod run;")
        open(os.path.join(d, "run", "mod.rs"), "w").write("mod ceilings; mod scenarios; pub struct Run;")
        open(os.path.join(d, "run", "ceilings.rs"), "w").write("use super::{Run, scenarios::consume};")
        open(os.path.join(d, "run", "scenarios.rs"), "w").write("use super::{ceilings, Run};")
        if check(d, quiet=True):
            sys.exit("check-cycles self-test: a circle through brace groups passed")
        open(os.path.join(d, "run", "ceilings.rs"), "w").write("use super::{Run};")
        if not check(d, quiet=True):
            sys.exit("check-cycles self-test: brace groups without a circle were refused")
    with tempfile.TemporaryDirectory() as d:
        # A child that calls back up into the parent that calls it.
        os.makedirs(os.path.join(d, "order_tx"))
        open(os.path.join(d, "lib.rs"), "w").write("mod order_tx;")
        open(os.path.join(d, "order_tx", "mod.rs"), "w").write(
            "mod stock; pub struct Batch; fn steps() { stock::take(); } pub fn write_outcomes() {}")
        open(os.path.join(d, "order_tx", "stock.rs"), "w").write(
            "use super::Batch; pub fn take() { super::write_outcomes(); }")
        if check(d, quiet=True):
            sys.exit("check-cycles self-test: a child calling up into its parent passed")
        open(os.path.join(d, "order_tx", "stock.rs"), "w").write("use super::Batch; pub fn take() {}")
        if not check(d, quiet=True):
            sys.exit("check-cycles self-test: a child using its parent's type was refused")
    print("check-cycles self-test: ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
    else:
        repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        ok = True
        for tree in ("src", os.path.join("bench", "src")):
            ok &= check(os.path.join(repo, tree))
        if not ok:
            sys.exit(1)
        print("check-cycles: no circles between top-level modules, sibling files or a parent "
              "and its children, in src/ and bench/src/")
