//! `cargo xtask parity zimage`: a whole Z-Image generation, ours against the reference's.
//!
//! ```text
//! cargo xtask parity zimage [--diffusion-model FILE --llm FILE --vae FILE] [-p PROMPT] [--size N [--height N]]
//!                           [--steps N] [--cfg-scale S] [--seed N] [--threads N] [--flash] [--loras]
//!                           [--sd-cli EXE]
//! ```
//!
//! Without files it writes (once, in the fixture cache) the fixtures `sd-cli`'s tests use: a
//! reduced Z-Image DiT (width 256, one refiner of each kind, two layers, captions 256 wide,
//! `sd_models::fixture::zimage`), a Qwen3 `--llm` of 2 layers of width 256 (SwiGLU 512) and
//! the full-size FLUX.1 VAE; the reference reads depths and widths from the tensors, so it
//! runs them as they are (its `out_layers = {35}` is past the LLM's depth: both programs take
//! the final norm's output). Both programs generate one image with the same files, prompt,
//! seed, size, steps, sampler (`euler`, the flow schedule with Z-Image's shift 3) and cfg
//! scale (default 1); the PNGs are compared with the issue's image bound
//! (`Tolerance::PNG`). `sd-cli` is built in release unless `--sd-cli` names one.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context as _, Result};
use sd_models::diffusion::zimage::ZImageConfig;
use sd_models::fixture::{self, flux_vae, qwen3, zimage, FileFormat, WeightType};
use sd_models::text::qwen3::Qwen3Config;

use crate::parity::{png_diff, run_ok, Row, Tolerance};
use crate::reference;

/// `cargo xtask parity zimage` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// A Z-Image diffusion model (default: the reduced fixture).
    #[arg(long = "diffusion-model", value_name = "FILE", requires_all = ["llm", "vae"])]
    diffusion_model: Option<PathBuf>,
    /// Its Qwen3 LLM (default: the reduced fixture).
    #[arg(long = "llm", value_name = "FILE", requires = "diffusion_model")]
    llm: Option<PathBuf>,
    /// A FLUX.1 VAE (default: the fixture).
    #[arg(long = "vae", value_name = "FILE", requires = "diffusion_model")]
    vae: Option<PathBuf>,
    /// The prompt.
    #[arg(short = 'p', long = "prompt", default_value = "a (red:1.2) fox in the snow")]
    prompt: String,
    /// Image side in pixels (a multiple of 16).
    #[arg(long = "size", default_value_t = 64, value_parser = clap::value_parser!(u32).range(16..=1024))]
    size: u32,
    /// Image height when it differs from the width (`--size`), a multiple of 16.
    #[arg(long = "height", value_parser = clap::value_parser!(u32).range(16..=1024))]
    height: Option<u32>,
    /// Sampling steps.
    #[arg(long = "steps", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=50))]
    steps: u32,
    /// Classifier-free guidance scale (above 1 runs the negative prompt too).
    #[arg(long = "cfg-scale", default_value_t = 1.0)]
    cfg_scale: f32,
    /// Seed.
    #[arg(long = "seed", default_value_t = 42)]
    seed: u64,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Flash attention in the diffusion model of both programs (`--diffusion-fa`: k and v
    /// scaled by 1/128 before their f16 cast, as the reference's Z-Image does).
    #[arg(long = "flash")]
    flash: bool,
    /// The fixtures' seed (the DiT's and the LLM's weights; default 42, the tests' files).
    #[arg(long = "fixture-seed", default_value_t = 42, conflicts_with = "diffusion_model")]
    fixture_seed: u64,
    /// Draw the fixtures' matrices N(0, STD) instead of their initialisers' scales.
    #[arg(long = "std", conflicts_with = "diffusion_model")]
    std: Option<f64>,
    /// Our executable (default: `sd-cli` built in release).
    #[arg(long = "sd-cli", value_name = "EXE")]
    sd_cli: Option<PathBuf>,
    /// Also the same generation with a LoRA of the fixture DiT in each layout (the original
    /// dotted names, diffusers' split q/k/v, kohya's flat names), ours from a prompt tag, the
    /// reference's from `--lora`.
    #[arg(long = "loras", conflicts_with = "diffusion_model")]
    loras: bool,
}

