//! Image generation: the reference's flags, placement, progress, image output.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use sd_backends::{BackendManager, GgmlType};
use sd_models::files::Prediction as FilePrediction;
use sd_models::fixture::{self, Family, FileFormat, FixtureRequest, WeightType};
use sd_models::pipeline::{GenerateParams, LoadOptions, ModuleDevices, ModuleHomes, Pipeline, Placement, Progress};
use sd_models::sampling::{RngKind, SampleMethod, Scheduler};
use sd_sched::ParamHome;
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
    /// The prompt.
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
    #[arg(long = "steps", default_value_t = 20)]
    pub steps: usize,
    /// Classifier-free guidance scale (1 disables the negative prompt).
    #[arg(long = "cfg-scale", default_value_t = 7.0, allow_hyphen_values = true)]
    pub cfg_scale: f32,
    /// Sampling method: euler, euler_a, heun, dpm2, dpm++2s_a, dpm++2m, dpm++2mv2, ipndm, ipndm_v,
    /// lcm, ddim_trailing, tcd, res_multistep, res_2s, er_sde, euler_cfg_pp, euler_a_cfg_pp,
    /// euler_ge (default: the model's, euler_a for SD 1.x/2.x).
    #[arg(long = "sampling-method")]
    pub sampling_method: Option<String>,
    /// Scheduler: discrete, karras, exponential, ays, gits, sgm_uniform, simple, smoothstep,
    /// kl_optimal, lcm, bong_tangent, ltx2 (default: the sampler's: lcm for lcm and tcd, simple
    /// for ddim_trailing, else discrete).
    #[arg(long = "scheduler")]
    pub scheduler: Option<String>,
    /// Seed (negative: random).
    #[arg(short = 's', long = "seed", default_value_t = 42, allow_hyphen_values = true)]
    pub seed: i64,
    /// Number of images.
    #[arg(short = 'b', long = "batch-count", default_value_t = 1)]
    pub batch_count: usize,
    /// Output image: .png, .jpg or .webp; printf-style %d (e.g. out_%03d.png) numbers the
    /// images, else a batch is name_0.png, name_1.png, ...
    #[arg(short = 'o', long = "output", default_value = "output.png")]
    pub output: PathBuf,
    /// CPU threads (<= 0: the number of physical cores).
    #[arg(short = 't', long = "threads", default_value_t = -1, allow_hyphen_values = true)]
    pub threads: i64,
    /// Noise generator: cuda (Philox, the default), std_default, cpu.
    #[arg(long = "rng", default_value = "cuda")]
    pub rng: String,
    /// img2img: the init image (PNG, JPEG, WebP or BMP), centre-cropped and resized to
    /// -W x -H when both are given.
    #[arg(short = 'i', long = "init-img")]
    pub init_img: Option<PathBuf>,
    /// img2img: how much to change the init image (0..1).
    #[arg(long = "strength", default_value_t = 0.75)]
    pub strength: f32,
    /// Skip the last N-1 text-encoder layers (<= 0: the model's default).
    #[arg(long = "clip-skip", default_value_t = -1, allow_hyphen_values = true)]
    pub clip_skip: i64,
    /// Ancestral sampler noise scale.
    #[arg(long = "eta")]
    pub eta: Option<f32>,
    /// Weight type at load: f32, f16, q8_0, q5_0, q4_0, ...
    #[arg(long = "type")]
    pub wtype: Option<String>,
    /// eps or v (overrides what the file says).
    #[arg(long = "prediction")]
    pub prediction: Option<String>,
    /// Flash attention in the diffusion model.
    #[arg(long = "diffusion-fa")]
    pub diffusion_fa: bool,
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
    /// [sd-rs] Force monolithic graph execution.
    #[arg(long = "disable-segmented-compute")]
    pub disable_segmented_compute: bool,
    /// [sd-rs] Write a JSON report of the run to PATH: placement, each module's residency,
    /// each runner's work, each device's managed high-water mark and budget, stage times.
    #[arg(long = "report-json", value_name = "PATH")]
    pub report_json: Option<PathBuf>,
}

/// `-W`/`-H`: a whole number of pixels (its range is checked with the init image, and its
/// multiple once the model is known).
fn image_side(s: &str) -> std::result::Result<i64, String> {
    s.trim().parse::<i64>().map_err(|_| format!("'{}' is not a whole number of pixels", clip_text(s)))
}

