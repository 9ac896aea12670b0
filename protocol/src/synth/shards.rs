//! Streaming safetensors shards. The tensor list is planned first (shard boundaries by a size
//! limit, each shard's header with its data offsets), so every shard's header is written
//! before its data; then the tensors are generated batch by batch on the rayon pool and written
//! in order by one writer thread through [`crate::checkpoint::writer::ShardWriter`]. Memory
//! stays bounded by a few batches, whatever the model size.

use std::collections::BTreeMap;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;

use super::weights::{self, Unit};
use super::SynthError;
use crate::checkpoint::writer::{shard_file_name, ShardWriter};
use crate::tensors::TensorSpec;

/// Output bytes per generation batch: 8 MiB per rayon thread, at least 32 MiB (the pipeline
/// holds at most about three batches, so memory stays near 100 MB on a small machine).
fn batch_bytes() -> usize {
    (rayon::current_num_threads() * (8 << 20)).max(32 << 20)
}
/// Generated pieces `(tensor index, bytes)` of a batch of units, in file order.
type Batch = Vec<Vec<(usize, Vec<u8>)>>;

/// Units per batch at most.
const BATCH_UNITS: usize = 512;

/// One planned shard: which tensors it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardPlan {
    pub file: String,
    /// Tensors `first..end` of the planned list.
    pub first: usize,
    pub end: usize,
    pub data_bytes: u64,
}

/// Splits the tensor list into shards of at most `max_bytes` of data each (a tensor larger than
/// the limit gets a shard of its own).
pub fn plan_shards(specs: &[TensorSpec], max_bytes: u64) -> Vec<ShardPlan> {
    let mut ranges = Vec::new();
    let mut first = 0;
    let mut bytes = 0u64;
    for (i, s) in specs.iter().enumerate() {
        let b = s.nbytes() as u64;
        if i > first && bytes + b > max_bytes {
            ranges.push((first, i, bytes));
            first = i;
            bytes = 0;
        }
        bytes += b;
    }
    if first < specs.len() {
        ranges.push((first, specs.len(), bytes));
    }
    let n = ranges.len();
    ranges.into_iter().enumerate().map(|(k, (first, end, data_bytes))| ShardPlan { file: shard_file_name(k, n), first, end, data_bytes }).collect()
}

/// The index's weight map of a plan (every tensor's shard file).
pub fn weight_map(specs: &[TensorSpec], plans: &[ShardPlan]) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for p in plans {
        for s in &specs[p.first..p.end] {
            map.insert(s.name.clone(), p.file.clone());
        }
    }
    map
}

fn progress_bar(total: u64, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}").expect("valid template"),
    );
    pb
}

/// The writer side: receives generated pieces in file order and appends them to the shards.
fn write_pieces(dir: &Path, specs: &[TensorSpec], plans: &[ShardPlan], rx: std::sync::mpsc::Receiver<Batch>, pb: &ProgressBar) -> Result<(), SynthError> {
    let mut shard_of = vec![0usize; specs.len()];
    for (k, p) in plans.iter().enumerate() {
        shard_of[p.first..p.end].iter_mut().for_each(|x| *x = k);
    }
    let mut cur: Option<(usize, ShardWriter)> = None;
    // Flushed, not fsynced: these are test models, and the page cache keeps writing fast.
    let finish = |w: ShardWriter| -> Result<(), SynthError> {
        let path = w.path().to_path_buf();
        w.finish(false).map(drop).map_err(|e| SynthError::io(&path, e))
    };
    for batch in rx {
        for pieces in batch {
            for (spec, bytes) in pieces {
                let k = shard_of[spec];
                if cur.as_ref().map(|c| c.0) != Some(k) {
                    if let Some((_, w)) = cur.take() {
                        finish(w)?;
                    }
                    let path = dir.join(&plans[k].file);
                    pb.set_message(plans[k].file.clone());
                    let w = ShardWriter::create(&path, &specs[plans[k].first..plans[k].end]).map_err(|e| SynthError::io(&path, e))?;
                    cur = Some((k, w));
                }
                let (_, w) = cur.as_mut().expect("opened above");
                w.write(&bytes).map_err(|e| SynthError::io(&dir.join(&plans[k].file), e))?;
                pb.inc(bytes.len() as u64);
            }
        }
    }
    if let Some((_, w)) = cur.take() {
        finish(w)?;
    }
    Ok(())
}

/// Generates and writes every shard of the plan. Returns the number of data bytes written.
pub fn write_shards(dir: &Path, specs: &[TensorSpec], plans: &[ShardPlan], seed: u64, show_progress: bool) -> Result<u64, SynthError> {
    let total: u64 = plans.iter().map(|p| p.data_bytes).sum();
    let pb = progress_bar(total, show_progress);
    let units = weights::units(specs);
    // Batches of consecutive units, bounded in bytes and count.
    let batch_limit = batch_bytes();
    let mut batches: Vec<std::ops::Range<usize>> = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, u) in units.iter().enumerate() {
        let b = weights::unit_bytes(specs, u);
        if i > start && (bytes + b > batch_limit || i - start >= BATCH_UNITS) {
            batches.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += b;
    }
    if start < units.len() {
        batches.push(start..units.len());
    }
    let (tx, rx) = std::sync::mpsc::sync_channel::<Batch>(1);
    let result = std::thread::scope(|scope| {
        let writer = scope.spawn(|| write_pieces(dir, specs, plans, rx, &pb));
        for r in batches {
            let done: Batch = units[r].par_iter().map(|u: &Unit| weights::generate(specs, seed, u)).collect();
            if tx.send(done).is_err() {
                break; // the writer failed; its error is reported below
            }
        }
        drop(tx);
        writer.join().unwrap_or_else(|_| Err(SynthError::Invalid("the shard writer thread panicked".into())))
    });
    pb.finish_and_clear();
    result.map(|_| total)
}
