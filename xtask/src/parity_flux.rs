//! `cargo xtask parity flux-dit`: our FLUX transformer against the reference's on one file.
//!
//! ```text
//! cargo xtask parity flux-dit --vae AE_FILE [--diffusion-model FILE] [--size WxH] [--tokens N]
//!                             [--timestep T] [--guidance G] [--seed N] [--threads N] [--flash]
//! ```
//!
//! Without `--diffusion-model` it writes (once, in the fixture cache) a reduced dev fixture:
//! width 256 (2 heads of 128), 2 double and 2 single blocks, f16, seed 42
//! (`sd_models::fixture::flux`). Both programs evaluate the model once on the same seeded
//! inputs: a 16-channel latent of `--size` (default 16x16, 64 image tokens), a random T5-wide
//! context of `--tokens` tokens (default 8), a random pooled vector of 768, the timestep (the
//! sampler's t in [0, 1], default 0.75; both scale it by 1000) and the guidance (dev; default
//! 3.5); `--flash` gives both programs flash attention (`--diffusion-fa`). The reference
//! runs `sdref unet` (its `FluxRunner::compute` through the diffusion dump); we run `sd_models::diffusion::flux::FluxModel::eval`. The raw outputs are compared
//! with the bound of the UNet stage, `Tolerance::rounding_points` over the f16 rounding points
//! of the longest path (`flux_points`).
//!
//! The reference refuses to load a FLUX model without a 16-channel VAE, so `--vae` names one
//! (BFL's `ae.safetensors` or a FLUX VAE fixture); it is loaded and not run. Not in CI: the
//! project has no FLUX VAE fixture writer yet.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::diffusion::flux::{FluxConfig, FluxModel};
use sd_models::files::{ModelFiles, ModelSources};
use sd_models::fixture::{flux, FileFormat, WeightType};
use sd_models::loader::{dtype_of, FileSource};
use sd_sched::Runner;

use crate::parity::{read_raw, write_raw, Tolerance, Verdict};
use crate::reference;

/// f16 rounding points on the longest path through `cfg`: the embedders' two products and
/// the final layer's two; per double block the modulation, qkv, projection and two MLP
/// products and the GELU table (6); per single block the modulation, `linear1`, the GELU
/// table and `linear2` (4). The attention products are f32 in both programs.
fn flux_points(cfg: &FluxConfig) -> u32 {
    (4 + 6 * cfg.depth + 4 * cfg.depth_single_blocks) as u32
}

/// `cargo xtask parity flux-dit` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// A FLUX diffusion model (default: the reduced fixture, written on first use).
    #[arg(long = "diffusion-model", value_name = "FILE")]
    diffusion_model: Option<PathBuf>,
    /// A 16-channel FLUX VAE, which the reference needs to load the model.
    #[arg(long = "vae", value_name = "FILE")]
    vae: PathBuf,
    /// Latent size, WxH (even numbers).
    #[arg(long = "size", default_value = "16x16", value_parser = latent_size)]
    size: (usize, usize),
    /// Context tokens.
    #[arg(long = "tokens", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=512))]
    tokens: u32,
    /// The sampler's t (sigma).
    #[arg(long = "timestep", default_value_t = 0.75)]
    timestep: f32,
    /// Distilled guidance (dev).
    #[arg(long = "guidance", default_value_t = 3.5)]
    guidance: f32,
    /// Seed of the inputs.
    #[arg(long = "seed", default_value_t = 1)]
    seed: u64,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Flash attention in both programs (the reference's `--diffusion-fa`).
    #[arg(long = "flash")]
    flash: bool,
}

/// A latent size `WxH` (even, 2 to 256 each), for the DiT parity commands.
pub(crate) fn latent_size(s: &str) -> Result<(usize, usize), String> {
    let (w, h) = s.split_once('x').ok_or("WxH, e.g. 16x16")?;
    let parse = |v: &str| v.parse::<usize>().ok().filter(|&n| n > 0 && n % 2 == 0 && n <= 256);
    match (parse(w), parse(h)) {
        (Some(w), Some(h)) => Ok((w, h)),
        _ => Err(format!("'{s}': even sizes from 2 to 256, WxH")),
    }
}

/// Approximately normal values (Irwin-Hall of 4 uniforms), seeded.
pub(crate) fn normal(seed: u64, salt: u64, n: usize) -> Vec<f32> {
    let mut s = (seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n).map(|_| ((0..4).map(|_| uniform()).sum::<f64>() - 2.0) as f32 * 3f32.sqrt()).collect()
}

