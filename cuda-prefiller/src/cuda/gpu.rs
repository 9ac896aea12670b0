//! The device: context, a compute and a copy stream, device and pinned host memory, kernel
//! modules and launches. Thin and explicit on purpose: raw device pointers, stream-ordered
//! allocation, events where two streams meet.
//!
//! `CUstream`/`CUevent` handles are raw pointers to driver objects that Rust never dereferences;
//! functions taking them are safe (hence the `not_unsafe_ptr_arg_deref` allowance below).
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::nvrtc;

/// Turns a driver status into an error naming what was being done.
pub fn ck(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a static string pointer.
    let msg = unsafe {
        if sys::cuGetErrorString(r, &mut p) == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        }
    };
    Err(anyhow!("CUDA error in {what}: {msg} ({r:?})"))
}

struct Streams {
    compute: sys::CUstream,
    /// The weight streamer's host-to-device copies.
    copy: sys::CUstream,
    /// The compute stream's own host-to-device copies ([`HostCopy::Streams`] only).
    up: sys::CUstream,
    /// The compute stream's device-to-host copies ([`HostCopy::Split`], [`HostCopy::Streams`]).
    down: sys::CUstream,
}
// SAFETY: CUDA streams may be used from any thread of the process once the context is bound.
unsafe impl Send for Streams {}
unsafe impl Sync for Streams {}

#[derive(Clone, Copy)]
pub struct Func(pub sys::CUfunction);
// SAFETY: function handles are process-global and immutable.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

struct Module {
    _m: sys::CUmodule,
    funcs: HashMap<String, Func>,
}
unsafe impl Send for Module {}

/// How the compute stream's host <-> device copies ([`Gpu::htod`], [`Gpu::dtoh`],
/// [`Gpu::dtoh_start`]) run.
///
/// Measured on the H200 (docs/cuda.md, "Host copies"): a host-to-device copy on a copy stream of
/// its own still waits for every weight copy queued before it on the weight streamer's stream
/// (the embedding ids of a prompt: 351 ms, one layer's hand-off state: ~230 ms), so uploads go
/// through the SMs; the device-to-host direction carries no weight traffic, so downloads go
/// through the copy engine and are taken when their values are needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostCopy {
    /// Uploads as [`HostCopy::Kernel`], downloads as [`HostCopy::Streams`]. The default.
    #[default]
    Split,
    /// Both directions through page-locked staging buffers (a pool, reused) and
    /// `cuMemcpy{HtoD,DtoH}Async` on two copy streams of their own (one per direction, neither
    /// the weight streamer's), ordered with the compute stream by events: no SM time, an upload
    /// never blocks the host, a download blocks it only when its values are taken
    /// ([`Download::finish_into`]). `--host-copy streams` (diagnostic: the uploads queue behind
    /// the weights).
    Streams,
    /// Both directions through page-locked bounce buffers mapped into the device's address
    /// space, moved by a copy kernel on the SMs (`kernels/convert.cu` `copy_bytes`):
    /// `--host-copy kernel` (diagnostic: the former default).
    Kernel,
    /// `cuMemcpy{HtoD,DtoH}Async` from/to pageable memory on the compute stream plus a stream
    /// synchronisation (`--host-copy engine`, diagnostic: the first path).
    Engine,
}

impl HostCopy {
    /// Whether uploads run through the SM copy kernel.
    pub fn uploads_by_kernel(self) -> bool {
        matches!(self, HostCopy::Split | HostCopy::Kernel)
    }

    /// Whether downloads run on the download stream (and [`Gpu::dtoh_start`] returns before the copy).
    pub fn downloads_on_streams(self) -> bool {
        matches!(self, HostCopy::Streams | HostCopy::Split)
    }

    /// The flag value of each path (`--host-copy`).
    pub const NAMES: [(&'static str, HostCopy); 4] =
        [("split", HostCopy::Split), ("streams", HostCopy::Streams), ("kernel", HostCopy::Kernel), ("engine", HostCopy::Engine)];

    /// The flag value of this path.
    pub fn name(self) -> &'static str {
        HostCopy::NAMES.iter().find(|(_, h)| *h == self).map_or("split", |(n, _)| n)
    }
}

impl std::str::FromStr for HostCopy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match HostCopy::NAMES.iter().find(|(n, _)| *n == s) {
            Some((_, h)) => Ok(*h),
            None => bail!("unknown host copy path {s:?} (split, streams, kernel or engine)"),
        }
    }
}

impl std::fmt::Display for HostCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Page-locked host memory of the staging pool (freed with the [`Gpu`]).
struct Staged {
    ptr: *mut u8,
    bytes: usize,
}
// SAFETY: page-locked host memory owned by the pool (or by one [`Download`] while taken out).
unsafe impl Send for Staged {}

/// The staging pool of the copy-stream copies ([`HostCopy::Streams`], downloads of [`HostCopy::Split`]): idle page-locked buffers, each with the event of
/// the copy that last read it (an upload), if any.
#[derive(Default)]
struct StagingPool {
    idle: Vec<(Staged, Option<Event>)>,
}

/// Staging buffers are allocated in multiples of this (a few sizes serve every prompt length).
const STAGING_GRAIN: usize = 2 << 20;
/// Idle staging bytes above which idle buffers too small for a request are freed first.
const STAGING_KEEP: usize = 2 << 30;

