//! `cargo xtask parity flux2`: whole FLUX.2 klein generations, ours against the reference's
//! (`--dev`: FLUX.2 dev's, on its own reduced fixtures and a subset of the cases).
//!
//! ```text
//! cargo xtask parity flux2 [--diffusion-model FILE --llm FILE --vae FILE] [-p PROMPT] [--size N [--height N]]
//!                          [--steps N] [--cfg-scale S] [--seed N] [--threads N] [--flash] [--fixture-seed N]
//!                          [--std S] [--sd-cli EXE]
//! ```
//!
//! Without files it writes (once, in the fixture cache) a reduced FLUX.2 klein DiT (width 256,
//! two double and two single blocks, a context of three 256-wide LLM layers), a Qwen3 `--llm`
//! of 30 layers of width 256 (klein reads its layers 9, 18 and 27; the reference reads a
//! 28-layer Qwen3 as another model) and FLUX.2's full-size VAE; the reference reads depths
//! and widths from the tensors, so it runs them as they are. Both programs generate with the
//! same files, prompt, seed, size, steps, sampler (`euler`, FLUX.2's image-dependent shift)
//! and cfg scale (default 1); then an img2img from the reference's first image, and the
//! txt2img decoded by TAEF2 (`--taesd`, a fixture of its layout), the txt2img again with a
//! negative prompt and cfg 3 (both passes of the guidance), and edits with reference images
//! (`-r`): the first image and a 100x40 pattern resized to the image's area (96x48), then a
//! 256x160 pattern at its own size (160 tokens, ten times the image's) (`--disable-auto-resize-ref-image`) with the negative prompt
//! at cfg 3 (the references in both passes), skip-layer guidance over the second double block and
//! the first single one, the two references again with the image guidance at 2.5 (the negative
//! prompt with and without them); each must also change our image (as must the LoRAs). The PNGs are compared with the issue's image bound (`Tolerance::PNG`), the large
//! reference's with a mean of at most half a level.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, Result};
use sd_models::fixture::{self, flux, FileFormat, WeightType};

use crate::parity::{png_diff, run_ok, Row, Tolerance};
use crate::reference;

/// `cargo xtask parity flux2` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// A FLUX.2 klein diffusion model (default: the reduced fixture).
    #[arg(long = "diffusion-model", value_name = "FILE", requires_all = ["llm", "vae"])]
    diffusion_model: Option<PathBuf>,
    /// Its Qwen3 LLM (default: the reduced fixture).
    #[arg(long = "llm", value_name = "FILE", requires = "diffusion_model")]
    llm: Option<PathBuf>,
    /// A FLUX.2 VAE (default: the fixture).
    #[arg(long = "vae", value_name = "FILE", requires = "diffusion_model")]
    vae: Option<PathBuf>,
    /// The prompt.
    #[arg(short = 'p', long = "prompt", default_value = "a (red:1.2) fox [in the snow], ÆØÅ 雪")]
    prompt: String,
    /// Image side in pixels (a multiple of 16).
    #[arg(long = "size", default_value_t = 64, value_parser = clap::value_parser!(u32).range(16..=1024))]
    size: u32,
    /// Image height when it differs from the width (`--size`), a multiple of 16.
    #[arg(long = "height", value_parser = clap::value_parser!(u32).range(16..=1024))]
    height: Option<u32>,
    /// Sampling steps.
    #[arg(long = "steps", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=50))]
    steps: u32,
    /// Classifier-free guidance scale of the first generation.
    #[arg(long = "cfg-scale", default_value_t = 1.0)]
    cfg_scale: f32,
    /// Seed.
    #[arg(long = "seed", default_value_t = 42)]
    seed: u64,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Flash attention in the diffusion model of both programs (`--diffusion-fa`).
    #[arg(long = "flash")]
    flash: bool,
    /// The fixtures' seed (the DiT's; the LLM's is one more).
    #[arg(long = "fixture-seed", default_value_t = 7, conflicts_with = "diffusion_model")]
    fixture_seed: u64,
    /// The fixtures' weights N(0, STD) (the LLM's at 0.6 of it).
    #[arg(long = "std", default_value_t = 0.05, conflicts_with = "diffusion_model")]
    std: f64,
    /// Our executable (default: `sd-cli` built in release).
    #[arg(long = "sd-cli", value_name = "EXE")]
    sd_cli: Option<PathBuf>,
    /// Also the txt2img with a LoRA of the fixture DiT in BFL's dotted names and in kohya's,
    /// ours from a prompt tag, the reference's from `--lora`.
    #[arg(long = "loras", conflicts_with = "diffusion_model")]
    loras: bool,
    /// FLUX.2 dev instead: its reduced fixtures (a DiT of width 256 with 1 double and 48 single
    /// blocks and the guidance embedding, a 30-layer Mistral of width 256) and the cases
    /// txt2img, img2img, negative, refs, and `--guidance 6` (which must change the image).
    #[arg(long = "dev", conflicts_with_all = ["diffusion_model", "loras"])]
    dev: bool,
}

