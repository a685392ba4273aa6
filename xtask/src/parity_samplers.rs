//! `cargo xtask parity samplers`: every sampling method and scheduler, ours against the reference.
//!
//! ```text
//! cargo xtask parity samplers [--steps N] [--side PX] [--threads N] [--only NAME|METHOD/SCHEDULER,...]
//!                             [--write-test-data [--test-data-dir DIR]]
//! ```
//!
//! On the SD 1.5 fixture (seed 42, f16), `sdref txt2img` and our `sd-cli` generate the same
//! image (prompt "a cat", cfg 7, seed 42, rng cuda, default eta) for each case of [`cases`]:
//! every method with its default scheduler and with `karras`, and every scheduler not covered
//! that way with `euler`. Each PNG pair must agree within the project's bound (mean |diff| <= 1,
//! max <= 8 levels, see `parity/mod.rs`). Per case it prints the differences and the two
//! programs' wall times; it exits non-zero if any case fails.
//!
//! Measured when this was written (all 44 cases, 64x64, 4 steps, 2 threads): every case PASS,
//! mean |diff| 0.14-0.21 levels, max 1-2 levels; both programs 3.6-5 s per image. The step
//! arithmetic itself is compared bit for bit with the reference's own code in
//! `crates/sd-sampling/src/tests.rs`.
//!
//! `--write-test-data` writes the reference PNGs of [`TEST_DATA_CASES`] (64x64, 3 steps) to
//! `tests/data/ref-sd15-f16-seed42-64x64-<method>-<scheduler>3-cfg7.png` for
//! `crates/sd-cli/tests/generate.rs`, then checks ours against them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::fixture::FixtureModel;
use sd_models::sampling::{SampleMethod, Scheduler};

use crate::parity::{build_sd_cli, ensure_fixture, png_diff, run_ok, Row, Tolerance};
use crate::reference;

/// The (method, scheduler) pairs the CI test checks with committed reference PNGs: new methods
/// of different kinds (multistep, two-stage, SDE, CFG++, TCD) and new schedulers.
const TEST_DATA_CASES: [(SampleMethod, Scheduler); 5] = [
    (SampleMethod::Ipndm, Scheduler::Karras),
    (SampleMethod::Res2s, Scheduler::Discrete),
    (SampleMethod::ErSde, Scheduler::Ays),
    (SampleMethod::EulerACfgPp, Scheduler::Gits),
    (SampleMethod::Tcd, Scheduler::Lcm),
];

/// The file name of a test-data PNG.
fn test_data_name(method: SampleMethod, scheduler: Scheduler, steps: u32) -> String {
    format!("ref-sd15-f16-seed42-64x64-{}-{}{steps}-cfg7.png", method.name(), scheduler.name())
}

/// Every method with its default scheduler and with karras; then each scheduler not used yet,
/// with euler.
pub fn cases() -> Vec<(SampleMethod, Scheduler)> {
    let mut out = Vec::new();
    for m in SampleMethod::ALL {
        out.push((m, m.default_scheduler()));
        if m.default_scheduler() != Scheduler::Karras {
            out.push((m, Scheduler::Karras));
        }
    }
    for s in Scheduler::ALL {
        if !out.iter().any(|&(_, used)| used == s) {
            out.push((SampleMethod::Euler, s));
        }
    }
    out
}

/// `cargo xtask parity samplers` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// Sampling steps.
    #[arg(long = "steps", value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Image side in pixels, a multiple of 8.
    #[arg(long = "side", value_name = "PX", default_value_t = 64, value_parser = side)]
    side: u32,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Only these cases: sampling methods, schedulers or METHOD/SCHEDULER pairs.
    #[arg(long = "only", value_name = "NAME,...", value_delimiter = ',', value_parser = case_filter)]
    only: Option<Vec<String>>,
    /// Write the reference PNGs of the CI test, then check ours against them.
    #[arg(long = "write-test-data")]
    write_test_data: bool,
    /// Where --write-test-data writes (default: tests/data).
    #[arg(long = "test-data-dir", value_name = "DIR")]
    test_data_dir: Option<PathBuf>,
}

fn side(v: &str) -> Result<u32, String> {
    let n: u32 = v.parse().ok().filter(|&n| n > 0).ok_or_else(|| format!("{v}: a positive integer"))?;
    if !n.is_multiple_of(8) {
        return Err(format!("{n}: a multiple of 8"));
    }
    Ok(n)
}

/// One `--only` entry, checked: a method, a scheduler or METHOD/SCHEDULER.
fn case_filter(name: &str) -> Result<String, String> {
    let known = match name.split_once('/') {
        Some((m, s)) => m.parse::<SampleMethod>().is_ok() && s.parse::<Scheduler>().is_ok(),
        None => name.parse::<SampleMethod>().is_ok() || name.parse::<Scheduler>().is_ok(),
    };
    if !known {
        return Err(format!("--only {name}: neither a sampling method, a scheduler nor METHOD/SCHEDULER"));
    }
    Ok(name.to_owned())
}

