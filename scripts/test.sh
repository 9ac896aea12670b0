#!/usr/bin/env bash
# The test command of the README: installs what the build needs, then runs the whole suite.
# Works on a fresh Debian/Ubuntu machine with Rust, pip and apt.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
source .deps/env.sh
cargo test --workspace --no-fail-fast "$@"
