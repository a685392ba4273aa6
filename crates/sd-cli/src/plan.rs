//! `sd-cli plan`: print a placement plan from file headers, for this machine or a device profile.
//!
//! Exit status: 0 when the plan fits, 1 when it does not, 2 on bad input.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::Args;
use sd_models::describe::{describe, ExtraFile};
use sd_models::files::{ModelFiles, ModelSources};
use sd_models::output::{InputRole, OutputRole, RunFiles};
use sd_placement::{plan, Device, DeviceProfile, DeviceType, Flags, Plan, PlanRequest, MIB, PIPELINE_COPIES_ENV};

use crate::DeviceArgs;

/// The placement flags, shared by `plan` and generation.
#[derive(Args, Debug, Clone, Default)]
pub struct PlacementArgs {
    /// Runtime backend per module (`cuda0`, `te=cpu,diffusion=cuda0`, `diffusion=cuda0&cuda1`).
    #[arg(long = "backend", value_name = "SPEC")]
    pub backend: Option<String>,
    /// Where parameters live per module (a device, or `disk`).
    #[arg(long = "params-backend", value_name = "SPEC")]
    pub params_backend: Option<String>,
    /// `layer` or `row`, or per module (`diffusion=row,te=layer`), e.g. `--backend
    /// "diffusion=cuda0&cuda1" --split-mode row`. Where no listed device exports a split buffer
    /// type (CPU, RPC) `row` cuts the module's block matmuls (the diffusion model's, the text
    /// encoder's layers') across the devices at graph level (the CPU only as the last device);
    /// where that cannot run it falls back to a layer split, saying why.
    #[arg(long = "split-mode", value_name = "SPEC")]
    pub split_mode: Option<String>,
    /// [sd-rs] How a layer split sizes its block ranges: `memory` (default: by free memory or the
    /// device budget) or `speed` (so that the devices finish together, from measured device
    /// speeds), e.g. `--backend "diffusion=cuda0&rpc0" --split-by speed`.
    #[arg(long = "split-by", value_name = "memory|speed")]
    pub split_by: Option<String>,
    /// [sd-rs] Micro-batches a layer-split module overlaps across its devices; each device keeps
    /// that many copies of its cross-device inputs and compute buffers (default 1, or the
    /// environment variable SD_PIPELINE_COPIES), e.g. `--backend "diffusion=cpu&rpc0"
    /// --pipeline-copies 2`.
    #[arg(long = "pipeline-copies", value_name = "N", allow_hyphen_values = true)]
    pub pipeline_copies: Option<String>,
    /// Per-device budget in GiB (`6`, `-1`, `cuda0=6,vulkan0=2`): positive: a managed budget;
    /// negative: free memory at startup less that many GiB; 0 (as without it): no managed
    /// budget, only live free memory limits segmented execution.
    #[arg(long = "max-vram", value_name = "SPEC", allow_hyphen_values = true)]
    pub max_vram: Option<String>,
    /// Automatic placement: `on` (default unless --backend/--params-backend are given; by
    /// predicted time when every device has measured figures, see `sd-cli calibrate`), `off`,
    /// or `ladder` ([sd-rs]: the first-fit ladder only, never replaced by a faster prediction).
    #[arg(long = "auto-fit", value_name = "on|off|ladder")]
    pub auto_fit: Option<String>,
    /// Deprecated: `te=cpu` in front of --backend.
    #[arg(long = "clip-on-cpu")]
    pub clip_on_cpu: bool,
    /// Deprecated: `vae=cpu` in front of --backend.
    #[arg(long = "vae-on-cpu")]
    pub vae_on_cpu: bool,
    /// Deprecated: `controlnet=cpu` in front of --backend.
    #[arg(long = "control-net-cpu")]
    pub control_net_cpu: bool,
    /// Parameters in RAM: `*=cpu` in front of --params-backend.
    #[arg(long = "offload-to-cpu")]
    pub offload_to_cpu: bool,
    /// [sd-rs] Skip the pre-load memory check.
    #[arg(long = "no-memory-check")]
    pub no_memory_check: bool,
}

