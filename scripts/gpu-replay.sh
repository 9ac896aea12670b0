#!/usr/bin/env bash
# "The number users feel" (docs/e2e.md), on the lent H200 box from the repository root: the
# captured Claude Code session (mac-decoder/tests/fixtures/agents/claude-code-turn{1,2,3}.json)
# replayed through `k3-decode serve` on the K3-width 3-layer checkpoint, with the prefill node
# (`k3-prefill serve --backend cuda`, weights streamed from the page cache) paced to one and to
# four Gen5 NVMe drives (`--emulate-source-gbs 10` and `40`), and against the decoder alone.
# The decoder runs on MLX's CPU backend of this box (16 cores), standing in for the Mac; it skips
# its start-up calibration (a CPU is no Mac) and routes with --local-prefill-tok-s (default 120,
# the Mac Studio estimate of docs/e2e.md), which is also the local-only column.
# Per turn: time to the first streamed token, route and predicted times, prompt, cached and
# prefilled tokens (scripts/replay_agent.py), as JSON lines in $OUT/replay-*.jsonl.
# Usage: BIN=dir-with-k3-prefill-and-k3-decode OUT=dir [MODES='nvme1 nvme4'] [MODE_CAP=200] scripts/gpu-replay.sh
#   MODES may add `local` (the decoder alone, prefilling on this box's CPU: slow).
#   BIN/lib holds libmlx.so and the BLAS/LAPACK libraries it loads.
set -uo pipefail
BIN=${BIN:-.devbin}
OUT=${OUT:-gpu-out}
K3=${K3:-/dev/shm/k3-3l}
FIX=mac-decoder/tests/fixtures/agents
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-/tmp/k3-kernels}
if [ ! -f "$K3/config.json" ]; then
  /usr/bin/time -f "synth: %e s" "$BIN/k3-prefill" synth --preset k3 --layers 3 --seed 1 --no-progress --out "$K3" 2>&1 | tail -2
fi
PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; sleep 2; for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; PIDS=(); }
trap stop EXIT
port=18400
for mode in ${MODES:-nvme1 nvme4}; do
  port=$((port + 1))
  t0=$(date +%s)
  node=()
  case $mode in
    nvme1) gbs=10 ;;
    nvme4) gbs=40 ;;
    *) gbs="" ;;
  esac
  if [ -n "$gbs" ]; then
    RUST_LOG=info "$BIN/k3-prefill" serve --model "$K3" --backend cuda --listen 127.0.0.1:0 --insecure-dev \
      --config-dir "/tmp/replay-node-$mode" --emulate-source-gbs "$gbs" 2>"$OUT/node-$mode.log" &
    PIDS+=($!)
    addr=""
    for _ in $(seq 240); do
      addr=$(sed -n 's/^k3-prefill: serving on \([^ ]*\).*/\1/p' "$OUT/node-$mode.log" | head -1)
      [ -n "$addr" ] && break
      sleep 0.5
    done
    [ -z "$addr" ] && { echo "$mode: the node did not start"; tail -5 "$OUT/node-$mode.log"; stop; continue; }
    node=(--prefill-node "$addr" --insecure-dev --local-calibration-tokens 0)
  fi
  RUST_LOG=info,mac_decoder::remote=info "$BIN/k3-decode" serve --model "$K3" --listen "127.0.0.1:$port" "${node[@]}" \
    --config-dir "/tmp/replay-dec-$mode" --session-dir "/tmp/replay-sessions-$mode" 2>"$OUT/decoder-$mode.log" &
  PIDS+=($!)
  up=0
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { up=1; break; }
    kill -0 "${PIDS[-1]}" 2>/dev/null || break
    sleep 0.5
  done
  [ "$up" = 1 ] || { echo "$mode: the decoder did not start"; tail -5 "$OUT/decoder-$mode.log"; stop; continue; }
  echo "$mode: servers up in $(( $(date +%s) - t0 )) s"
  timeout "${MODE_CAP:-200}" python3 scripts/replay_agent.py --url "http://127.0.0.1:$port" --log "$OUT/decoder-$mode.log" \
    --label "$mode" "$FIX/claude-code-turn1.json" "$FIX/claude-code-turn2.json" "$FIX/claude-code-turn3.json" >"$OUT/replay-$mode.jsonl"
  echo "$mode: replay rc=$? in $(( $(date +%s) - t0 )) s"
  grep -h "start-up cost prediction\|start-up weight feed" "$OUT/node-$mode.log" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-300
  stop
done
python3 - "$OUT" <<'EOF'
import json, sys, glob
print(f"{'mode':<6} {'turn':>4} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'route':<8} {'pred local':>10} {'pred remote':>11} {'1st token s':>11}")
for f in sorted(glob.glob(sys.argv[1] + "/replay-*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        rt = r["routes"][-1] if r["routes"] else {"route": "held", "pred_local_s": "", "pred_remote_s": ""}
        print(f"{r['label']:<6} {r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['prefilled_tokens']:>9} {rt['route']:<8} {rt['pred_local_s']:>10} {rt['pred_remote_s']:>11} {r['ttft_s']:>11}")
EOF
