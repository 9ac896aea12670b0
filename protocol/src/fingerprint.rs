//! Model identities: what both nodes compare before exchanging state, and what a checkpoint is
//! checked against as it is used. One module, one hash (SHA-256), one type ([`Fingerprint`]):
//!
//! - [`Checkpoint::fingerprint`] — **the model fingerprint** (v2): the typed config, the tensor
//!   index (names, dtypes, shapes) and the SHA-256 of every tensor's bytes. Two checkpoints with
//!   equal configs but different weights (another seed, a fine-tune, a revision, a damaged shard)
//!   differ. The weight digests are computed once per checkpoint ([`WeightDigest`]: parallel,
//!   with a progress bar) and cached beside it, keyed by each shard's size and mtime.
//! - [`Checkpoint::index_fingerprint`] — config and tensor index only (the v1 fingerprint): equal
//!   for any two checkpoints of one architecture, whatever their weights.
//! - [`Checkpoint::verify_layer`] — the weight bytes of one layer against the digest (SHA-256,
//!   about 1.7 GB/s per core with the CPU's SHA instructions), once per layer per process, so a
//!   shard damaged or edited after the digest was made, or a forged digest cache, is refused at
//!   its first use instead of computing with it (and the cache deleted);
//!   [`Checkpoint::verify_outside_layers`] the same for the embedding, norm and output head. A
//!   command labels what it writes with the fingerprint only after the tensors it read passed.
//!
//! Other identities (e.g. which hand-off states are compatible) belong here too, built from the
//! same pieces.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::K3Config;
pub use crate::weight_digest::{ShardStamp, TensorDigest, WeightDigest};

/// 32-byte model fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
    /// The first 16 hex digits, for logs.
    pub fn short(&self) -> String {
        self.hex()[..16].to_string()
    }
    pub fn from_hex(s: &str) -> Option<Self> {
        let v = hex::decode(s).ok()?;
        Some(Fingerprint(v.try_into().ok()?))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", self.short())
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

/// One entry of a tensor index: name, dtype name, shape.
pub type IndexEntry = (String, &'static str, Vec<usize>);

fn hash_index(h: &mut Sha256, config: &K3Config, tensors: &mut [IndexEntry], weights: Option<&WeightDigest>) {
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    // The typed config re-serialised: independent of key order and whitespace in the file.
    h.update(serde_json::to_vec(config).expect("config serialises"));
    h.update(b"\n");
    for (name, dtype, shape) in tensors.iter() {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(dtype.as_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        if let Some(w) = weights {
            match w.tensors.get(name) {
                Some(t) => h.update(t.sha256.as_bytes()),
                None => h.update(b"<no digest>"),
            }
        }
        h.update([b'\n']);
    }
}

/// Index fingerprint (v1) of a config and a list of `(name, dtype, shape)` entries
/// (order-independent): no weight bytes.
pub fn fingerprint_of(config: &K3Config, tensors: &mut [IndexEntry]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"k3-offload model fingerprint v1\n");
    hash_index(&mut h, config, tensors, None);
    Fingerprint(h.finalize().into())
}

/// Model fingerprint (v2): config, index and every tensor's weight digest.
pub fn model_fingerprint_of(config: &K3Config, tensors: &mut [IndexEntry], weights: &WeightDigest) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"k3-offload model fingerprint v2 (config, index, weights)\n");
    hash_index(&mut h, config, tensors, Some(weights));
    Fingerprint(h.finalize().into())
}

/// Bytes hashed per task (a tensor larger than this is split; its pieces hash in parallel).
pub const PIECE: usize = 16 << 20;
const DIGEST_VERSION: u32 = 1;
/// The cache beside the checkpoint.
pub const DIGEST_FILE: &str = ".k3-weights.digest.json";
/// Models smaller than this hash without a progress bar.
const PROGRESS_FROM_BYTES: u64 = 256 << 20;

fn stamp(path: &Path, name: &str) -> Option<ShardStamp> {
    let m = std::fs::metadata(path).ok()?;
    let mtime_ns = m.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos();
    Some(ShardStamp { name: name.to_string(), size: m.len(), mtime_ns })
}

/// Where the digest of `dir` is cached when `dir` is not writable.
fn fallback_cache_path(dir: &Path) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    let canon = std::fs::canonicalize(dir).ok()?;
    let key = hex::encode(Sha256::digest(canon.to_string_lossy().as_bytes()));
    Some(base.join("k3-offload").join("weight-digests").join(format!("{}.json", &key[..32])))
}

