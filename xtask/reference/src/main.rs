//! sdref: stable-diffusion.cpp (the reference) as a separate process, for side-by-side runs.
//!
//! Why a separate executable: sd.cpp links its own ggml (another version,
//! built with GGML_MAX_NAME=128), which must never share a process with ours.
//! We compare across the process boundary through files: PNGs, and raw f32
//! tensors with a JSON sidecar (see `rawio`).
//!
//! Subcommands:
//! - `txt2img` (img2img with `-i`): sd.cpp CLI flag names, mapped onto the C
//!   API (`new_sd_ctx`, `generate_image`); writes PNGs and prints machine-
//!   readable `SDREF_TIMING` and `SDREF_RSS` lines on stderr.
//! - `encode-text`, `unet`, `vae-decode`: one component of the loaded model,
//!   evaluated by sd.cpp's own objects, dumped as raw f32 (driver/driver.cpp
//!   explains how it reaches them without patching sd.cpp).
//! - `t5-tokens`: sd.cpp's T5 tokenizer on a list of prompts (ids, and FLUX's per-token
//!   weights and 256-id chunks), as JSON; no model is loaded.
//! - `t5-encode`: sd.cpp's T5-XXL on a `--t5xxl` file alone, for a prompt tokenized as FLUX
//!   does, each 256-id chunk encoded on its own; the raw hidden states (before the token
//!   weights) as raw f32.
//! - `qwen-tokens`: sd.cpp's Qwen2 tokenizer on a list of prompts (raw, or Z-Image's chat
//!   template with the prompt's weights), as JSON; no model is loaded. `--mistral`: its
//!   Mistral tokenizer (raw, or with `--flux2` FLUX.2 dev's template).
//! - `llm-encode`: sd.cpp's LLM (`--arch`: Qwen3, Mistral or Qwen2.5-VL) on an `--llm` file alone, for a prompt tokenized as
//!   Z-Image does; the hidden states of `--out-layer` (before the token weights) as raw f32.
//! - `upscale`: sd.cpp's ESRGAN upscaler (`new_upscaler_ctx`, `upscale`) on a PNG, as its
//!   CLI's `-M upscale` runs it; writes the PNG and an `SDREF_TIMING` line.
//! - `info`: sd.cpp's version and the CPU features its ggml was built for.

mod ffi;
mod rawio;
mod timing;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use serde_json::{json, Map};

use ffi::{Context, CtxOptions, GenOptions, Tensor};
use timing::Recorder;

#[derive(Parser, Debug)]
#[command(name = "sdref", about = "stable-diffusion.cpp reference runs and component dumps")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate images (img2img when -i is given), as sd.cpp's CLI does.
    Txt2img(Txt2Img),
    /// Dump the text conditioning sd.cpp feeds the diffusion model.
    EncodeText(EncodeText),
    /// Dump one diffusion-model (UNet) evaluation.
    Unet(Unet),
    /// Dump a VAE decode, before clamping and uint8 conversion.
    VaeDecode(VaeDecode),
    /// Upscale a PNG with an ESRGAN model, as sd.cpp's CLI `-M upscale` does.
    Upscale(Upscale),
    /// Canny edges of a PNG with sd.cpp's `preprocess_canny` (the CLI's `--canny` thresholds).
    Canny(Canny),
    /// Print sd.cpp's T5 token ids (and FLUX's per-token weights) for prompts; no model needed.
    T5Tokens(T5Tokens),
    /// Dump sd.cpp's raw T5-XXL hidden states for a prompt (FLUX's tokenization); only --t5xxl.
    T5Encode(T5Encode),
    /// Print sd.cpp's Qwen2 token ids (raw, or Z-Image's template and weights); no model needed.
    QwenTokens(QwenTokens),
    /// Dump sd.cpp's Qwen3 hidden states for a prompt (Z-Image's tokenization); only --llm.
    LlmEncode(LlmEncode),
    /// Print sd.cpp's version and system info.
    Info,
}

