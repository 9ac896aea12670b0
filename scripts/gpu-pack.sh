#!/usr/bin/env bash
# Builds the release k3-prefill binary and the CUDA test binaries here and copies them, with
# stable names, into .devbin/ (git-ignored) for a run on the lent GPU machine:
#   scripts/gpu-pack.sh            # then carry .devbin and run scripts/gpu-run.sh there
#   DEVBIN=.devbin-x scripts/gpu-pack.sh   # another folder (then DEVBIN=.devbin-x on the GPU box too)
set -euo pipefail
cd "$(dirname "$0")/.."
D=${DEVBIN:-.devbin}
mkdir -p "$D"
cargo build --release -p cuda-prefiller --bin k3-prefill
cp target/release/k3-prefill "$D"/
cargo test --release -p cuda-prefiller --test 'cuda_*' --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except Exception: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"]
        shutil.copy(m["executable"], sys.argv[1] + "/" + name)
        print("packed", name)
' "$D"
strip "$D"/k3-prefill "$D"/cuda_* 2>/dev/null || true
cp .whl/fla_core-*.whl "$D"/ 2>/dev/null || echo "no fla-core wheel in .whl/ (pip download fla-core there for the peer bench)"
du -sh "$D"
