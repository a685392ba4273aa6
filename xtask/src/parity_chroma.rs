//! `cargo xtask parity chroma`: our Chroma transformer against the reference's on one file.
//!
//! ```text
//! cargo xtask parity chroma [--diffusion-model FILE] [--vae FILE] [--size WxH] [--tokens N]
//!                           [--masked N] [--timestep T] [--seed N] [--threads N]
//! cargo xtask parity chroma --image [--radiance] [--diffusion-model FILE] [--vae FILE] [--t5xxl FILE]
//!                           [--threads N] [--sd-cli EXE]
//! ```
//!
//! `--radiance` evaluates Chroma1-Radiance instead (the reduced fixture in pixel space:
//! [`flux::reduced_chroma_radiance`], seed 11, N(0, 0.03), **f32**): its input is an RGB image
//! of `--size` times 8 pixels (64x64 by default: 4x4 patches of 16), and the reference loads
//! it without a VAE (its `FakeVAE`); `--x0` adds the marker of x0 files. The fixture is f32
//! because the NeRF head amplifies the transformer's f16 rounding differences: its weights are
//! generated from each patch's hidden state and L2-normalised. The same fixture in f16 differs
//! by rel_rms 1.8e-2 (over the rounding-point bound, 1.2e-2), in f32 by 1.0e-3; give an f16
//! file with `--diffusion-model` to see the drift.
//!
//! `--image` compares whole generations instead (`IMAGE_CASES`: txt2img with a weighted
//! prompt and a negative prompt, txt2img without one, img2img from the reference's image of
//! the case before), on the same files, as PNGs within the image bound (`Tolerance::PNG`). The
//! reference needs a T5-XXL with all 24 layers: without `--t5xxl` the q8_0 fixture (4.8 GB) is
//! written once in the fixture cache; a run takes 4–5 minutes per case on two cores.
//!
//! Without `--diffusion-model` it writes (once, in the fixture cache) a reduced Chroma fixture:
//! width 256 (2 heads of 128), 2 double and 2 single blocks, the released approximator (5120
//! wide, 5 layers: the reference builds that one whatever the file holds), every matrix
//! N(0, 0.02), seed 7, f16 (`sd_models::fixture::flux::write_chroma`). Without `--vae` it
//! uses the FLUX.1 VAE fixture (the reference loads a FLUX-style model only with one; it is
//! not run).
//!
//! Both programs evaluate the model on the same seeded inputs (a 16-channel latent of
//! `--size`, a random T5-wide context of `--tokens` tokens, the sampler's t), twice: with the
//! DiT mask (the last `--masked` tokens -inf, the rest 0, as the conditioner's text mask
//! marks padding) and with an all-zero mask (ours takes no mask then: the unmasked path). The
//! reference runs `sdref unet` with the mask as its `y` (Chroma's `FluxRunner` reads `y` as
//! the mask, `chroma_use_dit_mask` on by default, and fills the guidance with 0). The raw
//! outputs are compared with `Tolerance::rounding_points` over the f16 rounding points of
//! the longest path ([`chroma_points`]).

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::diffusion::flux::radiance::RadianceConfig;
use sd_models::diffusion::flux::{FluxConfig, FluxModel};
use sd_models::files::{ModelFiles, ModelSources};
use sd_models::fixture::{flux, flux_vae, FileFormat, WeightType};
use sd_models::loader::{dtype_of, FileSource};
use sd_sched::Runner;

use crate::parity::{read_raw, write_raw, Tolerance, Verdict};
use crate::reference;

/// f16 rounding points on the longest path through `cfg`: `img_in`, `txt_in` and the final
/// linear (3); the approximator's `in_proj`, two products per layer and `out_proj`; per
/// double block qkv, projection, two MLP products and the GELU table (5); per single block
/// `linear1`, the GELU table and `linear2` (3). The attention products are f32 in both.
///
/// Radiance has no final linear but its NeRF head: the embedder, one generated-weight product
/// per block (the generated matrices are f32) and the output convolution.
fn chroma_points(cfg: &FluxConfig) -> u32 {
    let layers = cfg.chroma.as_ref().map_or(0, |c| c.layers);
    // The embedder, the blocks and the convolution, less the final linear the 3 counted.
    let head = if cfg.radiance.is_some() { sd_models::diffusion::flux::radiance::NERF_DEPTH + 1 } else { 0 };
    (3 + head + 2 + 2 * layers + 5 * cfg.depth + 3 * cfg.depth_single_blocks) as u32
}

