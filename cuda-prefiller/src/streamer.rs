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

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::sys::CUdeviceptr;
use k3_protocol::checkpoint::Checkpoint;

use crate::cuda::gpu::Event;
use crate::cuda::{Gpu, PinnedBuf};
use crate::stream_plan::SlotCopy;

/// Where weight bytes come from.
pub trait WeightSource: Send + Sync {
    /// Copies `out.len()` bytes of region `src` at `offset` into `out`. With [`WeightSource::align`]
    /// above 1, `offset`, `out.len()` and the address of `out` are multiples of it and the read
    /// may stop at the end of the region (the bytes past it are left as they were).
    fn read(&self, src: usize, offset: u64, out: &mut [u8]) -> Result<()>;
    /// The address of `len` bytes of region `src` at `offset` when they sit in page-locked
    /// memory the GPU can read directly (then no staging copy is needed).
    fn pinned(&self, _src: usize, _offset: u64, _len: usize) -> Option<*const u8> {
        None
    }
    /// Alignment every read needs (offset, length and destination address), 1 for none.
    fn align(&self) -> usize {
        1
    }
}

/// Where the streamer reads a checkpoint's shards from (`--pin-host`, `--direct-io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum WeightsFrom {
    /// `pread` (the page cache, or the drive on a miss) into the pinned staging buffers.
    #[default]
    PageCache,
    /// Every shard copied once into page-locked host memory when the streamer starts; the GPU
    /// copies straight from it (a machine whose RAM holds the model).
    PinHost,
    /// `O_DIRECT` reads from the drive straight into the pinned staging (no page cache).
    Direct,
}

impl WeightsFrom {
    pub fn name(self) -> &'static str {
        match self {
            WeightsFrom::PageCache => "page cache",
            WeightsFrom::PinHost => "pinned host memory",
            WeightsFrom::Direct => "O_DIRECT",
        }
    }
}

/// The shard files of a checkpoint, in order (shard index = position).
pub fn shard_paths(ck: &Checkpoint) -> Result<Vec<(String, std::path::PathBuf)>> {
    let nshards = ck.tensor_names().filter_map(|n| ck.entry(n)).map(|e| e.shard + 1).max().unwrap_or(0);
    ensure!(nshards > 0, "checkpoint {} has no shards", ck.dir().display());
    Ok((0..nshards).map(|i| (ck.shard_name(i).to_string(), ck.dir().join(ck.shard_name(i)))).collect())
}

/// `O_DIRECT` of Linux (not in std; its value differs by architecture).
#[cfg(all(target_os = "linux", any(target_arch = "aarch64", target_arch = "arm")))]
const O_DIRECT: i32 = 0o200000;
#[cfg(all(target_os = "linux", not(any(target_arch = "aarch64", target_arch = "arm"))))]
const O_DIRECT: i32 = 0o40000;

/// Alignment of `O_DIRECT` reads (covers 512-byte and 4 KiB logical blocks).
pub const DIRECT_ALIGN: usize = 4096;

/// The shard files opened with `O_DIRECT`: reads bypass the page cache and land straight in the
/// (page-aligned) pinned staging; offsets and lengths are rounded to [`DIRECT_ALIGN`].
pub struct DirectShards {
    files: Vec<(String, File)>,
}

impl DirectShards {
    #[cfg(target_os = "linux")]
    pub fn open(ck: &Checkpoint) -> Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut files = Vec::new();
        for (name, path) in shard_paths(ck)? {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(O_DIRECT)
                .open(&path)
                .with_context(|| format!("opening shard {} with O_DIRECT (does its file system support direct I/O? tmpfs does not)", path.display()))?;
            files.push((name, f));
        }
        Ok(DirectShards { files })
    }
    #[cfg(not(target_os = "linux"))]
    pub fn open(_ck: &Checkpoint) -> Result<Self> {
        bail!("O_DIRECT reads are implemented for Linux only")
    }
}

impl WeightSource for DirectShards {
    fn read(&self, src: usize, offset: u64, out: &mut [u8]) -> Result<()> {
        let (name, f) = self.files.get(src).ok_or_else(|| anyhow!("no shard {src}"))?;
        let a = DIRECT_ALIGN;
        ensure!(
            (offset as usize).is_multiple_of(a) && out.len().is_multiple_of(a) && (out.as_ptr() as usize).is_multiple_of(a),
            "shard {name}: O_DIRECT read of {} bytes at {offset} is not {a}-byte aligned",
            out.len()
        );
        let mut done = 0;
        while done < out.len() {
            match f.read_at(&mut out[done..], offset + done as u64) {
                Ok(0) => break, // end of the file: the rest is alignment padding
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(e).with_context(|| format!("O_DIRECT read of {} bytes at offset {} of shard {name}", out.len() - done, offset + done as u64))
                }
            }
        }
        Ok(())
    }
    fn align(&self) -> usize {
        DIRECT_ALIGN
    }
}

/// Every shard of a checkpoint copied once into page-locked host memory (`--pin-host`): the GPU
/// copies straight from it, no staging.
pub struct PinnedShards {
    shards: Vec<(String, PinnedBuf)>,
}

