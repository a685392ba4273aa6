//! `cargo xtask profile`: where a generation's compute time goes, by ggml op and by model block.
//!
//! ```text
//! cargo xtask profile [--size 256|512] [--threads N] [--steps K] [--top N] [--plugin-dir DIR]
//! ```
//!
//! Runs `sd-cli --profile` on the SD 1.5 f16 fixture (`cargo xtask bench`'s prompt, euler,
//! cfg 7, seed 42; one step by default, so the UNet figures are one step's two evaluations)
//! and prints, per module (text encoder, UNet, VAE), the ops by time with their share, node
//! count, achieved GFLOP/s (matrix products and attention) and output bytes, then the blocks
//! by time. Profiled runs compute node by node (`sd_sched::profile`): the shares are what to
//! read, the absolute times include a launch per node.

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use sd_models::fixture::FixtureModel;
use sd_sched::profile::{Profile, ProfileEntry};

use crate::bench::{self, Size};
use crate::parity::{build_sd_cli, ensure_fixture};
use crate::workspace_root;

/// `cargo xtask profile` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// Image side: 256 or 512.
    #[arg(long = "size", value_enum, default_value_t = Size::S256)]
    size: Size,
    /// CPU threads.
    #[arg(long = "threads", short = 't', value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Sampling steps.
    #[arg(long = "steps", value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Rows of each table.
    #[arg(long = "top", value_name = "N", default_value_t = 12)]
    top: usize,
    /// A plugin directory searched first (e.g. another CPU plugin build).
    #[arg(long = "plugin-dir", value_name = "DIR")]
    plugin_dir: Option<PathBuf>,
}

/// Entry point of `cargo xtask profile`.
pub fn run(args: Args) -> Result<()> {
    let mut s = args.size.setting();
    s.steps = args.steps;
    let exe = build_sd_cli()?;
    let model = ensure_fixture(FixtureModel::Sd15)?;
    let dir = workspace_root().join("target/profile");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let out = dir.join(format!("profile-{}.png", s.side));
    let mut cmd = bench::our_command(&exe, &model, s, args.threads, &out);
    cmd.arg("--profile");
    if let Some(d) = &args.plugin_dir {
        cmd.arg("--plugin-dir").arg(d);
    }
    eprintln!("profile: {0}x{0}, {1} step(s), -t {2}", s.side, s.steps, args.threads);
    let m = bench::run_measured(&mut cmd)?;
    m.check("sd-cli --profile")?;
    let report = bench::read_report(&bench::report_path(&out))?;
    println!(
        "\nsd15 f16 fixture, {0}x{0}, {1} step(s) euler, cfg 7, -t {2}; profiled node by node (shares, not wall times)",
        s.side, s.steps, args.threads
    );
    for r in &report.runners {
        let Some(p) = &r.profile else { continue };
        print_profile(&r.name, &r.device, p, args.top);
    }
    Ok(())
}

fn print_profile(name: &str, device: &str, p: &Profile, top: usize) {
    let total: f64 = p.ops.values().map(|e| e.seconds).sum();
    println!("\n{name} on {device}: {total:.2} s in {} nodes", p.ops.values().map(|e| e.nodes).sum::<u64>());
    table("op", &p.ops, total, top);
    table("block", &p.blocks, total, top);
}

fn table(what: &str, rows: &std::collections::BTreeMap<String, ProfileEntry>, total: f64, top: usize) {
    let mut rows: Vec<(&String, &ProfileEntry)> = rows.iter().collect();
    rows.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    println!("| {what} | time | share | nodes | GFLOP/s | output MiB |");
    println!("|---|---|---|---|---|---|");
    for (k, e) in rows.iter().take(top) {
        let gflops =
            if e.flops > 0.0 && e.seconds > 0.0 { format!("{:.1}", e.flops / e.seconds * 1e-9) } else { "-".into() };
        println!(
            "| {k} | {:.3} s | {:.1}% | {} | {gflops} | {:.1} |",
            e.seconds,
            100.0 * e.seconds / total.max(1e-12),
            e.nodes,
            e.bytes_out as f64 / 1048576.0
        );
    }
    if rows.len() > top {
        let rest: f64 = rows[top..].iter().map(|(_, e)| e.seconds).sum();
        println!("| ({} more) | {rest:.3} s | {:.1}% | | | |", rows.len() - top, 100.0 * rest / total.max(1e-12));
    }
}
