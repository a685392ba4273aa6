//! Text-to-image and image-to-image generation, end to end, for any registered model family
//! (`crate::family`: SD 1.x / 2.x today); nothing here names a family.
//!
//! The order of operations, and every place randomness enters, follows
//! stable-diffusion.cpp so that the same seed gives the same image:
//! 1. encode the prompt (and the negative prompt when guidance is on);
//! 2. for img2img, encode the init image with the VAE and sample the latent
//!    with noise from the generator seeded with `seed` (before the per-image
//!    reseed), then scale it into diffusion space;
//! 3. for each image `b` of the batch: reseed the generator with `seed + b`,
//!    draw the initial noise for the whole latent (`[C, H, W]` order), run the
//!    sampler (which continues the same generator for ancestral noise);
//! 4. decode every latent with the VAE (or TAESD), map `[-1, 1]` to 8-bit.
//!
//! Memory: each module's weights are loaded for its phase and released after
//! it (text encoder after encoding, UNet after sampling), so the peak is the
//! largest phase rather than the sum; a server keeps them between generations instead
//! ([`Pipeline::generate_keeping`], `pipeline/kept.rs`).

use std::sync::Arc;
use std::time::Instant;

use sd_backends::{Backend, GgmlType};
use sd_sched::{Ledgers, MappedBytes, ParamHome, Runner, SourceError, TensorSource, TensorSpec, Weights};
use sd_vae::{AutoencoderKl, FirstStage, Taesd, TilingParams, VaeParts};

use crate::diffusion::controlnet::{ControlNetModel, ControlResiduals};
use crate::family::{block_group, DiffusionModel, DiffusionSettings, Family, TextEncoder, TextRequest};
use crate::files::{ModelFiles, ModelSources, PredictionSource};
use crate::health;
use crate::loader::{dtype_of, FileSource};
use crate::placement::LayerSplit;
use crate::report::{DeviceReport, ModuleReport, RunReport, RunnerReport, Settings, StepTime};
use crate::sampling::{
    img2img_sigmas, noised_latent, sample, sample_flow, txt2img_latent, Denoised, GuidedDenoiser, ModelInput,
    ModelOutput, NoiseSchedule, Prediction, RngKind, SampleMethod, Schedule, ScheduleContext, Scheduler,
};
use crate::text::conditioning::Conditioning;

mod control;
mod inpaint;
mod kept;
pub use kept::KeptWeights;

/// Errors of a generation, each naming the stage and what failed.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Model files.
    #[error(transparent)]
    Files(#[from] crate::files::FilesError),
    /// A setting that cannot work.
    #[error("{0}")]
    Invalid(String),
    /// A setting of the request that cannot work, by the name this library gives it (a front
    /// end names its own flag: [`Setting`]).
    #[error("{} {value}: {problem}", setting.name())]
    Setting {
        /// Which setting.
        setting: Setting,
        /// Its value as given.
        value: String,
        /// What is wrong with it.
        problem: String,
    },
    /// One stage's working memory at the requested size exceeds a device.
    #[error(
        "{stage} alone needs about {} at {width}x{height}, more than {device} has ({}); use a smaller size{}",
        fmt_gib(*need),
        fmt_gib(*total),
        if *flash_attn { "" } else { ", flash attention or VAE tiling" }
    )]
    WorkingMemory {
        /// Image width.
        width: usize,
        /// Image height.
        height: usize,
        /// The stage.
        stage: &'static str,
        /// Bytes it needs at least.
        need: f64,
        /// The device.
        device: String,
        /// The device's total bytes.
        total: f64,
        /// Whether flash attention is already on.
        flash_attn: bool,
    },
    /// Tensors a module loads are not in the model files.
    #[error("{module}: {missing} of its {total} tensors are missing from {files} (first: {first})")]
    MissingTensors {
        /// `text encoder`, `diffusion model`, `VAE` or `TAESD`.
        module: &'static str,
        /// How many are missing.
        missing: usize,
        /// How many the module has.
        total: usize,
        /// The files searched.
        files: String,
        /// The first missing names.
        first: String,
    },
    /// The first stage's weights cannot be read (checked before sampling).
    #[error("{module}")]
    FirstStage {
        /// `VAE` or `TAESD`.
        module: &'static str,
        /// The tensor and why.
        #[source]
        source: SourceError,
    },
    /// Loading or running the text encoder.
    #[error("text encoder")]
    Text(#[from] crate::text::clip::ClipError),
    /// Loading or running a family's own conditioner (`what` names it: "FLUX text encoders").
    #[error("{what}")]
    Conditioner {
        /// The conditioner.
        what: &'static str,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A ControlNet file, or running the ControlNet.
    #[error(transparent)]
    ControlNet(#[from] crate::controlnet::ControlNetError),
    /// Loading or running the UNet.
    #[error("diffusion model")]
    Diffusion(#[from] crate::diffusion::DiffusionError),
    /// Loading or running the VAE.
    #[error("VAE")]
    Vae(#[from] sd_vae::VaeError),
    /// Sampling.
    #[error("sampling")]
    Sampling(#[from] crate::sampling::SamplingError),
    /// Weights or execution.
    #[error(transparent)]
    Sched(#[from] sd_sched::SchedError),
    /// LoRA adapters.
    #[error(transparent)]
    Lora(#[from] crate::lora::LoraError),
    /// The run was cancelled through [`Pipeline::with_cancel`]'s flag (between two steps or
    /// stages; nothing after the cancelled stage ran).
    #[error("cancelled")]
    Cancelled,
    /// A file given in one role holds the component of another, as its tensors' shapes show
    /// (SDXL's CLIP-L given where its OpenCLIP bigG goes). Front ends name the two roles'
    /// options.
    #[error("'{}' {problem}", path.display())]
    MisplacedFile {
        /// The file.
        path: std::path::PathBuf,
        /// The role it was given in.
        given: crate::files::FileRole,
        /// The role its tensors belong to.
        found: crate::files::FileRole,
        /// What its tensors show.
        problem: String,
    },
    /// A component the family cannot run without is in none of the files.
    #[error("{family} needs {what}")]
    MissingComponent {
        /// The family ("FLUX.1").
        family: &'static str,
        /// The role of the file that brings it.
        role: crate::files::FileRole,
        /// The component and how its absence was seen.
        what: String,
    },
    /// A tiny autoencoder was given to a family that has none.
    #[error("the {family} family has no tiny autoencoder (TAESD) yet")]
    NoTaesd {
        /// The family's architecture name.
        family: &'static str,
    },
}

/// Something about the loaded model a user should know, found while loading; front ends word
/// it with their own option names ([`Pipeline::notices`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The files do not say whether the model predicts eps or v: eps is assumed.
    PredictionAssumed,
    /// An optional component is missing, and what that does.
    MissingOptional {
        /// The role of the file that would bring it.
        role: crate::files::FileRole,
        /// The component.
        what: &'static str,
        /// What its absence does.
        effect: &'static str,
    },
}

impl std::fmt::Display for Notice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Notice::PredictionAssumed => {
                write!(f, "the model files do not say whether the model predicts eps or v; assuming eps")
            }
            Notice::MissingOptional { what, effect, .. } => write!(f, "no {what}: {effect}"),
        }
    }
}

/// A setting of [`GenerateParams`], for errors: front ends map it to their own flag names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// [`GenerateParams::width`].
    Width,
    /// [`GenerateParams::height`].
    Height,
    /// [`GenerateParams::steps`].
    Steps,
    /// [`GenerateParams::batch_count`].
    BatchCount,
    /// [`GenerateParams::cfg_scale`].
    CfgScale,
    /// [`GenerateParams::guidance`].
    Guidance,
    /// [`GenerateParams::eta`].
    Eta,
    /// [`GenerateParams::strength`].
    Strength,
    /// [`GenerateParams::mask`].
    Mask,
    /// [`GenerateParams::flow_shift`].
    FlowShift,
    /// [`GenerateParams::prompt`].
    Prompt,
    /// [`GenerateParams::negative_prompt`].
    NegativePrompt,
    /// [`GenerateParams::control_strength`].
    ControlStrength,
    /// [`HiresParams::scale`](crate::hires::HiresParams::scale).
    HiresScale,
    /// [`HiresParams::width`](crate::hires::HiresParams::width) and `height`.
    HiresSize,
    /// [`HiresParams::denoising_strength`](crate::hires::HiresParams::denoising_strength).
    HiresDenoisingStrength,
    /// [`GenerateParams::hires`] beside another setting it cannot run with.
    Hires,
}

impl Setting {
    /// The setting's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Setting::Width => "width",
            Setting::Height => "height",
            Setting::Steps => "steps",
            Setting::BatchCount => "batch count",
            Setting::CfgScale => "cfg scale",
            Setting::Guidance => "guidance",
            Setting::Eta => "eta",
            Setting::Strength => "strength",
            Setting::Mask => "mask",
            Setting::FlowShift => "flow shift",
            Setting::Prompt => "prompt",
            Setting::NegativePrompt => "negative prompt",
            Setting::ControlStrength => "control strength",
            Setting::HiresScale => "hires scale",
            Setting::HiresSize => "hires size",
            Setting::HiresDenoisingStrength => "hires denoising strength",
            Setting::Hires => "hires fix",
        }
    }
}

/// A [`PipelineError::Setting`].
fn bad_setting<T>(setting: Setting, value: impl std::fmt::Display, problem: impl Into<String>) -> Result<T> {
    Err(PipelineError::Setting { setting, value: value.to_string(), problem: problem.into() })
}

/// The VAE's downscaling factor (8 for every SD 1.x / 2.x autoencoder and TAESD).
const VAE_SCALE: usize = 8;

/// Most sampling steps accepted (far beyond any useful schedule).
const MAX_STEPS: usize = 10_000;

/// What text-encoder hidden states and UNet outputs should look like.
const ACTIVATIONS: health::Expect = health::Expect::Activations { limit: health::F16_OVERFLOW };

fn fmt_gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / (1u64 << 30) as f64)
}

/// Result alias.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

