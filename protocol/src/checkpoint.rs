//! Reading a K3 checkpoint directory in the release layout: `config.json`,
//! `model.safetensors.index.json` and the shards, memory-mapped (never copied into RAM).
//! Every expected tensor is checked up front (presence, shape, dtype); all problems are
//! reported at once, each naming the tensor and shard.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::Deserialize;

use crate::config::{ConfigError, K3Config};
use crate::mxfp4::{Mxfp4Error, Mxfp4Weight};
use crate::tensors::{all_tensors, expert_tensor, DType};

pub mod writer;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("malformed index {path}: {msg}")]
    Index { path: String, msg: String },
    #[error("shard {shard}: {msg}")]
    Shard { shard: String, msg: String },
    #[error("checkpoint {dir} has {} problem(s):\n  {}", problems.len(), problems.join("\n  "))]
    Invalid { dir: String, problems: Vec<String> },
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },
    #[error("tensor {name}: {source}")]
    Mxfp4 { name: String, source: Mxfp4Error },
    #[error("tensor layer {layer}: {source}")]
    Layer { layer: usize, source: std::sync::Arc<CheckpointError> },
    /// An error found once and answered again (a verification result kept per process).
    #[error(transparent)]
    Shared(std::sync::Arc<CheckpointError>),
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub shard: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte range within the shard file.
    pub start: usize,
    pub end: usize,
}

/// A borrowed, zero-copy view of one tensor's bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub shard: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Decodes BF16 or F32 data to f32 (bit-exact widening).
    pub fn to_f32(&self) -> Result<Vec<f32>, CheckpointError> {
        match self.dtype {
            DType::F32 => Ok(self.bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
            DType::BF16 => Ok(self.bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()),
            DType::U8 => Err(CheckpointError::Tensor { name: self.name.to_string(), msg: "is U8 (MXFP4 packed data); decode it through mxfp4".into() }),
        }
    }
}

struct Shard {
    name: String,
    map: Mmap,
    /// Where the data section starts (after the length and the header).
    data_start: usize,
}

/// The digest cache of one checkpoint's weights, and the per-layer verification state (filled by
/// [`crate::fingerprint`]).
#[derive(Default)]
pub(crate) struct IdentityCache {
    pub(crate) digest: std::sync::OnceLock<crate::weight_digest::WeightDigest>,
    /// `Some(result)` once a layer was verified in this process.
    pub(crate) layers: std::sync::Mutex<HashMap<usize, Result<(), std::sync::Arc<CheckpointError>>>>,
    /// Set once the tensors outside the decoder layers were verified in this process.
    pub(crate) outside_layers: std::sync::OnceLock<Result<(), std::sync::Arc<CheckpointError>>>,
}

/// An opened checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    config: K3Config,
    shards: Vec<Shard>,
    entries: HashMap<String, TensorEntry>,
    /// Weight digests and per-layer verification (see [`crate::fingerprint`]).
    identity: IdentityCache,
}

#[derive(Deserialize)]
struct IndexFile {
    #[serde(default)]
    metadata: Option<serde_json::Value>,
    weight_map: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "BF16" => Some(DType::BF16),
        "F32" => Some(DType::F32),
        "U8" => Some(DType::U8),
        _ => None,
    }
}

/// Parses a safetensors header from a mapped shard, checking every range lies in the file.
fn read_header(name: &str, map: &[u8], shard_idx: usize, problems: &mut Vec<String>) -> Result<Vec<(String, TensorEntry)>, CheckpointError> {
    let err = |msg: String| CheckpointError::Shard { shard: name.to_string(), msg };
    if map.len() < 8 {
        return Err(err(format!("file is {} bytes, too short for a safetensors header", map.len())));
    }
    let n = u64::from_le_bytes(map[..8].try_into().unwrap()) as usize;
    if n > map.len() - 8 || n > 100 << 20 {
        return Err(err(format!("header length {n} exceeds the file size {} (truncated?)", map.len())));
    }
    let HeaderEntries(mut header) = serde_json::from_slice(&map[8..8 + n]).map_err(|e| err(format!("header JSON: {e}")))?;
    // A name twice: JSON parsers keep one of the two (which one differs between them), so the
    // bytes a reader uses would depend on the reader.
    let mut seen = std::collections::HashSet::with_capacity(header.len());
    for (tname, _) in &header {
        if !seen.insert(tname.as_str()) {
            return Err(err(format!("the header names tensor {tname:?} twice")));
        }
    }
    header.sort_by(|a, b| a.0.cmp(&b.0));
    let base = 8 + n;
    let mut out = Vec::new();
    for (tname, v) in header {
        if tname == "__metadata__" {
            continue;
        }
        let e: HeaderEntry = serde_json::from_value(v).map_err(|e| err(format!("header entry {tname}: {e}")))?;
        let Some(dtype) = parse_dtype(&e.dtype) else {
            problems.push(format!("{tname} in {name}: unsupported dtype {}", e.dtype));
            continue;
        };
        let [s, t] = e.data_offsets;
        // Checked: a hostile header may hold shapes or offsets whose products overflow.
        let nbytes = e.shape.iter().try_fold(dtype.size(), |a, &d| a.checked_mul(d));
        if t < s || Some(t - s) != nbytes {
            problems.push(format!("{tname} in {name}: data_offsets {s}..{t} do not match shape {:?} {}", e.shape, e.dtype));
            continue;
        }
        if base.checked_add(t).is_none_or(|end| end > map.len()) {
            problems.push(format!(
                "{tname} in {name}: bytes {}..{} lie beyond the end of the file ({} bytes): truncated shard",
                base.saturating_add(s),
                base.saturating_add(t),
                map.len()
            ));
            continue;
        }
        out.push((tname, TensorEntry { shard: shard_idx, dtype, shape: e.shape, start: base + s, end: base + t }));
    }
    Ok(out)
}