impl Checkpoint {
    /// The index fingerprint (v1): config and tensor index, not the weights.
    pub fn index_fingerprint(&self) -> Fingerprint {
        fingerprint_of(self.config(), &mut self.index_entries())
    }

    /// The model fingerprint (v2): config, tensor index and weight bytes. The first call per
    /// checkpoint hashes every tensor (or reads the cache beside it); later calls are free.
    pub fn fingerprint(&self) -> Fingerprint {
        model_fingerprint_of(self.config(), &mut self.index_entries(), self.weight_digest())
    }

    fn index_entries(&self) -> Vec<IndexEntry> {
        self.tensor_names()
            .map(|n| {
                let e = self.entry(n).expect("listed");
                (n.to_string(), e.dtype.name(), e.shape.clone())
            })
            .collect()
    }

    fn shard_stamps(&self) -> Vec<ShardStamp> {
        (0..self.shard_count())
            .map(|i| {
                let name = self.shard_name(i);
                stamp(&self.dir().join(name), name).unwrap_or(ShardStamp { name: name.to_string(), size: 0, mtime_ns: 0 })
            })
            .collect()
    }

    /// Whether a cached digest describes this checkpoint as it is now: the same shards (name,
    /// size, mtime) and the same tensors with the same byte counts.
    fn digest_fits(&self, d: &WeightDigest, stamps: &[ShardStamp]) -> bool {
        d.version == DIGEST_VERSION
            && d.shards == stamps
            && d.tensors.len() == self.tensor_names().count()
            && self.tensor_names().all(|n| {
                let e = self.entry(n).expect("listed");
                d.tensors.get(n).is_some_and(|t| t.bytes == (e.end - e.start) as u64)
            })
    }

    /// The weight digests: from memory, else the cache beside the checkpoint (or in
    /// `~/.cache/k3-offload/weight-digests/`) if it still fits, else computed and cached.
    pub fn weight_digest(&self) -> &WeightDigest {
        self.identity().digest.get_or_init(|| {
            let stamps = self.shard_stamps();
            let beside = self.dir().join(DIGEST_FILE);
            let fallback = fallback_cache_path(self.dir());
            for path in std::iter::once(beside.clone()).chain(fallback.clone()) {
                let Ok(bytes) = crate::files::read_regular(&path, 1 << 30) else { continue };
                match serde_json::from_slice::<WeightDigest>(&bytes) {
                    Ok(d) if self.digest_fits(&d, &stamps) => {
                        tracing::debug!(path = %path.display(), "weight digest from the cache");
                        return d;
                    }
                    Ok(_) => tracing::info!(path = %path.display(), "the checkpoint changed since its weight digest was cached; hashing again"),
                    Err(e) => tracing::warn!(path = %path.display(), "unreadable weight digest cache ({e}); hashing again"),
                }
            }
            let d = self.compute_weight_digest(stamps);
            let text = serde_json::to_vec(&d).expect("digest serialises");
            let written = std::iter::once(beside).chain(fallback).find(|p| {
                // Unique per process and call: concurrent openers each write whole files.
                static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let tmp = p.with_extension(format!("json.{}.{n}.tmp", std::process::id()));
                let ok = p.parent().is_some_and(|dir| std::fs::create_dir_all(dir).is_ok())
                    && std::fs::write(&tmp, &text).is_ok()
                    && std::fs::rename(&tmp, p).is_ok();
                if !ok {
                    let _ = std::fs::remove_file(&tmp);
                }
                ok
            });
            match written {
                Some(p) => tracing::info!(path = %p.display(), "weight digest cached"),
                None => tracing::warn!(dir = %self.dir().display(), "could not cache the weight digest; it will be computed again next time"),
            }
            d
        })
    }

