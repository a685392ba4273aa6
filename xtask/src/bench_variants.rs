//! `cargo xtask bench-variants`: each CPU variant the build offers, beside the reference, as ratios.
//!
//! ```text
//! cargo xtask bench-variants [--variants all|v1,v2] [--type f16,q8_0] [--runs N] [--threads N] [--size 256|512]
//! ```
//!
//! For every CPU variant in `target/ggml/plugins` that this CPU can run (ggml's
//! score is not 0), `sd-cli` runs the SD 1.5 fixture with `--plugin-dir` pointing
//! at a directory that holds only that variant, so the registry cannot pick
//! another one (checked: `--list-devices --json` must name that file). For
//! each weight type, the reference runs the same generation in the same
//! alternation, so load drift falls on every column. Reported per variant and
//! type: the median UNet step, the VAE decode and the whole run, and each as a
//! ratio to the reference.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};
use sd_models::fixture::FixtureModel;

use crate::bench::{
    fmt_ratio, fmt_s, median, our_command, ours_timings, parse_ref, read_report, ref_command, report_path,
    run_measured, Size,
};
use crate::parity::{build_sd_cli, ensure_fixture};
use crate::reference;
use crate::workspace_root;

/// `cargo xtask bench-variants` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// CPU variants to run: `all` (every one this CPU can run) or a list.
    #[arg(long = "variants", value_name = "all|v1,v2", default_value = "all", value_parser = variants)]
    variants: Variants,
    /// Weight types (`--type` of both programs).
    #[arg(long = "type", value_name = "f16,q8_0", value_delimiter = ',', default_value = "f16,q8_0", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    types: Vec<String>,
    /// Runs of each program per type.
    #[arg(long = "runs", value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// CPU threads of each program.
    #[arg(long = "threads", short = 't', value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Image side: 256 (4 steps) or 512 (2 steps).
    #[arg(long = "size", value_enum, default_value_t = Size::S256)]
    size: Size,
}

/// `--variants`: `None` for all.
#[derive(Clone, Debug, PartialEq)]
struct Variants(Option<Vec<String>>);

fn variants(v: &str) -> Result<Variants, String> {
    if v == "all" {
        return Ok(Variants(None));
    }
    let list: Vec<String> = v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if list.is_empty() {
        return Err("no variant named".into());
    }
    Ok(Variants(Some(list)))
}

/// The CPU variant libraries of the build, by variant name.
fn built_variants(plugin_dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(plugin_dir).with_context(|| plugin_dir.display().to_string())? {
        let p = e?.path();
        let name = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
        if let Some(v) = name.strip_prefix("libggml-cpu-").and_then(|n| n.strip_suffix(".so")) {
            out.push((v.to_string(), p));
        }
    }
    out.sort();
    Ok(out)
}

/// The plugin file sd-cli uses for the CPU device when searching only `dir`.
fn cpu_plugin_used(exe: &Path, dir: &Path) -> Result<Option<PathBuf>> {
    let m =
        run_measured(std::process::Command::new(exe).arg("--list-devices").arg("--json").arg("--plugin-dir").arg(dir))?;
    m.check("sd-cli --list-devices")?;
    let v: serde_json::Value = serde_json::from_str(&m.stdout).context("sd-cli --list-devices --json output")?;
    let devices = v["devices"].as_array().or_else(|| v.as_array()).cloned().unwrap_or_default();
    Ok(devices.iter().find(|d| d["name"] == "CPU").and_then(|d| d["plugin"].as_str().map(PathBuf::from)))
}

#[derive(Default)]
struct Cell {
    steps: Vec<f64>,
    decode: Vec<f64>,
    wall: Vec<f64>,
}

impl Cell {
    fn step(&self) -> Option<f64> {
        median(&self.steps)
    }
    fn dec(&self) -> Option<f64> {
        median(&self.decode)
    }
    fn whole(&self) -> Option<f64> {
        median(&self.wall)
    }
}

