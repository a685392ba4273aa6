//! Image generation: the reference's flags, placement, progress, image output.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::Args;
use sd_backends::BackendManager;
use sd_models::files::Prediction as FilePrediction;
use sd_models::fixture::{self, FixtureModel, WeightType};
use sd_models::loader::LoadType;
use sd_models::output::{ImageOutput, InputRole, OutputRole};
use sd_models::pipeline::{GenerateParams, LoadOptions, Pipeline, Progress, Request, ValidParams};
use sd_models::placement::RuntimePlacement;
use sd_models::sampling::{RngKind, SampleMethod, Scheduler};
use sd_vae::TilingParams;

use crate::inputs::RunArgs;
use crate::plan::{ModelArgs, PlacementArgs};
use crate::DeviceArgs;

/// Generation flags (names as in stable-diffusion.cpp's sd-cli).
#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub placement: PlacementArgs,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[command(flatten)]
    pub upscale: crate::upscale::UpscaleArgs,
    /// The prompt (`<lora:name:multiplier>` tags apply LoRA files of --lora-model-dir).
    #[arg(short = 'p', long = "prompt", default_value = "")]
    pub prompt: String,
    /// The negative prompt.
    #[arg(short = 'n', long = "negative-prompt", default_value = "")]
    pub negative_prompt: String,
    /// Image width in pixels (default: 512, or the init image's; rounded up to the model's
    /// multiple, 64 for SD).
    #[arg(short = 'W', long = "width", default_value_t = -1, allow_hyphen_values = true, hide_default_value = true, value_parser = image_side)]
    pub width: i64,
    /// Image height in pixels (default: 512, or the init image's; rounded up likewise).
    #[arg(short = 'H', long = "height", default_value_t = -1, allow_hyphen_values = true, hide_default_value = true, value_parser = image_side)]
    pub height: i64,
    /// Sampling steps.
    #[arg(long = "steps", default_value_t = 20, allow_negative_numbers = true, value_parser = whole::<usize>)]
    pub steps: usize,
    /// Classifier-free guidance scale (1 disables the negative prompt; default: the model's,
    /// 7 for SD 1.x/2.x and SDXL, 1 for FLUX.1, whose guidance is distilled).
    #[arg(long = "cfg-scale", allow_hyphen_values = true)]
    pub cfg_scale: Option<f32>,
    /// Distilled guidance scale of models that take one (FLUX.1 dev; schnell, which has no
    /// guidance input, ignores it with a note; other families ignore it).
    #[arg(long = "guidance", default_value_t = 3.5, allow_hyphen_values = true)]
    pub guidance: f32,
    /// Time shift of flow-matching models instead of the model's default (FLUX.1: mu, 1.15 for
    /// dev and 1.0 for schnell); models without a flow schedule ignore it.
    #[arg(long = "flow-shift", value_name = "SHIFT", allow_hyphen_values = true)]
    pub flow_shift: Option<f32>,
    /// Sampling method: euler, euler_a, heun, dpm2, dpm++2s_a, dpm++2m, dpm++2mv2, ipndm, ipndm_v,
    /// lcm, ddim_trailing, tcd, res_multistep, res_2s, er_sde, euler_cfg_pp, euler_a_cfg_pp,
    /// euler_ge (default: the model's, euler_a for SD 1.x/2.x).
    #[arg(long = "sampling-method")]
    pub sampling_method: Option<SampleMethod>,
    /// Scheduler: discrete, karras, exponential, ays, gits, sgm_uniform, simple, smoothstep,
    /// kl_optimal, lcm, bong_tangent, ltx2 (default: the sampler's: lcm for lcm and tcd, simple
    /// for ddim_trailing, else discrete).
    #[arg(long = "scheduler")]
    pub scheduler: Option<Scheduler>,
    /// Seed (negative: random).
    #[arg(short = 's', long = "seed", default_value_t = 42, allow_hyphen_values = true)]
    pub seed: i64,
    /// Number of images.
    #[arg(short = 'b', long = "batch-count", default_value_t = 1, allow_negative_numbers = true, value_parser = whole::<usize>)]
    pub batch_count: usize,
    /// Output image: .png, .jpg or .webp; printf-style %d (e.g. out_%03d.png) numbers the
    /// images, else a batch is name_0.png, name_1.png, ...
    /// An existing file whose name has no image extension is refused (see --overwrite); an
    /// image format that is not written (.gif, .bmp, ...) is refused; `/dev/stdout` writes
    /// the image to the standard output when it is redirected.
    #[arg(short = 'o', long = "output", default_value = "output.png")]
    pub output: PathBuf,
    /// [sd-rs] Let -o replace an existing file whose name has no image extension (a .txt file,
    /// `README`) with the image (a PNG); without it such a file is refused and left untouched.
    #[arg(long = "overwrite")]
    pub overwrite: bool,
    /// CPU threads (<= 0: the number of physical cores).
    #[arg(short = 't', long = "threads", default_value_t = -1, allow_hyphen_values = true)]
    pub threads: i64,
    /// Noise generator: cuda (Philox, the default), std_default, cpu.
    #[arg(long = "rng", default_value = "cuda")]
    pub rng: RngKind,
    /// img2img: the init image (PNG, JPEG, WebP or BMP), centre-cropped and resized to
    /// -W x -H when both are given.
    #[arg(short = 'i', long = "init-img")]
    pub init_img: Option<PathBuf>,
    /// A reference image (PNG, JPEG, WebP or BMP; repeat for several, in order): FLUX.2 reads
    /// each as tokens beside the image it generates, for edits ("the cat of image 1 on the
    /// sofa of image 2"). Each is resized to the generated image's area unless
    /// --disable-auto-resize-ref-image.
    #[arg(short = 'r', long = "ref-image", value_name = "FILE")]
    pub ref_image: Vec<PathBuf>,
    /// Encode each reference image (-r) at its own size (its sides then multiples of 16)
    /// instead of resizing it to the generated image's area.
    #[arg(long = "disable-auto-resize-ref-image")]
    pub disable_auto_resize_ref_image: bool,
    /// FLUX.1 Kontext: read the k-th reference image on RoPE index k + 1 instead of all on
    /// index 1 side by side (FLUX.2 always numbers them).
    #[arg(long = "increase-ref-index")]
    pub increase_ref_index: bool,
    /// Image guidance with reference images (-r, FLUX.2): how far each step moves from the
    /// negative prompt without the references toward it with them (three passes; default 1,
    /// off). Ignored with a warning by a model without reference images, as in the reference.
    #[arg(long = "img-cfg-scale", allow_hyphen_values = true)]
    pub img_cfg_scale: Option<f32>,
    /// Skip-layer guidance (SD3/SD3.5, FLUX, Chroma, FLUX.2): how far each step moves away from the
    /// prompt's prediction with --skip-layers left out (0: off; 2.5 is SD3.5 Medium's usual).
    #[arg(long = "slg-scale", default_value_t = 0.0, allow_hyphen_values = true)]
    pub slg_scale: f32,
    /// Skip-layer guidance: the blocks left out, as the reference writes them ("[7,8,9]").
    #[arg(long = "skip-layers", default_value = "[7,8,9]", value_name = "LIST")]
    pub skip_layers: String,
    /// Skip-layer guidance: where it starts, as a fraction of the steps.
    #[arg(long = "skip-layer-start", default_value_t = 0.01, allow_hyphen_values = true)]
    pub skip_layer_start: f32,
    /// Skip-layer guidance: where it ends, as a fraction of the steps.
    #[arg(long = "skip-layer-end", default_value_t = 0.2, allow_hyphen_values = true)]
    pub skip_layer_end: f32,
    /// img2img: how much to change the init image (0..1).
    #[arg(long = "strength", default_value_t = 0.75)]
    pub strength: f32,
    /// Inpainting (with -i): the mask image, white where the init image is repainted, black
    /// where it is kept; read as grey, centre-cropped and resized like the init image.
    #[arg(long = "mask", value_name = "FILE")]
    pub mask: Option<PathBuf>,
    /// ControlNet (with --control-net): the control image (an edge map, a pose...), RGB,
    /// centre-cropped and resized to the generated size like the init image.
    #[arg(long = "control-image", value_name = "FILE")]
    pub control_image: Option<PathBuf>,
    /// ControlNet: turn the control image into its Canny edges first (the reference's
    /// preprocessor and thresholds), for a canny ControlNet given a photo.
    #[arg(long = "canny")]
    pub canny: bool,
    /// ControlNet: the factor of its residuals.
    #[arg(long = "control-strength", value_name = "F", default_value_t = 0.9, allow_hyphen_values = true)]
    pub control_strength: f32,
    #[command(flatten)]
    pub(crate) hires: HiresArgs,
    /// Skip the last N-1 text-encoder layers (<= 0: the model's default).
    #[arg(long = "clip-skip", default_value_t = -1, allow_hyphen_values = true)]
    pub clip_skip: i64,
    /// Ancestral sampler noise scale.
    #[arg(long = "eta")]
    pub eta: Option<f32>,
    /// Weight type at load: f32, f16, q8_0, q5_0, q4_0, ...
    #[arg(long = "type")]
    pub wtype: Option<LoadType>,
    /// eps or v (overrides what the file says).
    #[arg(long = "prediction", value_parser = prediction)]
    pub prediction: Option<FilePrediction>,
    /// Flash attention in the diffusion model.
    #[arg(long = "diffusion-fa")]
    pub diffusion_fa: bool,
    /// The model family's options, KEY=VALUE[,KEY=VALUE...] as the reference names them
    /// (Chroma: chroma_use_dit_mask, chroma_use_t5_mask, chroma_t5_mask_pad).
    #[arg(long = "model-args", value_name = "KEY=VALUE,...", value_parser = model_args)]
    pub(crate) model_args: Option<FamilyArgs>,
    /// Tile the VAE.
    #[arg(long = "vae-tiling")]
    pub vae_tiling: bool,
    /// VAE tile size in image pixels: N or WxH.
    #[arg(long = "vae-tile-size")]
    pub vae_tile_size: Option<String>,
    /// VAE tile overlap: a fraction of the tile, 0 to 0.5.
    #[arg(long = "vae-tile-overlap", allow_negative_numbers = true)]
    pub vae_tile_overlap: Option<String>,
    /// Relative VAE tile size: <=1 fraction of the image, >1 tiles per axis; N or WxH.
    #[arg(long = "vae-relative-tile-size")]
    pub vae_relative_tile_size: Option<String>,
    /// [sd-rs] Disable asynchronous next-segment prefetch (segmented execution).
    #[arg(long = "disable-prefetch")]
    pub disable_prefetch: bool,
    /// [sd-rs] Weights of modules computed on the CPU in ggml's extra CPU buffer types where
    /// one takes them (AMX for quantized matrices on CPUs with AMX-INT8; repacked layouts
    /// for q4_0, q4_K, iq4_nl on AVX2): `on` (the default, or the environment variable
    /// SD_CPU_EXTRA_BUFTS=on|off) or `off`. `-v` logs which buffer type holds how many bytes.
    #[arg(long = "cpu-extra-bufts", value_name = "on|off", value_parser = ["on", "off"])]
    pub cpu_extra_bufts: Option<String>,
    /// [sd-rs] Force monolithic graph execution.
    #[arg(long = "disable-segmented-compute")]
    pub disable_segmented_compute: bool,
    /// [sd-rs] Write a JSON report of the run to PATH: placement, each module's residency,
    /// each runner's work, each device's managed high-water mark and budget, stage times.
    #[arg(long = "report-json", value_name = "PATH")]
    pub report_json: Option<PathBuf>,
    /// [sd-rs] Profile every module's graphs node by node: time, FLOPs and bytes by ggml op and
    /// by block, in the --report-json report and a summary at -v (slower: one graph launch
    /// per node). Example: `--profile --report-json run.json`.
    #[arg(long = "profile")]
    pub profile: bool,
    /// [sd-rs] Copy weights that run on the CPU out of the model files into memory of their
    /// own. By default they are used in place from the files' read-only memory maps when
    /// stored in the type they compute in (no load time, no second copy); the files must then
    /// not be rewritten during the run (a truncation ends it with a message naming the file).
    #[arg(long = "no-mmap", conflicts_with = "mmap")]
    pub no_mmap: bool,
    /// Memory-map the model files (stable-diffusion.cpp's flag; the default here).
    #[arg(long = "mmap")]
    pub mmap: bool,
}

