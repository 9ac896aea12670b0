#!/usr/bin/env bash
# The README's main command: split inference end to end on one machine.
#
#   ./scripts/demo.sh
#
# 1. setup (apt packages, the MLX CPU wheel, the patched mlx-sys; see scripts/setup.sh),
# 2. a release build of k3-prefill and k3-decode,
# 3. a synthetic K3-shaped model (k3-prefill synth; cached in .demo/ between runs),
# 4. a prefill node on loopback (k3-prefill serve --backend auto: CUDA when a GPU is usable,
#    else the CPU reference backend),
# 5. a three-turn conversation through it (k3-decode generate --prefill-node): a long first
#    prompt and a medium second one go to the node, a short third one stays local; the timing
#    table of every turn is printed,
# 6. the same conversation prefilled locally only, to show the tokens agree.
#
# Environment: DEMO_PROMPT (first prompt, tokens; default 2048), DEMO_GEN (tokens generated per
# turn; 24), DEMO_DIR (work dir; .demo), DEMO_SKIP_SETUP=1 (skip step 1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
DEMO="${DEMO_DIR:-$ROOT/.demo}"
PROMPT="${DEMO_PROMPT:-2048}"
GEN="${DEMO_GEN:-24}"
mkdir -p "$DEMO"

say() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }
die() { printf '\ndemo: FAILED: %s\n' "$*" >&2; exit 1; }

SERVER_PID=""
cleanup() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$SERVER_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'die "interrupted"' INT TERM

# --- 1. setup ---------------------------------------------------------------------------------
if [[ "${DEMO_SKIP_SETUP:-0}" != 1 ]]; then
    say "setup (scripts/setup.sh)"
    ./scripts/setup.sh
fi
# shellcheck disable=SC1091
[[ -f .deps/env.sh ]] && source .deps/env.sh

# --- 2. build ---------------------------------------------------------------------------------
say "release build of k3-prefill and k3-decode"
cargo build --release --bins -p cuda-prefiller -p mac-decoder
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}/release"
PREFILL="$TARGET/k3-prefill"
DECODE="$TARGET/k3-decode"
[[ -x "$PREFILL" && -x "$DECODE" ]] || die "binaries missing in $TARGET"

# --- 3. model ---------------------------------------------------------------------------------
# The `small` preset's per-layer shapes (hidden 1024, 64 experts, top-8, MXFP4), 8 layers and a
# 32k vocabulary: ~0.5 GB, a few minutes for the whole demo on 2 CPU cores.
MODEL="$DEMO/model-small-l8-v32k"
SYNTH=(--preset small --layers 8 --vocab 32768 --seed 7)
if [[ ! -f "$MODEL/model.safetensors.index.json" || "$(cat "$MODEL/.synth-args" 2>/dev/null)" != "${SYNTH[*]}" ]]; then
    say "synthesizing a model: k3-prefill synth ${SYNTH[*]}"
    rm -rf "$MODEL"
    "$PREFILL" synth "${SYNTH[@]}" --out "$MODEL"
    echo "${SYNTH[*]}" > "$MODEL/.synth-args"
else
    say "model: $MODEL (cached)"
fi
"$PREFILL" inspect --model "$MODEL" >"$DEMO/inspect.txt" 2>&1 || { cat "$DEMO/inspect.txt" >&2; die "the model does not validate"; }