/// `txt2img` flags shared by both programs for one case.
fn flags(method: SampleMethod, scheduler: Scheduler, side: u32, steps: u32, threads: u32) -> Vec<String> {
    let side = side.to_string();
    let steps = steps.to_string();
    let threads = threads.to_string();
    [
        "-p",
        "a cat",
        "-W",
        &side,
        "-H",
        &side,
        "--steps",
        &steps,
        "--sampling-method",
        method.name(),
        "--scheduler",
        scheduler.name(),
        "--cfg-scale",
        "7",
        "-s",
        "42",
        "-t",
        &threads,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

/// Runs both programs on one case; returns the comparison and both wall times.
fn run_case(
    sdref: &Path,
    ours: &Path,
    model: &Path,
    flags: &[String],
    ref_png: &Path,
    ours_png: &Path,
) -> Result<(Row, f64, f64)> {
    let mut c = Command::new(sdref);
    c.arg("txt2img").arg("-m").arg(model).args(flags).arg("-o").arg(ref_png);
    let t_ref = run_ok(c, "sdref txt2img")?;
    let mut c = Command::new(ours);
    c.arg("-m").arg(model).args(flags).arg("-o").arg(ours_png).env("NO_COLOR", "1");
    let t_ours = run_ok(c, "sd-cli")?;
    let (diff, shape) = png_diff(ours_png, ref_png)?;
    Ok((Row { family: "sd15", what: String::new(), shape, diff, tol: Tolerance::PNG }, t_ref, t_ours))
}

/// Entry point of `cargo xtask parity samplers ...` (`args` excludes `parity samplers`).
pub fn run(a: Args) -> Result<()> {
    let test_data_dir = a.test_data_dir.clone().unwrap_or_else(|| crate::workspace_root().join("tests/data"));
    let sdref = reference::build()?;
    let ours = build_sd_cli()?;
    let model = ensure_fixture(FixtureModel::Sd15)?;
    let work = crate::workspace_root().join("target/parity/samplers");
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let start = Instant::now();
    let mut rows: Vec<(Row, f64, f64)> = Vec::new();
    if a.write_test_data {
        std::fs::create_dir_all(&test_data_dir)
            .with_context(|| format!("cannot create {}", test_data_dir.display()))?;
        const STEPS: u32 = 3;
        for (m, s) in TEST_DATA_CASES {
            let file = test_data_dir.join(test_data_name(m, s, STEPS));
            let f = flags(m, s, 64, STEPS, a.threads);
            let ours_png = work.join(format!("test-data-{}-{}.ours.png", m.name(), s.name()));
            let (mut row, tr, to) = run_case(&sdref, &ours, &model, &f, &file, &ours_png)?;
            row.what = format!("{m} {s} {STEPS}");
            println!("wrote {}", file.display());
            row.print_timed(tr, to);
            rows.push((row, tr, to));
        }
    } else {
        let selected = |m: SampleMethod, s: Scheduler| match &a.only {
            None => true,
            Some(names) => {
                names.iter().any(|n| n == m.name() || n == s.name() || *n == format!("{}/{}", m.name(), s.name()))
            }
        };
        for (m, s) in cases().into_iter().filter(|&(m, s)| selected(m, s)) {
            let f = flags(m, s, a.side, a.steps, a.threads);
            let stem = format!("{}-{}-{}x{}-{}", m.name(), s.name(), a.side, a.side, a.steps);
            let ref_png = work.join(format!("{stem}.ref.png"));
            let ours_png = work.join(format!("{stem}.ours.png"));
            let (mut row, tr, to) = run_case(&sdref, &ours, &model, &f, &ref_png, &ours_png)
                .with_context(|| format!("--sampling-method {m} --scheduler {s}"))?;
            row.what = format!("{m} {s}");
            row.print_timed(tr, to);
            rows.push((row, tr, to));
        }
    }
    println!(
        "\nparity samplers summary ({}x{}, {} steps, {} threads, {:.0} s):",
        a.side,
        a.side,
        a.steps,
        a.threads,
        start.elapsed().as_secs_f64()
    );
    for (r, tr, to) in &rows {
        r.print_timed(*tr, *to);
    }
    let failed = rows.iter().filter(|r| !r.0.pass()).count();
    if failed > 0 {
        bail!("{failed} of {} sampler parity cases failed", rows.len());
    }
    println!("all {} sampler parity cases passed", rows.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_cover_every_method_and_scheduler() {
        let c = cases();
        for m in SampleMethod::ALL {
            assert!(c.iter().any(|&(cm, _)| cm == m), "{m}");
        }
        for s in Scheduler::ALL {
            assert!(c.iter().any(|&(_, cs)| cs == s), "{s}");
        }
        let mut dedup = c.clone();
        dedup.sort_by_key(|&(m, s)| (m.name(), s.name()));
        dedup.dedup();
        assert_eq!(dedup.len(), c.len(), "no case twice");
    }

    #[test]
    fn parses_the_documented_command_line() {
        let parse = crate::parse_test::<Args>;
        let a = parse("--steps 3 --side 128 -t 4 --only ipndm,ays,tcd/karras").unwrap();
        assert_eq!((a.steps, a.side, a.threads), (3, 128, 4));
        assert_eq!(a.only, Some(vec!["ipndm".to_owned(), "ays".to_owned(), "tcd/karras".to_owned()]));
        assert!(parse("--only tcd/nope").is_err());
        assert!(parse("--side 100").unwrap_err().to_string().contains("multiple of 8"));
        assert!(parse("--only nope").unwrap_err().to_string().contains("--only nope"));
        assert!(parse("--steps 0").is_err());
        assert!(parse("--write-test-data").unwrap().write_test_data);
    }
}
