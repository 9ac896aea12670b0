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
# It says up front what it will do and roughly how long, prints a progress line at least every
# 10 s during each stage (the stage, its time so far and the last line of its log), and the time
# of each stage and the total at the end.
#
# Environment: DEMO_TINY_T (the chat model; tests/models/tiny-t), DEMO_CHAT_TOKENS (tokens per
# reply; 64), DEMO_PROMPT (the long prompt, tokens; 2048), DEMO_GEN (tokens generated after it;
# 8), DEMO_DIR (work dir; .demo), DEMO_SKIP_SETUP=1 (skip step 1), DEMO_BIN=DIR (use the
# k3-prefill and k3-decode in DIR, e.g. target/debug, instead of step 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
DEMO="${DEMO_DIR:-$ROOT/.demo}"
TINY_T="${DEMO_TINY_T:-$ROOT/tests/models/tiny-t}"
CHAT_TOKENS="${DEMO_CHAT_TOKENS:-64}"
PROMPT="${DEMO_PROMPT:-2048}"
GEN="${DEMO_GEN:-8}"
TARGET="${DEMO_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
MODEL="$DEMO/model-small-l8-v32k"
mkdir -p "$DEMO"

say() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }
die() { printf '\ndemo: FAILED: %s\n' "$*" >&2; exit 1; }
mmss() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }

# --- stages, their times, and a progress line at least every 10 s --------------------------------
T0=$(date +%s)
STAGE_FILE="$DEMO/.stage"
STAGES=()
STAGE_NAME=""
STAGE_START=0
# stage NAME [LOG]: ends the running stage (its time is kept for the summary) and starts NAME;
# the progress line shows the last line of LOG.
stage() {
    local now
    now=$(date +%s)
    [[ -n "$STAGE_NAME" ]] && STAGES+=("$((now - STAGE_START))"$'\t'"$STAGE_NAME")
    STAGE_NAME="$1"
    STAGE_START=$now
    printf '%s\t%s\t%s\n' "$1" "$now" "${2:-}" > "$STAGE_FILE"
    say "$1"
}
# stage_log LOG: the log whose last line the running stage's progress line shows.
stage_log() { printf '%s\t%s\t%s\n' "$STAGE_NAME" "$STAGE_START" "$1" > "$STAGE_FILE"; }
ticker() {
    local name start log line
    while sleep 10; do
        [[ -f "$STAGE_FILE" ]] || continue
        IFS=$'\t' read -r name start log < "$STAGE_FILE" || continue
        line=""
        if [[ -n "$log" && -f "$log" ]]; then
            line=$(tail -c 4000 "$log" | tr '\r' '\n' | sed -e 's/\x1b\[[0-9;]*m//g' -e '/^[[:space:]]*$/d' | tail -1 | cut -c1-120)
        fi
        printf '  ... %s in this stage%s\n' "$(mmss $(($(date +%s) - start)))" "${line:+ | $line}" >&2
    done
}
summary() {
    local now row
    now=$(date +%s)
    [[ -n "$STAGE_NAME" ]] && STAGES+=("$((now - STAGE_START))"$'\t'"$STAGE_NAME")
    STAGE_NAME=""
    printf '\ntime per stage:\n' >&2
    for row in "${STAGES[@]}"; do
        printf '  %6s  %s\n' "$(mmss "${row%%$'\t'*}")" "${row#*$'\t'}" >&2
    done
    printf '  %6s  total\n' "$(mmss $((now - T0)))" >&2
}

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
TICKER=""
finish() {
    stop
    [[ -n "$TICKER" ]] && kill "$TICKER" 2>/dev/null
    rm -f "$STAGE_FILE"
}
trap finish EXIT
trap 'die "interrupted"' INT TERM

# --- what it will do, and roughly how long ----------------------------------------------------
if [[ -n "${DEMO_BIN:-}" ]]; then
    BUILD_TIME="skipped: DEMO_BIN=$DEMO_BIN"
elif [[ -x "$TARGET/k3-prefill" && -x "$TARGET/k3-decode" ]]; then
    BUILD_TIME="seconds if nothing changed, minutes after a change"
else
    BUILD_TIME="~20 min on 2 cores the first time; $(nproc) cores here"
fi
if [[ -f "$MODEL/model.safetensors.index.json" ]]; then SYNTH_TIME="cached in $DEMO"; else SYNTH_TIME="written once, ~0.7 GB"; fi
cat >&2 <<EOF
k3-offload demo: split inference (a prefill node and a decoder) on this machine.
  1. set-up: apt packages if missing, MLX's CPU wheel and the patched mlx-sys in .deps/ (seconds once done)
  2. release build of k3-prefill and k3-decode ($BUILD_TIME)
  3. a three-turn chat with tiny-t through a prefill node and the OpenAI server (~1 min)
  4. a synthetic model ($SYNTH_TIME); a $PROMPT-token prompt prefilled on the node, then
     locally, and how much sooner the first token came (~2-3 min on 2 cores; the node's part
     takes seconds on a GPU)
First run on 2 cores: ~23 min in all; with the build done: ~3 min. Logs: $DEMO/
EOF
ticker &
TICKER=$!

# --- 1. setup ---------------------------------------------------------------------------------
if [[ "${DEMO_SKIP_SETUP:-0}" != 1 ]]; then
    stage "setup (scripts/setup.sh)"
    ./scripts/setup.sh
fi
# shellcheck disable=SC1091
[[ -f .deps/env.sh ]] && source .deps/env.sh

