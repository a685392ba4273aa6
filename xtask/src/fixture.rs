//! `cargo xtask fixture`: write a checkpoint with a real family's layout and random weights.
//!
//! ```text
//! cargo xtask fixture sd15|sd21|sd-turbo|sdxl|ssd-1b|vega|sd15-inpaint [--seed N] [--type f32|f16|q8_0|q5_0|q4_0|q4_K|q5_K|q6_K]
//!                     [-o FILE.safetensors|FILE.gguf] [--only unet,text,vae] [--std S]
//! cargo xtask fixture lora-sd15 --layout kohya|peft|loha|lokr|tucker|tucker-loha|diff [--rank R] [--seed S] [--scale X] [--unet-only] -o FILE.safetensors
//! cargo xtask fixture lora-flux --layout kohya|peft|diffusers [--hidden N --double N --single N] [--schnell-dit]
//!                     [--rank R] [--seed S] [--scale X] [--unet-only] -o FILE.safetensors
//! cargo xtask fixture lora-sdxl|lora-vega|lora-ssd-1b [--rank R] [--seed S] [--scale X] [--unet-only] -o FILE.safetensors
//! cargo xtask fixture t5xxl [--layers N] [--seed N] [--type ...] [-o FILE]
//! cargo xtask fixture qwen3|mistral|qwen25vl [--layers N] [--hidden N] [--intermediate N] [--seed N] [--std S] [--type ...] [-o FILE]
//! cargo xtask fixture flux2-klein|flux2-dev [--double N] [--single N] [--hidden N] [--cap-dim N] [--seed N] [--std S] [--type ...] [-o FILE]
//! cargo xtask fixture flux|flux-schnell [--double N] [--single N] [--hidden N] [--seed N] [--type ...] [-o FILE]
//! cargo xtask fixture zimage [--layers N] [--refiner-layers N] [--hidden N] [--cap-dim N] [--seed N] [--std S] [--type ...] [-o FILE]
//! cargo xtask fixture chroma|chroma-radiance [--double N] [--single N] [--hidden N] [--seed N] [--std S] [--type ...] [-o FILE]
//! cargo xtask fixture flux-vae [--seed N] [--type f16|f32] [-o FILE]
//! cargo xtask fixture clip-l [--seed N] [--type ...] [-o FILE]
//! ```
//!
//! `lora-sd15` writes a LoRA for the SD 1.5 fixture with the real key names of that layout
//! (`sd_models::fixture::lora`): random values N(0, X), rank R (default 4), alpha R/2 in kohya
//! files; `loha` and `lokr` write LyCORIS LoHa and LoKr factors under kohya's names (LoKr:
//! the linear layers only). `lora-flux` does the same for a FLUX.1 DiT of the given sizes (those of the `flux`
//! fixture it adapts) and CLIP-L (kohya's `lora_te1_`, unless `--unet-only`); `diffusers`
//! writes a fused `qkv` as `to_q`, `to_k`, `to_v`. `lora-sdxl` (`lora-vega`, `lora-ssd-1b`)
//! writes a kohya LoRA for that family's fixture: UNet (LDM names), `lora_te1_` and
//! `lora_te2_`. `t5xxl` writes a T5-XXL v1.1 encoder file (`--t5xxl`, the names of
//! `t5xxl_fp16.safetensors`; `sd_models::fixture::t5`), 24 blocks unless `--layers` says fewer
//! (the reference needs all 24: 9.5 GB at f16, about 5 GB at q8_0). `flux` / `flux-schnell`
//! write a FLUX.1 transformer (`--diffusion-model`, the names of BFL's `flux1-dev.safetensors`;
//! `sd_models::fixture::flux`): full size (width 3072, 19 double and 38 single blocks, 24 GB
//! at f16) unless `--hidden` (a multiple of 128: heads of 128), `--double` or `--single` say
//! less; the cache entry names the sizes. `zimage` writes a Z-Image transformer
//! (`--diffusion-model`, the names of ComfyUI's `z_image_turbo_bf16.safetensors`;
//! `sd_models::fixture::zimage`): full size (width 3840, 30 layers, 2 + 2 refiners, captions
//! 2560 wide) unless `--hidden`, `--layers`, `--refiner-layers` or `--cap-dim` (the `--llm`'s
//! width: a reduced qwen3 fixture's `--hidden`) say less. `flux-vae` writes FLUX.1's autoencoder as BFL's
//! `ae.safetensors` names it (`--vae`: bare `encoder.*` / `decoder.*`, 16 latent channels, no
//! quant convs; `sd_models::fixture::flux_vae`), full size (83.8M parameters). `clip-l` writes
//! the sd15 fixture's CLIP-L alone under the bare names of `clip_l.safetensors` (`--clip_l`
//! of FLUX and SDXL, which the reference reads only in that layout). `mistral` writes
//! Mistral-Small-3.2's text model as `qwen3` writes Qwen3 (the same names without the q/k norms;
//! 40 layers of width 5120 unless told less). `flux2-dev` writes FLUX.2 dev's transformer (8
//! double and 48 single blocks of width 6144, the guidance embedding; the reference takes a file
//! for dev by its 48th single block, so `--single` stays at 48 or more).
//!
//! Defaults: seed 42, type f16, output the fixture cache entry of that family, seed and type
//! (`sd_models::fixture::cached_path`, shared with `sd-cli` and the tests), whose
//! extension is `gguf` for quantized types and `safetensors` otherwise; with `-o` the
//! extension chooses the format. A modified fixture (`--only`, `--std`, `--std-everywhere`,
//! `--plain-norms`) needs `-o`, so that it never takes a plain fixture's cache entry. `--only` keeps some components
//! (file metadata unchanged), for small files in tests; `text` keeps both text encoders of
//! SDXL-layout families. `--std S` draws every weight and
//! embedding N(0, S) instead of the scaled initialisation (a checkpoint as a naive generator
//! writes it, for parity runs on weights this project's fixtures do not have);
//! `--std-everywhere` does the same to biases and norms; `--plain-norms` makes biases 0 and
//! norm gains 1, as PyTorch initialises them. The generation itself lives in
//! `sd_models::fixture`; this is only argument handling.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use sd_models::diffusion::flux::FluxConfig;
use sd_models::diffusion::zimage::ZImageConfig;
use sd_models::family::sd3::mmdit::MmditConfig;
use sd_models::fixture::lora::{write_flux_lora, write_lora, write_sdxl_lora, LoraFixture, LoraLayout};
use sd_models::fixture::{
    self, flux, flux_vae, qwen3, sd3, t5, taesd, zimage, Component, FileFormat, FixtureModel, FixtureReport,
    FixtureRequest, WeightType,
};
use sd_models::text::qwen3::{LlmArch, Qwen3Config};
use sd_models::text::t5::T5Config;