/// The device (backend) each module computes on: the main one, and the layer split of a
/// module that has one.
#[derive(Clone, Debug)]
pub struct ModuleDevices {
    /// Text encoder.
    pub te: Arc<Backend>,
    /// UNet.
    pub diffusion: Arc<Backend>,
    /// VAE / TAESD.
    pub vae: Arc<Backend>,
    /// The text encoder's layer split (its main device is `te`).
    pub te_split: Option<LayerSplit>,
    /// The UNet's layer split (its main device is `diffusion`).
    pub diffusion_split: Option<LayerSplit>,
    /// ControlNet.
    pub controlnet: Arc<Backend>,
}

/// How to load the model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The files.
    pub sources: ModelSources,
    /// `--prediction`.
    pub prediction: Option<Prediction>,
    /// `--type`: store weights in this type.
    pub wtype: Option<GgmlType>,
    /// Where each module runs.
    pub devices: ModuleDevices,
    /// `--diffusion-fa`.
    pub flash_attn: bool,
    /// Where parameters live, device budgets, segmented-execution flags.
    pub placement: Placement,
    /// `--model-args`: the family's options as `(key, value)`, as the reference names them
    /// (`chroma_use_dit_mask`); a key the family does not take is an error.
    pub model_args: Vec<(String, String)>,
    /// A ControlNet file (`crate::controlnet`), checked against the model when the pipeline is
    /// built.
    pub control_net: Option<std::path::PathBuf>,
}

/// Where each module's parameters live (`--params-backend`).
#[derive(Clone, Debug)]
pub struct ModuleHomes {
    /// Text encoder.
    pub te: ParamHome,
    /// UNet.
    pub diffusion: ParamHome,
    /// VAE / TAESD.
    pub vae: ParamHome,
    /// ControlNet.
    pub controlnet: ParamHome,
}

impl Default for ModuleHomes {
    fn default() -> Self {
        Self {
            te: ParamHome::Compute,
            diffusion: ParamHome::Compute,
            vae: ParamHome::Compute,
            controlnet: ParamHome::Compute,
        }
    }
}

/// Run-time placement: parameter homes, one managed-memory ledger per device (with the
/// `--max-vram` budgets), and the segmented-execution flags.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// Parameter homes.
    pub homes: ModuleHomes,
    /// Device ledgers.
    pub ledgers: Ledgers,
    /// `--disable-prefetch`, `--disable-segmented-compute`.
    pub sched: sd_sched::plan::Options,
    /// `--pipeline-copies`: micro-batches a split module overlaps across its devices (0 and
    /// 1: none).
    pub pipeline_copies: usize,
    /// `--profile`: every runner profiles its graphs by op and block (`sd_sched::profile`).
    pub profile: bool,
    /// `--no-mmap`: weights pinned on the CPU are copied out of the model files into buffers
    /// of their own. By default, those stored in the type the model computes with are used in
    /// place from the files' read-only memory maps ([`Weights::use_in_place`]): no load time
    /// and no second copy, the pages shared with the page cache.
    pub no_mmap: bool,
}

/// The model files as a shared [`TensorSource`], for parameters re-read on demand.
struct SharedFiles(Arc<ModelFiles>);

impl TensorSource for SharedFiles {
    fn load(
        &self,
        name: &str,
        ty: GgmlType,
        ne: &[i64],
    ) -> std::result::Result<std::borrow::Cow<'_, [u8]>, SourceError> {
        FileSource::new(&self.0).load_tensor(name, ty, ne)
    }

    fn release(&self, name: &str) {
        FileSource::new(&self.0).release(name)
    }

    fn mapped(&self, name: &str, ty: GgmlType, ne: &[i64]) -> std::result::Result<Option<MappedBytes>, SourceError> {
        // The maps belong to the `ModelFiles` this source owns a share of.
        FileSource::new(&self.0).mapped_tensor(name, ty, ne)
    }
}

/// One generation request (the reference's flags), as asked. [`GenerateParams::validate`]
/// checks what needs no model; [`Pipeline::check_request`] fills in the model's defaults,
/// checks the rest and gives the [`Request`] that [`Pipeline::generate`] runs.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// `-p`.
    pub prompt: String,
    /// `-n`.
    pub negative_prompt: String,
    /// `-W`, `-H` in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `--steps`.
    pub steps: usize,
    /// `--cfg-scale` (None: the model's default, [`SamplingDefaults::cfg_scale`](crate::family::SamplingDefaults::cfg_scale):
    /// 7 for SD 1.x/2.x and SDXL, 1 for FLUX.1, whose guidance is distilled).
    pub cfg_scale: Option<f32>,
    /// `--guidance`: the distilled guidance scale (FLUX.1 dev; other models ignore it).
    pub guidance: f32,
    /// `--sampling-method` (None: the model's default).
    pub method: Option<SampleMethod>,
    /// `--scheduler` (None: the sampler's default).
    pub scheduler: Option<Scheduler>,
    /// `-s`.
    pub seed: u64,
    /// `-b`.
    pub batch_count: usize,
    /// `--rng`.
    pub rng: RngKind,
    /// `--clip-skip` (<= 0: the model's default).
    pub clip_skip: i64,
    /// `--eta` (None: the sampler's default).
    pub eta: Option<f32>,
    /// img2img: the init image, of any size ([`Pipeline::check_request`] fits it to the
    /// generated size).
    pub init_image: Option<Image>,
    /// img2img: `--strength`, how much to change the init image (0..1).
    pub strength: f32,
    /// Inpainting: `--mask`, a grey image (its first channel is read; `image_io::to_gray` makes
    /// one from a colour image) of any size, fitted like the init image: white where the
    /// image is repainted, black where the init image is kept. `None`: repaint everything (the
    /// reference's all-white mask). Needs [`GenerateParams::init_image`].
    pub mask: Option<Image>,
    /// `--flow-shift`: the time shift of a flow-matching schedule (FLUX.1's `mu`, SD3's
    /// shift) instead of the model's default; models without a flow schedule ignore it.
    pub flow_shift: Option<f32>,
    /// VAE tiling.
    pub tiling: TilingParams,
    /// Cap on one VAE graph's compute buffer (triggers the tiled retry).
    pub vae_max_compute_bytes: Option<usize>,
    /// `--control-image`: the ControlNet's hint, an RGB image of any size (fitted to the
    /// generated size as the reference fits it, nearest). Without a ControlNet it is unused, as
    /// in the reference.
    pub control_image: Option<Image>,
    /// `--control-strength`: the factor of the ControlNet's residuals (the reference's default
    /// 0.9).
    pub control_strength: f32,
    /// `--hires`: the hires fix's second pass (None: one pass). [`Pipeline::check_request`]
    /// resolves its `width` and `height` to the aligned target size.
    pub hires: Option<crate::hires::HiresParams>,
}

/// The longest prompt (and negative prompt) accepted, in bytes. The reference has no limit;
/// a prompt's cost grows with it (one text-encoder pass per 75 tokens, and CLIP's byte-pair
/// merge is quadratic in a word's length: a 1 MiB prompt ran 25 minutes without a word).
/// 16 KiB is several times the longest prompts written by hand (with LoRA tags) and
/// tokenizes in well under a second in the worst case.
const MAX_PROMPT_BYTES: usize = 16 * 1024;

/// The largest magnitude of `--cfg-scale` and `--guidance`, and the largest `--eta`.
const MAX_GUIDANCE: f32 = 100.0;
/// The largest magnitude of `--flow-shift`.
const MAX_FLOW_SHIFT: f32 = 50.0;

impl GenerateParams {
    /// Checks what needs no model: a size, counts, finite numbers. What depends on the model
    /// or on the size it generates at (tiling, memory) is checked by
    /// [`Pipeline::check_request`], which takes the [`ValidParams`] this gives.
    pub fn validate(self) -> Result<ValidParams> {
        for (setting, v) in [(Setting::Width, self.width), (Setting::Height, self.height)] {
            if v == 0 {
                return bad_setting(setting, v, "image sides must be positive");
            }
        }
        if self.steps == 0 {
            return bad_setting(Setting::Steps, 0, "at least one sampling step is needed");
        }
        if self.steps > MAX_STEPS {
            return bad_setting(Setting::Steps, self.steps, format!("at most {MAX_STEPS} steps are accepted"));
        }
        if self.batch_count == 0 {
            return bad_setting(Setting::BatchCount, 0, "the batch count must be at least 1");
        }
        for (setting, text) in [(Setting::Prompt, &self.prompt), (Setting::NegativePrompt, &self.negative_prompt)] {
            if text.len() > MAX_PROMPT_BYTES {
                return bad_setting(
                    setting,
                    format!("({} bytes)", text.len()),
                    format!("a prompt of at most {MAX_PROMPT_BYTES} bytes is accepted"),
                );
            }
            // The weighting syntax, checked before anything is loaded (the encoders parse it again).
            if let Err(e) = crate::text::parse_prompt_attention(text) {
                return bad_setting(setting, "", e.to_string());
            }
        }
        // Scales within what any UI offers (ComfyUI's widgets stop at 100) and far from where
        // the sampler's arithmetic leaves f32: `--cfg-scale 1e30` times a difference of
        // predictions is infinite, and the image black or noise.
        let within = |v: f32, max: f32| v.abs() <= max; // false for NaN
        if let Some(cfg) = self.cfg_scale.filter(|&c| !within(c, MAX_GUIDANCE)) {
            return bad_setting(
                Setting::CfgScale,
                format!("{cfg:?}"),
                format!("must be a finite number from -{MAX_GUIDANCE} to {MAX_GUIDANCE}"),
            );
        }
        if !within(self.guidance, MAX_GUIDANCE) {
            return bad_setting(
                Setting::Guidance,
                format!("{:?}", self.guidance),
                format!("must be a finite number from -{MAX_GUIDANCE} to {MAX_GUIDANCE}"),
            );
        }
        if let Some(eta) = self.eta.filter(|&e| !(within(e, MAX_GUIDANCE) && e >= 0.0)) {
            return bad_setting(
                Setting::Eta,
                format!("{eta:?}"),
                format!("must be a finite number from 0 to {MAX_GUIDANCE}"),
            );
        }
        if !(0.0..=1.0).contains(&self.strength) {
            return bad_setting(Setting::Strength, self.strength, "must be between 0 and 1");
        }
        if let (Some(mask), None) = (&self.mask, &self.init_image) {
            let size = format!("({}x{})", mask.width, mask.height);
            return bad_setting(
                Setting::Mask,
                size,
                "a mask needs an init image (img2img) to keep the unmasked part of",
            );
        }
        if !within(self.control_strength, MAX_GUIDANCE) {
            return bad_setting(
                Setting::ControlStrength,
                format!("{:?}", self.control_strength),
                format!("must be a finite number from -{MAX_GUIDANCE} to {MAX_GUIDANCE}"),
            );
        }
        if let Some(h) = &self.hires {
            if h.width == 0 && h.height == 0 && !(h.scale > 0.0 && h.scale <= crate::hires::MAX_HIRES_SCALE) {
                return bad_setting(
                    Setting::HiresScale,
                    format!("{:?}", h.scale),
                    format!(
                        "must be a number above 0 and at most {} (or give the target's width or height)",
                        crate::hires::MAX_HIRES_SCALE
                    ),
                );
            }
            if !(0.0..=1.0).contains(&h.denoising_strength) {
                return bad_setting(Setting::HiresDenoisingStrength, h.denoising_strength, "must be between 0 and 1");
            }
            if h.steps > MAX_STEPS {
                return bad_setting(Setting::Steps, h.steps, format!("at most {MAX_STEPS} hires steps are accepted"));
            }
            let (tw, th) = h.target_size(self.width, self.height);
            if tw == 0 || th == 0 {
                return bad_setting(Setting::HiresSize, format!("{tw}x{th}"), "the target's sides must be positive");
            }
        }
        // FLUX's schedule takes exp(shift) in f32 (overflows past 88).
        if let Some(shift) = self.flow_shift.filter(|&s| !within(s, MAX_FLOW_SHIFT)) {
            return bad_setting(
                Setting::FlowShift,
                format!("{shift:?}"),
                format!("must be a finite number from -{MAX_FLOW_SHIFT} to {MAX_FLOW_SHIFT}"),
            );
        }
        Ok(ValidParams(self))
    }
}