/// LoRA flags (names as in stable-diffusion.cpp's sd-cli).
#[derive(Args, Debug, Clone)]
pub struct LoraArgs {
    /// Directory of the LoRA files that `<lora:name:multiplier>` tags in the prompt name
    /// (tried as name, then name.gguf, .safetensors, .pt, .ckpt); tags are removed from the
    /// prompt before it is encoded.
    #[arg(long = "lora-model-dir", value_name = "DIR", default_value = ".")]
    pub lora_model_dir: PathBuf,
    /// How LoRAs are applied: auto, immediately, at_runtime. `immediately` merges them into
    /// the weights as they are loaded (at each staging for weights kept off the device);
    /// `at_runtime` leaves the weights as they are and adds each adapter's low-rank product
    /// in the graph (its matrices live with the module's weights and count in its device
    /// memory). `auto` chooses per module and says why at -v: at_runtime when adapted weights
    /// are quantized, the parameters live off the computing device (--params-backend) or the
    /// module is row-split; immediately otherwise.
    #[arg(long = "lora-apply-mode", value_name = "MODE", default_value = "auto")]
    pub lora_apply_mode: sd_models::lora::ApplyMode,
}

impl LoraArgs {
    /// `prompt` without its LoRA tags, and the files they name (every one checked to exist).
    pub fn extract(&self, prompt: &str) -> Result<(String, Vec<sd_models::lora::LoraRequest>)> {
        Ok(sd_models::lora::tags::extract(prompt, &self.lora_model_dir)?)
    }
}

