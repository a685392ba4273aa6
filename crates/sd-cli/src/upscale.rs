//! ESRGAN upscaling flags: `--upscale-model`, `--upscale-repeats`, `--upscale-tile-size`, and `-M upscale` for an existing image.
//!
//! As the reference's CLI: with a generation, each image is upscaled after it is decoded and
//! the upscaled image is saved; with `-M upscale`, the `-i` image is upscaled and saved to
//! `-o`. The upscaler runs on the device `--backend upscaler=DEVICE` names (aliases
//! `esrgan`, `hires`), else on the default device. The work is `sd_models::upscale`'s; this
//! file parses flags, checks inputs before the first expensive stage, and picks the device.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use clap::Args;
use sd_backends::{Backend, BackendManager, PluginRegistry};
use sd_models::output::{ImageOutput, InputRole, OutputRole};
use sd_models::pipeline::Image;
use sd_models::upscale::{Upscaler, UpscalerFile};
use sd_placement::{Flag, Module, RuntimeValue};

use crate::generate::GenerateArgs;
use crate::plan::PlacementArgs;
use crate::DeviceArgs;

/// Most passes `--upscale-repeats` takes (the image size limit usually stops earlier).
const MAX_REPEATS: usize = 16;

/// The upscaling flags of stable-diffusion.cpp's sd-cli.
#[derive(Args, Debug, Clone)]
pub struct UpscaleArgs {
    /// ESRGAN model (RealESRGAN x4plus, the anime 6B variant, x2; safetensors or GGUF) to
    /// upscale each generated image with, or the -i image with -M upscale.
    #[arg(long = "upscale-model", value_name = "PATH")]
    pub upscale_model: Option<PathBuf>,
    /// Upscaling passes, each feeding the last one's output (1 to 16; default 1).
    #[arg(long = "upscale-repeats", value_name = "N", default_value_t = 1, allow_negative_numbers = true, value_parser = repeats)]
    pub upscale_repeats: usize,
    /// Tile size of the upscaler in input pixels (default 128; 0: the whole image as one
    /// tile; otherwise at least 16).
    #[arg(long = "upscale-tile-size", value_name = "N", default_value_t = sd_models::upscale::DEFAULT_TILE, allow_negative_numbers = true, value_parser = tile_size)]
    pub upscale_tile_size: usize,
}

fn repeats(s: &str) -> std::result::Result<usize, String> {
    let v: usize = crate::generate::whole(s)?;
    if !(1..=MAX_REPEATS).contains(&v) {
        return Err(format!("{v} passes: from 1 to {MAX_REPEATS}"));
    }
    Ok(v)
}

fn tile_size(s: &str) -> std::result::Result<usize, String> {
    let v: usize = crate::generate::whole(s)?;
    if v != 0 && !(16..=8192).contains(&v) {
        return Err(format!("{v} pixels: 0 (no tiling) or from 16 to 8192"));
    }
    Ok(v)
}

/// A checked upscaler: the file and the device it will run on (nothing loaded yet).
pub struct Planned {
    file: UpscalerFile,
    backend: Arc<Backend>,
    budget: Option<u64>,
    tile: usize,
    repeats: usize,
    /// The devices of `-M upscale` (a generation's upscaler shares the pipeline's).
    _devices: Option<(PluginRegistry, BackendManager)>,
}

/// The device `--backend upscaler=DEVICE` (aliases `esrgan`, `hires`) names among `devices`,
/// else the default device (a GPU, else the CPU). `--params-backend` for it is refused: its
/// parameters live on its device.
fn upscaler_device(placement: &PlacementArgs, devices: &[sd_placement::Device]) -> Result<usize> {
    if let Some(spec) = placement.params_backend.as_deref() {
        let assigned = sd_placement::parse_params_backend(spec)?;
        if let Some(e) = assigned.modules.get(&Module::Upscaler) {
            bail!("--params-backend {}: the upscaler keeps its parameters on its device (not implemented)", e.entry);
        }
    }
    let assigned = placement.backend.as_deref().map(sd_placement::parse_backend).transpose()?;
    Ok(match assigned.as_ref().and_then(|s| s.get(Module::Upscaler)) {
        Some(e) => match &e.value {
            RuntimeValue::Device(token) => sd_placement::resolve_device(devices, token, Flag::Backend, &e.entry)?,
            RuntimeValue::List(_) => bail!("--backend {}: the upscaler runs on one device", e.entry),
        },
        None => sd_placement::default_device(devices).context("no device to run the upscaler on")?,
    })
}

/// The plan's line for `--upscale-model` (`sd-cli plan`): the model, its device and its
/// parameter bytes, from the file's header.
pub fn plan_line(path: &Path, placement: &PlacementArgs, devices: &[sd_placement::Device]) -> Result<String> {
    let file = UpscalerFile::open(path).context("--upscale-model")?;
    let device = &devices[upscaler_device(placement, devices)?];
    Ok(format!(
        "upscaler: {} on {}, {} of parameters (--upscale-model {})",
        file.config().describe(),
        device.name,
        sd_placement::fmt_bytes(file.param_bytes()),
        path.display()
    ))
}

/// The upscaler's budget on `device` from `--max-vram` (its entry for the device, else the
/// default): positive GiB, or negative: the device's free memory less that many GiB; 0 or
/// none: no budget.
fn budget_of(spec: Option<&str>, device: &sd_placement::Device) -> Result<Option<u64>> {
    let Some(spec) = spec else { return Ok(None) };
    let m = sd_placement::parse_max_vram(spec)?;
    let own = m.devices.iter().find(|e| e.value.0.eq_ignore_ascii_case(&device.name)).map(|e| e.value.1);
    let gib = match own.or(m.default) {
        Some(g) => g,
        None => return Ok(None),
    };
    const GIB: f64 = (1u64 << 30) as f64;
    Ok(if gib > 0.0 {
        Some((gib * GIB) as u64)
    } else if gib < 0.0 {
        device.free_bytes.map(|free| free.saturating_sub((-gib * GIB) as u64))
    } else {
        None
    })
}