/// Entry point of `cargo xtask parity flux-dit`.
pub fn run(args: Args) -> Result<()> {
    let model = match &args.diffusion_model {
        Some(p) => p.clone(),
        None => {
            let cfg = flux::reduced(256, 2, 2, false);
            let path = flux::cached_flux_path(&cfg, 42, WeightType::F16);
            if !path.is_file() {
                std::fs::create_dir_all(path.parent().context("cache path")?)?;
                flux::write_flux(&path, &cfg, 42, WeightType::F16, FileFormat::Safetensors)?;
            }
            path
        }
    };
    let exe = reference::build()?;
    let dir = std::env::temp_dir().join(format!("parity-flux-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    // Ours.
    let cpu = crate::parity::Cpu::new(args.threads)?;
    let files = ModelFiles::open(&ModelSources { diffusion_model: Some(model.clone()), ..Default::default() })?;
    let tensors: Vec<(String, Vec<u64>)> = files.index().entries().iter().map(|e| (e.name.clone(), e.ne())).collect();
    let cfg = FluxConfig::from_file(&tensors)?;
    let mut m = FluxModel::new(cfg.clone(), &dtype_of(&files), None)?;
    let unused = sd_models::diffusion::flux::validate_against_file(m.weights.specs(), &tensors)?;
    if !unused.is_empty() {
        eprintln!(
            "parity flux-dit: {} tensors of the file are not used: {:?}",
            unused.len(),
            &unused[..unused.len().min(3)]
        );
    }
    m.flash_attn = args.flash;
    m.weights.allocate(cpu.backend.device().buffer_type())?;
    m.weights.load_from(&FileSource::new(&files))?;
    let mut runner = Runner::new("flux", cpu.backend.clone());

    let (w, h) = args.size;
    let (c, l, cd, yd) =
        (cfg.latent_channels() as usize, args.tokens as usize, cfg.context_in_dim as usize, cfg.vec_in_dim as usize);
    let x = normal(args.seed, 1, c * w * h);
    let ctx = normal(args.seed, 2, l * cd);
    let y = normal(args.seed, 3, yd);
    let guidance = cfg.guidance_embed.then_some(args.guidance);
    let t = Instant::now();
    let ours = m.eval(&mut runner, &x, (w, h), args.timestep, &ctx, l, &y, guidance)?;
    let ours_s = t.elapsed().as_secs_f64();

    // The reference.
    let (xp, cp, yp, op) = (dir.join("x.f32"), dir.join("c.f32"), dir.join("y.f32"), dir.join("out.f32"));
    write_raw(&xp, &[1, c, h, w], &x, "latent")?;
    write_raw(&cp, &[1, l, cd], &ctx, "context")?;
    write_raw(&yp, &[1, yd], &y, "pooled vector")?;
    let s = |p: &PathBuf| p.to_str().map(str::to_owned).context("a temporary path is not UTF-8");
    let t = Instant::now();
    let status = Command::new(&exe)
        .args(["unet", "--diffusion-model", &s(&model)?, "--vae", &s(&args.vae)?, "--latent", &s(&xp)?])
        .args(["--context", &s(&cp)?, "--y", &s(&yp)?, "-o", &s(&op)?])
        .args(["--timestep", &args.timestep.to_string(), "--guidance", &args.guidance.to_string()])
        .args(["-t", &args.threads.to_string()])
        .args(args.flash.then_some("--diffusion-fa"))
        .status()
        .context("running sdref unet")?;
    if !status.success() {
        bail!("sdref unet failed on the FLUX model: {status}");
    }
    let ref_s = t.elapsed().as_secs_f64();
    let (shape, reference) = read_raw(&op)?;
    if shape != [1, c, h, w] {
        bail!("the reference's output has shape {shape:?}, expected [1, {c}, {h}, {w}]");
    }
    let v = Verdict::of(&ours, &reference, Tolerance::rounding_points(flux_points(&cfg)))?;
    println!(
        "flux-dit {} (width {}, {}+{} blocks{}) {w}x{h}, {l} tokens, t {}, guidance {:?}: {}  sdref {ref_s:.1} s (with loading)  ours {ours_s:.2} s  {}",
        model.display(),
        cfg.hidden_size,
        cfg.depth,
        cfg.depth_single_blocks,
        if args.flash { ", flash attention" } else { "" },
        args.timestep,
        guidance,
        v.figures,
        v.word()
    );
    let _ = std::fs::remove_dir_all(&dir);
    if !v.pass {
        bail!("the FLUX outputs differ beyond the bound");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_line() {
        let a: Args = crate::parse_test("--vae ae.safetensors --size 8x12 --tokens 4 --timestep 0.5").unwrap();
        assert_eq!((a.size, a.tokens, a.timestep, a.guidance), ((8, 12), 4, 0.5, 3.5));
        assert!(crate::parse_test::<Args>("--size 8x12").is_err(), "--vae is required");
        let e = crate::parse_test::<Args>("--vae a --size 7x8").unwrap_err();
        assert!(format!("{e:#}").contains("even"), "{e:#}");
    }

    #[test]
    fn the_points_of_full_flux() {
        // 19 double and 38 single blocks: 4 + 114 + 152.
        assert_eq!(flux_points(&FluxConfig::dev()), 270);
    }
}