/// `-W`/`-H`: a whole number of pixels (its range is checked with the init image, and its
/// multiple once the model is known).
fn image_side(s: &str) -> std::result::Result<i64, String> {
    s.trim().parse::<i64>().map_err(|_| format!("'{}' is not a whole number of pixels", clip_text(s)))
}

/// A flag's whole number (at least 0): a negative number reaches this parser (clap's
/// `allow_negative_numbers`), so the error names the flag and the value instead of taking
/// `-1` for an unknown flag.
pub fn whole<T: TryFrom<u128>>(s: &str) -> std::result::Result<T, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("'{}' is negative; a whole number of at least 0 is needed", clip_text(s)));
    }
    let v: u128 = t.parse().map_err(|_| format!("'{}' is not a whole number", clip_text(s)))?;
    T::try_from(v).map_err(|_| format!("{v} is too large"))
}

/// `s` cut to 60 characters for an error message (a 100 KB argument is not echoed whole).
pub fn clip_text(s: &str) -> String {
    const MAX: usize = 60;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}... ({} bytes)", &s[..i], s.len()),
        None => s.to_string(),
    }
}

/// `--prediction`: the library's prediction types by their own names only (`eps`, `v`; the
/// spellings found in model metadata, such as `v_prediction`, are not flag values).
fn prediction(s: &str) -> std::result::Result<FilePrediction, sd_models::sampling::SamplingError> {
    s.parse()
}

