//! `cargo xtask fixture`: write a checkpoint with a real family's layout and random weights.
//!
//! ```text
//! cargo xtask fixture sd15|sd21|sd-turbo [--seed N] [--type f32|f16|q8_0|q5_0|q4_0]
//!                     [-o FILE.safetensors|FILE.gguf] [--only unet,text,vae] [--std S]
//! ```
//!
//! Defaults: seed 42, type f16, output the fixture cache entry of that family, seed and type
//! (`sd_models::fixture::cached_path`, shared with `sd-cli` and the tests), whose
//! extension is `gguf` for quantized types and `safetensors` otherwise; with `-o` the
//! extension chooses the format. A modified fixture (`--only`, `--std`, `--std-everywhere`,
//! `--plain-norms`) needs `-o`, so that it never takes a plain fixture's cache entry. `--only` keeps some components
//! (file metadata unchanged), for small files in tests. `--std S` draws every weight and
//! embedding N(0, S) instead of the scaled initialisation (a checkpoint as a naive generator
//! writes it, for parity runs on weights this project's fixtures do not have);
//! `--std-everywhere` does the same to biases and norms; `--plain-norms` makes biases 0 and
//! norm gains 1, as PyTorch initialises them. The generation itself lives in
//! `sd_models::fixture`; this is only argument handling.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use sd_models::fixture::{self, Component, Family, FileFormat, FixtureRequest, WeightType};

const USAGE: &str = "usage: cargo xtask fixture sd15|sd21|sd-turbo [--seed N] [--type f32|f16|q8_0|q5_0|q4_0] [-o FILE.safetensors|FILE.gguf] [--only unet,text,vae] [--std S [--std-everywhere]] [--plain-norms]";

/// Parsed command line.
#[derive(Debug, PartialEq)]
struct Args {
    family: Family,
    seed: u64,
    wtype: WeightType,
    output: Option<PathBuf>,
    only: Option<Vec<Component>>,
    std: Option<f64>,
    std_everywhere: bool,
    plain_norms: bool,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut family = None;
    let mut seed = 42u64;
    let mut wtype = WeightType::F16;
    let mut output = None;
    let mut only = None;
    let mut std = None;
    let mut std_everywhere = false;
    let mut plain_norms = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().with_context(|| format!("{flag} needs a value\n{USAGE}")).cloned();
        match arg.as_str() {
            "--seed" | "-s" => {
                let v = value(arg)?;
                seed = v.parse().with_context(|| format!("--seed '{v}' is not a non-negative integer"))?;
            }
            "--type" => {
                let v = value(arg)?;
                wtype = WeightType::parse(&v).ok_or_else(|| fixture::FixtureError::UnknownType(v.clone()))?;
            }
            "-o" | "--output" => output = Some(PathBuf::from(value(arg)?)),
            "--only" => {
                let v = value(arg)?;
                let list = v
                    .split(',')
                    .map(|c| {
                        Component::from_short_name(c.trim())
                            .with_context(|| format!("--only: unknown component '{c}' (accepted: unet, text, vae)"))
                    })
                    .collect::<Result<Vec<_>>>()?;
                only = Some(list);
            }
            "--std" => {
                let v = value(arg)?;
                let s: f64 = v
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0)
                    .with_context(|| format!("--std '{v}': a positive standard deviation such as 0.02"))?;
                std = Some(s);
            }
            "--std-everywhere" => std_everywhere = true,
            "--plain-norms" => plain_norms = true,
            "-h" | "--help" => bail!("{USAGE}"),
            s if s.starts_with('-') => bail!("unknown option '{s}'\n{USAGE}"),
            s if family.is_none() => family = Some(Family::parse(s)?),
            s => bail!(
                "unexpected argument '{s}' (the family is already '{}')\n{USAGE}",
                family.map_or("", Family::name)
            ),
        }
    }
    let family = family.with_context(|| format!("no family given\n{USAGE}"))?;
    if std_everywhere && std.is_none() {
        bail!("--std-everywhere needs --std S\n{USAGE}");
    }
    if std_everywhere && plain_norms {
        bail!("--std-everywhere and --plain-norms contradict each other\n{USAGE}");
    }
    Ok(Args { family, seed, wtype, output, only, std, std_everywhere, plain_norms })
}

/// Entry point of `cargo xtask fixture ...` (`args` excludes the subcommand name).
pub fn run(args: &[String]) -> Result<()> {
    let args = parse(args)?;
    let (path, format) = match &args.output {
        Some(p) => (p.clone(), FileFormat::from_path(p)?),
        None => {
            if args.only.is_some() || args.std.is_some() || args.std_everywhere || args.plain_norms {
                bail!("a modified fixture (--only, --std, --std-everywhere, --plain-norms) needs -o FILE\n{USAGE}");
            }
            let dir = fixture::cache_dir();
            std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
            (fixture::cached_path(args.family, args.seed, args.wtype), FileFormat::for_type(args.wtype))
        }
    };
    let mut req = FixtureRequest::family(args.family, args.seed, args.wtype, format);
    if let Some(only) = &args.only {
        req.arch = req.arch.only(only);
    }
    req.weight_std = args.std;
    req.std_everywhere = args.std_everywhere;
    req.plain_norms = args.plain_norms;
    let start = Instant::now();
    let report = fixture::write_fixture(&path, &req)?;
    println!(
        "wrote {} ({} fixture, seed {}, {}{}): {} tensors, {:.2} M parameters, {:.1} MiB in {:.1} s",
        report.path.display(),
        args.family.name(),
        args.seed,
        args.wtype,
        args.std.map(|s| format!(", weights N(0, {s})")).unwrap_or_default(),
        report.tensors,
        report.params as f64 / 1e6,
        report.bytes as f64 / (1024.0 * 1024.0),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_args as args;

    #[test]
    fn parses_the_documented_command_line() {
        let a = parse(&args("sd21 --seed 7 --type q8_0 -o m.gguf --only unet,vae --std 0.05")).unwrap();
        assert_eq!(
            a,
            Args {
                family: Family::Sd21,
                seed: 7,
                wtype: WeightType::Q8_0,
                output: Some("m.gguf".into()),
                only: Some(vec![Component::Diffusion, Component::Vae]),
                std: Some(0.05),
                std_everywhere: false,
                plain_norms: false,
            }
        );
        let d = parse(&args("sd-turbo")).unwrap();
        assert_eq!((d.seed, d.wtype, d.output, d.only, d.std), (42, WeightType::F16, None, None, None));
    }

    #[test]
    fn rejects_bad_command_lines_with_the_reason() {
        for (line, needle) in [
            ("", "no family"),
            ("sdxl", "sdxl"),
            ("sd15 --type q3_k", "q3_k"),
            ("sd15 --seed -1", "--seed"),
            ("sd15 --seed", "needs a value"),
            ("sd15 --only unet,clip", "clip"),
            ("sd15 sd21", "unexpected argument"),
            ("sd15 --fast", "--fast"),
            ("sd15 --std 0", "--std"),
            ("sd15 --std x", "--std"),
            ("sd15 --std-everywhere", "needs --std"),
        ] {
            let e = parse(&args(line)).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }
}
