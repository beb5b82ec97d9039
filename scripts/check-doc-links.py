#!/usr/bin/env python3
"""Every relative link in the project's Markdown, every alert's `runbook:` annotation, and every
document a source file names from the repository's root (`docs/architecture/recovery.md#outbox-relay`
in a comment, `BENCHMARKS.md` in a script) points at a file that exists and, when it names an
anchor, at a heading that exists.

The docs are split across README.md, BENCHMARKS.md and docs/; a section moved from one file to
another must not leave a link or an alert's runbook pointing at nothing.

    scripts/check-doc-links.py              # check the repository, exit 1 on a broken link
    scripts/check-doc-links.py --self-test  # the checker finds what it must find
"""
import os
import re
import sys
import tempfile

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
RUNBOOK = re.compile(r"runbook:\s*(\S+)")
FENCE = re.compile(r"^(```|~~~)")
# A document named from the repository's root in code, configuration or scripts.
CODE_REF = re.compile(r"(?<![\w./-])((?:docs/[\w/.-]+|[A-Z][A-Z_]*)\.md)(?:#([\w-]+))?")
CODE_DIRS = ("src", "tests", "bench", "scripts", "config", "deploy", "migrations", ".ci")
CODE_FILES = ("Makefile", "Cargo.toml", "Containerfile")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path):
    found, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                fenced = not fenced
                continue
            m = re.match(r"^#{1,6} (.*)", line)
            if m and not fenced:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                found.add(s if n == 0 else f"{s}-{n}")
            for a in re.findall(r'<a (?:id|name)="([^"]+)"', line):
                found.add(a)
    return found


def links_of(path):
    """(line number, target) for every link outside code fences."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced:
                out.extend((no, t) for t in LINK.findall(line))
    return out


def check_target(root, base_dir, target, cache):
    """None when `target` (relative to base_dir) resolves, else why not."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None  # http:, mailto: ... not checked (no internet here)
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(base_dir, path)) if path else None
    if full is not None and not os.path.exists(full):
        return f"no such file {os.path.relpath(full, root)}"
    if anchor and (full is None or full.endswith(".md")):
        md = full
        if md not in cache:
            cache[md] = anchors_of(md)
        if anchor not in cache[md]:
            return f"no heading #{anchor} in {os.path.relpath(md, root)}"
    return None


def markdown_files(root):
    files = [os.path.join(root, f) for f in os.listdir(root) if f.endswith(".md")]
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        for dirpath, _, names in os.walk(docs):
            files.extend(os.path.join(dirpath, n) for n in names if n.endswith(".md"))
    return sorted(files)


def code_files(root):
    out = [os.path.join(root, f) for f in CODE_FILES if os.path.exists(os.path.join(root, f))]
    for d in CODE_DIRS:
        for dirpath, dirs, names in os.walk(os.path.join(root, d)):
            dirs[:] = [x for x in dirs if x not in ("target", "node_modules")]
            out.extend(os.path.join(dirpath, n) for n in names if not n.endswith(".md"))
    return sorted(out)


def check_code(root, cache):
    """Documents named from the root in code, configuration and scripts."""
    problems = []
    for path in code_files(root):
        if os.path.abspath(path) == os.path.abspath(__file__):
            continue  # its self-test names documents that do not exist
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        for no, line in enumerate(text.split("\n"), 1):
            for doc, anchor in CODE_REF.findall(line):
                target = doc + (f"#{anchor}" if anchor else "")
                why = check_target(root, root, target, cache)
                if why:
                    problems.append(f"{os.path.relpath(path, root)}:{no}: {target}: {why}")
    return problems


def check(root):
    problems, cache = [], {}
    for md in markdown_files(root):
        cache.setdefault(md, anchors_of(md))
        for no, target in links_of(md):
            base = os.path.dirname(md)
            target_full = target if target.split("#")[0] else os.path.basename(md) + target
            why = check_target(root, base, target_full, cache)
            if why:
                problems.append(f"{os.path.relpath(md, root)}:{no}: {target}: {why}")
    rules = os.path.join(root, "config", "prometheus")
    for name in ("alerts.yml", "alerts_test.yml"):
        path = os.path.join(rules, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                for target in RUNBOOK.findall(line):
                    why = check_target(root, root, target, cache)
                    if why:
                        problems.append(f"config/prometheus/{name}:{no}: {target}: {why}")
    # The alert rules are under config/ too: each problem once.
    return list(dict.fromkeys(problems + check_code(root, cache)))


def self_test():
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "docs"))
        os.makedirs(os.path.join(root, "config", "prometheus"))
        with open(os.path.join(root, "README.md"), "w") as f:
            f.write("# Top\n\n## Two commands\n\n[ok](docs/A.md#alert-x) [ok](#two-commands)\n"
                    "[gone](docs/B.md) [no anchor](docs/A.md#nothing)\n"
                    "```\n[in a fence](docs/Missing.md)\n```\n")
        with open(os.path.join(root, "docs", "A.md"), "w") as f:
            f.write("# A\n\n### Alert X\n\n[up](../README.md#top) [self](#missing-here)\n")
        with open(os.path.join(root, "config", "prometheus", "alerts.yml"), "w") as f:
            f.write("runbook: docs/A.md#alert-x\nrunbook: README.md#alert-y\n")
        os.makedirs(os.path.join(root, "src"))
        with open(os.path.join(root, "src", "lib.rs"), "w") as f:
            f.write("//! See docs/A.md#alert-x and README.md.\n"
                    "/// Moved away: docs/A.md#gone-section, docs/Old.md.\n")
        found = check(root)
        want = ["docs/B.md: no such file", "docs/A.md#nothing: no heading",
                "#missing-here: no heading", "README.md#alert-y: no heading",
                "src/lib.rs:2: docs/A.md#gone-section: no heading",
                "src/lib.rs:2: docs/Old.md: no such file"]
        for w in want:
            assert any(w in p for p in found), f"self-test: expected a problem containing {w!r}: {found}"
        assert len(found) == len(want), f"self-test: unexpected problems: {found}"
    print("check-doc-links self-test OK")


def main():
    if "--self-test" in sys.argv[1:]:
        self_test()
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    problems = check(root)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check-doc-links: {len(problems)} broken link(s)", file=sys.stderr)
        return 1
    print(f"check-doc-links OK ({len(markdown_files(root))} documents, "
          f"{len(code_files(root))} source files read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
