#!/usr/bin/env python3
"""Derives partial_vocab.json from k3-tokenizer-cases.json (our own script, run once).

The real `tiktoken.model` is not in this repository. The golden cases say, for each text, which
ids the real tokenizer gives. This script recovers a byte string for every id the cases use
(consistent across all cases: concatenating a case's tokens gives its text, tokens never cross a
pre-tokenization piece, every non-byte token has >= 2 bytes, no two ids share bytes). Where the
cases leave a split ambiguous, it picks the choice consistent with BPE merge order (a token
containing another ranks after it). It then adds "intermediate" tokens (at free ranks just below
the token they build) so that byte-pair merging reaches every token, searching split points until
all 109 cases re-encode to their golden ids under tiktoken's merge rule. The merge ranks are thus
a reconstruction: the Rust test pins pre-tokenization, chunking and special tokens exactly, and
BPE on a vocabulary consistent with the real one.

The Rust test builds a full 163,584-rank vocabulary from this (bytes in GPT-2 order, these
tokens, unreachable fillers elsewhere) and checks that pre-tokenization, chunking, special-token
handling and BPE reproduce every golden id sequence. Needs the `regex` module (for \\p{Han}, &&).
"""
import json, regex, sys

d = json.load(open(sys.argv[1] if len(sys.argv) > 1 else "k3-tokenizer-cases.json"))
pat = regex.compile(d["pat_str"], flags=regex.V1)
bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
order = bs + [b for b in range(256) if b not in bs]
known = {i: bytes([order[i]]) for i in range(256)}
specials = {int(k): v for k, v in d["named_specials"].items()}
specials.update({int(k): v for k, v in d["reserved_examples"].items()})
by_name = {v: k for k, v in specials.items()}
N_BASE = d["num_base_tokens"]


def run_split(s, m):
    out, cur_len, start = [], 0, 0
    cur_sp = s[0].isspace() if s else False
    for i, ch in enumerate(s):
        sp = ch.isspace()
        if cur_sp ^ sp:
            cur_len, cur_sp = 1, sp
        else:
            cur_len += 1
            if cur_len > m:
                out.append(s[start:i]); start = i; cur_len = 1
    out.append(s[start:])
    return out


def pieces(text, max_run, max_chars):
    res = []
    for ci in range(0, len(text), max_chars):
        for sub in run_split(text[ci:ci + max_chars], max_run):
            parts = regex.split("(" + "|".join(regex.escape(n) for n in by_name) + ")", sub)
            for j, p in enumerate(parts):
                if j % 2:
                    res.append(("S", p))
                else:
                    res.extend(("T", m.group().encode()) for m in pat.finditer(p))
    return res


cases = [(c["text"], c["ids"], pieces(c["text"], 25000, 400000)) for c in d["cases"]]
cases += [(c["text"], c["ids"], pieces(c["text"], c["max_run"], 400000)) for c in d["chunked"]]
cases += [(c["text"], c["ids"], pieces(c["text"], c["max_run"], c["max_chars"])) for c in d["outer"]]


def solutions(ids, ps, limit):
    sols = []

    def dfs(si, pos, k, assign):
        if len(sols) >= limit:
            return
        if si == len(ps):
            if k == len(ids):
                sols.append(dict(assign))
            return
        kind, B = ps[si]
        if kind == "S":
            if k < len(ids) and ids[k] == by_name[B]:
                dfs(si + 1, 0, k + 1, assign)
            return
        if pos == len(B):
            return dfs(si + 1, 0, k, assign)
        if k >= len(ids) or ids[k] >= N_BASE:
            return
        t = ids[k]
        cand = known.get(t, assign.get(t))
        if cand is not None:
            if B[pos:pos + len(cand)] == cand:
                dfs(si, pos + len(cand), k + 1, assign)
            return
        taken = set(known.values()) | set(assign.values())
        for L in range(2, len(B) - pos + 1):
            v = B[pos:pos + L]
            if v not in taken:
                assign[t] = v; dfs(si, pos + L, k + 1, assign); del assign[t]

    dfs(0, 0, 0, {})
    return sols


def propagate():
    changed = True
    while changed:
        changed = False
        for text, ids, ps in cases:
            if all(i in known or i >= N_BASE for i in ids):
                continue
            sols = solutions(ids, ps, 2000)
            if not sols:
                sys.exit(f"no consistent split for {text!r}")
            if len(sols) >= 2000:
                continue
            for t in sols[0]:
                vals = {s.get(t) for s in sols}
                if len(vals) == 1:
                    known[t] = vals.pop(); changed = True