impl PinnedShards {
    /// Reads every shard (`readers` threads, `pread` through the page cache) into pinned memory.
    pub fn load(gpu: &Arc<Gpu>, ck: &Checkpoint, readers: usize) -> Result<Self> {
        let paths = shard_paths(ck)?;
        let mut sizes = Vec::new();
        for (_, p) in &paths {
            sizes.push(std::fs::metadata(p).with_context(|| format!("shard {}", p.display()))?.len() as usize);
        }
        let total: usize = sizes.iter().sum();
        let bar = indicatif::ProgressBar::new(total as u64).with_message("pinning the checkpoint in host memory");
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} ({bytes_per_sec})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let t0 = Instant::now();
        let mut shards = Vec::new();
        for ((name, path), &len) in paths.iter().zip(&sizes) {
            let buf = gpu.pinned(len).with_context(|| format!("pinning shard {name} ({len} bytes)"))?;
            let files = ShardFiles::single(path)?;
            let piece = 64 << 20;
            let base = buf.as_mut_ptr() as usize;
            let jobs: Vec<(usize, usize)> = (0..len).step_by(piece).map(|o| (o, piece.min(len - o))).collect();
            let n = readers.clamp(1, jobs.len().max(1));
            let errs: Vec<anyhow::Error> = std::thread::scope(|sc| {
                let hs: Vec<_> = (0..n)
                    .map(|t| {
                        let (jobs, files, bar) = (&jobs, &files, &bar);
                        sc.spawn(move || -> Result<()> {
                            for &(o, l) in jobs.iter().skip(t).step_by(n) {
                                // SAFETY: each job writes a disjoint range of the pinned buffer.
                                let out = unsafe { std::slice::from_raw_parts_mut((base + o) as *mut u8, l) };
                                files.read(0, o as u64, out)?;
                                bar.inc(l as u64);
                            }
                            Ok(())
                        })
                    })
                    .collect();
                hs.into_iter().filter_map(|h| h.join().map_err(|_| anyhow!("reader thread panicked")).and_then(|r| r).err()).collect()
            });
            if let Some(e) = errs.into_iter().next() {
                return Err(e.context(format!("pinning shard {name}")));
            }
            shards.push((name.clone(), buf));
        }
        bar.finish_and_clear();
        let s = t0.elapsed().as_secs_f64();
        tracing::info!(gb = total as f64 / 1e9, seconds = s, "checkpoint pinned in host memory");
        eprintln!("--pin-host: {:.1} GB of shards read into page-locked host memory in {s:.1} s", total as f64 / 1e9);
        Ok(PinnedShards { shards })
    }
}

impl WeightSource for PinnedShards {
    fn read(&self, src: usize, offset: u64, out: &mut [u8]) -> Result<()> {
        let (name, b) = self.shards.get(src).ok_or_else(|| anyhow!("no shard {src}"))?;
        let o = offset as usize;
        ensure!(o + out.len() <= b.len(), "shard {name}: {}+{} past its {} bytes", o, out.len(), b.len());
        out.copy_from_slice(&b.as_slice()[o..o + out.len()]);
        Ok(())
    }
    fn pinned(&self, src: usize, offset: u64, len: usize) -> Option<*const u8> {
        let (_, b) = self.shards.get(src)?;
        (offset as usize + len <= b.len()).then(|| b.as_slice()[offset as usize..].as_ptr())
    }
}

/// The shard files of a checkpoint, read with `pread` (page cache or disk).
pub struct ShardFiles {
    files: Vec<(String, File)>,
}

impl ShardFiles {
    pub fn open(ck: &Checkpoint) -> Result<Self> {
        let mut files = Vec::new();
        for (name, path) in shard_paths(ck)? {
            let f = File::open(&path).with_context(|| format!("opening shard {}", path.display()))?;
            files.push((name, f));
        }
        Ok(ShardFiles { files })
    }

    /// One file.
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

/// The read rate of `source` over `ck`'s shards into page-locked memory, GB/s: `readers`
/// threads, each reading the streamer's 8 MiB sub-reads at successive offsets (the same queue
/// depth as the streamer), up to `max_bytes` in all (whole pieces only).
pub fn read_rate(gpu: &Arc<Gpu>, source: &dyn WeightSource, ck: &Checkpoint, readers: usize, max_bytes: usize) -> Result<f64> {
    let piece = 8usize << 20;
    let mut jobs: Vec<(usize, u64)> = Vec::new();
    'shards: for (i, (_, p)) in shard_paths(ck)?.iter().enumerate() {
        let len = std::fs::metadata(p).with_context(|| format!("shard {}", p.display()))?.len() as usize;
        let mut o = 0;
        while o + piece <= len {
            if (jobs.len() + 1) * piece > max_bytes {
                break 'shards;
            }
            jobs.push((i, o as u64));
            o += piece;
        }
    }
    ensure!(!jobs.is_empty(), "read rate: no whole 8 MiB piece in the shards of {}", ck.dir().display());
    let n = readers.clamp(1, jobs.len());
    let buf = gpu.pinned(n * piece)?;
    let base = buf.as_mut_ptr() as usize;
    let t0 = Instant::now();
    let errs: Vec<anyhow::Error> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|t| {
                let jobs = &jobs;
                sc.spawn(move || -> Result<()> {
                    // SAFETY: thread t owns piece t of the buffer.
                    let out = unsafe { std::slice::from_raw_parts_mut((base + t * piece) as *mut u8, piece) };
                    for &(s, o) in jobs.iter().skip(t).step_by(n) {
                        source.read(s, o, out)?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().map_err(|_| anyhow!("reader thread panicked")).and_then(|r| r).err()).collect()
    });
    if let Some(e) = errs.into_iter().next() {
        return Err(e.context("measuring the source's read rate"));
    }
    Ok((jobs.len() * piece) as f64 / 1e9 / t0.elapsed().as_secs_f64())
}

/// Pinned host → device copy rate on the copy stream, GB/s: 1 GiB copied six times, the median
/// of the last five (the first pays the mapping).
pub fn pinned_h2d_gbs(gpu: &Arc<Gpu>) -> Result<f64> {
    let n = 1usize << 30;
    let host = gpu.pinned(n)?;
    let dev = gpu.alloc_sync(n)?;
    let mut v = Vec::new();
    for i in 0..6 {
        let (e0, e1) = (gpu.event()?, gpu.event()?);
        e0.record(gpu.copy_stream())?;
        host.copy_to_device(0, n, dev.ptr, gpu.copy_stream())?;
        e1.record(gpu.copy_stream())?;
        e1.sync()?;
        if i > 0 {
            v.push(n as f64 / 1e9 / (e0.ms_to(&e1)? as f64 / 1e3));
        }
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

/// What a streamed checkpoint's source can feed the GPU, measured: the pinned H2D rate and the
/// source's own read rate into page-locked memory ([`read_rate`]; `NaN` for weights already
/// page-locked, which are not read).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FeedRates {
    pub pinned_h2d_gbs: f64,
    pub source_read_gbs: f64,
}

impl FeedRates {
    /// GB/s the weights reach the GPU at: the slower of the read and the copy.
    pub fn limit_gbs(&self) -> f64 {
        if self.source_read_gbs.is_nan() {
            self.pinned_h2d_gbs
        } else {
            self.source_read_gbs.min(self.pinned_h2d_gbs)
        }
    }

    /// Seconds `bytes` of weights take to reach the GPU at [`Self::limit_gbs`].
    pub fn seconds(&self, bytes: u64) -> f64 {
        bytes as f64 / 1e9 / self.limit_gbs()
    }
}

/// Largest single host-to-device copy the streamer issues. On the H200 neither this nor
/// [`WeightStreamer::set_copy_window`] (pieces in flight) let the compute stream's own uploads
/// overtake a queued layer on the copy engine (docs/cuda.md, session 4); since session 5 those
/// uploads do not use a copy engine ([`crate::cuda::gpu::HostCopy`]).
pub const COPY_PIECE: usize = 64 << 20;

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
    /// [`WeightStreamer::set_copy_window`].
    copy_window: Option<usize>,
}

impl WeightStreamer {
    /// `stage_bytes` per staging buffer (two are allocated, once); `readers` threads.
    pub fn new(gpu: Arc<Gpu>, stage_bytes: usize, readers: usize) -> Result<Self> {
        let t0 = Instant::now();
        let a = gpu.pinned(stage_bytes)?;
        let b = gpu.pinned(stage_bytes)?;
        tracing::info!(mib = (2 * stage_bytes) >> 20, ms = t0.elapsed().as_millis() as u64, "pinned staging allocated");
        Ok(WeightStreamer { gpu, staging: [a, b], drained: [None, None], next: 0, readers: readers.max(1), piece: 8 << 20, copy_window: None })
    }