# --- prompts: deterministic token ids (a long first turn, a medium and a short follow-up) -------
python3 - "$DEMO" "$PROMPT" <<'EOF'
import json, random, sys
d, n = sys.argv[1], int(sys.argv[2])
r = random.Random(20261129)
for name, k in (("turn1", n), ("turn2", max(n // 4, 300)), ("turn3", 48)):
    json.dump([r.randrange(32000) for _ in range(k)], open(f"{d}/{name}.json", "w"))
EOF

# --- 4. prefill node --------------------------------------------------------------------------
say "starting the prefill node: k3-prefill serve --listen 127.0.0.1:0 --backend auto --insecure-dev"
SERVER_LOG="$DEMO/prefill-node.log"
RUST_LOG="${RUST_LOG:-info}" "$PREFILL" serve --model "$MODEL" --listen 127.0.0.1:0 --backend auto --insecure-dev \
    --config-dir "$DEMO/prefill-config" 2>"$SERVER_LOG" &
SERVER_PID=$!
ADDR=""
for _ in $(seq 600); do
    ADDR=$(sed -n 's/^k3-prefill: serving on \([^ ]*\).*/\1/p' "$SERVER_LOG" | head -1)
    [[ -n "$ADDR" ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$SERVER_LOG" >&2; die "the prefill node exited"; }
    sleep 0.2
done
[[ -n "$ADDR" ]] || { cat "$SERVER_LOG" >&2; die "the prefill node did not start within 120 s"; }
BACKEND=$(sed -n 's/^k3-prefill: serving on [^ ]* (backend \([a-z]*\).*/\1/p' "$SERVER_LOG" | head -1)
echo "prefill node on $ADDR, backend $BACKEND (log: $SERVER_LOG)" >&2

# --- 5. the conversation through the node -----------------------------------------------------
TURNS=(--input-ids "$DEMO/turn1.json" --next-turn "$DEMO/turn2.json" --next-turn "$DEMO/turn3.json")
COMMON=(--model "$MODEL" "${TURNS[@]}" --max-new-tokens "$GEN" --greedy --config-dir "$DEMO/decoder-config")
say "three turns through the node: k3-decode generate --prefill-node $ADDR --remote-min-tokens 256"
RUST_LOG="${RUST_LOG:-info}" "$DECODE" generate "${COMMON[@]}" --prefill-node "$ADDR" --insecure-dev --remote-min-tokens 256 \
    --timing-json "$DEMO/timing-split.json" --out "$DEMO/split.json" 2>"$DEMO/decoder-split.log" >/dev/null \
    || { cat "$DEMO/decoder-split.log" >&2; die "k3-decode generate --prefill-node failed"; }
sed -n '/^turn *route/,$p' "$DEMO/decoder-split.log" >&2
cat >&2 <<'LEGEND'
columns: route = where the prompt was prefilled (remote: the node; local: here, below
  --remote-min-tokens; fallback: here after the node failed, reason below the table);
  prompt = new prompt tokens of the turn; prefill = tokens prefilled (a remote turn adds the
  earlier generated tokens the node has not seen); context = tokens the session holds after it;
  remote / transfer / tail / ingest / local / 1st tok = seconds (remote: layer compute on the
  node; transfer: request sent -> every layer received and verified; tail: the node's last
  layer done -> state usable here; ingest: staging the layers into MLX; local: local prefill;
  1st tok: prefill start -> first token); decode = tokens generated, tok/s their rate;
  state MB = hand-off state received. "-" = that phase did not happen.
LEGEND
grep -q '"route": "remote"' "$DEMO/timing-split.json" || { cat "$DEMO/decoder-split.log" >&2; die "no turn was prefilled remotely"; }

# --- 6. the same conversation, local prefill only ---------------------------------------------
say "the same conversation with local prefill only"
"$DECODE" generate "${COMMON[@]}" --timing-json "$DEMO/timing-local.json" --out "$DEMO/local.json" \
    2>"$DEMO/decoder-local.log" >/dev/null || { cat "$DEMO/decoder-local.log" >&2; die "local k3-decode generate failed"; }
sed -n '/^turn *route/,$p' "$DEMO/decoder-local.log" >&2

if cmp -s <(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["turns"])' "$DEMO/split.json") \
          <(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["turns"])' "$DEMO/local.json"); then
    say "split and local conversations generated identical tokens ($GEN per turn)"
else
    die "split and local conversations differ on the $BACKEND node (see $DEMO/split.json and $DEMO/local.json)"
fi
echo "prefill node log: $SERVER_LOG; decoder logs and timing JSON: $DEMO/" >&2