/// A [`GenerateParams`] that passed [`GenerateParams::validate`].
#[derive(Clone, Debug)]
pub struct ValidParams(GenerateParams);

impl ValidParams {
    /// The parameters.
    pub fn params(&self) -> &GenerateParams {
        &self.0
    }
}

/// A [`GenerateParams`] completed for one model and checked against it by
/// [`Pipeline::check_request`] (the only way to make one): the sampler and scheduler resolved,
/// the size aligned to the model's multiple, the init image fitted to it.
#[derive(Clone, Debug)]
pub struct Request {
    params: GenerateParams,
    method: SampleMethod,
    scheduler: Scheduler,
    cfg_scale: f32,
}

impl Request {
    /// The completed parameters (`width`/`height` are the generated size).
    pub fn params(&self) -> &GenerateParams {
        &self.params
    }

    /// The sampling method used.
    pub fn method(&self) -> SampleMethod {
        self.method
    }

    /// The scheduler used.
    pub fn scheduler(&self) -> Scheduler {
        self.scheduler
    }

    /// The classifier-free guidance scale used (1: no negative pass).
    pub fn cfg_scale(&self) -> f32 {
        self.cfg_scale
    }
}

/// An 8-bit RGB image, row-major, interleaved.
#[derive(Clone, Debug, PartialEq)]
pub struct Image {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `width * height * 3` bytes.
    pub rgb: Vec<u8>,
}

/// What the pipeline reports while it runs, in order: the observer passed to
/// [`Pipeline::generate`] gets every event (a front end draws progress from them).
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// A stage finished (`text encode`, `image encode`, `decode`), with its duration.
    Stage { name: &'static str, seconds: f64 },
    /// Sampling step `step` (0-based) of `steps` finished for image `image` (0-based) of
    /// the `images` of the batch, taking `seconds`.
    Step { image: usize, images: usize, step: usize, steps: usize, seconds: f64 },
    /// `done` of the `tiles` VAE tiles of image `image` (0-based, of `images`) are finished,
    /// in `stage` (`decode` or `image encode`). Only a tiled VAE run reports tiles; a retry
    /// with smaller tiles starts counting again with the new total.
    Tile { stage: &'static str, image: usize, images: usize, done: usize, tiles: usize },
}

/// `width x height` rounded up to multiples of `multiple`, as the reference aligns a
/// generation request (it warns and generates at the aligned size).
pub fn align_up(width: usize, height: usize, multiple: usize) -> (usize, usize) {
    let up = |v: usize| v.div_ceil(multiple.max(1)) * multiple.max(1);
    (up(width), up(height))
}

/// `requests`' LoRA adapters read and checked against the text encoder's and diffusion
/// model's weights of `family` in `files` (with the `--type` override `wtype`).
fn lora_set(
    files: &ModelFiles,
    family: &dyn Family,
    requests: &[crate::lora::LoraRequest],
    wtype: Option<GgmlType>,
) -> Result<crate::lora::LoraSet> {
    use crate::lora::{LoraError, LoraSet};
    let table = family.lora_prefixes();
    if table.is_empty() {
        return Err(LoraError::Unsupported(format!("the {} family takes no LoRA yet", family.arch())).into());
    }
    let dtype = dtype_of(files);
    let mut targets = family.text_specs(&dtype, wtype);
    targets.extend(family.diffusion_specs(&dtype, wtype));
    Ok(LoraSet::load(requests, family.arch(), table, &targets)?)
}

/// `requests`' LoRA adapters for the model of `files`, read and checked as a generation
/// would, without loading the model (for `sd-cli plan`).
pub fn lora_set_for(
    files: &ModelFiles,
    requests: &[crate::lora::LoraRequest],
    wtype: Option<GgmlType>,
) -> Result<crate::lora::LoraSet> {
    let detected = files.detect(None)?;
    let family = crate::family::for_detected(&detected, files)?;
    lora_set(files, family.as_ref(), requests, wtype)
}

/// The loaded model family and its settings; weights are loaded per phase.
pub struct Pipeline {
    files: Arc<ModelFiles>,
    family: Box<dyn Family>,
    prediction: Prediction,
    opts: LoadOptions,
    /// What loading found that a user should know.
    notices: Vec<Notice>,
    /// LoRA adapters and the apply mode asked for (`crate::lora`; resolved per module).
    loras: Option<(Arc<crate::lora::LoraSet>, crate::lora::ApplyMode)>,
    /// Set by another thread to stop the run at the next sampling step or stage.
    cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Called with each sampling step's denoised latent (previews).
    latent_hook: Option<LatentHook>,
    /// The hires fix's upscaler model (`--hires-upscaler` naming one).
    hires_model: Option<std::sync::Mutex<crate::upscale::Upscaler>>,
    /// The checked ControlNet file ([`LoadOptions::control_net`]).
    control_net: Option<Arc<crate::controlnet::ControlNetFile>>,
}

/// One image's denoised latent after a sampling step, as [`Pipeline::with_latent_hook`]'s
/// hook sees it: planar `channels x height x width` (latent pixels), in the diffusion
/// model's scaling.
#[derive(Debug)]
pub struct StepLatent<'a> {
    /// The image (0-based) of the batch.
    pub image: usize,
    /// The step (0-based) just finished, of `steps`.
    pub step: usize,
    /// Sampling steps of the image.
    pub steps: usize,
    /// Latent channels.
    pub channels: usize,
    /// Latent width.
    pub width: usize,
    /// Latent height.
    pub height: usize,
    /// The denoised estimate.
    pub latent: &'a [f32],
}

/// A hook called after each sampling step (on the generating thread; keep it cheap).
pub type LatentHook = Arc<dyn Fn(&StepLatent<'_>) + Send + Sync>;

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pipeline({}, {:?})", self.family.arch(), self.prediction)
    }
}

/// Bytes of an image tensor -> u8 exactly as the reference rounds.
fn to_u8(v: f32) -> u8 {
    if v <= 0.0 {
        0
    } else if v >= 1.0 {
        255
    } else {
        (v * 255.0 + 0.5) as u8
    }
}

impl Pipeline {
    /// Detects the architecture of files the caller has opened (e.g. to plan them first) and
    /// checks the tensors against it.
    pub fn from_files(files: ModelFiles, opts: LoadOptions) -> Result<Self> {
        let detected = files.detect(opts.prediction)?;
        let mut family = crate::family::for_detected(&detected, &files)?;
        family.set_model_args(&opts.model_args)?;
        let flow = family.sampling().schedule.is_flow();
        let mut notices = family.notices();
        let prediction = detected.prediction.unwrap_or_else(|| {
            // A flow-matching model's parameterisation comes with its schedule.
            if flow {
                return Prediction::Eps;
            }
            notices.push(Notice::PredictionAssumed);
            Prediction::Eps
        });
        if let PredictionSource::Metadata { key } = &detected.prediction_source {
            tracing::info!("prediction {} (from `{key}`)", prediction.name());
        }
        let parameterisation = if flow { "flow matching" } else { prediction.name() };
        let kind = if family.concat_channels() > 0 { " inpainting" } else { "" };
        tracing::info!(
            "model: {}{kind} ({} tensors), prediction {parameterisation}",
            detected.arch,
            files.index().len()
        );
        let control_net = match &opts.control_net {
            None => None,
            Some(path) => {
                let file = crate::controlnet::ControlNetFile::open(path, family.arch(), family.control_net())?;
                tracing::info!("ControlNet: '{}'", path.display());
                Some(Arc::new(file))
            }
        };
        let files = Arc::new(files);
        Ok(Self {
            files,
            family,
            prediction,
            opts,
            notices,
            loras: None,
            cancel: None,
            latent_hook: None,
            control_net,
            hires_model: None,
        })
    }

    /// What loading found that a user should know (front ends print these with their own
    /// option names; the library does not log them).
    pub fn notices(&self) -> &[Notice] {
        &self.notices
    }

    /// The pipeline with `requests`' LoRA adapters applied in `mode` (read and checked
    /// against the model now, before any weight is loaded). The mode of each module is
    /// resolved as its weights load (`crate::lora::runtime::resolve`), and said in the log.
    pub fn with_loras(mut self, requests: &[crate::lora::LoraRequest], mode: crate::lora::ApplyMode) -> Result<Self> {
        self.set_loras(requests, mode)?;
        Ok(self)
    }

