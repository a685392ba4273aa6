//! Image generation: the reference's flags, placement, progress, PNG output.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
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

use crate::image_io::{read_png, write_png, Rgb8};
use crate::plan::{ModelArgs, PlacementArgs};
use crate::DeviceArgs;

/// Generation flags (names as in stable-diffusion.cpp's sd-cli).
#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub placement: PlacementArgs,
    /// The prompt.
    #[arg(short = 'p', long = "prompt", default_value = "")]
    pub prompt: String,
    /// The negative prompt.
    #[arg(short = 'n', long = "negative-prompt", default_value = "")]
    pub negative_prompt: String,
    /// Image width in pixels (a multiple of 8).
    #[arg(short = 'W', long = "width", default_value_t = 512)]
    pub width: usize,
    /// Image height in pixels (a multiple of 8).
    #[arg(short = 'H', long = "height", default_value_t = 512)]
    pub height: usize,
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
    /// Output PNG (with several images: name_2.png, ...).
    #[arg(short = 'o', long = "output", default_value = "output.png")]
    pub output: PathBuf,
    /// CPU threads (<= 0: all cores).
    #[arg(short = 't', long = "threads", default_value_t = -1, allow_hyphen_values = true)]
    pub threads: i64,
    /// Noise generator: cuda (Philox, the default), std_default, cpu.
    #[arg(long = "rng", default_value = "cuda")]
    pub rng: String,
    /// img2img: the init image (PNG).
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
    /// VAE tile overlap (fraction of a tile).
    #[arg(long = "vae-tile-overlap")]
    pub vae_tile_overlap: Option<f32>,
    /// Relative VAE tile size: <=1 fraction of the image, >1 tiles per axis; N or WxH.
    #[arg(long = "vae-relative-tile-size")]
    pub vae_relative_tile_size: Option<String>,
    /// Disable asynchronous next-segment prefetch (segmented execution).
    #[arg(long = "disable-prefetch")]
    pub disable_prefetch: bool,
    /// Force monolithic graph execution.
    #[arg(long = "disable-segmented-compute")]
    pub disable_segmented_compute: bool,
}