/// Model and runtime flags, named as in sd.cpp's CLI.
#[derive(Args, Debug)]
struct ModelArgs {
    /// Path to the full model (checkpoint, diffusers folder or GGUF).
    #[arg(short = 'm', long = "model")]
    model: Option<String>,
    /// Path to a standalone diffusion model.
    #[arg(long = "diffusion-model")]
    diffusion_model: Option<String>,
    /// Path to a standalone VAE.
    #[arg(long = "vae")]
    vae: Option<String>,
    /// Path to a standalone CLIP-L text encoder.
    #[arg(long = "clip_l")]
    clip_l: Option<String>,
    /// Path to a standalone CLIP-G text encoder.
    #[arg(long = "clip_g")]
    clip_g: Option<String>,
    /// Path to a standalone T5-XXL text encoder.
    #[arg(long = "t5xxl")]
    t5xxl: Option<String>,
    /// Path to an LLM text encoder (Z-Image's Qwen3).
    #[arg(long = "llm")]
    llm: Option<String>,
    /// Path to a tiny autoencoder (TAESD, TAESDXL, TAEF1), used instead of the VAE.
    #[arg(long = "taesd")]
    taesd: Option<String>,
    /// Path to a ControlNet (the library's `control_net_path`).
    #[arg(long = "control-net")]
    control_net: Option<String>,
    /// Run the ControlNet on the CPU (prepends `controlnet=cpu` to the backend).
    #[arg(long = "control-net-cpu")]
    control_net_cpu: bool,
    /// Threads; <= 0 means the number of physical cores (sd.cpp's default).
    #[arg(short = 't', long = "threads", default_value_t = -1, allow_negative_numbers = true)]
    threads: i32,
    /// Weight type (f32, f16, q8_0, q4_0, ...); default: as in the file.
    #[arg(long = "type")]
    wtype: Option<String>,
    /// RNG: cuda (default), std_default or cpu.
    #[arg(long = "rng")]
    rng: Option<String>,
    /// Sampler RNG; default: same as --rng.
    #[arg(long = "sampler-rng")]
    sampler_rng: Option<String>,
    /// Runtime backend assignment, e.g. cpu or te=cpu,vae=cuda0.
    #[arg(long = "backend")]
    backend: Option<String>,
    /// Parameter backend assignment, e.g. disk, cpu or diffusion=disk.
    #[arg(long = "params-backend")]
    params_backend: Option<String>,
    /// VRAM budget in GiB for graph-cut segmented execution (0: off).
    #[arg(long = "max-vram", default_value_t = 0.0, allow_negative_numbers = true)]
    max_vram: f32,
    /// Keep weights in RAM (params backend "*=cpu").
    #[arg(long = "offload-to-cpu")]
    offload_to_cpu: bool,
    /// Run the text encoder on the CPU.
    #[arg(long = "clip-on-cpu")]
    clip_on_cpu: bool,
    /// Run the VAE on the CPU.
    #[arg(long = "vae-on-cpu")]
    vae_on_cpu: bool,
    /// Flash attention everywhere.
    #[arg(long = "fa")]
    flash_attn: bool,
    /// Flash attention in the diffusion model only.
    #[arg(long = "diffusion-fa")]
    diffusion_fa: bool,
    /// ggml_conv2d_direct in the diffusion model.
    #[arg(long = "diffusion-conv-direct")]
    diffusion_conv_direct: bool,
    /// ggml_conv2d_direct in the VAE.
    #[arg(long = "vae-conv-direct")]
    vae_conv_direct: bool,
    /// Memory-map the model file.
    #[arg(long = "mmap")]
    mmap: bool,
    /// How LoRAs are applied: auto, immediately (the default here) or at_runtime (the
    /// library's `lora_apply_mode`).
    #[arg(long = "lora-apply-mode")]
    lora_apply_mode: Option<String>,
    /// Also echo sd.cpp's DEBUG log lines.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
}

impl ModelArgs {
    fn ctx_options(&self) -> CtxOptions {
        CtxOptions {
            model: self.model.clone(),
            diffusion_model: self.diffusion_model.clone(),
            vae: self.vae.clone(),
            clip_l: self.clip_l.clone(),
            clip_g: self.clip_g.clone(),
            t5xxl: self.t5xxl.clone(),
            taesd: self.taesd.clone(),
            wtype: self.wtype.clone(),
            rng: self.rng.clone(),
            sampler_rng: self.sampler_rng.clone(),
            backend: self.backend.clone(),
            params_backend: self.params_backend.clone(),
            threads: self.threads,
            max_vram: self.max_vram,
            offload_to_cpu: self.offload_to_cpu,
            clip_on_cpu: self.clip_on_cpu,
            vae_on_cpu: self.vae_on_cpu,
            flash_attn: self.flash_attn,
            diffusion_fa: self.diffusion_fa,
            diffusion_conv_direct: self.diffusion_conv_direct,
            vae_conv_direct: self.vae_conv_direct,
            mmap: self.mmap,
            lora_apply_mode: self.lora_apply_mode.clone(),
            llm: self.llm.clone(),
            control_net: self.control_net.clone(),
            control_net_cpu: self.control_net_cpu,
        }
    }

    fn model_desc(&self) -> String {
        self.model.clone().or_else(|| self.diffusion_model.clone()).unwrap_or_default()
    }
}

