#!/usr/bin/env bash
# Installs the coding-agent clients that tests/agent_clients.rs (mac-decoder) drives against
# `k3-decode serve`, at pinned versions, from the npm and PyPI registries:
#   npm:  @anthropic-ai/claude-code, @openai/codex, opencode-ai, @qwen-code/qwen-code  -> DIR/npm
#   PyPI: aider-chat (in its own virtual environment)                                -> DIR/aider
# DIR is $K3_AGENT_CLIENTS_DIR, else .deps-clients/ at the repository root (git-ignored; about
# 1.2 GB). Idempotent: a second run with the same pins only checks the stamps (DIR/*/.spec), so a
# CI cache of DIR keyed on this file's hash makes the step instant; without one, npm's and pip's
# own caches (~/.npm, ~/.cache/pip) still spare the downloads. Needs Node >= 20 (npm) and python3
# (venv). Any failure exits non-zero: the tests that need the clients then fail, never skip.
#
#   scripts/setup-clients.sh          # install or check
#   scripts/setup-clients.sh --print  # print DIR
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
DIR="${K3_AGENT_CLIENTS_DIR:-$ROOT/.deps-clients}"
NPM_SPEC="@anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0 opencode-ai@1.18.33 @qwen-code/qwen-code@0.24.4"
PIP_SPEC="aider-chat==0.86.2"
log() { echo "setup-clients: $*" >&2; }

if [[ "${1:-}" == "--print" ]]; then
    echo "$DIR"
    exit 0
fi
mkdir -p "$DIR"

# --- npm clients --------------------------------------------------------------------------
command -v node >/dev/null || { log "error: node is not installed (Node >= 20 runs the npm clients)"; exit 1; }
command -v npm >/dev/null || { log "error: npm is not installed"; exit 1; }
major=$(node -p 'process.versions.node.split(".")[0]')
((major >= 20)) || { log "error: Node $(node --version) is too old (the clients need >= 20)"; exit 1; }
NPM_DIR="$DIR/npm"
if [[ ! -f "$NPM_DIR/.spec" || "$(cat "$NPM_DIR/.spec")" != "$NPM_SPEC" ]]; then
    log "installing $NPM_SPEC into $NPM_DIR"
    rm -rf "$NPM_DIR"
    mkdir -p "$NPM_DIR"
    # shellcheck disable=SC2086
    npm install --prefix "$NPM_DIR" --no-audit --no-fund --no-update-notifier --loglevel=error $NPM_SPEC
    echo "$NPM_SPEC" > "$NPM_DIR/.spec"
fi
BIN="$NPM_DIR/node_modules/.bin"
for exe in claude codex opencode qwen; do
    [[ -x "$BIN/$exe" ]] || { log "error: $BIN/$exe is missing (delete $NPM_DIR and run again)"; exit 1; }
done
# Qwen Code's bundled ripgrep is unpacked without its execute bit; it falls back to a slower grep.
find "$NPM_DIR/node_modules/@qwen-code" -path '*ripgrep*' -name rg -type f -exec chmod +x {} + 2>/dev/null || true

# --- aider (PyPI) -------------------------------------------------------------------------
AIDER_DIR="$DIR/aider"
if [[ ! -f "$AIDER_DIR/.spec" || "$(cat "$AIDER_DIR/.spec")" != "$PIP_SPEC" ]]; then
    log "installing $PIP_SPEC into $AIDER_DIR"
    rm -rf "$AIDER_DIR"
    python3 -m venv "$AIDER_DIR"
    "$AIDER_DIR/bin/python" -m pip install --quiet --disable-pip-version-check "$PIP_SPEC"
    echo "$PIP_SPEC" > "$AIDER_DIR/.spec"
fi
[[ -x "$AIDER_DIR/bin/aider" ]] || { log "error: $AIDER_DIR/bin/aider is missing (delete $AIDER_DIR and run again)"; exit 1; }
log "ready in $DIR"
