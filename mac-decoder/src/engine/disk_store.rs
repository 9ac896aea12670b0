//! Held sessions on disk (`k3-decode serve --session-dir DIR --session-disk GB`): a session
//! evicted from memory, and every held session when the server stops, is written to `DIR` as a
//! `*.k3session` file — the validated session-state format of `generate --state`
//! (`k3_protocol::handoff`: checksummed safetensors with the model fingerprint and the hash of
//! the token prefix), plus the last logits and the conversation key. A prompt that continues a
//! file's tokens further than anything held in memory is restored from it instead of
//! prefilled again.
//!
//! - **Writes never block the decode loop**: the engine thread only exports the state to host
//!   memory (MLX arrays live on that thread); a writer thread serialises, checksums and writes
//!   it (`NAME.k3session.tmp`, then a rename, so a file under its final name is complete). A
//!   session queued for writing is restored from the queued copy.
//! - **Index at start**: every `*.k3session` file's header is read (format, version, model
//!   fingerprint, token count and hash, the byte length the header implies); a torn, foreign
//!   or other-model file gets a warning naming it and why, and is deleted. A restore reads the
//!   whole file and checks its checksum, shapes, fingerprint and hash again; a file failing
//!   there is also named, deleted and not used (the prompt is prefilled instead). Other files in
//!   the directory are left alone.
//! - **Bound**: the files' bytes stay under `max_bytes`; the least recently used files go first
//!   (`session_evictions{reason="disk_full"}`).
//! - Files are named by the token-prefix hash (with the cache scope, when the state has one), so
//!   one conversation state is written once however often it is evicted; a file records its
//!   scope and is restored only into requests of that scope.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use k3_protocol::handoff::{self, SessionMeta};

use super::generation_engine::{HeldState, StateIdentity};
use crate::metrics::Metrics;

/// File name extension of a held session.
pub const EXTENSION: &str = "k3session";

/// Metadata key of the conversation key in a session file.
const KEY_MD: &str = "session_key";

/// Metadata key of the cache scope (`sessions` module doc) in a session file.
const SCOPE_MD: &str = "cache_scope";

/// The file name of the state of a token prefix (hash `hash`) in cache scope `scope`: the same
/// tokens in two scopes are two files.
fn file_name(hash: &str, scope: Option<&str>) -> String {
    match scope {
        None => format!("{}.{EXTENSION}", &hash[..32.min(hash.len())]),
        Some(s) => {
            use sha2::{Digest, Sha256};
            let d = Sha256::digest(format!("{hash}\n{s}").as_bytes());
            let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
            format!("{}.{EXTENSION}", &hex[..32])
        }
    }
}

/// Where and how much.
#[derive(Debug, Clone)]
pub struct DiskOptions {
    pub dir: PathBuf,
    /// Bytes of session files at most.
    pub max_bytes: u64,
}

impl DiskOptions {
    /// `$XDG_CACHE_HOME/k3-offload/sessions` (else `~/.cache/...`).
    pub fn default_dir() -> Option<PathBuf> {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("k3-offload").join("sessions"))
    }

    /// A tenth of the free space of the file system holding `dir` (or of its nearest existing
    /// ancestor); `None` when it cannot be read.
    pub fn default_max_bytes(dir: &Path) -> Option<u64> {
        let mut p = dir;
        while !p.exists() {
            p = p.parent()?;
        }
        free_bytes(p).map(|b| b / 10)
    }
}

#[cfg(unix)]
fn free_bytes(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `s` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    Some(s.f_bavail as u64 * s.f_frsize as u64)
}

#[cfg(not(unix))]
fn free_bytes(_p: &Path) -> Option<u64> {
    None
}

/// One session file (or one queued for writing).
struct DiskFile {
    name: String,
    tokens: usize,
    hash: String,
    bytes: u64,
    key: Option<String>,
    scope: Option<String>,
    last_used: u64,
    /// The state while it waits for the writer (restores read it from here).
    pending: Option<Arc<HeldState>>,
}

#[derive(Default)]
struct Index {
    files: Vec<DiskFile>,
    clock: u64,
}

impl Index {
    fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
}