/// `cargo xtask fixture` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// The family: sd15, sd21, sd-turbo, sdxl, ssd-1b, vega or sd15-inpaint; or lora-sd15 / lora-flux (a LoRA
    /// for the sd15 / flux fixture);
    /// or t5xxl, the text encoder alone; flux or flux-schnell, a FLUX.1 transformer; flux-vae,
    /// FLUX.1's autoencoder alone; taesd (also TAESDXL's layout) or taef1, a tiny autoencoder.
    #[arg(value_name = "sd15|sd21|sd-turbo|sdxl|ssd-1b|vega|sd15-inpaint|lora-sd15|lora-flux|t5xxl|qwen3|flux|flux-schnell|chroma|chroma-radiance|sd35-large|sd35-medium|flux-vae|flux2-klein|flux2-vae|clip-l|taesd|taef1|taef2|zimage|esrgan|esrgan-anime|esrgan-x2|controlnet-sd15|controlnet-sdxl", value_parser = target)]
    family: Target,
    /// t5xxl: encoder blocks (1 to 24); qwen3: decoder layers (1 to 36, not 28); zimage: main layers (default 30).
    #[arg(long = "layers", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=36))]
    layers: Option<u32>,
    /// qwen3 only: the SwiGLU width (default 9728, Qwen3-4B's; a multiple of 32).
    #[arg(long = "intermediate", value_name = "N", value_parser = clap::value_parser!(u32).range(32..=65536))]
    intermediate: Option<u32>,
    /// flux, chroma, flux2-klein, flux2-dev: double-stream blocks (0 to 19, default 19;
    /// flux2-klein 5, flux2-dev 8).
    #[arg(long = "double", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=19))]
    double: Option<u32>,
    /// flux, chroma, flux2-klein, flux2-dev: single-stream blocks (0 to 64; default 38,
    /// flux2-klein 20, flux2-dev 48).
    #[arg(long = "single", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=64))]
    single: Option<u32>,
    /// sd35-large, sd35-medium: joint blocks, also the head count (default 38 / 24).
    #[arg(long = "depth", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=38))]
    depth: Option<u32>,
    /// sd35-large, sd35-medium: also write CLIP-L and CLIP-G (full size) into the checkpoint.
    #[arg(long = "with-clips")]
    with_clips: bool,
    /// zimage only: noise and context refiner layers, each (0 to 2, default 2).
    #[arg(long = "refiner-layers", value_name = "N", value_parser = clap::value_parser!(u32).range(0..=2))]
    refiner_layers: Option<u32>,
    /// zimage, flux2-klein: the `--llm`'s hidden size (default 2560, Qwen3-4B's; flux2-klein's
    /// context is three of its layers side by side).
    #[arg(long = "cap-dim", value_name = "N", value_parser = clap::value_parser!(u32).range(32..=8192))]
    cap_dim: Option<u32>,
    /// flux, chroma, qwen3, zimage: the width, a multiple of 128 from 128 to 3840 (default 3072; qwen3: 2560; zimage: 3840);
    /// sd35-large, sd35-medium: a multiple of 64 and of --depth (default 2432 / 1536).
    #[arg(long = "hidden", value_name = "N", value_parser = hidden_width)]
    hidden: Option<u32>,
    /// esrgan: RRDB blocks (default 23, RealESRGAN_x4plus; esrgan-anime: 6).
    #[arg(long = "blocks", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    blocks: Option<u32>,
    /// esrgan: feature channels (default 64, the only width the reference takes; growth is half).
    #[arg(long = "features", value_name = "F", value_parser = clap::value_parser!(u32).range(2..=256))]
    features: Option<u32>,
    /// Seed of the random weights.
    #[arg(long = "seed", short = 's', default_value_t = 42, allow_negative_numbers = true)]
    seed: u64,
    /// Weight type: f32, f16, q8_0, q5_0, q4_0, q4_K, q5_K, q6_K (GGUF only: quantized types), f8_e4m3 (safetensors only: fp8 e4m3fn).
    #[arg(long = "type", value_name = "TYPE", default_value = "f16", value_parser = weight_type)]
    wtype: WeightType,
    /// Output file (`.safetensors` or `.gguf`: the extension chooses the format).
    #[arg(long = "output", short = 'o', value_name = "FILE")]
    output: Option<PathBuf>,
    /// Keep only these components (file metadata unchanged).
    #[arg(long = "only", value_name = "unet,text,vae", value_delimiter = ',', value_parser = component)]
    only: Option<Vec<Component>>,
    /// Draw every weight and embedding N(0, S) instead of the scaled initialisation.
    #[arg(long = "std", value_name = "S", value_parser = std_dev)]
    std: Option<f64>,
    /// With --std: biases and norms too.
    #[arg(long = "std-everywhere", requires = "std", conflicts_with = "plain_norms")]
    std_everywhere: bool,
    /// Biases 0 and norm gains 1, as PyTorch initialises them.
    #[arg(long = "plain-norms")]
    plain_norms: bool,
    /// lora-sd15, lora-flux: the key layout, kohya or peft (lora-flux: or diffusers; lora-sd15:
    /// or LyCORIS's loha, lokr, tucker (Tucker-decomposed 3x3 convolutions), tucker-loha (one of
    /// them a LoHa), diff (full deltas) under kohya's names).
    #[arg(long = "layout", default_value = "kohya")]
    layout: LoraLayout,
    /// lora-sd15, lora-flux: the rank of every adapter.
    #[arg(long = "rank", default_value_t = 4)]
    rank: u64,
    /// lora-sd15, lora-flux: the standard deviation of the values.
    #[arg(long = "scale", default_value_t = 0.05)]
    scale: f32,
    /// lora-sd15, lora-flux: adapt the UNet / DiT only (no text-encoder keys).
    #[arg(long = "unet-only")]
    unet_only: bool,
    /// lora-flux: the DiT is schnell's (no guidance embedder).
    #[arg(long = "schnell-dit")]
    schnell_dit: bool,
}