pub(crate) fn ensure_fixture() -> Result<PathBuf> {
    let path = fixture::cached_path(FixtureModel::Sd15, 42, WeightType::F16);
    if !path.is_file() {
        tracing::warn!(
            "no model given (-m): writing an SD 1.5 checkpoint with random weights to {} (once); \
             the image will be noise-like. Pass -m to use a real model.",
            path.display()
        );
    } else {
        tracing::warn!("no model given (-m): using the random-weight SD 1.5 fixture {}", path.display());
    }
    let (path, _) =
        fixture::ensure_cached(FixtureModel::Sd15, 42, WeightType::F16).context("writing the fixture checkpoint")?;
    Ok(path)
}

/// The parameters text of image `i` of a request (A1111's layout): it was sampled from seed
/// `seed + i`.
fn a1111_parameters(a: &GenerateArgs, r: &Request, i: usize, model: &str) -> String {
    let (p, method, scheduler) = (r.params(), r.method(), r.scheduler());
    let seed = p.seed.wrapping_add(i as u64);
    let mut s = p.prompt.clone();
    if !p.negative_prompt.is_empty() {
        s.push_str(&format!("\nNegative prompt: {}", p.negative_prompt));
    }
    s.push_str(&format!(
        "\nSteps: {}, Sampler: {}, Schedule type: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Model: {}, RNG: {}",
        a.steps,
        method.display_name(),
        scheduler.name(),
        r.cfg_scale(),
        seed,
        p.width,
        p.height,
        model,
        p.rng
    ));
    if p.init_image.is_some() {
        s.push_str(&format!(", Denoising strength: {}", a.strength));
    }
    if a.clip_skip > 0 {
        s.push_str(&format!(", Clip skip: {}", a.clip_skip));
    }
    s.push_str(&format!(", Version: sd-rs {}", env!("CARGO_PKG_VERSION")));
    s
}

/// A loaded pipeline, its placement plan and the model flags it came from.
pub struct Loaded {
    /// The pipeline.
    pub pipeline: Pipeline,
    /// The placement it runs with.
    pub plan: sd_placement::Plan,
    /// The cost model's prediction for it (from measured figures where the devices have them).
    pub predicted: sd_placement::Prediction,
    /// The model flags (`-m` filled with the fixture when none was given).
    pub model: ModelArgs,
    /// The devices and backends, kept as long as the pipeline.
    _devices: (sd_backends::PluginRegistry, BackendManager),
}

