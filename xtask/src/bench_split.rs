//! `cargo xtask bench-placement --split`: what a layer split over two RPC servers costs and gains.
//!
//! ```text
//! cargo xtask bench-placement --split [--runs N] [--size 256|512] [--batch N]
//! ```
//!
//! Two `sd-cli rpc-server` children on loopback, one thread each (a third, with two threads,
//! for the uneven pair); the client runs `cargo xtask bench`'s settings (SD 1.5 f16 fixture,
//! euler, cfg 7: every step evaluates a batch of two) with the text encoder and the VAE on the
//! CPU, so the figures are the UNet's. Configurations, each once per round, alternating order:
//!
//! - `one device`: `--backend diffusion=RPC0` (the baseline);
//! - `split, copies 1|2|4`: `diffusion=RPC0&RPC1` with `--pipeline-copies N` (an image's two
//!   guidance passes are at most two micro-batches: with `--batch 1`, 4 runs as 2 and shows that
//!   it costs nothing more; `--batch 2` samples two images in lockstep, four micro-batches);
//! - `uneven, by memory|speed`: the one-thread server and the two-thread one, `--pipeline-copies
//!   2`, `--split-by memory` and `speed` (the speeds measured on the first run and cached);
//! - `row split`: `diffusion=RPC0&RPC1 --split-mode row`, against `split, copies 1` on the same
//!   pair: the graph-level row split (each block matmul's rows on both servers, gathered on
//!   RPC0).
//!
//! Printed: the median step time, its ratio to the one-device run, the overlap the run
//! report gives (`pipeline_busy_secs / pipeline_wall_secs`), each device's managed high-water
//! mark, and the activation bytes crossing between devices per UNet evaluation.

use std::path::Path;

use anyhow::Result;
use sd_models::report::RunReport;

use crate::bench::{self, fmt_ratio, fmt_s, median, Size};
use crate::bench_placement::{bench_inputs, RpcServer};

/// One configuration: its name and the flags after `--rpc A,B[,C]`.
struct Config {
    name: &'static str,
    flags: &'static [&'static str],
}

const CONFIGS: [Config; 8] = [
    Config { name: "one device", flags: &["--backend", "diffusion=RPC0,te=cpu,vae=cpu"] },
    Config {
        name: "split, copies 1",
        flags: &["--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--pipeline-copies", "1"],
    },
    Config {
        name: "split, copies 2",
        flags: &["--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--pipeline-copies", "2"],
    },
    Config {
        name: "split, copies 4",
        flags: &["--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--pipeline-copies", "4"],
    },
    Config {
        name: "uneven, by memory",
        flags: &["--backend", "diffusion=RPC0&RPC2,te=cpu,vae=cpu", "--pipeline-copies", "2", "--split-by", "memory"],
    },
    Config {
        name: "uneven, by speed",
        flags: &["--backend", "diffusion=RPC0&RPC2,te=cpu,vae=cpu", "--pipeline-copies", "2", "--split-by", "speed"],
    },
    Config { name: "uneven, fast one alone", flags: &["--backend", "diffusion=RPC2,te=cpu,vae=cpu"] },
    Config { name: "row split", flags: &["--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--split-mode", "row"] },
];

/// Index of the row split in `CONFIGS`, and of the layer split it is compared with.
const ROW: usize = 7;
const LAYER: usize = 1;

/// What one run's report says, in the units printed.
#[derive(Default)]
struct Figures {
    step_s: Vec<f64>,
    overlap: Vec<f64>,
    high_water_mib: Vec<(String, f64)>,
    crossing_per_eval_mib: Vec<f64>,
    ranges: String,
}