/// Device memory parked in a page-locked buffer of the staging pool ([`Gpu::park`]); the
/// buffer goes back to the pool when this is dropped, once the copies that read it are done.
pub struct HostParked {
    gpu: Arc<Gpu>,
    buf: Option<Staged>,
    bytes: usize,
    /// After the copy into `buf` (download stream).
    pub copied: Arc<Event>,
    /// After the last copy out of `buf` (compute stream).
    last_read: Mutex<Option<Event>>,
}

impl HostParked {
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

impl Drop for HostParked {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let busy = match self.last_read.get_mut().ok().and_then(|e| e.take()) {
            Some(e) => Some(e),
            None => {
                // never read back: the pool may reuse the buffer only after the parking's copy
                let _ = self.copied.sync();
                None
            }
        };
        self.gpu.staging_give(buf, busy);
    }
}

/// A device-to-host copy in flight on the download stream ([`Gpu::dtoh_start`]); its values are
/// taken by [`Download::finish_into`]. The source must stay allocated and unchanged until then.
pub struct Download {
    gpu: Arc<Gpu>,
    bytes: usize,
    how: DownloadHow,
}

enum DownloadHow {
    /// Copied already (a former copy path, or nothing to copy).
    Done(Vec<u8>),
    /// On the download stream into `buf`; `done` after the copy.
    Pending { buf: Option<Staged>, done: Event },
}

impl Download {
    /// Bytes this download copies.
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Waits for the copy (host blocked only if the GPU has not reached it yet) and copies its
    /// bytes into `dst` (exactly [`Download::len`] bytes).
    pub fn finish_into(mut self, dst: &mut [u8]) -> Result<()> {
        ensure!(dst.len() == self.bytes, "download of {} bytes into {} bytes", self.bytes, dst.len());
        match &mut self.how {
            DownloadHow::Done(v) => dst.copy_from_slice(v),
            DownloadHow::Pending { buf, done } => {
                let t0 = std::time::Instant::now();
                done.sync()?;
                super::host_wait::host_blocked(self.gpu.profile, "device-to-host copy", self.bytes, t0.elapsed());
                let b = buf.take().expect("a pending download holds its buffer");
                // SAFETY: the copy of `bytes` bytes into `b` has completed (event above).
                unsafe { std::ptr::copy_nonoverlapping(b.ptr as *const u8, dst.as_mut_ptr(), self.bytes) };
                self.gpu.staging_give(b, None);
            }
        }
        Ok(())
    }
}

impl Drop for Download {
    fn drop(&mut self) {
        if let DownloadHow::Pending { buf, done } = &mut self.how {
            if let Some(b) = buf.take() {
                // not taken: the buffer goes back once the copy into it is done
                let _ = done.sync();
                self.gpu.staging_give(b, None);
            }
        }
    }
}

/// Bytes of each of the two mapped page-locked bounce buffers of the copy kernel ([`HostCopy::Kernel`], uploads of [`HostCopy::Split`]).
pub const BOUNCE_BYTES: usize = 32 << 20;

/// The two bounce buffers: host address, device address of the same pages, and the event
/// recorded after the last kernel that used each.
struct Bounce {
    bufs: Vec<(*mut u8, sys::CUdeviceptr, Event)>,
}
// SAFETY: page-locked host memory and events, used under the Gpu's mutex only.
unsafe impl Send for Bounce {}

/// One GPU: context, streams, compiled kernel modules.
pub struct Gpu {
    /// Dropped (freed) before the context (declared first).
    bounce: Mutex<Option<Bounce>>,
    staging: Mutex<StagingPool>,
    ctx: Arc<CudaContext>,
    streams: Streams,
    modules: Mutex<HashMap<String, Module>>,
    /// Nanoseconds spent compiling (or reading from the disk cache) and loading kernel modules.
    module_load_ns: std::sync::atomic::AtomicU64,
    pub name: String,
    pub cc: (i32, i32),
    pub sm_count: i32,
    pub smem_optin: i32,
    /// Bytes held by synchronous allocations ([`Gpu::alloc_sync`]) now.
    sync_bytes: std::sync::atomic::AtomicUsize,
    /// How the compute stream's host <-> device copies run (`--host-copy`).
    pub host_copy: HostCopy,
    /// `--profile`: GPU time per step ([`super::profile`]) and host time blocked on the GPU
    /// ([`super::host_wait`]) are recorded.
    pub profile: bool,
}