/// Opens `model` (the model flags of `a`, the fixture filled in), plans its placement for
/// images of `size` and builds the pipeline with `loras` (no weight is read yet): what a
/// generation and `sd-cli serve` share.
pub fn load(
    a: &GenerateArgs,
    dev: &DeviceArgs,
    model: ModelArgs,
    size: (usize, usize),
    loras: &[sd_models::lora::LoraRequest],
) -> Result<Loaded> {
    let (w, h) = size;
    let reg = crate::devices::open(dev)?;
    let files = sd_models::files::ModelFiles::open(&model.sources())?;
    let threads = sd_backends::threads::resolve_threads(a.threads);
    tracing::debug!("{threads} CPU threads");
    let extra_bufts = match a.cpu_extra_bufts.as_deref() {
        Some(v) => v == "on",
        // a bad value was refused at start-up (`check_cpu_env` in main)
        None => sd_backends::backend::cpu_extra_bufts_from_env().unwrap_or(true),
    };
    tracing::debug!("CPU extra weight buffer types {}", if extra_bufts { "on" } else { "off" });
    let manager = BackendManager::new(Some(threads)).with_cpu_extra_bufts(extra_bufts);
    let speeds = |d: &sd_placement::ModelDescription, names: &[String]| -> Result<_> {
        let backends = reg
            .devices()
            .into_iter()
            .filter(|dev| dev.kind() != sd_backends::DeviceKind::Meta)
            .filter(|dev| names.iter().any(|n| n.eq_ignore_ascii_case(&dev.name())))
            .map(|dev| manager.get(dev))
            .collect::<Result<Vec<_>, _>>()?;
        let key = sd_models::speed::model_key(d);
        let tokens = sd_models::speed::latent_tokens(w, h);
        Ok(sd_models::speed::device_speeds(&backends, &key, tokens, &sd_models::speed::cache_path())?)
    };
    let devices = crate::plan::machine_devices_from(&reg);
    let descriptions = crate::cost::descriptions(&reg);
    let run = crate::cost::RunShape { width: w, height: h, steps: a.steps, cfg_scale: a.cfg_scale };
    let (plan, predicted) = crate::plan::plan_for(
        &model,
        &files,
        &a.placement,
        devices,
        &speeds,
        (&descriptions, run, a.diffusion_fa),
        a.wtype.map(|t| t.0),
    )
    .map_err(|e| crate::devices::name_unusable_plugins(e, &reg))?;
    plan.ensure_loadable()?;
    let sched = sd_sched::plan::Options {
        disable_prefetch: a.disable_prefetch,
        disable_segmented_compute: a.disable_segmented_compute,
    };
    let RuntimePlacement { devices, mut placement } = RuntimePlacement::from_plan(&plan, &reg, &manager, sched)?;
    placement.profile = a.profile;
    placement.no_mmap = a.no_mmap;
    let options = LoadOptions {
        sources: model.sources(),
        prediction: a.prediction,
        wtype: a.wtype.map(|t| t.0),
        devices,
        flash_attn: a.diffusion_fa,
        placement,
        model_args: a.model_args.clone().map(|m| m.0).unwrap_or_default(),
        control_net: model.control_net.clone(),
    };
    let pipeline = Pipeline::from_files(files, options)?.with_loras(loras, a.lora.lora_apply_mode)?;
    for n in pipeline.notices() {
        tracing::warn!("{}", crate::errors::notice(n));
    }
    Ok(Loaded { pipeline, plan, predicted, model, _devices: (reg, manager) })
}

