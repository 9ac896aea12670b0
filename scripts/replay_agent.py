#!/usr/bin/env python3
"""Replays a captured coding-agent session (mac-decoder/tests/fixtures/agents/) against a running
`k3-decode serve`, turn after turn, and prints one JSON object per turn: time to the first
streamed token, the prompt's tokens, how many were read from the held session and how many were
prefilled, and the route the decoder logged for the turn (remote / local / fallback, with its
predicted local and remote seconds).

Usage: replay_agent.py --url http://127.0.0.1:PORT --log DECODER_LOG [--max-tokens 8]
                       FIXTURE.json [FIXTURE.json ...]
Only the Python standard library is used. The fixtures' own max_tokens (32,000) is replaced: the
time to the first token is what this measures.
"""
import argparse
import json
import re
import sys
import time
import urllib.request


def route_of(log_path, offset):
    """The decoder's routing lines written since `offset` (bytes) of its log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        if "routing:" in line or "prefilling locally" in line or "fell back" in line:
            fields = dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", line))
            out.append({
                "route": fields.get("route", "fallback" if "prefilling locally" in line else "?").strip('"'),
                "new_tokens": fields.get("new_tokens"),
                "pred_local_s": fields.get("local_s", "").strip('"'),
                "pred_remote_s": fields.get("remote_s", "").strip('"'),
                "reason": line.split("routing:", 1)[-1].strip()[:200],
            })
    return out


def log_size(path):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            return f.tell()
    except OSError:
        return 0


def one_turn(url, fixture, max_tokens):
    req = json.load(open(fixture))
    body = dict(req["body"])
    body["max_tokens"] = max_tokens
    body["stream"] = True
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    r = urllib.request.Request(url + req["path"], data=json.dumps(body).encode(), headers=headers, method="POST")
    t0 = time.monotonic()
    first = None
    usage = {}
    events = 0
    with urllib.request.urlopen(r, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            try:
                ev = json.loads(line[5:])
            except ValueError:
                continue
            events += 1
            kind = ev.get("type")
            if kind == "message_start":
                usage.update(ev.get("message", {}).get("usage", {}))
            elif kind == "content_block_delta" and first is None:
                first = time.monotonic() - t0
            elif kind == "message_delta":
                usage.update(ev.get("usage", {}))
            elif kind == "error":
                raise RuntimeError(f"{fixture}: error event {ev}")
    total = time.monotonic() - t0
    return first, total, usage, events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--log", required=True, help="the decoder's log file (its routing lines)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--label", default="")
    ap.add_argument("fixtures", nargs="+")
    a = ap.parse_args()
    for i, fx in enumerate(a.fixtures, 1):
        off = log_size(a.log)
        first, total, usage, events = one_turn(a.url, fx, a.max_tokens)
        time.sleep(0.2)  # the routing line is logged before the first token; let it be flushed
        routes = route_of(a.log, off)
        cached = usage.get("cache_read_input_tokens", 0) or 0
        fresh = usage.get("input_tokens", 0) or 0
        row = {
            "label": a.label,
            "turn": i,
            "fixture": fx.rsplit("/", 1)[-1],
            "ttft_s": round(first, 3) if first is not None else None,
            "total_s": round(total, 3),
            "prompt_tokens": cached + fresh,
            "cached_tokens": cached,
            "prefilled_tokens": fresh,
            "routes": routes,
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