fn parse_pair<T: std::str::FromStr + Copy>(s: &str, flag: &str) -> Result<[T; 2]> {
    let bad = || anyhow::anyhow!("{flag} '{s}': expected N or WxH");
    let parts: Vec<&str> = s.split(['x', 'X']).collect();
    match parts.as_slice() {
        [a] => {
            let v: T = a.trim().parse().map_err(|_| bad())?;
            Ok([v, v])
        }
        [a, b] => Ok([a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?]),
        _ => Err(bad()),
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

fn a1111_parameters(a: &GenerateArgs, seed: u64, method: SampleMethod, scheduler: Scheduler, model: &str) -> String {
    let mut s = a.prompt.clone();
    if !a.negative_prompt.is_empty() {
        s.push_str(&format!("\nNegative prompt: {}", a.negative_prompt));
    }
    s.push_str(&format!(
        "\nSteps: {}, Sampler: {}, Schedule type: {}, CFG scale: {}, Seed: {}, Size: {}x{}, Model: {}, RNG: {}",
        a.steps,
        method.display_name(),
        scheduler.name(),
        a.cfg_scale,
        seed,
        a.width,
        a.height,
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

fn output_path(base: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 || i == 0 {
        return base.to_path_buf();
    }
    let stem = base.file_stem().and_then(|s| s.to_str()).unwrap_or("output");
    let ext = base.extension().and_then(|s| s.to_str()).unwrap_or("png");
    base.with_file_name(format!("{stem}_{}.{ext}", i + 1))
}

/// Runs a generation.
pub fn run(a: &GenerateArgs, dev: &DeviceArgs) -> Result<ExitCode> {
    // Validate cheap things before loading anything.
    if a.width == 0 || a.height == 0 || !a.width.is_multiple_of(8) || !a.height.is_multiple_of(8) {
        bail!("-W {} -H {}: width and height must be positive multiples of 8", a.width, a.height);
    }
    if a.steps == 0 {
        bail!("--steps 0: at least one sampling step is needed");
    }
    if a.batch_count == 0 {
        bail!("-b 0: the batch count must be at least 1");
    }
    if !(0.0..=1.0).contains(&a.strength) {
        bail!("--strength {}: must be between 0 and 1", a.strength);
    }
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
    let mut tiling = TilingParams { enabled: a.vae_tiling, ..TilingParams::default() };
    if let Some(s) = &a.vae_tile_size {
        tiling.tile_size = parse_pair::<usize>(s, "--vae-tile-size")?;
    }
    if let Some(o) = a.vae_tile_overlap {
        tiling.target_overlap = o;
    }
    if let Some(s) = &a.vae_relative_tile_size {
        tiling.rel_size = parse_pair::<f32>(s, "--vae-relative-tile-size")?;
    }
    if !a.vae_tiling
        && (a.vae_tile_size.is_some() || a.vae_tile_overlap.is_some() || a.vae_relative_tile_size.is_some())
    {
        bail!("--vae-tile-size, --vae-tile-overlap and --vae-relative-tile-size require --vae-tiling");
    }
    if a.output.is_dir() {
        bail!("-o {}: is a directory", a.output.display());
    }
    let init = match &a.init_img {
        None => None,
        Some(p) => {
            let img = read_png(p)?;
            if img.width as usize != a.width || img.height as usize != a.height {
                bail!(
                    "-i {}: the image is {}x{}, but -W/-H ask for {}x{}",
                    p.display(),
                    img.width,
                    img.height,
                    a.width,
                    a.height
                );
            }
            let plane = (img.width * img.height) as usize;
            let mut planar = vec![0f32; plane * 3];
            for i in 0..plane {
                for c in 0..3 {
                    planar[c * plane + i] = img.data[i * 3 + c] as f32 / 255.0;
                }
            }
            Some((planar, a.strength))
        }
    };
    if a.prompt.is_empty() {
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
    let threads = if a.threads <= 0 {
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    } else {
        a.threads as usize
    };
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
    // Managed budgets: a positive --max-vram, or the startup snapshot a negative one gives.
    let budgets = plan
        .devices
        .iter()
        .filter_map(|d| match d.budget_rule {
            sd_placement::BudgetRule::Managed(_)
            | sd_placement::BudgetRule::FreeMinus(_)
            | sd_placement::BudgetRule::Free => d.budget_bytes.map(|b| (d.device.clone(), b)),
            _ => None,
        })
        .collect();
    let placement = Placement {
        homes,
        ledgers: sd_sched::Ledgers::with_budgets(budgets),
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
    let params = GenerateParams {
        prompt: a.prompt.clone(),
        negative_prompt: a.negative_prompt.clone(),
        width: a.width,
        height: a.height,
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
    let tty = std::io::stderr().is_terminal();
    let start = std::time::Instant::now();
    let mut on_progress = |p: Progress| {
        if let Progress::Step { image, step, steps, seconds } = p {
            if tty {
                let done = step + 1;
                let bar: String = (0..30).map(|i| if i * steps < done * 30 { '=' } else { ' ' }).collect();
                let _ = write!(
                    std::io::stderr(),
                    "\r  [{bar}] {done}/{steps} image {} {:.2} it/s ",
                    image + 1,
                    1.0 / seconds.max(1e-9)
                );
                if done == steps {
                    let _ = writeln!(std::io::stderr());
                }
            }
        }
    };
    let images = pipeline.generate(&params, &mut on_progress)?;
    for line in pipeline.device_report() {
        tracing::debug!("{line}");
    }
    let text = a1111_parameters(a, seed, method, scheduler, &model_name);
    for (i, img) in images.iter().enumerate() {
        let path = output_path(&a.output, i, images.len());
        write_png(&path, &Rgb8 { width: img.width as u32, height: img.height as u32, data: img.rgb.clone() }, &text)?;
        tracing::info!("saved {}", path.display());
    }
    tracing::info!("generation took {:.2} s", start.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}