/// Runs a generation: flags -> request -> plan -> pipeline -> images.
pub fn run(a: &GenerateArgs, dev: &DeviceArgs) -> Result<ExitCode> {
    // What needs no model is checked before anything is opened or written; the rest once the
    // model is known (`Pipeline::check_request`), with the outputs: all before the first
    // weight is read. An error there is bad input (exit status 2, as `plan` gives for it).
    if a.run.mode.as_deref() == Some("upscale") {
        return crate::upscale::run_mode(a, dev);
    }
    let (loaded, request, outputs, report_to, upscaler) = validate(a, dev).map_err(crate::errors::bad_input)?;
    let Loaded { pipeline, plan, predicted, model, .. } = loaded;

    let mut report = sd_models::report::RunReport::new("generate", crate::output::command_line());
    report.plan = Some(plan.clone());
    report.predicted = Some(predicted);
    let start = std::time::Instant::now();
    let mut reporter = crate::progress::Reporter::new(std::io::stderr().is_terminal());
    let images = pipeline.generate_reported(&request, &mut |p: Progress| reporter.event(&p), &mut report);
    reporter.finish();
    let images = images.inspect_err(|_| {
        // What ran before the error, for whoever asked; the error is what gets reported.
        let _ = crate::output::write_report(report_to.as_ref(), &report);
    })?;
    for line in pipeline.device_report() {
        tracing::debug!("{line}");
    }
    // As the reference: each image is replaced by its upscaled self before it is saved.
    let images = match upscaler {
        Some(u) => u.run(images, &mut report).inspect_err(|_| {
            let _ = crate::output::write_report(report_to.as_ref(), &report);
        })?,
        None => images,
    };
    let name = model.name();
    let text = |i: usize| (!a.run.disable_image_metadata).then(|| a1111_parameters(a, &request, i, &name));
    let t = std::time::Instant::now();
    crate::output::save_images(&images, &outputs, text)?;
    report.stage("write", t.elapsed().as_secs_f64());
    crate::output::write_report(report_to.as_ref(), &report)?;
    tracing::info!("generation took {:.2} s", start.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}

/// A generation's input checked: the pipeline built and the request checked against it, the
/// outputs planned (nothing read but headers, nothing written).
type Validated =
    (Loaded, Request, Vec<ImageOutput>, Option<sd_models::output::OutputTarget>, Option<crate::upscale::Planned>);

/// Everything a generation checks before its first expensive stage.
fn validate(a: &GenerateArgs, dev: &DeviceArgs) -> Result<Validated> {
    let (params, loras) = a.params()?;
    let count = params.params().batch_count;
    let outputs = ImageOutput::plan(&a.output, count, a.run.output_begin_idx, a.overwrite).context("-o")?;
    let report_to = crate::output::report_target(a.report_json.as_deref())?;
    let model = a.model.or_fixture(ensure_fixture)?;
    // No output may be a file the run reads, or another output.
    let files = model
        .run_files()
        .input(InputRole::PromptFile, a.run.prompt_file.as_deref())
        .input(InputRole::NegativePromptFile, a.run.negative_prompt_file.as_deref())
        .input(InputRole::InitImage, a.init_img.as_deref())
        .input(InputRole::Mask, a.mask.as_deref())
        .input(InputRole::ControlNet, model.control_net.as_deref())
        .input(InputRole::ControlImage, a.control_image.as_deref())
        .inputs(InputRole::RefImage, &a.ref_image)
        .input(InputRole::UpscaleModel, a.upscale.upscale_model.as_deref())
        .loras(&loras);
    let files = outputs.iter().fold(files, |f, o| f.output(OutputRole::Image, &o.target));
    let files = report_to.iter().fold(files, |f, t| f.output(OutputRole::Report, t));
    files.check().map_err(crate::errors::same_file)?;
    let (w, h) = (params.params().width, params.params().height);
    // The hires fix's upscaler model, checked from its header before anything is loaded.
    let hires_model = match a.hires.model_path()? {
        Some(path) => Some(
            sd_models::upscale::UpscalerFile::open(&path)
                .with_context(|| format!("--hires-upscaler {}", path.display()))?,
        ),
        None => None,
    };
    let mut loaded = load(a, dev, model, (w, h), &loras)?;
    if let Some(file) = hires_model {
        let (reg, manager) = &loaded._devices;
        let up = crate::upscale::load_hires_model(a, (reg, manager), file, (w, h), a.hires.hires_upscale_tile_size)?;
        loaded.pipeline.set_hires_model(up);
    }
    let request = loaded.pipeline.check_request(params).map_err(crate::errors::with_flag)?;
    let size = match &request.params().hires {
        Some(h) => (h.width, h.height),
        None => (request.params().width, request.params().height),
    };
    let (reg, manager) = &loaded._devices;
    let upscaler = a.upscale.plan(a, (reg, manager), size)?;
    Ok((loaded, request, outputs, report_to, upscaler))
}

impl GenerateArgs {
    /// The request the flags make, checked as far as it can be without a model.
    pub fn params(&self) -> Result<(ValidParams, Vec<sd_models::lora::LoraRequest>)> {
        self.run.check_mode()?;
        let tiling = TilingParams::from_cli(
            self.vae_tiling,
            self.vae_tile_size.as_deref(),
            self.vae_tile_overlap.as_deref(),
            self.vae_relative_tile_size.as_deref(),
        )
        .map_err(crate::errors::tiling_with_flag)?;
        let (prompt, negative_prompt) = self.run.prompts(&self.prompt, &self.negative_prompt)?;
        // The reference's CLI takes LoRA tags from the prompt only.
        let (prompt, loras) = self.lora.extract(&prompt)?;
        // -W/-H and the init image, as the reference's CLI resolves them; the pipeline aligns
        // the size to the model.
        let (width, height, init_image) =
            crate::inputs::resolve_size(self.width, self.height, self.init_img.as_deref())?;
        let mask = match &self.mask {
            None => None,
            Some(path) if init_image.is_none() => anyhow::bail!(
                "--mask {}: a mask needs an init image (-i): it marks which part of that image is repainted",
                path.display()
            ),
            Some(path) => Some(crate::inputs::read_mask(path, width, height)?),
        };
        let control_image = match &self.control_image {
            None => None,
            Some(path) => Some(crate::inputs::read_control_image(path, width, height)?),
        };
        let control_image = match control_image {
            Some(img) if self.canny => {
                Some(sd_models::image_io::canny::canny(&img, sd_models::image_io::canny::CLI_PARAMS))
            }
            other => other,
        };
        let ref_images = self
            .ref_image
            .iter()
            .map(|path| sd_models::image_io::read_image(path).with_context(|| format!("-r {}", path.display())))
            .collect::<Result<Vec<_>>>()?;
        if self.canny && control_image.is_none() {
            tracing::warn!("--canny without --control-image: nothing to preprocess");
        }
        if prompt.is_empty() {
            tracing::warn!("the prompt is empty (-p): generating unconditioned");
        }
        let seed = if self.seed < 0 {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64 & 0x7fff_ffff)
                .unwrap_or(0)
        } else {
            self.seed as u64
        };
        if self.seed < 0 {
            // The image's metadata carries it too; printed so a run without metadata repeats.
            tracing::info!("random seed {seed} (-s {seed} repeats this image)");
        }
        let params = GenerateParams {
            prompt,
            negative_prompt,
            width,
            height,
            steps: self.steps,
            cfg_scale: self.cfg_scale,
            guidance: self.guidance,
            method: self.sampling_method,
            scheduler: self.scheduler,
            seed,
            batch_count: self.batch_count,
            rng: self.rng,
            clip_skip: self.clip_skip,
            eta: self.eta,
            init_image,
            strength: self.strength,
            mask,
            tiling,
            vae_max_compute_bytes: None,
            flow_shift: self.flow_shift,
            control_image,
            control_strength: self.control_strength,
            hires: self.hires.params()?,
            ref_images,
            auto_resize_ref_images: !self.disable_auto_resize_ref_image,
            increase_ref_index: self.increase_ref_index,
            slg: self.skip_layer_guidance()?,
            img_cfg_scale: self.img_cfg_scale,
        };
        Ok((params.validate().map_err(crate::errors::with_flag)?, loras))
    }
}

