//! The transport's fault hooks exist only in test builds: the `fault-injection` feature is
//! enabled by dev-dependencies alone (checked on `cargo metadata` of the workspace), and a
//! crate that depends on k3-protocol the normal way sees no `FaultHooks` and no
//! `NodeConfig::hooks` (checked by compiling a probe crate against it, with the feature as the
//! positive control).

use std::path::{Path, PathBuf};
use std::process::Command;

const FEATURE: &str = "fault-injection";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

#[test]
fn only_dev_dependencies_enable_fault_injection() {
    let out = cargo()
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline", "--manifest-path"])
        .arg(workspace().join("Cargo.toml"))
        .output()
        .expect("running cargo metadata");
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages = meta["packages"].as_array().unwrap();
    let protocol = packages.iter().find(|p| p["name"] == "k3-protocol").expect("k3-protocol in the workspace");
    let features = protocol["features"].as_object().unwrap();
    assert!(features.contains_key(FEATURE), "k3-protocol declares no `{FEATURE}` feature");
    for (name, implied) in features {
        let implied: Vec<&str> = implied.as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert!(name == FEATURE || !implied.contains(&FEATURE), "k3-protocol's feature `{name}` turns on `{FEATURE}`: {implied:?}");
    }
    let mut dev_users = Vec::new();
    for p in packages {
        let pname = p["name"].as_str().unwrap();
        for (name, implied) in p["features"].as_object().unwrap() {
            for f in implied.as_array().unwrap() {
                let f = f.as_str().unwrap();
                assert!(
                    !(f.starts_with("k3-protocol") && f.ends_with(&format!("/{FEATURE}"))),
                    "{pname}'s feature `{name}` turns on k3-protocol's `{FEATURE}` ({f})"
                );
            }
        }
        for d in p["dependencies"].as_array().unwrap() {
            if d["name"] != "k3-protocol" {
                continue;
            }
            let enables = d["features"].as_array().unwrap().iter().any(|f| f == FEATURE);
            let kind = d["kind"].as_str().unwrap_or("normal");
            if enables {
                assert_eq!(kind, "dev", "{pname}'s {kind} dependency on k3-protocol enables `{FEATURE}`");
                dev_users.push(pname.to_string());
            }
        }
    }
    // The transport's own fault tests and the cross-node ones (tests/fallback.rs) use the hooks.
    dev_users.sort();
    assert_eq!(dev_users, ["k3-e2e-tests", "k3-protocol"], "the crates whose tests enable `{FEATURE}`");
}

/// Checks a probe crate that depends on k3-protocol by path and names the hooks; returns
/// (success, compiler messages).
fn check_probe(with_feature: bool) -> (bool, String) {
    let ws = workspace();
    let dir = tempfile::tempdir().unwrap();
    let manifest = format!(
        "[package]\nname = \"fault-probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
         [dependencies]\nk3-protocol = {{ path = {:?} }}\n\n[workspace]\n",
        ws.join("protocol").to_str().unwrap()
    );
    std::fs::write(dir.path().join("Cargo.toml"), manifest).unwrap();
    // The workspace's lock: the same dependency versions, no registry look-up.
    std::fs::copy(ws.join("Cargo.lock"), dir.path().join("Cargo.lock")).unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::write(
        dir.path().join("src/lib.rs"),
        "pub use k3_protocol::transport::hooks::FaultHooks;\n\
         pub fn hooks_of(c: &k3_protocol::transport::NodeConfig) -> usize { std::mem::size_of_val(&c.hooks) }\n",
    )
    .unwrap();
    // A target dir of its own (the running `cargo test` holds the workspace's), kept between runs.
    let target = ws.join("target").join("fault-probe");
    let mut cmd = cargo();
    cmd.current_dir(dir.path())
        .args(["check", "--offline", "--lib", "--message-format", "short", "--target-dir"])
        .arg(&target)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS");
    if with_feature {
        cmd.args(["--features", &format!("k3-protocol/{FEATURE}")]);
    }
    let out = cmd.output().expect("running cargo check");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_normal_build_has_no_fault_hooks() {
    let (ok, msgs) = check_probe(true);
    assert!(ok, "the probe must build with `{FEATURE}` (the control):\n{msgs}");
    let (ok, msgs) = check_probe(false);
    assert!(!ok, "a normal build of k3-protocol exposes the fault hooks:\n{msgs}");
    let errors: Vec<&str> = msgs.lines().filter(|l| l.contains("error[E")).collect();
    assert_eq!(errors.len(), 2, "expected exactly the two missing items, got:\n{msgs}");
    assert!(errors.iter().any(|l| l.contains("E0432") && l.contains("hooks")), "`transport::hooks` must not resolve:\n{msgs}");
    assert!(errors.iter().any(|l| l.contains("E0609") && l.contains("hooks")), "`NodeConfig::hooks` must not exist:\n{msgs}");
}