impl Gpu {
    /// Opens GPU 0 with the host copy path and profiling of the backend's options. Fails with a
    /// clear message when no usable GPU/driver/NVRTC/cuBLAS exists.
    pub fn open(host_copy: HostCopy, profile: bool) -> Result<Arc<Gpu>> {
        super::probe().map_err(|e| anyhow!("CUDA backend unavailable: {e}"))?;
        // Threads waiting for the GPU sleep instead of spinning, so that the weight streamer's
        // reader threads keep every core while the compute thread waits for a readback. (It did
        // not by itself fix the slower staging under the dense expert path: docs/cuda.md.) Best
        // effort: if the primary context is already active with other flags, the driver keeps those.
        // SAFETY: plain driver calls on device 0 before its primary context is retained here.
        unsafe {
            let mut dev = 0;
            if sys::cuInit(0) == sys::CUresult::CUDA_SUCCESS && sys::cuDeviceGet(&mut dev, 0) == sys::CUresult::CUDA_SUCCESS {
                let r = sys::cuDevicePrimaryCtxSetFlags_v2(dev, sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC as u32);
                if r != sys::CUresult::CUDA_SUCCESS {
                    tracing::debug!("blocking-sync scheduling not set: {r:?}");
                }
            }
        }
        let ctx = CudaContext::new(0).map_err(|e| anyhow!("cannot open GPU 0: {e}"))?;
        let name = ctx.name().unwrap_or_default();
        let cc = ctx.compute_capability().map_err(|e| anyhow!("compute capability: {e}"))?;
        let sm_count = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| anyhow!("{e}"))?;
        let smem_optin = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).map_err(|e| anyhow!("{e}"))?;
        let (mut compute, mut copy, mut up, mut down) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the context is bound to this thread by CudaContext::new.
        unsafe {
            for s in [&mut compute, &mut copy, &mut up, &mut down] {
                ck(sys::cuStreamCreate(s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "cuStreamCreate")?;
            }
            // keep freed stream-ordered memory in the pool instead of returning it at every sync
            let mut pool = std::ptr::null_mut();
            if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS {
                let mut thr: u64 = u64::MAX;
                let _ = sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut thr as *mut u64 as *mut c_void);
            }
        }
        tracing::info!(gpu = %name, sm = format!("{}{}", cc.0, cc.1), sms = sm_count, "CUDA device opened");
        Ok(Arc::new(Gpu {
            bounce: Mutex::new(None),
            staging: Mutex::new(StagingPool::default()),
            ctx,
            streams: Streams { compute, copy, up, down },
            modules: Mutex::new(HashMap::new()),
            module_load_ns: std::sync::atomic::AtomicU64::new(0),
            name,
            cc,
            sm_count,
            smem_optin,
            sync_bytes: Default::default(),
            host_copy,
            profile,
        }))
    }

    /// Binds the context to the calling thread (cheap; every entry point calls it).
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| anyhow!("cannot bind the CUDA context: {e}"))
    }

    pub fn stream(&self) -> sys::CUstream {
        self.streams.compute
    }
    pub fn copy_stream(&self) -> sys::CUstream {
        self.streams.copy
    }

    /// `sm_XY` for NVRTC.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    pub fn sync(&self) -> Result<()> {
        self.bind()?;
        let t0 = std::time::Instant::now();
        // SAFETY: valid stream handle.
        unsafe { ck(sys::cuStreamSynchronize(self.streams.compute), "synchronize compute stream")? };
        super::host_wait::host_blocked(self.profile, "compute stream synchronisation", 0, t0.elapsed());
        Ok(())
    }

    pub fn sync_copy(&self) -> Result<()> {
        self.bind()?;
        unsafe { ck(sys::cuStreamSynchronize(self.streams.copy), "synchronize copy stream") }
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut f, mut t) = (0usize, 0usize);
        unsafe { ck(sys::cuMemGetInfo_v2(&mut f, &mut t), "cuMemGetInfo")? };
        Ok((f, t))
    }

    /// Bytes an allocation could get now: free device memory plus what the stream-ordered pool
    /// holds without using (freed allocations it keeps for reuse).
    pub fn mem_available(&self) -> Result<usize> {
        let (free, _) = self.mem_info()?;
        let mut pooled = 0usize;
        // SAFETY: the context is bound (mem_info); attribute queries write one u64 each.
        unsafe {
            let mut pool = std::ptr::null_mut();
            let dev = self.ctx.cu_device();
            if sys::cuDeviceGetDefaultMemPool(&mut pool, dev) == sys::CUresult::CUDA_SUCCESS {
                let (mut reserved, mut used) = (0u64, 0u64);
                let a =
                    sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &mut reserved as *mut u64 as *mut c_void);
                let b = sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &mut used as *mut u64 as *mut c_void);
                if a == sys::CUresult::CUDA_SUCCESS && b == sys::CUresult::CUDA_SUCCESS {
                    pooled = reserved.saturating_sub(used) as usize;
                }
            }
        }
        Ok(free + pooled)
    }

    /// The stream-ordered pool's attribute `a` (bytes), 0 when it cannot be read.
    fn pool_attr(&self, a: sys::CUmemPool_attribute) -> u64 {
        let mut v = 0u64;
        // SAFETY: attribute queries on the device's default pool write one u64.
        unsafe {
            let mut pool = std::ptr::null_mut();
            if self.bind().is_ok() && sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS {
                let _ = sys::cuMemPoolGetAttribute(pool, a, &mut v as *mut u64 as *mut c_void);
            }
        }
        v
    }

    /// The allocator's high-water mark since [`Gpu::reset_memory_peak`]: the stream-ordered
    /// pool's peak bytes in use plus the synchronous allocations live now (weight slots,
    /// tables: made before a pass and held through it).
    pub fn allocated_peak(&self) -> u64 {
        self.pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH) + self.sync_bytes.load(std::sync::atomic::Ordering::Relaxed) as u64
    }

    /// The pool's reserved high-water mark (what the device had to give it) since the reset.
    pub fn reserved_peak(&self) -> u64 {
        self.pool_attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
    }

    /// Returns the pool's unused memory to the device and restarts both high-water marks.
    pub fn reset_memory_peak(&self) -> Result<()> {
        self.sync()?;
        // SAFETY: the default pool of this context's device; the attributes take a u64 zero.
        unsafe {
            let mut pool = std::ptr::null_mut();
            ck(sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()), "cuDeviceGetDefaultMemPool")?;
            ck(sys::cuMemPoolTrimTo(pool, 0), "cuMemPoolTrimTo")?;
            for a in [sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH] {
                let mut zero = 0u64;
                ck(sys::cuMemPoolSetAttribute(pool, a, &mut zero as *mut u64 as *mut c_void), "resetting the pool's high-water mark")?;
            }
        }
        Ok(())
    }

    /// Seconds this process has spent compiling and loading kernel modules (each once).
    pub fn module_load_seconds(&self) -> f64 {
        self.module_load_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9
    }

    /// A kernel function from `kernels/<module>.cu` compiled with `defines` (e.g. `["MLA_DQK=192"]`).
    pub fn func(&self, module: &str, defines: &[String], name: &str) -> Result<Func> {
        let key = format!("{module}|{}", defines.join(","));
        let mut mods = self.modules.lock().map_err(|_| anyhow!("kernel module table poisoned"))?;
        if !mods.contains_key(&key) {
            let t0 = std::time::Instant::now();
            self.bind()?;
            let image = nvrtc::compile_cached(module, defines, &self.arch())?;
            let mut m = std::ptr::null_mut();
            // SAFETY: image is a CUBIN produced by NVRTC for this device's architecture.
            unsafe { ck(sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void), &format!("loading kernels/{module}.cu"))? };
            mods.insert(key.clone(), Module { _m: m, funcs: HashMap::new() });
            self.module_load_ns.fetch_add(t0.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        let module_entry = mods.get_mut(&key).expect("inserted above");
        if let Some(f) = module_entry.funcs.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name)?;
        let mut f = std::ptr::null_mut();
        unsafe {
            ck(sys::cuModuleGetFunction(&mut f, module_entry._m, cname.as_ptr()), &format!("kernel {name} in kernels/{module}.cu"))?;
            if self.smem_optin > 48 * 1024 {
                let mut stat = 0i32;
                ck(
                    sys::cuFuncGetAttribute(&mut stat, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f),
                    "reading a kernel's static shared memory",
                )?;
                ck(
                    sys::cuFuncSetAttribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem_optin - stat),
                    &format!("raising the dynamic shared memory limit of {name}"),
                )?;
            }
        }
        module_entry.funcs.insert(name.to_string(), Func(f));
        Ok(Func(f))
    }

    /// Launches `f` on the compute stream.
    pub fn launch(&self, f: Func, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, args: &mut KArgs, what: &str) -> Result<()> {
        self.launch_on(self.streams.compute, f, grid, block, smem, args, what)
    }

    pub fn launch_on(
        &self,
        stream: sys::CUstream,
        f: Func,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut KArgs,
        what: &str,
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        if smem as i32 > self.smem_optin {
            bail!("{what}: needs {smem} bytes of shared memory, the device allows {}", self.smem_optin);
        }
        self.bind()?;
        let mut ptrs = args.ptrs();
        // SAFETY: the argument list matches the kernel signature (each call site mirrors its .cu).
        unsafe { ck(sys::cuLaunchKernel(f.0, grid.0, grid.1, grid.2, block.0, block.1, block.2, smem, stream, ptrs.as_mut_ptr(), std::ptr::null_mut()), what) }
    }

    /// Device memory, stream-ordered on the compute stream.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DevMem> {
        self.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        if bytes > 0 {
            unsafe { ck(sys::cuMemAllocAsync(&mut p, bytes, self.streams.compute), &format!("allocating {bytes} bytes of device memory"))? };
        }
        Ok(DevMem { ptr: p, bytes, gpu: self.clone(), sync_alloc: false, borrowed: false })
    }

    /// Device memory from the synchronous allocator (long-lived arenas shared by both streams).
    pub fn alloc_sync(self: &Arc<Self>, bytes: usize) -> Result<DevMem> {
        self.bind()?;
        let mut p: sys::CUdeviceptr = 0;
        if bytes > 0 {
            unsafe { ck(sys::cuMemAlloc_v2(&mut p, bytes), &format!("allocating {bytes} bytes of device memory"))? };
            self.sync_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(DevMem { ptr: p, bytes, gpu: self.clone(), sync_alloc: true, borrowed: false })
    }

    pub fn memset0(&self, m: &DevMem) -> Result<()> {
        if m.bytes == 0 {
            return Ok(());
        }
        unsafe { ck(sys::cuMemsetD8Async(m.ptr, 0, m.bytes, self.streams.compute), "cuMemsetD8Async") }
    }

    /// Host → device on the compute stream, ordered with its other work; `src` may be reused as
    /// soon as the call returns. See [`HostCopy`] for how.
    pub fn htod<T: Copy>(&self, dst: sys::CUdeviceptr, src: &[T]) -> Result<()> {
        self.bind()?;
        let n = std::mem::size_of_val(src);
        if n == 0 {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        // SAFETY: `src` is `n` initialised bytes (T: Copy, plain data).
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, n) };
        match self.host_copy {
            HostCopy::Streams => {
                let buf = self.staging_take(n)?;
                // SAFETY: the staging buffer holds at least n bytes and no copy reads it now.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.ptr, n) };
                // after the compute stream's earlier work (dst may be a stream-ordered allocation
                // or still read there), before its later work
                let issued = (|| -> Result<Event> {
                    self.order(self.streams.compute, self.streams.up)?;
                    // SAFETY: page-locked source of n bytes, kept until the event below completes.
                    unsafe { ck(sys::cuMemcpyHtoDAsync_v2(dst, buf.ptr as *const c_void, n, self.streams.up), "host-to-device copy")? };
                    let done = self.event_sync_only()?;
                    done.record(self.streams.up)?;
                    done.wait_on(self.streams.compute)?;
                    Ok(done)
                })();
                match issued {
                    Ok(done) => self.staging_give(buf, Some(done)),
                    Err(e) => {
                        // the copy may be queued: keep the buffer until the stream is idle
                        let _ = self.sync_stream(self.streams.up);
                        self.staging_give(buf, None);
                        return Err(e);
                    }
                }
            }
            HostCopy::Engine => unsafe {
                ck(sys::cuMemcpyHtoDAsync_v2(dst, bytes.as_ptr() as *const c_void, n, self.streams.compute), "host-to-device copy")?;
                ck(sys::cuStreamSynchronize(self.streams.compute), "host-to-device copy")?;
            },
            HostCopy::Kernel | HostCopy::Split => {
                let mut guard = self.bounce.lock().map_err(|_| anyhow!("bounce buffers poisoned"))?;
                let bn = self.bounce_bufs(&mut guard)?;
                for (i, o) in (0..n).step_by(BOUNCE_BYTES).enumerate() {
                    let len = BOUNCE_BYTES.min(n - o);
                    let (h, d, ev) = &bn.bufs[i % 2];
                    // the kernel that last read this buffer is done before the host overwrites it
                    ev.sync()?;
                    // SAFETY: the bounce buffer holds BOUNCE_BYTES bytes; nothing else uses it now.
                    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().add(o), *h, len) };
                    self.copy_kernel(*d, dst + o as u64, len, "host-to-device copy")?;
                    ev.record(self.streams.compute)?;
                }
            }
        }
        super::host_wait::host_blocked(self.profile, "host-to-device copy", n, t0.elapsed());
        Ok(())
    }

    /// Device → host, synchronous with respect to the compute stream. See [`HostCopy`] for how.
    pub fn dtoh<T: Copy>(&self, dst: &mut [T], src: sys::CUdeviceptr) -> Result<()> {
        self.bind()?;
        let n = std::mem::size_of_val(dst);
        if n == 0 {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        // SAFETY: `dst` is `n` bytes of plain data (T: Copy); every byte is written below.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, n) };
        match self.host_copy {
            HostCopy::Streams | HostCopy::Split => {
                let (buf, done) = self.issue_download(src, n)?;
                let r = done.sync();
                if r.is_ok() {
                    // SAFETY: the copy of n bytes into the staging buffer has completed.
                    unsafe { std::ptr::copy_nonoverlapping(buf.ptr as *const u8, out.as_mut_ptr(), n) };
                }
                self.staging_give(buf, None);
                r?;
            }
            HostCopy::Engine => unsafe {
                ck(sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr() as *mut c_void, src, n, self.streams.compute), "device-to-host copy")?;
                ck(sys::cuStreamSynchronize(self.streams.compute), "device-to-host copy")?;
            },
            HostCopy::Kernel => {
                let mut guard = self.bounce.lock().map_err(|_| anyhow!("bounce buffers poisoned"))?;
                let bn = self.bounce_bufs(&mut guard)?;
                let pieces: Vec<(usize, usize)> = (0..n).step_by(BOUNCE_BYTES).map(|o| (o, BOUNCE_BYTES.min(n - o))).collect();
                // piece i lands in buffer i % 2; piece i + 1 is copied while the host takes piece i
                let issue = |i: usize| -> Result<()> {
                    let (o, len) = pieces[i];
                    let (_, d, ev) = &bn.bufs[i % 2];
                    self.copy_kernel(src + o as u64, *d, len, "device-to-host copy")?;
                    ev.record(self.streams.compute)
                };
                issue(0)?;
                for (i, &(o, len)) in pieces.iter().enumerate() {
                    if i + 1 < pieces.len() {
                        issue(i + 1)?;
                    }
                    let (h, _, ev) = &bn.bufs[i % 2];
                    ev.sync()?;
                    // SAFETY: the kernel wrote `len` bytes at the start of this bounce buffer.
                    unsafe { std::ptr::copy_nonoverlapping(*h as *const u8, out.as_mut_ptr().add(o), len) };
                }
            }
        }
        super::host_wait::host_blocked(self.profile, "device-to-host copy", n, t0.elapsed());
        Ok(())
    }

    /// The compute stream's device → host copy of `n` bytes at `src` on the download stream,
    /// started now (after the compute stream's work so far) and taken later
    /// ([`Download::finish_into`]): the host does not wait for the GPU to get there now. With a
    /// former copy path ([`HostCopy`]) the copy is done at once.
    pub fn dtoh_start(self: &Arc<Self>, src: sys::CUdeviceptr, n: usize) -> Result<Download> {
        self.bind()?;
        if n == 0 || !self.host_copy.downloads_on_streams() {
            let mut v = vec![0u8; n];
            self.dtoh(&mut v, src)?;
            return Ok(Download { gpu: self.clone(), bytes: n, how: DownloadHow::Done(v) });
        }
        let (buf, done) = self.issue_download(src, n)?;
        Ok(Download { gpu: self.clone(), bytes: n, how: DownloadHow::Pending { buf: Some(buf), done } })
    }

    /// Parks `n` bytes of device memory at `src` in a page-locked buffer of the staging pool:
    /// the copy is queued on the download stream after the compute stream's work so far and
    /// nothing waits for it here. The caller keeps `src` allocated until [`HostParked::copied`]
    /// has completed.
    pub fn park(self: &Arc<Self>, src: sys::CUdeviceptr, n: usize) -> Result<HostParked> {
        self.bind()?;
        let (buf, done) = self.issue_download(src, n)?;
        Ok(HostParked { gpu: self.clone(), buf: Some(buf), bytes: n, copied: Arc::new(done), last_read: Mutex::new(None) })
    }

    /// Copies a parked buffer back to `dst` on the compute stream, straight from its page-locked
    /// memory (no host copy, no host wait): the compute stream first waits, on the GPU, for the
    /// parking's copy.
    pub fn unpark(&self, p: &HostParked, dst: sys::CUdeviceptr) -> Result<()> {
        self.bind()?;
        let t0 = std::time::Instant::now();
        let buf = p.buf.as_ref().context("a parked buffer without its memory")?;
        p.copied.wait_on(self.streams.compute)?;
        // page-locked memory is device-accessible (unified addressing); its device address
        let mut src: sys::CUdeviceptr = 0;
        // SAFETY: `buf` is a live cuMemHostAlloc allocation.
        unsafe { ck(sys::cuMemHostGetDevicePointer_v2(&mut src, buf.ptr as *mut c_void, 0), "device address of a parked buffer")? };
        match self.host_copy {
            HostCopy::Kernel | HostCopy::Split => self.copy_kernel(src, dst, p.bytes, "host-to-device copy (parked)")?,
            HostCopy::Streams | HostCopy::Engine => unsafe {
                // SAFETY: page-locked source of p.bytes bytes, kept until `last_read` completes.
                ck(sys::cuMemcpyHtoDAsync_v2(dst, buf.ptr as *const c_void, p.bytes, self.streams.compute), "host-to-device copy (parked)")?
            },
        }
        let read = self.event_sync_only()?;
        read.record(self.streams.compute)?;
        // a later copy on the same stream: the earlier event is implied by this one
        *p.last_read.lock().map_err(|_| anyhow!("parked buffer poisoned"))? = Some(read);
        super::host_wait::host_blocked(self.profile, "host-to-device copy (parked)", p.bytes, t0.elapsed());
        Ok(())
    }

    /// A staging buffer of at least `n` bytes with the copy of `src` into it queued on the
    /// download stream after the compute stream's work so far; the event follows the copy.
    fn issue_download(&self, src: sys::CUdeviceptr, n: usize) -> Result<(Staged, Event)> {
        let buf = self.staging_take(n)?;
        let issued = (|| -> Result<Event> {
            self.order(self.streams.compute, self.streams.down)?;
            // SAFETY: the staging buffer holds at least n bytes and is ours until given back.
            unsafe { ck(sys::cuMemcpyDtoHAsync_v2(buf.ptr as *mut c_void, src, n, self.streams.down), "device-to-host copy")? };
            let done = self.event_sync_only()?;
            done.record(self.streams.down)?;
            Ok(done)
        })();
        match issued {
            Ok(done) => Ok((buf, done)),
            Err(e) => {
                let _ = self.sync_stream(self.streams.down);
                self.staging_give(buf, None);
                Err(e)
            }
        }
    }

    /// Work queued on `to` from now on starts after the work queued on `from` so far.
    fn order(&self, from: sys::CUstream, to: sys::CUstream) -> Result<()> {
        let e = self.event_sync_only()?;
        e.record(from)?;
        e.wait_on(to)
    }

    fn sync_stream(&self, s: sys::CUstream) -> Result<()> {
        unsafe { ck(sys::cuStreamSynchronize(s), "synchronize a host-copy stream") }
    }

    /// An idle staging buffer of at least `n` bytes (the smallest that fits and whose last copy
    /// is done), else a new one; give it back with [`Gpu::staging_give`].
    fn staging_take(&self, n: usize) -> Result<Staged> {
        let mut pool = self.staging.lock().map_err(|_| anyhow!("staging pool poisoned"))?;
        let fit = pool
            .idle
            .iter()
            .enumerate()
            .filter(|(_, (b, ev))| b.bytes >= n && ev.as_ref().is_none_or(|e| e.is_done()))
            .min_by_key(|(_, (b, _))| b.bytes)
            .map(|(i, _)| i);
        if let Some(i) = fit {
            return Ok(pool.idle.swap_remove(i).0);
        }
        let held: usize = pool.idle.iter().map(|(b, _)| b.bytes).sum();
        if held > STAGING_KEEP {
            // too much idle staging: free the idle buffers too small for this request
            let (keep, free): (Vec<_>, Vec<_>) = std::mem::take(&mut pool.idle).into_iter().partition(|(b, _)| b.bytes >= n);
            pool.idle = keep;
            for (b, ev) in free {
                if let Some(e) = ev {
                    e.sync()?;
                }
                // SAFETY: allocated by cuMemHostAlloc below; no copy uses it any more.
                unsafe {
                    let _ = sys::cuMemFreeHost(b.ptr as *mut c_void);
                }
            }
        }
        drop(pool);
        let bytes = n.div_ceil(STAGING_GRAIN).max(1) * STAGING_GRAIN;
        let mut p: *mut c_void = std::ptr::null_mut();
        self.bind()?;
        // SAFETY: plain allocation of page-locked host memory.
        unsafe { ck(sys::cuMemHostAlloc(&mut p, bytes, sys::CU_MEMHOSTALLOC_PORTABLE), &format!("allocating {bytes} bytes of page-locked staging memory"))? };
        Ok(Staged { ptr: p as *mut u8, bytes })
    }

    /// Returns a staging buffer to the pool; `busy` follows the last copy that reads it.
    fn staging_give(&self, b: Staged, busy: Option<Event>) {
        match self.staging.lock() {
            Ok(mut pool) => pool.idle.push((b, busy)),
            Err(_) => {
                // the pool is gone with a panic: free the buffer once its copy is done
                if let Some(e) = busy {
                    let _ = e.sync();
                }
                unsafe {
                    let _ = sys::cuMemFreeHost(b.ptr as *mut c_void);
                }
            }
        }
    }

    /// An event for ordering and host waits only (no timing: cheaper to record).
    pub fn event_sync_only(&self) -> Result<Event> {
        let mut e = std::ptr::null_mut();
        unsafe { ck(sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32), "cuEventCreate")? };
        Ok(Event(e))
    }

    /// The bounce buffers of [`HostCopy::Kernel`], allocated at first use.
    fn bounce_bufs<'a>(&self, b: &'a mut Option<Bounce>) -> Result<&'a Bounce> {
        if b.is_none() {
            let mut bufs = Vec::new();
            for _ in 0..2 {
                let mut p: *mut c_void = std::ptr::null_mut();
                let mut d: sys::CUdeviceptr = 0;
                // SAFETY: plain allocation; the device address of mapped page-locked memory.
                unsafe {
                    ck(
                        sys::cuMemHostAlloc(&mut p, BOUNCE_BYTES, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP),
                        "allocating a mapped page-locked bounce buffer",
                    )?;
                    if let Err(e) = ck(sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0), "device address of a bounce buffer") {
                        let _ = sys::cuMemFreeHost(p);
                        return Err(e);
                    }
                }
                bufs.push((p as *mut u8, d, self.event()?));
            }
            *b = Some(Bounce { bufs });
        }
        Ok(b.as_ref().expect("set above"))
    }

    /// `kernels/convert.cu` `copy_bytes` on the compute stream.
    fn copy_kernel(&self, src: sys::CUdeviceptr, dst: sys::CUdeviceptr, n: usize, what: &str) -> Result<()> {
        let f = self.func("convert", &[], "copy_bytes")?;
        let grid = n.div_ceil(16 * 256).clamp(1, (self.sm_count.max(1) as usize) * 8) as u32;
        self.launch(f, (grid, 1, 1), (256, 1, 1), 0, &mut KArgs::new().arg(src).arg(dst).arg(n as i64), what)
    }

    pub fn dtod(&self, dst: sys::CUdeviceptr, src: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        unsafe { ck(sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.streams.compute), "device-to-device copy") }
    }

    /// Pinned (page-locked) host memory, for async H2D at full PCIe speed. Allocate once, reuse.
    pub fn pinned(self: &Arc<Self>, bytes: usize) -> Result<PinnedBuf> {
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        unsafe { ck(sys::cuMemHostAlloc(&mut p, bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE), &format!("allocating {bytes} bytes of pinned host memory"))? };
        Ok(PinnedBuf { ptr: p as *mut u8, bytes, gpu: self.clone() })
    }

    /// Page-locks existing host memory for direct DMA (stays registered for the process).
    pub fn register_host(&self, ptr: *const u8, bytes: usize) -> Result<()> {
        self.bind()?;
        unsafe {
            ck(sys::cuMemHostRegister_v2(ptr as *mut c_void, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE), &format!("page-locking {bytes} bytes of host memory"))
        }
    }

    /// Undoes [`Gpu::register_host`] (errors are ignored: used on drop).
    pub fn unregister_host(&self, ptr: *const u8) {
        let _ = self.bind();
        unsafe {
            let _ = sys::cuMemHostUnregister(ptr as *mut c_void);
        }
    }

    /// Async host-to-device copy from page-locked memory on `stream`.
    ///
    /// # Safety
    /// `src` must point to `bytes` readable bytes of page-locked memory that stay valid and
    /// unchanged until the copy completes on `stream`.
    pub unsafe fn htod_async_raw(&self, dst: sys::CUdeviceptr, src: *const u8, bytes: usize, stream: sys::CUstream) -> Result<()> {
        unsafe { ck(sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream), "host-to-device copy (pinned source)") }
    }

    pub fn event(&self) -> Result<Event> {
        self.bind()?;
        let mut e = std::ptr::null_mut();
        unsafe { ck(sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32), "cuEventCreate")? };
        Ok(Event(e))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.bind();
        if let Ok(mut pool) = self.staging.lock() {
            for (b, ev) in std::mem::take(&mut pool.idle) {
                if let Some(e) = ev {
                    let _ = e.sync();
                }
                // SAFETY: allocated by cuMemHostAlloc in `staging_take`, freed once.
                unsafe {
                    let _ = sys::cuMemFreeHost(b.ptr as *mut c_void);
                }
            }
        }
        if let Ok(mut b) = self.bounce.lock() {
            if let Some(bn) = b.take() {
                for (h, _, ev) in bn.bufs {
                    let _ = ev.sync();
                    // SAFETY: allocated by cuMemHostAlloc in `bounce_bufs`, freed once.
                    unsafe {
                        let _ = sys::cuMemFreeHost(h as *mut c_void);
                    }
                }
            }
        }
    }
}