impl GenerateArgs {
    /// `--slg-scale` and its layers and range (None at scale 0, as the reference runs it).
    fn skip_layer_guidance(&self) -> Result<Option<sd_models::sampling::SkipLayerGuidance>> {
        let layers = parse_skip_layers(&self.skip_layers)?;
        Ok((self.slg_scale != 0.0).then_some(sd_models::sampling::SkipLayerGuidance {
            scale: self.slg_scale,
            layers,
            start: self.skip_layer_start,
            end: self.skip_layer_end,
        }))
    }
}

/// `--skip-layers`: block numbers separated by commas, in brackets or not ("[7,8,9]", "7, 8").
fn parse_skip_layers(s: &str) -> Result<Vec<usize>> {
    let inner = s.trim();
    let inner = inner.strip_prefix('[').and_then(|t| t.strip_suffix(']')).unwrap_or(inner);
    if inner.trim().is_empty() {
        return Ok(Vec::new());
    }
    inner
        .split(',')
        .map(|p| {
            p.trim().parse::<usize>().map_err(|_| {
                anyhow::anyhow!("--skip-layers {s}: '{}' is not a block number (expected e.g. [7,8,9])", p.trim())
            })
        })
        .collect()
}

/// The hires fix's flags (the reference's names and defaults).
#[derive(Args, Debug, Clone)]
pub(crate) struct HiresArgs {
    /// Hires fix: sample again at a larger size from the first result upscaled.
    #[arg(long = "hires")]
    pub hires: bool,
    /// Hires fix: the upscaler, one of `Latent`, `Latent (nearest)`, `Latent (nearest-exact)`,
    /// `Latent (antialiased)`, `Latent (bicubic)`, `Latent (bicubic antialiased)`, `Lanczos`,
    /// `Nearest` (the decoded image resized) or `None` (no hires pass).
    #[arg(long = "hires-upscaler", value_name = "NAME", default_value = "Latent")]
    pub hires_upscaler: String,
    /// Hires fix: the directory of upscaler models (for `--hires-upscaler MODEL-NAME`).
    #[arg(long = "hires-upscalers-dir", value_name = "DIR")]
    pub hires_upscalers_dir: Option<PathBuf>,
    /// Hires fix: the target's factor of the generated size, when neither
    /// `--hires-width` nor `--hires-height` is given.
    #[arg(long = "hires-scale", value_name = "F", default_value_t = 2.0, allow_hyphen_values = true)]
    pub hires_scale: f32,
    /// Hires fix: the target width (0: the height, else from the scale).
    #[arg(long = "hires-width", value_name = "N", default_value_t = 0, value_parser = image_side)]
    pub hires_width: i64,
    /// Hires fix: the target height (0: the width, else from the scale).
    #[arg(long = "hires-height", value_name = "N", default_value_t = 0, value_parser = image_side)]
    pub hires_height: i64,
    /// Hires fix: the second pass's steps (0: `--steps`).
    #[arg(long = "hires-steps", value_name = "N", default_value_t = 0, value_parser = whole::<usize>)]
    pub hires_steps: usize,
    /// Hires fix: how much the second pass changes the upscaled image (0..1).
    #[arg(long = "hires-denoising-strength", value_name = "F", default_value_t = 0.7, allow_hyphen_values = true)]
    pub hires_denoising_strength: f32,
    /// Hires fix: the tile size of an upscaler model.
    #[arg(long = "hires-upscale-tile-size", value_name = "N", default_value_t = 128, value_parser = whole::<usize>)]
    pub hires_upscale_tile_size: usize,
}

