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

use sd_backends::{Backend, GgmlType};
use sd_placement::Module;
use sd_sched::{Ledgers, MappedBytes, ParamHome, Runner, SourceError, TensorSource, TensorSpec, Weights};
use sd_vae::{AutoencoderKl, FirstStage, Taesd, TilingParams, VaeParts};

use crate::diffusion::controlnet::ControlNetModel;
use crate::family::{block_group, DiffusionModel, DiffusionSettings, Family, TextEncoder};
use crate::files::{ModelFiles, ModelSources, PredictionSource};
use crate::health;
use crate::loader::{dtype_of, FileSource};
use crate::placement::LayerSplit;
use crate::report::{DeviceReport, RunReport, Settings};
use crate::sampling::{NoiseSchedule, Prediction, RngKind, SampleMethod, Scheduler};

mod control;
mod generate;
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
    /// [`GenerateParams::ref_images`].
    RefImage,
    /// [`GenerateParams::slg`].
    SlgScale,
    /// [`GenerateParams::img_cfg_scale`].
    ImgCfgScale,
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
            Setting::RefImage => "reference image",
            Setting::SlgScale => "skip-layer guidance scale",
            Setting::ImgCfgScale => "image guidance scale",
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
    /// `-r/--ref-image`: reference images of any size, in order (FLUX.2 reads them as tokens
    /// beside the image it generates: "put the cat of image 1 on the sofa of image 2").
    /// [`Pipeline::check_request`] resizes each as the reference does
    /// ([`GenerateParams::auto_resize_ref_images`]).
    pub ref_images: Vec<Image>,
    /// Resize each reference image to the generated image's area (at most 1024x1024's), its
    /// aspect kept and its sides rounded to the model's multiple, as the reference's CLI does
    /// unless `--disable-auto-resize-ref-image`. Without it each is encoded at its own size,
    /// whose sides must then be multiples of the model's ([`Pipeline::spatial_multiple`]).
    pub auto_resize_ref_images: bool,
    /// `--increase-ref-index`: FLUX.1 Kontext reads the k-th reference image (from 0) on RoPE
    /// index `k + 1` instead of all on index 1 laid out side by side, as the reference's flag
    /// does (FLUX.2 always numbers them so).
    pub increase_ref_index: bool,
    /// Skip-layer guidance (`--slg-scale`, `--skip-layers`, `--skip-layer-start`,
    /// `--skip-layer-end`; None or a scale of 0: off). SD3's MMDiT only.
    pub slg: Option<crate::sampling::SkipLayerGuidance>,
    /// `--img-cfg-scale`: the image guidance scale of the reference's three-pass guidance, where
    /// the model reads images beside the latent (FLUX.2 with reference images: the negative
    /// prompt once with them, once without). None: 1, off; a model without such images
    /// ignores it with a warning, as the reference does.
    pub img_cfg_scale: Option<f32>,
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
        self.check_sizes()?;
        self.check_prompts()?;
        self.check_scales()?;
        self.check_img2img()?;
        self.check_hires()?;
        Ok(ValidParams(self))
    }

    /// The image's sides, the steps and the batch count.
    fn check_sizes(&self) -> Result<()> {
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
        Ok(())
    }

    /// The prompts' lengths and weighting syntax.
    fn check_prompts(&self) -> Result<()> {
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
        Ok(())
    }

    /// The guidance scales, eta, the ControlNet's strength and the flow shift: finite and within
    /// what any UI offers.
    fn check_scales(&self) -> Result<()> {
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
        if !within(self.control_strength, MAX_GUIDANCE) {
            return bad_setting(
                Setting::ControlStrength,
                format!("{:?}", self.control_strength),
                format!("must be a finite number from -{MAX_GUIDANCE} to {MAX_GUIDANCE}"),
            );
        }
        if let Some(v) = self.img_cfg_scale.filter(|&v| !within(v, MAX_GUIDANCE)) {
            return bad_setting(
                Setting::ImgCfgScale,
                format!("{v:?}"),
                format!("must be a finite number from -{MAX_GUIDANCE} to {MAX_GUIDANCE}"),
            );
        }
        if let Some(s) = &self.slg {
            if !within(s.scale, MAX_GUIDANCE) {
                return bad_setting(
                    Setting::SlgScale,
                    format!("{:?}", s.scale),
                    format!("must be a finite number from -{MAX_GUIDANCE} to {MAX_GUIDANCE}"),
                );
            }
            if !(s.start.is_finite() && s.end.is_finite()) {
                return bad_setting(
                    Setting::SlgScale,
                    format!("(from {:?} to {:?})", s.start, s.end),
                    "the skip layers' start and end must be finite fractions of the schedule",
                );
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
        Ok(())
    }

    /// img2img's strength, and a mask only with an init image.
    fn check_img2img(&self) -> Result<()> {
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
        Ok(())
    }

    /// The hires fix's scale or target size, strength and steps.
    fn check_hires(&self) -> Result<()> {
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
        Ok(())
    }
}

/// The size the reference's `auto_resize_ref_image` gives a `w` x `h` reference image for a
/// generation of `area` pixels (capped at 1024x1024's): its aspect kept, each side rounded to
/// a multiple of `multiple`. The reference computes `area * w / h` in integers first.
pub(crate) fn ref_image_size((w, h): (usize, usize), area: usize, multiple: usize) -> (usize, usize) {
    let width = ((area as u64 * w as u64 / h.max(1) as u64) as f64).sqrt();
    let height = width * h as f64 / w.max(1) as f64;
    let m = multiple as f64;
    ((width / m).round() as usize * multiple, (height / m).round() as usize * multiple)
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
    /// The image guidance scale in use (1: off; see [`GenerateParams::img_cfg_scale`]).
    img_cfg: f32,
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
    /// A stage finished (`text encode`, `image encode`, `sampling`, `decode`), with its
    /// duration (module loads included).
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

    /// Image pixels per diffusion latent position (8; FLUX.2's patched latent: 16; a
    /// pixel-space model: 1).
    pub(crate) fn latent_scale(&self) -> usize {
        self.family.vae().map_or(1, |v| v.latent_scale())
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
        module: Module,
        mut specs: Vec<TensorSpec>,
        home: &ParamHome,
        split: Option<&LayerSplit>,
    ) -> Result<(Weights, Arc<dyn TensorSource + Send + Sync>)> {
        use crate::lora::runtime::{resolve, AdapterSource, ModuleWeights};
        use crate::lora::ApplyMode;
        let module = crate::report::module_name(module);
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
        module: Module,
        home: &ParamHome,
        compute: &Arc<Backend>,
        split: Option<&LayerSplit>,
        group_of: &dyn Fn(&str) -> String,
        row_splittable: &dyn Fn(&TensorSpec) -> bool,
        src: Arc<dyn TensorSource + Send + Sync>,
    ) -> Result<()> {
        use crate::lora::runtime::adapted_weight;
        let module = crate::report::module_name(module);
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

    fn runner(&self, module: Module, backend: &Arc<Backend>, split: Option<&LayerSplit>) -> Runner {
        let p = &self.opts.placement;
        let mut runner = self.runner_on(crate::report::module_name(module), backend, split);
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
        let (mut w, src) = self.module_weights(Module::Te, specs, home, d.te_split.as_ref())?;
        // Embedding tables are read by `get_rows`, never by a product: no repacked layout.
        w.keep_in_device_buffer(&|n| {
            crate::text::clip::is_gathered(n) || crate::text::t5::is_gathered(n) || crate::text::qwen3::is_gathered(n)
        });
        let group_of = |name: &str| self.family.text_group(name);
        let rows = |spec: &TensorSpec| self.family.text_row_splittable(spec);
        self.place(&mut w, Module::Te, home, &d.te, d.te_split.as_ref(), &group_of, &rows, src)?;
        self.family.load_text(w)
    }

    fn load_diffusion(&self, guidance: f32) -> Result<Box<dyn DiffusionModel>> {
        let dtype = dtype_of(&self.files);
        let d = &self.opts.devices;
        let home = &self.opts.placement.homes.diffusion;
        let specs = self.family.diffusion_specs(&dtype, self.opts.wtype);
        let (mut w, src) = self.module_weights(Module::Diffusion, specs, home, d.diffusion_split.as_ref())?;
        let group_of = |name: &str| self.family.diffusion_group(name);
        let rows = |spec: &TensorSpec| self.family.diffusion_row_splittable(spec);
        self.place(&mut w, Module::Diffusion, home, &d.diffusion, d.diffusion_split.as_ref(), &group_of, &rows, src)?;
        let settings = DiffusionSettings { flash_attn: self.opts.flash_attn, guidance };
        self.family.load_diffusion(w, &settings)
    }

    /// The ControlNet's weights placed on its device, when there is one.
    fn load_control_net(&self) -> Result<Option<ControlNetModel>> {
        let Some(file) = &self.control_net else { return Ok(None) };
        let home = &self.opts.placement.homes.controlnet;
        let mut w = Weights::new(file.specs(self.opts.wtype))?;
        let group = |name: &str| crate::diffusion::unet::group_of(name);
        self.place(
            &mut w,
            Module::ControlNet,
            home,
            &self.opts.devices.controlnet,
            None,
            &group,
            &|_| false,
            file.source(),
        )?;
        let cfg = file.config().clone();
        Ok(Some(ControlNetModel { cfg, weights: w, flash_attn: self.opts.flash_attn }))
    }

    /// The family's TAESD configuration, or an error naming `--taesd` when it has none.
    fn taesd_config(&self) -> Result<sd_vae::TaesdConfig> {
        crate::family::taesd_config(self.family.as_ref())
    }

    fn load_first_stage(&self, need_encoder: bool) -> Result<Box<dyn FirstStage>> {
        let Some(cfg) = self.family.vae() else {
            return Ok(Box::new(sd_vae::PixelSpace::new(self.family.latent_channels())));
        };
        let home = &self.opts.placement.homes.vae;
        let backend = &self.opts.devices.vae;
        let vae_err = |e| sd_vae::VaeError::Weights { module: "VAE", source: e };
        if self.opts.sources.taesd.is_some() {
            let parts = if need_encoder { sd_vae::TaesdParts::Full } else { sd_vae::TaesdParts::DecoderOnly };
            let cfg = self.taesd_config()?;
            let mut w = Weights::new(sd_vae::taesd_specs(&cfg, parts)).map_err(vae_err)?;
            self.place(&mut w, Module::Vae, home, backend, None, &block_group, &|_| false, self.source())?;
            return Ok(Box::new(Taesd::from_weights(cfg, w)?));
        }
        let parts = if need_encoder { VaeParts::Full } else { VaeParts::DecoderOnly };
        let mut w = Weights::new(sd_vae::vae_specs(&cfg, parts)).map_err(vae_err)?;
        self.place(&mut w, Module::Vae, home, backend, None, &block_group, &|_| false, self.source())?;
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
        let scale = self.latent_scale();
        // Reference images' tokens join the image's in the diffusion model's attention.
        let ref_tokens: f64 = p.ref_images.iter().map(|r| (r.width / scale) as f64 * (r.height / scale) as f64).sum();
        let latent_tokens = (p.width / scale) as f64 * (p.height / scale) as f64 + ref_tokens;
        // `p` is completed by `check_request`: its cfg scale is the one used.
        let batch = if p.cfg_scale != Some(1.0) { 2.0 } else { 1.0 };
        let unet = self.family.attention_bytes(latent_tokens, batch, self.opts.flash_attn);
        // The VAE's largest image: the generated one or a reference image it encodes.
        let largest = p.ref_images.iter().map(|r| (r.width, r.height)).fold((p.width, p.height), |a, b| {
            if b.0 * b.1 > a.0 * a.1 {
                b
            } else {
                a
            }
        });
        let tokens = tokens.max((largest.0 / VAE_SCALE) as f64 * (largest.1 / VAE_SCALE) as f64);
        // A pixel-space model has no autoencoder to run.
        let (vae_attn, vae_act) = if p.tiling.enabled || self.family.vae().is_none() {
            (0.0, 0.0)
        } else {
            (tokens * tokens * 4.0, 3.0 * 128.0 * (largest.0 * largest.1) as f64 * 4.0)
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
        self.fit_ref_images(&mut p)?;
        if p.slg.as_ref().is_some_and(|s| s.scale != 0.0 && !s.layers.is_empty()) && !self.family.skips_layers() {
            return bad_setting(
                Setting::SlgScale,
                "",
                format!(
                    "the {} model has no layers to skip (the DiTs of SD3, FLUX and Chroma have)",
                    self.family.arch()
                ),
            );
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
        let img_cfg = self.image_guidance(&p)?;
        Ok(Request { params: p, method, scheduler, cfg_scale, img_cfg })
    }

    /// The image guidance scale the run uses: the request's where the model reads reference
    /// images and has some, else 1 (a warning where another was asked, as the reference);
    /// refused for an inpainting model, whose image guidance is not implemented.
    fn image_guidance(&self, p: &GenerateParams) -> Result<f32> {
        let v = p.img_cfg_scale.unwrap_or(1.0);
        if v == 1.0 {
            return Ok(1.0);
        }
        if self.family.reads_reference_images() && !p.ref_images.is_empty() {
            return Ok(v);
        }
        if self.family.concat_channels() != 0 {
            return bad_setting(
                Setting::ImgCfgScale,
                v,
                "the image guidance of inpainting models is not implemented by sd-rs yet",
            );
        }
        tracing::warn!(
            "--img-cfg-scale {v} ignored: the {} model {} (three-pass guidance needs reference images)",
            self.family.arch(),
            if self.family.reads_reference_images() {
                "has no reference images (-r)"
            } else {
                "reads no reference images"
            }
        );
        Ok(1.0)
    }

    /// Reference images: refused by a model that reads none; resized as the reference's
    /// `generate_image` does with `auto_resize_ref_image` (to the generated image's area, at
    /// most 1024x1024's, its aspect kept, its sides rounded to the model's multiple; nearest),
    /// else checked to be whole latents.
    fn fit_ref_images(&self, p: &mut GenerateParams) -> Result<()> {
        if p.ref_images.is_empty() {
            return Ok(());
        }
        if !self.family.reads_reference_images() {
            return bad_setting(
                Setting::RefImage,
                "",
                format!("the {} model reads no reference images (FLUX.1 Kontext and FLUX.2 do)", self.family.arch()),
            );
        }
        let multiple = self.spatial_multiple();
        let area = (p.width * p.height).min(1024 * 1024);
        for (k, image) in p.ref_images.iter_mut().enumerate() {
            let (w, h) = (image.width, image.height);
            if p.auto_resize_ref_images {
                let (rw, rh) = ref_image_size((w, h), area, multiple);
                if rw == 0 || rh == 0 {
                    return bad_setting(
                        Setting::RefImage,
                        format!("{} ({w}x{h})", k + 1),
                        format!("resized to the image's area it is {rw}x{rh}: too narrow to encode"),
                    );
                }
                if (rw, rh) != (w, h) {
                    tracing::debug!("reference image {} resized from {w}x{h} to {rw}x{rh}", k + 1);
                    *image = crate::image_io::resize_nearest(image, rw, rh);
                }
            } else if w % multiple != 0 || h % multiple != 0 {
                return bad_setting(
                    Setting::RefImage,
                    format!("{} ({w}x{h})", k + 1),
                    format!(
                        "without auto-resize a reference image's sides must be multiples of {multiple} \
                         for the {} model",
                        self.family.arch()
                    ),
                );
            }
        }
        Ok(())
    }

    /// A reference image the VAE cannot encode whole on its device (one kept at its own size):
    /// an error naming it, rather than the generated size.
    fn check_ref_memory(&self, p: &GenerateParams) -> Result<()> {
        if p.tiling.enabled {
            return Ok(());
        }
        let device = self.opts.devices.vae.device();
        let (_, total) = device.memory();
        for (k, r) in p.ref_images.iter().enumerate() {
            let tokens = (r.width / VAE_SCALE) as f64 * (r.height / VAE_SCALE) as f64;
            let need = tokens * tokens * 4.0;
            if total > 0 && need > total as f64 {
                let problem = format!(
                    "the VAE's attention needs about {} to encode it, more than {} has ({}); \
                     let it be resized to the image's area (no --disable-auto-resize-ref-image) or use VAE tiling",
                    fmt_gib(need),
                    device.name(),
                    fmt_gib(total as f64)
                );
                return bad_setting(Setting::RefImage, format!("{} ({}x{})", k + 1, r.width, r.height), problem);
            }
        }
        Ok(())
    }

    /// The checks of [`Pipeline::check_request`] that need the model and the aligned size.
    fn check_model_limits(&self, p: &GenerateParams) -> Result<()> {
        p.tiling.validate([p.width, p.height], self.latent_scale())?;
        self.family.check_text(p.clip_skip)?;
        self.check_ref_memory(p)?;
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
    /// back after its stage ([`KeptWeights`]). The stages are in `pipeline/generate.rs`.
    fn generate_into(
        &self,
        request: &Request,
        progress: &mut dyn FnMut(Progress),
        report: &mut RunReport,
        kept: Option<&mut KeptWeights>,
    ) -> Result<Vec<Image>> {
        self.run_stages(request, &mut generate::RunOutputs { kept, report, progress })
    }
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
            ref_images: Vec::new(),
            auto_resize_ref_images: true,
            increase_ref_index: false,
            slg: None,
            img_cfg_scale: None,
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

    /// The reference's auto-resize: the generated area with the reference's aspect, sides
    /// rounded to the multiple; the area caps at 1024x1024's.
    #[test]
    fn reference_images_take_the_generated_area() {
        assert_eq!(ref_image_size((100, 40), 64 * 64, 16), (96, 48));
        assert_eq!(ref_image_size((64, 64), 64 * 48, 16), (48, 48));
        assert_eq!(ref_image_size((3000, 1000), 1024 * 1024, 16), (1776, 592));
        assert_eq!(ref_image_size((1, 400), 64 * 64, 16), (0, 1264));
    }
}