/// `s` cut to 60 characters for an error message (a 100 KB argument is not echoed whole).
pub fn clip_text(s: &str) -> String {
    const MAX: usize = 60;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}... ({} bytes)", &s[..i], s.len()),
        None => s.to_string(),
    }
}

fn wtype(s: &str) -> Result<GgmlType> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "f32" => GgmlType::GGML_TYPE_F32,
        "f16" => GgmlType::GGML_TYPE_F16,
        "bf16" => GgmlType::GGML_TYPE_BF16,
        "q8_0" => GgmlType::GGML_TYPE_Q8_0,
        "q5_0" => GgmlType::GGML_TYPE_Q5_0,
        "q5_1" => GgmlType::GGML_TYPE_Q5_1,
        "q4_0" => GgmlType::GGML_TYPE_Q4_0,
        "q4_1" => GgmlType::GGML_TYPE_Q4_1,
        "q4_k" => GgmlType::GGML_TYPE_Q4_K,
        "q5_k" => GgmlType::GGML_TYPE_Q5_K,
        "q6_k" => GgmlType::GGML_TYPE_Q6_K,
        "q3_k" => GgmlType::GGML_TYPE_Q3_K,
        "q2_k" => GgmlType::GGML_TYPE_Q2_K,
        other => bail!(
            "--type '{other}': accepted: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1, q2_k, q3_k, q4_k, q5_k, q6_k"
        ),
    })
}