    /// [`Pipeline::with_loras`] in place, for a server that applies each request's adapters
    /// to one loaded pipeline (weights load per generation, so nothing of the previous
    /// request's adapters stays). On an error the pipeline keeps no adapter.
    pub fn set_loras(&mut self, requests: &[crate::lora::LoraRequest], mode: crate::lora::ApplyMode) -> Result<()> {
        self.loras = None;
        if requests.is_empty() {
            return Ok(());
        }
        let set = lora_set(&self.files, self.family.as_ref(), requests, self.opts.wtype)?;
        tracing::info!(
            "{} LoRA files ({:.1} MiB) adapt {} weights",
            requests.len(),
            set.file_bytes() as f64 / 1048576.0,
            set.targets()
        );
        self.loras = Some((Arc::new(set), mode));
        Ok(())
    }

    /// The pipeline stopping a run with [`PipelineError::Cancelled`] at the next sampling step
    /// or stage boundary once `flag` is set (the caller clears it before the next run).
    pub fn with_cancel(mut self, flag: Arc<std::sync::atomic::AtomicBool>) -> Self {
        self.cancel = Some(flag);
        self
    }

    /// The pipeline calling `hook` with every image's denoised latent after each sampling
    /// step (a server's previews).
    pub fn with_latent_hook(mut self, hook: LatentHook) -> Self {
        self.latent_hook = Some(hook);
        self
    }

    /// [`PipelineError::Cancelled`] when the cancel flag is set.
    /// Gives the hires fix its upscaler model ([`HiresUpscaler::Model`](crate::hires::HiresUpscaler::Model)).
    pub fn set_hires_model(&mut self, upscaler: crate::upscale::Upscaler) {
        self.hires_model = Some(std::sync::Mutex::new(upscaler));
    }

    fn check_cancel(&self) -> Result<()> {
        match &self.cancel {
            Some(flag) if flag.load(std::sync::atomic::Ordering::Relaxed) => Err(PipelineError::Cancelled),
            _ => Ok(()),
        }
    }

    /// The multiple image sides must have for this model: VAE scale times the diffusion
    /// model's down factor (64 for SD 1.x / 2.x).
    fn spatial_multiple(&self) -> usize {
        self.family.spatial_multiple()
    }

    /// The size a request of `width x height` is generated at ([`align_up`] to
    /// [`Pipeline::spatial_multiple`]), with the reference's warning when it changes.
    pub(crate) fn aligned_size(&self, width: usize, height: usize) -> (usize, usize) {
        let multiple = self.spatial_multiple();
        let (w, h) = align_up(width, height, multiple);
        if (w, h) != (width, height) {
            tracing::warn!("align generation request up {width}x{height} to {w}x{h} (multiple={multiple})");
        }
        (w, h)
    }