/// `cargo xtask parity chroma` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// A Chroma diffusion model (default: the reduced fixture, written on first use).
    #[arg(long = "diffusion-model", value_name = "FILE")]
    diffusion_model: Option<PathBuf>,
    /// A 16-channel FLUX VAE, which the reference needs to load the model (default: the fixture).
    #[arg(long = "vae", value_name = "FILE")]
    vae: Option<PathBuf>,
    /// Latent size, WxH (even numbers).
    #[arg(long = "size", default_value = "8x8", value_parser = crate::parity_flux::latent_size)]
    size: (usize, usize),
    /// Context tokens.
    #[arg(long = "tokens", default_value_t = 12, value_parser = clap::value_parser!(u32).range(2..=512))]
    tokens: u32,
    /// Tokens masked out (-inf) at the end of the context in the masked run.
    #[arg(long = "masked", default_value_t = 5)]
    masked: u32,
    /// The sampler's t (sigma).
    #[arg(long = "timestep", default_value_t = 0.6)]
    timestep: f32,
    /// Seed of the inputs.
    #[arg(long = "seed", default_value_t = 3)]
    seed: u64,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Whole images instead of one diffusion-model evaluation: `sd-cli` and the reference
    /// generate the same three images (txt2img with a weighted prompt and a negative prompt,
    /// txt2img without a negative prompt, img2img), compared with the image bound.
    #[arg(long = "image")]
    image: bool,
    /// Chroma1-Radiance (pixel space) instead: the reduced Radiance fixture, an RGB input of
    /// `--size` times 8 pixels, no VAE.
    #[arg(long = "radiance", conflicts_with = "vae")]
    radiance: bool,
    /// With --radiance: the fixture of an x0 file (its `__x0__` marker: the head predicts the
    /// clean image, the model returns `(x - x0) / t`).
    #[arg(long = "x0", requires = "radiance")]
    x0: bool,
    /// With --image: the T5-XXL (default: the 24-layer q8_0 fixture, 4.8 GB, written on first
    /// use; the reference needs every layer).
    #[arg(long = "t5xxl", value_name = "FILE", requires = "image")]
    t5xxl: Option<PathBuf>,
    /// With --image: our executable (default: `sd-cli` built in release).
    #[arg(long = "sd-cli", value_name = "EXE", requires = "image")]
    sd_cli: Option<PathBuf>,
}

impl Args {
    /// The architecture compared, as rows and folders name it.
    fn family(&self) -> &'static str {
        if self.radiance {
            "chroma-radiance"
        } else {
            "chroma"
        }
    }
}

/// The default files: the reduced Chroma fixture and the FLUX VAE fixture.
fn fixtures() -> Result<(PathBuf, PathBuf)> {
    let cfg = flux::reduced_chroma(256, 2, 2);
    let dir = sd_models::fixture::cache_dir();
    std::fs::create_dir_all(&dir)?;
    let dit = dir.join("chroma-std0.02-seed7-f16-h256-d2-s2-a5120x5.safetensors");
    if !dit.is_file() {
        flux::write_chroma(&dit, &cfg, 7, Some(0.02), WeightType::F16, FileFormat::Safetensors)?;
    }
    let vae = flux_vae::cached_flux_vae_path(42, WeightType::F16);
    if !vae.is_file() {
        flux_vae::write_flux_vae(&vae, 42, WeightType::F16, FileFormat::Safetensors)?;
    }
    Ok((dit, vae))
}

/// The reduced Chroma1-Radiance fixture: width 256, 2 double and 2 single blocks, the released
/// approximator and NeRF head, seed 11, N(0, 0.03), f32 (1.2 GB); `x0`: with the x0 marker.
fn radiance_fixture(x0: bool) -> Result<PathBuf> {
    let cfg = flux::reduced_chroma(256, 2, 2).with_radiance(RadianceConfig { x0, ..RadianceConfig::released() });
    let dir = sd_models::fixture::cache_dir();
    std::fs::create_dir_all(&dir)?;
    let kind = if x0 { "-x0" } else { "" };
    let dit = dir.join(format!("chroma-radiance{kind}-std0.03-seed11-f32-h256-d2-s2-a5120x5.safetensors"));
    if !dit.is_file() {
        flux::write_chroma(&dit, &cfg, 11, Some(0.03), WeightType::F32, FileFormat::Safetensors)?;
    }
    Ok(dit)
}

/// The cases of `--image`: a name and the generation flags both programs take (the img2img
/// case's `-i` is the reference's image of the case before it).
const IMAGE_CASES: [(&str, &[&str]); 3] = [
    (
        "txt2img, weighted prompt, negative prompt",
        &[
            "-p",
            "a red cat on a (blue:1.2) sofa",
            "-n",
            "blurry, low quality",
            "-W",
            "128",
            "-H",
            "96",
            "--steps",
            "3",
            "--cfg-scale",
            "4",
            "--sampling-method",
            "euler",
            "-s",
            "1234",
        ],
    ),
    (
        "txt2img, no negative prompt",
        &[
            "-p",
            "a lighthouse at dusk, oil painting",
            "-W",
            "64",
            "-H",
            "128",
            "--steps",
            "2",
            "--cfg-scale",
            "3",
            "--sampling-method",
            "dpm++2m",
            "-s",
            "77",
        ],
    ),
    (
        "img2img of the image above",
        &[
            "-p",
            "a (quiet:0.8) harbor",
            "-n",
            "fog",
            "--strength",
            "0.6",
            "--steps",
            "3",
            "--cfg-scale",
            "5",
            "--sampling-method",
            "euler_a",
            "-s",
            "5",
        ],
    ),
];