#[derive(Args, Debug)]
struct Txt2Img {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(short = 'p', long = "prompt", default_value = "")]
    prompt: String,
    #[arg(short = 'n', long = "negative-prompt", default_value = "")]
    negative_prompt: String,
    /// Image width; default 512, or the init image's width.
    #[arg(short = 'W', long = "width")]
    width: Option<i32>,
    /// Image height; default 512, or the init image's height.
    #[arg(short = 'H', long = "height")]
    height: Option<i32>,
    #[arg(long = "steps", default_value_t = 20)]
    steps: i32,
    #[arg(long = "cfg-scale", default_value_t = 7.0)]
    cfg_scale: f32,
    /// euler, euler_a, heun, dpm2, dpm++2s_a, dpm++2m, dpm++2mv2, ipndm, ipndm_v, lcm, ddim_trailing, tcd, ...
    #[arg(long = "sampling-method")]
    sampling_method: Option<String>,
    /// discrete, karras, exponential, ays, gits, sgm_uniform, simple, ...
    #[arg(long = "scheduler")]
    scheduler: Option<String>,
    /// RNG seed.
    #[arg(short = 's', long = "seed", default_value_t = 42, allow_negative_numbers = true)]
    seed: i64,
    #[arg(short = 'b', long = "batch-count", default_value_t = 1)]
    batch_count: i32,
    /// Output PNG; image k > 1 of a batch goes to STEM_k.png.
    #[arg(short = 'o', long = "output", default_value = "output.png")]
    output: PathBuf,
    /// img2img denoising strength.
    #[arg(long = "strength", default_value_t = 0.75)]
    strength: f32,
    /// Init image (PNG) for img2img.
    #[arg(short = 'i', long = "init-img")]
    init_img: Option<PathBuf>,
    /// Inpainting mask (PNG, the size of the image; white: repaint), read as gray the way
    /// the reference's CLI reads it (stb_image's luma of RGB).
    #[arg(long = "mask")]
    mask: Option<PathBuf>,
    /// Control image (PNG, RGB, of any size: the library resizes it to the image's size).
    #[arg(long = "control-image")]
    control_image: Option<PathBuf>,
    /// A reference image (PNG, RGB, of any size; repeat for several).
    #[arg(short = 'r', long = "ref-image")]
    ref_image: Vec<PathBuf>,
    /// Image guidance scale (default: not set).
    #[arg(long = "img-cfg-scale")]
    img_cfg_scale: Option<f32>,
    /// FLUX's distilled guidance (dev models; the CLI's default).
    #[arg(long = "guidance", default_value_t = 3.5)]
    guidance: f32,
    /// Skip-layer guidance scale (0: off).
    #[arg(long = "slg-scale", default_value_t = 0.0)]
    slg_scale: f32,
    /// Skip-layer guidance's blocks, "[7,8,9]" as the CLI takes them.
    #[arg(long = "skip-layers", default_value = "[7,8,9]")]
    skip_layers: String,
    #[arg(long = "skip-layer-start", default_value_t = 0.01)]
    skip_layer_start: f32,
    #[arg(long = "skip-layer-end", default_value_t = 0.2)]
    skip_layer_end: f32,
    /// Encode reference images at their own sizes (the CLI's flag).
    #[arg(long = "disable-auto-resize-ref-image")]
    disable_auto_resize_ref_image: bool,
    /// Each reference image on its own RoPE index (the CLI's flag).
    #[arg(long = "increase-ref-index")]
    increase_ref_index: bool,
    /// Strength of the ControlNet's residuals (the library's default 0.9).
    #[arg(long = "control-strength", default_value_t = 0.9)]
    control_strength: f32,
    /// The hires fix: a second pass at the target size from the first result upscaled.
    #[arg(long = "hires")]
    hires: bool,
    /// The library's upscaler name (`Latent`, `Latent (nearest)`, ..., `Lanczos`, `Nearest`),
    /// or an upscaler model's path (the library's `Model`).
    #[arg(long = "hires-upscaler", default_value = "Latent")]
    hires_upscaler: String,
    #[arg(long = "hires-scale", default_value_t = 2.0)]
    hires_scale: f32,
    #[arg(long = "hires-width", default_value_t = 0)]
    hires_width: i32,
    #[arg(long = "hires-height", default_value_t = 0)]
    hires_height: i32,
    #[arg(long = "hires-steps", default_value_t = 0)]
    hires_steps: i32,
    #[arg(long = "hires-denoising-strength", default_value_t = 0.7)]
    hires_denoising_strength: f32,
    #[arg(long = "hires-upscale-tile-size", default_value_t = 128)]
    hires_upscale_tile_size: i32,
    /// Decode with the tiled VAE.
    #[arg(long = "vae-tiling")]
    vae_tiling: bool,
    /// CLIP layers to skip; <= 0 means the model's default.
    /// A LoRA file and its multiplier, `PATH:MULT` (repeatable; applied in the order given, as
    /// the library's `loras` array, in `--lora-apply-mode`).
    #[arg(long = "lora", value_name = "PATH:MULT", allow_hyphen_values = true)]
    lora: Vec<String>,
    #[arg(long = "clip-skip", default_value_t = -1, allow_negative_numbers = true)]
    clip_skip: i32,
}

#[derive(Args, Debug)]
struct EncodeText {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(short = 'p', long = "prompt", default_value = "")]
    prompt: String,
    #[arg(long = "clip-skip", default_value_t = -1, allow_negative_numbers = true)]
    clip_skip: i32,
    /// Image size some conditioners take into account (not SD1/SD2).
    #[arg(short = 'W', long = "width", default_value_t = 512)]
    width: i32,
    #[arg(short = 'H', long = "height", default_value_t = 512)]
    height: i32,
    /// Output raw f32 file (c_crossattn); a pooled vector, where the model has
    /// one, goes to OUTPUT.vector.f32. Sidecars: OUTPUT.json.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
}

#[derive(Args, Debug)]
struct T5Tokens {
    /// A JSON file holding an array of prompt strings; the output is a JSON array with, per
    /// prompt, {"prompt", "ids", "weights"} on stdout.
    #[arg(long = "prompts")]
    prompts: PathBuf,
    /// The tokenizer's encode alone (no weighting syntax, no EOS, no padding).
    #[arg(long = "raw")]
    raw: bool,
    /// Chunk length of the conditioner's padding (FLUX: 256).
    #[arg(long = "chunk-len", default_value_t = 256)]
    chunk_len: usize,
}

