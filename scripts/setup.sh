#!/usr/bin/env bash
# Installs what the workspace build needs; idempotent (a second run only checks).
#
# Linux (CI, dev boxes): MLX's CPU backend from PyPI and a patched mlx-sys.
#   1. apt: cmake clang libclang-dev libopenblas-dev pkg-config (bindgen, the mlx-c build, BLAS).
#   2. pip downloads the `mlx-cpu==0.32.2` wheel (exactly that MLX: mlx-sys 0.7.0's mlx-c was written
#      for it) and unpacks it into .deps/mlx-cpu; MLX_PREFIX = .deps/mlx-cpu/mlx.
#   3. The wheel's bundled reference BLAS/LAPACK (~30x slower) are pointed at Debian's OpenBLAS.
#   4. cargo fetches mlx-sys 0.7.0 from crates.io (checksum-verified); it is unpacked into
#      .deps/mlx-sys and scripts/mlx-sys-0.7.0-linux.patch is applied (prebuilt MLX instead of a
#      GitHub fetch, no Apple frameworks, GCC 12 fixes).
#   5. .cargo/config.toml (git-ignored) gets `[patch.crates-io] mlx-sys = { path = ".deps/mlx-sys" }`
#      and MLX_PREFIX under [env], so plain `cargo build` works without sourcing anything.
#   6. pip installs the Python client libraries the server tests drive `k3-decode serve` with
#      (the official `openai` and `anthropic` SDKs, pinned) into .deps/pyclients.
#   7. .deps/env.sh exports MLX_PREFIX, LD_LIBRARY_PATH and K3_PY_CLIENTS (scripts/test.sh
#      sources it; the client tests put K3_PY_CLIENTS on PYTHONPATH).
# macOS: nothing to do; the published mlx-rs builds MLX with Metal, unpatched (see docs/decoder.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
DEPS="$ROOT/.deps"
mkdir -p "$DEPS"

MLX_VERSION=0.32.2
MLX_SYS_VERSION=0.7.0
log() { echo "setup: $*" >&2; }

if [[ "$(uname -s)" != "Linux" ]]; then
    log "$(uname -s): no setup needed (mlx-rs builds MLX itself; see docs/decoder.md)"
    : > "$DEPS/env.sh"
    exit 0
fi

# --- 1. system packages ---------------------------------------------------------------------
APT_PKGS=(cmake clang libclang-dev libopenblas-dev pkg-config)
# pip downloads the MLX wheel; a bare Debian python3 may lack it
python3 -m pip --version >/dev/null 2>&1 || APT_PKGS+=(python3-pip)
missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    SUDO=""
    [[ "$(id -u)" != 0 ]] && SUDO="sudo"
    log "installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- 2. the MLX wheel -------------------------------------------------------------------------
MLX_ROOT="$DEPS/mlx-cpu"
MLX_PREFIX="$MLX_ROOT/mlx"
if [[ ! -f "$MLX_ROOT/.version" || "$(cat "$MLX_ROOT/.version")" != "$MLX_VERSION" ]]; then
    WHL_DIR="$ROOT/.whl"
    mkdir -p "$WHL_DIR"
    whl=$(ls "$WHL_DIR"/mlx_cpu-"$MLX_VERSION"-*.whl 2>/dev/null | head -1 || true)
    if [[ -z "$whl" ]]; then
        log "downloading mlx-cpu==$MLX_VERSION from PyPI"
        python3 -m pip download --quiet --no-deps "mlx-cpu==$MLX_VERSION" -d "$WHL_DIR"
        whl=$(ls "$WHL_DIR"/mlx_cpu-"$MLX_VERSION"-*.whl | head -1)
    fi
    rm -rf "$MLX_ROOT"
    mkdir -p "$MLX_ROOT"
    python3 -m zipfile -e "$whl" "$MLX_ROOT"
    echo "$MLX_VERSION" > "$MLX_ROOT/.version"
fi
[[ -f "$MLX_PREFIX/lib/libmlx.so" && -f "$MLX_PREFIX/share/cmake/MLX/MLXConfig.cmake" ]] \
    || { log "error: $MLX_PREFIX lacks lib/libmlx.so or share/cmake/MLX"; exit 1; }

# --- 3. BLAS/LAPACK -> OpenBLAS ---------------------------------------------------------------
LIBDIR="/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
relink() { # relink <pattern in mlx_cpu.libs> <system library>
    local f
    for f in "$MLX_ROOT"/mlx_cpu.libs/$1; do
        [[ -e "$f" || -L "$f" ]] || continue
        if [[ "$(readlink -f "$f")" != "$(readlink -f "$2")" ]]; then
            rm -f "$f" && ln -s "$2" "$f"
        fi
    done
}
[[ -e "$LIBDIR/libblas.so.3" && -e "$LIBDIR/liblapack.so.3" ]] \
    || { log "error: $LIBDIR/libblas.so.3 or liblapack.so.3 missing (libopenblas-dev?)"; exit 1; }
