//! `cargo xtask bench-placement`: what parameter placement costs, measured around `sd-cli` runs.
//!
//! ```text
//! cargo xtask bench-placement [--runs N] [--threads N] [--size 256|512]
//! ```
//!
//! (`--split` measures layer splits instead, `bench_split.rs`; `--truth` the cost model's
//! predictions, `bench_truth.rs`.)
//!
//! One `sd-cli rpc-server` child serves the CPU on a free loopback port for the
//! whole benchmark (killed at the end, also on error); the runs use the SD 1.5 f16
//! fixture with `cargo xtask bench`'s settings (euler, cfg 7, seed 42, "a photo of
//! a cat"; 256x256 with 4 steps or 512x512 with 2). Each round runs every
//! configuration once, in reverse order every other round, so load drift falls on all.
//!
//! - A. Client RSS by parameter home: `--backend RPC0` (parameters on the device,
//!   the client holds none: the baseline), `--params-backend cpu` (in RAM) and
//!   `--params-backend disk` (re-read from the model file). The target: disk RSS
//!   at most 1.1 x the baseline (the largest resident set plus compute).
//! - B. The UNet segmented under `--max-vram RPC0=0.5`, with and without
//!   `--disable-prefetch`: step time against max(transfer, compute) per UNet run,
//!   from the UNet runner's figures in the run report. The target: within 15%.
//! - C. `--offload-to-cpu` (CPU compute) beside the reference's `--offload-to-cpu`,
//!   the one placement configuration the reference runs too (it has no RPC).
//!
//! Peak RSS is each client's `wait4` `ru_maxrss`; times are the programs' own: ours
//! from `sd-cli`'s run report (`--report-json`), the reference's from its log line. Beside
//! each measured step time, the cost model's prediction from the same report (`predicted`,
//! from the devices' `sd-cli calibrate` figures where they have them, else nominal ones).

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use sd_models::fixture::FixtureModel;
use sd_models::report::RunReport;

use crate::bench::{self, fmt_ratio, fmt_s, median, Size, Timings};
use crate::parity::{build_sd_cli, ensure_fixture};
use crate::{reference, workspace_root};

/// `cargo xtask bench-placement` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// Image side: 256 (4 steps) or 512 (2 steps).
    #[arg(long = "size", value_enum, default_value_t = Size::S256)]
    size: Size,
    /// Rounds (each runs every configuration once).
    #[arg(long = "runs", value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// CPU threads of the client and of the rpc-server.
    #[arg(long = "threads", short = 't', value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Measure layer splits over two RPC servers instead (`bench_split.rs`).
    #[arg(long = "split", conflicts_with = "truth")]
    split: bool,
    /// Measure the cost model's predictions against runs instead (`bench_truth.rs`).
    #[arg(long = "truth")]
    truth: bool,
    /// With `--split`: images per run (`-b`); a batch gives the pipeline more micro-batches
    /// (each image's two guidance passes), sampled in lockstep under copies > 1.
    #[arg(long = "batch", value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16), requires = "split")]
    batch: u32,
}

/// One measured configuration: its name and the flags added to `bench::our_command`
/// (`bench::ref_command` for the last one); `rpc` puts `--rpc ADDR --backend RPC0` first.
struct Config {
    name: &'static str,
    rpc: bool,
    flags: &'static [&'static str],
}

impl Config {
    fn args(&self, rpc: &str) -> Vec<String> {
        let head: &[&str] = if self.rpc { &["--rpc", rpc, "--backend", "RPC0"] } else { &[] };
        head.iter().chain(self.flags).map(|s| (*s).to_owned()).collect()
    }
}

const CONFIGS: [Config; 7] = [
    Config { name: "rpc-params-on-device", rpc: true, flags: &[] },
    Config { name: "rpc-params-ram", rpc: true, flags: &["--params-backend", "cpu"] },
    Config { name: "rpc-params-disk", rpc: true, flags: &["--params-backend", "disk"] },
    Config { name: "rpc-segmented-prefetch", rpc: true, flags: &["--params-backend", "cpu", "--max-vram", "RPC0=0.5"] },
    Config {
        name: "rpc-segmented-no-prefetch",
        rpc: true,
        flags: &["--params-backend", "cpu", "--max-vram", "RPC0=0.5", "--disable-prefetch"],
    },
    Config { name: "ours-offload-to-cpu", rpc: false, flags: &["--offload-to-cpu"] },
    Config { name: "ref-offload-to-cpu", rpc: false, flags: &["--offload-to-cpu"] },
];
/// Index of the reference's configuration in `CONFIGS`.
const REF: usize = 6;

