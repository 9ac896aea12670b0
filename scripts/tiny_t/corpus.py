#!/usr/bin/env python3
"""Plain-text English corpus for tiny-t from the Rust documentation shipped with a toolchain.

Source: `<toolchain>/share/doc/rust/html` (MIT/Apache-2.0), the mdBook books only (the Book, the
Reference, the Rustonomicon, Rust by Example, Cargo, rustc, rustdoc, the edition guide, the
embedded book, Clippy, the style guide, the error-code index, the unstable book), and the prose of
the API documentation of std, alloc, core, proc_macro and test (the `docblock` divs; the
architecture intrinsics and SIMD modules are skipped).

Book pages: only the `<main>` element is read. Everywhere code blocks (`<pre>`) are dropped and
inline code is kept as text, so what remains is prose. Redirect stubs (`noindex`), the old
editions' stubs, `print.html` (a whole book again), `toc.html` and `404.html` are skipped.

Split (deterministic): a page is held out when sha256 of its key, as an integer, is 0 mod 20
(about 5 % of the pages; the text perplexity is reported on), validation text (model selection
during training) when it is 1 mod 20, training text otherwise; the key is the path relative to the html root, without the crate for
API pages (so std's re-export of a core item lands in the same split). Paragraphs of 40 or more
characters are kept once (training text first, then validation, then held-out), so no held-out
paragraph is also training or validation text.

Writes OUT/train.txt, OUT/valid.txt and OUT/heldout.txt (pages separated by a blank line) and OUT/pages.tsv
(path, split, characters). Python standard library only.

    python3 scripts/tiny_t/corpus.py --out /tmp/tiny-t-corpus
"""
import argparse
import glob
import hashlib
import html.parser
import os
import re
import sys

BOOKS = ["book", "reference", "nomicon", "rust-by-example", "cargo", "rustc", "rustdoc",
         "edition-guide", "embedded-book", "clippy", "style-guide", "error_codes", "unstable-book"]
SKIP_NAMES = {"print.html", "toc.html", "404.html"}
SKIP_DIRS = ("2018-edition", "first-edition", "second-edition")
# API documentation (rustdoc pages): only the prose of the `docblock` divs is read.
API_CRATES = ["std", "alloc", "core", "proc_macro", "test"]
# Thousands of near-identical intrinsic pages.
API_SKIP = {"arch", "core_arch", "simd", "core_simd", "intrinsics", "std_detect"}
BLOCK = {"p", "div", "li", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "dt", "dd", "tr", "table",
         "ul", "ol", "section", "header", "footer", "br", "hr", "details", "summary"}
DROP = {"pre", "script", "style", "nav", "button", "svg", "template"}


