//! What this machine's memory allows: the budgets that bound work sized by a request (the
//! vision tower's patches, the context a request may reach).

/// Memory available now: Linux `MemAvailable`; on macOS, physical memory / 2 (unified memory
/// the GPU shares); `None` where it cannot be read.
pub fn available_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let kb: u64 = text.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }
    #[cfg(target_os = "macos")]
    {
        let out = std::process::Command::new("sysctl").args(["-n", "hw.memsize"]).output().ok()?;
        let bytes: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
        Some(bytes / 2)
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        None
    }
}

/// A memory budget: `bytes` when given (`--vision-memory-bytes`, `--context-memory-bytes`),
/// else half of what [`available_bytes`] leaves beside `beside` bytes still to be loaded (the
/// model's weights), else `None` (unbounded: the memory cannot be read).
pub fn budget(bytes: Option<u64>, beside: u64) -> Option<u64> {
    bytes.or_else(|| available_bytes().map(|a| a.saturating_sub(beside) / 2))
}