impl HiresArgs {
    /// The upscaler model `--hires-upscaler` names (None for a built-in upscaler or without
    /// `--hires`): a file, or a name in `--hires-upscalers-dir` (the file itself, or with the
    /// extension `.safetensors`, `.gguf`, `.pth` or `.bin`).
    pub(crate) fn model_path(&self) -> Result<Option<PathBuf>> {
        let name = self.hires_upscaler.as_str();
        let builtin = sd_models::hires::HiresUpscaler::from_name(name)
            .is_some_and(|u| u != sd_models::hires::HiresUpscaler::Model);
        if !self.hires || builtin || name == "None" {
            return Ok(None);
        }
        if let Some(dir) = &self.hires_upscalers_dir {
            let found = ["", ".safetensors", ".gguf", ".pth", ".bin"]
                .iter()
                .map(|ext| dir.join(format!("{name}{ext}")))
                .find(|p| p.is_file());
            if found.is_some() {
                return Ok(found);
            }
        }
        let path = PathBuf::from(name);
        Ok(path.is_file().then_some(path))
    }

    /// The hires fix the flags ask for (None without `--hires` or with `--hires-upscaler None`).
    fn params(&self) -> Result<Option<sd_models::hires::HiresParams>> {
        use sd_models::hires::{HiresParams, HiresUpscaler};
        if !self.hires {
            return Ok(None);
        }
        if let Some(dir) = self.hires_upscalers_dir.as_deref().filter(|d| !d.is_dir()) {
            anyhow::bail!("--hires-upscalers-dir {}: not a directory", dir.display());
        }
        let name = self.hires_upscaler.as_str();
        let upscaler = match (HiresUpscaler::from_name(name).filter(|u| *u != HiresUpscaler::Model), name) {
            (Some(u), _) => u,
            (None, _) if self.model_path()?.is_some() => HiresUpscaler::Model,
            (None, "None") => {
                tracing::warn!("--hires with --hires-upscaler None: no hires pass");
                return Ok(None);
            }
            (None, _) => anyhow::bail!(
                "--hires-upscaler '{name}': not an upscaler: the latent modes are `Latent`, `Latent (nearest)`, \
                 `Latent (nearest-exact)`, `Latent (antialiased)`, `Latent (bicubic)` and `Latent (bicubic \
                 antialiased)`, the image ones `Lanczos` and `Nearest`, or an upscaler model: a file, \
                 or a name in --hires-upscalers-dir"
            ),
        };
        let side = |v: i64| usize::try_from(v.max(0)).unwrap_or(0);
        Ok(Some(HiresParams {
            upscaler,
            scale: self.hires_scale,
            width: side(self.hires_width),
            height: side(self.hires_height),
            steps: self.hires_steps,
            denoising_strength: self.hires_denoising_strength,
        }))
    }
}

/// `--model-args`: `(key, value)` pairs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct FamilyArgs(pub(crate) Vec<(String, String)>);

fn model_args(s: &str) -> Result<FamilyArgs, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => out.push((k.trim().to_owned(), v.trim().to_owned())),
            _ => return Err(format!("'{part}': KEY=VALUE expected")),
        }
    }
    Ok(FamilyArgs(out))
}