    /// The detected architecture (`sd1`, `sd2`).
    pub fn arch(&self) -> &'static str {
        self.family.arch()
    }

    /// The sampling method the reference uses for this model when none is given.
    pub(crate) fn default_sample_method(&self) -> SampleMethod {
        self.family.sampling().method
    }

    /// The opened files.
    pub fn files(&self) -> &ModelFiles {
        &self.files
    }

    fn source(&self) -> Arc<dyn TensorSource + Send + Sync> {
        let files: Arc<dyn TensorSource + Send + Sync> = Arc::new(SharedFiles(self.files.clone()));
        match &self.loras {
            Some((set, _)) => Arc::new(crate::lora::MergedSource::new(files, set.clone())),
            None => files,
        }
    }

    /// The weights of `module` declared by `specs`, with its LoRA adapters in the mode
    /// resolved for where they live (`home`, `split`), and the source that fills them:
    /// merged by [`crate::lora::MergedSource`], or adapter tensors declared with the module
    /// and served by [`crate::lora::runtime::AdapterSource`].
    fn module_weights(
        &self,
        module: &str,
        mut specs: Vec<TensorSpec>,
        home: &ParamHome,
        split: Option<&LayerSplit>,
    ) -> Result<(Weights, Arc<dyn TensorSource + Send + Sync>)> {
        use crate::lora::runtime::{resolve, AdapterSource, ModuleWeights};
        use crate::lora::ApplyMode;
        let files: Arc<dyn TensorSource + Send + Sync> = Arc::new(SharedFiles(self.files.clone()));
        let Some((set, requested)) = &self.loras else { return Ok((Weights::new(specs)?, files)) };
        let adapted: Vec<&TensorSpec> = specs.iter().filter(|s| set.adapts(&s.name)).collect();
        if adapted.is_empty() {
            return Ok((Weights::new(specs)?, files));
        }
        let m = ModuleWeights {
            quantized: adapted.iter().any(|s| sd_backends::convert::is_quantized(s.ty)),
            off_device: !matches!(home, ParamHome::Compute),
            row_split: split.is_some_and(|s| s.rows.is_some()),
        };
        let (mode, why) = resolve(*requested, &m);
        if mode == ApplyMode::AtRuntime {
            let rt = set.runtime(&specs);
            tracing::info!(
                "{module}: LoRA {} -> at_runtime ({why}): {} weights adapted in the graph, {:.2} MiB of adapter tensors with the module's weights",
                requested.name(),
                rt.weights(),
                rt.bytes() as f64 / 1048576.0
            );
            specs.extend(rt.specs().iter().cloned());
            let mut w = Weights::new(specs)?;
            rt.attach(&mut w)?;
            return Ok((w, Arc::new(AdapterSource::new(files, set.clone()))));
        }
        tracing::info!(
            "{module}: LoRA {} -> immediately ({why}): {} weights merged as they are read",
            requested.name(),
            adapted.len()
        );
        Ok((Weights::new(specs)?, Arc::new(crate::lora::MergedSource::new(files, set.clone()))))
    }

    /// Gives `w` its home (groups from `group_of`: one per layer, block or stage), on
    /// `compute` or over `split`, filled from `src`; the runner stages them. A LoRA adapter
    /// tensor (`crate::lora::runtime`) gets the group and device of the weight it adapts.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        w: &mut Weights,
        module: &str,
        home: &ParamHome,
        compute: &Arc<Backend>,
        split: Option<&LayerSplit>,
        group_of: &dyn Fn(&str) -> String,
        row_splittable: &dyn Fn(&TensorSpec) -> bool,
        src: Arc<dyn TensorSource + Send + Sync>,
    ) -> Result<()> {
        use crate::lora::runtime::adapted_weight;
        let p = &self.opts.placement;
        let group_of = |name: &str| group_of(adapted_weight(name));
        w.use_in_place(!p.no_mmap);
        match split {
            None => w.place(module, home.clone(), compute.clone(), &p.ledgers, &group_of, src)?,
            Some(s) if s.rows.is_some() => {
                let shares = s.rows.as_deref().unwrap_or_default();
                let (home, ledgers) = (home.clone(), &p.ledgers);
                w.place_rows(module, home, &s.devices, shares, row_splittable, ledgers, &group_of, src)?;
            }
            Some(s) => {
                let index = self.files.index();
                let device_of = |name: &str| s.device_of_block(index.block_of(adapted_weight(name)));
                w.place_split(module, home.clone(), &s.devices, &device_of, &p.ledgers, &group_of, src)?
            }
        }
        Ok(())
    }

    fn runner(&self, name: &str, backend: &Arc<Backend>, split: Option<&LayerSplit>) -> Runner {
        let p = &self.opts.placement;
        let mut runner = self.runner_on(name, backend, split);
        runner.set_profiling(p.profile);
        runner
    }

    fn runner_on(&self, name: &str, backend: &Arc<Backend>, split: Option<&LayerSplit>) -> Runner {
        let p = &self.opts.placement;
        match split {
            None => Runner::with_ledger(name, backend.clone(), p.ledgers.get(&backend.device().name()), p.sched),
            Some(s) => {
                let devices = s.devices.iter().map(|b| (b.clone(), p.ledgers.get(&b.device().name()))).collect();
                let mut runner = Runner::with_devices(name, devices, p.sched);
                runner.set_pipeline_copies(p.pipeline_copies);
                if s.rows.is_some() {
                    runner.set_row_split(s.host.clone());
                }
                runner
            }
        }
    }

    fn load_text(&self) -> Result<Box<dyn TextEncoder>> {
        let dtype = dtype_of(&self.files);
        let d = &self.opts.devices;
        let home = &self.opts.placement.homes.te;
        let specs = self.family.text_specs(&dtype, self.opts.wtype);
        let (mut w, src) = self.module_weights("te", specs, home, d.te_split.as_ref())?;
        // Embedding tables are read by `get_rows`, never by a product: no repacked layout.
        w.keep_in_device_buffer(&|n| {
            crate::text::clip::is_gathered(n) || crate::text::t5::is_gathered(n) || crate::text::qwen3::is_gathered(n)
        });
        let group_of = |name: &str| self.family.text_group(name);
        let rows = |spec: &TensorSpec| self.family.text_row_splittable(spec);
        self.place(&mut w, "te", home, &d.te, d.te_split.as_ref(), &group_of, &rows, src)?;
        self.family.load_text(w)
    }

    fn load_diffusion(&self, guidance: f32) -> Result<Box<dyn DiffusionModel>> {
        let dtype = dtype_of(&self.files);
        let d = &self.opts.devices;
        let home = &self.opts.placement.homes.diffusion;
        let specs = self.family.diffusion_specs(&dtype, self.opts.wtype);
        let (mut w, src) = self.module_weights("unet", specs, home, d.diffusion_split.as_ref())?;
        let group_of = |name: &str| self.family.diffusion_group(name);
        let rows = |spec: &TensorSpec| self.family.diffusion_row_splittable(spec);
        self.place(&mut w, "unet", home, &d.diffusion, d.diffusion_split.as_ref(), &group_of, &rows, src)?;
        let settings = DiffusionSettings { flash_attn: self.opts.flash_attn, guidance };
        self.family.load_diffusion(w, &settings)
    }

    /// The ControlNet's weights placed on its device, when there is one.
    fn load_control_net(&self) -> Result<Option<ControlNetModel>> {
        let Some(file) = &self.control_net else { return Ok(None) };
        let home = &self.opts.placement.homes.controlnet;
        let mut w = Weights::new(file.specs(self.opts.wtype))?;
        let group = |name: &str| crate::diffusion::unet::group_of(name);
        self.place(&mut w, "controlnet", home, &self.opts.devices.controlnet, None, &group, &|_| false, file.source())?;
        let cfg = file.config().clone();
        Ok(Some(ControlNetModel { cfg, weights: w, flash_attn: self.opts.flash_attn }))
    }

    /// The family's TAESD configuration, or an error naming `--taesd` when it has none.
    fn taesd_config(&self) -> Result<sd_vae::TaesdConfig> {
        crate::family::taesd_config(self.family.as_ref())
    }

    fn load_first_stage(&self, need_encoder: bool) -> Result<Box<dyn FirstStage>> {
        let home = &self.opts.placement.homes.vae;
        let backend = &self.opts.devices.vae;
        let vae_err = |e| sd_vae::VaeError::Weights { module: "VAE", source: e };
        if self.opts.sources.taesd.is_some() {
            let parts = if need_encoder { sd_vae::TaesdParts::Full } else { sd_vae::TaesdParts::DecoderOnly };
            let cfg = self.taesd_config()?;
            let mut w = Weights::new(sd_vae::taesd_specs(&cfg, parts)).map_err(vae_err)?;
            self.place(&mut w, "vae", home, backend, None, &block_group, &|_| false, self.source())?;
            return Ok(Box::new(Taesd::from_weights(cfg, w)?));
        }
        let parts = if need_encoder { VaeParts::Full } else { VaeParts::DecoderOnly };
        let cfg = self.family.vae();
        let mut w = Weights::new(sd_vae::vae_specs(&cfg, parts)).map_err(vae_err)?;
        self.place(&mut w, "vae", home, backend, None, &block_group, &|_| false, self.source())?;
        Ok(Box::new(AutoencoderKl::from_weights(cfg, w)?))
    }

    /// One line per device for `-v`: managed high-water mark and budget.
    pub fn device_report(&self) -> Vec<String> {
        DeviceReport::all(&self.opts.placement.ledgers)
            .iter()
            .map(|d| {
                let mib = |b: u64| b as f64 / 1048576.0;
                let budget =
                    d.budget_bytes.map_or_else(|| "no budget".to_string(), |b| format!("budget {:.1} MiB", mib(b)));
                format!("{}: managed high-water {:.1} MiB ({budget})", d.device, mib(d.high_water_bytes))
            })
            .collect()
    }

    /// A lower bound of the largest working memory one stage needs for `p`, in bytes, and
    /// the stage: the UNet's attention scores at its first level (`heads x tokens^2` f32 per
    /// sample, unless flash attention), the VAE's mid-block attention and last-level
    /// activations (unless tiled). Real use is higher; this is for refusing at once what can
    /// never fit.
    fn working_memory_estimate(&self, p: &GenerateParams) -> (f64, &'static str) {
        let tokens = (p.width / VAE_SCALE) as f64 * (p.height / VAE_SCALE) as f64;
        // `p` is completed by `check_request`: its cfg scale is the one used.
        let batch = if p.cfg_scale != Some(1.0) { 2.0 } else { 1.0 };
        let unet = self.family.attention_bytes(tokens, batch, self.opts.flash_attn);
        let (vae_attn, vae_act) = if p.tiling.enabled {
            (0.0, 0.0)
        } else {
            (tokens * tokens * 4.0, 3.0 * 128.0 * p.width as f64 * p.height as f64 * 4.0)
        };
        let mut best = (unet, "the diffusion model's attention");
        for c in [(vae_attn, "the VAE's attention"), (vae_act, "the VAE decoder's activations")] {
            if c.0 > best.0 {
                best = c;
            }
        }
        best
    }

    /// Completes `p` for this model and checks it before any weight is read: the model's
    /// sampler (and the sampler's scheduler) where none is given, the size aligned to
    /// [`Pipeline::spatial_multiple`] ([`Pipeline::aligned_size`]) with the init image fitted to
    /// it; then what `validate` could not check: VAE tiling at that size, `clip_skip`, working
    /// memory against the devices, the tensors every stage will need (so a missing or broken
    /// VAE is found before sampling, not after).
    pub fn check_request(&self, p: ValidParams) -> Result<Request> {
        let mut p = p.0;
        let method = p.method.unwrap_or_else(|| self.default_sample_method());
        let scheduler = p.scheduler.unwrap_or_else(|| method.default_scheduler());
        let cfg_scale = p.cfg_scale.unwrap_or(self.family.sampling().cfg_scale);
        (p.method, p.scheduler, p.cfg_scale) = (Some(method), Some(scheduler), Some(cfg_scale));
        (p.width, p.height) = self.aligned_size(p.width, p.height);
        if let Some(image) = &mut p.init_image {
            // The library's rule for an init image of another size than the (aligned) request.
            *image = crate::image_io::resize_nearest(image, p.width, p.height);
        }
        if let Some(mask) = &mut p.mask {
            // The same rule for the mask (the reference resizes it as the init image, nearest).
            *mask = crate::image_io::resize_nearest(mask, p.width, p.height);
        }
        if let Some(image) = &mut p.control_image {
            // And for the control image (`sd_image_to_tensor`'s nearest interpolation).
            *image = crate::image_io::resize_nearest(image, p.width, p.height);
        }
        self.check_model_limits(&p)?;
        if let Some(h) = &p.hires {
            if p.mask.is_some() || self.family.concat_channels() != 0 {
                return bad_setting(
                    Setting::Hires,
                    "",
                    "the hires fix with inpainting is not implemented by sd-rs yet",
                );
            }
            if p.control_image.is_some() && self.control_net.is_some() {
                return bad_setting(
                    Setting::Hires,
                    "",
                    "the hires fix with a ControlNet is not implemented by sd-rs yet",
                );
            }
            let (tw, th) = h.target_size(p.width, p.height);
            let multiple = self.spatial_multiple();
            let (aw, ah) = align_up(tw, th, multiple);
            if (aw, ah) != (tw, th) {
                tracing::warn!("align hires target up {tw}x{th} to {aw}x{ah} (multiple={multiple})");
            }
            // The second pass's memory, as the first's.
            let mut big = p.clone();
            (big.width, big.height, big.init_image, big.hires) = (aw, ah, None, None);
            self.check_model_limits(&big)?;
            if h.upscaler == crate::hires::HiresUpscaler::Model && self.hires_model.is_none() {
                return bad_setting(Setting::Hires, "", "the Model upscaler needs an upscaler model");
            }
            if !h.upscaler.is_latent() {
                // The image upscalers encode again: the encoder's weights too.
                self.check_tensors(true)?;
            }
        }
        if let Some(h) = &mut p.hires {
            let (tw, th) = h.target_size(p.width, p.height);
            (h.width, h.height) = align_up(tw, th, self.spatial_multiple());
        }
        Ok(Request { params: p, method, scheduler, cfg_scale })
    }

    /// The checks of [`Pipeline::check_request`] that need the model and the aligned size.
    fn check_model_limits(&self, p: &GenerateParams) -> Result<()> {
        p.tiling.validate([p.width, p.height], VAE_SCALE)?;
        self.family.check_text(p.clip_skip)?;
        let (need, stage) = self.working_memory_estimate(p);
        // A ControlNet's working set is the UNet's first half: its attention as large.
        let control =
            (self.control_net.is_some() && p.control_image.is_some()).then_some(&self.opts.devices.controlnet);
        for backend in [&self.opts.devices.diffusion, &self.opts.devices.vae].into_iter().chain(control) {
            let device = backend.device();
            let (_, total) = device.memory();
            if total > 0 && need > total as f64 {
                return Err(PipelineError::WorkingMemory {
                    width: p.width,
                    height: p.height,
                    stage,
                    need,
                    device: device.name(),
                    total: total as f64,
                    flash_attn: self.opts.flash_attn,
                });
            }
        }
        // Every image's latent is kept until decoding: refuse a batch that cannot be held.
        let latents =
            p.batch_count as f64 * (p.width * p.height) as f64 / 64.0 * self.family.latent_channels() as f64 * 4.0;
        let (_, host) = self.opts.devices.te.device().memory();
        if host > 0 && latents > host as f64 {
            let problem = format!("the batch's latents alone need {}", fmt_gib(latents));
            return bad_setting(Setting::BatchCount, p.batch_count, problem);
        }
        self.check_tensors(p.init_image.is_some())
    }

    /// Every tensor the text encoder, the UNet and the first stage will load exists with the
    /// expected number of elements; the first stage's weights hold no NaN or infinity (they
    /// are small and read last, so a broken VAE would otherwise waste a whole sampling run).
    fn check_tensors(&self, need_encoder: bool) -> Result<()> {
        let modules =
            crate::family::generation_specs(self.family.as_ref(), &self.files, self.opts.wtype, need_encoder)?;
        crate::family::check_specs(self.family.arch(), &self.files, &modules)?;
        let (first_name, first) = (modules[2].0, &modules[2].1);
        let src = FileSource::new(&self.files);
        for s in first {
            if let Err(source) = src.load_tensor(&s.name, s.ty, &s.ne) {
                return Err(PipelineError::FirstStage { module: first_name, source });
            }
            src.release(&s.name);
        }
        Ok(())
    }

    /// Generates the request's `batch_count` images.
    pub fn generate(&self, request: &Request, progress: &mut dyn FnMut(Progress)) -> Result<Vec<Image>> {
        self.generate_reported(request, progress, &mut RunReport::new("generate", Vec::new()))
    }

    /// [`Pipeline::generate`], recording into `report` the settings, each module's
    /// residency and runner work, the stage and step times and, at the end, each device's
    /// managed memory (what was done before an error stays recorded).
    pub fn generate_reported(
        &self,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
        report: &mut RunReport,
    ) -> Result<Vec<Image>> {
        report.settings = Some(Settings::of(request));
        let images = self.generate_into(request, progress, report, None);
        report.devices = DeviceReport::all(&self.opts.placement.ledgers);
        images
    }

    /// The generation; with `kept`, each module is taken from it when kept there and put
    /// back after its stage ([`KeptWeights`]).
    fn generate_into(
        &self,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
        report: &mut RunReport,
        mut kept: Option<&mut KeptWeights>,
    ) -> Result<Vec<Image>> {
        let (p, method, scheduler, cfg_scale) = (&request.params, request.method, request.scheduler, request.cfg_scale);
        let (lw, lh) = (p.width / VAE_SCALE, p.height / VAE_SCALE);
        let channels = self.family.latent_channels();
        let guided = cfg_scale != 1.0;

        // 1. Text.
        self.check_cancel()?;
        let t = Instant::now();
        let (cond, uncond) = {
            let reused = kept.as_deref_mut().and_then(|k| k.te.take());
            let fresh = reused.is_none();
            let model = match reused {
                Some(m) => m,
                None => kept::load_or_free(&mut kept, || self.load_text())?,
            };
            let start = kept::begin(model.weights(), !fresh);
            report.stage("te load", t.elapsed().as_secs_f64());
            let t_encode = Instant::now();
            let mut runner = self.runner("te", &self.opts.devices.te, self.opts.devices.te_split.as_ref());
            let text = |prompt, negative| TextRequest {
                prompt,
                clip_skip: p.clip_skip,
                width: p.width,
                height: p.height,
                negative,
            };
            let cond = model.encode(&mut runner, &text(&p.prompt, false))?;
            let uncond = if guided { Some(model.encode(&mut runner, &text(&p.negative_prompt, true))?) } else { None };
            health::check("text encoder (prompt)", &cond.data, ACTIVATIONS);
            // A conditioning may be zero by design (SDXL's empty negative prompt).
            if let Some(u) = uncond.as_ref().filter(|u| !u.zeroed) {
                health::check("text encoder (negative prompt)", &u.data, ACTIVATIONS);
            }
            tracing::debug!("te params {}; {}", model.weights().home_description(), runner.summary());
            record_module(report, "te", model.weights(), &runner);
            kept::record(report, "te", model.weights(), start);
            if let Some(k) = kept.as_deref_mut() {
                k.te = Some(model);
            }
            report.stage("text encode", t_encode.elapsed().as_secs_f64());
            (cond, uncond)
        };
        let secs = t.elapsed().as_secs_f64();
        tracing::info!("text encoding took {secs:.2} s");
        progress(Progress::Stage { name: "text encode", seconds: secs });

        // 2. Schedule and, for img2img, the init latent.
        let defaults = self.family.sampling();
        let schedule = match (defaults.schedule, p.flow_shift) {
            (Schedule::Flow(flow), Some(shift)) => Schedule::Flow(flow.with_shift(shift)),
            (schedule, Some(shift)) => {
                // The reference sets a shift on flow denoisers only.
                tracing::info!("flow shift {shift} ignored: the {} model has no flow schedule", self.family.arch());
                schedule
            }
            (schedule, None) => schedule,
        };
        let ctx = ScheduleContext { ays: defaults.ays, image_seq_len: lw * lh };
        let full = scheduler.sigmas_for(p.steps, &schedule, &ctx)?;
        let mut init_latent: Option<Vec<f32>> = None;
        // Inpainting: the mask at pixel and latent resolution; an inpainting checkpoint also
        // takes the masked image's latent (`inpaint.rs`).
        let concat_channels = self.family.concat_channels();
        if concat_channels != 0 && concat_channels != channels + 1 {
            return Err(PipelineError::Invalid(format!(
                "the {} model's UNet takes {concat_channels} channels beside the latent's {channels}: \
                 only inpainting's {} (mask and masked image) are supported",
                self.family.arch(),
                channels + 1
            )));
        }
        let pixel_mask = p.mask.as_ref().map(inpaint::pixel_mask);
        let latent_mask = pixel_mask.as_ref().map(|m| inpaint::latent_mask(m, (p.width, p.height), VAE_SCALE));
        let mut masked_latent: Option<Vec<f32>> = None;
        let sigmas = match &p.init_image {
            None => full,
            Some(image) => {
                let image = crate::image_io::to_planar(image);
                let t = Instant::now();
                // A kept decoder without its encoder is freed for the full VAE.
                let reused = kept.as_deref_mut().and_then(|k| k.vae.take()).filter(|(encoder, _)| *encoder);
                let was_kept = reused.is_some();
                let vae = match reused {
                    Some((_, vae)) => vae,
                    None => kept::load_or_free(&mut kept, || self.load_first_stage(true))?,
                };
                let start = vae.params().and_then(|w| kept::begin(w, was_kept));
                report.stage("vae load (encode)", t.elapsed().as_secs_f64());
                let t_encode = Instant::now();
                let mut runner = self.runner("vae", &self.opts.devices.vae, None);
                // Pixels in [0, 1] as the VAE takes them.
                let range = vae.image_range();
                let to_vae = |x: &[f32]| -> Vec<f32> {
                    match range {
                        sd_vae::ImageRange::MinusOneToOne => x.iter().map(|v| v * 2.0 - 1.0).collect(),
                        sd_vae::ImageRange::ZeroToOne => x.to_vec(),
                    }
                };
                let px = to_vae(&image);
                let mut rng = p.rng.seeded(p.seed);
                let mut on_tile = |done: usize, tiles: usize| {
                    progress(Progress::Tile { stage: "image encode", image: 0, images: 1, done, tiles })
                };
                let latent = encode_latent(
                    vae.as_ref(),
                    &mut runner,
                    &px,
                    (p.width, p.height),
                    &p.tiling,
                    rng.as_mut(),
                    &mut on_tile,
                )?;
                init_latent = Some(latent);
                if concat_channels > 0 {
                    // The reference encodes the masked image next, drawing from the same generator.
                    let ones;
                    let m = match &pixel_mask {
                        Some(m) => m,
                        None => {
                            ones = vec![1.0; p.width * p.height];
                            &ones
                        }
                    };
                    let px = to_vae(&inpaint::masked_image(&image, m));
                    masked_latent = Some(encode_latent(
                        vae.as_ref(),
                        &mut runner,
                        &px,
                        (p.width, p.height),
                        &p.tiling,
                        rng.as_mut(),
                        &mut on_tile,
                    )?);
                }
                if let Some(w) = vae.params() {
                    record_module(report, "vae", w, &runner);
                    kept::record(report, "vae", w, start);
                }
                if let Some(k) = kept.as_deref_mut() {
                    k.vae = Some((true, vae));
                }
                report.stage("image encode", t_encode.elapsed().as_secs_f64());
                let secs = t.elapsed().as_secs_f64();
                tracing::info!("init image encoded in {secs:.2} s");
                progress(Progress::Stage { name: "image encode", seconds: secs });
                img2img_sigmas(&full, p.strength)?
            }
        };
        if sigmas.len() < 2 {
            return bad_setting(Setting::Strength, p.strength, "too low: no sampling step remains");
        }
        // An inpainting UNet's extra channels (the same for every image and both passes):
        // without an init image, a mask of ones and a zero masked latent, as the reference.
        let concat = (concat_channels > 0).then(|| {
            let ones = vec![1.0; lw * lh];
            let zeros = vec![0.0; channels * lw * lh];
            inpaint::concat(latent_mask.as_deref().unwrap_or(&ones), masked_latent.as_deref().unwrap_or(&zeros))
        });
        // The denoised estimate keeps the init latent outside the mask (dilated for an
        // inpainting UNet). Without a mask the reference's mask is all ones: nothing to keep.
        let denoise_mask = latent_mask.map(|m| if concat.is_some() { inpaint::dilate3(&m, (lw, lh)) } else { m });
        if concat.is_some() && (p.init_image.is_none() || p.mask.is_none()) {
            // The reference's warning; it then runs as this does.
            tracing::warn!("an inpainting model needs both an init image (-i) and a mask (--mask)");
        }

        // 3. Sampling.
        let mut latents: Vec<Vec<f32>> = Vec::with_capacity(p.batch_count);
        {
            let t = Instant::now();
            let key = p.guidance.to_bits();
            let reused = kept.as_deref_mut().and_then(|k| k.unet.take()).filter(|(g, _)| *g == key);
            let was_kept = reused.is_some();
            let unet = match reused {
                Some((_, unet)) => unet,
                None => kept::load_or_free(&mut kept, || self.load_diffusion(p.guidance))?,
            };
            let start = kept::begin(unet.weights(), was_kept);
            report.stage("unet load", t.elapsed().as_secs_f64());
            // The ControlNet, loaded for sampling and released after it.
            let mut control = match (&p.control_image, self.control_net.is_some()) {
                (Some(image), true) => {
                    let t = Instant::now();
                    match kept::load_or_free(&mut kept, || self.load_control_net())? {
                        Some(model) => {
                            report.stage("controlnet load", t.elapsed().as_secs_f64());
                            let runner = self.runner("controlnet", &self.opts.devices.controlnet, None);
                            let hint = crate::image_io::to_planar(image);
                            Some(control::ControlStage { model, runner, hint, strength: p.control_strength })
                        }
                        None => None,
                    }
                }
                (Some(_), false) => {
                    tracing::warn!("a control image without a ControlNet is not used");
                    None
                }
                (None, _) => None,
            };
            let t = Instant::now();
            let mut runner =
                self.runner("unet", &self.opts.devices.diffusion, self.opts.devices.diffusion_split.as_ref());
            // The passes: the generated size, then the hires fix's target from the first pass's
            // latents upscaled (the reference's second sampling, each image's generator seeded
            // again as for the first).
            let (lw0, lh0) = (lw, lh);
            let mut passes = vec![(lw, lh, sigmas.clone())];
            if let Some(h) = &p.hires {
                let (hw, hh) = (h.width / VAE_SCALE, h.height / VAE_SCALE);
                let steps = crate::hires::second_pass_schedule_steps(h, p.steps);
                let ctx = ScheduleContext { ays: defaults.ays, image_seq_len: hw * hh };
                let full = scheduler.sigmas_for(steps, &schedule, &ctx)?;
                let tail = img2img_sigmas(&full, h.strength())?;
                tracing::info!(
                    "hires fix: {}x{}, scheduler steps {steps}, denoising strength {:.2}, {} sigmas",
                    h.width,
                    h.height,
                    h.strength(),
                    tail.len()
                );
                passes.push((hw, hh, tail));
            }
            // Where each pass's images start from: the init latent (or noise), then the first
            // pass's latents upscaled.
            let mut start_from = PassStart::Init;
            for (pass, (lw, lh, sigmas)) in passes.into_iter().enumerate() {
                if let (1, Some(h)) = (pass, &p.hires) {
                    let first = std::mem::take(&mut latents);
                    start_from = if h.upscaler.is_latent() {
                        let up = |l: &Vec<f32>| crate::hires::upscale_latent(l, (lw0, lh0), (lw, lh), h.upscaler);
                        PassStart::Latents(first.iter().map(up).collect())
                    } else {
                        let vae = self.load_first_stage(true)?;
                        let runner = self.runner("vae", &self.opts.devices.vae, None);
                        PassStart::Images(Box::new(ImageUpscale { vae, runner, latents: first, upscaler: h.upscaler }))
                    };
                }
                // Images are sampled one after the other, each from its own generator, as in the
                // reference. A split module that overlaps micro-batches across its devices
                // (`pipeline_copies` > 1) samples the batch's images in lockstep instead: one model
                // evaluation per step covers every image, so the micro-batches have images to
                // overlap even without guidance. Each image still draws its noise from its own
                // generator, in its own order (`ImagesRng`), so the sampling math is the same.
                let per_image = channels * lh * lw;
                let groups: Vec<std::ops::Range<usize>> = if runner.micro_batches(p.batch_count) > 1 {
                    tracing::debug!("{} images sampled in lockstep for the pipelined split", p.batch_count);
                    std::iter::once(0..p.batch_count).collect()
                } else {
                    (0..p.batch_count).map(|b| b..b + 1).collect()
                };
                for images in groups {
                    let first = images.start;
                    let mut rngs: Vec<Box<dyn crate::sampling::NoiseRng>> =
                        images.clone().map(|b| p.rng.seeded(p.seed.wrapping_add(b as u64))).collect();
                    let mut x = Vec::with_capacity(per_image * images.len());
                    for (k, rng) in rngs.iter_mut().enumerate() {
                        let from_image;
                        let init = match &mut start_from {
                            PassStart::Init => init_latent.as_deref(),
                            PassStart::Latents(u) => Some(&u[first + k][..]),
                            PassStart::Images(state) => {
                                from_image = hires_image_upscale(
                                    self.hires_model.as_ref(),
                                    state.vae.as_ref(),
                                    &mut state.runner,
                                    &state.latents[first + k],
                                    ((lw0, lh0), (lw, lh)),
                                    state.upscaler,
                                    &p.tiling,
                                    rng.as_mut(),
                                )?;
                                Some(&from_image[..])
                            }
                        };
                        let noise = rng.randn(per_image);
                        x.extend(match init {
                            None => txt2img_latent(&noise, sigmas[0]),
                            Some(init) => match &schedule {
                                Schedule::Flow(flow) => flow.noised_latent(init, &noise, sigmas[0])?,
                                Schedule::Discrete(_) => noised_latent(init, &noise, sigmas[0])?,
                            },
                        });
                    }
                    let mut rng = ImagesRng(rngs);
                    let mut step_start = Instant::now();
                    let warned = std::cell::Cell::new(false);
                    let n_images = images.len();
                    let model = |inp: ModelInput<'_>| -> Result<ModelOutput> {
                        let with_concat: Vec<f32>;
                        let x = match &concat {
                            None => inp.x,
                            Some(c) => {
                                with_concat =
                                    inp.x.chunks_exact(per_image).flat_map(|xi| xi.iter().chain(c).copied()).collect();
                                &with_concat
                            }
                        };
                        let out = eval_guided(
                            unet.as_ref(),
                            &mut runner,
                            x,
                            (lw, lh),
                            n_images,
                            inp.timestep,
                            &cond,
                            uncond.as_ref().filter(|_| inp.uncond),
                            control.as_mut().map(|c| (c, inp.x)),
                        )?;
                        // One warning per image: a broken model is broken at every step.
                        if !warned.get() {
                            let which = match n_images {
                                1 => format!("image {}", first + 1),
                                n => format!("images {} to {}", first + 1, first + n),
                            };
                            let stage = format!("diffusion model output at timestep {:.0} of {which}", inp.timestep);
                            warned.set(health::check(&stage, &out.cond, ACTIVATIONS));
                        }
                        Ok(out)
                    };
                    let steps = &mut report.steps;
                    let mut denoiser = GuidedDenoiser::new(&schedule, self.prediction, cfg_scale, model);
                    let with_uncond = method.needs_uncond_denoised();
                    let mut denoise = |x: &[f32], sigma: f32, step: crate::sampling::Step| -> Result<Denoised> {
                        self.check_cancel()?;
                        let mut out = denoiser.denoise_full::<PipelineError>(x, sigma, step, with_uncond)?;
                        if let (Some(m), Some(init)) = (&denoise_mask, &init_latent) {
                            inpaint::blend(&mut out.pred, init, m);
                        }
                        if step.last_eval {
                            let secs = step_start.elapsed().as_secs_f64();
                            // In lockstep one step serves every image: each is reported with it.
                            for b in images.clone() {
                                steps.push(StepTime { image: b, step: step.index, seconds: secs });
                                // The front end shows it (sd-cli: a bar, or an info line).
                                progress(Progress::Step {
                                    image: b,
                                    images: p.batch_count,
                                    step: step.index,
                                    steps: step.count,
                                    seconds: secs,
                                });
                            }
                            step_start = Instant::now();
                            if let Some(hook) = &self.latent_hook {
                                for (k, b) in images.clone().enumerate() {
                                    let Some(latent) = out.pred.get(k * per_image..(k + 1) * per_image) else { break };
                                    hook(&StepLatent {
                                        image: b,
                                        step: step.index,
                                        steps: step.count,
                                        channels,
                                        width: lw,
                                        height: lh,
                                        latent,
                                    });
                                }
                            }
                        }
                        Ok(out)
                    };
                    let eta = p.eta.unwrap_or_else(|| method.default_eta());
                    let out = if schedule.is_flow() {
                        sample_flow(method, &mut denoise, x, &sigmas, &mut rng, eta)?
                    } else {
                        sample(method, &mut denoise, x, &sigmas, &mut rng, eta)?
                    };
                    latents.extend(out.chunks_exact(per_image).map(<[f32]>::to_vec));
                }
            }
            let moved = unet.weights().stats();
            tracing::debug!(
                "unet params {}; {}; copied {:.1} MiB to {} in {:.2} s",
                unet.weights().home_description(),
                runner.summary(),
                moved.copied_bytes as f64 / 1048576.0,
                runner.backends().iter().map(|b| b.device().name()).collect::<Vec<_>>().join("&"),
                moved.copy_nanos as f64 * 1e-9
            );
            record_module(report, "unet", unet.weights(), &runner);
            kept::record(report, "unet", unet.weights(), start);
            if let Some(c) = &control {
                tracing::debug!("controlnet params {}; {}", c.model.weights.home_description(), c.runner.summary());
                record_module(report, "controlnet", &c.model.weights, &c.runner);
            }
            drop(control);
            report.stage("sampling", t.elapsed().as_secs_f64());
            drop(runner);
            if let Some(k) = kept.as_deref_mut() {
                k.unet = Some((key, unet));
            }
        }

        // 4. Decoding, at the hires target's size after a hires pass.
        let (out_w, out_h) = p.hires.as_ref().map_or((p.width, p.height), |h| (h.width, h.height));
        let (lw, lh) = (out_w / VAE_SCALE, out_h / VAE_SCALE);
        self.check_cancel()?;
        let t = Instant::now();
        let reused = kept.as_deref_mut().and_then(|k| k.vae.take());
        let was_kept = reused.is_some();
        let (encoder, vae) = match reused {
            Some(v) => v,
            None => (false, kept::load_or_free(&mut kept, || self.load_first_stage(false))?),
        };
        let start = vae.params().and_then(|w| kept::begin(w, was_kept));
        report.stage("vae load", t.elapsed().as_secs_f64());
        let t_decode = Instant::now();
        let mut runner = self.runner("vae", &self.opts.devices.vae, None);
        let mut images = Vec::with_capacity(latents.len());
        let images_n = latents.len();
        for (image, mut latent) in latents.into_iter().enumerate() {
            vae.diffusion_to_vae(&mut latent);
            let mut on_tile = |done: usize, tiles: usize| {
                progress(Progress::Tile { stage: "decode", image, images: images_n, done, tiles })
            };
            let img = sd_vae::decode_tiled_observed(
                vae.as_ref(),
                &mut runner,
                &latent,
                (lw, lh),
                channels,
                &p.tiling,
                p.vae_max_compute_bytes,
                &mut on_tile,
            )?;
            let (lo, hi) = match vae.image_range() {
                sd_vae::ImageRange::MinusOneToOne => (-1.0, 1.0),
                sd_vae::ImageRange::ZeroToOne => (0.0, 1.0),
            };
            health::check(&format!("VAE decoder (image {})", images.len() + 1), &img, health::Expect::Image { lo, hi });
            images.push(planar_to_rgb8(&img, out_w, out_h, vae.image_range()));
        }
        tracing::debug!("vae; {}", runner.summary());
        if let Some(w) = vae.params() {
            record_module(report, "vae", w, &runner);
            kept::record(report, "vae", w, start);
        }
        drop(runner);
        if let Some(k) = kept {
            k.vae = Some((encoder, vae));
        }
        report.stage("decode", t_decode.elapsed().as_secs_f64());
        let secs = t.elapsed().as_secs_f64();
        tracing::info!("decoding took {secs:.2} s");
        progress(Progress::Stage { name: "decode", seconds: secs });
        Ok(images)
    }
}