/// What `fixture` writes: a checkpoint of a family, a LoRA for the SD 1.5 fixture, or the
/// T5-XXL text encoder alone.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Target {
    Model(FixtureModel),
    LoraSd15,
    LoraFlux,
    /// A LoRA for an SDXL-layout fixture (SDXL, SSD-1B, Vega).
    LoraSdxl(FixtureModel),
    T5xxl,
    /// An LLM text encoder (`--llm`): Qwen3's layout, Mistral-Small-3.2's or Qwen2.5-VL's.
    Qwen3 {
        arch: LlmArch,
    },
    /// A Z-Image transformer (`--diffusion-model`).
    ZImage,
    /// A Chroma transformer (FLUX.1-schnell's blocks with the approximator); `radiance`:
    /// Chroma1-Radiance's, in pixel space (a patch convolution and a NeRF head).
    Chroma {
        radiance: bool,
    },
    /// An SD3.5 checkpoint (MMDiT and VAE): Large's layout or Medium's (MMDiT-X).
    Sd35 {
        medium: bool,
    },
    /// FLUX.1-dev (`schnell: false`) or -schnell.
    Flux {
        schnell: bool,
    },
    FluxVae,
    /// A FLUX.2 transformer (`--diffusion-model`): klein's, or dev's (48 single blocks by
    /// default, the guidance embedding).
    Flux2 {
        dev: bool,
    },
    /// FLUX.2's autoencoder alone.
    Flux2Vae,
    /// CLIP-L alone, bare names.
    ClipL,
    /// A tiny autoencoder of this many latent channels: 4 (TAESD, TAESDXL) or 16 (TAEF1).
    Taesd {
        z_channels: usize,
    },
    /// An ESRGAN upscaler of this factor and default block count.
    Esrgan {
        scale: usize,
        blocks: usize,
    },
    /// A ControlNet (`--control-net`) for SD 1.x (`sdxl: false`) or SDXL.
    ControlNet {
        sdxl: bool,
    },
}

fn target(s: &str) -> Result<Target, String> {
    match s {
        "lora-sd15" => Ok(Target::LoraSd15),
        "lora-flux" => Ok(Target::LoraFlux),
        "lora-sdxl" => Ok(Target::LoraSdxl(FixtureModel::Sdxl)),
        "lora-vega" => Ok(Target::LoraSdxl(FixtureModel::Vega)),
        "lora-ssd-1b" => Ok(Target::LoraSdxl(FixtureModel::Ssd1b)),
        "t5xxl" => Ok(Target::T5xxl),
        "qwen3" => Ok(Target::Qwen3 { arch: LlmArch::Qwen3 }),
        "mistral" | "mistral-small-3.2" => Ok(Target::Qwen3 { arch: LlmArch::Mistral }),
        "qwen25vl" | "qwen2.5-vl" => Ok(Target::Qwen3 { arch: LlmArch::Qwen25Vl }),
        "zimage" | "z-image" => Ok(Target::ZImage),
        "flux" | "flux-dev" => Ok(Target::Flux { schnell: false }),
        "flux-schnell" => Ok(Target::Flux { schnell: true }),
        "chroma" => Ok(Target::Chroma { radiance: false }),
        "chroma-radiance" | "chroma1-radiance" => Ok(Target::Chroma { radiance: true }),
        "sd35-large" | "sd3" => Ok(Target::Sd35 { medium: false }),
        "sd35-medium" => Ok(Target::Sd35 { medium: true }),
        "flux-vae" => Ok(Target::FluxVae),
        "flux2-klein" => Ok(Target::Flux2 { dev: false }),
        "flux2-dev" | "flux2" => Ok(Target::Flux2 { dev: true }),
        "flux2-vae" => Ok(Target::Flux2Vae),
        "clip-l" => Ok(Target::ClipL),
        "taesd" | "taesdxl" => Ok(Target::Taesd { z_channels: 4 }),
        "taef1" => Ok(Target::Taesd { z_channels: 16 }),
        "taef2" => Ok(Target::Taesd { z_channels: 32 }),
        "esrgan" | "esrgan-x4" => Ok(Target::Esrgan { scale: 4, blocks: 23 }),
        "esrgan-anime" => Ok(Target::Esrgan { scale: 4, blocks: 6 }),
        "esrgan-x2" => Ok(Target::Esrgan { scale: 2, blocks: 23 }),
        "controlnet-sd15" => Ok(Target::ControlNet { sdxl: false }),
        "controlnet-sdxl" => Ok(Target::ControlNet { sdxl: true }),
        _ => FixtureModel::parse(s)
            .map(Target::Model)
            .map_err(|e| format!("{e}; or lora-sd15, lora-flux, lora-sdxl, lora-vega, lora-ssd-1b, t5xxl, qwen3, mistral, qwen25vl, flux, flux-schnell, chroma, chroma-radiance, sd35-large, sd35-medium, flux-vae, flux2-klein, flux2-dev, flux2-vae, clip-l, taesd, taef1, taef2, zimage, esrgan, esrgan-anime, esrgan-x2, controlnet-sd15, controlnet-sdxl")),
    }
}

fn hidden_width(s: &str) -> Result<u32, String> {
    s.parse()
        .ok()
        .filter(|v: &u32| (64..=3840).contains(v) && v.is_multiple_of(64))
        .ok_or_else(|| "a multiple of 64 from 64 to 3840 (flux, chroma, qwen3, zimage: of 128, heads of 128)".into())
}

fn weight_type(s: &str) -> Result<WeightType, String> {
    WeightType::parse(s).ok_or_else(|| fixture::FixtureError::UnknownType(s.to_owned()).to_string())
}

