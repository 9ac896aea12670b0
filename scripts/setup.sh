#!/usr/bin/env bash
# Installs the system packages and the MLX CPU build the workspace needs (idempotent).
# Writes .deps/env.sh with the environment the build reads.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
: > .deps/env.sh