    /// At most `pieces` copies of [`COPY_PIECE`] in flight from a page-locked source (the calling
    /// thread waits for older ones first); `None`: no limit.
    pub fn set_copy_window(&mut self, pieces: Option<usize>) {
        self.copy_window = pieces.map(|p| p.max(1));
    }

    pub fn stage_bytes(&self) -> usize {
        self.staging[0].len()
    }

    /// Moves `parts` from `src` to the device slot at `dst`. The copy stream first waits for
    /// `slot_free` (compute done with the slot's old contents). Returns an event recorded on the
    /// copy stream after the last copy: the compute stream waits on it before reading the slot.
    /// Blocks the calling thread only while filling staging buffers.
    pub fn upload(&mut self, src: &dyn WeightSource, parts: &[SlotCopy], dst: CUdeviceptr, slot_free: Option<&Event>) -> Result<(Event, UploadStats)> {
        self.gpu.bind()?;
        let copy = self.gpu.copy_stream();
        if let Some(e) = slot_free {
            e.wait_on(copy)?;
        }
        let cap = self.stage_bytes();
        let mut stats = UploadStats::default();
        // page-locked sources: DMA straight from them
        if parts.iter().all(|p| src.pinned(p.src, p.offset, p.len).is_some()) {
            let mut in_flight: std::collections::VecDeque<Event> = std::collections::VecDeque::new();
            for p in parts {
                let ptr = src.pinned(p.src, p.offset, p.len).expect("checked above");
                for o in (0..p.len).step_by(COPY_PIECE) {
                    let n = COPY_PIECE.min(p.len - o);
                    if let Some(w) = self.copy_window {
                        while in_flight.len() >= w {
                            let t0 = Instant::now();
                            in_flight.pop_front().expect("non-empty").sync()?;
                            stats.stall_s += t0.elapsed().as_secs_f64();
                        }
                    }
                    // SAFETY: `pinned` vouches for a page-locked range; the source keeps it alive
                    // and unchanged for the streamer's lifetime.
                    unsafe { self.gpu.htod_async_raw(dst + (p.dst + o) as u64, ptr.add(o), n, copy)? };
                    if self.copy_window.is_some() {
                        let e = self.gpu.event()?;
                        e.record(copy)?;
                        in_flight.push_back(e);
                    }
                }
                stats.bytes += p.len;
            }
            let done = self.gpu.event()?;
            done.record(copy)?;
            return Ok((done, stats));
        }
        // Greedy packing of parts (split where larger than a staging buffer) into stages. With
        // an aligned source (O_DIRECT) each piece is read as its aligned cover straight into the
        // staging, at a staging offset of the same alignment; the DMA takes the piece's bytes.
        let al = src.align().max(1);
        ensure!(cap > 2 * al, "staging buffer of {cap} bytes is too small for {al}-byte aligned reads");
        let max_piece = if al > 1 { cap - 2 * al } else { cap };
        // (src, off, len, dst, part idx, aligned read offset, aligned read length)
        let mut pieces: Vec<(usize, u64, usize, usize, usize, u64, usize)> = Vec::new();
        for (pi, p) in parts.iter().enumerate() {
            let mut done = 0;
            while done < p.len {
                let n = (p.len - done).min(max_piece);
                let off = p.offset + done as u64;
                let ro = off / al as u64 * al as u64;
                let rl = ((off - ro) as usize + n).next_multiple_of(al);
                pieces.push((p.src, off, n, p.dst + done, pi, ro, rl));
                done += n;
            }
        }
        let mut i = 0;
        while i < pieces.len() {
            // the pieces that fit in this stage (by their aligned read length)
            let mut used = 0;
            let mut j = i;
            while j < pieces.len() && used + pieces[j].6 <= cap {
                used += pieces[j].6;
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
            // fill: split every piece's read into reader-sized sub-reads and spread them over the threads
            let base = self.staging[slot].as_mut_ptr() as usize;
            let mut jobs: Vec<(usize, u64, usize, usize, usize)> = Vec::new(); // (src, off, len, stage off, part)
            let mut soff = 0;
            for &(s, _, _, _, pi, ro, rl) in &pieces[i..j] {
                let mut k = 0;
                while k < rl {
                    let n = (rl - k).min(self.piece);
                    jobs.push((s, ro + k as u64, n, soff + k, pi));
                    k += n;
                }
                soff += rl;
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
            for &(_, off, len, d, _, ro, rl) in &pieces[i..j] {
                let at = soff + (off - ro) as usize;
                for o in (0..len).step_by(COPY_PIECE) {
                    self.staging[slot].copy_to_device(at + o, COPY_PIECE.min(len - o), dst + (d + o) as u64, copy)?;
                }
                soff += rl;
                stats.bytes += len;
            }
            let ev = self.gpu.event()?;
            ev.record(copy)?;
            self.drained[slot] = Some(ev);
            i = j;
        }
        let done = self.gpu.event()?;
        done.record(copy)?;
        Ok((done, stats))
    }
}

// ---- the executor's streamed weights ---------------------------------------------------------

/// Settings of [`StreamedWeights`].
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// Device bytes for the weight slots; `None`: two whole layers (the largest).
    pub vram_budget: Option<usize>,
    /// Reader threads filling the staging buffers.
    pub readers: usize,
    /// Bytes per pinned staging buffer (two are allocated; capped at the largest unit).
    pub stage_bytes: usize,
    /// At most this many routed experts per transfer unit (streams experts in chunks even when
    /// whole layers fit the budget; finer pipelining, and tests on small models).
    pub expert_chunk: Option<usize>,
    /// Where the shards are read from.
    pub weights_from: WeightsFrom,
    /// Pinned sources: at most this many 64 MiB copies in flight (`--copy-window`; `None`: all
    /// of a unit's copies are queued at once).
    pub copy_window: Option<usize>,
    /// Keep the BF16 embedding table on the device and gather each prompt's rows there (else
    /// the host gathers and uploads them; the memory plan's choice).
    pub embed_on_device: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            vram_budget: None,
            readers: default_readers(),
            stage_bytes: 256 << 20,
            expert_chunk: None,
            weights_from: WeightsFrom::PageCache,
            copy_window: None,
            embed_on_device: true,
        }
    }
}

