#!/usr/bin/env python3
"""Tokenizes the tiny-t corpus into uint16 arrays for training (train.bin, valid.bin,
heldout.bin: raw little-endian uint16 token ids), with the K3 tokenizer in MODEL_DIR.

The training stream is the training text plus short chats in K3's chat format (spec K3_CHAT §2)
made from the training pages: a heading of the docs becomes a user question, the paragraphs under
it the assistant's answer; 1 to 3 turns per chat; 70 % with thinking off, 30 % in thinking mode
(with the built-in thinking-effort note and a one-line reasoning). Chat segments are encoded one
by one, markup as special tokens, exactly as the chat renderer does. The chats are inserted
between paragraphs of the text at seeded random places, so the model learns to answer in that
format. Validation and held-out text are plain text.

    python3 scripts/tiny_t/prepare.py --corpus /tmp/tiny-t-corpus --model DIR --out DIR [--seed 1]
"""
import argparse
import os
import random
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer as tk  # noqa: E402

THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                   "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                   "Now the system is invoked with `thinking_effort=max`.")
QUESTIONS = ["Tell me about {}.", "Explain {}.", "What should I know about {}?", "Can you describe {}?",
             "How does {} work in Rust?", "What is {}?"]


class Chat:
    def __init__(self, enc):
        self.enc = enc
        self.ids = []

    def special(self, name):
        self.ids.append(self.enc.encode_single_token(name))

    def text(self, s):
        if s:
            self.ids.extend(self.enc.encode_ordinary(s))

    def open(self, tag, attrs=()):
        self.special("<|open|>")
        self.text(tag)
        for k, v in attrs:
            self.text(" " + k)
            self.text('="')
            self.text(v.replace("&", "&amp;").replace('"', "&quot;"))
            self.text('"')
        self.special("<|sep|>")

    def close(self, tag):
        self.special("<|close|>")
        self.text(tag)
        self.special("<|sep|>")

    def message(self, attrs, body):
        self.open("message", attrs)
        body(self)
        self.close("message")
        self.special("<|end_of_msg|>")


def is_heading(p):
    return (8 <= len(p) <= 60 and "\n" not in p and not p.endswith((".", ":", ",", ";")) and p[0].isupper()
            and len(p.split()) <= 8 and re.search(r"[a-z]", p) is not None)


def qa_pairs(paras):
    """(heading, answer) for headings followed by prose."""
    out = []
    for i, p in enumerate(paras[:-1]):
        if not is_heading(p):
            continue
        ans = []
        for q in paras[i + 1:i + 4]:
            if is_heading(q) or len(q) < 80:
                break
            if sum(map(len, ans)) + len(q) > 700 and ans:
                break
            ans.append(q)
        if ans and sum(map(len, ans)) >= 150:
            out.append((p, "\n\n".join(ans)))
    return out


def topic(h):
    return h if len(h) > 1 and h[1].isupper() else h[0].lower() + h[1:]


def make_chat(enc, pairs, rng):
    c = Chat(enc)
    thinking = rng.random() < 0.3
    if thinking:
        c.message([("role", "system"), ("type", "thinking-effort")], lambda c: c.text(THINKING_EFFORT))
    for h, ans in pairs:
        q = rng.choice(QUESTIONS).format(topic(h))
        c.message([("role", "user")], lambda c: c.text(q))

        def body(c):
            if thinking:
                c.open("think")
                c.text(f"The user asks about {topic(h)}. I will explain it briefly.")
                c.close("think")
            c.open("response")
            c.text(ans)
            c.close("response")

        c.message([("role", "assistant")], body)
    return c.ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--model", required=True, help="directory with tiktoken.model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--chats", type=int, default=1000)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    enc = tk.load(a.model)
    rng = random.Random(a.seed)
    for split in ("valid", "heldout"):
        text = open(os.path.join(a.corpus, f"{split}.txt"), encoding="utf-8").read()
        ids = np.array(enc.encode_ordinary(text), dtype=np.uint16)
        ids.tofile(os.path.join(a.out, f"{split}.bin"))
        print(f"{split}: {len(ids)} tokens")
    paras = open(os.path.join(a.corpus, "train.txt"), encoding="utf-8").read().split("\n\n")
    pairs = qa_pairs(paras)
    chats = []
    for _ in range(a.chats):
        n = rng.choice([1, 2, 2, 3])
        i = rng.randrange(len(pairs) - n)
        chats.append(make_chat(enc, pairs[i:i + n], rng))
    # Chats go between paragraphs at random places.
    where = sorted(rng.randrange(len(paras)) for _ in chats)
    out = []
    j = 0
    chunk = []
    for i, p in enumerate(paras):
        chunk.append(p)
        while j < len(where) and where[j] == i:
            out.extend(enc.encode_ordinary("\n\n".join(chunk) + "\n\n"))
            chunk = []
            out.extend(chats[j])
            j += 1
    out.extend(enc.encode_ordinary("\n\n".join(chunk) + "\n"))
    ids = np.array(out, dtype=np.uint16)
    ids.tofile(os.path.join(a.out, "train.bin"))
    nchat = sum(map(len, chats))
    print(f"train: {len(ids)} tokens ({len(pairs)} heading/answer pairs; {len(chats)} chats, {nchat} tokens)")


if __name__ == "__main__":
    main()
