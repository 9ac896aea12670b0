#!/usr/bin/env python3
"""Runs every command block of README.md in a fresh clone; fails on the first non-zero exit.

    python3 scripts/readme_check.py [--bin DIR] [--keep] [--list]

`sh` and `python` blocks run in order in one bash process inside a fresh `git clone` of this
repository (the working tree's README.md is copied over the clone's when they differ), with
`HOME` in a scratch directory. What a newcomer would build is reused: `--bin DIR` (default
`target/release`, else `target/debug`) holds `k3-prefill` and `k3-decode`, linked into the
clone's `target/release/`; `cargo` is a shell function that only says what it skipped.
Placeholders for real-K3 paths are replaced by tiny-t (`tests/models/tiny-t`) or scratch files
(PLACEHOLDERS below); fixed ports become free ones. A block preceded by
`<!-- readme-check: skip REASON -->` is not run and REASON is printed: the build and test
commands themselves, downloads, GPU-only and two-machine steps. `text` blocks are output, not
commands. Standard library only.
"""
import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Real-K3 placeholders -> what runs here (longest first). $CHECK is the scratch directory.
PLACEHOLDERS = [
    ("/models/kimi-k3-512g", "$CHECK/kimi-k3-pruned"),
    ("/models/kimi-k3", "$PWD/tests/models/tiny-t"),
    ("prompts.jsonl", "$CHECK/prompts.jsonl"),
    ("stats.json", "$CHECK/stats.json"),
    ("--budget-gb 520", "--budget-gb 0.02"),  # tiny-t is 0.024 GB: a budget it must be pruned for
    ("/tmp/", "$CHECK/tmp/"),  # scratch files of the examples, apart from other runs
]
PORTS = ["8000", "8001", "7433"]
SKIP = re.compile(r"<!--\s*readme-check:\s*skip\s+(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)")


def blocks(text):
    """(line, language, body, skip reason or None) of every fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        skip = None
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and SKIP.search(lines[j]):
            skip = SKIP.search(lines[j]).group(1)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        out.append((start, lang, "\n".join(body), skip))
        i += 1
    return out


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return str(p)


def substitute(body, ports):
    for a, b in PLACEHOLDERS:
        body = body.replace(a, b)
    for a, b in ports.items():
        body = re.sub(rf"(?<=:){a}\b", b, body)
    return body


def script(readme, ports):
    """The bash script that runs the README's blocks, and how many it runs / skips."""
    parts = [
        "set -euo pipefail",
        "cargo() { echo \"readme-check: not running 'cargo $*' (the binaries are reused from $BIN)\"; }",
        "cleanup() { local p; for p in $(jobs -p); do kill \"$p\" 2>/dev/null || true; done; wait 2>/dev/null || true; }",
        "trap cleanup EXIT",
    ]
    run = skipped = 0
    for line, lang, body, skip in blocks(readme):
        if lang not in ("sh", "bash", "python"):
            continue
        where = f"README.md:{line}"
        if skip:
            parts.append(f"printf '\\n%s\\n' {sh_quote(f'== {where}: skipped: {skip}')}")
            skipped += 1
            continue
        if lang != "python" and re.search(r"&&|\|\|", body):
            sys.exit(f"readme-check: {where}: `&&` / `||` in a command block hides a failing command from `set -e`: one command per line")
        run += 1
        parts.append(f"printf '\\n%s\\n' {sh_quote(f'== {where} ({lang})')}")
        body = substitute(body, ports)
        if lang == "python":
            parts.append(f"python3 - <<'README_PY'\n{body}\nREADME_PY")
        else:
            parts.append(body)
    parts.append(f"echo {sh_quote(f'readme-check: {run} blocks ran, {skipped} skipped')}")
    return "\n".join(parts) + "\n", run, skipped