/// Reader threads when none are given: the cores less two (the executor thread issuing the GPU
/// work and the prefetch thread keep a core each), 2 to 16.
pub fn default_readers() -> usize {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    threads.saturating_sub(2).clamp(2, 16)
}

impl StreamOptions {
    /// `--vram-budget GB` (decimal gigabytes) as bytes; errors on a non-positive value.
    pub fn budget_from_gb(gb: Option<f64>) -> Result<Option<usize>> {
        match gb {
            None => Ok(None),
            Some(g) if g.is_finite() && g > 0.0 => Ok(Some((g * 1e9) as usize)),
            Some(g) => Err(anyhow!("--vram-budget {g}: expected a positive number of GB")),
        }
    }
}

/// Timing of one layer of a streamed prompt (GPU times from events on the compute stream).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LayerStreamTime {
    pub layer: usize,
    /// Weight bytes copied for the layer.
    pub bytes: usize,
    /// Transfer units (1, or 1 + expert chunks).
    pub units: usize,
    /// Compute stream busy with the layer (waits for weights excluded), ms.
    pub compute_ms: f64,
    /// Compute stream blocked on the layer's weight copies, ms.
    pub wait_ms: f64,
    /// The executor thread blocked until the reader pool had issued the layer's copies, ms.
    pub host_wait_ms: f64,
    /// Copy stream busy with the layer's copies, ms.
    pub copy_ms: f64,
}

/// What one streamed prompt moved and waited for.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StreamStats {
    pub layers: Vec<LayerStreamTime>,
    pub bytes: usize,
    /// Σ compute / wait / host wait / copy over the layers, seconds.
    pub compute_s: f64,
    pub wait_s: f64,
    pub host_wait_s: f64,
    pub copy_s: f64,
    /// Reader-pool time filling staging buffers, and blocked on a draining one, seconds.
    pub fill_s: f64,
    pub stall_s: f64,
}

/// A model's layer weights streamed into device slots allocated once (sized by a
/// [`StreamPlan`](crate::stream_plan::StreamPlan) under the VRAM budget), through the pinned
/// staging of a [`WeightStreamer`] fed by a pool of `pread` readers. [`StreamedWeights::feed`]
/// gives one prompt's [`WeightFeed`](crate::executor::WeightFeed): while layer ℓ computes, a
/// prefetch thread reads and copies the next unit (layer ℓ+1, or the next expert chunk) on the
/// copy stream.
pub struct StreamedWeights {
    gpu: Arc<Gpu>,
    plan: Arc<crate::stream_plan::StreamPlan>,
    source: Arc<dyn WeightSource>,
    /// Where `source` reads from.
    pub weights_from: WeightsFrom,
    /// Reader threads filling the staging (the streamer's queue depth).
    readers: usize,
    /// The output head, loaded once (not per prompt).
    head: Arc<crate::model::HeadWeights<crate::cuda::CudaBackend>>,
    /// The BF16 embedding table on the device (`[vocab, hidden]`), loaded once: each prompt's
    /// rows are gathered there instead of converted and uploaded by the host. `None` for an
    /// f32 table (the host path).
    embed_table: Option<crate::cuda::DevMem>,
    /// `[ring][slot]` device addresses (ring 0: dense / whole layers, ring 1: expert chunks).
    slot_ptr: [[CUdeviceptr; 2]; 2],
    _slots: Vec<crate::cuda::DevMem>,
    /// Taken by the running prompt's prefetch thread.
    streamer: std::sync::Mutex<Option<WeightStreamer>>,
}

impl std::fmt::Debug for StreamedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamedWeights({})", self.plan.describe())
    }
}