#[derive(Args, Debug)]
struct QwenTokens {
    /// A JSON file holding an array of prompt strings; the output is a JSON array with, per
    /// prompt, {"prompt", "ids", "weights"} on stdout.
    #[arg(long = "prompts")]
    prompts: PathBuf,
    /// Z-Image's chat template and prompt weighting around each prompt (else encode alone).
    #[arg(long = "zimage", conflicts_with = "mistral")]
    zimage: bool,
    /// sd.cpp's Mistral tokenizer instead (FLUX.2 dev's); with --flux2, FLUX.2 dev's template.
    #[arg(long = "mistral")]
    mistral: bool,
    /// FLUX.2 dev's system prompt, [INST] markers, weighting and BOS (with --mistral).
    #[arg(long = "flux2", requires = "mistral")]
    flux2: bool,
}

#[derive(Args, Debug)]
struct LlmEncode {
    /// The LLM file (safetensors with HF names or GGUF with llama.cpp names).
    #[arg(long = "llm")]
    llm: String,
    /// Its architecture: qwen3 (tokenized as Z-Image does), mistral (as FLUX.2 dev does) or
    /// qwen2.5vl (Qwen-Image's encoder; tokenized as Z-Image does).
    #[arg(long = "arch", default_value = "qwen3", value_parser = ["qwen3", "mistral", "qwen2.5vl"])]
    arch: String,
    #[arg(short = 'p', long = "prompt", default_value = "")]
    prompt: String,
    /// The layer whose output is taken (Z-Image: 35); past the file's depth: the final norm.
    #[arg(long = "out-layer", default_value_t = 35)]
    out_layer: i32,
    /// Threads; <= 0 means the number of physical cores.
    #[arg(short = 't', long = "threads", default_value_t = -1, allow_negative_numbers = true)]
    threads: i32,
    /// Output raw f32 file, torch shape [tokens, hidden]; sidecar OUTPUT.json with the ids.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Also echo sd.cpp's DEBUG log lines.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
}

#[derive(Args, Debug)]
struct T5Encode {
    /// The T5-XXL file (all 24 blocks).
    #[arg(long = "t5xxl")]
    t5xxl: String,
    #[arg(short = 'p', long = "prompt", default_value = "")]
    prompt: String,
    /// Threads; <= 0 means the number of physical cores.
    #[arg(short = 't', long = "threads", default_value_t = -1, allow_negative_numbers = true)]
    threads: i32,
    /// Output raw f32 file, torch shape [chunks * 256, 4096]; sidecar OUTPUT.json with the ids.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Also echo sd.cpp's DEBUG log lines.
    #[arg(short = 'v', long = "verbose")]
    verbose: bool,
}

#[derive(Args, Debug)]
struct Unet {
    #[command(flatten)]
    model: ModelArgs,
    /// The model input x (already scaled by c_in), raw f32, e.g. [1,4,32,32].
    #[arg(long = "latent")]
    latent: PathBuf,
    /// Shape of --latent when it has no sidecar, e.g. 1,4,32,32.
    #[arg(long = "latent-shape")]
    latent_shape: Option<String>,
    /// The model timestep t (e.g. 999 for the first step of 1000-step SD1 schedules).
    #[arg(long = "timestep", allow_negative_numbers = true)]
    timestep: f32,
    /// The context (c_crossattn), raw f32, e.g. from encode-text.
    #[arg(long = "context")]
    context: PathBuf,
    /// Shape of --context when it has no sidecar, e.g. 1,77,768.
    #[arg(long = "context-shape")]
    context_shape: Option<String>,
    /// The vector y, raw f32: SDXL's ADM vector or FLUX's pooled CLIP-L output [1,768].
    #[arg(long = "y")]
    y: Option<PathBuf>,
    /// Shape of --y when it has no sidecar, e.g. 1,768.
    #[arg(long = "y-shape")]
    y_shape: Option<String>,
    /// FLUX-dev's distilled guidance scale.
    #[arg(long = "guidance", default_value_t = 3.5)]
    guidance: f32,
    /// Output raw f32 file (the model's raw output: eps or v).
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
}

#[derive(Args, Debug)]
struct Canny {
    /// The PNG (RGB).
    #[arg(short = 'i', long = "input")]
    input: PathBuf,
    /// The output PNG.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// White background, black edges.
    #[arg(long = "inverse")]
    inverse: bool,
}

/// `sdref canny`: the reference CLI's `--canny` on one image (0.08, 0.08, 0.8, 1.0).
fn canny_png(a: Canny) -> Res<()> {
    let (w, h, mut rgb) = read_png_rgb(&a.input)?;
    ffi::canny(&mut rgb, w, h, (0.08, 0.08, 0.8, 1.0), a.inverse)?;
    write_png(&a.output, &ffi::Image { width: w, height: h, channels: 3, data: rgb })?;
    eprintln!("sdref: wrote {}", a.output.display());
    Ok(())
}

#[derive(Args, Debug)]
struct Upscale {
    /// The ESRGAN model.
    #[arg(long = "upscale-model")]
    model: String,
    /// The PNG to upscale.
    #[arg(short = 'i', long = "init-img")]
    input: PathBuf,
    /// The output PNG.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Passes.
    #[arg(long = "upscale-repeats", default_value_t = 1)]
    repeats: u32,
    /// Tile size in input pixels (sd.cpp's CLI default 128).
    #[arg(long = "upscale-tile-size", default_value_t = 128)]
    tile: i32,
    #[arg(short = 't', long = "threads", default_value_t = -1)]
    threads: i32,
    /// sd.cpp's backend spec (default: its default device).
    #[arg(long = "backend")]
    backend: Option<String>,
}