def sh_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", help="directory with k3-prefill and k3-decode (default: target/release, else target/debug)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--list", action="store_true", help="print the generated script and exit")
    ap.add_argument("--timeout", type=int, default=900, help="seconds for all blocks together")
    a = ap.parse_args()

    readme = open(os.path.join(ROOT, "README.md")).read()
    ports = {p: free_port() for p in PORTS}
    text, run, skipped = script(readme, ports)
    if a.list:
        print(text)
        return 0
    bin_dir = a.bin
    if not bin_dir:
        for cand in ("target/release", "target/debug"):
            d = os.path.join(ROOT, cand)
            if all(os.path.exists(os.path.join(d, b)) for b in ("k3-prefill", "k3-decode")):
                bin_dir = d
                break
    if not bin_dir:
        sys.exit("readme-check: no k3-prefill and k3-decode in target/release or target/debug (build first, or --bin DIR)")
    bin_dir = os.path.abspath(bin_dir)
    for b in ("k3-prefill", "k3-decode"):
        if not os.access(os.path.join(bin_dir, b), os.X_OK):
            sys.exit(f"readme-check: {bin_dir}/{b} is missing")

    check = tempfile.mkdtemp(prefix="k3-readme-check-")
    try:
        clone = os.path.join(check, "clone")
        subprocess.run(["git", "clone", "--quiet", ROOT, clone], check=True)
        if open(os.path.join(clone, "README.md")).read() != readme:
            print("readme-check: the working tree's README.md differs from the committed one: checking the working tree's")
            shutil.copy(os.path.join(ROOT, "README.md"), os.path.join(clone, "README.md"))
        rel = os.path.join(clone, "target", "release")
        os.makedirs(rel)
        for b in ("k3-prefill", "k3-decode"):
            os.symlink(os.path.join(bin_dir, b), os.path.join(rel, b))
        # What scripts/setup.sh put in .deps/ (the Python clients, MLX's CPU library), shared.
        pyclients = os.environ.get("K3_PY_CLIENTS") or os.path.join(ROOT, ".deps", "pyclients")
        if not os.path.isdir(os.path.join(pyclients, "openai")):
            sys.exit(f"readme-check: the Python clients are not in {pyclients} (run scripts/setup.sh, or set K3_PY_CLIENTS)")
        os.makedirs(os.path.join(clone, ".deps"))
        for name, src in (("pyclients", pyclients), ("mlx-cpu", os.path.join(ROOT, ".deps", "mlx-cpu"))):
            if os.path.isdir(src):
                os.symlink(src, os.path.join(clone, ".deps", name))
        home = os.path.join(check, "home")
        os.makedirs(home)
        os.makedirs(os.path.join(check, "tmp"))
        with open(os.path.join(check, "prompts.jsonl"), "w") as f:
            for t in ("Tell me about ownership in Rust.", "What is a slice?", "Explain traits and generics."):
                f.write('{"text": "%s"}\n' % t)
        path = os.path.join(check, "readme.sh")
        with open(path, "w") as f:
            f.write(text)
        env = dict(os.environ, HOME=home, CHECK=check, BIN=bin_dir, PYTHONPATH=pyclients, RUST_LOG=os.environ.get("README_CHECK_LOG", "warn"),
                   PATH=rel + os.pathsep + os.environ.get("PATH", ""))
        print(f"readme-check: {run} command blocks of README.md in a fresh clone ({clone}), {skipped} skipped; binaries from {bin_dir}")
        p = subprocess.Popen(["bash", path], cwd=clone, env=env, start_new_session=True)
        try:
            p.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            print(f"readme-check: FAILED: the blocks did not finish within {a.timeout} s (the last '== README.md:N' line above is the block)")
            return 1
        try:
            os.killpg(p.pid, 15)  # servers a failed block left behind
        except ProcessLookupError:
            pass
        if p.returncode != 0:
            print(f"readme-check: FAILED (exit {p.returncode}) in the block of the last '== README.md:N' line above; script: {path}")
            a.keep = True
            return 1
        print("readme-check: every command block ran")
        return 0
    finally:
        if a.keep:
            print(f"readme-check: kept {check}")
        else:
            shutil.rmtree(check, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
