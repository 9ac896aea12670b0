#!/usr/bin/env python3
"""Byte-level BPE tokenizer for tiny-t, trained on the training split, in K3's release format.

Pre-tokenization is K3's `pat_str` (spec K3_CHAT §1.2, the same pattern as
mac-decoder/src/tokenizer/split.rs); merges are learned with HF `tokenizers`' BPE trainer over
the 256 byte symbols; the result is written as `tiktoken.model` (base64 of the token bytes, a
space, the rank = id): the 256 single bytes first in GPT-2 `bytes_to_unicode` order (as in the
release), then the merges in the order they were learned. The special block above the base
tokens (K3's 256-slot layout for vocabularies >= 2048) and `tokenizer_config.json` come from the
project's synthetic-model writer (`k3-prefill synth`), which lays them out from `vocab_size`.

Also the encoder used by the other scripts: `load(path)` gives a tiktoken `Encoding` with the same
ranks and pattern as the Rust tokenizer (tiktoken-rs), so ids agree with the engines.

    python3 scripts/tiny_t/tokenizer.py --train /tmp/tiny-t-corpus/train.txt --base 3840 --out DIR
"""
import argparse
import base64
import os

# K3's pre-tokenization pattern, verbatim (K3_CHAT §1.2).
PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# K3's named special tokens and their offsets in the 256-slot block (protocol/src/synth/tokenizer.rs).
SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
    "[start_header_id]": 6, "[end_header_id]": 7, "[EOT]": 9, "<|media_begin|>": 18,
    "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21, "<osagent_mode>": 65,
    "[UNK]": 254, "[PAD]": 255,
}


def bytes_to_unicode_order():
    """The 256 bytes in GPT-2 `bytes_to_unicode` order, with the character each maps to."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs, [chr(c) for c in cs]


def train(train_txt, n_base):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train([train_txt], trainer)
    vocab = tok.get_vocab()
    order, chars = bytes_to_unicode_order()
    dec = {c: b for b, c in zip(order, chars)}
    ranks = [bytes([b]) for b in order]
    seen = set(ranks)
    # Merged tokens in the order the trainer created them (its ids after the alphabet).
    for s, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        bt = bytes(dec[c] for c in s)
        if bt not in seen:
            seen.add(bt)
            ranks.append(bt)
    return ranks[:n_base]


def write_ranks(path, ranks):
    with open(path, "w") as f:
        for i, t in enumerate(ranks):
            f.write(f"{base64.b64encode(t).decode()} {i}\n")


def load(model_dir):
    """tiktoken Encoding of a model directory's `tiktoken.model` with K3's pattern and specials."""
    import tiktoken

    ranks = {}
    for line in open(os.path.join(model_dir, "tiktoken.model")):
        if line.strip():
            t, r = line.split()
            ranks[base64.b64decode(t)] = int(r)
    n_base = len(ranks)
    specials = {name: n_base + off for name, off in SPECIAL_OFFSETS.items()}
    return tiktoken.Encoding(name="tiny-t", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", required=True, help="training text (corpus.py's train.txt)")
    ap.add_argument("--base", type=int, default=3840, help="base (BPE) tokens; vocab_size = base + 256")
    ap.add_argument("--out", required=True, help="directory for tiktoken.model")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    ranks = train(a.train, a.base)
    assert len(ranks) == a.base, f"trainer gave {len(ranks)} tokens, wanted {a.base}"
    write_ranks(os.path.join(a.out, "tiktoken.model"), ranks)
    enc = load(a.out)
    text = open(a.train, encoding="utf-8").read()[:200000]
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    print(f"{a.base} base tokens; {len(text) / len(ids):.2f} characters per token on the first 200k characters")


if __name__ == "__main__":
    main()