/// `--image`: whole generations of both programs on the same files, compared as PNGs.
fn images(args: &Args, dit: &std::path::Path, vae: Option<&std::path::Path>) -> Result<()> {
    use crate::parity::{png_diff, run_ok, Row};
    let t5 = match &args.t5xxl {
        Some(p) => p.clone(),
        None => {
            let p = sd_models::fixture::t5::cached_t5xxl_path(24, 42, WeightType::Q8_0);
            if !p.is_file() {
                eprintln!("parity: writing the 24-layer T5-XXL fixture {} (4.8 GB)", p.display());
                let cfg = sd_models::text::t5::T5Config::xxl();
                sd_models::fixture::t5::write_t5xxl(&p, &cfg, 42, WeightType::Q8_0, FileFormat::Gguf)?;
            }
            p
        }
    };
    let sdref = reference::build()?;
    let ours = match &args.sd_cli {
        Some(p) => p.clone(),
        None => crate::parity::build_sd_cli()?,
    };
    let family = args.family();
    let dir = crate::workspace_root().join("target/parity").join(family);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let files = |c: &mut Command| {
        c.arg("--diffusion-model").arg(dit).arg("--t5xxl").arg(&t5);
        if let Some(vae) = vae {
            c.arg("--vae").arg(vae);
        }
        c.args(["-t", &args.threads.to_string()]);
    };
    let mut failed = false;
    let mut init: Option<PathBuf> = None;
    for (i, (name, flags)) in IMAGE_CASES.iter().enumerate() {
        let (ref_png, ours_png) = (dir.join(format!("case{i}.ref.png")), dir.join(format!("case{i}.ours.png")));
        let with_init = |c: &mut Command| {
            if flags.contains(&"--strength") {
                c.arg("-i").arg(init.as_ref().expect("an img2img case follows a txt2img one"));
            }
        };
        let mut c = Command::new(&sdref);
        c.arg("txt2img");
        files(&mut c);
        with_init(&mut c);
        c.args(*flags).arg("-o").arg(&ref_png);
        let ref_s = run_ok(c, "sdref txt2img")?;
        let mut c = Command::new(&ours);
        files(&mut c);
        with_init(&mut c);
        c.args(*flags).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
        let ours_s = run_ok(c, "sd-cli")?;
        let (diff, shape) = png_diff(&ours_png, &ref_png)?;
        let row = Row { family, what: (*name).to_owned(), shape, diff, tol: Tolerance::PNG };
        row.print_timed(ref_s, ours_s);
        failed |= !row.pass();
        init = Some(ref_png);
    }
    if failed {
        bail!("Chroma: an image differs from the reference's beyond {}", Tolerance::PNG.describe());
    }
    Ok(())
}