fn component(s: &str) -> Result<Component, String> {
    Component::from_short_name(s.trim()).ok_or_else(|| format!("unknown component '{s}' (accepted: unet, text, vae)"))
}

fn std_dev(s: &str) -> Result<f64, String> {
    s.parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v > 0.0)
        .ok_or_else(|| "a positive standard deviation such as 0.02".into())
}

/// Entry point of `cargo xtask fixture ...` (`args` excludes the subcommand name).
pub fn run(args: Args) -> Result<()> {
    let heads_of_128 = matches!(
        args.family,
        Target::Flux { .. }
            | Target::Chroma { .. }
            | Target::Qwen3 { .. }
            | Target::ZImage
            | Target::LoraFlux
            | Target::Flux2 { .. }
    );
    if let Some(h) = args.hidden.filter(|h| heads_of_128 && !h.is_multiple_of(128)) {
        bail!("--hidden {h}: this model's heads are 128 wide, so its width is a multiple of 128");
    }
    let family = match args.family {
        Target::Model(f) => f,
        Target::T5xxl => return run_t5xxl(&args),
        Target::Qwen3 { arch } => return run_qwen3(&args, arch),
        Target::ZImage => return run_zimage(&args),
        Target::Flux { schnell } => return run_flux(&args, schnell),
        Target::Chroma { radiance } => return run_chroma(&args, radiance),
        Target::Sd35 { medium } => return run_sd35(&args, medium),
        Target::FluxVae => return run_flux_vae(&args),
        Target::Flux2 { dev } => return run_flux2(&args, dev),
        Target::Flux2Vae => return run_flux2_vae(&args),
        Target::ClipL => return run_clip_l(&args),
        Target::Taesd { z_channels } => return run_taesd(&args, z_channels),
        Target::Esrgan { scale, blocks } => return run_esrgan(&args, scale, blocks),
        Target::ControlNet { sdxl } => return run_controlnet(&args, sdxl),
        Target::LoraSd15 | Target::LoraFlux | Target::LoraSdxl(_) => return run_lora(&args),
    };
    if args.layers.is_some() {
        bail!("--layers applies to t5xxl and qwen3 fixtures only");
    }
    if args.depth.is_some() || args.with_clips {
        bail!("--depth and --with-clips apply to sd35-large and sd35-medium fixtures only");
    }
    if args.double.is_some() || args.single.is_some() || args.hidden.is_some() {
        bail!("--double, --single and --hidden apply to flux and chroma fixtures only");
    }
    if args.refiner_layers.is_some() || args.cap_dim.is_some() {
        bail!("--refiner-layers and --cap-dim apply to zimage fixtures only");
    }
    if args.output.is_none() && (args.only.is_some() || args.std.is_some() || args.std_everywhere || args.plain_norms) {
        bail!("a modified fixture (--only, --std, --std-everywhere, --plain-norms) needs -o FILE");
    }
    let (path, format) = output(&args, || fixture::cached_path(family, args.seed, args.wtype))?;
    let mut req = FixtureRequest::family(family, args.seed, args.wtype, format);
    if let Some(only) = &args.only {
        let mut only = only.clone();
        if only.contains(&Component::TextEncoder(0)) {
            only.push(Component::TextEncoder(1));
        }
        req.arch = req.arch.only(&only);
    }
    req.weight_std = args.std;
    req.std_everywhere = args.std_everywhere;
    req.plain_norms = args.plain_norms;
    let start = Instant::now();
    let report = fixture::write_fixture(&path, &req)?;
    let std = args.std.map(|s| format!(", weights N(0, {s})")).unwrap_or_default();
    print_written(&report, &format!("{} fixture, seed {}, {}{std}", family.name(), args.seed, args.wtype), start);
    Ok(())
}

/// Where a fixture goes and in which format: `-o FILE` (the format from its extension), else
/// `cached` in the fixture cache (created if missing), in the weight type's usual format.
fn output(args: &Args, cached: impl FnOnce() -> PathBuf) -> Result<(PathBuf, FileFormat)> {
    if let Some(p) = &args.output {
        return Ok((p.clone(), FileFormat::from_path(p)?));
    }
    let dir = fixture::cache_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok((cached(), FileFormat::for_type(args.wtype)))
}

/// The line printed for a written fixture (`what` describes it), with its size and time.
fn print_written(report: &FixtureReport, what: &str, start: Instant) {
    println!(
        "wrote {} ({what}): {} tensors, {:.2} M parameters, {:.1} MiB in {:.1} s",
        report.path.display(),
        report.tensors,
        report.params as f64 / 1e6,
        report.bytes as f64 / (1024.0 * 1024.0),
        start.elapsed().as_secs_f64()
    );
}

/// `cargo xtask fixture t5xxl ...`.
fn run_t5xxl(args: &Args) -> Result<()> {
    if args.only.is_some() || args.std.is_some() || args.std_everywhere || args.plain_norms {
        bail!("--only, --std, --std-everywhere and --plain-norms apply to checkpoint families, not t5xxl");
    }
    if args.layers.is_some_and(|l| l > 24) || args.intermediate.is_some() || args.hidden.is_some() {
        bail!("t5xxl takes --layers 1 to 24 and no --hidden or --intermediate");
    }
    let cfg = T5Config { n_layers: args.layers.unwrap_or(24) as usize, ..T5Config::xxl() };
    let (path, format) = output(args, || t5::cached_t5xxl_path(cfg.n_layers, args.seed, args.wtype))?;
    let start = Instant::now();
    let report = t5::write_t5xxl(&path, &cfg, args.seed, args.wtype, format)?;
    let what = format!("t5xxl fixture, {} blocks, seed {}, {}", cfg.n_layers, args.seed, args.wtype);
    print_written(&report, &what, start);
    Ok(())
}

