#!/usr/bin/env bash
# The benchmark runs of docs/cuda.md, on the GPU machine (repository root, .devbin carried).
# Usage: scripts/gpu-bench.sh [tests] [forward] [kernels] [project] [project-wide] [budget] [peer]
#        (default: tests kernels project budget peer). K3_PROFILE=1 adds a per-step GPU time table
#        to the project runs (stderr, kept in the logs).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export K3_GOLDEN_DIR="$PWD/tests/golden/tiny-a" K3_KERNEL_CACHE=/tmp/k3-kernels RUST_LOG=${RUST_LOG:-warn}
D=${DEVBIN:-.devbin}
B=$D/k3-prefill
steps=${*:-tests kernels project budget peer}
for s in $steps; do
  echo "=== $s ($(date +%T))"
  case $s in
    tests)   scripts/gpu-run.sh tests | tail -8 ;;
    forward) timeout 120 $D/cuda_forward --test-threads=1 --nocapture 2>&1 | tee "$OUT/forward.log" | grep -E "BF16 part|Bf16:|F32:|test result" | grep -v exempt | cut -c1-400 ;;
    kernels) timeout 180 $B bench --kernels --tokens ${KERNEL_TOKENS:-8192,32768,131072} 2>&1 | tee "$OUT/kernels.log" ;;
    project) timeout 300 $B bench --project --pinned-source --layers 4 --tokens 32768,131072 2>&1 | tee "$OUT/project.log" | tail -40 ;;
    project-wide) timeout 300 $B bench --project --pinned-source --layers 4 --chunk-tokens ${WIDE_CHUNK:-65536} --tokens 32768,131072 2>&1 | tee "$OUT/project-wide.log" | tail -40 ;;
    project-staged) timeout 300 $B bench --project --layers 4 --tokens 8192,32768,131072 2>&1 | tee "$OUT/project-staged.log" | tail -32 ;;
    budget)  timeout 240 $B bench --project --layers ${BUDGET_LAYERS:-8} --vram-budget 24 --tokens 8192,32768 2>&1 | tee "$OUT/budget.log" | tail -34 ;;
    peer)    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $D/fla_core-*.whl && \
             PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 300 python3 scripts/peer_bench.py --bin $B --tokens ${PEER_TOKENS:-8192,32768,131072} 2>&1 | tee "$OUT/peer.log" ;;
  esac
done
