#!/usr/bin/env bash
# Re-captures the request fixtures of mac-decoder/tests/fixtures/agents/: each coding-agent client
# (installed by scripts/setup-clients.sh) runs one headless turn (and Claude Code two more with
# --continue, and a tool round trip) against mac-decoder/tests/clients/capture_stub.py, a stand-in
# server that records the requests; trim_capture.py cuts the long texts out. Not part of the test
# suite (the fixtures are committed); run it when a client's pin changes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
scripts/setup-clients.sh
CL="$(scripts/setup-clients.sh --print)"
export PATH="$CL/npm/node_modules/.bin:$PATH"
STUB="$ROOT/mac-decoder/tests/clients/capture_stub.py"
TRIM="$ROOT/mac-decoder/tests/clients/trim_capture.py"
FIX="$ROOT/mac-decoder/tests/fixtures/agents"
W=$(mktemp -d /tmp/cap.XXXXXX)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$W"' EXIT
mkdir -p "$W/proj" "$FIX"
cd "$W/proj"

stub() { # stub PORT NAME [tools]
    mkdir -p "$W/$2"
    python3 "$STUB" "$1" "$W/$2" ${3:-} >"$W/$2.log" 2>&1 &
    PIDS+=($!)
    sleep 1
}
claude_env() { # claude_env PORT HOME
    echo env HOME="$2" ANTHROPIC_BASE_URL="http://127.0.0.1:$1" ANTHROPIC_API_KEY=unused ANTHROPIC_DEFAULT_HAIKU_MODEL=tiny-t \
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 CLAUDE_CODE_ATTRIBUTION_HEADER=0
}
trim() { python3 "$TRIM" "$W/$1" "$FIX/$2" --client "$3"; }

# Claude Code: three turns, then a tool round trip (Bash).
stub 18801 claude
$(claude_env 18801 "$W/h1") claude -p "Say hello." --model tiny-t --output-format json >/dev/null
$(claude_env 18801 "$W/h1") claude -p "What is 2+2?" --continue --model tiny-t --output-format json >/dev/null
$(claude_env 18801 "$W/h1") claude -p "And 3+3?" --continue --model tiny-t --output-format json >/dev/null
trim claude/001.json claude-code-turn1.json claude-code@2.1.328
trim claude/002.json claude-code-turn2.json claude-code@2.1.328
trim claude/003.json claude-code-turn3.json claude-code@2.1.328
stub 18804 claude2 tools
$(claude_env 18804 "$W/h2") claude -p "Run echo hi." --model tiny-t --output-format json --allowedTools Bash >/dev/null
trim claude2/002.json claude-code-tool-result.json claude-code@2.1.328

# Codex: one turn, then a function-call round trip with a reasoning item.
codex_home() { # codex_home DIR PORT
    mkdir -p "$1/.codex"
    printf 'model = "tiny-t"\nmodel_provider = "k3"\n[model_providers.k3]\nname = "k3-decode"\nbase_url = "http://127.0.0.1:%s/v1"\nwire_api = "responses"\nenv_key = "K3_API_KEY"\n' "$2" >"$1/.codex/config.toml"
}
stub 18802 codex
codex_home "$W/h3" 18802
HOME="$W/h3" K3_API_KEY=unused codex exec --skip-git-repo-check -o "$W/last.txt" "Say hello." >/dev/null 2>&1
trim codex/001.json codex-turn1.json codex@0.169.0
stub 18803 codex2 tools
codex_home "$W/h4" 18803
HOME="$W/h4" K3_API_KEY=unused codex exec --skip-git-repo-check --sandbox danger-full-access -o "$W/last.txt" "Run echo hi." >/dev/null 2>&1
trim codex2/002.json codex-tool-output.json codex@0.169.0

# OpenCode (its title request, then the turn).
stub 18805 opencode
mkdir -p "$W/h5/.config/opencode"
printf '{"provider": {"k3": {"npm": "@ai-sdk/openai-compatible", "name": "k3-decode", "options": {"baseURL": "http://127.0.0.1:18805/v1", "apiKey": "unused"}, "models": {"tiny-t": {"name": "tiny-t"}}}}, "model": "k3/tiny-t", "autoupdate": false, "share": "disabled"}\n' >"$W/h5/.config/opencode/opencode.json"
HOME="$W/h5" opencode run "Say hello." -m k3/tiny-t >/dev/null 2>&1
trim opencode/001.json opencode-title.json opencode-ai@1.18.33
trim opencode/002.json opencode-turn1.json opencode-ai@1.18.33

# Qwen Code (the turn, then its memory-extraction request).
stub 18806 qwen
mkdir -p "$W/h6" "$W/h7"
HOME="$W/h6" OPENAI_BASE_URL=http://127.0.0.1:18806/v1 OPENAI_API_KEY=unused OPENAI_MODEL=tiny-t qwen -p "Say hello." --auth-type openai >/dev/null 2>&1
trim qwen/001.json qwen-code-turn1.json qwen-code@0.24.4
trim qwen/002.json qwen-code-memory.json qwen-code@0.24.4

# aider.
stub 18807 aider
HOME="$W/h7" LITELLM_LOCAL_MODEL_COST_MAP=True "$CL/aider/bin/aider" --model openai/tiny-t --openai-api-base http://127.0.0.1:18807/v1 \
    --openai-api-key unused --message "Say hello." --yes-always --no-git --no-check-update --no-show-model-warnings --analytics-disable --no-pretty >/dev/null 2>&1
trim aider/001.json aider-turn1.json aider-chat@0.86.2
echo "fixtures written to $FIX"
