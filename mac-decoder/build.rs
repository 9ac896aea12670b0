//! Linux only, with the `mlx` feature: the patched mlx-sys links the prebuilt `libmlx.so` from
//! `$MLX_PREFIX/lib` (the mlx-cpu wheel unpacked by scripts/setup.sh). Its own rpath does not
//! reach the binaries of dependent crates, so this crate's binaries and tests get one here:
//! first `$ORIGIN/../lib/k3-offload/mlx/lib` (where scripts/install.sh puts the library beside
//! binaries copied out of the clone), then the clone's own `.deps/`.
//! macOS needs nothing: mlx-rs builds and links MLX statically.

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_PREFIX");
    let mlx = std::env::var_os("CARGO_FEATURE_MLX").is_some();
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if !mlx || os != "linux" {
        return;
    }
    match std::env::var("MLX_PREFIX") {
        Ok(prefix) if !prefix.is_empty() => {
            let lib = std::path::Path::new(&prefix).join("lib");
            println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../lib/k3-offload/mlx/lib");
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        }
        _ => println!("cargo:warning=MLX_PREFIX is not set: run scripts/setup.sh (it writes .cargo/config.toml and .deps/env.sh)"),
    }
}