/// The UNet runner's figures in a run report, in the units the tables print.
#[derive(Clone, Debug, Default, PartialEq)]
struct UnetSummary {
    runs: f64,
    compute_s: f64,
    blocking_s: f64,
    waits_s: f64,
    copied_mib: f64,
    copy_s: f64,
}

const MIB: f64 = 1048576.0;

fn unet_summary(r: &RunReport) -> Option<UnetSummary> {
    let u = r.runner("unet")?;
    Some(UnetSummary {
        runs: u.stats.runs as f64,
        compute_s: u.stats.compute_secs,
        blocking_s: u.stats.load_secs,
        waits_s: u.stats.prefetch_wait_secs,
        copied_mib: u.uploaded_bytes as f64 / MIB,
        copy_s: u.upload_seconds,
    })
}

/// `(high-water MiB, budget MiB)` of `device`'s managed memory.
fn high_water(r: &RunReport, device: &str) -> Option<(f64, Option<f64>)> {
    let d = r.device(device)?;
    Some((d.high_water_bytes as f64 / MIB, d.budget_bytes.map(|b| b as f64 / MIB)))
}

/// `(module, parameter MiB)` of each module the plan placed.
fn module_params(r: &RunReport) -> Vec<(String, f64)> {
    let modules = r.plan.as_ref().map_or(&[][..], |p| &p.modules[..]);
    modules.iter().map(|m| (m.module.name().to_owned(), m.param_bytes as f64 / MIB)).collect()
}

/// One configuration's runs.
#[derive(Debug, Default)]
struct Runs {
    timings: Vec<Timings>,
    wall_s: Vec<f64>,
    rss_kib: Vec<u64>,
    anon_kib: Vec<u64>,
    unet: Vec<UnetSummary>,
    high_water_mib: Vec<f64>,
    modules: Vec<(String, f64)>,
    /// The cost model's seconds per step, from each run's report (`predicted`).
    predicted_step_s: Vec<f64>,
}

impl Runs {
    fn step(&self) -> Option<f64> {
        median(&self.timings.iter().flat_map(|t| t.steps_s.clone()).collect::<Vec<_>>())
    }
    fn predicted(&self) -> Option<f64> {
        median(&self.predicted_step_s)
    }
    fn med(&self, f: impl Fn(&Timings) -> Option<f64>) -> Option<f64> {
        median(&self.timings.iter().filter_map(f).collect::<Vec<_>>())
    }
    fn rss_mib(&self) -> Option<f64> {
        self.rss_kib.iter().max().map(|&k| k as f64 / 1024.0)
    }
    fn anon_mib(&self) -> Option<f64> {
        self.anon_kib.iter().max().map(|&k| k as f64 / 1024.0)
    }
    /// Median over runs of a UNet-summary field divided by the UNet runs of that generation.
    fn per_unet_run(&self, f: impl Fn(&UnetSummary) -> f64) -> Option<f64> {
        median(&self.unet.iter().filter(|u| u.runs > 0.0).map(|u| f(u) / u.runs).collect::<Vec<_>>())
    }
}

/// What every placement benchmark starts with: the release `sd-cli`, the SD 1.5 f16 fixture
/// and the output folder `target/bench`.
pub(crate) fn bench_inputs() -> Result<(PathBuf, PathBuf, PathBuf)> {
    let exe = build_sd_cli()?;
    let model = ensure_fixture(FixtureModel::Sd15)?;
    let dir = workspace_root().join("target/bench");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok((exe, model, dir))
}

/// The `sd-cli rpc-server` child; killed and reaped on drop.
pub(crate) struct RpcServer {
    child: Child,
    log: PathBuf,
}

