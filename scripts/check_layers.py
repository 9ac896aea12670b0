#!/usr/bin/env python3
"""Layering and import-cycle check for the k3-offload workspace (Python stdlib only).

For every Rust source file under `<crate>/src/` it collects the files that file depends on:
`use` declarations and in-code paths that start with `crate::`, `super::`, `self::`, a child
module of the file's own module, or another workspace crate (`k3_protocol::`, `cuda_prefiller::`,
`mac_decoder::`, `k3_e2e::`). A path is resolved to the file that defines the item, following
`pub use` re-exports of facade modules (`mod.rs`, `lib.rs`), so importing `crate::wire::WireError`
counts as a dependency on `wire/error.rs`, not on `wire/mod.rs`. Not counted: `mod` declarations,
`pub use` re-export lines themselves (a facade is not a dependency), and `#[cfg(test)]` modules
(unit tests may reach anywhere in their crate).

It then reports
  * file-level import cycles (strongly connected components of more than one file), and
  * upward imports: a file importing a file of a higher layer than its own, against the layer
    order declared in LAYERS below (documented in docs/architecture.md), across crates too
    (protocol < cuda-prefiller, mac-decoder < tests).
  * docs/architecture.md out of step with the tree: its layer table must be LAYERS, and each
    crate's `| module | owns |` table must list exactly the modules of that crate's lib.rs.
Exit status 1 when it finds any, 0 when the workspace is clean.

    python3 scripts/check_layers.py            # report, non-zero exit on findings
    python3 scripts/check_layers.py --graph    # also print every file's resolved dependencies
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# crate directory -> Rust crate name as other crates write it.
CRATES = {
    "protocol": "k3_protocol",
    "cuda-prefiller": "cuda_prefiller",
    "mac-decoder": "mac_decoder",
    "tests": "k3_e2e",
}

# Crate order: a crate may import only crates of a lower rank.
CRATE_RANK = {"protocol": 0, "cuda-prefiller": 1, "mac-decoder": 1, "tests": 2}

# Layers per crate, lowest first. A file belongs to the layer of the longest module prefix
# listed; a file may import its own layer and the layers below, never one above. `main` is the
# binary's root (src/main.rs), `` (empty) the library root (lib.rs, a facade) and nothing else.
# A module that is in no layer is itself a finding: add it where it belongs.
LAYERS = {
    "protocol": [
        ["testdata", "eval", "mxfp4", "process", "files", "tokenizer", "weight_digest"],
        ["config"],
        ["tensors"],
        ["checkpoint"],
        ["fingerprint"],
        ["handoff", "synth"],
        ["prune", "fit"],
        ["wire"],
        ["transport"],
        [""],
    ],
    "cuda-prefiller": [
        ["backend", "act", "calibrate", "expert_layout", "memory_plan", "mx"],
        ["model"],
        ["stream_plan"],
        ["cpu", "cuda"],
        ["executor"],
        ["streamer", "source_pace"],
        ["prefiller"],
        ["server"],
        ["cli"],
        ["", "main"],
    ],
    "mac-decoder": [
        ["sampler", "tokenizer", "mlx", "distributed", "memory", "metrics"],
        ["chat", "model", "decode_loop"],
        ["ingest", "vision"],
        ["decode"],
        ["remote"],
        ["engine"],
        ["server"],
        ["cli"],
        ["", "main"],
    ],
    "tests": [[""]],
}

ITEM_RE = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|async\s+|const\s+|extern\s+\"[^\"]*\"\s+)*"
    r"(?:struct|enum|union|trait|type|fn|const|static|macro_rules!|mod)\s+([A-Za-z_][A-Za-z0-9_]*)",
    re.M,
)


def strip_comments_and_strings(src):
    """Blank out comments, string and char literals (keeping newlines and offsets)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:i + 10]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'r(#*)"', src[i:])
            end = src.find('"' + m.group(1), i + len(m.group(0)))
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "'":
            # char literal ('a', '\n', '\u{1F}') vs lifetime ('a)
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", src[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def blank_test_modules(src):
    """Blank out `#[cfg(test)]`-gated items (inline test modules, test-only functions)."""
    out = list(src)
    for m in re.finditer(r"#\[cfg\((?:test|all\(test[^\]]*)\)\]", src):
        j = m.end()
        # the item runs to the end of its first balanced {...} block, or to a `;` before any `{`
        k = j
        while k < len(src) and src[k] not in "{;":
            k += 1
        if k >= len(src):
            continue
        if src[k] == ";":
            end = k + 1
        else:
            depth, end = 0, k
            while end < len(src):
                if src[end] == "{":
                    depth += 1
                elif src[end] == "}":
                    depth -= 1
                    if depth == 0:
                        end += 1
                        break
                end += 1
        for p in range(m.start(), end):
            if out[p] != "\n":
                out[p] = " "
    return "".join(out)