/// `cargo xtask fixture qwen3 ...`: a Qwen3 `--llm` file (Qwen3-4B's heads), Hugging Face
/// names in safetensors, llama.cpp's in GGUF; `-o` is required unless every size is the
/// default (the cache entry names seed, type and depth only).
fn run_qwen3(args: &Args, arch: LlmArch) -> Result<()> {
    let (name, full) = match arch {
        LlmArch::Qwen3 => ("qwen3", Qwen3Config::qwen3_4b()),
        LlmArch::Mistral => ("mistral", Qwen3Config::mistral_small_3_2()),
        LlmArch::Qwen25Vl => ("qwen25vl", Qwen3Config::qwen25_vl_7b()),
    };
    if args.only.is_some() || args.std_everywhere || args.plain_norms {
        bail!("--only, --std-everywhere and --plain-norms apply to checkpoint families, not {name}");
    }
    let cfg = Qwen3Config {
        n_layers: args.layers.map_or(full.n_layers, |l| l as usize),
        hidden: args.hidden.map_or(full.hidden, |h| h as usize),
        intermediate: args.intermediate.map_or(full.intermediate, |i| i as usize),
        ..full.clone()
    };
    if cfg.n_layers == 28 && arch == LlmArch::Qwen3 {
        bail!("the reference reads a 28-layer Qwen3 as Qwen3-1.7B (16 heads): choose another depth");
    }
    if !cfg.intermediate.is_multiple_of(32) {
        bail!("--intermediate {} is not a multiple of 32 (quantized blocks)", cfg.intermediate);
    }
    let modified = cfg.hidden != full.hidden || cfg.intermediate != full.intermediate || args.std.is_some();
    if modified && args.output.is_none() {
        bail!("a {name} fixture with --hidden, --intermediate or --std needs -o FILE");
    }
    let (path, format) = output(args, || {
        let format = FileFormat::for_type(args.wtype);
        fixture::cache_dir().join(format!(
            "{name}-fixture-seed{}-{}-{}l.{}",
            args.seed,
            args.wtype,
            cfg.n_layers,
            format.extension()
        ))
    })?;
    let start = Instant::now();
    let report = qwen3::write_qwen3(&path, &cfg, args.seed, args.std, args.wtype, format)?;
    let std = args.std.map(|s| format!(", weights N(0, {s})")).unwrap_or_default();
    let what = format!(
        "{name} fixture, {} layers, width {}, SwiGLU {}, seed {}, {}{std}",
        cfg.n_layers, cfg.hidden, cfg.intermediate, args.seed, args.wtype
    );
    print_written(&report, &what, start);
    Ok(())
}

/// `cargo xtask fixture zimage ...`: a Z-Image transformer; `-o` is required with `--std`
/// (the cache entry names the sizes, seed and type only).
fn run_zimage(args: &Args) -> Result<()> {
    if args.only.is_some() || args.std_everywhere || args.plain_norms || args.double.is_some() || args.single.is_some()
    {
        bail!("--only, --std-everywhere, --plain-norms, --double and --single do not apply to zimage fixtures");
    }
    if args.intermediate.is_some() {
        bail!("--intermediate applies to qwen3 fixtures only (the SwiGLU width of zimage follows --hidden)");
    }
    let full = ZImageConfig::turbo();
    let cfg = ZImageConfig::reduced(
        args.hidden.map_or(full.hidden_size, i64::from),
        args.layers.map_or(full.num_layers, |l| l as usize),
        args.refiner_layers.map_or(full.num_refiner_layers, |r| r as usize),
        args.cap_dim.map_or(full.cap_feat_dim, i64::from),
    );
    if args.std.is_some() && args.output.is_none() {
        bail!("a zimage fixture with --std needs -o FILE");
    }
    let (path, format) = output(args, || zimage::cached_zimage_path(&cfg, args.seed, args.wtype))?;
    let start = Instant::now();
    let report = zimage::write_zimage(&path, &cfg, args.seed, args.std, args.wtype, format)?;
    let std = args.std.map(|s| format!(", weights N(0, {s})")).unwrap_or_default();
    let what = format!(
        "zimage fixture, width {}, {} layers + {} refiners each, captions {}, seed {}, {}{std}",
        cfg.hidden_size, cfg.num_layers, cfg.num_refiner_layers, cfg.cap_feat_dim, args.seed, args.wtype
    );
    print_written(&report, &what, start);
    Ok(())
}

/// `cargo xtask fixture sd35-large|sd35-medium [--depth N] [--hidden N] [--with-clips] ...`: an
/// SD3.5 checkpoint (MMDiT and VAE, CLIP-L and CLIP-G with `--with-clips`).
fn run_sd35(args: &Args, medium: bool) -> Result<()> {
    if args.only.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std-everywhere, --plain-norms and --layers do not apply to sd35 fixtures (--depth sets the blocks)");
    }
    if args.double.is_some() || args.single.is_some() || args.refiner_layers.is_some() || args.cap_dim.is_some() {
        bail!("--double, --single, --refiner-layers and --cap-dim do not apply to sd35 fixtures");
    }
    let base = if medium { MmditConfig::sd35_medium() } else { MmditConfig::sd35_large() };
    let depth = args.depth.map_or(base.depth, |d| d as usize);
    let hidden = args.hidden.map_or(base.hidden_size, i64::from);
    if hidden % depth as i64 != 0 {
        bail!("--hidden {hidden} is not a multiple of --depth {depth}: the model has as many heads as blocks");
    }
    let side = base.pos_embed_max_size;
    let cfg = sd3::reduced(base, hidden, depth, side);
    if args.std.is_some() && args.output.is_none() {
        bail!("an sd35 fixture with --std needs -o FILE");
    }
    let (path, format) = output(args, || sd3::cached_sd3_path(&cfg, args.seed, args.wtype, args.with_clips))?;
    let start = Instant::now();
    let report = sd3::write_sd3(&path, &cfg, args.seed, args.std, args.wtype, format, args.with_clips)?;
    let std = args.std.map(|s| format!(", weights N(0, {s})")).unwrap_or_default();
    let clips = if args.with_clips { ", with CLIP-L and CLIP-G" } else { "" };
    let what = format!(
        "{} fixture, width {}, {} joint blocks ({} with attn2), seed {}, {}{std}{clips}",
        if medium { "sd35-medium" } else { "sd35-large" },
        cfg.hidden_size,
        cfg.depth,
        cfg.self_attn_blocks,
        args.seed,
        args.wtype
    );
    print_written(&report, &what, start);
    Ok(())
}

