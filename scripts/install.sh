#!/usr/bin/env bash
# Places the binaries where they work outside the clone, with the library k3-decode needs.
#
#   ./scripts/install.sh [PREFIX]        (default: ~/.local; BIN=DIR: binaries from DIR, default target/release)
#
# PREFIX/bin/k3-prefill, PREFIX/bin/k3-decode and, on Linux, MLX's CPU library from the clone's
# .deps/ (scripts/setup.sh): PREFIX/lib/k3-offload/mlx/lib/libmlx.so and the wheel's
# mlx_cpu.libs/ (libgfortran, libquadmath, and the links to the system's OpenBLAS that
# setup.sh made). k3-decode looks for libmlx.so in $ORIGIN/../lib/k3-offload/mlx/lib first and
# in the clone's .deps/ second, so the installed copy keeps working when the clone is gone.
# k3-prefill needs no library of ours; on macOS MLX is linked into k3-decode.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PREFIX="${1:-$HOME/.local}"
BIN="${BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
log() { echo "install: $*" >&2; }
for b in k3-prefill k3-decode; do
    [[ -x "$BIN/$b" ]] || { log "error: $BIN/$b is missing (cargo build --release --bins, or BIN=DIR)"; exit 1; }
done
mkdir -p "$PREFIX/bin"
install -m 755 "$BIN/k3-prefill" "$BIN/k3-decode" "$PREFIX/bin/"
log "k3-prefill, k3-decode -> $PREFIX/bin"

if [[ "$(uname -s)" == Linux ]]; then
    MLX="${MLX_PREFIX:-$ROOT/.deps/mlx-cpu/mlx}"
    [[ -f "$MLX/lib/libmlx.so" ]] || { log "error: no $MLX/lib/libmlx.so (run scripts/setup.sh)"; exit 1; }
    readelf -d "$PREFIX/bin/k3-decode" | grep -q 'ORIGIN/../lib/k3-offload/mlx/lib' \
        || { log "error: $BIN/k3-decode does not look in \$ORIGIN/../lib/k3-offload/mlx/lib (built before mac-decoder/build.rs added it: rebuild)"; exit 1; }
    DEST="$PREFIX/lib/k3-offload"
    rm -rf "$DEST"
    mkdir -p "$DEST/mlx/lib" "$DEST/mlx_cpu.libs"
    cp "$MLX/lib/libmlx.so" "$DEST/mlx/lib/"
    # libmlx.so finds these through its own RPATH, $ORIGIN/../../mlx_cpu.libs; the BLAS/LAPACK
    # entries are links to the system's OpenBLAS (scripts/setup.sh), kept as links.
    cp -P "$MLX/../mlx_cpu.libs/"* "$DEST/mlx_cpu.libs/"
    log "MLX's CPU library -> $DEST"
    # as a user's shell runs it: without the build's LD_LIBRARY_PATH (.deps/env.sh sets one,
    # which the loader searches before the binary's RUNPATH)
    found=$(env -u LD_LIBRARY_PATH ldd "$PREFIX/bin/k3-decode" | awk '/libmlx.so/ {print $3}')
    [[ -n "$found" && "$(readlink -f "$found")" == "$(readlink -f "$DEST/mlx/lib/libmlx.so")" ]] \
        || { log "error: the installed k3-decode resolves libmlx.so to '${found:-nothing}', not $DEST/mlx/lib/libmlx.so"; exit 1; }
    if env -u LD_LIBRARY_PATH ldd "$PREFIX/bin/k3-decode" | grep -q 'not found'; then
        env -u LD_LIBRARY_PATH ldd "$PREFIX/bin/k3-decode" | grep 'not found' >&2
        log "error: libraries not found"
        exit 1
    fi
fi
env -u LD_LIBRARY_PATH "$PREFIX/bin/k3-decode" --version >/dev/null && "$PREFIX/bin/k3-prefill" --version >/dev/null
case ":$PATH:" in
    *":$PREFIX/bin:"*) log "done" ;;
    *) log "done; add it to PATH: export PATH=\"$PREFIX/bin:\$PATH\"" ;;
esac