def score(s, ids):
    # BPE ranks are merge order: a token that contains another must rank after it.
    allv = dict(known); allv.update(s)
    bad = sum(1 for a, va in s.items() for b, vb in allv.items() if a != b and (
        (va in vb and a > b) or (vb in va and b > a)))
    whole = sum(1 for v in s.values() if _utf8(v))
    return (-bad, whole, [len(s[i]) for i in ids if i in s])


def _utf8(v):
    try:
        v.decode("utf-8"); return True
    except UnicodeDecodeError:
        return False


propagate()
while True:
    pending = [c for c in cases if any(i < N_BASE and i not in known for i in c[1])]
    if not pending:
        break
    text, ids, ps = pending[0]
    known.update(max(solutions(ids, ps, 200000), key=lambda s: score(s, ids)))
    propagate()

for text, ids, ps in cases:
    got = b"".join(known[i] if i in known else specials[i].encode() for i in ids)
    assert got == text.encode(), text

golden = {k: v for k, v in known.items() if k >= 256}


def bpe(piece, rank_of):
    if piece in rank_of:
        return [rank_of[piece]]
    parts = [bytes([b]) for b in piece]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = rank_of.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [rank_of[p] for p in parts]


def encode_case(text, max_run, max_chars, rank_of):
    out = []
    for kind, p in pieces(text, max_run, max_chars):
        out.extend([by_name[p]] if kind == "S" else bpe(p, rank_of))
    return out


# Every golden token must be reachable by merges: give each a split (a, b) into two tokens,
# creating missing halves as "intermediate" tokens at the highest free rank below their parent.
# Splits are tried in turn until every golden case re-encodes to its ids.
all_cases = [(c["text"], c["ids"], 25000, 400000) for c in d["cases"]]
all_cases += [(c["text"], c["ids"], c["max_run"], 400000) for c in d["chunked"]]
all_cases += [(c["text"], c["ids"], c["max_run"], c["max_chars"]) for c in d["outer"]]
used = set(known)


def free_below(r):
    while r in used or r < 256:
        r -= 1
        if r < 256:
            raise SystemExit("no free rank")
    return r


def build(choice):
    """choice: token id -> split position; returns rank_of including intermediates."""
    rank_of = {v: k for k, v in known.items()}
    inter = {}
    taken = set(used)

    def ensure(t, parent_rank):
        if t in rank_of or len(t) == 1:
            return
        cut = choice.get(t, 1)
        ensure(t[:cut], parent_rank); ensure(t[cut:], parent_rank)
        r = parent_rank - 1
        while r in taken or r < 256:
            r -= 1
        taken.add(r); rank_of[t] = r; inter[r] = t

    for k, v in sorted(golden.items()):
        if len(v) > 1:
            cut = choice.get(v, 1)
            ensure(v[:cut], k); ensure(v[cut:], k)
    return rank_of, inter


def failures(choice):
    rank_of, inter = build(choice)
    return [(t, ids) for t, ids, mr, mc in all_cases if encode_case(t, mr, mc, rank_of) != ids], rank_of, inter


choice = {}
# Prefer splits whose halves both exist already.
vals = set(known.values())
for k, v in golden.items():
    for cut in range(1, len(v)):
        if v[:cut] in vals and v[cut:] in vals:
            choice[v] = cut; break
fails, rank_of, inter = failures(choice)
for attempt in range(400):
    if not fails:
        break
    text = fails[0][0]
    # try alternative splits for tokens in the failing case
    improved = False
    toks = sorted({v for k, v in golden.items() if v in text.encode() and len(v) > 1}, key=len)
    toks += sorted({v for k, v in golden.items() if len(v) > 1} - set(toks), key=len)
    for v in toks:
        for cut in range(1, len(v)):
            if choice.get(v, 1) == cut:
                continue
            trial = dict(choice); trial[v] = cut
            f2, r2, i2 = failures(trial)
            if len(f2) < len(fails):
                choice, fails, rank_of, inter = trial, f2, r2, i2; improved = True; break
        if improved:
            break
    if not improved:
        break
if fails:
    for t, ids in fails:
        print("still failing:", repr(t), ids, encode_case(t, 25000, 400000, rank_of))
    raise SystemExit(1)
json.dump({
    "_comment": "Derived by derive_partial_vocab.py from k3-tokenizer-cases.json: id -> hex bytes. "
                "Not the real K3 vocabulary: a consistent reconstruction of the ids the golden cases use, "
                "plus intermediate merge tokens so byte-pair merging reproduces every case.",
    "golden": {str(k): v.hex() for k, v in sorted(golden.items())},
    "intermediate": {str(k): v.hex() for k, v in sorted(inter.items())},
}, open("partial_vocab.json", "w"), indent=1)
print(f"{len(golden)} golden tokens, {len(inter)} intermediates, all {len(all_cases)} cases reproduce")