/// Where a sampling pass's images start from.
enum PassStart {
    /// The init latent (img2img), else noise.
    Init,
    /// The hires fix's latent upscaler: the first pass's latents, upscaled.
    Latents(Vec<Vec<f32>>),
    /// The hires fix's image upscaler: each image is decoded, upscaled and encoded with its
    /// own generator, which its encoding draws from first.
    Images(Box<ImageUpscale>),
}

/// [`PassStart::Images`]' state.
struct ImageUpscale {
    /// The VAE (encoder and decoder) and its runner.
    vae: Box<dyn FirstStage>,
    runner: Runner,
    /// The first pass's latents.
    latents: Vec<Vec<f32>>,
    upscaler: crate::hires::HiresUpscaler,
}

/// Adds `module`'s residency and its runner's work to `report`.
fn record_module(report: &mut RunReport, module: &str, w: &Weights, runner: &Runner) {
    report.modules.push(ModuleReport::of(module, w, runner));
    report.runners.push(RunnerReport::of(runner, w));
}

/// One guided model evaluation of `images` latents (concatenated in `x`, sampled in lockstep):
/// every image's cond pass and then every image's uncond pass as one batch when their shapes
/// agree (the same numbers as separate runs to a few f16 ulps, fewer graph launches), else the
/// cond passes and the uncond passes as two batches.
#[allow(clippy::too_many_arguments)]
fn eval_guided(
    model: &dyn DiffusionModel,
    runner: &mut Runner,
    x: &[f32],
    dims: (usize, usize),
    images: usize,
    timestep: f32,
    cond: &Conditioning,
    uncond: Option<&Conditioning>,
    mut control: Option<(&mut control::ControlStage, &[f32])>,
) -> Result<ModelOutput> {
    let times = vec![timestep; images];
    let conds = vec![cond; images];
    // The ControlNet's residuals for a batch of `n` copies of the latents under `cs`.
    let mut residuals = |n: usize, cs: &[&Conditioning]| -> Result<Option<ControlResiduals>> {
        let Some((stage, latent)) = control.as_mut() else { return Ok(None) };
        let lx: Vec<f32> = std::iter::repeat_n(*latent, n).flatten().copied().collect();
        Ok(Some(stage.residuals(&lx, dims, &vec![timestep; cs.len()], cs)?))
    };
    match uncond {
        None => {
            let r = residuals(1, &conds)?;
            let c = model.eval_controlled(runner, x, dims, &times, &conds, r.as_ref())?;
            Ok(ModelOutput { cond: c, uncond: None })
        }
        Some(u) if u.batches_with(cond) => {
            let mut xx = Vec::with_capacity(2 * x.len());
            xx.extend_from_slice(x);
            xx.extend_from_slice(x);
            let both: Vec<&Conditioning> = conds.iter().copied().chain(std::iter::repeat_n(u, images)).collect();
            let r = residuals(2, &both)?;
            let times2 = [&times[..], &times[..]].concat();
            let mut out = model.eval_controlled(runner, &xx, dims, &times2, &both, r.as_ref())?;
            // Each half is one output per image (an inpainting UNet's input has more channels).
            let un = out.split_off(out.len() / 2);
            Ok(ModelOutput { cond: out, uncond: Some(un) })
        }
        Some(u) => {
            let r = residuals(1, &conds)?;
            let c = model.eval_controlled(runner, x, dims, &times, &conds, r.as_ref())?;
            let uncs = vec![u; images];
            let r = residuals(1, &uncs)?;
            let un = model.eval_controlled(runner, x, dims, &times, &uncs, r.as_ref())?;
            Ok(ModelOutput { cond: c, uncond: Some(un) })
        }
    }
}

