#!/usr/bin/env bash
# Issue 34's GPU runs (the memory plan), on the lent H200, from the repository root:
#   the K3-width 3-layer checkpoint (`synth --preset k3 --layers 3 --seed 1`) in /dev/shm, then
#   `bench` on emulated 24 and 32 GB cards (--emulate-gpu-memory: a ballast holds the rest of the
#   H200) and on the whole H200, weights streamed from the page cache, every row's memory plan,
#   median/min/max seconds, roofline ratio, peak device memory (allocator high-water mark and
#   the device's used memory) and peak host memory as JSON lines; nvidia-smi's memory.used
#   sampled every 100 ms beside (it counts the ballast).
# Usage: BIN=path/to/k3-prefill OUT=dir [DEADLINE_S=420] [STEPS='emu24 emu32 h200 h200-524k'] scripts/gpu-memory-plan.sh
#   more steps: emu24-pinned emu32-pinned (weights from --pin-host), emu24-profile emu32-profile
# The lengths are the ones the plan admits on each card (`k3-prefill inspect --config DIR
# --gpu-memory GB --host-memory GB` prints the longest prompt); a longer one is refused up front.
set -uo pipefail
B=${BIN:-.devbin-mem/k3-prefill}
OUT=${OUT:-gpu-out}
K3=${K3:-/dev/shm/k3-3l}
DEADLINE=$(( $(date +%s) + ${DEADLINE_S:-420} ))
mkdir -p "$OUT"
export K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-/tmp/k3-kernels} RUST_LOG=${RUST_LOG:-warn}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
free -g | head -2 | tee -a "$OUT/gpu.txt"
if [ ! -f "$K3/config.json" ]; then
  /usr/bin/time -f "synth: %e s" "$B" synth --preset k3 --layers 3 --seed 1 --no-progress --out "$K3" 2>&1 | tail -2 | tee -a "$OUT/gpu.txt"
fi
for g in 24 32 141; do
  echo "== inspect --gpu-memory $g --host-memory 125" >>"$OUT/inspect.txt"
  "$B" inspect --config "$K3" --gpu-memory $g --host-memory 125 | grep -A1 "longest prompt" >>"$OUT/inspect.txt"
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$OUT/smi.txt" 2>/dev/null &
SMI=$!
# run NAME CAP_S ARGS...: one bench, at most CAP_S seconds and never past the deadline
run() {
  local name=$1 cap=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  [ "$left" -lt 20 ] && { echo "$name: skipped (deadline)" | tee -a "$OUT/summary.txt"; return; }
  [ "$cap" -gt "$left" ] && cap=$left
  local t0=$(date +%s) l0=$(wc -l <"$OUT/smi.txt")
  timeout "$cap" "$B" bench --model "$K3" --backend cuda --json "$@" >"$OUT/$name.jsonl" 2>"$OUT/$name.log"
  local rc=$?
  local smi=$(tail -n +$((l0 + 1)) "$OUT/smi.txt" | sort -n | tail -1)
  echo "$name rc=$rc $(( $(date +%s) - t0 )) s: $* (nvidia-smi peak memory.used ${smi} MiB, ballast included)" | tee -a "$OUT/summary.txt"
  python3 - "$OUT/$name.jsonl" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    try: r = json.loads(line)
    except Exception: continue
    if "tokens" not in r: continue
    print(f"  {r['tokens']:>7} tokens: median {r['median_s']:.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f}, {r['repeats']} runs), "
          f"{100*r['of_roofline']:.1f} % of roofline, peak device {r['peak_device_gb']:.2f} GB allocated / {r['peak_device_used_gb']:.2f} GB used, "
          f"host {r['peak_host_gb']:.2f} GB, planned {r['plan_peak_gb']:.2f} GB, weights {r['weight_gb']:.1f} GB, 93 layers {r['k3_93_layers_s']:.1f} s")
    print(f"           {r['plan']}")
EOF
}
# STEPS picks the runs (default all four); *_TOKENS and REPEATS the rows
for step in ${STEPS:-emu24 emu32 h200 h200-524k}; do
  case $step in
    emu24) run emu24 ${EMU24_CAP:-200} --emulate-gpu-memory 24 --tokens ${EMU24_TOKENS:-8192,32768,131072} --repeats ${REPEATS:-3} ;;
    emu32) run emu32 ${EMU32_CAP:-240} --emulate-gpu-memory 32 --tokens ${EMU32_TOKENS:-32768,131072,262144} --repeats ${REPEATS:-3} ;;
    h200) run h200 ${H200_CAP:-100} --tokens ${H200_TOKENS:-131072,262144} --repeats ${REPEATS:-3} ;;
    h200-524k) run h200-524k ${H524_CAP:-90} --tokens ${H524_TOKENS:-524288} --repeats 1 ;;
    # the same card from pinned host memory (`--pin-host`) instead of the page cache
    emu24-pinned) run emu24-pinned ${EMU24_CAP:-200} --emulate-gpu-memory 24 --pin-host --tokens ${EMU24_TOKENS:-8192,32768,131072} --repeats ${REPEATS:-3} ;;
    emu32-pinned) run emu32-pinned ${EMU32_CAP:-240} --emulate-gpu-memory 32 --pin-host --tokens ${EMU32_TOKENS:-32768,131072,262144} --repeats ${REPEATS:-3} ;;
    # where the time of one row goes (GPU time per step, host time blocked): --profile's tables
    emu24-profile) run emu24-profile ${EMU24_CAP:-200} --emulate-gpu-memory 24 --profile --tokens ${PROFILE_TOKENS:-32768} --repeats 1 ;;
    emu32-profile) run emu32-profile ${EMU32_CAP:-240} --emulate-gpu-memory 32 --profile --tokens ${PROFILE_TOKENS:-32768} --repeats 1 ;;
  esac
done
kill $SMI 2>/dev/null