fn upscale_png(a: Upscale) -> Res<()> {
    let (width, height, data) = read_png_rgb(&a.input)?;
    let start = Instant::now();
    let input = ffi::Image { width, height, channels: 3, data };
    let (factor, img) = ffi::upscale_image(&a.model, a.threads, a.tile, a.backend.as_deref(), input, a.repeats)?;
    eprintln!("SDREF_TIMING upscale {:.3}", start.elapsed().as_secs_f64());
    eprintln!("sdref: x{factor}, {width}x{height} -> {}x{}", img.width, img.height);
    write_png(&a.output, &img)
}

#[derive(Args, Debug)]
struct VaeDecode {
    #[command(flatten)]
    model: ModelArgs,
    /// The latent, raw f32, e.g. [1,4,32,32].
    #[arg(long = "latent")]
    latent: PathBuf,
    /// Shape of --latent when it has no sidecar.
    #[arg(long = "latent-shape")]
    latent_shape: Option<String>,
    /// The latent is already in the VAE's space (skip sd.cpp's division by
    /// the scale factor, 0.18215 for SD1/SD2).
    #[arg(long = "vae-space")]
    vae_space: bool,
    /// Output raw f32 file: the decoder output, nominally in [-1, 1]; sd.cpp's
    /// image is clamp((v + 1) / 2, 0, 1) of it.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
}

type Res<T> = Result<T, String>;

/// What the pinned package carries; sd.cpp's own version string says
/// "unknown" when built outside a git checkout.
const SDCPP_ORIGIN: &str = "diffusion-rs-sys 0.1.20: upstream commit 5db680c of 2026-06-14";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Txt2img(a) => txt2img(a),
        Command::EncodeText(a) => encode_text(a),
        Command::Unet(a) => unet(a),
        Command::VaeDecode(a) => vae_decode(a),
        Command::T5Tokens(a) => t5_tokens(a),
        Command::T5Encode(a) => t5_encode(a),
        Command::QwenTokens(a) => qwen_tokens(a),
        Command::LlmEncode(a) => llm_encode(a),
        Command::Upscale(a) => upscale_png(a),
        Command::Canny(a) => canny_png(a),
        Command::Info => {
            println!("sd.cpp version: {} ({SDCPP_ORIGIN})", ffi::sdcpp_version());
            println!("sd.cpp source: {}", env!("SDREF_SDCPP_DIR"));
            println!("{}", ffi::system_info().trim_end());
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("sdref: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn start(verbose: bool) -> &'static Recorder {
    let recorder: &'static Recorder = Box::leak(Box::new(Recorder::new(verbose)));
    ffi::set_observer(recorder);
    recorder
}

fn load(args: &ModelArgs) -> Res<(Context, f64)> {
    if args.model.is_none() && args.diffusion_model.is_none() {
        return Err("give a model with -m/--model or --diffusion-model".into());
    }
    let t0 = Instant::now();
    let ctx = Context::new(&args.ctx_options())?;
    Ok((ctx, t0.elapsed().as_secs_f64()))
}

fn print_rss() {
    match timing::peak_rss_kib() {
        Some(kib) => eprintln!("SDREF_RSS peak_rss_kib={kib} peak_rss_mib={:.0}", kib as f64 / 1024.0),
        None => eprintln!("SDREF_RSS peak_rss_kib=unknown"),
    }
}

fn read_png_rgb(path: &Path) -> Res<(u32, u32, Vec<u8>)> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut decoder = png::Decoder::new(std::io::BufReader::new(file));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().map_err(|e| format!("{}: {e}", path.display()))?;
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).map_err(|e| format!("{}: {e}", path.display()))?;
    let (w, h) = (info.width, info.height);
    let px = (w * h) as usize;
    let rgb = match info.color_type {
        png::ColorType::Rgb => buf[..px * 3].to_vec(),
        png::ColorType::Rgba => buf[..px * 4].chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => buf[..px].iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => buf[..px * 2].chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => return Err(format!("{}: palette PNG was not expanded", path.display())),
    };
    Ok((w, h, rgb))
}

fn write_png(path: &Path, img: &ffi::Image) -> Res<()> {
    let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), img.width, img.height);
    enc.set_color(match img.channels {
        1 => png::ColorType::Grayscale,
        3 => png::ColorType::Rgb,
        4 => png::ColorType::Rgba,
        c => return Err(format!("sd.cpp returned an image with {c} channels")),
    });
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().map_err(|e| format!("{}: {e}", path.display()))?;
    w.write_image_data(&img.data).map_err(|e| format!("{}: {e}", path.display()))
}

fn batch_path(base: &Path, index: usize) -> PathBuf {
    if index == 0 {
        return base.to_path_buf();
    }
    let stem = base.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "output".into());
    let ext = base.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_else(|| "png".into());
    base.with_file_name(format!("{stem}_{}.{ext}", index + 1))
}

/// `PATH:MULT` (the last `:` separates them).
fn parse_lora(s: &str) -> Res<(String, f32)> {
    let (path, mult) = s.rsplit_once(':').ok_or_else(|| format!("--lora {s}: expected PATH:MULT"))?;
    let m = mult.parse::<f32>().map_err(|_| format!("--lora {s}: '{mult}' is not a number"))?;
    Ok((path.to_owned(), m))
}