/// Entry point of `cargo xtask bench-variants ...`.
pub fn run(args: Args) -> Result<()> {
    let root = workspace_root();
    let ours_exe = build_sd_cli()?;
    let ref_exe = reference::build()?;
    let model = ensure_fixture(FixtureModel::Sd15)?;
    let plugin_dir = crate::ggml::plugin_dir();
    let dir = root.join("target/bench-variants");
    std::fs::create_dir_all(&dir)?;

    // one directory per usable variant, holding only that variant
    let mut variants = Vec::new();
    for (name, lib) in built_variants(&plugin_dir)? {
        if args.variants.0.as_ref().is_some_and(|w| !w.contains(&name)) {
            continue;
        }
        let only = dir.join(format!("plugins-{name}"));
        let _ = std::fs::remove_dir_all(&only);
        std::fs::create_dir_all(&only)?;
        let link = only.join(lib.file_name().context("plugin file name")?);
        std::os::unix::fs::symlink(&lib, &link)?;
        match cpu_plugin_used(&ours_exe, &only)? {
            Some(p) if p == link || p == lib => variants.push((name, only)),
            Some(p) => bail!("with --plugin-dir {} sd-cli used {} for the CPU", only.display(), p.display()),
            None => eprintln!("bench-variants: {name}: not usable on this CPU (score 0), skipped"),
        }
    }
    if variants.is_empty() {
        bail!("no CPU variant to measure in {}", plugin_dir.display());
    }
    let s = args.size.setting();
    let mut table: Vec<(String, String, Cell)> = Vec::new();
    for ty in &args.types {
        let mut refc = Cell::default();
        let mut cells: Vec<Cell> = variants.iter().map(|_| Cell::default()).collect();
        for run in 0..args.runs {
            // the reference first on even runs, last on odd ones
            let mut order: Vec<Option<usize>> = (0..variants.len()).map(Some).collect();
            if run % 2 == 0 {
                order.insert(0, None);
            } else {
                order.push(None);
            }
            for who in order {
                let out =
                    dir.join(format!("{}-{ty}-{run}.png", who.map_or("ref".to_string(), |i| variants[i].0.clone())));
                let (mut cmd, label) = match who {
                    Some(i) => {
                        let mut c = our_command(&ours_exe, &model, s, args.threads, &out);
                        c.arg("--plugin-dir").arg(&variants[i].1).args(["--type", ty]);
                        (c, variants[i].0.clone())
                    }
                    None => {
                        let mut c = ref_command(&ref_exe, &model, s, args.threads, &out);
                        c.args(["--type", ty]);
                        (c, "reference".to_string())
                    }
                };
                eprintln!("bench-variants: {ty} run {}/{}: {label}", run + 1, args.runs);
                let m = run_measured(&mut cmd)?;
                m.check(&label)?;
                let (t, cell) = match who {
                    Some(i) => (ours_timings(&read_report(&report_path(&out))?), &mut cells[i]),
                    None => (parse_ref(&m.stderr), &mut refc),
                };
                // each run's figures as they come, so an interrupted benchmark keeps them
                eprintln!(
                    "bench-variants: {ty} {label}: step median {}, decode {}, whole {:.2} s",
                    fmt_s(median(&t.steps_s)),
                    fmt_s(t.decode_s),
                    m.wall_s
                );
                cell.steps.extend(t.steps_s.iter().copied());
                cell.decode.extend(t.decode_s);
                cell.wall.push(m.wall_s);
            }
        }
        table.push((ty.clone(), "reference".into(), refc));
        for ((name, _), c) in variants.iter().zip(cells) {
            table.push((ty.clone(), name.clone(), c));
        }
    }
    println!(
        "\nsd15 fixture, {0}x{0}, {1} steps euler, cfg 7, -t {2}, {3} run(s) each; ratios are ours/reference of the same type",
        s.side, s.steps, args.threads, args.runs
    );
    println!(
        "{:<6} {:<16} {:>10} {:>7} {:>10} {:>7} {:>10} {:>7}",
        "type", "CPU variant", "step", "ratio", "decode", "ratio", "whole", "ratio"
    );
    for (ty, name, c) in &table {
        let r = table.iter().find(|(t, n, _)| t == ty && n == "reference").map(|(_, _, c)| c);
        let ratio = |a: Option<f64>, f: fn(&Cell) -> Option<f64>| fmt_ratio(a, r.and_then(f));
        println!(
            "{ty:<6} {name:<16} {:>10} {:>7} {:>10} {:>7} {:>10} {:>7}",
            fmt_s(c.step()),
            ratio(c.step(), Cell::step),
            fmt_s(c.dec()),
            ratio(c.dec(), Cell::dec),
            fmt_s(c.whole()),
            ratio(c.whole(), Cell::whole)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_line() {
        let parse = crate::parse_test::<Args>;
        let a = parse("--variants x64,zen4 --type q8_0 --runs 2 -t 1 --size 512").unwrap();
        assert_eq!(a.variants, Variants(Some(vec!["x64".to_string(), "zen4".to_string()])));
        assert_eq!(a.types, vec!["q8_0".to_string()]);
        assert_eq!((a.runs, a.threads, a.size.setting()), (2, 1, crate::bench::SETTING_512));
        assert_eq!(parse("--variants all").unwrap().variants, Variants(None));
        assert_eq!(parse("").unwrap().types, vec!["f16".to_string(), "q8_0".to_string()]);
        for bad in ["--runs 0", "--size 300", "--type ,", "--bogus"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn variant_files_are_recognised() {
        let d = std::env::temp_dir().join(format!("bench-variants-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        for f in ["libggml-cpu-x64.so", "libggml-cpu-zen4.so", "libggml-rpc.so", "libggml-cpu-x64.so.tmp"] {
            std::fs::write(d.join(f), b"").unwrap();
        }
        let names: Vec<String> = built_variants(&d).unwrap().into_iter().map(|(n, _)| n).collect();
        std::fs::remove_dir_all(&d).unwrap();
        assert_eq!(names, ["x64", "zen4"]);
    }
}
