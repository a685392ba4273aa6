//! `cargo xtask parity`: our text encoder, UNet, VAE and whole generations against stable-diffusion.cpp.
//!
//! ```text
//! cargo xtask parity [sd15|sd21|all] [--threads N]
//! cargo xtask parity [sd15|sd21|all] --write-test-data [--test-data-dir DIR]
//! cargo xtask parity --fuzz N --model PATH [--seed S]   (random cases: xtask/src/fuzz.rs)
//! cargo xtask parity samplers ...   (every sampler and scheduler: see xtask/src/parity_samplers.rs)
//! cargo xtask parity ops ...        (each ggml op, ours against the reference's: xtask/src/parity_ops.rs)
//! ```
//!
//! For each family, on the cached fixture (`sd_models::fixture::cached_path`, seed 42,
//! f16; written if missing, as `cargo xtask fixture <family>` would),
//! the reference runs as its own process (`sdref`, xtask/reference) and ours in
//! this process (components) or as `sd-cli` (whole generations):
//!
//! - (a) text: the conditioning of [`PROMPT`] (ours: `encode_prompt`; ref:
//!   `sdref encode-text`), and of [`WEIGHTED_PROMPT`], which adds attention
//!   weights and `BREAK` (two 77-token chunks);
//! - (b) UNet: one evaluation on a pseudo-random latent `[1, 4, 32, 32]` (written
//!   to a file for both) at timestep 999, with the reference's conditioning as
//!   the context of both, so that (a) does not leak into (b);
//! - (c) VAE: the decode of another pseudo-random latent `[1, 4, 32, 32]`
//!   (diffusion space; both divide by 0.18215), before clamping;
//! - (d) image: `txt2img` 256x256, 4 steps euler, cfg 7, seed 42, rng cuda, PNGs.
//!
//! Every comparison prints the max and mean absolute difference, the scale of
//! the reference output (max |ref| and its standard deviation), the relative
//! errors `rel_rms = rms(ours - ref) / rms(ref)` and `rel_max = max|ours - ref| /
//! max|ref|`, and PASS/FAIL. The command exits non-zero when any check fails.
//!
//! # Tolerances
//!
//! Images (d): the issue's bound, in 8-bit levels, mean |diff| <= 1 and max <= 8.
//!
//! Tensors (a)-(c): both programs run the same f16 weights through ggml's CPU
//! kernels. The only rounding that is large compared with f32 is f16: ggml's
//! `mul_mat` with an f16 weight first converts the f32 activations to f16 (its
//! `vec_dot_type`), and a convolution with an f16 kernel does the same through
//! `im2col` to f16. Each such rounding point has a unit roundoff of
//! `u = 2^-11 ~ 4.9e-4`. Two programs that feed bit-identical f32 values to a
//! rounding point round them identically; they differ where their f32 values
//! already differ (accumulation order: SIMD width, thread split, ggml version,
//! fused or unfused ops, which give differences of order 1e-7 relative), and
//! such a difference is amplified to a whole f16 step (up to `2u` relative) in
//! the elements where it crosses a rounding boundary. So each rounding point
//! adds at most about `u` of relative error; the layers are normalised (layer
//! or group norm before every block, residual sums), so errors from successive
//! points add like a random walk rather than multiply: after `N` points the
//! relative RMS error is at most about `u * sqrt(N)`. We allow a factor 4 on
//! that (rounding points the count below misses, e.g. attention softmax inputs
//! and sd.cpp's f16 KV casts, and the amplification of the layer norms over
//! random weights):
//!
//! `rel_rms <= 4 u sqrt(N)`, and, for the worst element, `rel_max <= 8 u sqrt(N)`
//! (a few-sigma tail of the same error, measured against the largest output).
//!
//! `N` counts the rounded matmul/conv inputs on the longest path:
//! - CLIP: 4 per layer (qkv, out projection, fc1, fc2): ViT-L/14, 12 layers:
//!   N = 48; OpenCLIP ViT-H/14 up to the penultimate layer, 23 layers: N = 92;
//! - UNet: 2 convs per ResNet block (22 blocks: 2 per down level, 2 mid, 3 per
//!   up level) and its timestep-embedding linear (one point each), 8 per
//!   transformer block (proj_in, q/k/v, out, cross q, cross out, GEGLU in,
//!   GEGLU out, proj_out; 16 blocks), the 6 down/up samplers and
//!   conv_in/out: N ~ 44 + 22 + 128 + 8 = 202;
//! - VAE decoder: post_quant_conv, conv_in, mid (2 ResNet blocks, attention with
//!   q/k/v/out), 4 levels x 3 ResNet blocks x 2 convs, 3 upsample convs,
//!   conv_out: N ~ 1 + 1 + 4 + 2 + 24 + 3 + 1 = 36.
//!
//! Resulting bounds (rel_rms / rel_max): CLIP-L 1.4e-2 / 2.7e-2, CLIP-H 1.9e-2 /
//! 3.7e-2, UNet 2.8e-2 / 5.6e-2, VAE 1.2e-2 / 2.3e-2. They are bounds, not
//! expectations. When this command was written (2 threads, f16 fixtures) the
//! observed rel_rms were 1.6e-3 (CLIP-L), 1.8e-3 (CLIP-H), 2.6e-3 / 3.6e-4
//! (UNet SD1 / SD2) and 2.4e-3 (VAE): 5 to 80 times inside the bounds, and
//! the differences are uncorrelated with the values (no scale or offset
//! error), as rounding noise should be. The 256x256 PNGs differed by at most
//! 2 levels, 0.2 on average.