impl PlacementArgs {
    /// The planner's flags, with the environment variable `SD_PIPELINE_COPIES` (read here: the
    /// planner does no I/O; a value that is not UTF-8 reaches it lossily and fails to parse).
    pub fn flags(&self) -> Flags {
        Flags {
            backend: self.backend.clone(),
            params_backend: self.params_backend.clone(),
            split_mode: self.split_mode.clone(),
            split_by: self.split_by.clone(),
            pipeline_copies: self.pipeline_copies.clone(),
            pipeline_copies_env: std::env::var_os(PIPELINE_COPIES_ENV).map(|v| v.to_string_lossy().into_owned()),
            max_vram: self.max_vram.clone(),
            auto_fit: self.auto_fit.clone(),
            clip_on_cpu: self.clip_on_cpu,
            vae_on_cpu: self.vae_on_cpu,
            control_net_cpu: self.control_net_cpu,
            offload_to_cpu: self.offload_to_cpu,
            no_memory_check: self.no_memory_check,
        }
    }
}

/// The model file flags, shared by `plan` and generation.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// Model: a checkpoint (safetensors, GGUF) or a diffusers folder.
    #[arg(short = 'm', long = "model", value_name = "PATH")]
    pub model: Option<PathBuf>,
    /// The diffusion model alone.
    #[arg(long = "diffusion-model", value_name = "PATH")]
    pub diffusion_model: Option<PathBuf>,
    /// The VAE alone.
    #[arg(long = "vae", value_name = "PATH")]
    pub vae: Option<PathBuf>,
    /// The CLIP-L text encoder alone.
    #[arg(long = "clip_l", value_name = "PATH")]
    pub clip_l: Option<PathBuf>,
    /// The OpenCLIP ViT-bigG text encoder alone (SDXL's second text encoder).
    #[arg(long = "clip_g", value_name = "PATH")]
    pub clip_g: Option<PathBuf>,
    /// The T5-XXL text encoder alone (FLUX's).
    #[arg(long = "t5xxl", value_name = "PATH")]
    pub t5xxl: Option<PathBuf>,
    /// An LLM text encoder (Z-Image's Qwen3).
    #[arg(long = "llm", value_name = "PATH")]
    pub llm: Option<PathBuf>,
    /// The tiny autoencoder (TAESD) used instead of the VAE.
    #[arg(long = "taesd", visible_alias = "tae", value_name = "PATH")]
    pub taesd: Option<PathBuf>,
    /// A ControlNet (SD 1.x), the `controlnet` module; its input is --control-image.
    #[arg(long = "control-net", value_name = "PATH")]
    pub control_net: Option<PathBuf>,
}

impl ModelArgs {
    /// These flags, with `fixture()`'s checkpoint as `-m` when no model is given.
    pub fn or_fixture(&self, fixture: impl FnOnce() -> Result<PathBuf>) -> Result<ModelArgs> {
        let mut m = self.clone();
        if m.model.is_none() && m.diffusion_model.is_none() {
            m.model = Some(fixture()?);
        }
        Ok(m)
    }