/// `cargo xtask fixture flux-vae ...`.
fn run_flux_vae(args: &Args) -> Result<()> {
    if args.only.is_some() || args.std.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std, --std-everywhere, --plain-norms and --layers do not apply to flux-vae");
    }
    let (path, format) = output(args, || flux_vae::cached_flux_vae_path(args.seed, args.wtype))?;
    let start = Instant::now();
    let report = flux_vae::write_flux_vae(&path, args.seed, args.wtype, format)?;
    print_written(&report, &format!("flux-vae fixture, seed {}, {}", args.seed, args.wtype), start);
    Ok(())
}

fn run_flux2_vae(args: &Args) -> Result<()> {
    if args.only.is_some() || args.std.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std, --std-everywhere, --plain-norms and --layers do not apply to flux2-vae");
    }
    let (path, format) = output(args, || flux_vae::cached_flux2_vae_path(args.seed, args.wtype))?;
    let start = Instant::now();
    let report = flux_vae::write_flux2_vae(&path, args.seed, args.wtype, format)?;
    print_written(&report, &format!("flux2-vae fixture, seed {}, {}", args.seed, args.wtype), start);
    Ok(())
}

/// `cargo xtask fixture flux2-klein|flux2-dev [--hidden N] [--double N] [--single N] [--cap-dim N]
/// [--std S] ...` (dev: the guidance embedding; the reference takes a file for dev by its 48th
/// single block, so dev needs `--single` of 48 or more).
fn run_flux2(args: &Args, dev: bool) -> Result<()> {
    let name = if dev { "flux2-dev" } else { "flux2-klein" };
    if args.only.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std-everywhere, --plain-norms and --layers do not apply to {name} fixtures");
    }
    let full = if dev { FluxConfig::flux2_dev() } else { FluxConfig::flux2_klein_4b() };
    let cfg = FluxConfig {
        guidance_embed: dev,
        ..flux::reduced_flux2(
            args.hidden.map_or(full.hidden_size, i64::from),
            args.double.map_or(full.depth, |d| d as usize),
            args.single.map_or(full.depth_single_blocks, |s| s as usize),
            args.cap_dim.map_or(full.context_in_dim, |c| 3 * i64::from(c)),
        )
    };
    if cfg.depth + cfg.depth_single_blocks == 0 {
        bail!("--double 0 --single 0 leaves no block: give at least one");
    }
    if dev != (cfg.depth_single_blocks >= 48) {
        bail!(
            "--single {}: the reference takes a FLUX.2 file with a 48th single block for dev and without one for klein",
            cfg.depth_single_blocks
        );
    }
    let (path, format) = output(args, || flux::cached_flux2_path(&cfg, args.seed, args.std, args.wtype))?;
    let start = Instant::now();
    let report = flux::write_flux2(&path, &cfg, args.seed, args.std, args.wtype, format)?;
    let std = args.std.map(|s| format!(", weights N(0, {s})")).unwrap_or_default();
    let what = format!(
        "{name} fixture, width {}, {} double + {} single blocks, context {}, seed {}, {}{std}",
        cfg.hidden_size, cfg.depth, cfg.depth_single_blocks, cfg.context_in_dim, args.seed, args.wtype
    );
    print_written(&report, &what, start);
    Ok(())
}

/// `cargo xtask fixture esrgan|esrgan-anime|esrgan-x2 [--blocks N] [--features F] [--std S] ...`.
fn run_esrgan(args: &Args, scale: usize, blocks: usize) -> Result<()> {
    if args.only.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std-everywhere, --plain-norms and --layers do not apply to esrgan");
    }
    let fixture = fixture::esrgan::EsrganFixture {
        scale,
        blocks: args.blocks.map_or(blocks, |b| b as usize),
        features: args.features.map_or(64, |f| f as usize),
        std: args.std,
        seed: args.seed,
    };
    let (path, format) = output(args, || fixture.cached_path(args.wtype))?;
    let start = Instant::now();
    let report = fixture.write(&path, args.wtype, format)?;
    let what = format!(
        "ESRGAN x{scale} fixture, {} blocks, {} features, seed {}, {}",
        fixture.blocks, fixture.features, args.seed, args.wtype
    );
    print_written(&report, &what, start);
    Ok(())
}

/// `cargo xtask fixture controlnet-sd15|controlnet-sdxl [--std S] [--seed N] [-o FILE]`.
fn run_controlnet(args: &Args, sdxl: bool) -> Result<()> {
    if args.only.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std-everywhere, --plain-norms and --layers do not apply to ControlNet fixtures");
    }
    let fixture = if sdxl {
        fixture::controlnet::ControlNetFixture::sdxl(args.std, args.seed)
    } else {
        fixture::controlnet::ControlNetFixture::sd15(args.std, args.seed)
    };
    let (path, format) = output(args, || fixture.cached_path(args.wtype))?;
    let start = Instant::now();
    let report = fixture.write(&path, args.wtype, format)?;
    let std = args.std.map(|s| format!(", std {s}")).unwrap_or_default();
    let family = if sdxl { "SDXL" } else { "SD 1.x" };
    print_written(&report, &format!("{family} ControlNet fixture, seed {}{std}, {}", args.seed, args.wtype), start);
    Ok(())
}

/// `cargo xtask fixture taesd|taef1 ...`.
fn run_taesd(args: &Args, z_channels: usize) -> Result<()> {
    if args.only.is_some() || args.std.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std, --std-everywhere, --plain-norms and --layers do not apply to tiny autoencoders");
    }
    let (path, format) = output(args, || taesd::cached_taesd_path(z_channels, args.seed, args.wtype))?;
    let start = Instant::now();
    let report = taesd::write_taesd(&path, z_channels, args.seed, args.wtype, format)?;
    let what = format!("tiny autoencoder fixture, {z_channels} latent channels, seed {}, {}", args.seed, args.wtype);
    print_written(&report, &what, start);
    Ok(())
}

