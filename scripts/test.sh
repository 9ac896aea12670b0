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
# The layering rule (docs/architecture.md): no import cycle between files, no upward import.
# A finding fails the run after the tests have run.
layers=0
python3 scripts/check_layers.py || layers=$?
cargo test --workspace --no-fail-fast "$@"
du -sh target 2>/dev/null || true
if [ "$layers" -ne 0 ]; then echo "scripts/check_layers.py found import cycles or upward imports (above)"; exit "$layers"; fi