    /// Hashes every tensor: pieces of [`PIECE`] bytes on the rayon pool, a progress bar for
    /// large models.
    fn compute_weight_digest(&self, shards: Vec<ShardStamp>) -> WeightDigest {
        let names: Vec<&str> = self.tensor_names().collect();
        let mut tasks: Vec<(usize, usize)> = Vec::new(); // (tensor index, piece index)
        let mut total = 0u64;
        for (i, n) in names.iter().enumerate() {
            let len = self.tensor(n).expect("listed").bytes.len();
            total += len as u64;
            for p in 0..len.div_ceil(PIECE).max(1) {
                tasks.push((i, p));
            }
        }
        let t0 = std::time::Instant::now();
        let bar = if total >= PROGRESS_FROM_BYTES {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(
                indicatif::ProgressStyle::with_template("hashing weights {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}").expect("template"),
            );
            b
        } else {
            indicatif::ProgressBar::hidden()
        };
        let pieces: Vec<([u8; 32], u32, usize)> = tasks
            .par_iter()
            .map(|&(i, p)| {
                let bytes = self.tensor(names[i]).expect("listed").bytes;
                let piece = &bytes[(p * PIECE).min(bytes.len())..((p + 1) * PIECE).min(bytes.len())];
                let out = (Sha256::digest(piece).into(), crc32c::crc32c(piece), piece.len());
                bar.inc(piece.len() as u64);
                out
            })
            .collect();
        bar.finish_and_clear();
        let mut tensors = HashMap::with_capacity(names.len());
        let mut k = 0;
        for (i, n) in names.iter().enumerate() {
            let mut h = Sha256::new();
            let mut crc = 0u32;
            let mut bytes = 0u64;
            while k < tasks.len() && tasks[k].0 == i {
                let (sha, c, len) = pieces[k];
                h.update(sha);
                crc = if bytes == 0 { c } else { crc32c::crc32c_combine(crc, c, len) };
                bytes += len as u64;
                k += 1;
            }
            tensors.insert(n.to_string(), TensorDigest { sha256: hex::encode(h.finalize()), crc32c: crc, bytes });
        }
        let secs = t0.elapsed().as_secs_f64();
        tracing::info!(
            tensors = names.len(),
            bytes = total,
            seconds = secs,
            "hashed the checkpoint's weights ({:.2} GB/s)",
            total as f64 / secs.max(1e-9) / 1e9
        );
        WeightDigest { version: DIGEST_VERSION, shards, tensors }
    }

    /// Checks one tensor's bytes against its digest ([`Self::verify_tensors`]).
    pub fn verify_tensor(&self, name: &str) -> Result<(), CheckpointError> {
        self.verify_tensors(&[name])
    }