/// The fixtures of the default run (the DiT and LLM of `seed`, `std`), written once.
fn fixtures(seed: u64, std: Option<f64>) -> Result<(PathBuf, PathBuf, PathBuf)> {
    std::fs::create_dir_all(fixture::cache_dir())?;
    let tag = std.map_or(String::new(), |s| format!("-std{s}"));
    let cfg = ZImageConfig::reduced(256, 2, 1, 256);
    let mut dit = zimage::cached_zimage_path(&cfg, seed, WeightType::F16);
    if std.is_some() {
        dit = dit.with_file_name(format!("zimage{tag}-seed{seed}-f16-h256-l2-r1-c256.safetensors"));
    }
    if !dit.is_file() {
        zimage::write_zimage(&dit, &cfg, seed, std, WeightType::F16, FileFormat::Safetensors)?;
    }
    let llm_cfg = Qwen3Config { n_layers: 2, hidden: 256, intermediate: 512, ..Qwen3Config::qwen3_4b() };
    let llm = fixture::cache_dir().join(format!("qwen3-fixture{tag}-seed{seed}-f16-2l-h256-i512.safetensors"));
    if !llm.is_file() {
        qwen3::write_qwen3(&llm, &llm_cfg, seed, std, WeightType::F16, FileFormat::Safetensors)?;
    }
    let vae = flux_vae::cached_flux_vae_path(42, WeightType::F16);
    if !vae.is_file() {
        flux_vae::write_flux_vae(&vae, 42, WeightType::F16, FileFormat::Safetensors)?;
    }
    Ok((dit, llm, vae))
}