/// `cargo xtask fixture flux|flux-schnell ...`.
fn run_clip_l(args: &Args) -> Result<()> {
    if args.only.is_some() || args.std.is_some() || args.layers.is_some() || args.hidden.is_some() {
        bail!("--only, --std, --layers and --hidden do not apply to clip-l");
    }
    let (path, format) = output(args, || fixture::cached_clip_l_path(args.seed, args.wtype))?;
    let start = Instant::now();
    let report = fixture::write_clip_l(&path, args.seed, args.wtype, format)?;
    print_written(&report, &format!("clip-l fixture (the sd15 fixture's), seed {}, {}", args.seed, args.wtype), start);
    Ok(())
}

fn run_lora(args: &Args) -> Result<()> {
    let Some(path) = &args.output else { bail!("a LoRA fixture needs -o FILE.safetensors") };
    let req = LoraFixture {
        layout: args.layout,
        rank: args.rank,
        seed: args.seed,
        scale: args.scale,
        text_encoder: !args.unet_only,
    };
    let (n, what) = if args.family == Target::LoraFlux {
        let cfg = flux_config(args, args.schnell_dit);
        let n = write_flux_lora(path, &cfg, &req)?;
        (n, format!("flux width {}, {} double + {} single blocks", cfg.hidden_size, cfg.depth, cfg.depth_single_blocks))
    } else {
        if args.schnell_dit || args.hidden.is_some() || args.double.is_some() || args.single.is_some() {
            bail!("--schnell-dit, --hidden, --double and --single are lora-flux flags");
        }
        match args.family {
            Target::LoraSdxl(family) => {
                let Some(unet) = family.architecture().unet else { bail!("the {} fixture has no UNet", family.name()) };
                (write_sdxl_lora(path, &unet, &req)?, family.name().to_owned())
            }
            _ => (write_lora(path, &req)?, "sd15".to_owned()),
        }
    };
    println!(
        "wrote {} (LoRA for {what}, {:?} layout, rank {}, seed {}, N(0, {})): {n} adapters",
        path.display(),
        args.layout,
        args.rank,
        args.seed,
        args.scale
    );
    Ok(())
}

/// The FLUX configuration of `--hidden`, `--double`, `--single` (full size by default).
fn flux_config(args: &Args, schnell: bool) -> sd_models::diffusion::flux::FluxConfig {
    flux::reduced(
        args.hidden.unwrap_or(3072) as i64,
        args.double.unwrap_or(19) as usize,
        args.single.unwrap_or(38) as usize,
        schnell,
    )
}

/// `cargo xtask fixture chroma ...`: the released approximator (5120 wide, 5 layers, which the
/// reference builds whatever the file holds) with reduced blocks.
fn run_chroma(args: &Args, radiance: bool) -> Result<()> {
    if args.only.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std-everywhere, --plain-norms and --layers do not apply to chroma fixtures");
    }
    let reduced = if radiance { flux::reduced_chroma_radiance } else { flux::reduced_chroma };
    let cfg = reduced(
        args.hidden.unwrap_or(3072) as i64,
        args.double.unwrap_or(19) as usize,
        args.single.unwrap_or(38) as usize,
    );
    if cfg.depth + cfg.depth_single_blocks == 0 {
        bail!("--double 0 --single 0 leaves no block: give at least one");
    }
    if args.std.is_some() && args.output.is_none() {
        bail!("a chroma fixture with --std needs -o FILE");
    }
    let (path, format) = output(args, || flux::cached_chroma_path(&cfg, args.seed, args.wtype))?;
    let start = Instant::now();
    let report = flux::write_chroma(&path, &cfg, args.seed, args.std, args.wtype, format)?;
    let std = args.std.map(|s| format!(", weights N(0, {s})")).unwrap_or_default();
    let what = format!(
        "{} fixture, width {}, {} double + {} single blocks, seed {}, {}{std}",
        if radiance { "chroma-radiance" } else { "chroma" },
        cfg.hidden_size,
        cfg.depth,
        cfg.depth_single_blocks,
        args.seed,
        args.wtype
    );
    print_written(&report, &what, start);
    Ok(())
}