//!
//! The code, one job per module: `tools` (fixtures and the release `sd-cli`), `compare`
//! (differences, tolerances, report rows), `files` (what both programs read and write),
//! `ours` (our components in process), `checks` (the reference's side and the checks).

mod checks;
mod compare;
mod files;
mod ours;
mod tools;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use sd_models::fixture::FixtureModel;

use crate::reference;
pub(crate) use checks::run_ok;
use checks::{check_family, write_test_data};
pub(crate) use compare::*;
pub(crate) use files::*;
pub(crate) use ours::*;
pub use tools::{build_sd_cli, ensure_fixture};

/// The prompt of the text check (a) and the whole generation (d).
pub const PROMPT: &str = "a photo of a cat";
/// A prompt with attention weights and two chunks, for the tokenizer and weighting path.
pub const WEIGHTED_PROMPT: &str = "a (photo:1.3) of a [cat], ((masterpiece)) BREAK studio lighting";
/// The UNet's timestep in (b): the first step of a 1000-step discrete schedule.
pub(crate) const TIMESTEP: f32 = 999.0;
/// Latent size of (b) and (c): a 256x256 image.
pub(crate) const LATENT_SIDE: usize = 32;
/// f16's unit roundoff, 2^-11.
pub(crate) const F16_U: f64 = 1.0 / 2048.0;

/// `cargo xtask parity` flags: the families to check, or `samplers`, or the fuzz harness
/// (`--fuzz N`, its flags in [`crate::fuzz::Flags`]).
#[derive(clap::Args, Debug, PartialEq)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<ParityCommand>,
    /// Families to check (default: all).
    #[arg(value_enum, conflicts_with = "fuzz_mode")]
    family: Option<Families>,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Write the CI test inputs (reference PNGs) instead of checking.
    #[arg(long = "write-test-data", conflicts_with = "fuzz_mode")]
    write_test_data: bool,
    /// Where --write-test-data writes (default: tests/data).
    #[arg(long = "test-data-dir", value_name = "DIR")]
    test_data_dir: Option<PathBuf>,
    #[command(flatten)]
    fuzz: crate::fuzz::Flags,
}

/// `cargo xtask parity <command>`.
#[derive(clap::Subcommand, Debug, PartialEq)]
enum ParityCommand {
    /// Every sampling method and scheduler: sd-cli against the reference, per case.
    Samplers(crate::parity_samplers::Args),
    /// Each ggml op our models use, ours against the reference's ggml, bit for bit.
    Ops(crate::parity_ops::Args),
    /// Our T5-XXL encoder against the reference's on a full `--t5xxl` file.
    T5(crate::parity_t5::Args),
    /// Our Qwen3 LLM encoder against the reference's on one `--llm` file (Z-Image's tokens).
    Qwen3(crate::parity_qwen3::Args),
    /// Our FLUX transformer against the reference's on one diffusion-model file.
    FluxDit(crate::parity_flux::Args),
    /// Our Chroma transformer against the reference's (masked and unmasked), on one file.
    Chroma(crate::parity_chroma::Args),
    /// Our FLUX.1 VAE decode against the reference's (needs a FLUX.1 diffusion model file).
    FluxVae(crate::parity_flux_vae::Args),
    /// Our ESRGAN upscaler against the reference's (`-M upscale`), whole and tiled.
    Esrgan(crate::parity_esrgan::Args),
    /// A whole Z-Image generation (DiT, Qwen3 `--llm`, FLUX VAE), ours against the reference's.
    Zimage(crate::parity_zimage::Args),
    /// Whole SD3 / SD3.5 generations (MMDiT, its three encoders, its VAE), ours against the reference's.
    Sd3(crate::parity_sd3::Args),
    /// Whole FLUX.2 klein generations (DiT, Qwen3 `--llm`, FLUX.2 VAE), ours against the reference's.
    Flux2(crate::parity_flux2::Args),
}

