//! `cargo xtask bench`'s server row: N requests to one `sd-cli serve` against N `sd-cli`
//! runs of the same job (the load and planning a server saves), and the weight bytes each
//! request staged anew, first against later (the weights a server keeps between requests).
//!
//! The server is started once (`sd-cli serve --listen-port 0`, its address read from its
//! first stdout line) and sent the jobs one after the other through the native async API
//! (`POST /sdcpp/v1/img_gen`, then polling `GET /sdcpp/v1/jobs/{id}`, whose completed job
//! carries its run report). Its time to the first image runs from the spawn to the first
//! job's completion; each later image's time from its submission to its completion. The
//! `sd-cli` runs are measured as in the main table ([`run_measured`]: spawn to reap); their
//! time to the first image is the first run's, their bytes staged from their run reports.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use sd_models::report::RunReport;
use serde_json::{json, Value};

use crate::bench::{fmt_ratio, fmt_s, median, read_report, report_path, run_measured, Setting, PROMPT};

/// What the server row measured.
#[derive(Debug, Default)]
pub(crate) struct ServerRow {
    /// Seconds from the server's spawn to its first image, and each later request's seconds.
    server_first_s: f64,
    server_later_s: Vec<f64>,
    /// Bytes of weights each request staged anew, in order.
    server_staged: Vec<u64>,
    /// Each `sd-cli` run's wall seconds and bytes staged, in order.
    cli_s: Vec<f64>,
    cli_staged: Vec<u64>,
}

/// A running `sd-cli serve`, killed and reaped on drop.
struct Server {
    child: Child,
    base: String,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(exe: &Path, model: &[OsString], threads: u32, log: PathBuf) -> Result<Server> {
        let err = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let mut child = Command::new(exe)
            .arg("serve")
            .args(model)
            .args(["-t", &threads.to_string(), "--listen-port", "0", "--preview-interval", "0"])
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .context("cannot start sd-cli serve")?;
        let mut line = String::new();
        let read = child.stdout.take().map(|out| BufReader::new(out).read_line(&mut line));
        let mut server = Server { child, base: String::new(), log };
        server.base = match (read, line.trim().strip_prefix("sd-server listening on ")) {
            (Some(Ok(_)), Some(base)) => base.to_string(),
            _ => bail!("sd-cli serve did not print its address (its log: {})", server.log.display()),
        };
        Ok(server)
    }
}

/// The native body of the benchmark's job.
fn job_body(s: Setting, cfg: &str) -> Value {
    let cfg: f64 = cfg.parse().unwrap_or(7.0);
    json!({
        "prompt": PROMPT, "width": s.side, "height": s.side, "seed": 42,
        "sample_params": {"sample_steps": s.steps, "sample_method": "euler", "guidance": {"txt_cfg": cfg}},
    })
}

/// Submits one job and waits for it: its seconds and its run report.
fn request(agent: &ureq::Agent, server: &Server, body: &Value) -> Result<(f64, RunReport)> {
    let t = Instant::now();
    let url = format!("{}/sdcpp/v1/img_gen", server.base);
    let v: Value = agent.post(&url).send_json(body).with_context(|| format!("POST {url}"))?.body_mut().read_json()?;
    let id = v["id"].as_str().with_context(|| format!("no job id in {v}"))?.to_string();
    let url = format!("{}/sdcpp/v1/jobs/{id}", server.base);
    loop {
        let v: Value = agent.get(&url).call().with_context(|| format!("GET {url}"))?.body_mut().read_json()?;
        match v["status"].as_str() {
            Some("completed") => {
                let secs = t.elapsed().as_secs_f64();
                let report: RunReport =
                    serde_json::from_value(v["report"].clone()).context("the completed job's run report")?;
                return Ok((secs, report));
            }
            Some("queued" | "generating") => std::thread::sleep(Duration::from_millis(10)),
            _ => bail!("job {id} ended {v} (the server's log: {})", server.log.display()),
        }
    }
}

/// Runs the row: `n` jobs of `s` on one server started with `model`, and `n` `sd-cli` runs.
pub(crate) fn run(
    exe: &Path,
    model: &[OsString],
    cfg: &str,
    s: Setting,
    threads: u32,
    n: usize,
    dir: &Path,
) -> Result<ServerRow> {
    let mut row = ServerRow::default();
    let agent: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(3600))).build().into();
    let body = job_body(s, cfg);
    eprintln!("bench: server row: {n} requests to one sd-cli serve");
    let t = Instant::now();
    let server = Server::start(exe, model, threads, dir.join("server.log"))?;
    for i in 0..n {
        let (secs, report) = request(&agent, &server, &body)?;
        if i == 0 {
            row.server_first_s = t.elapsed().as_secs_f64();
        } else {
            row.server_later_s.push(secs);
        }
        row.server_staged.push(report.staged_bytes());
    }
    drop(server);
    eprintln!("bench: server row: {n} sd-cli runs");
    for i in 0..n {
        let out = dir.join(format!("server-row-cli-{i}.png"));
        let mut cmd = Command::new(exe);
        cmd.args(model);
        cmd.args(["-p", PROMPT, "-W", &s.side.to_string(), "-H", &s.side.to_string()]);
        cmd.args(["--steps", &s.steps.to_string(), "--sampling-method", "euler", "--cfg-scale", cfg, "-s", "42"]);
        cmd.args(["-t", &threads.to_string(), "-o"]).arg(&out).arg("--report-json").arg(report_path(&out));
        cmd.env("NO_COLOR", "1");
        let m = run_measured(&mut cmd)?;
        m.check(&format!("sd-cli run {} of the server row", i + 1))?;
        row.cli_s.push(m.wall_s);
        row.cli_staged.push(read_report(&report_path(&out))?.staged_bytes());
    }
    Ok(row)
}

/// Prints the row under a heading naming the job.
pub(crate) fn print(row: &ServerRow, label: &str, s: Setting, threads: u32) {
    let n = row.cli_s.len();
    let mib = |b: Option<u64>| b.map_or_else(|| "?".to_owned(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
    let server_all = row.server_first_s + row.server_later_s.iter().sum::<f64>();
    let cli_all: f64 = row.cli_s.iter().sum();
    let (server_later, cli_later) = (median(&row.server_later_s), median(row.cli_s.get(1..).unwrap_or_default()));
    println!();
    println!(
        "server row: {label}, {0}x{0}, {1} steps euler, seed 42, -t {threads}: {n} requests to one sd-server against {n} sd-cli runs",
        s.side, s.steps
    );
    println!("  {:<40} {:>12} {:>12} {:>12}", "", "sd-server", "sd-cli", "server/cli");
    let line = |name: &str, a: Option<f64>, b: Option<f64>| {
        println!("  {name:<40} {:>12} {:>12} {:>12}", fmt_s(a), fmt_s(b), fmt_ratio(a, b));
    };
    line("time to the first image", Some(row.server_first_s), row.cli_s.first().copied());
    line("per later image (median)", server_later, cli_later);
    line(&format!("all {n} images"), Some(server_all), Some(cli_all));
    let first = |v: &[u64]| v.first().copied();
    let later = |v: &[u64]| v.get(1..).and_then(|l| l.iter().max().copied());
    println!(
        "  {:<40} {:>12} {:>12}",
        "weights staged anew, first",
        mib(first(&row.server_staged)),
        mib(first(&row.cli_staged))
    );
    println!(
        "  {:<40} {:>12} {:>12}",
        "weights staged anew, later (largest)",
        mib(later(&row.server_staged)),
        mib(later(&row.cli_staged))
    );
}