fn txt2img(a: Txt2Img) -> Res<()> {
    let t_start = Instant::now();
    let recorder = start(a.model.verbose);

    let (mut width, mut height) = (a.width.unwrap_or(512), a.height.unwrap_or(512));
    let init_rgb = match &a.init_img {
        None => None,
        Some(path) => {
            let (w, h, rgb) = read_png_rgb(path)?;
            width = a.width.unwrap_or(w as i32);
            height = a.height.unwrap_or(h as i32);
            if (w as i32, h as i32) != (width, height) {
                return Err(format!("{} is {w}x{h}, but {width}x{height} was asked; resize it first", path.display()));
            }
            Some(rgb)
        }
    };

    let mask_gray = match &a.mask {
        None => None,
        Some(path) => {
            let (w, h, rgb) = read_png_rgb(path)?;
            if (w as i32, h as i32) != (width, height) {
                return Err(format!("{} is {w}x{h}, but {width}x{height} was asked; resize it first", path.display()));
            }
            // stb_image's RGB-to-luma conversion (stbi__compute_y), as `stbi_load(.., 1)` does.
            Some(
                rgb.chunks_exact(3)
                    .map(|p| ((p[0] as u32 * 77 + p[1] as u32 * 150 + p[2] as u32 * 29) >> 8) as u8)
                    .collect(),
            )
        }
    };

    let control = match &a.control_image {
        None => None,
        Some(path) => Some(read_png_rgb(path)?),
    };
    let (mut ctx, load_s) = load(&a.model)?;
    let gen = GenOptions {
        prompt: a.prompt.clone(),
        negative_prompt: a.negative_prompt.clone(),
        width,
        height,
        steps: a.steps,
        batch_count: a.batch_count,
        clip_skip: a.clip_skip,
        cfg_scale: a.cfg_scale,
        strength: a.strength,
        seed: a.seed,
        sample_method: a.sampling_method.clone(),
        scheduler: a.scheduler.clone(),
        init_rgb,
        vae_tiling: a.vae_tiling,
        loras: a.lora.iter().map(|l| parse_lora(l)).collect::<Res<Vec<_>>>()?,
        mask_gray,
        control,
        control_strength: a.control_strength,
        hires: a.hires.then(|| {
            // A path names a model (the CLI resolves a name in --hires-upscalers-dir to one).
            let is_model = std::path::Path::new(&a.hires_upscaler).is_file();
            ffi::HiresOptions {
                upscaler: if is_model { "Model".into() } else { a.hires_upscaler.clone() },
                model_path: is_model.then(|| a.hires_upscaler.clone()),
                scale: a.hires_scale,
                width: a.hires_width,
                height: a.hires_height,
                steps: a.hires_steps,
                denoising_strength: a.hires_denoising_strength,
                upscale_tile_size: a.hires_upscale_tile_size,
            }
        }),
        refs: a.ref_image.iter().map(|p| read_png_rgb(p)).collect::<Res<Vec<_>>>()?,
        auto_resize_ref_image: !a.disable_auto_resize_ref_image,
        increase_ref_index: a.increase_ref_index,
        slg: (
            a.slg_scale,
            a.skip_layers
                .trim_matches(|c| c == '[' || c == ']')
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| s.trim().parse::<i32>().map_err(|_| format!("--skip-layers {}: bad number", a.skip_layers)))
                .collect::<Res<Vec<_>>>()?,
            a.skip_layer_start,
            a.skip_layer_end,
        ),
        img_cfg: a.img_cfg_scale,
        guidance: a.guidance,
    };
    let t_gen = Instant::now();
    let images = ctx.generate(&gen)?;
    let generate_s = t_gen.elapsed().as_secs_f64();
    drop(ctx);

    for (i, img) in images.iter().enumerate() {
        let path = batch_path(&a.output, i);
        write_png(&path, img)?;
        eprintln!("sdref: wrote {}", path.display());
    }

    let t = recorder.take();
    let total_s = t_start.elapsed().as_secs_f64();
    let opt = |v: Option<f64>| v.map_or_else(|| "unknown".to_owned(), timing::ms);
    let steps: Vec<String> = t.step_s.iter().map(|&s| timing::ms(s)).collect();
    let step_mean = (!t.step_s.is_empty()).then(|| t.step_s.iter().sum::<f64>() / t.step_s.len() as f64);
    let sampling = (!t.sampling_s.is_empty()).then(|| t.sampling_s.iter().sum::<f64>());
    eprintln!(
        "SDREF_TIMING load_ms={} text_encode_ms={} sampling_ms={} steps={} step_ms={} step_mean_ms={} decode_ms={} \
         tensor_load_ms={} generate_ms={} total_ms={}",
        timing::ms(load_s),
        opt(t.text_encode_s),
        opt(sampling),
        t.step_s.len(),
        if steps.is_empty() { "unknown".to_owned() } else { steps.join(",") },
        opt(step_mean),
        opt(t.decode_s),
        timing::ms(t.tensor_load_s),
        timing::ms(generate_s),
        timing::ms(total_s),
    );
    print_rss();
    Ok(())
}

