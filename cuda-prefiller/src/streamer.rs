//! The weight streamer: a layer's weights go from the checkpoint shards (read with large
//! `pread`s by a small thread pool, or from any other host source) into pinned staging buffers
//! allocated once, then to the GPU with async copies on the copy stream, so that the next
//! layer's transfer overlaps the current layer's compute on the compute stream.
//!
//! Two staging buffers alternate: while the DMA engine drains one, the reader threads fill the
//! other. A unit of transfer (a whole layer, or a chunk of a layer's experts when the layer does
//! not fit the VRAM budget) lands in a device slot; the copy stream waits for the event that
//! says the slot's previous contents are no longer read by compute.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, ensure, Context, Result};
use cudarc::driver::sys::CUdeviceptr;
use k3_protocol::checkpoint::Checkpoint;

use crate::cuda::gpu::Event;
use crate::cuda::{Gpu, PinnedBuf};

/// One contiguous piece of weight bytes to move: `len` bytes from the source's `(file, offset)`
/// (or host address) to byte `dst` of the destination slot.
#[derive(Debug, Clone)]
pub struct Part {
    /// For errors: the tensor name.
    pub name: String,
    /// Index of the source file (shard) or host region.
    pub src: usize,
    pub offset: u64,
    pub len: usize,
    pub dst: usize,
}

/// Where weight bytes come from.
pub trait WeightSource: Sync {
    /// Copies `out.len()` bytes of region `src` at `offset` into `out`.
    fn read(&self, src: usize, offset: u64, out: &mut [u8]) -> Result<()>;
    /// The address of `len` bytes of region `src` at `offset` when they sit in page-locked
    /// memory the GPU can read directly (then no staging copy is needed).
    fn pinned(&self, _src: usize, _offset: u64, _len: usize) -> Option<*const u8> {
        None
    }
}

/// The shard files of a checkpoint, read with `pread` (page cache or disk).
pub struct ShardFiles {
    files: Vec<(String, File)>,
}

impl ShardFiles {
    pub fn open(ck: &Checkpoint) -> Result<Self> {
        let mut files = Vec::new();
        let nshards = ck.tensor_names().filter_map(|n| ck.entry(n)).map(|e| e.shard + 1).max().unwrap_or(0);
        for i in 0..nshards {
            let name = ck.shard_name(i).to_string();
            let path = ck.dir().join(&name);
            let f = File::open(&path).with_context(|| format!("opening shard {}", path.display()))?;
            files.push((name, f));
        }
        ensure!(!files.is_empty(), "checkpoint {} has no shards", ck.dir().display());
        Ok(ShardFiles { files })
    }

    /// One file (tests, synthetic layer images on disk).
    pub fn single(path: &Path) -> Result<Self> {
        let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(ShardFiles { files: vec![(path.display().to_string(), f)] })
    }
}

impl WeightSource for ShardFiles {
    fn read(&self, src: usize, offset: u64, out: &mut [u8]) -> Result<()> {
        let (name, f) = self.files.get(src).ok_or_else(|| anyhow!("no shard {src}"))?;
        f.read_exact_at(out, offset).with_context(|| format!("reading {} bytes at offset {offset} of shard {name}", out.len()))
    }
}

/// Host memory regions (synthetic models; a model already in RAM). With [`HostRegions::pin`]
/// they are page-locked and the GPU copies straight from them.
pub struct HostRegions(pub Vec<Arc<Vec<u8>>>, Option<Arc<Gpu>>);

impl HostRegions {
    pub fn new(regions: Vec<Arc<Vec<u8>>>) -> Self {
        HostRegions(regions, None)
    }
    /// Page-locks every region (cuMemHostRegister); the streamer then skips the staging copy.
    /// The regions are unregistered when this is dropped.
    pub fn pin(&mut self, gpu: &Arc<Gpu>) -> Result<()> {
        for r in &self.0 {
            gpu.register_host(r.as_ptr(), r.len())?;
        }
        self.1 = Some(gpu.clone());
        Ok(())
    }
}

impl Drop for HostRegions {
    fn drop(&mut self) {
        if let Some(g) = &self.1 {
            for r in &self.0 {
                g.unregister_host(r.as_ptr());
            }
        }
    }
}

impl WeightSource for HostRegions {
    fn read(&self, src: usize, offset: u64, out: &mut [u8]) -> Result<()> {
        let r = self.0.get(src).ok_or_else(|| anyhow!("no host region {src}"))?;
        let o = offset as usize;
        ensure!(o + out.len() <= r.len(), "host region {src}: {}+{} past its {} bytes", o, out.len(), r.len());
        out.copy_from_slice(&r[o..o + out.len()]);
        Ok(())
    }
    fn pinned(&self, src: usize, offset: u64, len: usize) -> Option<*const u8> {
        let r = self.0.get(src)?;
        (self.1.is_some() && offset as usize + len <= r.len()).then(|| r[offset as usize..].as_ptr())
    }
}

/// Timing of one [`WeightStreamer::upload`].
#[derive(Debug, Clone, Copy, Default)]
pub struct UploadStats {
    pub bytes: usize,
    /// Host time spent filling staging buffers (reader threads).
    pub fill_s: f64,
    /// Host time blocked waiting for a staging buffer to drain.
    pub stall_s: f64,
}

