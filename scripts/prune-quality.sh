#!/usr/bin/env bash
# Held-out perplexity of tiny-t pruned by REAP, frequency and random selection (docs/pruning.md):
# builds the corpus (Rust docs shipped with the toolchain), runs the prune_quality example (calibrate,
# prune, evaluate on the CPU reference) and plots. Needs python3 with matplotlib for the plot.
#   scripts/prune-quality.sh [OUT_DIR] [extra example args, e.g. --eval-windows 8]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/prune-quality}
shift || true
# shellcheck disable=SC1091
source .deps/env.sh
CORPUS=${CORPUS:-/tmp/prune-corpus}
[ -f "$CORPUS/heldout.txt" ] || python3 scripts/tiny_t/corpus.py --out "$CORPUS"
cargo run --release -p k3-e2e-tests --example prune_quality -- --model tests/models/tiny-t \
  --calib "$CORPUS/valid.txt" --heldout "$CORPUS/heldout.txt" --out "$OUT" "$@"
python3 scripts/prune_quality_plot.py "$OUT/results.json" docs/pruning/perplexity.png
cp "$OUT/results.json" docs/pruning/results.json