impl StreamedWeights {
    /// Plans and allocates the slots and the staging for `model` (its checkpoint and layer plan).
    pub fn new(model: &crate::model::Model<crate::cuda::CudaBackend>, opts: &StreamOptions) -> Result<Self> {
        let gpu = model.backend.gpu.clone();
        let plan = crate::stream_plan::StreamPlan::new(&model.ck, &model.cfg, &model.plan, opts.vram_budget, opts.expert_chunk)?;
        let need = plan.slot_bytes();
        let (free, total) = gpu.mem_info()?;
        ensure!(
            need <= free,
            "weight streamer: the slots need {:.3} GB of device memory, the GPU has {:.3} of {:.3} GB free (give a smaller --vram-budget)",
            need as f64 / 1e9,
            free as f64 / 1e9,
            total as f64 / 1e9
        );
        let mut slots = Vec::new();
        let mut slot_ptr = [[0; 2]; 2];
        for (ring, bytes) in [(0, plan.dense_slot), (1, plan.expert_slot)] {
            if bytes == 0 {
                continue;
            }
            for (s, ptr) in slot_ptr[ring].iter_mut().enumerate() {
                let m = gpu.alloc_sync(bytes).with_context(|| format!("weight streamer: slot {s} of ring {ring}"))?;
                *ptr = m.ptr;
                slots.push(m);
            }
        }
        let biggest = (0..plan.units.len()).map(|u| plan.unit_bytes(u)).max().unwrap_or(0);
        let stage = opts.stage_bytes.min(biggest.next_multiple_of(1 << 20)).max(1 << 20);
        let mut streamer = WeightStreamer::new(gpu.clone(), stage, opts.readers)?;
        streamer.set_copy_window(opts.copy_window);
        let source: Arc<dyn WeightSource> = match opts.weights_from {
            WeightsFrom::PageCache => Arc::new(ShardFiles::open(&model.ck)?),
            WeightsFrom::PinHost => Arc::new(PinnedShards::load(&gpu, &model.ck, opts.readers)?),
            WeightsFrom::Direct => Arc::new(DirectShards::open(&model.ck)?),
        };
        let head = model.head()?;
        let embed_table = {
            let name = k3_protocol::tensors::text_tensor("model.embed_tokens.weight");
            let v = model.ck.tensor(&name)?;
            match v.dtype {
                k3_protocol::tensors::DType::BF16 if opts.embed_on_device => {
                    Some(model.backend.upload_bytes(v.bytes).with_context(|| format!("uploading {name}"))?)
                }
                _ => None,
            }
        };
        tracing::info!(plan = %plan.describe(), stage_mib = stage >> 20, readers = opts.readers, from = opts.weights_from.name(), "weight streamer ready");
        Ok(StreamedWeights {
            gpu,
            plan: Arc::new(plan),
            source,
            weights_from: opts.weights_from,
            readers: opts.readers,
            head,
            embed_table,
            slot_ptr,
            _slots: slots,
            streamer: std::sync::Mutex::new(Some(streamer)),
        })
    }

    pub fn plan(&self) -> &crate::stream_plan::StreamPlan {
        &self.plan
    }

    /// Measures what this checkpoint's source feeds the GPU ([`FeedRates`]): the pinned H2D
    /// rate, and the source read at the streamer's reader count over at most `probe_bytes` of
    /// `ck`'s shards (not for page-locked weights). A node predicts its weight pass from it
    /// before it has served anything; `bench` puts it in the roofline.
    pub fn measure_feed(&self, ck: &Checkpoint, probe_bytes: usize) -> Result<FeedRates> {
        let pinned_h2d_gbs = pinned_h2d_gbs(&self.gpu)?;
        let source_read_gbs = match self.weights_from {
            WeightsFrom::PinHost => f64::NAN,
            _ => read_rate(&self.gpu, &*self.source, ck, self.readers, probe_bytes)?,
        };
        Ok(FeedRates { pinned_h2d_gbs, source_read_gbs })
    }

    /// The rate a pass's weights reach the GPU, GB/s, measured the way a pass moves them (the
    /// readers filling staging while the copy engine drains it into the slots, no compute in
    /// between): the first units of a pass, at least `probe_bytes` of them (or all), and any
    /// the prefetch thread had already issued. On a page cache the read and the copy share the
    /// host's memory bandwidth, so this is below both [`FeedRates`] limits.
    pub fn feed_gbs(&self, probe_bytes: usize) -> Result<f64> {
        self.gpu.sync()?;
        let t0 = Instant::now();
        let mut feed = self.feed()?;
        let mut bytes = 0usize;
        for u in 0..self.plan.units.len() {
            if bytes >= probe_bytes {
                break;
            }
            let (got, _) = feed.take_unit(|_| true, "feed probe")?;
            ensure!(got == u, "weight streamer: unit {got} arrived, {u} expected");
            bytes += self.plan.unit_bytes(u);
            feed.release(u)?;
        }
        feed.stop()?;
        let seconds = t0.elapsed().as_secs_f64();
        // units the prefetch thread issued beyond the probe were copied by the time stop returned
        while let Ok(r) = feed.ready_rx.try_recv() {
            bytes += r.map(|r| r.stats.bytes).unwrap_or(0);
        }
        ensure!(bytes > 0 && seconds > 0.0, "weight streamer: the feed probe moved nothing");
        Ok(bytes as f64 / 1e9 / seconds)
    }

    /// Moves every unit of a prompt with no compute in between (each slot is released as soon
    /// as its copies are issued): the feed's own time for one prompt's weights, seconds.
    pub fn transfer_alone(&self) -> Result<f64> {
        self.gpu.sync()?;
        let t0 = Instant::now();
        let mut feed = self.feed()?;
        for u in 0..self.plan.units.len() {
            let (got, _) = feed.take_unit(|_| true, "transfer alone")?;
            ensure!(got == u, "weight streamer: unit {got} arrived, {u} expected");
            feed.release(u)?;
        }
        feed.stop()?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// The weight feed of one prompt; starts copying layer 0 at once. One prompt at a time.
    pub fn feed(&self) -> Result<StreamFeed<'_>> {
        self.feed_for(1)
    }