class MainText(html.parser.HTMLParser):
    """Collects the text inside <main> (mdBook) or inside `docblock` divs (rustdoc), minus code
    blocks and scripts, with block breaks."""

    def __init__(self, rustdoc=False):
        super().__init__(convert_charrefs=True)
        self.rustdoc = rustdoc
        self.in_main = 0
        self.stack = []  # rustdoc: per open div, whether it opened a docblock
        self.drop = 0
        self.parts = []

    def handle_starttag(self, tag, attrs):
        if self.rustdoc and tag == "div":
            cls = dict(attrs).get("class") or ""
            opens = "docblock" in cls.split() and "item-decl" not in cls
            self.stack.append(opens)
            if opens:
                self.in_main += 1
                self.parts.append("\n\n")
                return
        if tag == "main" and not self.rustdoc:
            self.in_main += 1
        elif self.in_main:
            if tag in DROP:
                self.drop += 1
            elif tag in BLOCK:
                self.parts.append("\n")
                if tag == "li" and not self.drop:
                    self.parts.append("- ")

    def handle_startendtag(self, tag, attrs):
        if self.in_main and tag in ("br", "hr"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.rustdoc and tag == "div" and self.stack:
            if self.stack.pop():
                self.in_main = max(0, self.in_main - 1)
                self.parts.append("\n\n")
                return
        if tag == "main" and not self.rustdoc:
            self.in_main = max(0, self.in_main - 1)
        elif self.in_main:
            if tag in DROP:
                self.drop = max(0, self.drop - 1)
            elif tag in BLOCK:
                self.parts.append("\n")

    def handle_data(self, data):
        if self.in_main and not self.drop:
            self.parts.append(data)


def page_text(raw, rustdoc=False):
    p = MainText(rustdoc)
    p.feed(raw)
    p.close()
    text = "".join(p.parts)
    lines = []
    for line in text.split("\n"):
        line = re.sub(r"[ \t\u00a0]+", " ", line).strip()
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\n(- )?\n+", lambda m: "\n\n" if not m.group(1) else "\n- ", text)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    # Drop lines that are only punctuation (anchors, leftovers of removed code).
    keep = [l for l in text.split("\n") if not l or re.search(r"[A-Za-z]", l)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(keep)).strip()


def split_of(key):
    r = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 20
    return "heldout" if r == 0 else "valid" if r == 1 else "train"


def pages(root):
    """(relative path, split key, is rustdoc) of every page read, in a fixed order."""
    for book in BOOKS:
        for path in sorted(glob.glob(os.path.join(root, book, "**", "*.html"), recursive=True)):
            rel = os.path.relpath(path, root)
            if os.path.basename(path) in SKIP_NAMES or any(f"/{d}/" in rel for d in SKIP_DIRS):
                continue
            yield rel, rel, False
    for crate in API_CRATES:
        for path in sorted(glob.glob(os.path.join(root, crate, "**", "*.html"), recursive=True)):
            rel = os.path.relpath(path, root)
            inner = rel.split("/", 1)[1]
            if inner.split("/")[0] in API_SKIP or os.path.basename(path) in ("all.html", "sidebar-items.html"):
                continue
            # std re-exports core and alloc: the same item gets the same split in every crate.
            yield rel, inner, True


def default_root():
    roots = sorted(glob.glob(os.path.expanduser("~/.rustup/toolchains/*/share/doc/rust/html")))
    # Prefer a numbered release toolchain (stable content), else the first one found.
    numbered = [r for r in roots if re.search(r"/toolchains/\d", r)]
    return (numbered or roots or [None])[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=default_root(), help="the toolchain's share/doc/rust/html")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not a.root or not os.path.isdir(a.root):
        sys.exit("no Rust documentation found (install a toolchain with rustup, or pass --root)")
    os.makedirs(a.out, exist_ok=True)
    texts = {"train": [], "valid": [], "heldout": []}
    rows = []
    for rel, key, rustdoc in pages(a.root):
        raw = open(os.path.join(a.root, rel), encoding="utf-8", errors="replace").read()
        if 'content="noindex' in raw or "no longer distributed with Rust" in raw:
            continue
        if not rustdoc and "<main>" not in raw:
            continue
        text = page_text(raw, rustdoc)
        s = split_of(key)
        texts[s].append((rel, text))
    # Paragraph-level de-duplication (std re-exports, repeated boilerplate): training text first,
    # then held-out text, so no held-out paragraph was seen in training.
    seen = set()
    out = {}
    for s in ("train", "valid", "heldout"):
        kept_pages = []
        for rel, text in texts[s]:
            kept = []
            for para in text.split("\n\n"):
                h = hashlib.sha1(para.encode()).digest()
                if len(para) >= 40 and h in seen:
                    continue
                seen.add(h)
                kept.append(para)
            page = "\n\n".join(kept).strip()
            if len(page) >= 200:
                kept_pages.append(page)
                rows.append(f"{rel}\t{s}\t{len(page)}")
        out[s] = kept_pages
        with open(os.path.join(a.out, f"{s}.txt"), "w", encoding="utf-8") as f:
            f.write("\n\n".join(kept_pages) + "\n")
    with open(os.path.join(a.out, "pages.tsv"), "w") as f:
        f.write("\n".join(rows) + "\n")
    for s, kept_pages in out.items():
        print(f"{s}: {len(kept_pages)} pages, {sum(map(len, kept_pages))} characters")
    print(f"source: {a.root}")


if __name__ == "__main__":
    main()
