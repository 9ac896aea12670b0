#!/usr/bin/env python3
"""A multi-turn chat with a `k3-decode serve` OpenAI server (scripts/demo.sh's first part).

    python3 scripts/chat_demo.py http://127.0.0.1:PORT [--max-tokens N] [--turn TEXT]...

Each turn posts the whole conversation to /v1/chat/completions (greedy, thinking off), prints
the user's message and the decoded reply, and how many prompt tokens the server reused from the
previous turn; at the end it prints the server's prefill counters from /metrics (how many prompt
tokens the prefill node prefilled, how many were prefilled locally). Standard library only.
"""
import argparse
import json
import sys
import textwrap
import time
import urllib.error
import urllib.request

# Topics of a page tiny-t was not trained on (the Book's "References and Borrowing", held out),
# asked the way its training chats ask (scripts/tiny_t/prepare.py).
TURNS = [
    "Tell me about references and borrowing.",
    "What should I know about mutable references?",
    "Explain dangling references.",
]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}")


def model_id(base):
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("k3_prefill_tokens_total") or line.startswith("k3_prefill_fallbacks_total"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--turn", action="append", help="a user message (repeatable; default: three built-in turns)")
    a = ap.parse_args()
    model = model_id(a.base)
    messages = []
    wrap = lambda s: textwrap.fill(s, width=96, initial_indent="    ", subsequent_indent="    ")
    for i, user in enumerate(a.turn or TURNS, 1):
        messages.append({"role": "user", "content": user})
        t0 = time.time()
        r = post(a.base + "/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": a.max_tokens,
            "temperature": 0, "reasoning_effort": "none",
        })
        dt = time.time() - t0
        msg = r["choices"][0]["message"]
        reply = msg.get("content") or ""
        u = r["usage"]
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(f"\n[turn {i}] user:\n{wrap(user)}")
        print(f"[turn {i}] assistant ({u['completion_tokens']} tokens, {r['choices'][0]['finish_reason']}; "
              f"prompt {u['prompt_tokens']} tokens, {cached} reused from the previous turn; {dt:.2f} s):")
        print(wrap(reply) if reply.strip() else "    (empty)")
        if msg.get("reasoning_content"):
            print(f"    [reasoning] {msg['reasoning_content']!r}")
        messages.append({"role": "assistant", "content": reply})
    m = metrics(a.base)
    remote = sum(v for k, v in m.items() if 'where="remote"' in k)
    local = sum(v for k, v in m.items() if 'where="local"' in k)
    falls = sum(v for k, v in m.items() if k.startswith("k3_prefill_fallbacks_total"))
    print(f"\nprompt tokens prefilled on the prefill node: {remote:.0f}, locally: {local:.0f}, fallbacks: {falls:.0f}")
    if remote == 0:
        sys.exit("no prompt token was prefilled on the prefill node")


if __name__ == "__main__":
    main()