    /// Checks the bytes of `names` against the weight digest the model fingerprint was made
    /// from: each tensor's SHA-256 (the identity hash itself, over its [`PIECE`]-byte pieces on
    /// the rayon pool) and byte count. A CRC would catch bit rot but not a forged digest cache
    /// (one that lists a shard's real CRC next to another model's SHA-256), so the check is the
    /// hash the fingerprint is made of. On a mismatch the cached digest no longer describes the
    /// checkpoint: it is deleted ([`Self::discard_digest_cache`]) and the next open hashes the
    /// weights again, giving the checkpoint's true fingerprint.
    pub fn verify_tensors(&self, names: &[&str]) -> Result<(), CheckpointError> {
        let digest = self.weight_digest();
        let mut views = Vec::with_capacity(names.len());
        for n in names {
            let v = self.tensor(n)?;
            let want = digest.tensors.get(*n).ok_or_else(|| CheckpointError::Tensor { name: n.to_string(), msg: "has no weight digest".into() })?;
            views.push((v, want));
        }
        let tasks: Vec<(usize, usize)> =
            views.iter().enumerate().flat_map(|(i, (v, _))| (0..v.bytes.len().div_ceil(PIECE).max(1)).map(move |p| (i, p))).collect();
        let pieces: Vec<[u8; 32]> = tasks
            .par_iter()
            .map(|&(i, p)| {
                let b = views[i].0.bytes;
                Sha256::digest(&b[(p * PIECE).min(b.len())..((p + 1) * PIECE).min(b.len())]).into()
            })
            .collect();
        let mut k = 0;
        let mut bad: Option<CheckpointError> = None;
        for (i, (v, want)) in views.iter().enumerate() {
            let mut h = Sha256::new();
            while k < tasks.len() && tasks[k].0 == i {
                h.update(pieces[k]);
                k += 1;
            }
            let got = hex::encode(h.finalize());
            if bad.is_none() && (got != want.sha256 || v.bytes.len() as u64 != want.bytes) {
                bad = Some(CheckpointError::Tensor {
                    name: v.name.to_string(),
                    msg: format!(
                        "bytes in {} differ from the weight digest the model fingerprint was made from (sha256 {}…, \
                         the digest says {}…): the shard changed, is damaged, or the digest cache does not describe it; \
                         refusing to use it. The cached digest was deleted: the next start hashes the weights again",
                        v.shard,
                        &got[..16],
                        &want.sha256[..want.sha256.len().min(16)]
                    ),
                });
            }
        }
        match bad {
            Some(e) => {
                self.discard_digest_cache();
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Deletes the cached weight digest (beside the checkpoint and in the fallback cache): it
    /// failed a check, so the next open computes it again from the bytes.
    pub fn discard_digest_cache(&self) {
        for p in std::iter::once(self.dir().join(DIGEST_FILE)).chain(fallback_cache_path(self.dir())) {
            match std::fs::remove_file(&p) {
                Ok(()) => tracing::warn!(path = %p.display(), "deleted a weight digest cache that does not match the weights"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(path = %p.display(), "could not delete a weight digest cache that does not match the weights: {e}"),
            }
        }
    }

    /// Checks every tensor of decoder layer `layer` against the digest ([`Self::verify_tensors`]),
    /// the first time it is asked for in this process (later calls return the first answer at once).
    pub fn verify_layer(&self, layer: usize) -> Result<(), CheckpointError> {
        if let Some(r) = self.identity().layers.lock().expect("not poisoned").get(&layer) {
            return r.clone().map_err(|source| CheckpointError::Layer { layer, source });
        }
        let prefix = crate::tensors::layer_tensor(layer, "");
        let names: Vec<&str> = self.tensor_names().filter(|n| n.starts_with(&prefix)).collect();
        let r = self.verify_tensors(&names).map_err(std::sync::Arc::new);
        self.identity().layers.lock().expect("not poisoned").insert(layer, r.clone());
        r.map_err(|source| CheckpointError::Layer { layer, source })
    }

    /// Checks every tensor outside the decoder layers (embedding, final norm, output head, any
    /// other tower) against the digest, once per process. With [`Self::verify_layer`] of every
    /// layer a pass reads, the fingerprint written beside a result has been checked against the
    /// bytes that made it.
    pub fn verify_outside_layers(&self) -> Result<(), CheckpointError> {
        self.identity()
            .outside_layers
            .get_or_init(|| {
                let layers = self.config().text_config.num_hidden_layers;
                let prefixes: Vec<String> = (0..layers).map(|l| crate::tensors::layer_tensor(l, "")).collect();
                let mut names: Vec<&str> = self.tensor_names().filter(|n| !prefixes.iter().any(|p| n.starts_with(p.as_str()))).collect();
                names.sort_unstable();
                self.verify_tensors(&names).map_err(std::sync::Arc::new)
            })
            .clone()
            .map_err(CheckpointError::Shared)
    }

    /// [`Self::verify_outside_layers`] and [`Self::verify_layer`] of every decoder layer: every
    /// tensor of the checkpoint checked against the digest its fingerprint was made from.
    pub fn verify_all(&self) -> Result<(), CheckpointError> {
        self.verify_outside_layers()?;
        (0..self.config().text_config.num_hidden_layers).try_for_each(|l| self.verify_layer(l))
    }
}

/// Whether a tensor belongs to the routed experts or their router (the tensors routed-expert
/// pruning rewrites: `block_sparse_moe.experts.*`, `block_sparse_moe.gate.*`).
pub fn is_routed_expert_or_router(name: &str) -> bool {
    name.contains(".block_sparse_moe.experts.") || name.contains(".block_sparse_moe.gate.")
}

/// The state-compatibility identity (docs/pruning.md): the model fingerprint (config, index,
/// weights) of everything except the routed experts and their router — the config with
/// `num_experts` set to 0, the tensor index and weight digests without
/// [`is_routed_expert_or_router`] tensors. A model pruned from another (`k3-prefill prune`) has
/// the same state identity as its source and a different fingerprint, so a decoder running the
/// pruned model can recognise hand-off states computed by the full source model.
pub fn state_identity_of(config: &K3Config, tensors: &mut [IndexEntry], weights: &WeightDigest) -> Fingerprint {
    let mut cfg = config.clone();
    cfg.text_config.num_experts = 0;
    cfg.text_config.num_experts_per_layer = None;
    let mut kept: Vec<IndexEntry> = tensors.iter().filter(|(n, _, _)| !is_routed_expert_or_router(n)).cloned().collect();
    let mut h = Sha256::new();
    h.update(b"k3-offload state identity v1 (config, index, weights; no routed experts or router)\n");
    hash_index(&mut h, &cfg, &mut kept, Some(weights));
    Fingerprint(h.finalize().into())
}

impl Checkpoint {
    /// This checkpoint's state-compatibility identity ([`state_identity_of`]).
    pub fn state_identity(&self) -> Fingerprint {
        state_identity_of(self.config(), &mut self.index_entries(), self.weight_digest())
    }
}