    /// The weight feed of one pass whose latent-MoE layers take their experts in `windows`
    /// expert windows (with experts in chunks, each window streams them again:
    /// [`StreamPlan::with_expert_passes`](crate::stream_plan::StreamPlan::with_expert_passes)).
    pub fn feed_for(&self, windows: usize) -> Result<StreamFeed<'_>> {
        let streamer = self
            .streamer
            .lock()
            .map_err(|_| anyhow!("weight streamer: lock poisoned"))?
            .take()
            .ok_or_else(|| anyhow!("weight streamer: another prompt is using it"))?;
        let plan = if windows > 1 && !self.plan.whole_layers { Arc::new(self.plan.with_expert_passes(windows)) } else { self.plan.clone() };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<Ready>>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, Event)>();
        let (gpu, source, slot_ptr) = (self.gpu.clone(), self.source.clone(), self.slot_ptr);
        let thread_plan = plan.clone();
        let thread = std::thread::Builder::new()
            .name("weight-prefetch".into())
            .spawn(move || prefetch(streamer, gpu, thread_plan, source, slot_ptr, ready_tx, done_rx))
            .context("weight streamer: starting the prefetch thread")?;
        Ok(StreamFeed {
            sw: self,
            plan,
            next: 0,
            ready_rx,
            done_tx: Some(done_tx),
            thread: Some(thread),
            marks: Vec::new(),
            layer_end: Vec::new(),
            unit_done: Vec::new(),
        })
    }
}

/// A unit's copies, issued.
struct Ready {
    unit: usize,
    /// Copy stream: after the slot became free / after the last copy.
    start: Event,
    ready: Event,
    stats: UploadStats,
}

/// The prefetch thread: uploads the units in order, each after the compute that last read its
/// slot (the executor sends those events); hands the streamer back at the end.
fn prefetch(
    mut streamer: WeightStreamer,
    gpu: Arc<Gpu>,
    plan: Arc<crate::stream_plan::StreamPlan>,
    source: Arc<dyn WeightSource>,
    slot_ptr: [[CUdeviceptr; 2]; 2],
    ready_tx: std::sync::mpsc::Sender<Result<Ready>>,
    done_rx: std::sync::mpsc::Receiver<(usize, Event)>,
) -> WeightStreamer {
    let mut done: std::collections::HashMap<usize, Event> = std::collections::HashMap::new();
    for u in 0..plan.units.len() {
        let free = match plan.prev_in_slot[u] {
            None => None,
            Some(v) => loop {
                if let Some(e) = done.remove(&v) {
                    break Some(e);
                }
                match done_rx.recv() {
                    Ok((i, e)) => {
                        done.insert(i, e);
                    }
                    // the prompt ended (or failed): nothing more to copy
                    Err(_) => return streamer,
                }
            },
        };
        let unit = plan.units[u];
        let res = (|| -> Result<Ready> {
            gpu.bind()?;
            let copy = gpu.copy_stream();
            if let Some(e) = &free {
                e.wait_on(copy)?;
            }
            let start = gpu.event()?;
            start.record(copy)?;
            let parts = plan.copies(u)?;
            let (ready, stats) = streamer.upload(&*source, &parts, slot_ptr[unit.ring()][plan.slot[u]], None)?;
            Ok(Ready { unit: u, start, ready, stats })
        })()
        .with_context(|| format!("weight streamer: copying {unit:?}"));
        let failed = res.is_err();
        if ready_tx.send(res).is_err() || failed {
            return streamer;
        }
    }
    streamer
}

/// Events of one consumed unit.
struct UnitMarks {
    unit: usize,
    /// Compute stream before / after waiting for the unit's copies.
    e0: Event,
    e1: Event,
    host_wait_s: f64,
    start: Event,
    ready: Event,
    stats: UploadStats,
}

/// One prompt's streamed weights (see [`StreamedWeights::feed`]). Call [`StreamFeed::finish`]
/// after the prefill for the timing; dropping it (also after an error) waits for the GPU and
/// stops the prefetch thread.
pub struct StreamFeed<'a> {
    sw: &'a StreamedWeights,
    /// This pass's units (the streamer's plan, expert units repeated per window).
    plan: Arc<crate::stream_plan::StreamPlan>,
    next: usize,
    ready_rx: std::sync::mpsc::Receiver<Result<Ready>>,
    done_tx: Option<std::sync::mpsc::Sender<(usize, Event)>>,
    thread: Option<std::thread::JoinHandle<WeightStreamer>>,
    marks: Vec<UnitMarks>,
    /// Per layer: compute stream after its last op.
    layer_end: Vec<(usize, Event)>,
    /// Units whose done event was sent (for checks).
    unit_done: Vec<usize>,
}

