#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .devbin/ carried (scripts/gpu-pack.sh).
# Usage: scripts/gpu-run.sh [tests] [bench ARGS...]   Logs go to $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export K3_GOLDEN_DIR="$PWD/tests/golden/tiny-a" K3_TINY_T_DIR="${K3_TINY_T_DIR:-$PWD/tests/models/tiny-t}" K3_KERNEL_CACHE=/tmp/k3-kernels RUST_LOG=${RUST_LOG:-warn}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
# cuda_first_cost needs a checkpoint whose weight pass and GEMMs set the time: the K3-width one
# scripts/gpu-memory-plan.sh synthesizes (skipped without it).
[ -z "${K3_COST_MODEL:-}" ] && [ -f /dev/shm/k3-3l/config.json ] && export K3_COST_MODEL=/dev/shm/k3-3l
summary=()
if [ "${1:-tests}" = tests ]; then
  shift || true
  for t in ${DEVBIN:-.devbin}/cuda_*; do
    n=$(basename "$t")
    start=$(date +%s.%N)
    "$t" --test-threads=1 --nocapture >"$OUT/$n.log" 2>&1
    rc=$?
    el=$(python3 -c "print(f'{$(date +%s.%N)-$start:.1f}')")
    res=$(grep -E "^test result" "$OUT/$n.log" | tail -1)
    summary+=("$(printf '%-14s rc=%d %6ss  %s' "$n" "$rc" "$el" "$res")")
    grep -E "rel err|worst|exempt|identical|panicked|FAILED|SKIPPED|^\| |diverge|^turn [0-9]" "$OUT/$n.log" | head -60
  done
fi
printf '%s\n' "${summary[@]}"
