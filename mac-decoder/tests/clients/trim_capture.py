#!/usr/bin/env python3
"""Trims a request captured by capture_stub.py into a test fixture (Python stdlib only).

    python3 trim_capture.py CAPTURE.json FIXTURE.json [--client NAME@VERSION]

The shape is kept exactly: every key, every list (all tools, all messages and blocks), every
type, number and boolean. Long strings (system prompts, tool descriptions, reminders) are cut to
their first 160 characters plus a marker with the original length, so the fixture stays small
and holds none of the clients' prompt text beyond a recognisable opening; identifiers that name
this machine (device ids, paths of the capture's temporary directory) are replaced.
"""

import json
import re
import sys

KEEP = 160


def trim_str(s: str) -> str:
    s = re.sub(r"/tmp/cap[^\s\"'<>]*", "/work/project", s)
    s = re.sub(r"\b[0-9a-f]{64}\b", "0" * 64, s)
    if len(s) <= KEEP + 40:
        return s
    return s[:KEEP] + f"…[trimmed: {len(s)} chars]"


def trim(v):
    if isinstance(v, str):
        return trim_str(v)
    if isinstance(v, list):
        return [trim(x) for x in v]
    if isinstance(v, dict):
        return {k: trim(x) for k, x in v.items()}
    return v


def main():
    src, dst = sys.argv[1], sys.argv[2]
    client = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--client" else None
    e = json.load(open(src))
    out = {"client": client, "method": e["method"], "path": e["path"], "headers": e["headers"], "body": trim(e["body"])}
    with open(dst, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
