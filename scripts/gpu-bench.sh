#!/usr/bin/env bash
# The benchmark runs of docs/cuda.md, on the GPU machine (repository root, .devbin carried; see
# scripts/gpu-pack.sh). Every timing comes from `k3-prefill bench --model DIR` (the executor and
# weight streamer that forward and serve run) except the kernels-alone and peer steps.
# Usage: scripts/gpu-bench.sh [tests] [synth] [pinned] [grain] [window] [pagecache] [shared] [budget] [disk] [kernels] [peer]
#        [engine] [ppinned] [pengine] [experts]   (default: tests synth pinned pagecache budget disk).
# `engine` / `pengine`: the pinned run (with --profile: `pengine`) with --host-copy engine, the
# former host <-> device copies of the compute stream (cuMemcpy + synchronisation, through the copy
# engines), the "before" of docs/cuda.md's host-copy table; `ppinned`: --profile pinned (per-step
# GPU time and the executor thread's blocking calls); `experts`: the routed-expert kernels alone
# (mma.sync and dense path); `shared`: one 8k-token prompt against 4 in one shared weight pass
# (bench --concurrent); `grain`: the pinned run with the dense expert path's GEMM rows rounded
# up to GRAIN (default 64; --moe-dense row_grain). The host-copy table's runs: `PTOK=32768,131072 KERNEL_TOKENS=32768
# scripts/gpu-bench.sh synth pengine ppinned experts`.
# K3 widths: `synth` writes a 3-layer K3-width checkpoint (dense layer 0, a KDA and an MLA MoE
# layer, 38.6 GiB) into tmpfs ($K3_DIR, default /dev/shm/k3), i.e. held in host RAM and read by the
# same checkpoint reader; `disk` writes a 1-layer K3-width checkpoint to local disk ($K3_DISK_DIR)
# for the O_DIRECT run. `bench --profile` adds the per-step GPU time table.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export K3_GOLDEN_DIR="$PWD/tests/golden/tiny-a" K3_KERNEL_CACHE=/tmp/k3-kernels RUST_LOG=${RUST_LOG:-warn}
D=${DEVBIN:-.devbin}
B=$D/k3-prefill
K3=${K3_DIR:-/dev/shm/k3}
DISK=${K3_DISK_DIR:-$PWD/.k3-disk}
TOK=${TOKENS:-32768,131072}
steps=${*:-tests synth pinned pagecache budget disk}
for s in $steps; do
  echo "=== $s ($(date +%T))"
  case $s in
    tests)   DEVBIN=$D scripts/gpu-run.sh tests | tail -12 ;;
    synth)   [ -f "$K3/config.json" ] || { /usr/bin/time -f "synth: %e s" $B synth --preset k3 --layers 3 --seed 1 --no-progress --out "$K3" 2>&1 | tail -3; }
             du -sh "$K3"; free -g | head -2 ;;
    pinned)  timeout 300 $B bench --model "$K3" --backend cuda --pin-host --tokens $TOK 2>&1 | tee "$OUT/pinned.log" | tail -${TAIL:-30} ;;
    grain)   timeout 300 $B bench --model "$K3" --backend cuda --pin-host --moe-dense row_grain=${GRAIN:-64} --tokens $TOK 2>&1 | tee "$OUT/grain.log" | tail -${TAIL:-30} ;;
    engine)  timeout 300 $B bench --model "$K3" --backend cuda --pin-host --host-copy engine --tokens $TOK 2>&1 | tee "$OUT/engine.log" | tail -${TAIL:-30} ;;
    ppinned) timeout 300 $B bench --model "$K3" --backend cuda --pin-host --profile --tokens ${PTOK:-$TOK} 2>&1 | tee "$OUT/ppinned.log" | tail -${TAIL:-30} ;;
    pengine) timeout 300 $B bench --model "$K3" --backend cuda --pin-host --profile --host-copy engine --tokens ${PTOK:-$TOK} 2>&1 | tee "$OUT/pengine.log" | tail -${TAIL:-30} ;;
    experts) timeout 300 $B bench --kernels --experts-only --tokens ${KERNEL_TOKENS:-32768,131072} 2>&1 | tee "$OUT/experts.log" ;;
    window)  timeout 300 $B bench --model "$K3" --backend cuda --pin-host --copy-window ${WINDOW:-4} --tokens $TOK 2>&1 | tee "$OUT/window.log" | tail -${TAIL:-30} ;;
    pagecache) timeout 300 $B bench --model "$K3" --backend cuda --tokens $TOK 2>&1 | tee "$OUT/pagecache.log" | tail -${TAIL:-30} ;;
    shared)  timeout 300 $B bench --model "$K3" --backend cuda --tokens ${SHARED_TOKENS:-8192} --concurrent ${SHARED_N:-4} --source-probe-gb 2 2>&1 | tee "$OUT/shared.log" | tail -${TAIL:-30} ;;
    budget)  timeout 300 $B bench --model "$K3" --backend cuda --emulate-gpu-memory 24 --tokens ${BUDGET_TOKENS:-8192,32768,65536} 2>&1 | tee "$OUT/budget.log" | tail -${TAIL:-30} ;;
    disk)    mkdir -p "$DISK"; [ -f "$DISK/config.json" ] || { /usr/bin/time -f "synth (disk): %e s" $B synth --preset k3 --layers 1 --seed 1 --no-progress --out "$DISK" 2>&1 | tail -2; sync; }
             df -hT "$DISK" | tail -1
             timeout 300 $B bench --model "$DISK" --backend cuda --direct-io --source-probe-gb ${DISK_PROBE_GB:-2} --tokens ${DISK_TOKENS:-4096} 2>&1 | tee "$OUT/disk.log" | tail -${TAIL:-8} ;;
    kernels) timeout 180 $B bench --kernels --tokens ${KERNEL_TOKENS:-8192,32768,131072} 2>&1 | tee "$OUT/kernels.log" ;;
    peer)    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $D/fla_core-*.whl && \
             PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 300 python3 scripts/peer_bench.py --bin $B --tokens ${PEER_TOKENS:-8192,32768,131072} 2>&1 | tee "$OUT/peer.log" ;;
  esac
done