fn figures(r: &RunReport, batch: u32, into: &mut Figures) {
    // Sampled one after the other, an image's steps are its own; in lockstep one step serves
    // every image (reported once per image): a step of the batch is their sum, or one of them.
    let lockstep = r.runner("unet").is_some_and(|u| u.stats.pipelined_runs > 0);
    let per_image = r.steps.iter().map(|s| s.seconds).collect::<Vec<_>>();
    let step =
        if lockstep || batch == 1 { median(&per_image) } else { median(&per_image).map(|m| m * f64::from(batch)) };
    into.step_s.extend(step);
    if let Some(u) = r.runner("unet") {
        let s = &u.stats;
        if s.pipeline_wall_secs > 0.0 {
            into.overlap.push(s.pipeline_busy_secs / s.pipeline_wall_secs);
        }
        // A pipelined evaluation is several runs (micro-batches); count evaluations by steps
        // (one per image and step, reported per image also in lockstep).
        let evals = (r.steps.len() as f64).max(1.0);
        into.crossing_per_eval_mib.push(s.cross_device_bytes as f64 / evals / 1048576.0);
    }
    into.high_water_mib = r
        .devices
        .iter()
        .filter(|d| d.device.starts_with("RPC"))
        .map(|d| (d.device.clone(), d.high_water_bytes as f64 / 1048576.0))
        .collect();
    if let Some(m) = r.plan.as_ref().and_then(|p| p.modules.iter().find(|m| m.module.name() == "diffusion")) {
        into.ranges = m
            .split
            .iter()
            .map(|s| match s.row_share {
                Some(share) => format!("{} rows {:.0}%", s.device, share * 100.0),
                None => format!("{} {}-{}", s.device, s.first_block, s.last_block),
            })
            .collect::<Vec<_>>()
            .join(", ");
    }
}

/// Entry point of `cargo xtask bench-placement --split`.
pub fn run(size: Size, runs: u32, batch: u32) -> Result<()> {
    let s = size.setting();
    eprintln!("bench-placement --split: building sd-cli (release)");
    let (exe, model, dir) = bench_inputs()?;
    let log = |n: &str| dir.join(format!("split-rpc-server-{n}.log"));
    let (mut a, addr_a) = RpcServer::start(&exe, 1, log("a"))?;
    let (mut b, addr_b) = RpcServer::start(&exe, 1, log("b"))?;
    let (mut c, addr_c) = RpcServer::start(&exe, 2, log("c"))?;
    let rpc = format!("{addr_a},{addr_b},{addr_c}");
    // The speeds of the uneven pair are measured once, into a cache of this benchmark's own.
    let cache = dir.join("split-cache");
    std::fs::remove_dir_all(&cache).ok();
    let mut results: Vec<Figures> = (0..CONFIGS.len()).map(|_| Figures::default()).collect();
    for round in 0..runs {
        let mut order: Vec<usize> = (0..CONFIGS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for k in order {
            let cfg = &CONFIGS[k];
            let out = dir.join(format!("split-{k}-{}-{round}.png", s.side));
            let mut cmd = bench::our_command(&exe, &model, s, 2, &out);
            cmd.args(["--rpc", &rpc]).args(cfg.flags).env("SD_CACHE_DIR", &cache);
            if batch > 1 {
                cmd.args(["-b", &batch.to_string()]);
            }
            eprintln!("bench-placement --split: {0}x{0} round {1}/{runs}: {2}", s.side, round + 1, cfg.name);
            let m = bench::run_measured(&mut cmd)?;
            m.check(cfg.name)?;
            for server in [&mut a, &mut b, &mut c] {
                server.check_alive()?;
            }
            figures(&bench::read_report(&bench::report_path(&out))?, batch, &mut results[k]);
        }
    }
    print(&results, s.side, s.steps, runs, batch, Path::new(&cache));
    Ok(())
}

fn print(results: &[Figures], side: u32, steps: u32, runs: u32, batch: u32, cache: &Path) {
    println!(
        "\nsd15 f16 fixture, {side}x{side}, {steps} steps euler, cfg 7, {batch} image(s) ({} samples per step), te and vae on the CPU; \
         RPC0 and RPC1: one thread each, RPC2: two threads; {runs} round(s); a step's time covers every image",
        2 * batch
    );
    println!("| configuration | step (median) | vs one device | overlap | crossing per step | high-water | ranges |");
    println!("|---|---|---|---|---|---|---|");
    let base = median(&results[0].step_s);
    for (cfg, r) in CONFIGS.iter().zip(results) {
        let step = median(&r.step_s);
        let hw: Vec<String> = r.high_water_mib.iter().map(|(d, m)| format!("{d} {m:.0} MiB")).collect();
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            cfg.name,
            fmt_s(step),
            fmt_ratio(base, step),
            median(&r.overlap).map_or_else(|| "-".into(), |o| format!("{o:.2}")),
            median(&r.crossing_per_eval_mib).map_or_else(|| "-".into(), |b| format!("{b:.1} MiB")),
            hw.join(", "),
            if r.ranges.is_empty() { "-" } else { &r.ranges },
        );
    }
    let (row, layer) = (median(&results[ROW].step_s), median(&results[LAYER].step_s));
    println!("row split step / layer split (copies 1) step on the same two servers: {}", fmt_ratio(row, layer));
    println!("(speeds cached in {})", cache.display());
}