/// A safetensors header's entries in file order, duplicates kept (a map would drop them).
struct HeaderEntries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for HeaderEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = HeaderEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<HeaderEntries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry::<String, serde_json::Value>()? {
                    v.push(e);
                }
                Ok(HeaderEntries(v))
            }
        }
        d.deserialize_map(V)
    }
}

impl Checkpoint {
    /// Opens and fully validates a checkpoint directory.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let ck = Self::open_unvalidated(dir)?;
        ck.validate()?;
        Ok(ck)
    }

    /// Opens the config, index and shards without checking tensors against the config.
    pub fn open_unvalidated(dir: &Path) -> Result<Self, CheckpointError> {
        let config = K3Config::load(dir)?;
        let index_path = dir.join("model.safetensors.index.json");
        let io = |path: &Path, source| CheckpointError::Io { path: path.display().to_string(), source };
        let text = crate::files::read_regular_to_string(&index_path, crate::config::limits::JSON_FILE_BYTES).map_err(|e| io(&index_path, e))?;
        let index: IndexFile =
            serde_json::from_str(&text).map_err(|e| CheckpointError::Index { path: index_path.display().to_string(), msg: e.to_string() })?;
        let _ = index.metadata;
        let mut shard_names: Vec<String> = index.weight_map.values().cloned().collect();
        shard_names.sort();
        shard_names.dedup();
        let mut shards = Vec::new();
        let mut entries = HashMap::new();
        let mut problems = Vec::new();
        for (i, sname) in shard_names.iter().enumerate() {
            if sname.contains('/') || sname.contains("..") {
                return Err(CheckpointError::Index { path: index_path.display().to_string(), msg: format!("shard name {sname:?} is not a plain file name") });
            }
            let path = dir.join(sname);
            let file = crate::files::open_regular(&path).map_err(|e| CheckpointError::Shard {
                shard: sname.clone(),
                msg: format!("missing or unreadable ({e}); the index lists it for {} tensor(s)", index.weight_map.values().filter(|s| *s == sname).count()),
            })?;
            // SAFETY: the shard is opened read-only; the checkpoint is not modified while mapped.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| io(&path, e))?;
            for (name, entry) in read_header(sname, &map, i, &mut problems)? {
                match index.weight_map.get(&name) {
                    Some(s) if s == sname => {
                        entries.insert(name, entry);
                    }
                    Some(s) => problems.push(format!("{name}: index says shard {s}, found in {sname}")),
                    None => problems.push(format!("{name}: in shard {sname} but not in the index")),
                }
            }
            let data_start = 8 + u64::from_le_bytes(map[..8].try_into().expect("8 bytes, checked by read_header")) as usize;
            shards.push(Shard { name: sname.clone(), map, data_start });
        }
        for (name, sname) in &index.weight_map {
            if !entries.contains_key(name) && !problems.iter().any(|p| p.starts_with(name.as_str())) {
                problems.push(format!("{name}: listed in the index for shard {sname}, absent from that shard"));
            }
        }
        if !problems.is_empty() {
            return Err(CheckpointError::Invalid { dir: dir.display().to_string(), problems });
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), config, shards, entries, identity: Default::default() })
    }

    /// Checks every expected tensor's presence, shape and dtype; unknown tensors become warnings.
    pub fn validate(&self) -> Result<Vec<String>, CheckpointError> {
        let mut problems = Vec::new();
        let expected = all_tensors(&self.config);
        let mut known = std::collections::HashSet::new();
        for spec in &expected {
            known.insert(spec.name.as_str());
            match self.entries.get(&spec.name) {
                None => problems.push(format!("{}: missing (expected {:?} {})", spec.name, spec.shape, spec.dtype.name())),
                Some(e) => {
                    let shard = &self.shards[e.shard].name;
                    if e.shape != spec.shape || e.dtype != spec.dtype {
                        problems.push(format!(
                            "{} in {shard}: expected {:?} {}, found {:?} {}",
                            spec.name,
                            spec.shape,
                            spec.dtype.name(),
                            e.shape,
                            e.dtype.name()
                        ));
                    }
                }
            }
        }
        problems.extend(self.coverage_problems());
        let mut warnings: Vec<String> = self
            .entries
            .keys()
            .filter(|n| !known.contains(n.as_str()))
            .map(|n| format!("{n} in {}: unknown tensor, ignored", self.shards[self.entries[n].shard].name))
            .collect();
        warnings.sort();
        for w in &warnings {
            tracing::warn!("{w}");
        }
        if problems.is_empty() {
            Ok(warnings)
        } else {
            Err(CheckpointError::Invalid { dir: self.dir.display().to_string(), problems })
        }
    }

    /// Each shard's data section is exactly its tensors' bytes, in one run without holes or
    /// overlaps (as the safetensors format requires): bytes no tensor owns are a problem, so a
    /// shard padded to any size (a sparse file of 200 GB) is neither copied, read nor counted as
    /// model bytes.
    fn coverage_problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, shard) in self.shards.iter().enumerate() {
            let mut ranges: Vec<(usize, usize, &str)> =
                self.entries.iter().filter(|(_, e)| e.shard == i).map(|(n, e)| (e.start - shard.data_start, e.end - shard.data_start, n.as_str())).collect();
            ranges.sort_unstable();
            let mut end = 0usize;
            for (s, t, tname) in &ranges {
                if *s < end {
                    out.push(format!("{tname} in {}: bytes {s}..{t} of the data overlap the tensor before it (which ends at {end})", shard.name));
                } else if *s > end {
                    out.push(format!("{}: bytes {end}..{s} of the data belong to no tensor (a hole before {tname})", shard.name));
                }
                end = end.max(*t);
            }
            let data = shard.map.len() - shard.data_start;
            if end < data {
                out.push(format!(
                    "{}: the file is {} bytes, its tensors end at {}: {} trailing bytes belong to no tensor (a padded or sparse file)",
                    shard.name,
                    shard.map.len(),
                    shard.data_start + end,
                    data - end
                ));
            }
        }
        out
    }

    pub fn config(&self) -> &K3Config {
        &self.config
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.entries.get(name)
    }

    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    pub(crate) fn identity(&self) -> &IdentityCache {
        &self.identity
    }

    pub fn shard_name(&self, shard: usize) -> &str {
        &self.shards[shard].name
    }

    /// Zero-copy view of a tensor.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let (key, e) =
            self.entries.get_key_value(name).ok_or_else(|| CheckpointError::Tensor { name: name.to_string(), msg: "not in the checkpoint".into() })?;
        let shard = &self.shards[e.shard];
        Ok(TensorView { name: key, shard: &shard.name, dtype: e.dtype, shape: &e.shape, bytes: &shard.map[e.start..e.end] })
    }

    /// A BF16/F32 tensor widened to f32, with its shape checked.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        let v = self.tensor(name)?;
        if v.shape != shape {
            return Err(CheckpointError::Tensor { name: name.into(), msg: format!("shape {:?} in {}, expected {:?}", v.shape, v.shard, shape) });
        }
        v.to_f32()
    }

    /// The first `n` entries of a 1-D tensor (for `A_log`, stored padded to head_dim).
    pub fn f32_prefix(&self, name: &str, n: usize) -> Result<Vec<f32>, CheckpointError> {
        let v = self.tensor(name)?;
        if v.shape.len() != 1 || v.shape[0] < n {
            return Err(CheckpointError::Tensor { name: name.into(), msg: format!("shape {:?} in {} holds fewer than {n} entries", v.shape, v.shard) });
        }
        let mut all = v.to_f32()?;
        all.truncate(n);
        Ok(all)
    }

    /// Zero-copy view of a routed expert's MXFP4 weight (`w` = "w1" gate, "w3" up, "w2" down).
    pub fn expert(&self, layer: usize, expert: usize, w: &str) -> Result<Mxfp4Weight<'_>, CheckpointError> {
        let packed = self.tensor(&expert_tensor(layer, expert, w, "weight_packed"))?;
        let scale = self.tensor(&expert_tensor(layer, expert, w, "weight_scale"))?;
        let [out, half] = packed.shape else {
            return Err(CheckpointError::Tensor {
                name: packed.name.to_string(),
                msg: format!("shape {:?} in {} is not 2-D [out, in/2]", packed.shape, packed.shard),
            });
        };
        Mxfp4Weight::new(packed.bytes, scale.bytes, *out, half * 2).map_err(|source| CheckpointError::Mxfp4 { name: packed.name.to_string(), source })
    }

    /// Sum of the byte sizes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.entries.values().map(|e| (e.end - e.start) as u64).sum()
    }
}
