#!/usr/bin/env bash
# The GPU-box measurements of docs/pruning.md (issue 17, acceptance item 2), in one run:
#   calibration throughput as a ratio of plain prefill throughput (same binary, same model,
#   same weight source), and prune throughput against the disk's measured read rate.
# Usage (GPU machine, repository root, the release k3-prefill in $DEVBIN, see scripts/gpu-pack.sh):
#   DEVBIN=.devbin scripts/prune-gpu.sh            # logs and results.txt in $OUT (default gpu-out)
# The model: `synth --preset k3 --layers 3 --seed 1` (K3 widths; dense layer 0, a KDA and an MLA
# MoE layer of 896 experts; 41.5 GB). It is written to local disk ($K3_DIR, default .k3-prune)
# so that one copy serves both: calibration and bench read it through the page cache (it is
# cached after synth writes it; the same reads as from /dev/shm), and the cold prune reads it
# from the disk after its pages are dropped (posix_fadvise DONTNEED). Set K3_DIR=/dev/shm/k3 to
# skip the cold prune.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
D=${DEVBIN:-.devbin}
B=$D/k3-prefill
K3=${K3_DIR:-$PWD/.k3-prune}
TOK=${TOKENS:-8192}
NPROMPTS=${NPROMPTS:-3}
KEEP=${KEEP:-242}
SYNTH=${SYNTH:---preset k3 --layers 3 --seed 1}   # (local dry run: SYNTH="--preset tiny" BACKEND=cpu)
BACKEND=${BACKEND:-cuda}
VOCAB_IDS=${VOCAB_IDS:-160000}
export K3_KERNEL_CACHE=/tmp/k3-kernels RUST_LOG=${RUST_LOG:-warn}
R="$OUT/results.txt"; : >"$R"
say() { echo "$*" | tee -a "$R"; }
t() { date +%s.%N; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$R"
df -hT "$(dirname "$K3")" | tail -1 | tee -a "$R"
# The K3-width model needs 41.5 GB: without room on the disk, use tmpfs (no cold prune then).
case "$K3" in /dev/shm/*) ;; *) mkdir -p "$K3"; avail=$(df -B1 --output=avail "$K3" | tail -1)
  if [ "$avail" -lt 46000000000 ] && [ ! -f "$K3/config.json" ]; then echo "only $avail bytes free on the disk: using /dev/shm/k3"; rmdir "$K3"; K3=/dev/shm/k3; fi ;; esac

echo "=== synth ($(date +%T))"
if [ ! -f "$K3/config.json" ]; then
  s=$(t); $B synth $SYNTH --no-progress --out "$K3" >"$OUT/synth.log" 2>&1 || { cat "$OUT/synth.log"; exit 1; }
  say "synth: $(python3 -c "print(f'{$(t)-$s:.1f}')") s, $(du -sb "$K3" | cut -f1) bytes"
fi

echo "=== prompts"
python3 - "$OUT" "$TOK" "$NPROMPTS" "$VOCAB_IDS" <<'EOF'
import json, random, sys
out, tok, n, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
r = random.Random(1)
# ids below 160000 (K3's base tokens; no special or media-placeholder ids)
with open(f"{out}/prompts.jsonl", "w") as f:
    for _ in range(n):
        f.write(json.dumps([r.randrange(1, vocab) for _ in range(tok)]) + "\n")
EOF

echo "=== plain prefill: bench ($(date +%T))"
timeout 120 $B bench --model "$K3" --backend $BACKEND --tokens "$TOK" 2>&1 | tee "$OUT/bench.log" | tail -4
say "bench $TOK tokens (default chunks): $(awk -v t="$TOK" '$2 == t' "$OUT/bench.log" | head -1)"
if [ -n "${BENCH_2048:-}" ]; then
  timeout 120 $B bench --model "$K3" --backend $BACKEND --tokens "$TOK" --chunk-tokens 2048 2>&1 | tee "$OUT/bench-2048.log" | tail -2
  say "bench $TOK tokens (2048-token chunks, as calibrate): $(awk -v t="$TOK" '$2 == t' "$OUT/bench-2048.log" | head -1)"
fi

echo "=== calibrate ($(date +%T))"
RUST_LOG=info timeout 150 $B calibrate --model "$K3" --prompts "$OUT/prompts.jsonl" --out "$OUT/stats.json" --backend $BACKEND --fresh 2>&1 \
  | tr '\r' '\n' | grep -v "^calibrate \[" | tee "$OUT/calibrate.log" | tail -5
say "calibrate: $(grep 'calibration done' "$OUT/calibrate.log" | tail -1)"

echo "=== prune from the page cache into /dev/shm ($(date +%T))"
rm -rf /dev/shm/k3-pruned-warm /dev/shm/k3-pruned-cold
timeout 120 $B prune --model "$K3" --stats "$OUT/stats.json" --keep "$KEEP" --out /dev/shm/k3-pruned-warm 2>&1 | tee "$OUT/prune-warm.log" | tail -3
say "prune (page cache -> /dev/shm): $(grep '^wrote' "$OUT/prune-warm.log")"
rm -rf /dev/shm/k3-pruned-warm

case "$K3" in /dev/shm/*) exit 0 ;; esac
echo "=== disk read rate and prune from disk ($(date +%T))"
sync
python3 - "$K3" <<'EOF'
import os, sys
d = sys.argv[1]
for n in os.listdir(d):
    p = os.path.join(d, n)
    if os.path.isfile(p):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
EOF
grep -E "^(Cached|Buffers)" /proc/meminfo | tee -a "$R"
# The disk's sequential read rate: O_DIRECT, 8 MiB requests, one of the largest shards.
big=$(ls -S "$K3"/*.safetensors | head -1)
say "dd O_DIRECT read of $(basename "$big"): $(dd if="$big" of=/dev/null bs=8M count=${DD_COUNT:-512} iflag=direct 2>&1 | tail -1)"
python3 - "$K3" <<'EOF'
import os, sys
d = sys.argv[1]
for n in os.listdir(d):
    p = os.path.join(d, n)
    if os.path.isfile(p):
        fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
EOF
timeout 150 $B prune --model "$K3" --stats "$OUT/stats.json" --keep "$KEEP" --out /dev/shm/k3-pruned-cold 2>&1 | tee "$OUT/prune-cold.log" | tail -3
say "prune (disk, cold -> /dev/shm): $(grep '^wrote' "$OUT/prune-cold.log")"
rm -rf /dev/shm/k3-pruned-cold
cat "$R"
