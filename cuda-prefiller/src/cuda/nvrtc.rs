//! Run-time compilation of `kernels/*.cu` with NVRTC for the device's own architecture (sm_90 on
//! an H200, sm_120 on an RTX 5090, ...), straight to a CUBIN, cached on disk keyed by a hash of
//! the source, the defines, the architecture and the NVRTC version.
//!
//! Cache directory: `$K3_KERNEL_CACHE`, else `$XDG_CACHE_HOME/k3-offload/kernels`, else
//! `~/.cache/k3-offload/kernels`. A cache that cannot be written only costs a recompile.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};
use cudarc::nvrtc::sys;
use sha2::{Digest, Sha256};

/// Helpers prepended to every kernel file.
pub const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// The kernel sources, by module name (`kernels/<name>.cu`).
pub const SOURCES: &[(&str, &str)] = &[
    ("convert", include_str!("../../../kernels/convert.cu")),
    ("bf16_split", include_str!("../../../kernels/bf16_split.cu")),
    ("rmsnorm", include_str!("../../../kernels/rmsnorm.cu")),
    ("situ", include_str!("../../../kernels/situ.cu")),
    ("attnres", include_str!("../../../kernels/attnres.cu")),
    ("short_conv", include_str!("../../../kernels/short_conv.cu")),
    ("router", include_str!("../../../kernels/router.cu")),
    ("moe_route", include_str!("../../../kernels/moe_route.cu")),
    ("moe_gemm", include_str!("../../../kernels/moe_gemm.cu")),
    ("kda", include_str!("../../../kernels/kda.cu")),
    ("mla_attn", include_str!("../../../kernels/mla_attn.cu")),
    ("mla_attn_sm90", include_str!("../../../kernels/mla_attn_sm90.cu")),
];

/// The NVRTC target for `module` on a device of architecture `arch` (`sm_90`), or `None` when the
/// module does not run there: modules named `*_sm90` use wgmma, which exists only on the
/// architecture-specific target `sm_90a` (Hopper).
pub fn module_arch(module: &str, arch: &str) -> Option<String> {
    if module.ends_with("_sm90") {
        (arch == "sm_90").then(|| "sm_90a".to_string())
    } else {
        Some(arch.to_string())
    }
}

/// The full translation unit NVRTC compiles for `module`.
pub fn full_source(module: &str, defines: &[String]) -> Result<String> {
    let src = SOURCES.iter().find(|(n, _)| *n == module).map(|(_, s)| *s).ok_or_else(|| anyhow!("no kernel module kernels/{module}.cu"))?;
    let mut s = String::new();
    for d in defines {
        let (k, v) = d.split_once('=').unwrap_or((d.as_str(), "1"));
        s.push_str(&format!("#define {k} {v}\n"));
    }
    s.push_str(COMMON);
    s.push_str(&format!("\n#line 1 \"{module}.cu\"\n"));
    s.push_str(src);
    Ok(s)
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("K3_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Ok(d) = std::env::var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("k3-offload/kernels"));
    }
    std::env::var("HOME").ok().map(|h| PathBuf::from(h).join(".cache/k3-offload/kernels"))
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { sys::nvrtcVersion(&mut a, &mut b) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        bail!("nvrtcVersion failed: {r:?}");
    }
    Ok((a, b))
}

/// Compiles (or loads from the cache) `kernels/<module>.cu` for `arch` (`sm_90`), returning a CUBIN.
pub fn compile_cached(module: &str, defines: &[String], arch: &str) -> Result<Vec<u8>> {
    let target = module_arch(module, arch).ok_or_else(|| anyhow!("kernels/{module}.cu runs only on sm_90 (Hopper), not on {arch}"))?;
    let arch = target.as_str();
    let src = full_source(module, defines)?;
    let ver = version()?;
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    h.update(arch.as_bytes());
    h.update(format!("{ver:?}").as_bytes());
    let key = hex::encode(&h.finalize()[..12]);
    let file = cache_dir().map(|d| d.join(format!("{module}-{arch}-{key}.cubin")));
    if let Some(f) = &file {
        if let Ok(bytes) = std::fs::read(f) {
            if !bytes.is_empty() {
                tracing::debug!(module, arch, "kernel cache hit {}", f.display());
                return Ok(bytes);
            }
        }
    }
    let t0 = std::time::Instant::now();
    let cubin = compile(module, &src, arch)?;
    tracing::info!(module, arch, ms = t0.elapsed().as_millis() as u64, "compiled kernels/{module}.cu with NVRTC");
    if let Some(f) = &file {
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if let Some(parent) = f.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(cubin)
}

/// Compiles a full source for a real architecture and returns the CUBIN (errors carry the NVRTC log).
pub fn compile(module: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    let csrc = CString::new(src)?;
    let cname = CString::new(format!("{module}.cu"))?;
    let opts: Vec<CString> = [format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into(), "-lineinfo".into()]
        .into_iter()
        .map(|o| CString::new(o).expect("no NUL in options"))
        .collect();
    let optp: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: NVRTC API used as documented; the program is destroyed on every path.
    unsafe {
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        let r = sys::nvrtcCreateProgram(&mut prog, csrc.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null());
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            bail!("NVRTC could not create a program for kernels/{module}.cu: {r:?}");
        }
        let r = sys::nvrtcCompileProgram(prog, optp.len() as i32, optp.as_ptr());
        let mut log_n = 0usize;
        sys::nvrtcGetProgramLogSize(prog, &mut log_n);
        let mut log = vec![0u8; log_n.max(1)];
        sys::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut std::ffi::c_char);
        let log = CStr::from_bytes_until_nul(&log).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            sys::nvrtcDestroyProgram(&mut prog);
            bail!("NVRTC failed to compile kernels/{module}.cu for {arch} ({r:?}):\n{log}");
        }
        let mut n = 0usize;
        let r = sys::nvrtcGetCUBINSize(prog, &mut n);
        if r != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
            sys::nvrtcDestroyProgram(&mut prog);
            bail!("NVRTC produced no CUBIN for kernels/{module}.cu ({arch} must be a real architecture such as sm_90): {r:?}");
        }
        let mut out = vec![0u8; n];
        let r = sys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut std::ffi::c_char);
        sys::nvrtcDestroyProgram(&mut prog);
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            bail!("nvrtcGetCUBIN failed for kernels/{module}.cu: {r:?}");
        }
        Ok(out)
    }
}
