//! Synthetic K3 models in the exact release layout (spec §6): a preset (tiny, small, medium,
//! or the real K3 dimensions) with overrides, random weights following the spec's recipe,
//! MXFP4 experts, shards by size, a tokenizer in the release format. Writing streams tensor by
//! tensor (bounded memory, tens of GB are fine) and is deterministic: the same seed gives
//! byte-identical files.
//!
//! ```no_run
//! use k3_protocol::synth::{write_model, Preset, SynthOptions};
//! let mut opts = SynthOptions::new(Preset::Tiny);
//! opts.seed = 7;
//! opts.overrides.layers = Some(5);
//! let report = write_model(std::path::Path::new("/tmp/tiny7"), &opts).unwrap();
//! let ck = k3_protocol::Checkpoint::open(&report.dir).unwrap();
//! ```

pub mod corpus;
pub mod error;
pub mod presets;
pub mod release_config;
pub mod rng;
pub mod shards;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};
use std::time::Instant;

use error::write_file;
pub use error::SynthError;
pub use presets::{build_config, default_full_attn_layers, Overrides, Preset};
pub use shards::{plan_shards, ShardPlan};
pub use tokenizer::SpecialTokens;

use crate::config::K3Config;
use crate::tensors::all_tensors;

/// Default shard size limit (data bytes per shard).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// What to write for a given config.
#[derive(Debug, Clone, PartialEq)]
pub struct WriteOptions {
    pub seed: u64,
    /// Shard size limit in data bytes (a larger single tensor gets its own shard).
    pub max_shard_bytes: u64,
    /// Show an indicatif progress bar on stderr.
    pub progress: bool,
    /// Write `tiktoken.model` and `tokenizer_config.json`.
    pub tokenizer: bool,
    /// Write the weights (shards and index). `false`: config (and tokenizer) only.
    pub weights: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions { seed: 0, max_shard_bytes: DEFAULT_MAX_SHARD_BYTES, progress: false, tokenizer: true, weights: true }
    }
}

/// A preset, its overrides, and how to write it.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthOptions {
    pub preset: Preset,
    pub seed: u64,
    pub overrides: Overrides,
    pub max_shard_bytes: u64,
    pub progress: bool,
    pub tokenizer: bool,
    pub weights: bool,
}

impl SynthOptions {
    pub fn new(preset: Preset) -> Self {
        let w = WriteOptions::default();
        SynthOptions {
            preset,
            seed: w.seed,
            overrides: Overrides::default(),
            max_shard_bytes: w.max_shard_bytes,
            progress: w.progress,
            tokenizer: w.tokenizer,
            weights: w.weights,
        }
    }

    /// The validated config these options describe.
    pub fn config(&self) -> Result<K3Config, SynthError> {
        let cfg = build_config(self.preset, &self.overrides)?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn write_options(&self) -> WriteOptions {
        WriteOptions { seed: self.seed, max_shard_bytes: self.max_shard_bytes, progress: self.progress, tokenizer: self.tokenizer, weights: self.weights }
    }
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions::new(Preset::Tiny)
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub dir: PathBuf,
    pub config: K3Config,
    /// Shard file names (empty for a config-only write).
    pub shards: Vec<String>,
    pub tensors: usize,
    /// Tensor data bytes written (the index's `metadata.total_size`).
    pub bytes: u64,
    pub seconds: f64,
}

/// Writes the model a preset and its overrides describe into `out` (created if needed).
pub fn write_model(out: &Path, opts: &SynthOptions) -> Result<SynthReport, SynthError> {
    let cfg = opts.config()?;
    write_checkpoint(out, &cfg, &opts.write_options())
}

/// Writes a random checkpoint for any valid config (e.g. one a test modified by hand).
/// The tokenizer's special ids follow the vocabulary size (see [`tokenizer`]); the config's
/// token ids are written as given.
pub fn write_checkpoint(out: &Path, cfg: &K3Config, w: &WriteOptions) -> Result<SynthReport, SynthError> {
    cfg.validate()?;
    let t0 = Instant::now();
    std::fs::create_dir_all(out).map_err(|e| SynthError::io(out, e))?;
    let json = serde_json::to_string_pretty(&release_config::release_config_json(cfg)).expect("JSON value serialises");
    write_file(&out.join("config.json"), json.as_bytes())?;
    if w.tokenizer {
        tokenizer::write_tokenizer(out, cfg.text_config.vocab_size, cfg.text_config.max_position_embeddings)?;
    }
    let specs = all_tensors(cfg);
    let mut report = SynthReport { dir: out.to_path_buf(), config: cfg.clone(), shards: Vec::new(), tensors: specs.len(), bytes: 0, seconds: 0.0 };
    if w.weights {
        if w.max_shard_bytes == 0 {
            return Err(SynthError::Invalid("max_shard_bytes must be > 0".into()));
        }
        let plans = plan_shards(&specs, w.max_shard_bytes);
        tracing::info!(
            dir = %out.display(),
            tensors = specs.len(),
            shards = plans.len(),
            bytes = plans.iter().map(|p| p.data_bytes).sum::<u64>(),
            "writing synthetic checkpoint"
        );
        report.bytes = shards::write_shards(out, &specs, &plans, w.seed, w.progress)?;
        // The index goes last: a checkpoint interrupted mid-write does not look complete.
        let index = out.join(crate::checkpoint::writer::INDEX_FILE);
        crate::checkpoint::writer::write_index(out, &shards::weight_map(&specs, &plans), report.bytes).map_err(|e| SynthError::io(&index, e))?;
        report.shards = plans.into_iter().map(|p| p.file).collect();
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}
