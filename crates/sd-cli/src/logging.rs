//! The tracing subscriber of the binary: info by default, `-v` debug, `-vv` trace; text, or
//! JSON lines with `--log-format json`.
//!
//! `RUST_LOG` overrides the level. ggml's own messages arrive under the target
//! `ggml` (see sd-backends' log bridge).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields.message`.
    Json,
}

/// Installs the subscriber; logs go to stderr so stdout stays for data (JSON). Colours only
/// on a terminal, and never with `NO_COLOR` set.
pub fn init(verbose: u8, format: LogFormat) {
    let level = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    if format == LogFormat::Json {
        let _ = tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(|| AboveBars)
            .with_ansi(false)
            .with_target(true)
            .try_init();
        return;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| AboveBars)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_target(verbose > 0)
        .without_time()
        .try_init();
}

/// Stderr, with any progress bars lifted while a log line is written so the line lands
/// above them (see [`crate::progress`]).
struct AboveBars;

impl std::io::Write for AboveBars {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match crate::progress::active() {
            Some(bars) => bars.suspend(|| std::io::stderr().write(buf)),
            None => std::io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}
