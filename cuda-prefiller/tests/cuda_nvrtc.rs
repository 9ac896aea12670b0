//! Every kernel file compiles with NVRTC for each supported architecture (sm_80, sm_89, sm_90,
//! sm_120), also with the K3 and tiny MLA head widths; the Hopper-only modules (`*_sm90`) for
//! sm_90a. Needs only libnvrtc (no GPU); skips with the reason printed when NVRTC is absent.

use cuda_prefiller::cuda::nvrtc;

#[test]
fn cuda_kernels_compile_for_all_archs() {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("SKIPPED: NVRTC (libnvrtc.so) not found");
        return;
    }
    for arch in ["sm_80", "sm_89", "sm_90", "sm_120"] {
        for (module, _) in nvrtc::SOURCES {
            let Some(target) = nvrtc::module_arch(module, arch) else { continue };
            let defs: Vec<Vec<String>> = if *module == "mla_attn" { vec![vec![], vec!["MLA_DQK=48".into(), "MLA_DV=32".into()]] } else { vec![vec![]] };
            for d in defs {
                let src = nvrtc::full_source(module, &d).unwrap();
                let cubin = nvrtc::compile(module, &src, &target).unwrap_or_else(|e| panic!("{e:#}"));
                assert!(cubin.len() > 100, "{module} {target}: empty CUBIN");
            }
        }
        eprintln!("all kernels compiled for {arch}");
    }
}