/// Entry point of `cargo xtask parity chroma`.
pub fn run(args: Args) -> Result<()> {
    if args.masked >= args.tokens {
        bail!("--masked {} must leave at least one of the {} tokens open", args.masked, args.tokens);
    }
    let (model, vae) = if args.radiance {
        (args.diffusion_model.clone().map_or_else(|| radiance_fixture(args.x0), Ok)?, None)
    } else {
        let (fixture_dit, fixture_vae) = fixtures()?;
        (args.diffusion_model.clone().unwrap_or(fixture_dit), Some(args.vae.clone().unwrap_or(fixture_vae)))
    };
    if args.image {
        return images(&args, &model, vae.as_deref());
    }
    let exe = reference::build()?;
    let dir = std::env::temp_dir().join(format!("parity-chroma-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;

    let cpu = crate::parity::Cpu::new(args.threads)?;
    let files = ModelFiles::open(&ModelSources { diffusion_model: Some(model.clone()), ..Default::default() })?;
    let tensors: Vec<(String, Vec<u64>)> = files.index().entries().iter().map(|e| (e.name.clone(), e.ne())).collect();
    let cfg = FluxConfig::from_file(&tensors)?;
    if cfg.chroma.is_none() {
        bail!("{} is no Chroma model (no distilled_guidance_layer)", model.display());
    }
    if cfg.radiance.is_some() != args.radiance {
        bail!("{}: --radiance goes with a Chroma1-Radiance file, and only with one", model.display());
    }
    let mut m = FluxModel::new(cfg.clone(), &dtype_of(&files), None)?;
    m.weights.allocate(cpu.backend.device().buffer_type())?;
    m.weights.load_from(&FileSource::new(&files))?;
    let mut runner = Runner::new("chroma", cpu.backend.clone());

    // Radiance reads pixels: 8 per latent position of --size.
    let (w, h) = if args.radiance { (args.size.0 * 8, args.size.1 * 8) } else { args.size };
    let (c, l, cd) = (cfg.latent_channels() as usize, args.tokens as usize, cfg.context_in_dim as usize);
    let x = crate::parity_flux::normal(args.seed, 1, c * w * h);
    let ctx = crate::parity_flux::normal(args.seed, 2, l * cd);
    let mut failed = false;
    for masked in [args.masked as usize, 0] {
        let mask: Vec<f32> = (0..l).map(|i| if i + masked >= l { f32::NEG_INFINITY } else { 0.0 }).collect();
        let ours_mask: &[f32] = if masked == 0 { &[] } else { &mask };
        let t = Instant::now();
        let ours = m.eval(&mut runner, &x, (w, h), args.timestep, &ctx, l, ours_mask, Some(0.0))?;
        let ours_s = t.elapsed().as_secs_f64();

        let (xp, cp, yp, op) = (dir.join("x.f32"), dir.join("c.f32"), dir.join("y.f32"), dir.join("out.f32"));
        write_raw(&xp, &[1, c, h, w], &x, "latent")?;
        write_raw(&cp, &[1, l, cd], &ctx, "context")?;
        write_raw(&yp, &[1, l], &mask, "Chroma's DiT mask")?;
        let s = |p: &PathBuf| p.to_str().map(str::to_owned).context("a temporary path is not UTF-8");
        let t = Instant::now();
        let mut cmd = Command::new(&exe);
        cmd.args(["unet", "--diffusion-model", &s(&model)?]);
        if let Some(vae) = &vae {
            cmd.args(["--vae", &s(vae)?]);
        }
        let status = cmd
            .args(["--latent", &s(&xp)?])
            .args(["--context", &s(&cp)?, "--y", &s(&yp)?, "-o", &s(&op)?])
            .args(["--timestep", &args.timestep.to_string(), "--guidance", "0"])
            .args(["-t", &args.threads.to_string()])
            .status()
            .context("running sdref unet")?;
        if !status.success() {
            bail!("sdref unet failed on the Chroma model: {status}");
        }
        let ref_s = t.elapsed().as_secs_f64();
        let (shape, reference) = read_raw(&op)?;
        if shape != [1, c, h, w] {
            bail!("the reference's output has shape {shape:?}, expected [1, {c}, {h}, {w}]");
        }
        let v = Verdict::of(&ours, &reference, Tolerance::rounding_points(chroma_points(&cfg)))?;
        println!(
            "{} {} (width {}, {}+{} blocks, approximator {:?}) {w}x{h}, {l} tokens ({masked} masked), t {}: {}  sdref {ref_s:.1} s (with loading)  ours {ours_s:.2} s  {}",
            args.family(),
            model.display(),
            cfg.hidden_size,
            cfg.depth,
            cfg.depth_single_blocks,
            cfg.chroma.as_ref().map(|a| (a.inner, a.layers)),
            args.timestep,
            v.figures,
            v.word()
        );
        failed |= !v.pass;
    }
    let _ = std::fs::remove_dir_all(&dir);
    if failed {
        bail!("the Chroma outputs differ beyond the bound");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_line() {
        let a: Args = crate::parse_test("--size 8x12 --tokens 4 --masked 2 --timestep 0.5").unwrap();
        assert_eq!((a.size, a.tokens, a.masked, a.timestep), ((8, 12), 4, 2, 0.5));
        let e = crate::parse_test::<Args>("--size 7x8").unwrap_err();
        assert!(format!("{e:#}").contains("even"), "{e:#}");
        let i: Args = crate::parse_test("--image --t5xxl t5.gguf --sd-cli ./sd-cli").unwrap();
        assert!(i.image && i.t5xxl.is_some() && i.sd_cli.is_some());
        // --t5xxl and --sd-cli only mean something for whole images.
        assert!(crate::parse_test::<Args>("--t5xxl t5.gguf").is_err());
        // The img2img case follows a txt2img one, whose image it starts from.
        let first_img2img = IMAGE_CASES.iter().position(|(_, f)| f.contains(&"--strength")).unwrap();
        assert!(first_img2img > 0);
    }

    #[test]
    fn the_points_of_full_chroma() {
        // 3 + the approximator's 12 + 19 double blocks of 5 + 38 single blocks of 3.
        let cfg = FluxConfig {
            chroma: Some(sd_models::diffusion::flux::chroma::ChromaConfig::released()),
            ..FluxConfig::schnell()
        };
        assert_eq!(chroma_points(&cfg), 3 + 12 + 95 + 114);
    }
}