fn run_flux(args: &Args, schnell: bool) -> Result<()> {
    if args.only.is_some() || args.std.is_some() || args.std_everywhere || args.plain_norms || args.layers.is_some() {
        bail!("--only, --std, --std-everywhere, --plain-norms and --layers do not apply to flux fixtures");
    }
    let cfg = flux_config(args, schnell);
    if cfg.depth + cfg.depth_single_blocks == 0 {
        bail!("--double 0 --single 0 leaves no block: give at least one");
    }
    let (path, format) = output(args, || flux::cached_flux_path(&cfg, args.seed, args.wtype))?;
    let start = Instant::now();
    let report = flux::write_flux(&path, &cfg, args.seed, args.wtype, format)?;
    let what = format!(
        "{} fixture, width {}, {} double + {} single blocks, seed {}, {}",
        if schnell { "flux-schnell" } else { "flux" },
        cfg.hidden_size,
        cfg.depth,
        cfg.depth_single_blocks,
        args.seed,
        args.wtype
    );
    print_written(&report, &what, start);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Args> {
        crate::parse_test(line)
    }

    #[test]
    fn parses_the_documented_command_line() {
        let a = parse("sd21 --seed 7 --type q8_0 -o m.gguf --only unet,vae --std 0.05").unwrap();
        assert_eq!(
            a,
            Args {
                family: Target::Model(FixtureModel::Sd21),
                layers: None,
                intermediate: None,
                depth: None,
                with_clips: false,
                refiner_layers: None,
                cap_dim: None,
                double: None,
                single: None,
                hidden: None,
                blocks: None,
                features: None,
                seed: 7,
                wtype: WeightType::Q8_0,
                output: Some("m.gguf".into()),
                only: Some(vec![Component::Diffusion, Component::Vae]),
                std: Some(0.05),
                std_everywhere: false,
                plain_norms: false,
                layout: LoraLayout::Kohya,
                rank: 4,
                scale: 0.05,
                unet_only: false,
                schnell_dit: false,
            }
        );
        assert_eq!(parse("ssd-1b --type q8_0").unwrap().family, Target::Model(FixtureModel::Ssd1b));
        let m = parse("sd35-medium --depth 2 --hidden 128 --with-clips --std 0.04 -o m.safetensors").unwrap();
        assert_eq!(
            (m.family, m.depth, m.hidden, m.with_clips, m.std),
            (Target::Sd35 { medium: true }, Some(2), Some(128), true, Some(0.04))
        );
        assert!(parse("sd35-large --depth 39").is_err(), "SD3.5 Large has 38 blocks");
        let l = parse("lora-sd15 --layout peft --rank 8 --seed 3 --scale 0.1 -o l.safetensors").unwrap();
        assert_eq!((l.family, l.layout, l.rank, l.seed, l.scale), (Target::LoraSd15, LoraLayout::Peft, 8, 3, 0.1));
        assert_eq!(parse("lora-vega -o v.safetensors").unwrap().family, Target::LoraSdxl(FixtureModel::Vega));
        let l = parse("lora-flux --layout diffusers --hidden 256 --double 2 --single 2 -o f.safetensors").unwrap();
        assert_eq!(
            (l.family, l.layout, l.hidden, l.double),
            (Target::LoraFlux, LoraLayout::Diffusers, Some(256), Some(2))
        );
        let q = parse("qwen3 --layers 3 --hidden 256 --intermediate 512 --std 0.03 -o q.safetensors").unwrap();
        assert_eq!(
            (q.family, q.layers, q.hidden, q.intermediate, q.std),
            (Target::Qwen3 { arch: LlmArch::Qwen3 }, Some(3), Some(256), Some(512), Some(0.03))
        );
        assert_eq!(parse("mistral --layers 30 -o m.gguf").unwrap().family, Target::Qwen3 { arch: LlmArch::Mistral });
        assert_eq!(parse("qwen25vl -o q.gguf").unwrap().family, Target::Qwen3 { arch: LlmArch::Qwen25Vl });
        let d = parse("flux2-dev --hidden 256 --double 1 --single 48 -o d.safetensors").unwrap();
        assert_eq!((d.family, d.single), (Target::Flux2 { dev: true }, Some(48)));
        assert!(parse("flux2-dev --single 65").is_err());
        let z = parse(
            "zimage --layers 2 --refiner-layers 1 --seed 3 --std 0.02 --hidden 256 --cap-dim 256 -o z.safetensors",
        )
        .unwrap();
        assert_eq!(
            (z.family, z.layers, z.refiner_layers, z.seed, z.std, z.hidden, z.cap_dim),
            (Target::ZImage, Some(2), Some(1), 3, Some(0.02), Some(256), Some(256))
        );
        let t = parse("t5xxl --layers 2 --type q8_0").unwrap();
        assert_eq!((t.family, t.layers, t.wtype), (Target::T5xxl, Some(2), WeightType::Q8_0));
        let f = parse("flux-schnell --double 2 --single 1 --hidden 256 --type q8_0").unwrap();
        assert_eq!(
            (f.family, f.double, f.single, f.hidden, f.wtype),
            (Target::Flux { schnell: true }, Some(2), Some(1), Some(256), WeightType::Q8_0)
        );
        let v = parse("flux-vae --type f32 -o ae.safetensors").unwrap();
        assert_eq!((v.family, v.wtype, v.output), (Target::FluxVae, WeightType::F32, Some("ae.safetensors".into())));
        assert_eq!(parse("taef1 --seed 3").unwrap().family, Target::Taesd { z_channels: 16 });
        assert_eq!(parse("taesd").unwrap().family, Target::Taesd { z_channels: 4 });
        let e = parse("esrgan --blocks 2 --features 16 --std 0.02 --seed 5").unwrap();
        assert_eq!((e.family, e.blocks, e.features), (Target::Esrgan { scale: 4, blocks: 23 }, Some(2), Some(16)));
        assert_eq!(parse("esrgan-anime").unwrap().family, Target::Esrgan { scale: 4, blocks: 6 });
        let d = parse("sd-turbo").unwrap();
        assert_eq!((d.seed, d.wtype, d.output, d.only, d.std), (42, WeightType::F16, None, None, None));
        let c = parse("chroma --double 2 --single 1 --hidden 256 --seed 9 --std 0.02 -o c.safetensors").unwrap();
        assert_eq!(
            (c.family, c.double, c.single, c.hidden, c.std),
            (Target::Chroma { radiance: false }, Some(2), Some(1), Some(256), Some(0.02))
        );
    }

    #[test]
    fn rejects_bad_command_lines_with_the_reason() {
        for (line, needle) in [
            ("", "<sd15|sd21|sd-turbo|sdxl|ssd-1b|vega|sd15-inpaint|lora-sd15|lora-flux|t5xxl|qwen3|flux|flux-schnell|chroma|chroma-radiance|sd35-large|sd35-medium|flux-vae|flux2-klein|flux2-vae|clip-l|taesd|taef1|taef2|zimage|esrgan|esrgan-anime|esrgan-x2|controlnet-sd15|controlnet-sdxl>"),
            ("flux --hidden 200", "--hidden"),
            ("flux --double 20", "--double"),
            ("lora-sd15 --layout lycoris", "lycoris"),
            ("t5xxl --layers 0", "--layers"),
            ("t5xxl --layers 37", "--layers"),
            ("qwen3 --intermediate 8", "--intermediate"),
            ("zimage --refiner-layers 3", "--refiner-layers"),
            ("wan21", "wan21"),
            ("sd15 --type q3_k", "q3_k"),
            ("sd15 --seed -1", "--seed"),
            ("sd15 --seed", "a value is required"),
            ("sd15 --only unet,clip", "clip"),
            ("sd15 sd21", "unexpected argument"),
            ("sd15 --fast", "--fast"),
            ("sd15 --std 0", "--std"),
            ("sd15 --std x", "--std"),
            ("sd15 --std-everywhere", "--std <S>"),
            ("sd15 --std 0.1 --std-everywhere --plain-norms", "--plain-norms"),
        ] {
            let e = parse(line).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }
}