/// The positional family argument.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Families {
    Sd15,
    Sd21,
    All,
}

impl Args {
    /// The fuzz harness's flags.
    #[cfg(test)]
    pub(crate) fn fuzz_flags(&self) -> &crate::fuzz::Flags {
        &self.fuzz
    }

    /// `--threads`.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> u32 {
        self.threads
    }

    fn families(&self) -> Vec<FixtureModel> {
        match self.family.unwrap_or(Families::All) {
            Families::Sd15 => vec![FixtureModel::Sd15],
            Families::Sd21 => vec![FixtureModel::Sd21],
            Families::All => vec![FixtureModel::Sd15, FixtureModel::Sd21],
        }
    }
}

/// Entry point of `cargo xtask parity ...`: `samplers`, the fuzz harness, or the checks.
pub fn run(args: Args) -> Result<()> {
    match args.command {
        Some(ParityCommand::Samplers(a)) => return crate::parity_samplers::run(a),
        Some(ParityCommand::Ops(a)) => return crate::parity_ops::run(a),
        Some(ParityCommand::T5(a)) => return crate::parity_t5::run(a),
        Some(ParityCommand::Qwen3(a)) => return crate::parity_qwen3::run(a),
        Some(ParityCommand::FluxDit(a)) => return crate::parity_flux::run(a),
        Some(ParityCommand::Chroma(a)) => return crate::parity_chroma::run(a),
        Some(ParityCommand::FluxVae(a)) => return crate::parity_flux_vae::run(a),
        Some(ParityCommand::Esrgan(a)) => return crate::parity_esrgan::run(a),
        Some(ParityCommand::Zimage(a)) => return crate::parity_zimage::run(a),
        Some(ParityCommand::Sd3(a)) => return crate::parity_sd3::run(a),
        Some(ParityCommand::Flux2(a)) => return crate::parity_flux2::run(a),
        None => {}
    }
    if args.fuzz.active() {
        return crate::fuzz::run(&args.fuzz, args.threads);
    }
    let families = args.families();
    let test_data_dir = args.test_data_dir.clone().unwrap_or_else(|| crate::workspace_root().join("tests/data"));
    eprintln!("parity: building the reference and sd-cli (release)");
    let sdref_exe = reference::build()?;
    let ours_exe = build_sd_cli()?;
    let start = Instant::now();
    let mut rows = Vec::new();
    if args.write_test_data {
        for &f in &families {
            let row = write_test_data(f, args.threads, &sdref_exe, &ours_exe, &test_data_dir)?;
            row.print();
            rows.push(row);
        }
    } else {
        let cpu = Cpu::new(args.threads)?;
        for &f in &families {
            rows.extend(check_family(f, args.threads, &sdref_exe, &ours_exe, &cpu)?);
        }
    }
    println!("\nparity summary ({} threads, {:.0} s):", args.threads, start.elapsed().as_secs_f64());
    for r in &rows {
        r.print();
    }
    let failed = rows.iter().filter(|r| !r.pass()).count();
    if failed > 0 {
        bail!("{failed} of {} parity checks failed", rows.len());
    }
    println!("all {} parity checks passed", rows.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_line() {
        let parse = crate::parse_test::<Args>;
        let a = parse("sd21 --threads 4").unwrap();
        assert_eq!((a.families(), a.threads, a.write_test_data), (vec![FixtureModel::Sd21], 4, false));
        let d = parse("").unwrap();
        assert_eq!((d.families(), d.threads), (vec![FixtureModel::Sd15, FixtureModel::Sd21], 2));
        let w = parse("all --write-test-data --test-data-dir /tmp/x").unwrap();
        assert!(w.write_test_data);
        assert_eq!(w.test_data_dir, Some(PathBuf::from("/tmp/x")));
        assert!(matches!(parse("samplers --steps 3").unwrap().command, Some(ParityCommand::Samplers(_))));
        assert!(parse("--fuzz 2 --model m").unwrap().fuzz.active());
        for (line, needle) in [
            ("sdxl", "sdxl"),
            ("sd15 sd21", "sd21"),
            ("--threads 0", "--threads"),
            ("--quick", "--quick"),
            ("--text-only", "--fuzz"),
        ] {
            let e = parse(line).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }
}