/// Where a generated fixture is cached when no model is given.
fn fixture_cache() -> PathBuf {
    if let Some(d) = std::env::var_os("SD_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("sd-rs");
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/sd-rs"))
        .unwrap_or_else(|| std::env::temp_dir().join("sd-rs"))
}

fn ensure_fixture() -> Result<PathBuf> {
    let dir = fixture_cache();
    let path = dir.join("sd15-fixture-seed42-f16.safetensors");
    if !path.exists() {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        tracing::warn!(
            "no model given (-m): writing an SD 1.5 checkpoint with random weights to {} (once); \
             the image will be noise-like. Pass -m to use a real model.",
            path.display()
        );
        let req = FixtureRequest::family(Family::Sd15, 42, WeightType::F16, FileFormat::Safetensors);
        fixture::write_fixture(&path, &req).context("writing the fixture checkpoint")?;
    } else {
        tracing::warn!("no model given (-m): using the random-weight SD 1.5 fixture {}", path.display());
    }
    Ok(path)
}

/// The parameters text of an image (A1111's layout).
fn a1111_parameters(a: &GenerateArgs, p: &GenerateParams, seed: u64, model: &str) -> String {
    let (method, scheduler) = (p.method, p.scheduler);
    let mut s = p.prompt.clone();
    if !p.negative_prompt.is_empty() {
        s.push_str(&format!("\nNegative prompt: {}", p.negative_prompt));
    }
    s.push_str(&format!(
        "\nSteps: {}, Sampler: {}, Schedule type: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Model: {}, RNG: {}",
        a.steps,
        method.display_name(),
        scheduler.name(),
        a.cfg_scale,
        seed,
        p.width,
        p.height,
        model,
        a.rng
    ));
    if a.init_img.is_some() {
        s.push_str(&format!(", Denoising strength: {}", a.strength));
    }
    if a.clip_skip > 0 {
        s.push_str(&format!(", Clip skip: {}", a.clip_skip));
    }
    s.push_str(&format!(", Version: sd-rs {}", env!("CARGO_PKG_VERSION")));
    s
}

/// Runs a generation.
pub fn run(a: &GenerateArgs, dev: &DeviceArgs) -> Result<ExitCode> {
    // Flags are checked here, against the model in `Pipeline::check_request`, and the outputs
    // once those pass: all before the first weight is read.
    a.run.check_mode()?;
    // The defaults depend on the model: resolved once it is opened.
    let method: Option<SampleMethod> =
        a.sampling_method.as_deref().map(str::parse).transpose().with_context(|| "--sampling-method".to_string())?;
    let scheduler: Option<Scheduler> =
        a.scheduler.as_deref().map(str::parse).transpose().with_context(|| "--scheduler".to_string())?;
    let rng: RngKind = a.rng.parse().with_context(|| "--rng".to_string())?;
    let wt = a.wtype.as_deref().map(wtype).transpose()?;
    let prediction = match a.prediction.as_deref() {
        None => None,
        Some("eps") => Some(FilePrediction::Eps),
        Some("v") => Some(FilePrediction::V),
        Some(o) => bail!("--prediction '{o}': accepted: eps, v"),
    };
    let tiling = TilingParams::from_cli(
        a.vae_tiling,
        a.vae_tile_size.as_deref(),
        a.vae_tile_overlap.as_deref(),
        a.vae_relative_tile_size.as_deref(),
    )?;
    let (prompt, negative_prompt) = a.run.prompts(&a.prompt, &a.negative_prompt)?;
    // -W/-H and the init image, as the reference's CLI resolves them; the pipeline aligns
    // the size to the model below.
    let (width, height, init_image) = crate::inputs::resolve_size(a.width, a.height, a.init_img.as_deref())?;
    if prompt.is_empty() {
        tracing::warn!("the prompt is empty (-p): generating unconditioned");
    }
    let seed = if a.seed < 0 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 & 0x7fff_ffff)
            .unwrap_or(0)
    } else {
        a.seed as u64
    };

    // Model-independent checks before anything is opened or written; the size is checked
    // again, aligned to the model's multiple, once the model is known.
    let early = GenerateParams {
        prompt: String::new(),
        negative_prompt: String::new(),
        width: width.div_ceil(8) * 8,
        height: height.div_ceil(8) * 8,
        steps: a.steps,
        cfg_scale: a.cfg_scale,
        // validate() does not depend on the sampler; the model picks the defaults later
        method: method.unwrap_or_default(),
        scheduler: scheduler.unwrap_or_default(),
        seed,
        batch_count: a.batch_count,
        rng,
        clip_skip: a.clip_skip,
        eta: a.eta,
        init_image: None,
        tiling: tiling.clone(),
        vae_max_compute_bytes: None,
    };
    early.validate()?;
    if !(0.0..=1.0).contains(&a.strength) {
        bail!("--strength {}: must be between 0 and 1", a.strength);
    }

    let mut model_args = a.model.clone();
    if model_args.model.is_none() && model_args.diffusion_model.is_none() {
        model_args.model = Some(ensure_fixture()?);
    }
    let model_name = model_args
        .model
        .as_ref()
        .or(model_args.diffusion_model.as_ref())
        .and_then(|p| p.file_stem())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();

    // Placement.
    let reg = crate::devices::open(dev)?;
    let devices = crate::plan::machine_devices_from(&reg);
    let files = sd_models::files::ModelFiles::open(&model_args.sources())?;
    let description = sd_models::describe::describe(&files, &model_args.extra())?;
    let request = sd_placement::PlanRequest {
        flags: a.placement.flags(),
        devices,
        ram_available_bytes: crate::plan::ram_available(),
        model: description,
    };
    let plan = sd_placement::plan(&request)?;
    plan.ensure_loadable()?;
    for w in &plan.warnings {
        tracing::warn!("{w}");
    }
    if plan.auto_fit {
        tracing::info!("auto-fit: --backend \"{}\" --params-backend \"{}\"", plan.backend, plan.params_backend);
    }
    let threads = sd_backends::threads::resolve_threads(a.threads);
    tracing::debug!("{threads} CPU threads");
    let manager = BackendManager::new(Some(threads));
    let module_plan = |module: sd_placement::Module| plan.modules.iter().find(|m| m.module == module);
    let backend_of = |module: sd_placement::Module| -> Result<Arc<sd_backends::Backend>> {
        let m = module_plan(module);
        let name = m.and_then(|m| m.runtime.first()).cloned().unwrap_or_else(|| plan.main_device.clone());
        if m.is_some_and(|m| m.runtime.len() > 1) {
            tracing::warn!("{}: multi-device split is not implemented yet; running on {name}", module.name());
        }
        Ok(manager.get(reg.device(&name)?)?)
    };
    // Where each module's parameters live, as the plan says.
    let home_of = |module: sd_placement::Module, compute: &Arc<sd_backends::Backend>| -> Result<ParamHome> {
        let Some(m) = module_plan(module) else { return Ok(ParamHome::Compute) };
        let runtime = compute.device().name();
        let home = if m.params.is_empty() || m.params == runtime {
            ParamHome::Compute
        } else if m.params.eq_ignore_ascii_case("disk") {
            ParamHome::Disk
        } else if m.params.contains('&') {
            tracing::warn!("{}: split parameters are not implemented yet; keeping them on {runtime}", module.name());
            ParamHome::Compute
        } else {
            let dev = reg.device(&m.params)?;
            if dev.kind() == sd_backends::DeviceKind::Cpu {
                ParamHome::Host
            } else {
                ParamHome::Device(manager.get(dev)?)
            }
        };
        tracing::info!(
            "{}: runs on {runtime}, params {} ({})",
            module.name(),
            home.describe(),
            sd_placement::fmt_bytes(m.param_bytes)
        );
        Ok(home)
    };
    let devices = ModuleDevices {
        te: backend_of(sd_placement::Module::Te)?,
        diffusion: backend_of(sd_placement::Module::Diffusion)?,
        vae: backend_of(sd_placement::Module::Vae)?,
    };
    let homes = ModuleHomes {
        te: home_of(sd_placement::Module::Te, &devices.te)?,
        diffusion: home_of(sd_placement::Module::Diffusion, &devices.diffusion)?,
        vae: home_of(sd_placement::Module::Vae, &devices.vae)?,
    };
    // Managed budgets: a positive --max-vram, or the startup snapshot a negative one gives
    // (0, like no --max-vram, sets none: live free memory is the limit).
    let placement = Placement {
        homes,
        ledgers: sd_sched::Ledgers::with_budgets(plan.runtime_budgets().into_iter().collect()),
        sched: sd_sched::plan::Options {
            disable_prefetch: a.disable_prefetch,
            disable_segmented_compute: a.disable_segmented_compute,
        },
    };

    let pipeline = Pipeline::from_files(
        files,
        LoadOptions {
            sources: model_args.sources(),
            prediction,
            wtype: wt,
            devices,
            flash_attn: a.diffusion_fa,
            placement,
        },
    )?;
    let method = method.unwrap_or_else(|| pipeline.default_sample_method());
    let scheduler = scheduler.unwrap_or_else(|| method.default_scheduler());
    let (width, height) = pipeline.aligned_size(width, height);
    let init = init_image.map(|img| {
        // The library's rule for an init image of another size than the (aligned) request.
        let img = sd_models::image_io::resize_nearest(&img, width, height);
        (sd_models::image_io::to_planar(&img), a.strength)
    });
    let params = GenerateParams {
        prompt,
        negative_prompt,
        width,
        height,
        steps: a.steps,
        cfg_scale: a.cfg_scale,
        method,
        scheduler,
        seed,
        batch_count: a.batch_count,
        rng,
        clip_skip: a.clip_skip,
        eta: a.eta,
        init_image: init,
        tiling,
        vae_max_compute_bytes: None,
    };
    params.validate()?;
    pipeline.check_request(&params)?;
    // Every output is checked (and named) before the first weight is read.
    let outputs = crate::output::plan_outputs(&a.output, a.batch_count, a.run.output_begin_idx)?;
    let report_to = crate::output::report_target(a.report_json.as_deref())?;
    let mut report = sd_models::report::RunReport::new("generate", crate::output::command_line());
    report.plan = Some(plan.clone());
    let start = std::time::Instant::now();
    let mut reporter = crate::progress::Reporter::new(std::io::stderr().is_terminal());
    let images = pipeline.generate_reported(&params, &mut |p: Progress| reporter.event(&p), &mut report);
    reporter.finish();
    let images = images.inspect_err(|_| {
        // What ran before the error, for whoever asked; the error is what gets reported.
        let _ = crate::output::write_report(report_to.as_ref(), &report);
    })?;
    for line in pipeline.device_report() {
        tracing::debug!("{line}");
    }
    let metadata = !a.run.disable_image_metadata;
    // Image i was sampled from seed + i.
    let text = |i: usize| metadata.then(|| a1111_parameters(a, &params, seed.wrapping_add(i as u64), &model_name));
    let t = std::time::Instant::now();
    crate::output::save_images(&images, &outputs, text)?;
    report.stage("write", t.elapsed().as_secs_f64());
    crate::output::write_report(report_to.as_ref(), &report)?;
    tracing::info!("generation took {:.2} s", start.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}