/// A CUDA event (timing and cross-stream ordering).
pub struct Event(pub sys::CUevent);
unsafe impl Send for Event {}
unsafe impl Sync for Event {}
impl Event {
    pub fn record(&self, stream: sys::CUstream) -> Result<()> {
        unsafe { ck(sys::cuEventRecord(self.0, stream), "cuEventRecord") }
    }
    pub fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        unsafe { ck(sys::cuStreamWaitEvent(stream, self.0, 0), "cuStreamWaitEvent") }
    }
    pub fn sync(&self) -> Result<()> {
        unsafe { ck(sys::cuEventSynchronize(self.0), "cuEventSynchronize") }
    }
    pub fn is_done(&self) -> bool {
        unsafe { sys::cuEventQuery(self.0) == sys::CUresult::CUDA_SUCCESS }
    }
    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn ms_to(&self, end: &Event) -> Result<f32> {
        let mut ms = 0.0f32;
        unsafe { ck(sys::cuEventElapsedTime_v2(&mut ms, self.0, end.0), "cuEventElapsedTime")? };
        Ok(ms)
    }
}
impl Drop for Event {
    fn drop(&mut self) {
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.0);
        }
    }
}

/// Device memory owned by this process; freed when dropped.
pub struct DevMem {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    gpu: Arc<Gpu>,
    sync_alloc: bool,
    borrowed: bool,
}
unsafe impl Send for DevMem {}
unsafe impl Sync for DevMem {}