/// Pinned double-buffered staging plus the reader pool.
pub struct WeightStreamer {
    gpu: Arc<Gpu>,
    staging: [PinnedBuf; 2],
    drained: [Option<Event>; 2],
    next: usize,
    readers: usize,
    /// Reads are split into pieces of at most this many bytes across the reader threads.
    piece: usize,
}

impl WeightStreamer {
    /// `stage_bytes` per staging buffer (two are allocated, once); `readers` threads.
    pub fn new(gpu: Arc<Gpu>, stage_bytes: usize, readers: usize) -> Result<Self> {
        let t0 = Instant::now();
        let a = gpu.pinned(stage_bytes)?;
        let b = gpu.pinned(stage_bytes)?;
        tracing::info!(mib = (2 * stage_bytes) >> 20, ms = t0.elapsed().as_millis() as u64, "pinned staging allocated");
        Ok(WeightStreamer { gpu, staging: [a, b], drained: [None, None], next: 0, readers: readers.max(1), piece: 8 << 20 })
    }

    pub fn stage_bytes(&self) -> usize {
        self.staging[0].len()
    }

    /// Moves `parts` from `src` to the device slot at `dst`. The copy stream first waits for
    /// `slot_free` (compute done with the slot's old contents). Returns an event recorded on the
    /// copy stream after the last copy: the compute stream waits on it before reading the slot.
    /// Blocks the calling thread only while filling staging buffers.
    pub fn upload(&mut self, src: &dyn WeightSource, parts: &[Part], dst: CUdeviceptr, slot_free: Option<&Event>) -> Result<(Event, UploadStats)> {
        self.gpu.bind()?;
        let copy = self.gpu.copy_stream();
        if let Some(e) = slot_free {
            e.wait_on(copy)?;
        }
        let cap = self.stage_bytes();
        let mut stats = UploadStats::default();
        // page-locked sources: DMA straight from them
        if parts.iter().all(|p| src.pinned(p.src, p.offset, p.len).is_some()) {
            for p in parts {
                let ptr = src.pinned(p.src, p.offset, p.len).expect("checked above");
                // SAFETY: `pinned` vouches for a page-locked range; HostRegions keeps it alive and
                // unchanged for the streamer's lifetime.
                unsafe { self.gpu.htod_async_raw(dst + p.dst as u64, ptr, p.len, copy)? };
                stats.bytes += p.len;
            }
            let done = self.gpu.event()?;
            done.record(copy)?;
            return Ok((done, stats));
        }
        // Greedy packing of parts (split where larger than a staging buffer) into stages.
        let mut pieces: Vec<(usize, u64, usize, usize, usize)> = Vec::new(); // (src, off, len, dst, part idx)
        for (pi, p) in parts.iter().enumerate() {
            let mut done = 0;
            while done < p.len {
                let n = (p.len - done).min(cap);
                pieces.push((p.src, p.offset + done as u64, n, p.dst + done, pi));
                done += n;
            }
        }
        let mut i = 0;
        while i < pieces.len() {
            // the pieces that fit in this stage
            let mut used = 0;
            let mut j = i;
            while j < pieces.len() && used + pieces[j].2 <= cap {
                used += pieces[j].2;
                j += 1;
            }
            let slot = self.next;
            self.next ^= 1;
            let t0 = Instant::now();
            if let Some(e) = self.drained[slot].take() {
                e.sync()?;
            }
            stats.stall_s += t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            // fill: split every piece into reader-sized sub-reads and spread them over the threads
            let base = self.staging[slot].as_mut_ptr() as usize;
            let mut jobs: Vec<(usize, u64, usize, usize, usize)> = Vec::new(); // (src, off, len, stage off, part)
            let mut soff = 0;
            for &(s, off, len, _, pi) in &pieces[i..j] {
                let mut k = 0;
                while k < len {
                    let n = (len - k).min(self.piece);
                    jobs.push((s, off + k as u64, n, soff + k, pi));
                    k += n;
                }
                soff += len;
            }
            let nthreads = self.readers.min(jobs.len()).max(1);
            let errors: Vec<anyhow::Error> = std::thread::scope(|sc| {
                let handles: Vec<_> = (0..nthreads)
                    .map(|t| {
                        let jobs = &jobs;
                        sc.spawn(move || -> Result<()> {
                            for &(s, off, len, so, pi) in jobs.iter().skip(t).step_by(nthreads) {
                                // SAFETY: each job writes a disjoint range of the staging buffer.
                                let out = unsafe { std::slice::from_raw_parts_mut((base + so) as *mut u8, len) };
                                src.read(s, off, out).with_context(|| format!("tensor {}", parts[pi].name))?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                handles.into_iter().filter_map(|h| h.join().map_err(|_| anyhow!("reader thread panicked")).and_then(|r| r).err()).collect()
            });
            if let Some(e) = errors.into_iter().next() {
                return Err(e);
            }
            stats.fill_s += t1.elapsed().as_secs_f64();
            // DMA each piece to its destination
            let mut soff = 0;
            for &(_, _, len, d, _) in &pieces[i..j] {
                self.staging[slot].copy_to_device(soff, len, dst + d as u64, copy)?;
                soff += len;
            }
            let ev = self.gpu.event()?;
            ev.record(copy)?;
            self.drained[slot] = Some(ev);
            stats.bytes += used;
            i = j;
        }
        let done = self.gpu.event()?;
        done.record(copy)?;
        Ok((done, stats))
    }
}
