//! These tests link mac-decoder (MLX) into their own binaries. On Linux the patched mlx-sys
//! links the prebuilt `libmlx.so` from `$MLX_PREFIX/lib` (scripts/setup.sh), and its rpath does
//! not reach dependents, so the test binaries get one here (as mac-decoder/build.rs does for its
//! own). macOS needs nothing.

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_PREFIX");
    if std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default() != "linux" {
        return;
    }
    match std::env::var("MLX_PREFIX") {
        Ok(prefix) if !prefix.is_empty() => {
            let lib = std::path::Path::new(&prefix).join("lib");
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        }
        _ => println!("cargo:warning=MLX_PREFIX is not set: run scripts/setup.sh"),
    }
}
