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
tests=0
cargo test --workspace --no-fail-fast "$@" || tests=$?
du -sh target 2>/dev/null || true
# Every command block of the README, in a fresh clone, with the binaries the tests just built.
readme=0
python3 scripts/readme_check.py --bin "${CARGO_TARGET_DIR:-target}/debug" || readme=$?
# Lints: clippy with warnings as errors (Cargo.toml's [workspace.lints] says why each allowed lint
# is off) and rustfmt's check (rustfmt.toml); after the tests, so a finding hides no test result.
lint=0
cargo fmt --all -- --check >/dev/null || { echo "cargo fmt --all -- --check: files are not formatted (run cargo fmt --all)"; lint=1; }
cargo clippy --workspace --all-targets --quiet -- -D warnings || lint=1
if [ "$tests" -ne 0 ]; then exit "$tests"; fi
if [ "$lint" -ne 0 ]; then echo "clippy or rustfmt found something (above)"; exit "$lint"; fi
if [ "$layers" -ne 0 ]; then echo "scripts/check_layers.py found import cycles or upward imports (above)"; exit "$layers"; fi
if [ "$readme" -ne 0 ]; then echo "scripts/readme_check.py: a README command block failed (above)"; exit "$readme"; fi