impl StreamFeed<'_> {
    /// Waits (GPU side) for the next unit's copies, which must be `want`.
    fn take_unit(&mut self, want: impl Fn(&crate::stream_plan::Unit) -> bool, what: &str) -> Result<(usize, crate::stream_plan::Unit)> {
        let plan = &self.plan;
        let u = self.next;
        let unit = *plan.units.get(u).ok_or_else(|| anyhow!("weight streamer: {what} requested after the last unit"))?;
        ensure!(want(&unit), "weight streamer: {what} requested, but the next unit is {unit:?} (layers must be taken in order)");
        let t0 = Instant::now();
        let r = self.ready_rx.recv().map_err(|_| anyhow!("weight streamer: the prefetch thread stopped before {unit:?}"))??;
        let host_wait_s = t0.elapsed().as_secs_f64();
        ensure!(r.unit == u, "weight streamer: unit {} arrived, {u} expected", r.unit);
        let g = &self.sw.gpu;
        g.bind()?;
        crate::cuda::profile::begin(g, "(waiting for weights)")?;
        let e0 = g.event()?;
        e0.record(g.stream())?;
        r.ready.wait_on(g.stream())?;
        let e1 = g.event()?;
        e1.record(g.stream())?;
        self.marks.push(UnitMarks { unit: u, e0, e1, host_wait_s, start: r.start, ready: r.ready, stats: r.stats });
        self.next += 1;
        Ok((u, unit))
    }

    /// Records on the compute stream that unit `u`'s slot is no longer read after this point;
    /// returns a second event at the same point (for timing).
    fn release(&mut self, u: usize) -> Result<Event> {
        let g = &self.sw.gpu;
        let e = g.event()?;
        e.record(g.stream())?;
        let mark = g.event()?;
        mark.record(g.stream())?;
        if let Some(tx) = &self.done_tx {
            // the prefetch thread may have finished (nothing left to copy): fine
            let _ = tx.send((u, e));
        }
        self.unit_done.push(u);
        Ok(mark)
    }

    /// Waits for the GPU and the prefetch thread; returns the per-layer timing.
    pub fn finish(mut self) -> Result<StreamStats> {
        self.stop()?;
        let plan = &self.plan;
        let mut layers: Vec<LayerStreamTime> = Vec::new();
        let mut st = StreamStats::default();
        for (l, end) in &self.layer_end {
            let mut t = LayerStreamTime { layer: *l, ..Default::default() };
            let mut span_ms = 0.0;
            for m in self.marks.iter().filter(|m| plan.units[m.unit].layer() == *l) {
                t.units += 1;
                t.bytes += m.stats.bytes;
                t.wait_ms += m.e0.ms_to(&m.e1)? as f64;
                t.host_wait_ms += m.host_wait_s * 1e3;
                t.copy_ms += m.start.ms_to(&m.ready)? as f64;
                st.fill_s += m.stats.fill_s;
                st.stall_s += m.stats.stall_s;
                if let crate::stream_plan::Unit::Dense { .. } = plan.units[m.unit] {
                    span_ms = m.e1.ms_to(end)? as f64;
                }
            }
            // expert waits lie inside the layer's span
            let inner_wait: f64 = self
                .marks
                .iter()
                .filter(|m| plan.units[m.unit].layer() == *l && matches!(plan.units[m.unit], crate::stream_plan::Unit::Experts { .. }))
                .map(|m| m.e0.ms_to(&m.e1).map(|x| x as f64))
                .sum::<Result<f64>>()?;
            t.compute_ms = span_ms - inner_wait;
            st.bytes += t.bytes;
            st.compute_s += t.compute_ms / 1e3;
            st.wait_s += t.wait_ms / 1e3;
            st.host_wait_s += t.host_wait_ms / 1e3;
            st.copy_s += t.copy_ms / 1e3;
            layers.push(t);
        }
        st.layers = layers;
        Ok(st)
    }

    /// Stops the prefetch thread (it ends at its next wait for a free slot), waits for both
    /// streams and takes the streamer back.
    fn stop(&mut self) -> Result<()> {
        self.done_tx = None;
        // every slot-free event the prefetch thread may still wait on is recorded: this completes them
        let mut synced = self.sw.gpu.sync();
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(streamer) => {
                    if let Ok(mut g) = self.sw.streamer.lock() {
                        *g = Some(streamer);
                    }
                }
                Err(_) => tracing::error!("weight streamer: the prefetch thread panicked; streaming is unavailable from now on"),
            }
        }
        synced = synced.and_then(|_| self.sw.gpu.sync_copy());
        synced
    }
}

impl Drop for StreamFeed<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!("weight streamer: {e:#}");
        }
    }
}

impl crate::executor::WeightFeed<crate::cuda::CudaBackend> for StreamFeed<'_> {
    fn layer(&mut self, model: &crate::model::Model<crate::cuda::CudaBackend>, l: usize) -> Result<Arc<crate::model::LayerWeights<crate::cuda::CudaBackend>>> {
        use crate::stream_plan::Unit;
        let (u, unit) = self.take_unit(|x| matches!(x, Unit::Dense { layer, .. } if *layer == l), &format!("layer {l}"))?;
        let Unit::Dense { with_experts, .. } = unit else { unreachable!("checked by take_unit") };
        let plan = self.plan.clone();
        let img = plan.image_of(l)?;
        let base = self.sw.slot_ptr[0][plan.slot[u]];
        let b = &*model.backend;
        let gpu = &self.sw.gpu;
        let spec = *model.plan.get(l).ok_or_else(|| anyhow!("layer {l} does not exist"))?;
        let experts = if with_experts {
            let layout = plan.expert_layout.ok_or_else(|| anyhow!("layer {l}: no expert layout"))?;
            let n = img.experts.len();
            let arena = crate::cuda::DevMem::borrowed(gpu.clone(), base + img.dense_bytes as u64, n * layout.stride);
            Some(crate::cuda::backend::CudaExperts { arena, n, layout })
        } else {
            None
        };
        let mut i = 0;
        let w = crate::model::LayerWeights::assemble(&model.cfg, spec, experts, |t| {
            let s =
                img.tensors.get(i).filter(|s| s.name == t.name).ok_or_else(|| anyhow!("layer {l}: tensor {} is not where the stream plan put it", t.name))?;
            i += 1;
            let view = crate::cuda::DevMem::borrowed(gpu.clone(), base + s.off as u64, s.bytes);
            b.dense_from_device(&s.name, s.dtype, s.rows, s.cols, view)
        })?;
        Ok(Arc::new(w))
    }

    fn experts_in_chunks(
        &mut self,
        model: &crate::model::Model<crate::cuda::CudaBackend>,
        l: usize,
        inputs: &[(&crate::cuda::backend::CudaBuf, &crate::backend::Routing)],
    ) -> Result<Vec<crate::cuda::backend::CudaBuf>> {
        use crate::stream_plan::Unit;
        let b = &*model.backend;
        let plan_s = self.plan.clone();
        let layout = plan_s.expert_layout.ok_or_else(|| anyhow!("layer {l}: no expert layout"))?;
        let n = plan_s.image_of(l)?.experts.len();
        crate::cuda::profile::begin(&b.gpu, "MoE routing, grouping, combine")?;
        let plans = b.moe_plans_by_k(inputs, n, &layout)?;
        let mut covered = 0;
        while covered < n {
            let (u, unit) = self.take_unit(|x| matches!(x, Unit::Experts { layer, .. } if *layer == l), &format!("layer {l} experts from {covered}"))?;
            let Unit::Experts { lo, hi, .. } = unit else { unreachable!("checked by take_unit") };
            ensure!(lo == covered, "weight streamer: layer {l} experts {lo}..{hi} arrived, {covered}.. expected");
            let wbase = self.sw.slot_ptr[1][plan_s.slot[u]];
            crate::cuda::profile::begin(&b.gpu, "routed experts")?;
            for (_, plan) in &plans {
                b.moe_run_chunk(plan, &layout, wbase, lo, hi, model.dims.situ, None)?;
            }
            self.release(u)?;
            covered = hi;
        }
        crate::cuda::profile::begin(&b.gpu, "MoE routing, grouping, combine")?;
        b.moe_outputs_by_k(plans, inputs, layout.latent)
    }

    fn embed(&mut self, model: &crate::model::Model<crate::cuda::CudaBackend>, ids: &[u32]) -> Result<Option<crate::cuda::backend::CudaBuf>> {
        let Some(table) = &self.sw.embed_table else { return Ok(None) };
        let b = &*model.backend;
        let (h, vocab) = (model.dims.hidden, model.dims.vocab);
        ensure!(table.bytes == vocab * h * 2, "embedding table of {} bytes for [{vocab}, {h}] bf16", table.bytes);
        crate::cuda::profile::begin(&b.gpu, "embedding gather")?;
        let idx: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        ensure!(idx.iter().all(|&i| i >= 0 && (i as usize) < vocab), "embedding: a token id is outside the vocabulary (size {vocab})");
        let ids_d = b.upload_bytes(bytemuck::cast_slice(&idx))?;
        let out = b.empty(ids.len(), h)?;
        crate::cuda::kernels::embed_rows(&b.gpu, table.ptr, ids_d.ptr, out.ptr(), ids.len(), h)?;
        Ok(Some(out))
    }

    fn head(&mut self, _model: &crate::model::Model<crate::cuda::CudaBackend>) -> Result<Arc<crate::model::HeadWeights<crate::cuda::CudaBackend>>> {
        Ok(self.sw.head.clone())
    }

    fn layer_done(&mut self, _model: &crate::model::Model<crate::cuda::CudaBackend>, l: usize) -> Result<()> {
        use crate::stream_plan::Unit;
        let plan = self.plan.clone();
        let u = (0..self.next)
            .rev()
            .find(|&u| matches!(plan.units[u], Unit::Dense { layer, .. } if layer == l))
            .ok_or_else(|| anyhow!("weight streamer: layer {l} finished before it was taken"))?;
        ensure!(!self.unit_done.contains(&u), "weight streamer: layer {l} finished twice");
        let end = self.release(u)?;
        self.layer_end.push((l, end));
        Ok(())
    }
}

