//! Helpers shared by the end-to-end tests that use the SD 1.5 fixture and RPC servers.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sd_backends::rpc_wire::{WireClient, WireTensor};
use sd_models::fixture::{self, FixtureModel, WeightType};
use sd_models::report::RunReport;

pub fn sd_cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sd-cli"))
}

/// The SD 1.5 fixture (seed 42, f16), shared by the end-to-end tests.
pub fn sd15_fixture() -> PathBuf {
    fixture::ensure_cached(FixtureModel::Sd15, 42, WeightType::F16).unwrap().0
}

/// An `sd-cli rpc-server` on a free loopback port, in its own process group (signals
/// reach the supervisor and its worker alike); continued and killed on drop.
/// `RPC_FAULTS_SERVER_LOG=1` shows its log (`-v`).
pub struct Server {
    pub child: Child,
    pub endpoint: String,
    /// The server's stderr.
    pub log: PathBuf,
}

impl Server {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server with more `rpc-server` flags. It listens on a port the system picks
    /// (`--port 0`; the port is read from its log), so no other process can take the port
    /// between its choice and the bind. Its log is kept in a file and printed when a test
    /// fails while the server lives (`RPC_FAULTS_SERVER_LOG` adds `-v`).
    pub fn start_with(extra: &[&str]) -> Self {
        use std::os::unix::process::CommandExt;
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let log = std::env::temp_dir().join(format!("sd-rs-test-rpc-server-{}-{n}.log", std::process::id()));
        let verbose = std::env::var_os("RPC_FAULTS_SERVER_LOG").is_some();
        let mut child = sd_cli()
            .args(["rpc-server", "--host", "127.0.0.1", "--port", "0", "--threads", "2"])
            .args(extra)
            .args(verbose.then_some("-v"))
            .env("NO_COLOR", "1")
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let endpoint = loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            // the front's line (its workers log where they listen too)
            let front = text.lines().find(|l| l.contains("MiB for buffers"));
            if let Some(at) = front.and_then(|l| l.find("listening on ").map(|at| &l[at..])) {
                let rest = &at["listening on ".len()..];
                let end = rest.find(|c: char| c != '.' && c != ':' && !c.is_ascii_digit()).unwrap_or(rest.len());
                break rest[..end].to_string();
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("rpc-server exited while starting ({status}):\n{text}");
            }
            assert!(t.elapsed() < Duration::from_secs(60), "rpc-server did not start:\n{text}");
            std::thread::sleep(Duration::from_millis(20));
        };
        // ready once it answers the handshake
        let probe = loop {
            if let Ok(c) = WireClient::connect(&endpoint, Duration::from_secs(2)) {
                break c.local_addr().unwrap();
            }
            assert!(t.elapsed() < Duration::from_secs(60), "rpc-server at {endpoint} did not answer");
            std::thread::sleep(Duration::from_millis(50));
        };
        let server = Self { child, endpoint, log };
        // the probe holds one of --max-clients until the server has seen it leave
        server.wait_gone(probe);
        server
    }

    /// Waits until the server's log says that the client at `client` has left (it counts
    /// against `--max-clients` until then).
    pub fn wait_gone(&self, client: std::net::SocketAddr) {
        let t = Instant::now();
        let gone = [
            format!("RPC client {client} disconnected"),
            format!("RPC client {client} lost"),
            format!("RPC client {client} dropped"),
        ];
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if gone.iter().any(|g| text.contains(g.as_str())) {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "the server never logged that {client} left:\n{text}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `sig` to the server's process group.
    pub fn signal(&self, sig: &str) {
        assert!(self.try_signal(sig), "kill {sig} failed");
    }

    fn try_signal(&self, sig: &str) -> bool {
        let group = format!("-{}", self.child.id());
        Command::new("kill").args([sig, "--", &group]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    }

    /// Whether the supervisor still runs.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.try_signal("-CONT");
        self.try_signal("-KILL");
        let _ = self.child.wait();
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(60).collect();
            eprintln!("--- rpc-server {} (last lines of its log):", self.endpoint);
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A 64x64 RGB PNG with a smooth gradient and a coarse checkerboard (structure a sampler
/// cannot produce by chance).
pub fn write_init_png(path: &Path, flip: bool) {
    let mut data = Vec::with_capacity(64 * 64 * 3);
    for y in 0..64u32 {
        for x in 0..64u32 {
            let (x, y) = if flip { (63 - y, 63 - x) } else { (x, y) };
            let check = if (x / 16 + y / 16) % 2 == 0 { 32 } else { 128 };
            data.extend_from_slice(&[(x * 4) as u8, (y * 4) as u8, check]);
        }
    }
    let mut enc = png::Encoder::new(std::io::BufWriter::new(std::fs::File::create(path).unwrap()), 64, 64);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header().unwrap().write_image_data(&data).unwrap();
}

/// The decoded pixels of a PNG file.
pub fn pixels(path: &Path) -> Vec<u8> {
    png_pixels(&std::fs::read(path).unwrap())
}

/// The decoded pixels of PNG bytes.
pub fn png_pixels(png: &[u8]) -> Vec<u8> {
    let mut r = png::Decoder::new(std::io::Cursor::new(png)).read_info().unwrap();
    let mut buf = vec![0; r.output_buffer_size().unwrap()];
    let info = r.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    buf
}

/// Mean and largest absolute difference of two images' pixel values, in levels of 255.
pub fn level_diff(a: &[u8], b: &[u8]) -> (f64, u8) {
    assert_eq!(a.len(), b.len(), "image sizes differ");
    let d = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y));
    (d.clone().map(f64::from).sum::<f64>() / a.len().max(1) as f64, d.max().unwrap_or(0))
}

/// Runs `sd-cli -m model` with `args` then `extra` into `out` (`--report-json` beside it);
/// checks that it succeeded and kept every device within its budget; returns the run report.
pub fn run_checked(model: &Path, out: &Path, args: &[&str], extra: &[&str]) -> RunReport {
    run_checked_env(model, out, args, extra, &[])
}

/// [`run_checked`] with environment variables `env` set for sd-cli.
pub fn run_checked_env(model: &Path, out: &Path, args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> RunReport {
    let report = out.with_extension("json");
    let o = sd_cli()
        .envs(env.iter().copied())
        .arg("-m")
        .arg(model)
        .args(args)
        .arg("-o")
        .arg(out)
        .arg("--report-json")
        .arg(&report)
        .args(extra)
        // The model is given: the cache directory holds only what a run caches (device speeds).
        .env("SD_CACHE_DIR", out.parent().unwrap())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "sd-cli {extra:?} failed:\n{log}");
    let text = std::fs::read_to_string(&report).unwrap_or_else(|e| panic!("{}: {e}", report.display()));
    let report = RunReport::from_json(&text).unwrap_or_else(|e| panic!("{extra:?}: {e}:\n{text}"));
    for d in &report.devices {
        if let Some(b) = d.budget_bytes {
            assert!(
                d.high_water_bytes <= b,
                "{extra:?}: {} high-water {} above its budget {b}",
                d.device,
                d.high_water_bytes
            );
        }
    }
    report
}

/// A valid round trip on a fresh connection: the server still serves. Returns the
/// client's address (see [`Server::wait_gone`]).
pub fn round_trip(endpoint: &str) -> std::net::SocketAddr {
    let mut c = WireClient::connect(endpoint, Duration::from_secs(5)).expect("the server accepts a new client");
    let me = c.local_addr().unwrap();
    let (buf, size) = c.alloc_buffer(1024).unwrap();
    assert!(buf != 0 && size >= 1024);
    let base = c.buffer_base(buf).unwrap();
    let t = WireTensor::f32(1, buf, base, 16);
    let data: Vec<u8> = (0..64).collect();
    c.set_tensor(&t, 0, &data).unwrap();
    assert_eq!(c.get_tensor(&t, 0, 64).unwrap(), data);
    me
}
