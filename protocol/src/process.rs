//! What both binaries do around their subcommand: logs through `tracing` to stderr (filter from
//! `RUST_LOG`, `info` by default; colours only when stderr is a terminal, so a log redirected to
//! a file is plain text), and a failed command ends the process with one line that carries the
//! whole cause chain and exit status 1.

use std::io::IsTerminal;

/// Installs the stderr `tracing` subscriber (once per process).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let ansi = std::io::stderr().is_terminal();
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
}

/// Ends the process with `BIN: error: cause: cause…` and status 1 when `res` is an error.
pub fn exit_on_error(bin: &str, res: anyhow::Result<()>) {
    if let Err(e) = res {
        eprintln!("{bin}: error: {e:#}");
        std::process::exit(1);
    }
}

/// Logging for tests: `RUST_LOG` or `warn`, through the test harness's capture; a second call
/// is a no-op.
pub fn init_test_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
}

/// An in-memory log sink (a `tracing_subscriber` writer): tests read back what a run logged.
#[derive(Clone, Default)]
pub struct MemoryLog(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl MemoryLog {
    /// A subscriber that writes `info` and up, without colours, into this sink.
    pub fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync {
        tracing_subscriber::fmt().with_writer(self.clone()).with_ansi(false).with_max_level(tracing::Level::INFO).finish()
    }

    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

impl std::io::Write for MemoryLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for MemoryLog {
    type Writer = MemoryLog;
    fn make_writer(&'a self) -> MemoryLog {
        self.clone()
    }
}