impl DevMem {
    /// A view of memory owned elsewhere (never freed through this handle; the owner must outlive it).
    pub fn borrowed(gpu: Arc<Gpu>, ptr: sys::CUdeviceptr, bytes: usize) -> DevMem {
        DevMem { ptr, bytes, gpu, sync_alloc: false, borrowed: true }
    }
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    /// Byte offset into the allocation.
    pub fn at(&self, off: usize) -> sys::CUdeviceptr {
        self.ptr + off as u64
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.bytes == 0 || self.borrowed {
            return;
        }
        let _ = self.gpu.bind();
        unsafe {
            if self.sync_alloc {
                let _ = sys::cuMemFree_v2(self.ptr);
                self.gpu.sync_bytes.fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
            } else {
                let _ = sys::cuMemFreeAsync(self.ptr, self.gpu.streams.compute);
            }
        }
    }
}

/// Page-locked host memory.
pub struct PinnedBuf {
    ptr: *mut u8,
    bytes: usize,
    gpu: Arc<Gpu>,
}
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for `bytes` bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
    /// Async copy of `len` bytes at `off` to device address `dst` on `stream`.
    pub fn copy_to_device(&self, off: usize, len: usize, dst: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
        if off + len > self.bytes {
            bail!("pinned copy {off}+{len} past the end of a {}-byte staging buffer", self.bytes);
        }
        unsafe { ck(sys::cuMemcpyHtoDAsync_v2(dst, self.ptr.add(off) as *const c_void, len, stream), "pinned host-to-device copy") }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        unsafe {
            let _ = sys::cuMemFreeHost(self.ptr as *mut c_void);
        }
    }
}

/// Kernel arguments, each stored by value in 8-byte aligned storage.
#[derive(Default)]
pub struct KArgs {
    data: Vec<Box<[u64]>>,
}

impl KArgs {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn arg<T: Copy + 'static>(mut self, v: T) -> Self {
        let n = std::mem::size_of::<T>().div_ceil(8).max(1);
        let mut b = vec![0u64; n].into_boxed_slice();
        // SAFETY: the box holds at least size_of::<T>() bytes, 8-byte aligned (enough for every kernel parameter type).
        unsafe { std::ptr::write_unaligned(b.as_mut_ptr() as *mut T, v) };
        self.data.push(b);
        self
    }
    fn ptrs(&mut self) -> Vec<*mut c_void> {
        self.data.iter_mut().map(|b| b.as_mut_ptr() as *mut c_void).collect()
    }
}

/// `ceil(a / b)` as u32 for grid sizes, with an error if it does not fit.
pub fn blocks(a: usize, b: usize) -> Result<u32> {
    u32::try_from(a.div_ceil(b)).context("grid dimension overflow")
}
