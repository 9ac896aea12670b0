#!/usr/bin/env bash
# The README's main command: split inference end to end on one machine.
#
#   ./scripts/demo.sh
#
# 1. setup (apt packages, the MLX CPU wheel, the patched mlx-sys; see scripts/setup.sh),
# 2. a release build of k3-prefill and k3-decode,
# 3. a readable chat on the trained model tests/models/tiny-t: a prefill node on loopback
#    (k3-prefill serve --backend auto: CUDA when a GPU is usable, else the CPU reference
#    backend) and the OpenAI server (k3-decode serve --prefill-node); three chat turns through
#    /v1/chat/completions (the real chat template and tokenizer, greedy), each reply decoded and
#    printed (scripts/chat_demo.py),
# 4. on a larger synthetic K3-shaped model (k3-prefill synth; cached in .demo/ between runs),
#    one long prompt prefilled on the node (k3-decode generate --prefill-node) and once locally:
#    the same tokens, and one line saying how much sooner the first token came.
#
# Environment: DEMO_TINY_T (the chat model; tests/models/tiny-t), DEMO_CHAT_TOKENS (tokens per
# reply; 64), DEMO_PROMPT (the long prompt, tokens; 2048), DEMO_GEN (tokens generated after it;
# 8), DEMO_DIR (work dir; .demo), DEMO_SKIP_SETUP=1 (skip step 1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
DEMO="${DEMO_DIR:-$ROOT/.demo}"
TINY_T="${DEMO_TINY_T:-$ROOT/tests/models/tiny-t}"
CHAT_TOKENS="${DEMO_CHAT_TOKENS:-64}"
PROMPT="${DEMO_PROMPT:-2048}"
GEN="${DEMO_GEN:-8}"
mkdir -p "$DEMO"

say() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }
die() { printf '\ndemo: FAILED: %s\n' "$*" >&2; exit 1; }

PIDS=()
stop() { # ends the servers this script started
    local pid
    for pid in "${PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
    PIDS=()
}
trap stop EXIT
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

# A prefill node on loopback: start_node MODEL LOG sets ADDR and BACKEND.
start_node() {
    local model="$1" log="$2" pid
    RUST_LOG="${RUST_LOG:-info}" "$PREFILL" serve --model "$model" --listen 127.0.0.1:0 --backend auto --insecure-dev \
        --config-dir "$DEMO/prefill-config" 2>"$log" &
    pid=$!
    PIDS+=("$pid")
    ADDR=""
    for _ in $(seq 600); do
        ADDR=$(sed -n 's/^k3-prefill: serving on \([^ ]*\).*/\1/p' "$log" | head -1)
        [[ -n "$ADDR" ]] && break
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; die "the prefill node exited"; }
        sleep 0.2
    done
    [[ -n "$ADDR" ]] || { cat "$log" >&2; die "the prefill node did not start within 120 s"; }
    BACKEND=$(sed -n 's/^k3-prefill: serving on [^ ]* (backend \([a-z]*\).*/\1/p' "$log" | head -1)
    echo "prefill node on $ADDR, backend $BACKEND (log: $log)" >&2
}

# --- 3. a chat on the trained model, through the prefill node and the OpenAI server ------------
[[ -f "$TINY_T/config.json" && -f "$TINY_T/tiktoken.model" ]] || die "no trained model with a tokenizer at $TINY_T (DEMO_TINY_T)"
say "chat with $(basename "$TINY_T"): k3-prefill serve (prefill node) + k3-decode serve --prefill-node (OpenAI server)"
start_node "$TINY_T" "$DEMO/chat-prefill-node.log"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
RUST_LOG="${RUST_LOG:-info}" "$DECODE" serve --model "$TINY_T" --listen "127.0.0.1:$PORT" --prefill-node "$ADDR" --insecure-dev \
    --remote-min-tokens 16 --config-dir "$DEMO/decoder-config" 2>"$DEMO/chat-server.log" &
SERVER=$!
PIDS+=("$SERVER")
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$DEMO/chat-server.log" >&2; die "k3-decode serve exited"; }
    sleep 0.2
done
echo "OpenAI server on http://127.0.0.1:$PORT (log: $DEMO/chat-server.log); prompts with 16+ new tokens go to the node" >&2
python3 scripts/chat_demo.py "http://127.0.0.1:$PORT" --max-tokens "$CHAT_TOKENS" >&2 \
    || { tail -20 "$DEMO/chat-server.log" >&2; die "the chat failed"; }
stop

# --- 4. a larger synthetic model: how much sooner the first token comes -------------------------
# The `small` preset's per-layer shapes (hidden 1024, 64 experts, top-8, MXFP4), 8 layers and a
# 32k vocabulary: ~0.7 GB. Random weights: its tokens are ids, not text.
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
python3 - "$DEMO" "$PROMPT" <<'PY'
import json, random, sys
d, n = sys.argv[1], int(sys.argv[2])
r = random.Random(20261129)
json.dump([r.randrange(32000) for _ in range(n)], open(f"{d}/prompt.json", "w"))
PY
say "a $PROMPT-token prompt on $(basename "$MODEL"): prefilled on the node, then locally (k3-decode generate)"
start_node "$MODEL" "$DEMO/prefill-node.log"
COMMON=(--model "$MODEL" --input-ids "$DEMO/prompt.json" --max-new-tokens "$GEN" --greedy --config-dir "$DEMO/decoder-config")
RUST_LOG="${RUST_LOG:-info}" "$DECODE" generate "${COMMON[@]}" --prefill-node "$ADDR" --insecure-dev --remote-min-tokens 256 \
    --timing-json "$DEMO/timing-split.json" --out "$DEMO/split.json" 2>"$DEMO/decoder-split.log" >/dev/null \
    || { cat "$DEMO/decoder-split.log" >&2; die "k3-decode generate --prefill-node failed"; }
grep -q '"route": "remote"' "$DEMO/timing-split.json" || { cat "$DEMO/decoder-split.log" >&2; die "the prompt was not prefilled on the node"; }
stop
"$DECODE" generate "${COMMON[@]}" --timing-json "$DEMO/timing-local.json" --out "$DEMO/local.json" \
    2>"$DEMO/decoder-local.log" >/dev/null || { cat "$DEMO/decoder-local.log" >&2; die "local k3-decode generate failed"; }
python3 - "$DEMO" "$PROMPT" "$BACKEND" "$GEN" <<'PY' >&2 || die "split and local runs generated different tokens (see $DEMO/split.json and $DEMO/local.json)"
import json, sys
d, n, backend, gen = sys.argv[1:5]
if json.load(open(f"{d}/split.json"))["tokens"] != json.load(open(f"{d}/local.json"))["tokens"]:
    sys.exit(1)
split = json.load(open(f"{d}/timing-split.json"))[0]["first_token_s"]
local = json.load(open(f"{d}/timing-local.json"))[0]["first_token_s"]
print(f"\nfirst token after a {n}-token prompt: {split:.2f} s through the prefill node ({backend} backend) vs "
      f"{local:.2f} s with local prefill, {local / split:.1f}x sooner (the same {gen} greedy tokens)")
PY
echo "logs and timing JSON (k3-decode's per-turn tables): $DEMO/" >&2