fn meta(pairs: &[(&str, serde_json::Value)]) -> Map<String, serde_json::Value> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect()
}

fn t5_tokens(a: T5Tokens) -> Res<()> {
    let text = std::fs::read_to_string(&a.prompts).map_err(|e| format!("{}: {e}", a.prompts.display()))?;
    let prompts: Vec<String> = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a JSON array of strings: {e}", a.prompts.display()))?;
    let mut out = Vec::with_capacity(prompts.len());
    for p in prompts {
        let (ids, weights) = ffi::t5_tokenize(&p, a.raw, a.chunk_len).map_err(|e| format!("prompt {p:?}: {e}"))?;
        out.push(json!({ "prompt": p, "ids": ids, "weights": weights }));
    }
    println!("{}", serde_json::to_string(&out).map_err(|e| e.to_string())?);
    Ok(())
}

fn qwen_tokens(a: QwenTokens) -> Res<()> {
    let text = std::fs::read_to_string(&a.prompts).map_err(|e| format!("{}: {e}", a.prompts.display()))?;
    let prompts: Vec<String> = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a JSON array of strings: {e}", a.prompts.display()))?;
    let mut out = Vec::with_capacity(prompts.len());
    for p in prompts {
        let (ids, weights) = if a.mistral {
            ffi::mistral_tokenize(&p, a.flux2)
        } else {
            ffi::qwen2_tokenize(&p, a.zimage)
        }
        .map_err(|e| format!("prompt {p:?}: {e}"))?;
        out.push(json!({ "prompt": p, "ids": ids, "weights": weights }));
    }
    println!("{}", serde_json::to_string(&out).map_err(|e| e.to_string())?);
    Ok(())
}

fn llm_encode(a: LlmEncode) -> Res<()> {
    start(a.verbose);
    let (ids, _) = if a.arch == "mistral" {
        ffi::mistral_tokenize(&a.prompt, true)?
    } else {
        ffi::qwen2_tokenize(&a.prompt, true)?
    };
    let arch = match a.arch.as_str() {
        "mistral" => 1,
        "qwen2.5vl" => 2,
        _ => 0,
    };
    let t0 = Instant::now();
    let t = ffi::llm_encode(&a.llm, arch, &ids, a.out_layer, a.threads)?;
    let ms = timing::ms(t0.elapsed().as_secs_f64());
    let tokens = ids.len() as i64;
    let width = t.data.len() as i64 / tokens.max(1);
    let out = Tensor::from_torch_shape(&[tokens, width], t.data);
    let mut m = meta(&[
        ("source", json!(format!("stable-diffusion.cpp, {SDCPP_ORIGIN}"))),
        ("model", json!(a.llm)),
        ("prompt", json!(a.prompt)),
        ("ids", json!(ids)),
        ("out_layer", json!(a.out_layer)),
    ]);
    m.insert(
        "what".into(),
        json!("Qwen3 hidden states (LLMRunner, QWEN3) for Z-Image's template, before the token weights"),
    );
    rawio::write_tensor(&a.output, &out, m)?;
    eprintln!("sdref: wrote {} shape {:?}", a.output.display(), out.shape_torch());
    eprintln!("SDREF_TIMING llm_encode_ms={ms}");
    print_rss();
    Ok(())
}

fn t5_encode(a: T5Encode) -> Res<()> {
    start(a.verbose);
    const CHUNK: usize = 256;
    let (ids, _) = ffi::t5_tokenize(&a.prompt, false, CHUNK)?;
    let t0 = Instant::now();
    let mut data = Vec::new();
    for chunk in ids.chunks(CHUNK) {
        let t = ffi::t5_encode(&a.t5xxl, chunk, a.threads)?;
        data.extend(t.data);
    }
    let ms = timing::ms(t0.elapsed().as_secs_f64());
    let tokens = ids.len() as i64;
    let width = data.len() as i64 / tokens.max(1);
    let out = Tensor::from_torch_shape(&[tokens, width], data);
    let mut m = meta(&[
        ("source", json!(format!("stable-diffusion.cpp, {SDCPP_ORIGIN}"))),
        ("model", json!(a.t5xxl)),
        ("prompt", json!(a.prompt)),
        ("ids", json!(ids)),
    ]);
    m.insert("what".into(), json!("T5-XXL raw hidden states per 256-id chunk, before the token weights"));
    rawio::write_tensor(&a.output, &out, m)?;
    eprintln!("sdref: wrote {} shape {:?}", a.output.display(), out.shape_torch());
    eprintln!("SDREF_TIMING t5_encode_ms={ms}");
    print_rss();
    Ok(())
}