class Module:
    def __init__(self, crate, path, file):
        self.crate = crate  # crate dir
        self.path = path  # tuple of module names below the crate root
        self.file = file  # path relative to ROOT
        self.items = set()
        self.reexports = {}  # name -> full path tuple (resolved lazily)
        self.glob_reexports = []  # path tuples
        self.children = set()
        self.text = ""

    def key(self):
        return (self.crate, self.path)


def module_path_of(rel):
    """src-relative file path -> module path tuple."""
    parts = rel[:-3].split("/")
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


def split_use_tree(tree):
    """`a::{b, c::{d, e}}` -> [[a,b],[a,c,d],[a,c,e]] (each a list of segments; `*` kept)."""
    tree = re.sub(r"\s+", "", tree)
    res = []

    def rec(prefix, s):
        # split s at top-level commas
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        for p in parts:
            if not p:
                continue
            brace = p.find("{")
            if brace >= 0:
                head = p[:brace].rstrip(":")
                inner = p[brace + 1:p.rfind("}")]
                segs = [x for x in head.split("::") if x]
                rec(prefix + segs, inner)
            else:
                res.append(prefix + [x for x in p.split("::") if x])

    rec([], tree)
    return res


USE_RE = re.compile(r"(?:^|[;{}\s])(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M)
PATH_RE = re.compile(r"(?<![\w:])((?:crate|super|self|k3_protocol|cuda_prefiller|mac_decoder|k3_e2e)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
REL_PATH_RE = re.compile(r"(?<![\w:])([a-z_][a-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


class Workspace:
    def __init__(self):
        self.mods = {}
        self.crate_of_name = {v: k for k, v in CRATES.items()}

    def load(self):
        for crate in CRATES:
            src = os.path.join(ROOT, crate, "src")
            if not os.path.isdir(src):
                continue
            for dirpath, _, files in os.walk(src):
                for f in sorted(files):
                    if not f.endswith(".rs"):
                        continue
                    full = os.path.join(dirpath, f)
                    rel = os.path.relpath(full, src).replace(os.sep, "/")
                    if rel == "main.rs":
                        path = ("main",)
                    else:
                        path = module_path_of(rel)
                    m = Module(crate, path, os.path.relpath(full, ROOT))
                    with open(full, encoding="utf-8") as fh:
                        raw = fh.read()
                    m.text = blank_test_modules(strip_comments_and_strings(raw))
                    self.mods[m.key()] = m
        for m in self.mods.values():
            if len(m.path) >= 1:
                parent = self.mods.get((m.crate, m.path[:-1]))
                if parent is not None and m.path != ("main",):
                    parent.children.add(m.path[-1])
            for im in ITEM_RE.finditer(m.text):
                m.items.add(im.group(1))
            for um in USE_RE.finditer(m.text):
                if not um.group(1):
                    continue
                for segs in self.use_paths(um.group(2)):
                    if segs[-1] == "*":
                        m.glob_reexports.append(tuple(segs[:-1]))
                    else:
                        name = segs[-1][1] if isinstance(segs[-1], tuple) else segs[-1]
                        real = [s[0] if isinstance(s, tuple) else s for s in segs]
                        m.reexports[name] = tuple(real)

    @staticmethod
    def use_paths(tree):
        """Use-tree -> list of segment lists; a renamed leaf is (real, alias)."""
        tree = re.sub(r"\s+as\s+", " as ", tree.strip())
        out = []
        for segs in split_use_tree(tree.replace(" as ", "@AS@")):
            segs = [s for s in segs]
            if segs and "@AS@" in segs[-1]:
                real, alias = segs[-1].split("@AS@")
                segs[-1] = (real, alias)
            if segs and segs[-1] == "self":
                segs = segs[:-1]
                if not segs:
                    continue
                segs[-1] = (segs[-1], segs[-1])
            out.append(segs)
        return out

    def start(self, m, first):
        """Resolve the first segment of a path seen in module m -> (crate, module path) or None."""
        if first == "crate":
            return (m.crate, ())
        if first == "self":
            return (m.crate, m.path) if m.path != ("main",) else (m.crate, ())
        if first == "super":
            return (m.crate, m.path[:-1])
        if first in self.crate_of_name:
            return (self.crate_of_name[first], ())
        if first in m.children:
            return (m.crate, m.path + (first,))
        return None

    def resolve(self, m, segs, depth=0):
        """Path segments seen in m -> the Module that defines the named thing, or None."""
        if depth > 12 or not segs:
            return None
        segs = [s[0] if isinstance(s, tuple) else s for s in segs]
        cur = self.start(m, segs[0])
        if cur is None:
            return None
        i = 1
        while i < len(segs) and segs[i] == "super":
            cur = (cur[0], cur[1][:-1])
            i += 1
        while i < len(segs) and (cur[0], cur[1] + (segs[i],)) in self.mods:
            cur = (cur[0], cur[1] + (segs[i],))
            i += 1
        mod = self.mods.get(cur)
        if mod is None:
            return None
        if i < len(segs) and segs[i] != "*":
            name = segs[i]
            if name not in mod.items and name in mod.reexports:
                target = self.resolve(mod, list(mod.reexports[name]) + segs[i + 1:], depth + 1)
                if target is not None:
                    return target
            if name not in mod.items and name not in mod.reexports:
                for g in mod.glob_reexports:
                    target = self.resolve(mod, list(g) + [name], depth + 1)
                    if target is not None and name in target.items:
                        return target
        return mod

    def deps(self, m):
        """Set of (Module, evidence line) m depends on."""
        found = {}
        text = m.text
        use_spans = []
        for um in USE_RE.finditer(text):
            use_spans.append((um.start(2), um.end(2)))
            if um.group(1):
                continue  # a re-export: part of the facade, not a dependency
            for segs in self.use_paths(um.group(2)):
                t = self.resolve(m, segs)
                if t is not None and t is not m:
                    line = text.count("\n", 0, um.start(2)) + 1
                    found.setdefault(t.key(), (t, line))

        def in_use(pos):
            return any(a <= pos < b for a, b in use_spans)

        for pm in PATH_RE.finditer(text):
            if in_use(pm.start()):
                continue
            t = self.resolve(m, pm.group(1).split("::"))
            if t is not None and t is not m:
                line = text.count("\n", 0, pm.start()) + 1
                found.setdefault(t.key(), (t, line))
        if m.children:
            for pm in REL_PATH_RE.finditer(text):
                if in_use(pm.start()):
                    continue
                segs = pm.group(1).split("::")
                if segs[0] not in m.children:
                    continue
                t = self.resolve(m, segs)
                if t is not None and t is not m:
                    line = text.count("\n", 0, pm.start()) + 1
                    found.setdefault(t.key(), (t, line))
        return found


def layer_of(m):
    layers = LAYERS.get(m.crate, [[""]])
    best, best_len = None, -1
    for idx, group in enumerate(layers):
        for prefix in group:
            p = tuple(prefix.split("::")) if prefix else ()
            if not p and m.path:
                continue
            if m.path[: len(p)] == p and len(p) > best_len:
                best, best_len = idx, len(p)
    return best


def sccs(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
            out.append(comp)

    for v in nodes:
        if v not in index:
            visit(v)
    return out


DOC = os.path.join(ROOT, "docs", "architecture.md")

# The section of docs/architecture.md whose `| module | owns |` table lists a crate's modules.
DOC_SECTIONS = {"protocol": "## protocol/", "cuda-prefiller": "## cuda-prefiller/", "mac-decoder": "## mac-decoder/"}


def top_modules(crate):
    """The modules `src/lib.rs` of a crate declares (`mod x;` / `pub mod x;`, any cfg)."""
    with open(os.path.join(ROOT, crate, "src", "lib.rs"), encoding="utf-8") as fh:
        text = strip_comments_and_strings(fh.read())
    return set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([a-z_][a-z0-9_]*)\s*;", text, re.M))


def check_docs():
    """docs/architecture.md against the tree: its layer table is LAYERS, and each crate's module
    table lists exactly the modules that crate's lib.rs declares, each with its file. Returns
    the findings (lines to print)."""
    out = []
    rel = os.path.relpath(DOC, ROOT)
    with open(DOC, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    seen = set()
    for n, line in enumerate(lines, 1):
        m = re.match(r"^\|\s*([a-z-]+)\s*\|(.*)\|\s*$", line)
        if not m or m.group(1) not in DOC_SECTIONS or "→" not in m.group(2):
            continue
        crate = m.group(1)
        seen.add(crate)
        name = {"lib.rs": "", "main.rs": "main"}
        doc = [sorted(name.get(t, t) for t in re.findall(r"`([^`]+)`", g)) for g in m.group(2).split("→")]
        want = [sorted(g) for g in LAYERS[crate]]
        if doc != want:
            out.append(f"docs: {rel}:{n}: the layer table of {crate} differs from LAYERS in scripts/check_layers.py "
                       f"(docs {doc}, script {want})")
    for crate in sorted(set(DOC_SECTIONS) - seen):
        out.append(f"docs: {rel} has no layer table row for {crate}")
    for crate, head in sorted(DOC_SECTIONS.items()):
        start = next((i for i, l in enumerate(lines) if l.startswith(head)), None)
        if start is None:
            out.append(f"docs: {rel} has no section {head!r}")
            continue
        listed = {}
        in_table = False
        for i in range(start + 1, len(lines)):
            l = lines[i]
            if l.startswith("## "):
                break
            if re.match(r"^\|\s*module\s*\|", l):
                in_table = True
                continue
            if in_table and l.startswith("|"):
                first = l.split("|")[1]
                for mod in re.findall(r"`([a-z_][a-z0-9_]*)`", first):
                    listed.setdefault(mod, i + 1)
            elif in_table and not l.strip():
                in_table = False
        actual = top_modules(crate)
        for mod in sorted(set(listed) - actual):
            out.append(f"docs: {rel}:{listed[mod]}: module `{mod}` is not a module of {crate} (not in {crate}/src/lib.rs)")
        for mod in sorted(actual - set(listed)):
            out.append(f"docs: module `{mod}` of {crate} is missing from the module table of {rel} ({head})")
        for mod in sorted(actual):
            src = os.path.join(ROOT, crate, "src")
            if not (os.path.isfile(os.path.join(src, mod + ".rs")) or os.path.isfile(os.path.join(src, mod, "mod.rs"))):
                out.append(f"docs: module `{mod}` of {crate} has neither src/{mod}.rs nor src/{mod}/mod.rs")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph", action="store_true", help="print every file's resolved dependencies")
    args = ap.parse_args()

    ws = Workspace()
    ws.load()
    edges, evidence = {}, {}
    for k, m in sorted(ws.mods.items()):
        d = ws.deps(m)
        edges[k] = [t for t in sorted(d)]
        for t, (_, line) in d.items():
            evidence[(k, t)] = line
    name = lambda k: ws.mods[k].file

    if args.graph:
        for k in sorted(edges):
            print(f"{name(k)} [layer {layer_of(ws.mods[k])}]")
            for t in edges[k]:
                print(f"    -> {name(t)}  (line {evidence[(k, t)]})")

    findings = 0
    cycles = [sorted(c) for c in sccs(sorted(edges), edges) if len(c) > 1]
    for c in sorted(cycles):
        findings += 1
        members = set(c)
        print(f"cycle: {' <-> '.join(name(k) for k in c)}")
        for a in c:
            for b in edges[a]:
                if b in members:
                    print(f"    {name(a)}:{evidence[(a, b)]} -> {name(b)}")

    for k in sorted(edges):
        if layer_of(ws.mods[k]) is None:
            findings += 1
            print(f"unlisted: {name(k)} is in no layer of {ws.mods[k].crate} (add its module to LAYERS "
                  f"in scripts/check_layers.py and to docs/architecture.md)")
    for k in sorted(edges):
        src = ws.mods[k]
        for t in edges[k]:
            dst = ws.mods[t]
            up = False
            if dst.crate != src.crate:
                up = CRATE_RANK[dst.crate] >= CRATE_RANK[src.crate]
            else:
                ls, ld = layer_of(src), layer_of(dst)
                up = ls is not None and ld is not None and ld > ls
            if up:
                findings += 1
                print(f"upward: {name(k)}:{evidence[(k, t)]} -> {name(t)} "
                      f"(layer {layer_of(src)} imports layer {layer_of(dst)} of {dst.crate})")

    for line in check_docs():
        findings += 1
        print(line)

    nfiles = len(ws.mods)
    nedges = sum(len(v) for v in edges.values())
    if findings:
        print(f"check_layers: {findings} finding(s) in {nfiles} files, {nedges} file dependencies")
        return 1
    print(f"check_layers: no import cycle, no upward import, docs/architecture.md matches the tree "
          f"({nfiles} files, {nedges} file dependencies)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