/// A file to write.
struct Write {
    name: String,
    tokens: usize,
    hash: String,
    key: Option<String>,
    scope: Option<String>,
    held: Arc<HeldState>,
}

/// A state restored from disk.
pub struct Restored {
    pub held: HeldState,
    pub key: Option<String>,
    /// Read from its file (else from the writer's queue).
    pub from_file: bool,
}

/// The disk store; lives on the engine thread, with its writer thread.
pub struct DiskStore {
    dir: PathBuf,
    max_bytes: u64,
    identity: StateIdentity,
    index: Arc<Mutex<Index>>,
    writer: Option<(mpsc::Sender<Write>, std::thread::JoinHandle<()>)>,
    metrics: Arc<Metrics>,
}

/// Why an indexed file cannot be used (the warning's words and the metric's reason).
struct Bad {
    reason: &'static str,
    msg: String,
}

fn bad(reason: &'static str, msg: impl Into<String>) -> Bad {
    Bad { reason, msg: msg.into() }
}

impl DiskStore {
    /// Opens (creates) the directory and indexes its session files.
    pub fn open(opts: &DiskOptions, identity: StateIdentity, metrics: Arc<Metrics>) -> anyhow::Result<DiskStore> {
        std::fs::create_dir_all(&opts.dir).with_context(|| format!("creating the session directory {}", opts.dir.display()))?;
        let t = Instant::now();
        let mut index = Index::default();
        let mut files: Vec<(PathBuf, std::time::SystemTime)> = Vec::new();
        for e in std::fs::read_dir(&opts.dir).with_context(|| format!("reading the session directory {}", opts.dir.display()))? {
            let e = e?;
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(&format!(".{EXTENSION}.tmp")) {
                tracing::warn!(file = %path.display(), "deleting a session file left half-written by an earlier run");
                let _ = std::fs::remove_file(&path);
                metrics.store.rejected("torn");
                continue;
            }
            if !name.ends_with(&format!(".{EXTENSION}")) {
                continue;
            }
            let mtime = e.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
            files.push((path, mtime));
        }
        // Oldest first: the clock orders them by their last write.
        files.sort_by_key(|f| f.1);
        for (path, _) in files {
            match read_header(&path, &identity) {
                Ok(mut f) => {
                    index.clock += 1;
                    f.last_used = index.clock;
                    index.files.push(f);
                }
                Err(b) => {
                    tracing::warn!(file = %path.display(), reason = b.reason, "session file not used and deleted: {}", b.msg);
                    let _ = std::fs::remove_file(&path);
                    metrics.store.rejected(b.reason);
                }
            }
        }
        let index = Arc::new(Mutex::new(index));
        let (tx, rx) = mpsc::channel::<Write>();
        let writer = {
            let (dir, index, metrics, fp) = (opts.dir.clone(), index.clone(), metrics.clone(), identity.fingerprint);
            std::thread::Builder::new().name("k3-session-writer".into()).spawn(move || write_loop(&dir, fp, rx, &index, &metrics))?
        };
        let store = DiskStore { dir: opts.dir.clone(), max_bytes: opts.max_bytes, identity, index, writer: Some((tx, writer)), metrics };
        {
            let g = store.lock();
            tracing::info!(
                dir = %store.dir.display(),
                files = g.files.len(),
                mb = format!("{:.1}", g.bytes() as f64 / 1e6),
                limit_mb = format!("{:.1}", store.max_bytes as f64 / 1e6),
                seconds = format!("{:.3}", t.elapsed().as_secs_f64()),
                "session directory indexed"
            );
        }
        let mut g = store.lock();
        store.make_room(&mut g, 0);
        drop(g);
        store.gauges();
        Ok(store)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of the files (and queued writes).
    pub fn bytes(&self) -> u64 {
        self.lock().bytes()
    }

    pub fn files(&self) -> usize {
        self.lock().files.len()
    }

    fn gauges(&self) {
        let g = self.lock();
        self.metrics.store.disk_bytes.set(g.bytes() as i64);
        self.metrics.store.disk_files.set(g.files.len() as i64);
    }

    /// The longest file of cache scope `scope` whose tokens are a prefix of `prompt`, if longer
    /// than `longer_than`: its name and token count.
    pub fn best_match(&self, prompt: &[u32], longer_than: usize, scope: Option<&str>) -> Option<(String, usize)> {
        let g = self.lock();
        let mut lens: Vec<usize> =
            g.files.iter().filter(|f| f.scope.as_deref() == scope).map(|f| f.tokens).filter(|&n| n > longer_than && n <= prompt.len()).collect();
        if lens.is_empty() {
            return None;
        }
        lens.sort_unstable();
        lens.dedup();
        // One pass of the hash over the prompt, its state read at every candidate length.
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let mut at = 0;
        let mut hashes: HashMap<usize, String> = HashMap::new();
        for n in lens {
            for t in &prompt[at..n] {
                h.update(t.to_le_bytes());
            }
            at = n;
            hashes.insert(n, h.clone().finalize().iter().map(|b| format!("{b:02x}")).collect());
        }
        g.files
            .iter()
            .filter(|f| f.scope.as_deref() == scope && hashes.get(&f.tokens) == Some(&f.hash))
            .max_by_key(|f| (f.tokens, f.last_used))
            .map(|f| (f.name.clone(), f.tokens))
    }

    /// The state of file `name` (which must hold `tokens`), from the writer's queue or read and
    /// checked from disk. A file that fails a check is named in a warning and deleted.
    pub fn load(&self, name: &str, tokens: &[u32]) -> anyhow::Result<Restored> {
        let pending = {
            let mut g = self.lock();
            g.clock += 1;
            let clock = g.clock;
            let f = g.files.iter_mut().find(|f| f.name == name).ok_or_else(|| anyhow::anyhow!("session file {name} is no longer held"))?;
            f.last_used = clock;
            f.pending.clone().map(|p| (p, f.key.clone()))
        };
        if let Some((held, key)) = pending {
            anyhow::ensure!(held.state.tokens == tokens.len(), "queued session {name} holds {} tokens, not {}", held.state.tokens, tokens.len());
            return Ok(Restored { held: (*held).clone(), key, from_file: false });
        }
        let path = self.dir.join(name);
        match self.read_file(&path, tokens) {
            Ok(r) => Ok(r),
            Err(b) => {
                tracing::warn!(file = %path.display(), reason = b.reason, "session file not used and deleted: {}", b.msg);
                let _ = std::fs::remove_file(&path);
                self.metrics.store.rejected(b.reason);
                self.lock().files.retain(|f| f.name != name);
                self.gauges();
                anyhow::bail!("session file {}: {}", path.display(), b.msg)
            }
        }
    }

    fn read_file(&self, path: &Path, tokens: &[u32]) -> Result<Restored, Bad> {
        let c = &self.identity.text_config;
        let f = handoff::load_session(path, c).map_err(|e| bad("damaged", e.to_string()))?;
        if f.fingerprint != Some(self.identity.fingerprint) {
            return Err(bad("other_model", format!("written for model {}", f.fingerprint.map(|f| f.short()).unwrap_or_else(|| "(none)".into()))));
        }
        let want = handoff::token_prefix_hash(tokens);
        if f.state.tokens != tokens.len() || f.token_prefix_hash.as_deref() != Some(want.as_str()) {
            return Err(bad("damaged", format!("holds {} tokens with another prefix hash than its index entry", f.state.tokens)));
        }
        f.state.check(c).map_err(|e| bad("damaged", e.to_string()))?;
        let logits = match f.extra.get("logits") {
            Some((shape, data)) if shape == &[c.vocab_size] && data.iter().all(|x| x.is_finite()) => Some(data.clone()),
            Some((shape, _)) => return Err(bad("damaged", format!("logits of shape {shape:?} (or not finite), expected [{}]", c.vocab_size))),
            None => None,
        };
        Ok(Restored { held: HeldState { state: f.state, logits }, key: f.metadata.get(KEY_MD).cloned(), from_file: true })
    }

    /// Queues `held` (the state of `tokens`) for writing; evicts old files to stay under the
    /// bound. A state already on disk is only marked used.
    pub fn put(&self, tokens: &[u32], key: Option<String>, scope: Option<String>, held: HeldState) {
        let hash = handoff::token_prefix_hash(tokens);
        let name = file_name(&hash, scope.as_deref());
        let estimate = held.state.nbytes() as u64 + 4 * held.logits.as_ref().map_or(0, |l| l.len()) as u64 + 16 * 1024;
        {
            let mut g = self.lock();
            g.clock += 1;
            let clock = g.clock;
            if let Some(f) = g.files.iter_mut().find(|f| f.name == name) {
                f.last_used = clock;
                return;
            }
            if estimate > self.max_bytes {
                tracing::debug!(tokens = tokens.len(), mb = format!("{:.1}", estimate as f64 / 1e6), "a session larger than --session-disk is not written");
                return;
            }
            self.make_room(&mut g, estimate);
            let held = Arc::new(held);
            g.files.push(DiskFile {
                name: name.clone(),
                tokens: tokens.len(),
                hash: hash.clone(),
                bytes: estimate,
                key: key.clone(),
                scope: scope.clone(),
                last_used: clock,
                pending: Some(held.clone()),
            });
            if let Some((tx, _)) = &self.writer {
                if tx.send(Write { name, tokens: tokens.len(), hash, key, scope, held }).is_err() {
                    tracing::warn!("the session writer has stopped; the session is not written");
                }
            }
        }
        self.gauges();
    }

    /// Deletes the least recently used files until `extra` more bytes fit.
    fn make_room(&self, g: &mut Index, extra: u64) {
        while !g.files.is_empty() && g.bytes() + extra > self.max_bytes {
            let Some(i) = g.files.iter().enumerate().min_by_key(|(_, f)| f.last_used).map(|(i, _)| i) else { break };
            let f = g.files.swap_remove(i);
            // A queued file is dropped by the writer when it finds its entry gone.
            if f.pending.is_none() {
                let _ = std::fs::remove_file(self.dir.join(&f.name));
            }
            self.metrics.store.evicted("disk_full");
            tracing::debug!(file = %f.name, tokens = f.tokens, "session file evicted (disk bound)");
        }
    }

    /// Waits until every queued write is on disk and stops the writer.
    pub fn flush(&mut self) {
        if let Some((tx, h)) = self.writer.take() {
            drop(tx);
            if h.join().is_err() {
                tracing::error!("the session writer panicked");
            }
        }
        self.gauges();
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        self.flush();
    }
}

/// The writer thread: each queued state to its file, then the index updated.
fn write_loop(dir: &Path, fp: k3_protocol::Fingerprint, rx: mpsc::Receiver<Write>, index: &Mutex<Index>, metrics: &Metrics) {
    let lock = || index.lock().unwrap_or_else(|p| p.into_inner());
    for w in rx {
        if !lock().files.iter().any(|f| f.name == w.name) {
            continue; // evicted before it was written
        }
        let t = Instant::now();
        let path = dir.join(&w.name);
        let tmp = dir.join(format!("{}.tmp", w.name));
        let meta = SessionMeta { fingerprint: fp, tokens: w.tokens, token_prefix_hash: w.hash.clone() };
        let logits: Vec<(String, Vec<usize>, &[f32])> = w.held.logits.iter().map(|l| ("logits".to_string(), vec![l.len()], &l[..])).collect();
        let md: Vec<(&str, String)> = w.key.iter().map(|k| (KEY_MD, k.clone())).chain(w.scope.iter().map(|s| (SCOPE_MD, s.clone()))).collect();
        let r = handoff::save_session_with(&tmp, &w.held.state, Some(&meta), &logits, &md)
            .map_err(anyhow::Error::from)
            .and_then(|()| std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display())));
        let size = std::fs::metadata(&path).map(|m| m.len());
        let mut g = lock();
        let entry = g.files.iter_mut().position(|f| f.name == w.name);
        match (r, entry, size) {
            (Ok(()), Some(i), Ok(size)) => {
                g.files[i].bytes = size;
                g.files[i].pending = None;
                metrics.store.disk_writes.inc();
                metrics.store.disk_write_seconds.inc_by(t.elapsed().as_secs_f64());
                tracing::debug!(file = %path.display(), tokens = w.tokens, mb = format!("{:.2}", size as f64 / 1e6), seconds = format!("{:.3}", t.elapsed().as_secs_f64()), "session written");
            }
            (Ok(()), None, _) => {
                let _ = std::fs::remove_file(&path); // evicted while it was written
            }
            (r, i, _) => {
                if let Err(e) = r {
                    tracing::warn!(file = %path.display(), "could not write the session: {e:#}");
                }
                let _ = std::fs::remove_file(&tmp);
                let _ = std::fs::remove_file(&path);
                if let Some(i) = i {
                    g.files.swap_remove(i);
                }
            }
        }
        metrics.store.disk_bytes.set(g.bytes() as i64);
        metrics.store.disk_files.set(g.files.len() as i64);
    }
}