# --- 2. build ---------------------------------------------------------------------------------
if [[ -z "${DEMO_BIN:-}" ]]; then
    stage "release build of k3-prefill and k3-decode"
    cargo build --release --bins -p cuda-prefiller -p mac-decoder
fi
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
stage "chat with $(basename "$TINY_T"): k3-prefill serve (prefill node) + k3-decode serve --prefill-node (OpenAI server)" "$DEMO/chat-prefill-node.log"
if [[ "$(basename "$TINY_T")" == tiny-t ]]; then
    cat >&2 <<'EOF'
tiny-t is a 20M-parameter K3 trained on a few chats about Rust: its replies are English but
off-topic, and it repeats itself (turns 2 and 3 may be word for word the same). That is the
model, not the pipeline: what this shows is K3's tokenizer and chat format, the prefill node,
the hand-off of its states and the server.
EOF
fi
start_node "$TINY_T" "$DEMO/chat-prefill-node.log"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
stage_log "$DEMO/chat-server.log"
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
SYNTH=(--preset small --layers 8 --vocab 32768 --seed 7)
if [[ ! -f "$MODEL/model.safetensors.index.json" || "$(cat "$MODEL/.synth-args" 2>/dev/null)" != "${SYNTH[*]}" ]]; then
    stage "synthesizing a model: k3-prefill synth ${SYNTH[*]}" "$DEMO/synth.log"
    rm -rf "$MODEL"
    "$PREFILL" synth "${SYNTH[@]}" --no-progress --out "$MODEL" 2>"$DEMO/synth.log" \
        || { cat "$DEMO/synth.log" >&2; die "k3-prefill synth failed"; }
    echo "${SYNTH[*]}" > "$MODEL/.synth-args"
else
    stage "model: $MODEL (cached)"
fi
"$PREFILL" inspect --model "$MODEL" >"$DEMO/inspect.txt" 2>&1 || { cat "$DEMO/inspect.txt" >&2; die "the model does not validate"; }
python3 - "$DEMO" "$PROMPT" <<'PY'
import json, random, sys
d, n = sys.argv[1], int(sys.argv[2])
r = random.Random(20261129)
json.dump([r.randrange(32000) for _ in range(n)], open(f"{d}/prompt.json", "w"))
PY
stage "a $PROMPT-token prompt on $(basename "$MODEL"), prefilled on the node (k3-decode generate --prefill-node)" "$DEMO/prefill-node.log"
echo "random weights: this model's tokens are ids, not text; what counts here is the time to the first token" >&2
start_node "$MODEL" "$DEMO/prefill-node.log"
stage_log "$DEMO/decoder-split.log"
COMMON=(--model "$MODEL" --input-ids "$DEMO/prompt.json" --max-new-tokens "$GEN" --greedy --config-dir "$DEMO/decoder-config")
RUST_LOG="${RUST_LOG:-info}" "$DECODE" generate "${COMMON[@]}" --prefill-node "$ADDR" --insecure-dev --remote-min-tokens 256 \
    --timing-json "$DEMO/timing-split.json" --out "$DEMO/split.json" 2>"$DEMO/decoder-split.log" >/dev/null \
    || { cat "$DEMO/decoder-split.log" >&2; die "k3-decode generate --prefill-node failed"; }
grep -q '"route": "remote"' "$DEMO/timing-split.json" || { cat "$DEMO/decoder-split.log" >&2; die "the prompt was not prefilled on the node"; }
stop
stage "the same prompt prefilled locally (k3-decode generate)" "$DEMO/decoder-local.log"
RUST_LOG="${RUST_LOG:-info}" "$DECODE" generate "${COMMON[@]}" --timing-json "$DEMO/timing-local.json" --out "$DEMO/local.json" \
    2>"$DEMO/decoder-local.log" >/dev/null || { cat "$DEMO/decoder-local.log" >&2; die "local k3-decode generate failed"; }
python3 - "$DEMO" "$PROMPT" "$BACKEND" "$GEN" <<'PY' >&2 || die "split and local runs generated different tokens (see $DEMO/split.json and $DEMO/local.json)"
import json, sys
d, n, backend, gen = sys.argv[1:5]
if json.load(open(f"{d}/split.json"))["tokens"] != json.load(open(f"{d}/local.json"))["tokens"]:
    sys.exit(1)
split = json.load(open(f"{d}/timing-split.json"))[0]["first_token_s"]
local = json.load(open(f"{d}/timing-local.json"))[0]["first_token_s"]
print(f"\nfirst token after a {n}-token prompt: {split:.2f} s through the prefill node ({backend} backend) vs "
      f"{local:.2f} s with local prefill, {local / split:.1f}x sooner (the same {gen} greedy tokens of a random-weight model)")
# the router's first estimate of the local prefill (from its calibration at start) against the local run
pred = json.load(open(f"{d}/timing-split.json"))[0].get("predicted_local_s")
meas = json.load(open(f"{d}/timing-local.json"))[0].get("local_prefill_s")
if pred and meas:
    verdict = "within 30 %" if abs(pred / meas - 1) <= 0.3 else "more than 30 % off: the calibration at start did not predict this box"
    print(f"the router's first local estimate: {pred:.2f} s predicted, {meas:.2f} s measured (ratio {pred / meas:.2f}, {verdict})")
PY
summary
echo "logs and timing JSON (k3-decode's per-turn tables): $DEMO/" >&2