readlink -f "$LIBDIR/libblas.so.3" | grep -q openblas \
    || log "warning: $LIBDIR/libblas.so.3 is not OpenBLAS ($(readlink -f "$LIBDIR/libblas.so.3")): MLX matmuls will be slow"
relink 'libblas-*.so*' "$LIBDIR/libblas.so.3"
relink 'liblapack-*.so*' "$LIBDIR/liblapack.so.3"

# --- 4. mlx-sys from crates.io, patched ---------------------------------------------------------
PATCH="$ROOT/scripts/mlx-sys-$MLX_SYS_VERSION-linux.patch"
SYS_DIR="$DEPS/mlx-sys"
PATCH_SUM=$(sha256sum "$PATCH" | cut -d' ' -f1)
if [[ ! -f "$SYS_DIR/.patched" || "$(cat "$SYS_DIR/.patched")" != "$PATCH_SUM" ]]; then
    CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}"
    crate=$(ls "$CARGO_HOME"/registry/cache/*/mlx-sys-"$MLX_SYS_VERSION".crate 2>/dev/null | head -1 || true)
    if [[ -z "$crate" ]]; then
        # An empty throwaway package outside this workspace (so our .cargo/config.toml patch does
        # not apply) makes cargo download and checksum the crate into its cache.
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"' EXIT
        mkdir -p "$tmp/src"
        : > "$tmp/src/lib.rs"
        printf '[package]\nname = "fetch-mlx-sys"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nmlx-sys = "=%s"\n[workspace]\n' \
            "$MLX_SYS_VERSION" > "$tmp/Cargo.toml"
        log "fetching mlx-sys $MLX_SYS_VERSION from crates.io"
        (cd "$tmp" && cargo fetch --quiet)
        crate=$(ls "$CARGO_HOME"/registry/cache/*/mlx-sys-"$MLX_SYS_VERSION".crate | head -1)
    fi
    rm -rf "$SYS_DIR" "$DEPS/mlx-sys-$MLX_SYS_VERSION"
    tar -xzf "$crate" -C "$DEPS"
    mv "$DEPS/mlx-sys-$MLX_SYS_VERSION" "$SYS_DIR"
    (cd "$SYS_DIR" && patch -p1 --quiet < "$PATCH")
    echo "$PATCH_SUM" > "$SYS_DIR/.patched"
    log "mlx-sys $MLX_SYS_VERSION patched into $SYS_DIR"
fi

# --- 5. cargo configuration (git-ignored) ---------------------------------------------------------
mkdir -p "$ROOT/.cargo"
CONFIG="$ROOT/.cargo/config.toml"
NEW_CONFIG=$(cat <<EOF
# Written by scripts/setup.sh on Linux (git-ignored): MLX's CPU backend from the mlx-cpu wheel
# and the patched mlx-sys. macOS builds without this file.
[patch.crates-io]
mlx-sys = { path = "$SYS_DIR" }

[env]
MLX_PREFIX = "$MLX_PREFIX"
EOF
)
if [[ ! -f "$CONFIG" || "$(cat "$CONFIG")" != "$NEW_CONFIG" ]]; then
    printf '%s\n' "$NEW_CONFIG" > "$CONFIG"
fi

# --- 6. Python clients for the server tests ----------------------------------------------------
PY_CLIENTS="$DEPS/pyclients"
PY_CLIENTS_SPEC="openai==3.57.0 anthropic==2.14.0"
if [[ ! -f "$PY_CLIENTS/.spec" || "$(cat "$PY_CLIENTS/.spec")" != "$PY_CLIENTS_SPEC" ]]; then
    log "installing $PY_CLIENTS_SPEC into $PY_CLIENTS"
    rm -rf "$PY_CLIENTS"
    # shellcheck disable=SC2086
    python3 -m pip install --quiet --disable-pip-version-check --no-warn-conflicts --target "$PY_CLIENTS" $PY_CLIENTS_SPEC
    echo "$PY_CLIENTS_SPEC" > "$PY_CLIENTS/.spec"
fi

# --- 7. environment for scripts --------------------------------------------------------------
cat > "$DEPS/env.sh" <<EOF
# Written by scripts/setup.sh.
export MLX_PREFIX="$MLX_PREFIX"
export LD_LIBRARY_PATH="$MLX_PREFIX/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export K3_PY_CLIENTS="$PY_CLIENTS"
EOF
log "ready (MLX_PREFIX=$MLX_PREFIX)"