/// Streamed weights for `model` when its backend is CUDA; an error names the backend otherwise.
pub fn streamed_weights_for<B: crate::backend::Backend + 'static>(model: &crate::model::Model<B>, opts: &StreamOptions) -> Result<StreamedWeights> {
    match crate::cuda::cuda_model(model) {
        Some(m) => StreamedWeights::new(m, opts),
        None => bail!("weight streaming needs the CUDA backend (this model runs on {})", model.backend.name()),
    }
}

/// One prefill with the streamed weights when `sw` is given (the model's backend must then be
/// CUDA), else with the model's own weights ([`crate::executor::prefill`]); also returns the
/// streaming timing. A weight pass of one request ([`prefill_many_maybe_streamed`]).
pub fn prefill_maybe_streamed<B: crate::backend::Backend + 'static>(
    model: &crate::model::Model<B>,
    sw: Option<&StreamedWeights>,
    state: &mut k3_protocol::handoff::HandoffState,
    input: crate::executor::PrefillInput<'_>,
    opts: &crate::executor::ExecOptions,
    mut on_layer: impl FnMut(crate::executor::LayerEvent<'_>) -> Result<()>,
) -> Result<(crate::executor::PrefillOutput, Option<StreamStats>)> {
    let mut reqs = [crate::executor::PassRequest { state, input }];
    let (mut outs, stats) = prefill_many_maybe_streamed(model, sw, None, &mut reqs, opts, |_, ev| on_layer(ev))?;
    Ok((outs.pop().expect("one result per request")?, stats))
}

/// One shared weight pass over `reqs` ([`crate::executor::prefill_many_with`]): each layer's
/// weights streamed once when `sw` is given (the model's backend must then be CUDA), else the
/// model's own, and read no faster than the emulated source of `pace` when given
/// ([`crate::source_pace`]); also returns the pass's streaming timing (`None` when every request
/// dropped out before the pass ended, or without streaming).
pub fn prefill_many_maybe_streamed<B: crate::backend::Backend + 'static>(
    model: &crate::model::Model<B>,
    sw: Option<&StreamedWeights>,
    pace: Option<&crate::source_pace::SourcePass>,
    reqs: &mut [crate::executor::PassRequest<'_, '_>],
    opts: &crate::executor::ExecOptions,
    on_layer: impl FnMut(usize, crate::executor::LayerEvent<'_>) -> Result<()>,
) -> Result<(Vec<Result<crate::executor::PrefillOutput>>, Option<StreamStats>)> {
    use crate::source_pace::PacedFeed;
    let Some(sw) = sw else {
        let mut own = crate::executor::ModelWeights;
        let outs = match pace {
            Some(p) => crate::executor::prefill_many_with(model, &mut PacedFeed::new(&mut own, p), reqs, opts, on_layer)?,
            None => crate::executor::prefill_many_with(model, &mut own, reqs, opts, on_layer)?,
        };
        return Ok((outs, None));
    };
    let Some(m) = crate::cuda::cuda_model(model) else { bail!("weight streaming needs the CUDA backend (this model runs on {})", model.backend.name()) };
    let lens: Vec<usize> = reqs.iter().map(|r| r.input.tokens.len()).collect();
    let mut feed = sw.feed_for(crate::executor::expert_windows(&lens, opts).len())?;
    let outs = match pace {
        Some(p) => crate::executor::prefill_many_with(m, &mut PacedFeed::new(&mut feed, p), reqs, opts, on_layer)?,
        None => crate::executor::prefill_many_with(m, &mut feed, reqs, opts, on_layer)?,
    };
    if outs.iter().all(|o| o.is_err()) {
        return Ok((outs, None));
    }
    let stats = feed.finish()?;
    tracing::debug!(
        requests = outs.len(),
        gb = stats.bytes as f64 / 1e9,
        compute_s = stats.compute_s,
        wait_s = stats.wait_s,
        host_wait_s = stats.host_wait_s,
        copy_s = stats.copy_s,
        "streamed weight pass"
    );
    Ok((outs, Some(stats)))
}