impl RpcServer {
    pub(crate) fn start(exe: &Path, threads: u32, log: PathBuf) -> Result<(Self, String)> {
        // Ask the kernel for a free port, then release it for the server (a small race, loopback only).
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port();
        let out = File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let child = Command::new(exe)
            .args(["rpc-server", "--host", "127.0.0.1", "--port", &port.to_string(), "--threads", &threads.to_string()])
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("cannot start sd-cli rpc-server")?;
        let mut server = RpcServer { child, log };
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let start = Instant::now();
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            server.check_alive()?;
            if start.elapsed() > Duration::from_secs(60) {
                bail!("sd-cli rpc-server did not listen on {addr} within 60 s; see {}", server.log.display());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok((server, addr.to_string()))
    }

    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            bail!("sd-cli rpc-server exited ({status}); its log ({}):\n{log}", self.log.display());
        }
        Ok(())
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `f` while sampling, every 50 ms, the peak `RssAnon` (KiB) of this process's
/// children other than `skip`. `ru_maxrss` also counts the model file's pages mapped
/// by the child, which the kernel drops at will; anonymous memory is what it holds.
fn with_anon_peak<T>(skip: u32, f: impl FnOnce() -> T) -> (T, Option<u64>) {
    let done = AtomicBool::new(false);
    let sample = || {
        let mut peak = None;
        while !done.load(Ordering::Relaxed) {
            for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
                let field =
                    |k: &str| status.lines().find_map(|l| l.strip_prefix(k)?.split_whitespace().next()?.parse().ok());
                if field("PPid:") == Some(u64::from(std::process::id())) && field("Pid:") != Some(u64::from(skip)) {
                    peak = peak.max(field("RssAnon:"));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        peak
    };
    std::thread::scope(|scope| {
        let sampler = scope.spawn(sample);
        let out = f();
        done.store(true, Ordering::Relaxed);
        (out, sampler.join().unwrap_or(None))
    })
}

fn mib(v: Option<f64>) -> String {
    v.map_or_else(|| "?".to_owned(), |v| format!("{v:.0} MiB"))
}

fn plain(v: Option<f64>) -> String {
    v.map_or_else(|| "?".to_owned(), |v| format!("{v:.2}"))
}

fn yes_no(ok: Option<bool>) -> &'static str {
    ok.map_or("?", |ok| if ok { "yes" } else { "NO" })
}

/// One table row: a label, the values formatted by `f`, then the ratios `vals[i] / vals[j]`.
fn row(name: &str, vals: &[Option<f64>], ratios: &[(usize, usize)], f: fn(Option<f64>) -> String) {
    let cells = vals.iter().map(|&v| f(v)).chain(ratios.iter().map(|&(i, j)| fmt_ratio(vals[i], vals[j])));
    println!("{name:<34}{}", cells.map(|c| format!(" {c:>14}")).collect::<String>());
}

fn header(cols: &[&str]) {
    println!("{:<34}{}", "", cols.iter().map(|c| format!(" {c:>14}")).collect::<String>());
}

fn print_a(r: &[Runs; 7]) {
    let x = [&r[0], &r[1], &r[2]];
    println!("\nA. client RSS by parameter home (compute on RPC0)");
    header(&["on device", "RAM (cpu)", "disk", "disk/RAM", "disk/device"]);
    let q = [(2, 1), (2, 0)];
    let (rss, anon) = (x.map(Runs::rss_mib), x.map(Runs::anon_mib));
    row("client peak RSS (wait4)", &rss, &q, mib);
    row("client peak RssAnon (sampled)", &anon, &q, mib);
    row("per step (median)", &x.map(Runs::step), &q, fmt_s);
    row("predicted per step (cost model)", &x.map(Runs::predicted), &[], fmt_s);
    row("generation", &x.map(|r| r.med(|t| t.generation_s)), &q, fmt_s);
    row(
        "UNet params copied to RPC0",
        &x.map(|r| median(&r.unet.iter().map(|u| u.copied_mib).collect::<Vec<_>>())),
        &[],
        mib,
    );
    let modules: Vec<String> = r[1].modules.iter().map(|(m, v)| format!("{m} {v:.1} MiB")).collect();
    println!("  parameters per module: {}", if modules.is_empty() { "?".into() } else { modules.join(", ") });
    for (what, v) in [("RSS", rss), ("RssAnon", anon)] {
        println!(
            "  target: disk {what} <= 1.1 x on-device {what} (largest resident set + compute): {} ({} <= {})",
            yes_no(v[2].zip(v[0]).map(|(d, b)| d <= 1.1 * b)),
            mib(v[2]),
            mib(v[0].map(|b| 1.1 * b))
        );
    }
}

fn print_b(r: &[Runs; 7]) {
    let x = [&r[3], &r[4]];
    println!("\nB. UNet segmented on RPC0, --params-backend cpu --max-vram RPC0=0.5");
    header(&["prefetch", "no prefetch", "pf/no-pf"]);
    let q = [(0, 1)];
    let runs_per_step = |r: &Runs| {
        median(&r.unet.iter().zip(&r.timings).map(|(u, t)| u.runs / t.steps_s.len().max(1) as f64).collect::<Vec<_>>())
    };
    let step_per_run = x.map(|r| r.step().zip(runs_per_step(r)).map(|(s, n)| s / n));
    let compute = x.map(|r| r.per_unet_run(|u| u.compute_s));
    let copy = x.map(|r| r.per_unet_run(|u| u.copy_s));
    let bound = [0, 1].map(|i| compute[i].zip(copy[i]).map(|(c, t)| c.max(t)));
    let ratio = [0, 1].map(|i| step_per_run[i].zip(bound[i]).map(|(s, b)| s / b));
    row("per step (median)", &x.map(Runs::step), &q, fmt_s);
    row("predicted per step (cost model)", &x.map(Runs::predicted), &[], fmt_s);
    row("UNet runs per step", &x.map(runs_per_step), &[], plain);
    row("step per UNet run", &step_per_run, &q, fmt_s);
    row("  compute per run", &compute, &q, fmt_s);
    row("  copy to RPC0 per run (transfer)", &copy, &q, fmt_s);
    row("  blocking loads per run", &x.map(|r| r.per_unet_run(|u| u.blocking_s)), &q, fmt_s);
    row("  prefetch waits per run", &x.map(|r| r.per_unet_run(|u| u.waits_s)), &q, fmt_s);
    row("  MiB copied per run", &x.map(|r| r.per_unet_run(|u| u.copied_mib)), &q, plain);
    row("  max(transfer, compute) per run", &bound, &q, fmt_s);
    row("step / max(transfer, compute)", &ratio, &[], plain);
    row("RPC0 managed high-water", &x.map(|r| median(&r.high_water_mib)), &[], mib);
    row("client peak RSS (wait4)", &x.map(Runs::rss_mib), &q, mib);
    println!(
        "  target: with prefetch, step within 15% of max(transfer, compute): {}",
        yes_no(ratio[0].map(|q| q <= 1.15))
    );
}

fn print_c(r: &[Runs; 7]) {
    let x = [&r[5], &r[REF]];
    println!("\nC. --offload-to-cpu, CPU compute, beside the reference (it has no RPC)");
    header(&["ours", "reference", "ours/ref"]);
    let q = [(0, 1)];
    row("per step (median)", &x.map(Runs::step), &q, fmt_s);
    row("predicted per step (cost model)", &x.map(Runs::predicted), &[], fmt_s);
    row("text encode (1)", &x.map(|r| r.med(|t| t.text_encode_s)), &q, fmt_s);
    row("decode (1)", &x.map(|r| r.med(|t| t.decode_s)), &q, fmt_s);
    row("whole run (wall)", &x.map(|r| median(&r.wall_s)), &q, fmt_s);
    row("peak RSS (wait4)", &x.map(Runs::rss_mib), &q, mib);
    row("peak RssAnon (sampled)", &x.map(Runs::anon_mib), &q, mib);
    println!("  (1) ours includes loading that module's weights; the reference's excludes it.");
}

/// Entry point of `cargo xtask bench-placement ...` (`args` excludes the subcommand name).
pub fn run(args: Args) -> Result<()> {
    if args.split {
        return crate::bench_split::run(args.size, args.runs, args.batch);
    }
    if args.truth {
        return crate::bench_truth::run(args.runs);
    }
    let s = args.size.setting();
    eprintln!("bench-placement: building sd-cli (release) and the reference");
    let (ours_exe, model, dir) = bench_inputs()?;
    let ref_exe = reference::build()?;
    let (mut server, addr) = RpcServer::start(&ours_exe, args.threads, dir.join("placement-rpc-server.log"))?;
    eprintln!("bench-placement: rpc-server on {addr}");
    let mut results: [Runs; 7] = Default::default();
    let mut failures = Vec::new();
    for i in 0..args.runs {
        let mut order: Vec<usize> = (0..CONFIGS.len()).collect();
        if i % 2 == 1 {
            order.reverse();
        }
        for k in order {
            let c = &CONFIGS[k];
            let out = dir.join(format!("placement-{}-{}-{i}.png", c.name, s.side));
            let mut cmd = if k == REF {
                bench::ref_command(&ref_exe, &model, s, args.threads, &out)
            } else {
                bench::our_command(&ours_exe, &model, s, args.threads, &out)
            };
            cmd.args(c.args(&addr));
            eprintln!("bench-placement: {0}x{0} round {1}/{2}: {3}", s.side, i + 1, args.runs, c.name);
            let (m, anon) = with_anon_peak(server.child.id(), || bench::run_measured(&mut cmd));
            let m = m?;
            if let Err(e) = m.check(c.name) {
                // Keep going: the other configurations still answer, and what this one logged counts.
                eprintln!("bench-placement: warning: {e:#}");
                let why = m.stderr.lines().rev().find(|l| l.starts_with("error")).unwrap_or("see its log");
                failures.push(format!("{} (round {}): {why}", c.name, i + 1));
            }
            server.check_alive()?;
            let r = &mut results[k];
            // A failed run may have left no report: its figures are missing, with a warning.
            let report = if k == REF {
                None
            } else {
                bench::read_report(&bench::report_path(&out))
                    .inspect_err(|e| eprintln!("bench-placement: warning: {e:#}"))
                    .ok()
            };
            let t = match &report {
                _ if k == REF => bench::parse_ref(&m.stderr),
                Some(report) => bench::ours_timings(report),
                None => Timings::default(),
            };
            if t.steps_s.len() != s.steps as usize {
                eprintln!("bench-placement: warning: {} step times in {}'s report", t.steps_s.len(), c.name);
            }
            if let (true, Some(report)) = (c.rpc, &report) {
                match unet_summary(report) {
                    Some(u) => r.unet.push(u),
                    None => eprintln!("bench-placement: warning: no UNet runner in {}'s report", c.name),
                }
                r.high_water_mib.extend(high_water(report, "RPC0").map(|(h, _)| h));
                r.modules = module_params(report);
            }
            r.predicted_step_s.extend(report.as_ref().and_then(|r| r.predicted.as_ref()).map(|p| p.step_s));
            r.timings.push(t);
            r.wall_s.push(m.wall_s);
            r.rss_kib.push(m.max_rss_kib);
            r.anon_kib.extend(anon);
        }
    }
    drop(server);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    println!(
        "\nsd15 f16 fixture, {0}x{0}, {1} steps euler, cfg 7, seed 42, -t {2} (client and rpc-server), {3} round(s), \
         configurations alternating",
        s.side, s.steps, args.threads, args.runs
    );
    print_a(&results);
    print_b(&results);
    print_c(&results);
    for f in &failures {
        println!("\nFAILED, its numbers above are partial: {f}");
    }
    println!("\nload average at the end (1, 5, 15 min): {}", load.join(" "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use sd_models::report::{DeviceReport, RunnerReport};
    use sd_sched::RunStats;

    fn report() -> RunReport {
        let mut r = RunReport::new("generate", Vec::new());
        let stats = |runs, compute_secs| RunStats { runs, compute_secs, ..RunStats::default() };
        let runner = |name: &str, stats, uploaded_bytes, upload_seconds| RunnerReport {
            name: name.into(),
            device: "RPC0".into(),
            stats,
            uploaded_bytes,
            upload_seconds,
            stages: Vec::new(),
            profile: None,
        };
        let unet = RunStats { load_secs: 0.4, prefetch_wait_secs: 1.3, segmented_runs: 8, ..stats(8, 5.2) };
        r.runners = vec![runner("te", stats(2, 0.5), 0, 0.0), runner("unet", unet, 3300 << 20, 2.1)];
        let device = |device: &str, high: u64, budget| DeviceReport {
            device: device.into(),
            budget_bytes: budget,
            high_water_bytes: high,
            managed_bytes: 0,
            pressure_evictions: 0,
            pressure_evicted_bytes: 0,
        };
        r.devices = vec![device("CPU", 10 << 20, None), device("RPC0", 500 << 20, Some(512 << 20))];
        // Through JSON, as the benchmark reads it.
        RunReport::from_json(&r.to_json()).unwrap()
    }

    #[test]
    fn the_unet_runner_gives_each_counter() {
        // The text encoder's runner, also on RPC0, must not be taken for it.
        let u = unet_summary(&report()).unwrap();
        let (runs, compute_s, blocking_s, waits_s, copied_mib, copy_s) = (8.0, 5.2, 0.4, 1.3, 3300.0, 2.1);
        assert_eq!(u, UnetSummary { runs, compute_s, blocking_s, waits_s, copied_mib, copy_s });
        assert_eq!(unet_summary(&RunReport::new("generate", Vec::new())), None);
    }

    #[test]
    fn per_run_values_divide_by_the_runs_of_each_generation() {
        let mut u = unet_summary(&report()).unwrap();
        let mut r = Runs { unet: vec![u.clone()], ..Runs::default() };
        u.runs = 4.0; // a generation with half the runs and the same totals: twice the per-run time
        r.unet.push(u);
        assert_eq!(r.per_unet_run(|u| u.compute_s), Some((5.2 / 8.0 + 5.2 / 4.0) / 2.0));
    }

    #[test]
    fn the_device_report_gives_mark_and_budget() {
        let r = report();
        assert_eq!(high_water(&r, "RPC0"), Some((500.0, Some(512.0))));
        assert_eq!(high_water(&r, "CPU"), Some((10.0, None)));
        assert_eq!(high_water(&r, "RPC1"), None);
    }

    #[test]
    fn parses_the_documented_command_line() {
        let parse = crate::parse_test::<Args>;
        assert_eq!(
            parse("").unwrap(),
            Args { size: Size::S256, runs: 2, threads: 2, split: false, truth: false, batch: 1 }
        );
        assert_eq!(
            parse("--runs 1 --threads 4 --size 512").unwrap(),
            Args { size: Size::S512, runs: 1, threads: 4, split: false, truth: false, batch: 1 }
        );
        assert_eq!(parse("--split --batch 2").unwrap().batch, 2);
        assert!(parse("--truth --runs 1").unwrap().truth);
        assert!(parse("--truth --split").is_err(), "one measurement at a time");
        assert!(parse("--batch 2").is_err(), "--batch needs --split");
        assert_eq!(parse("--size 512").unwrap().size.setting(), bench::SETTING_512);
        for (line, needle) in
            [("--size 1024", "1024"), ("--runs 0", "--runs"), ("--runs", "a value is required"), ("--x 1", "--x")]
        {
            let e = parse(line).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }

    #[test]
    fn the_anonymous_peak_of_children_is_sampled_except_the_skipped_one() {
        // dd holds its block, filled from /dev/zero, for many 50 ms samples.
        let dd = |bs: &str, count: &str| {
            let mut c = Command::new("dd");
            c.args(["if=/dev/zero", "of=/dev/null", &format!("bs={bs}"), &format!("count={count}")]);
            c
        };
        let (m, anon) = with_anon_peak(0, || bench::run_measured(&mut dd("300M", "10")));
        m.unwrap().check("dd").unwrap();
        assert!(anon.is_some_and(|k| k > 290 * 1024), "{anon:?}");
        // A 1000 MiB child to skip, beside a sleeping one that is measured (other tests'
        // children, at most a few hundred MiB, may show too).
        let mut big = dd("1000M", "4").stderr(Stdio::null()).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let (_, small) = with_anon_peak(big.id(), || bench::run_measured(Command::new("sleep").arg("0.5")));
        big.wait().unwrap();
        assert!(small.is_some_and(|k| k < 900 * 1024), "{small:?}");
    }

    #[test]
    fn each_configuration_passes_its_placement_flags() {
        let f = |name: &str| CONFIGS.iter().find(|c| c.name == name).unwrap().args("127.0.0.1:5").join(" ");
        assert_eq!(f("rpc-params-on-device"), "--rpc 127.0.0.1:5 --backend RPC0");
        assert_eq!(f("rpc-params-disk"), "--rpc 127.0.0.1:5 --backend RPC0 --params-backend disk");
        assert!(f("rpc-segmented-no-prefetch").ends_with("cpu --max-vram RPC0=0.5 --disable-prefetch"));
        assert!(f("rpc-segmented-prefetch").ends_with("cpu --max-vram RPC0=0.5"));
        assert_eq!(f(CONFIGS[REF].name), "--offload-to-cpu");
        assert!(CONFIGS[REF].name.starts_with("ref"));
    }
}