/// Entry point of `cargo xtask parity zimage`.
pub fn run(args: Args) -> Result<()> {
    let (dit, llm, vae) = match (&args.diffusion_model, &args.llm, &args.vae) {
        (Some(d), Some(l), Some(v)) => (d.clone(), l.clone(), v.clone()),
        _ => fixtures(args.fixture_seed, args.std)?,
    };
    let sdref = reference::build()?;
    let ours = match &args.sd_cli {
        Some(p) => p.clone(),
        None => crate::parity::build_sd_cli()?,
    };
    let dir = crate::workspace_root().join("target/parity/zimage");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let side = args.size.to_string();
    let height = args.height.unwrap_or(args.size).to_string();
    let flags: Vec<String> = [
        "-p",
        &args.prompt,
        "-W",
        &side,
        "-H",
        &height,
        "--steps",
        &args.steps.to_string(),
        "--sampling-method",
        "euler",
        "--cfg-scale",
        &args.cfg_scale.to_string(),
        "-s",
        &args.seed.to_string(),
        "-t",
        &args.threads.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain(args.flash.then(|| "--diffusion-fa".to_owned()))
    .collect();
    let files = |c: &mut Command| {
        c.arg("--diffusion-model").arg(&dit).arg("--llm").arg(&llm).arg("--vae").arg(&vae);
    };
    // One generation by both programs: `tag` is our prompt's LoRA tag, `lora` the reference's
    // `--lora PATH:MULT`.
    let generate = |name: &str, tag: &str, lora: Option<String>| -> Result<(PathBuf, PathBuf, f64, f64)> {
        let ref_png = dir.join(format!("{name}.ref.png"));
        let mut c = Command::new(&sdref);
        c.arg("txt2img");
        files(&mut c);
        c.args(&flags).arg("-o").arg(&ref_png);
        if let Some(l) = &lora {
            c.arg("--lora").arg(l);
        }
        let ref_s = run_ok(c, &format!("sdref {name}"))?;
        let ours_png = dir.join(format!("{name}.ours.png"));
        let mut c = Command::new(&ours);
        files(&mut c);
        let ours_flags: Vec<String> = flags
            .iter()
            .enumerate()
            .map(|(i, f)| if i > 0 && flags[i - 1] == "-p" { format!("{f}{tag}") } else { f.clone() })
            .collect();
        c.args(&ours_flags).arg("--lora-model-dir").arg(&dir).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
        let ours_s = run_ok(c, &format!("sd-cli {name}"))?;
        Ok((ours_png, ref_png, ref_s, ours_s))
    };
    let (ours_png, ref_png, ref_s, ours_s) = generate("txt2img", "", None)?;
    let (diff, shape) = png_diff(&ours_png, &ref_png)?;
    let fa = if args.flash { " fa" } else { "" };
    let what = format!("png {side}x{height} euler{} cfg{}{fa}", args.steps, args.cfg_scale);
    let row = Row { family: "zimage", what, shape, diff, tol: Tolerance::PNG };
    row.print_timed(ref_s, ours_s);
    let mut failed = Vec::new();
    if !row.pass() {
        failed.push("txt2img".to_string());
    }
    if args.loras {
        use sd_models::fixture::lora::{write_zimage_lora, LoraFixture, LoraLayout};
        let cfg = ZImageConfig::reduced(256, 2, 1, 256);
        for (layout, name) in
            [(LoraLayout::Peft, "peft"), (LoraLayout::Diffusers, "diffusers"), (LoraLayout::Kohya, "kohya")]
        {
            let file = format!("zimage-lora-{name}");
            let path = dir.join(format!("{file}.safetensors"));
            let req = LoraFixture { layout, rank: 8, seed: 5, scale: 0.2, text_encoder: false };
            write_zimage_lora(&path, &cfg, &req)?;
            let (o, r, ref_s, ours_s) =
                generate(&file, &format!("<lora:{file}:1>"), Some(format!("{}:1", path.display())))?;
            let (diff, shape) = png_diff(&o, &r)?;
            let (effect, _) = png_diff(&o, &ours_png)?;
            let what = format!("lora {name} (changes {:.2}/{})", effect.mean_abs, effect.max_abs);
            let row = Row { family: "zimage", what, shape, diff, tol: Tolerance::PNG };
            row.print_timed(ref_s, ours_s);
            if !row.pass() {
                failed.push(format!("lora {name}"));
            }
        }
        // kohya's adapters the reference keeps (the layers' attention, the patch embedder): the
        // same image. It turns the `_` of feed_forward, noise_refiner, context_refiner and
        // adaLN_modulation into `.` and drops those adapters; sd-rs applies them, hence the
        // kohya row's difference.
        let file = "zimage-lora-kohya-kept";
        let kept = dir.join(format!("{file}.safetensors"));
        keep_tensors(&dir.join("zimage-lora-kohya.safetensors"), &kept, |n| {
            (n.starts_with("lora_unet_layers_") && n.contains("_attention_")) || n.starts_with("lora_unet_x_embedder")
        })?;
        let (o, r, ref_s, ours_s) = generate(file, &format!("<lora:{file}:1>"), Some(format!("{}:1", kept.display())))?;
        let (diff, shape) = png_diff(&o, &r)?;
        let (effect, _) = png_diff(&o, &ours_png)?;
        let what = format!("lora kohya kept (changes {:.2}/{})", effect.mean_abs, effect.max_abs);
        let row = Row { family: "zimage", what, shape, diff, tol: Tolerance::PNG };
        row.print_timed(ref_s, ours_s);
        if !row.pass() {
            failed.push("lora kohya kept".into());
        }
        println!(
            "(kohya: the reference drops the adapters of feed_forward, noise_refiner, context_refiner and \
             adaLN_modulation, whose `_` it reads as `.`; sd-rs applies them. Expected to differ; \
             'kohya kept' holds the adapters both apply.)"
        );
        failed.retain(|f| f != "lora kohya");
    }
    anyhow::ensure!(
        failed.is_empty(),
        "Z-Image: our image differs from the reference's beyond {} in: {}",
        Tolerance::PNG.describe(),
        failed.join(", ")
    );
    Ok(())
}

/// Writes the tensors of the safetensors file `from` whose names `keep` accepts to `to`.
fn keep_tensors(from: &std::path::Path, to: &std::path::Path, keep: impl Fn(&str) -> bool) -> Result<()> {
    use sd_models::files::safetensors::{parse, to_bytes, HeaderEntry};
    let bytes = std::fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    let header = parse(&bytes).with_context(|| format!("parsing {}", from.display()))?;
    let kept: Vec<(HeaderEntry<'_>, &[u8])> = header
        .tensors
        .iter()
        .filter(|t| keep(&t.name))
        .map(|t| {
            let entry = HeaderEntry { name: &t.name, dtype: t.dtype, shape: &t.shape };
            (entry, &bytes[t.offset as usize..(t.offset + t.len) as usize])
        })
        .collect();
    anyhow::ensure!(!kept.is_empty(), "no tensor of {} is kept", from.display());
    std::fs::write(to, to_bytes(&kept, &header.metadata)?).with_context(|| format!("writing {}", to.display()))?;
    Ok(())
}