/// Reads a session file's header: ours, this model's, whole. Its contents are checked when it
/// is restored ([`DiskStore::load`]).
fn read_header(path: &Path, identity: &StateIdentity) -> Result<DiskFile, Bad> {
    let mut f = std::fs::File::open(path).map_err(|e| bad("unreadable", e.to_string()))?;
    let len = f.metadata().map_err(|e| bad("unreadable", e.to_string()))?.len();
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8).map_err(|_| bad("torn", format!("{len} bytes: shorter than a safetensors header")))?;
    let n = u64::from_le_bytes(n8);
    if n > 64 << 20 || 8 + n > len {
        return Err(bad("torn", format!("its header claims {n} bytes, the file has {len}")));
    }
    let mut hdr = vec![0u8; n as usize];
    f.read_exact(&mut hdr).map_err(|e| bad("torn", e.to_string()))?;
    let v: serde_json::Value = serde_json::from_slice(&hdr).map_err(|e| bad("foreign", format!("the header is not JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| bad("foreign", "the header is not a JSON object"))?;
    let md = obj.get("__metadata__").and_then(|m| m.as_object()).ok_or_else(|| bad("foreign", "no metadata: not a k3-offload session"))?;
    let s = |k: &str| md.get(k).and_then(|v| v.as_str());
    if s("format") != Some("k3-offload-session") {
        return Err(bad("foreign", format!("format {:?}, not k3-offload-session", s("format"))));
    }
    if s("format_version") != Some(handoff::SESSION_FORMAT_VERSION) {
        return Err(bad("foreign", format!("format_version {:?}, this build writes {}", s("format_version"), handoff::SESSION_FORMAT_VERSION)));
    }
    let fp = s("fingerprint").ok_or_else(|| bad("foreign", "no model fingerprint"))?;
    if fp != identity.fingerprint.hex() {
        return Err(bad("other_model", format!("written for model {}, this server runs {}", &fp[..fp.len().min(16)], identity.fingerprint.short())));
    }
    let tokens: usize = s("tokens").and_then(|t| t.parse().ok()).ok_or_else(|| bad("foreign", "no token count"))?;
    let hash = s("token_prefix_hash").ok_or_else(|| bad("foreign", "no token prefix hash"))?.to_string();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let scope = s(SCOPE_MD).map(String::from);
    if hash.len() < 32 || name != file_name(&hash, scope.as_deref()) {
        return Err(bad("foreign", "its name is not its token prefix hash (and cache scope)"));
    }
    let mut end = 0u64;
    for (k, t) in obj {
        if k == "__metadata__" {
            continue;
        }
        let o = t.get("data_offsets").and_then(|o| o.as_array()).ok_or_else(|| bad("foreign", format!("tensor {k} has no data offsets")))?;
        end = end.max(o.get(1).and_then(|x| x.as_u64()).ok_or_else(|| bad("foreign", format!("tensor {k}: bad data offsets")))?);
    }
    if 8 + n + end != len {
        return Err(bad("torn", format!("{len} bytes, its header describes {}", 8 + n + end)));
    }
    Ok(DiskFile { name, tokens, hash, bytes: len, key: s(KEY_MD).map(String::from), scope, last_used: 0, pending: None })
}