/// The sampler's noise for images sampled in lockstep: a draw for all of them (their latents
/// concatenated) takes an equal share from each image's own generator, in image order, so each
/// image gets the values it would get sampled alone.
struct ImagesRng(Vec<Box<dyn crate::sampling::NoiseRng>>);

impl crate::sampling::NoiseRng for ImagesRng {
    fn randn(&mut self, n: usize) -> Vec<f32> {
        match self.0.as_mut_slice() {
            many if !many.is_empty() && n.is_multiple_of(many.len()) => {
                let share = n / many.len();
                many.iter_mut().flat_map(|r| r.randn(share)).collect()
            }
            // A draw that is not one share per image (no sampler makes one): nothing, which the
            // sampler reports as noise of the wrong length rather than using another image's.
            _ => Vec::new(),
        }
    }
}

/// Encodes an image (in the model's range) to a diffusion-space latent.
fn encode_latent(
    vae: &dyn FirstStage,
    runner: &mut Runner,
    px: &[f32],
    (w, h): (usize, usize),
    tiling: &TilingParams,
    rng: &mut dyn crate::sampling::NoiseRng,
    on_tile: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f32>> {
    let (out, c) = sd_vae::encode_tiled_observed(vae, runner, px, (w, h), 3, tiling, None, on_tile)?;
    let s = vae.scale_factor();
    let (lw, lh) = (w / s, h / s);
    let latent_c = vae.latent_channels();
    let mut latent = if c == 2 * latent_c {
        let dist = sd_vae::LatentDistribution::from_moments(&out, (lw, lh), c)?;
        let noise = rng.randn(latent_c * lw * lh);
        dist.sample(&noise)?
    } else {
        out
    };
    vae.vae_to_diffusion(&mut latent);
    Ok(latent)
}

/// The hires fix's image upscalers: the first pass's `latent` decoded, resized in pixels as
/// [`crate::hires::upscale_image`] and encoded again (the encoder sampling from `rng`), as
/// the reference's `upscale_hires_latent`; sizes are the latent's, `(from, to)`.
#[allow(clippy::too_many_arguments)]
fn hires_image_upscale(
    model: Option<&std::sync::Mutex<crate::upscale::Upscaler>>,
    vae: &dyn FirstStage,
    runner: &mut Runner,
    latent: &[f32],
    (from, to): ((usize, usize), (usize, usize)),
    upscaler: crate::hires::HiresUpscaler,
    tiling: &TilingParams,
    rng: &mut dyn crate::sampling::NoiseRng,
) -> Result<Vec<f32>> {
    let mut latent = latent.to_vec();
    vae.diffusion_to_vae(&mut latent);
    let channels = latent.len() / (from.0 * from.1);
    let img = sd_vae::decode_tiled_observed(vae, runner, &latent, from, channels, tiling, None, &mut |_, _| {})?;
    let range = vae.image_range();
    // The decoder's output in [0, 1] (the reference clamps a [-1, 1] decoder's output there).
    let unit: Vec<f32> = match range {
        sd_vae::ImageRange::MinusOneToOne => img.iter().map(|v| ((v + 1.0) * 0.5).clamp(0.0, 1.0)).collect(),
        sd_vae::ImageRange::ZeroToOne => img,
    };
    let (pw, ph) = (from.0 * VAE_SCALE, from.1 * VAE_SCALE);
    let (tw, th) = (to.0 * VAE_SCALE, to.1 * VAE_SCALE);
    let up = match (upscaler, model) {
        (crate::hires::HiresUpscaler::Model, Some(m)) => {
            let mut m = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let (out, size) = m.upscale_planar(&unit, (pw, ph)).map_err(|e| PipelineError::Invalid(e.to_string()))?;
            // Not clamped, as the reference; nearest to the target when the model's factor misses it.
            crate::hires::resize_planes(&out, size, (tw, th), crate::hires::Filter::Nearest, false)
        }
        _ => crate::hires::upscale_image(&unit, (pw, ph), (tw, th), upscaler),
    };
    let px: Vec<f32> = match range {
        sd_vae::ImageRange::MinusOneToOne => up.iter().map(|v| v * 2.0 - 1.0).collect(),
        sd_vae::ImageRange::ZeroToOne => up,
    };
    encode_latent(vae, runner, &px, (tw, th), tiling, rng, &mut |_, _| {})
}

pub(crate) fn planar_to_rgb8(img: &[f32], w: usize, h: usize, range: sd_vae::ImageRange) -> Image {
    let plane = w * h;
    let mut rgb = vec![0u8; plane * 3];
    for i in 0..plane {
        for c in 0..3 {
            let v = img[c * plane + i];
            let v = match range {
                sd_vae::ImageRange::MinusOneToOne => ((v + 1.0) * 0.5).clamp(0.0, 1.0),
                sd_vae::ImageRange::ZeroToOne => v.clamp(0.0, 1.0),
            };
            rgb[i * 3 + c] = to_u8(v);
        }
    }
    Image { width: w, height: h, rgb }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> GenerateParams {
        GenerateParams {
            prompt: String::new(),
            negative_prompt: String::new(),
            width: 64,
            height: 64,
            steps: 1,
            cfg_scale: Some(7.0),
            guidance: 3.5,
            method: None,
            scheduler: None,
            seed: 42,
            batch_count: 1,
            rng: RngKind::Cuda,
            clip_skip: -1,
            eta: None,
            init_image: None,
            strength: 0.75,
            mask: None,
            tiling: TilingParams::default(),
            vae_max_compute_bytes: None,
            flow_shift: None,
            control_image: None,
            control_strength: 0.9,
            hires: None,
        }
    }

    #[test]
    fn validate_names_the_setting_and_no_flag() {
        assert!(params().validate().is_ok());
        type Change = fn(&mut GenerateParams);
        let cases: [(Change, Setting); 18] = [
            (|p| p.width = 0, Setting::Width),
            (|p| p.height = 0, Setting::Height),
            (|p| p.steps = 0, Setting::Steps),
            (|p| p.steps = MAX_STEPS + 1, Setting::Steps),
            (|p| p.batch_count = 0, Setting::BatchCount),
            (|p| p.cfg_scale = Some(f32::NAN), Setting::CfgScale),
            (|p| p.cfg_scale = Some(1e30), Setting::CfgScale),
            (|p| p.cfg_scale = Some(-101.0), Setting::CfgScale),
            (|p| p.guidance = f32::NAN, Setting::Guidance),
            (|p| p.guidance = 1e30, Setting::Guidance),
            (|p| p.eta = Some(f32::INFINITY), Setting::Eta),
            (|p| p.strength = 1.5, Setting::Strength),
            (|p| p.strength = f32::NAN, Setting::Strength),
            (|p| p.flow_shift = Some(f32::INFINITY), Setting::FlowShift),
            (|p| p.flow_shift = Some(100.0), Setting::FlowShift),
            (|p| p.prompt = "x".repeat(MAX_PROMPT_BYTES + 1), Setting::Prompt),
            (|p| p.prompt = "(".repeat(5000) + "cat", Setting::Prompt),
            (|p| p.negative_prompt = "(x:1000)".into(), Setting::NegativePrompt),
        ];
        for (change, want) in cases {
            let mut p = params();
            change(&mut p);
            match p.validate() {
                Err(e @ PipelineError::Setting { setting, .. }) => {
                    assert_eq!(setting, want, "{e}");
                    let msg = e.to_string();
                    assert!(msg.starts_with(want.name()) && !msg.contains("--"), "{msg}");
                }
                other => panic!("{want:?}: expected a setting error, got {other:?}"),
            }
        }
        let mut p = params();
        p.eta = Some(-1.0);
        assert!(matches!(p.validate(), Err(PipelineError::Setting { setting: Setting::Eta, .. })));
        // The bounds themselves are accepted.
        let mut p = params();
        (p.cfg_scale, p.guidance, p.eta, p.flow_shift) = (Some(-100.0), 100.0, Some(100.0), Some(-50.0));
        p.prompt = "(".repeat(40) + &"x".repeat(MAX_PROMPT_BYTES - 40);
        assert!(p.validate().is_ok());
    }
}