fn encode_text(a: EncodeText) -> Res<()> {
    start(a.model.verbose);
    let (mut ctx, _) = load(&a.model)?;
    let t0 = Instant::now();
    let (cross, vector) = ctx.encode_text(&a.prompt, a.clip_skip, a.width, a.height)?;
    let ms = timing::ms(t0.elapsed().as_secs_f64());
    let common = [
        ("source", json!(format!("stable-diffusion.cpp, {SDCPP_ORIGIN}"))),
        ("model", json!(a.model.model_desc())),
        ("prompt", json!(a.prompt)),
        ("clip_skip", json!(a.clip_skip)),
    ];
    let mut m = meta(&common);
    m.insert("what".into(), json!("text encoder output: c_crossattn, the context fed to the diffusion model"));
    rawio::write_tensor(&a.output, &cross, m)?;
    eprintln!("sdref: wrote {} shape {:?}", a.output.display(), cross.shape_torch());
    if let Some(vector) = vector {
        let mut path = a.output.as_os_str().to_owned();
        path.push(".vector.f32");
        let path = PathBuf::from(path);
        let mut m = meta(&common);
        m.insert("what".into(), json!("text encoder pooled output: c_vector"));
        rawio::write_tensor(&path, &vector, m)?;
        eprintln!("sdref: wrote {} shape {:?}", path.display(), vector.shape_torch());
    }
    eprintln!("SDREF_TIMING encode_text_ms={ms}");
    print_rss();
    Ok(())
}

fn shape_arg(s: &Option<String>) -> Res<Option<Vec<i64>>> {
    s.as_deref().map(rawio::parse_shape).transpose()
}

fn unet(a: Unet) -> Res<()> {
    let x = rawio::read_tensor(&a.latent, shape_arg(&a.latent_shape)?.as_deref())?;
    let c = rawio::read_tensor(&a.context, shape_arg(&a.context_shape)?.as_deref())?;
    let y = a.y.as_ref().map(|p| rawio::read_tensor(p, shape_arg(&a.y_shape)?.as_deref())).transpose()?;
    start(a.model.verbose);
    let (mut ctx, _) = load(&a.model)?;
    let t0 = Instant::now();
    let out = ctx.diffusion(&x, a.timestep, &c, y.as_ref(), a.guidance)?;
    let ms = timing::ms(t0.elapsed().as_secs_f64());
    let m = meta(&[
        ("source", json!(format!("stable-diffusion.cpp, {SDCPP_ORIGIN}"))),
        ("model", json!(a.model.model_desc())),
        ("what", json!("diffusion model raw output (eps or v) for one evaluation")),
        ("latent", json!(a.latent.display().to_string())),
        ("context", json!(a.context.display().to_string())),
        ("timestep", json!(a.timestep)),
        ("guidance", json!(a.guidance)),
    ]);
    rawio::write_tensor(&a.output, &out, m)?;
    eprintln!("sdref: wrote {} shape {:?}", a.output.display(), out.shape_torch());
    eprintln!("SDREF_TIMING unet_ms={ms}");
    print_rss();
    Ok(())
}

fn vae_decode(a: VaeDecode) -> Res<()> {
    let z = rawio::read_tensor(&a.latent, shape_arg(&a.latent_shape)?.as_deref())?;
    start(a.model.verbose);
    let (mut ctx, _) = load(&a.model)?;
    let t0 = Instant::now();
    let out = ctx.vae_decode(&z, !a.vae_space)?;
    let ms = timing::ms(t0.elapsed().as_secs_f64());
    let m = meta(&[
        ("source", json!(format!("stable-diffusion.cpp, {SDCPP_ORIGIN}"))),
        ("model", json!(a.model.model_desc())),
        ("what", json!("VAE decoder raw output, nominally [-1, 1]; image = clamp((v + 1) / 2, 0, 1)")),
        ("latent", json!(a.latent.display().to_string())),
        ("latent_space", json!(if a.vae_space { "vae" } else { "diffusion (divided by the scale factor first)" })),
    ]);
    rawio::write_tensor(&a.output, &out, m)?;
    eprintln!("sdref: wrote {} shape {:?}", a.output.display(), out.shape_torch());
    eprintln!("SDREF_TIMING vae_decode_ms={ms}");
    print_rss();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_images_after_the_first_get_numbered_names() {
        assert_eq!(batch_path(Path::new("out/a.png"), 0), PathBuf::from("out/a.png"));
        assert_eq!(batch_path(Path::new("out/a.png"), 1), PathBuf::from("out/a_2.png"));
    }

    #[test]
    fn the_cli_accepts_the_reference_flag_names() {
        let cli = Cli::try_parse_from([
            "sdref",
            "txt2img",
            "-m",
            "m.safetensors",
            "-p",
            "a cat",
            "-n",
            "blurry",
            "-W",
            "256",
            "-H",
            "256",
            "--steps",
            "4",
            "--cfg-scale",
            "7",
            "--sampling-method",
            "euler",
            "--scheduler",
            "discrete",
            "-s",
            "42",
            "-b",
            "1",
            "-o",
            "x.png",
            "-t",
            "2",
            "--rng",
            "std_default",
            "--strength",
            "0.5",
            "--vae-tiling",
            "--diffusion-fa",
            "--backend",
            "cpu",
            "--params-backend",
            "disk",
            "--max-vram",
            "-1",
            "--offload-to-cpu",
            "--type",
            "f16",
            "--clip_l",
            "c.safetensors",
            "--vae",
            "v.safetensors",
        ])
        .unwrap();
        let Command::Txt2img(a) = cli.command else { panic!("not txt2img") };
        assert_eq!((a.width, a.height, a.steps, a.seed), (Some(256), Some(256), 4, 42));
        assert_eq!(a.model.threads, 2);
        assert_eq!(a.model.max_vram, -1.0);
        assert_eq!(a.model.rng.as_deref(), Some("std_default"));
        assert!(a.model.offload_to_cpu && a.model.diffusion_fa && a.vae_tiling);
    }
}
