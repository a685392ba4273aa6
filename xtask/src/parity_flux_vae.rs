//! `cargo xtask parity flux-vae`: our FLUX.1 autoencoder against the reference's on one `--vae` file.
//!
//! ```text
//! cargo xtask parity flux-vae --diffusion-model FILE [--vae FILE] [--side N] [--threads N]
//! ```
//!
//! The reference picks its VAE configuration (16 latent channels, no quant convs, scale 0.3611
//! and shift 0.1159) from the diffusion model's version, so `sdref vae-decode` needs a FLUX.1
//! diffusion model loaded beside the VAE; any depth and width does (the reference infers its
//! blocks from the names), no text encoder is needed. The VAE defaults to the cached
//! `cargo xtask fixture flux-vae` file (seed 42, f16), written when missing. The latent is
//! standard normal in diffusion space (splitmix64 seed 0x5eed0003), so both programs also apply
//! the scale and shift; the raw decoder outputs are compared with the SD VAE's bound
//! (`Tolerance::rounding_points(VAE_POINTS)`).
//!
//! Measured when this was written (diffusion model: the 16.9 MB `flux-dev` fixture of branch
//! `fluxdit`, hidden 256, 2 double + 2 single blocks; VAE: the seed-42 f16 fixture; 2 threads):
//! 8x8 latent rel_rms 6.67e-4, rel_max 6.99e-4; 16x16 latent rel_rms 6.65e-4, rel_max 6.96e-4
//! (bound 1.2e-2 / 2.3e-2). Not run in CI (it needs that diffusion model).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context as _, Result};
use sd_models::files::{ModelFiles, ModelSources};
use sd_models::fixture::{flux_vae, FileFormat, WeightType};
use sd_models::loader::{vae_layout, FileSource};
use sd_sched::Runner;
use sd_vae::{AutoencoderKl, VaeConfig, VaeParts};

use crate::parity::{normal_values, read_raw, run_ok, write_raw, Tolerance, Verdict, VAE_POINTS};
use crate::reference;

/// `cargo xtask parity flux-vae` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// A FLUX.1 diffusion model (any depth): the reference needs one to choose the FLUX VAE.
    #[arg(long = "diffusion-model", value_name = "FILE")]
    diffusion_model: PathBuf,
    /// The VAE (default: the flux-vae fixture of the cache, written when missing).
    #[arg(long = "vae", value_name = "FILE")]
    vae: Option<PathBuf>,
    /// Latent side (the image is 8 times larger).
    #[arg(long = "side", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=128))]
    side: u32,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
}

/// Entry point of `cargo xtask parity flux-vae`.
pub fn run(args: Args) -> Result<()> {
    let vae_path = match &args.vae {
        Some(p) => p.clone(),
        None => {
            let p = flux_vae::cached_flux_vae_path(42, WeightType::F16);
            if !p.exists() {
                let dir = sd_models::fixture::cache_dir();
                std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
                flux_vae::write_flux_vae(&p, 42, WeightType::F16, FileFormat::Safetensors)?;
            }
            p
        }
    };
    let exe = reference::build()?;
    let dir = std::env::temp_dir().join(format!("parity-flux-vae-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let side = args.side as usize;
    let shape = [1, 16, side, side];
    let z = normal_values(0x5eed_0003, shape.iter().product());
    let z_path = dir.join("flux_vae_z.f32");
    write_raw(&z_path, &shape, &z, "diffusion-space FLUX latent, standard normal, splitmix64 seed 0x5eed0003")?;

    let out = dir.join("flux_vae.ref.f32");
    let mut c = Command::new(&exe);
    c.arg("vae-decode")
        .arg("--diffusion-model")
        .arg(&args.diffusion_model)
        .arg("--vae")
        .arg(&vae_path)
        .args(["-t", &args.threads.to_string(), "--latent"])
        .arg(&z_path)
        .args(["--latent-shape", &format!("1,16,{side},{side}"), "-o"])
        .arg(&out);
    let ref_s = run_ok(c, "sdref vae-decode")?;
    let (ref_shape, reference) = read_raw(&out)?;

    let t = Instant::now();
    let cpu = crate::parity::Cpu::new(args.threads)?;
    let files = ModelFiles::open(&ModelSources { vae: Some(vae_path.clone()), ..Default::default() })?;
    let cfg = VaeConfig::flux();
    cfg.check_layout(&vae_layout(&files)?)?;
    let vae = AutoencoderKl::load(
        cfg.clone(),
        VaeParts::DecoderOnly,
        &FileSource::new(&files),
        cpu.backend.device().buffer_type(),
    )?;
    let mut runner = Runner::new("vae", cpu.backend.clone());
    let mut zv = z.clone();
    cfg.diffusion_to_vae(&mut zv);
    let ours = vae.decode(&mut runner, &zv, (side, side), cfg.z_channels)?;
    let ours_s = t.elapsed().as_secs_f64();
    write_raw(&dir.join("flux_vae.ours.f32"), &ref_shape, &ours, "our FLUX VAE output").ok();

    let v = Verdict::of(&ours, &reference, Tolerance::rounding_points(VAE_POINTS))?;
    println!("flux-vae decode {ref_shape:?}: {}  sdref {ref_s:.1} s  ours {ours_s:.1} s  {}", v.figures, v.word());
    let _ = std::fs::remove_dir_all(&dir);
    if !v.pass {
        anyhow::bail!("the FLUX VAE decode is outside the bound");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_line() {
        let a: Args = crate::parse_test("--diffusion-model f.safetensors --side 4 -t 3").unwrap();
        assert_eq!((a.diffusion_model, a.vae, a.side, a.threads), (PathBuf::from("f.safetensors"), None, 4, 3));
        assert!(crate::parse_test::<Args>("--vae ae.safetensors").is_err(), "--diffusion-model is required");
        assert!(crate::parse_test::<Args>("--diffusion-model f --side 0").is_err());
    }
}