impl UpscaleArgs {
    /// Opens and checks `--upscale-model` for images of `size` and resolves its device among
    /// `reg`'s, its backend from `manager` (a generation's, so that the upscaler shares the
    /// pipeline's backends and RPC connections); `None` without `--upscale-model`.
    pub fn plan(
        &self,
        a: &GenerateArgs,
        (reg, manager): (&PluginRegistry, &BackendManager),
        size: (usize, usize),
    ) -> Result<Option<Planned>> {
        let Some(path) = &self.upscale_model else { return Ok(None) };
        let file = UpscalerFile::open(path).context("--upscale-model")?;
        file.check_passes(size.0, size.1, self.upscale_repeats).context("--upscale-repeats")?;
        let devices = crate::plan::machine_devices_from(reg);
        let device = &devices[upscaler_device(&a.placement, &devices)?];
        let budget = budget_of(a.placement.max_vram.as_deref(), device)?;
        let name = device.registry_name();
        let backend = manager.get(reg.device(&name)?)?;
        let c = file.config();
        tracing::info!("upscaler: {} on {name} ({} MiB of parameters)", c.describe(), file.param_bytes() >> 20);
        let (tile, repeats) = (self.upscale_tile_size, self.upscale_repeats);
        Ok(Some(Planned { file, backend, budget, tile, repeats, _devices: None }))
    }
}

/// The hires fix's upscaler model `file` (opened and checked for images of `size`), loaded on
/// the upscaler's device (as `--upscale-model`'s), its tile `tile`.
pub(crate) fn load_hires_model(
    a: &GenerateArgs,
    (reg, manager): (&PluginRegistry, &BackendManager),
    file: UpscalerFile,
    size: (usize, usize),
    tile: usize,
) -> Result<Upscaler> {
    file.check_passes(size.0, size.1, 1).context("--hires-upscaler")?;
    let devices = crate::plan::machine_devices_from(reg);
    let device = &devices[upscaler_device(&a.placement, &devices)?];
    let budget = budget_of(a.placement.max_vram.as_deref(), device)?;
    let name = device.registry_name();
    let backend = manager.get(reg.device(&name)?)?;
    tracing::info!("hires upscaler: {} on {name}", file.config().describe());
    Ok(file.load_with_budget(backend, budget).context("--hires-upscaler")?.with_tile(tile))
}

impl Planned {
    /// Loads the weights and upscales each image.
    pub fn run(self, images: Vec<Image>, report: &mut sd_models::report::RunReport) -> Result<Vec<Image>> {
        let t = std::time::Instant::now();
        let mut up: Upscaler = self.file.load_with_budget(self.backend, self.budget)?.with_tile(self.tile);
        report.stage("upscaler load", t.elapsed().as_secs_f64());
        images.iter().map(|img| Ok(up.upscale(img, self.repeats, report)?)).collect()
    }
}

/// `-M upscale`: upscales the `-i` image into `-o`.
pub fn run_mode(a: &GenerateArgs, dev: &DeviceArgs) -> Result<ExitCode> {
    let (planned, image, outputs, report_to) = validate(a, dev).map_err(crate::errors::bad_input)?;
    let mut report = sd_models::report::RunReport::new("upscale", crate::output::command_line());
    let start = std::time::Instant::now();
    let images = planned.run(vec![image], &mut report).inspect_err(|_| {
        let _ = crate::output::write_report(report_to.as_ref(), &report);
    })?;
    let t = std::time::Instant::now();
    crate::output::save_images(&images, &outputs, |_| None)?;
    report.stage("write", t.elapsed().as_secs_f64());
    crate::output::write_report(report_to.as_ref(), &report)?;
    tracing::info!("upscale took {:.2} s", start.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}

type Validated = (Planned, Image, Vec<ImageOutput>, Option<sd_models::output::OutputTarget>);

fn validate(a: &GenerateArgs, dev: &DeviceArgs) -> Result<Validated> {
    let u = &a.upscale;
    if u.upscale_model.is_none() {
        bail!("-M upscale: no --upscale-model (the ESRGAN model to upscale the -i image with)");
    }
    let Some(input) = &a.init_img else { bail!("-M upscale: no -i (the image to upscale)") };
    let outputs = ImageOutput::plan(&a.output, 1, a.run.output_begin_idx, a.overwrite).context("-o")?;
    let report_to = crate::output::report_target(a.report_json.as_deref())?;
    let files = sd_models::output::RunFiles::default()
        .input(InputRole::InitImage, Some(input))
        .input(InputRole::UpscaleModel, u.upscale_model.as_deref());
    let files = outputs.iter().fold(files, |f, o| f.output(OutputRole::Image, &o.target));
    let files = report_to.iter().fold(files, |f, t| f.output(OutputRole::Report, t));
    files.check().map_err(crate::errors::same_file)?;
    let image = sd_models::image_io::read_image(input).context("-i")?;
    let reg = crate::devices::open(dev)?;
    let manager = BackendManager::new(Some(sd_backends::threads::resolve_threads(a.threads)));
    let mut planned =
        u.plan(a, (&reg, &manager), (image.width, image.height))?.expect("--upscale-model was checked above");
    planned._devices = Some((reg, manager));
    Ok((planned, image, outputs, report_to))
}
