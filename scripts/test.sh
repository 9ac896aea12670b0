#!/usr/bin/env bash
# The test command of the README: installs what the build needs, then runs the whole suite.
# Works on a fresh Debian/Ubuntu machine with Rust, pip and apt.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
source .deps/env.sh
# A one-shot build gains nothing from incremental state (1.8 GiB of it).
export CARGO_INCREMENTAL=0
df -h . | tail -1
cargo test --workspace --no-fail-fast "$@"
du -sh target 2>/dev/null || true
