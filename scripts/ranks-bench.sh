#!/usr/bin/env bash
# Decoder ranks on one many-core machine (docs/multi-mac.md): per-token decode time of
# `k3-decode launch --ranks N -- generate` for N in $RANKS on a K3-width reduced-layer synthetic
# model (MLX CPU backend), and the loopback bytes the ranks send while decoding.
#   BIN=target/release scripts/ranks-bench.sh OUTDIR
# Env: BIN (folder with k3-decode and k3-prefill), MODEL (default OUTDIR/model, written by
# `k3-prefill synth` when missing), LAYERS (4), EXPERTS (64), TOKENS (16 new tokens per run),
# RANKS ("1 2 4"), CORES (nproc; each rank gets CORES/N BLAS threads), SYNTH_ARGS (more
# `k3-prefill synth` overrides, e.g. "--intermediate 1024").
# Writes OUTDIR/log-N.txt (every rank's log), OUTDIR/net-N.txt (loopback tx bytes sampled every
# 50 ms) and OUTDIR/summary.json.
set -euo pipefail
BIN=${BIN:-target/release}
OUT=${1:-/tmp/ranks-bench}
mkdir -p "$OUT"
M=${MODEL:-$OUT/model}
LAYERS=${LAYERS:-4}
EXPERTS=${EXPERTS:-64}
TOKENS=${TOKENS:-16}
RANKS=${RANKS:-"1 2 4"}
CORES=${CORES:-$(nproc)}
if [ ! -f "$M/config.json" ]; then
  t0=$(date +%s.%N)
  "$BIN"/k3-prefill synth --preset k3 --layers "$LAYERS" --full-attn-layers "$LAYERS" --experts "$EXPERTS" --vocab 8192 \
    --vision-layers 0 --vision-hidden 32 --vision-heads 1 --vision-qkv 32 --vision-intermediate 32 --vision-pos 2 \
    ${SYNTH_ARGS:-} --no-tokenizer --no-progress --seed 1 --out "$M" >"$OUT/synth.txt" 2>&1
  echo "synth: $(python3 -c "import time; print(round(time.time() - $t0, 1))") s, $(du -sh "$M" | cut -f1)"
fi
python3 -c 'import json; print(json.dumps(list(range(100, 132))))' >"$OUT/ids.json"
lo_tx() { sed -n 's/^ *lo: *//p' /proc/net/dev | awk '{print $9}'; }
for n in $RANKS; do
  ( while :; do echo "$(date +%s.%N) $(lo_tx)"; sleep 0.05; done ) >"$OUT/net-$n.txt" &
  sampler=$!
  OPENBLAS_NUM_THREADS=$((CORES / n > 0 ? CORES / n : 1)) RUST_LOG=info \
    "$BIN"/k3-decode launch --ranks "$n" --step-timeout 300 -- generate --model "$M" --input-ids "$OUT/ids.json" \
    --greedy --max-new-tokens "$TOKENS" >"$OUT/tokens-$n.json" 2>"$OUT/log-$n.txt" || { echo "ranks $n failed:"; tail -5 "$OUT/log-$n.txt"; }
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  echo "ranks $n: $(grep -h 'tok_per_s=' "$OUT/log-$n.txt" | grep -v 'local prefill' | grep -o 'rank=[0-9]*\|tok_per_s="*[0-9.]*\|peak_rss_mb="*[0-9.]*' | paste -sd' ')"
done
python3 - "$OUT" "$TOKENS" $RANKS <<'EOF'
import json, re, sys, datetime, bisect
out, tokens, ranks = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3:]]
def ts(line):
    m = re.match(r'(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z', line)
    return datetime.datetime.fromisoformat(m.group(1)[:26]).replace(tzinfo=datetime.timezone.utc).timestamp() if m else None
summary = {}
for n in ranks:
    log = open(f"{out}/log-{n}.txt").read().splitlines()
    # rank 0's lines: `rank=0` on the decode line; the prefill line of each rank carries no rank,
    # so the decode window runs from the last rank's prefill to the first rank's decode line
    pre = [ts(l) for l in log if 'local prefill' in l]
    dec = [l for l in log if re.search(r'\bdecode\b', l) and 'tok_per_s=' in l]
    if not pre or not dec:
        summary[n] = {"error": "no decode in the log"}
        continue
    tps = {int(re.search(r'rank=(\d+)', l).group(1)): float(re.search(r'tok_per_s="?([0-9.]+)', l).group(1)) for l in dec}
    rss = [float(re.search(r'peak_rss_mb="?([0-9.]+)', l).group(1)) for l in dec]
    t0, t1 = max(pre), min(ts(l) for l in dec)
    samples = [tuple(map(float, l.split())) for l in open(f"{out}/net-{n}.txt") if len(l.split()) == 2]
    times = [s[0] for s in samples]
    def at(t):
        i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
        (ta, a), (tb, b) = samples[i - 1], samples[i]
        return a + (b - a) * (t - ta) / (tb - ta) if tb > ta else b
    sent = at(t1) - at(t0)
    summary[n] = {
        "ranks": n,
        "tok_per_s_rank0": tps.get(0),
        "ms_per_token": round(1000 / tps[0], 1) if tps.get(0) else None,
        "peak_rss_mb_per_rank": rss,
        "decode_window_s": round(t1 - t0, 3),
        "loopback_bytes_in_window": sent,
        "bytes_per_token_per_rank": round(sent / tokens / n) if n > 1 else 0,
        "tokens": json.load(open(f"{out}/tokens-{n}.json"))["tokens"],
    }
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
for n, s in summary.items():
    print(n, {k: v for k, v in s.items() if k != "tokens"})
toks = [s.get("tokens") for s in summary.values()]
print("tokens identical over rank counts:", all(t == toks[0] for t in toks))
EOF