    /// The model's name for image metadata: the file stem of `-m` (or `--diffusion-model`).
    pub fn name(&self) -> String {
        self.model
            .as_ref()
            .or(self.diffusion_model.as_ref())
            .and_then(|p| p.file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// The sources the runtime loads.
    pub fn sources(&self) -> ModelSources {
        ModelSources {
            model: self.model.clone(),
            diffusion_model: self.diffusion_model.clone(),
            vae: self.vae.clone(),
            clip_l: self.clip_l.clone(),
            clip_g: self.clip_g.clone(),
            taesd: self.taesd.clone(),
            t5xxl: self.t5xxl.clone(),
            llm: self.llm.clone(),
        }
    }

    /// These files as inputs of a run (every model file flag), for the outputs' check.
    pub fn run_files(&self) -> RunFiles {
        RunFiles::default().model_sources(&self.sources())
    }

    /// Files described from headers only beside the model's: the ControlNet (the
    /// `controlnet` module, loaded from its own file).
    pub fn extra(&self) -> Vec<ExtraFile> {
        self.control_net
            .iter()
            .map(|path| ExtraFile {
                flag: "--control-net".into(),
                path: path.clone(),
                dominant: false,
                module: sd_placement::Module::ControlNet,
            })
            .collect()
    }
}

/// The planner's description of `files` and the extra files of `model`, an extra file that
/// cannot be read named with its flag (`--control-net`).
fn describe_model(
    files: &ModelFiles,
    model: &ModelArgs,
    wtype: Option<sd_backends::GgmlType>,
) -> Result<sd_placement::ModelDescription> {
    let extra = model.extra();
    for x in &extra {
        sd_models::files::open::open_regular(&x.path).with_context(|| x.flag.clone())?;
    }
    Ok(describe(files, &extra, wtype)?)
}

/// Options of `plan`: a generation's flags (a generation's command line with `plan` in front
/// plans that generation; the flags a plan does not use are accepted and ignored), and the
/// plan's own.
#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub generation: crate::generate::GenerateArgs,
    /// Plan for the devices of a TOML profile instead of this machine's.
    #[arg(long = "devices", value_name = "PROFILE.toml")]
    pub devices: Option<PathBuf>,
    /// Available RAM in MiB (overrides the machine's or the profile's figure).
    #[arg(long = "ram-mib", value_name = "N", allow_negative_numbers = true, value_parser = ram_mib)]
    pub ram_mib: Option<u64>,
    /// [sd-rs] Plan a named model instead of files: `sd15`, `sdxl`, `flux-dev`, `zimage-turbo`, `sd35-large` or `flux2-klein-4b`, at `:f16`,
    /// `:q8_0` or `:q4_K` (else --type's, else f16): sd-placement's sizes measured from the
    /// released files' layouts. Compute buffers get the fixed reserves.
    #[arg(long = "preset", value_name = "NAME[:TYPE]")]
    pub preset: Option<String>,
    /// Print the plan as JSON (its `schema_version` first).
    #[arg(long = "json")]
    pub json: bool,
    /// [sd-rs] Also predict the plan's seconds per step and per module (and the auto-fit
    /// ladder's, and the fastest alternatives) for an image of -W x -H in --steps steps, from the
    /// devices' figures (`sd-cli calibrate`, a profile's `[device.cost]`, else nominal).
    #[arg(long = "explain")]
    pub explain: bool,
}

/// What a plan takes from a generation's flags: the image size (-W/-H, else the init image's,
/// else 512), the steps, the prompt (its LoRA tags), resolved as the generation resolves them.
struct Planned {
    width: usize,
    height: usize,
    steps: usize,
    prompt: String,
}

impl PlanArgs {
    fn planned(&self) -> Result<Planned> {
        let g = &self.generation;
        if !(1..=MAX_STEPS).contains(&g.steps) {
            anyhow::bail!("--steps {}: a plan is made for 1 to {MAX_STEPS} steps", g.steps);
        }
        // A mode that does not run has no plan either (`-M vid_gen` is refused as generation
        // refuses it).
        g.run.check_mode()?;
        let (width, height, _) = crate::inputs::resolve_size(g.width, g.height, g.init_img.as_deref())?;
        let (prompt, _) = g.run.prompts(&g.prompt, &g.negative_prompt)?;
        Ok(Planned { width, height, steps: g.steps, prompt })
    }
}

/// Most sampling steps a plan predicts for.
const MAX_STEPS: usize = 100_000;

/// `--ram-mib`: a whole number of MiB whose bytes fit in 64 bits.
fn ram_mib(s: &str) -> std::result::Result<u64, String> {
    let m: u64 = crate::generate::whole(s)?;
    if m > u64::MAX / MIB {
        return Err(format!("{m} MiB is more bytes than 64 bits count (at most {} MiB)", u64::MAX / MIB));
    }
    Ok(m)
}

/// Largest device profile read (real ones are a few hundred bytes).
const MAX_PROFILE_BYTES: u64 = 1 << 20;

/// MemAvailable from /proc/meminfo, in bytes.
pub(crate) fn ram_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The planner's view of a registry's devices.
pub fn machine_devices_from(reg: &sd_backends::PluginRegistry) -> Vec<Device> {
    reg.device_infos()
        .into_iter()
        .filter_map(|i| {
            let kind = match i.kind {
                sd_backends::DeviceKind::Cpu => DeviceType::Cpu,
                sd_backends::DeviceKind::Gpu => DeviceType::Gpu,
                sd_backends::DeviceKind::Igpu => DeviceType::Igpu,
                sd_backends::DeviceKind::Accel => DeviceType::Accel,
                sd_backends::DeviceKind::Meta => return None,
            };
            let mem = |v: u64| (v > 0 || i.memory_total > 0).then_some(v);
            // ggml's registry name for RPC devices is RPC[host:port]; they all share
            // the RPC registry for split purposes.
            let registry = i.registry.split('[').next().unwrap_or_default().to_string();
            Some(Device::new(i.name, kind).with_memory(mem(i.memory_free), mem(i.memory_total)).with_registry(registry))
        })
        .collect()
}

/// Measures (or reads from a cache) the speeds of the named devices for a model.
pub(crate) type SpeedProbe<'a> =
    dyn Fn(&sd_placement::ModelDescription, &[String]) -> Result<std::collections::BTreeMap<String, f64>> + 'a;

/// The placement plan of a generation of `size` images on this machine's `devices`, its
/// warnings logged; each module's compute reserve is estimated from the model and the size
/// (`sd_models::describe::compute_estimates`). With
/// `--split-by speed`, `speeds` measures (or reads from its cache) the speeds of the devices
/// the plan's layer splits use (a plan by memory first says which), for the model described.
/// Auto-fit chooses by predicted time for images of `size` (width, height, steps) when every
/// device has measured figures (`descriptions`: each device's, their key); `flash_attn` is
/// `--diffusion-fa`; `wtype` is `--type` (the weights' bytes as loaded). Returns the plan and its
/// prediction.
pub fn plan_for(
    model: &ModelArgs,
    files: &ModelFiles,
    placement: &PlacementArgs,
    devices: Vec<Device>,
    speeds: &SpeedProbe<'_>,
    (descriptions, run, flash_attn): (&std::collections::BTreeMap<String, String>, crate::cost::RunShape, bool),
    wtype: Option<sd_backends::GgmlType>,
) -> Result<(Plan, sd_placement::Prediction)> {
    let flags = placement.flags();
    let mut description = describe_model(files, model, wtype)?;
    description.compute_bytes = sd_models::describe::compute_estimates(files, run.width, run.height, flash_attn);
    let by_speed = sd_placement::parse_split_by(flags.split_by.as_deref())? == sd_placement::SplitBy::Speed;
    let mut request = PlanRequest {
        flags,
        devices,
        ram_available_bytes: ram_available(),
        model: description,
        device_speeds: Default::default(),
    };
    if by_speed {
        // Without speeds the planner sizes by memory: which devices that plan splits over is
        // what needs measuring (a device no split uses is not probed).
        let split_devices: std::collections::BTreeSet<String> =
            plan(&request)?.modules.iter().flat_map(|m| m.split.iter().map(|r| r.device.clone())).collect();
        let names: Vec<String> = split_devices.into_iter().collect();
        if !names.is_empty() {
            request.device_speeds = speeds(&request.model, &names)?;
        }
    }
    let (figures, measured) = crate::cost::figures(&request.devices, descriptions, None, &request.device_speeds);
    let work = crate::cost::workload(files, run);
    let (plan, predicted) = if measured {
        let (p, e) = crate::cost::choose(&request, &work, &figures, true)?;
        (p, e.chosen)
    } else {
        let p = plan(&request)?;
        let predicted = sd_placement::predict(&p, &work, &figures);
        (p, predicted)
    };
    for w in &plan.warnings {
        tracing::warn!("{w}");
    }
    if plan.auto_fit {
        tracing::info!("auto-fit: --backend \"{}\" --params-backend \"{}\"", plan.backend, plan.params_backend);
        if let Some(c) = &plan.choice {
            tracing::info!("{c}");
        }
    }
    tracing::debug!("{}", predicted.render("predicted"));
    Ok((plan, predicted))
}

/// The LoRA files the prompt's tags name, read and checked against the model: with
/// `--lora-apply-mode at_runtime` their adapter tensors join the modules they adapt in `model`
/// (so the plan counts their bytes); the lines to print say what each mode costs.
fn lora_bytes(
    lora: &crate::generate::LoraArgs,
    prompt: &str,
    files: &ModelFiles,
    model: &mut sd_placement::ModelDescription,
) -> Result<Vec<String>> {
    use sd_models::lora::ApplyMode;
    let (_, loras) = lora.extract(prompt)?;
    if loras.is_empty() {
        return Ok(Vec::new());
    }
    let file_bytes: u64 = loras.iter().filter_map(|l| std::fs::metadata(&l.path).ok()).map(|m| m.len()).sum();
    let set = sd_models::pipeline::lora_set_for(files, &loras, None)?;
    let mib = |b: u64| b as f64 / MIB as f64;
    let mode = lora.lora_apply_mode;
    let mut lines = vec![format!(
        "LoRA: {} files, {:.1} MiB read into RAM, {} weights adapted (--lora-apply-mode {})",
        loras.len(),
        mib(file_bytes),
        set.targets(),
        mode.name()
    )];
    let mut scratch = model.clone();
    let target = if mode == ApplyMode::AtRuntime { model } else { &mut scratch };
    let per = sd_models::describe::add_runtime_loras(target, files, &set);
    let list = per.iter().map(|(m, b)| format!("{} {:.2} MiB", m.name(), mib(*b))).collect::<Vec<_>>().join(", ");
    lines.push(match mode {
        ApplyMode::AtRuntime => format!("LoRA at_runtime: adapter tensors with the modules' weights, counted in the plan: {list}"),
        ApplyMode::Immediately => "LoRA immediately: merged into the weights as they load (no extra device memory)".into(),
        ApplyMode::Auto => format!(
            "LoRA auto: merged where a module's weights are f16/f32 on its computing device; at_runtime (adding {list}) where they are quantized, off the device or row-split"
        ),
    });
    Ok(lines)
}

/// `--preset NAME[:TYPE]`: the preset's description, refused beside model files, LoRA tags
/// and `--explain` (which need the files).
fn preset(
    arg: &str,
    sources: &sd_models::files::ModelSources,
    args: &PlanArgs,
    prompt: &str,
    wtype: Option<sd_backends::GgmlType>,
) -> Result<sd_placement::ModelDescription> {
    use sd_placement::presets;
    if *sources != sd_models::files::ModelSources::default() {
        anyhow::bail!(
            "--preset {arg}: plans a named model without files; drop the model file flags (-m, --diffusion-model, ...)"
        );
    }
    if args.explain {
        anyhow::bail!("--preset {arg}: --explain needs the model's files (its workload comes from them)");
    }
    if prompt.contains("<lora:") {
        anyhow::bail!("--preset {arg}: a preset has no files to check the prompt's <lora:...> tags against");
    }
    let (name, wtype) = match arg.split_once(':') {
        Some((n, t)) => (n, t.to_string()),
        None => (arg, wtype.map_or_else(|| "f16".to_string(), sd_backends::type_name)),
    };
    match presets::find(name, &wtype) {
        Some(p) => Ok(p.description()),
        None => anyhow::bail!("--preset {arg}: no preset '{name}' at type '{wtype}'; presets: {}", presets::names()),
    }
}

/// Runs `plan`.
pub fn run(args: &PlanArgs, dev_args: &DeviceArgs) -> Result<ExitCode> {
    let (devices, profile_ram, device_speeds, profile, descriptions) = match &args.devices {
        Some(p) => {
            let text = sd_models::files::open::read_text(p, MAX_PROFILE_BYTES).context("--devices")?;
            let prof =
                DeviceProfile::from_toml_str(&text).with_context(|| format!("device profile {}", p.display()))?;
            (prof.devices(), prof.ram_available_bytes(), prof.device_speeds(), Some(prof), Default::default())
        }
        None => {
            let reg = crate::devices::open(dev_args)?;
            (machine_devices_from(&reg), ram_available(), Default::default(), None, crate::cost::descriptions(&reg))
        }
    };
    let ram = args.ram_mib.map(|m| m * MIB).or(profile_ram);
    let g = &args.generation;
    let want = args.planned()?;
    let sources = g.model.sources();
    let (files, mut model) = match &args.preset {
        Some(name) => {
            if let Some(x) = g.model.extra().first() {
                anyhow::bail!("--preset {name}: plans a named model without files; drop {}", x.flag);
            }
            (None, preset(name, &sources, args, &want.prompt, g.wtype.map(|t| t.0))?)
        }
        None => {
            let files = ModelFiles::open(&sources)?;
            let mut model = describe_model(&files, &g.model, g.wtype.map(|t| t.0))?;
            // A model a family runs but cannot load (tensors missing or misshapen), or of an
            // unknown architecture, has no plan: refused as a generation refuses it.
            sd_models::family::check_runnable(&files)?;
            model.compute_bytes =
                sd_models::describe::compute_estimates(&files, want.width, want.height, g.diffusion_fa);
            (Some(files), model)
        }
    };
    let lora_lines = match &files {
        Some(files) => lora_bytes(&g.lora, &want.prompt, files, &mut model)?,
        None => Vec::new(),
    };
    // A profile's speeds; else `plan` runs nothing: speeds measured by an earlier generation
    // (at this size), if cached.
    let device_speeds = match args.devices {
        Some(_) => device_speeds,
        None => sd_models::speed::cached_speeds(
            &sd_models::speed::model_key(&model),
            sd_models::speed::latent_tokens(want.width, want.height),
            &sd_models::speed::cache_path(),
        ),
    };
    let upscaler_line = match &g.upscale.upscale_model {
        Some(path) => Some(crate::upscale::plan_line(path, &g.placement, &devices)?),
        None => None,
    };
    let request = PlanRequest { flags: g.placement.flags(), devices, ram_available_bytes: ram, model, device_speeds };
    let report_to = crate::output::report_target(g.report_json.as_deref())?;
    if let Some(t) = &report_to {
        let (_, loras) = g.lora.extract(&want.prompt)?;
        let files = g.model.run_files().input(InputRole::DeviceProfile, args.devices.as_deref()).loras(&loras);
        files.output(OutputRole::Report, t).check().map_err(crate::errors::same_file)?;
    }
    let (figures, measured) =
        crate::cost::figures(&request.devices, &descriptions, profile.as_ref(), &request.device_speeds);
    let (p, explain) = if let (Some(files), true) = (&files, measured || args.explain) {
        let run =
            crate::cost::RunShape { width: want.width, height: want.height, steps: want.steps, cfg_scale: g.cfg_scale };
        let work = crate::cost::workload(files, run);
        let (p, e) = crate::cost::choose(&request, &work, &figures, measured)?;
        (p, Some(e))
    } else {
        (plan(&request)?, None)
    };
    let mut report = sd_models::report::RunReport::new("plan", crate::output::command_line());
    report.plan = Some(p.clone());
    crate::output::write_report(report_to.as_ref(), &report)?;
    let explain = explain.filter(|_| args.explain);
    if args.json {
        match &explain {
            Some(e) => {
                crate::out!("{}", serde_json::to_string_pretty(&serde_json::json!({ "plan": p, "explain": e }))?)
            }
            None => crate::out!("{}", p.to_json()),
        }
    } else {
        crate::out!("{}", p.render());
        if let Some(e) = &explain {
            crate::out!("{}", e.render());
        }
        if files.as_ref().is_some_and(sd_models::family::is_inpainting) {
            crate::out!(
                "model: inpainting (the UNet takes the latent, a mask and the masked image's latent: -i, --mask)"
            );
        }
        for line in lora_lines.iter().chain(&upscaler_line) {
            crate::out!("{line}");
        }
    }
    Ok(if p.fits { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