/// One comparison: its name, what the row says, the reference's flags, ours when they differ.
type Case = (String, String, Vec<String>, Option<Vec<String>>);

/// Entry point of `cargo xtask parity flux2`.
pub fn run(args: Args) -> Result<()> {
    let (dit, llm, vae) = match (&args.diffusion_model, &args.llm, &args.vae) {
        (Some(d), Some(l), Some(v)) => (d.clone(), l.clone(), v.clone()),
        _ if args.dev => flux::cached_flux2_dev_set(args.fixture_seed, args.std)?,
        _ => flux::cached_flux2_klein_set(args.fixture_seed, args.std)?,
    };
    let family = if args.dev { "flux2 dev" } else { "flux2" };
    let sdref = reference::build()?;
    let ours = match &args.sd_cli {
        Some(p) => p.clone(),
        None => crate::parity::build_sd_cli()?,
    };
    let dir = crate::workspace_root().join(if args.dev { "target/parity/flux2-dev" } else { "target/parity/flux2" });
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let side = args.size.to_string();
    let height = args.height.unwrap_or(args.size).to_string();
    let base: Vec<String> = [
        "-W",
        &side,
        "-H",
        &height,
        "--steps",
        &args.steps.to_string(),
        "--sampling-method",
        "euler",
        "-s",
        &args.seed.to_string(),
        "-t",
        &args.threads.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain(args.flash.then(|| "--diffusion-fa".to_owned()))
    .collect();
    let generate = |name: &str, extra: &[String], ours_extra: &[String]| -> Result<(PathBuf, PathBuf, f64, f64)> {
        let ref_png = dir.join(format!("{name}.ref.png"));
        let ours_png = dir.join(format!("{name}.ours.png"));
        let mut c = Command::new(&sdref);
        c.arg("txt2img").arg("--diffusion-model").arg(&dit).arg("--llm").arg(&llm).arg("--vae").arg(&vae);
        c.args(&base).args(extra).arg("-o").arg(&ref_png);
        let ref_s = run_ok(c, &format!("sdref {name}"))?;
        let mut c = Command::new(&ours);
        c.arg("--diffusion-model").arg(&dit).arg("--llm").arg(&llm).arg("--vae").arg(&vae);
        c.args(&base).args(ours_extra).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
        let ours_s = run_ok(c, &format!("sd-cli {name}"))?;
        Ok((ours_png, ref_png, ref_s, ours_s))
    };
    let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<String>>();
    let first = dir.join("txt2img.ref.png");
    let taef2 = fixture::taesd::cached_taesd_path(32, 42, WeightType::F16);
    if !taef2.is_file() {
        fixture::taesd::write_taesd(&taef2, 32, 42, WeightType::F16, FileFormat::Safetensors)?;
    }
    let pattern = |name: &str, (w, h): (usize, usize)| -> Result<String> {
        let rgb = (0..w * h)
            .flat_map(|i| {
                let (x, y) = (i % w, i / w);
                [(x * 7 + y * 3) as u8, (x * y) as u8, 255u8.wrapping_sub((2 * x + y) as u8)]
            })
            .collect();
        let img = sd_models::pipeline::Image { width: w, height: h, rgb };
        let path = dir.join(name);
        sd_models::image_io::save_image(&path, &img, sd_models::image_io::OutputFormat::Png, None)?;
        Ok(path.display().to_string())
    };
    let (wide, tall) = (pattern("ref-100x40.png", (100, 40))?, pattern("ref-256x160.png", (256, 160))?);
    let first_s = first.display().to_string();
    let mut cases: Vec<Case> = vec![
        (
            "txt2img".into(),
            format!("png {side}x{height} euler{} cfg{}", args.steps, args.cfg_scale),
            strings(&["-p", &args.prompt, "--cfg-scale", &args.cfg_scale.to_string()]),
            None,
        ),
        (
            "img2img".into(),
            "png img2img strength 0.6".into(),
            strings(&[
                "-p",
                "a fox at night",
                "--cfg-scale",
                "1",
                "-i",
                &first.display().to_string(),
                "--strength",
                "0.6",
            ]),
            None,
        ),
        (
            "taef2".into(),
            "png TAEF2 (--taesd)".into(),
            strings(&["-p", &args.prompt, "--cfg-scale", "1", "--taesd", &taef2.display().to_string()]),
            None,
        ),
        (
            "negative".into(),
            "png negative prompt cfg 3".into(),
            strings(&["-p", &args.prompt, "-n", "blurry, (ugly:1.3)", "--cfg-scale", "3"]),
            None,
        ),
        (
            "slg".into(),
            "png skip-layer guidance 2 over blocks 1 and 2".into(),
            strings(&[
                "-p",
                &args.prompt,
                "--cfg-scale",
                "1",
                "--slg-scale",
                "2",
                "--skip-layers",
                "[1,2]",
                "--skip-layer-end",
                "1",
            ]),
            None,
        ),
        (
            "refs".into(),
            "png 2 reference images, auto-resized".into(),
            strings(&["-p", &args.prompt, "--cfg-scale", "1", "-r", &first_s, "-r", &wide]),
            None,
        ),
        (
            "refs-img-cfg".into(),
            "png 2 references, image guidance 2.5 (3 passes)".into(),
            strings(&["-p", &args.prompt, "--cfg-scale", "1", "-r", &first_s, "-r", &wide, "--img-cfg-scale", "2.5"]),
            None,
        ),
        (
            "refs-cfg".into(),
            "png reference 256x160 as it is, negative, cfg 3".into(),
            strings(&[
                "-p",
                &args.prompt,
                "-n",
                "blurry, (ugly:1.3)",
                "--cfg-scale",
                "3",
                "-r",
                &tall,
                "--disable-auto-resize-ref-image",
            ]),
            None,
        ),
    ];
    if args.dev {
        cases.retain(|(name, ..)| ["txt2img", "img2img", "negative", "refs"].contains(&name.as_str()));
        cases.push((
            "guidance".into(),
            "png distilled guidance 6".into(),
            strings(&["-p", &args.prompt, "--cfg-scale", "1", "--guidance", "6"]),
            None,
        ));
    }
    if args.loras {
        use sd_models::fixture::lora::{write_flux_lora, LoraFixture, LoraLayout};
        let cfg = flux::reduced_flux2(256, 2, 2, 3 * 256);
        for (layout, name) in [(LoraLayout::Peft, "peft"), (LoraLayout::Kohya, "kohya")] {
            let path = dir.join(format!("flux2-lora-{name}.safetensors"));
            let req = LoraFixture { layout, rank: 8, seed: 5, scale: 0.2, text_encoder: false };
            write_flux_lora(&path, &cfg, &req)?;
            let mut extra = strings(&["-p", &args.prompt, "--cfg-scale", "1"]);
            extra.extend(["--lora".to_owned(), format!("{}:0.8", path.display())]);
            let tagged = format!("{}<lora:flux2-lora-{name}:0.8>", args.prompt);
            let dir_arg = dir.display().to_string();
            let ours = strings(&["-p", &tagged, "--cfg-scale", "1", "--lora-model-dir", &dir_arg]);
            cases.push((format!("lora-{name}"), format!("lora {name} at 0.8"), extra, Some(ours)));
        }
    }
    let mut failed = Vec::new();
    for (name, what, extra, ours_extra) in &cases {
        let (o, r, ref_s, ours_s) = generate(name, extra, ours_extra.as_ref().unwrap_or(extra))?;
        let (diff, shape) = png_diff(&o, &r)?;
        // What the LoRA or the references change, against the same run without them: a case
        // whose addition changed nothing would compare nothing.
        let without = match name.as_str() {
            n if n.starts_with("lora") || n == "refs" || n == "slg" || n == "guidance" => Some("txt2img"),
            "refs-cfg" => Some("negative"),
            "refs-img-cfg" => Some("refs"),
            _ => None,
        };
        if let Some(base) = without {
            let (effect, _) = png_diff(&o, &dir.join(format!("{base}.ours.png")))?;
            println!(
                "({name}: our image differs from {base}'s by {:.2} mean, {} max)",
                effect.mean_abs, effect.max_abs
            );
            if effect.max_abs == 0.0 {
                failed.push(format!("{name} (no effect)"));
            }
        }
        // The large reference's case is held to a mean of half a level: its 160 tokens move the
        // image by 4 levels on average, and numbering them as FLUX.1 would (RoPE index 1, not
        // 10) gave 0.55 here, within the issue's bound (measured right: 0.16).
        let tol = if name == "refs-cfg" { Tolerance::Levels { mean: 0.5, max: 8.0 } } else { Tolerance::PNG };
        let row = Row { family, what: what.clone(), shape, diff, tol };
        row.print_timed(ref_s, ours_s);
        if !row.pass() {
            failed.push(name.clone());
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "{family}: our image differs from the reference's beyond {} (refs-cfg: mean 0.5) in: {}",
        Tolerance::PNG.describe(),
        failed.join(", ")
    );
    Ok(())
}
