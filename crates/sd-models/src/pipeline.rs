//! Text-to-image and image-to-image generation for SD 1.x / 2.x, end to end.
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
//! largest phase rather than the sum.

use std::sync::Arc;
use std::time::Instant;

use sd_backends::{Backend, GgmlType};
use sd_sched::{Ledgers, ParamHome, Runner, SourceError, TensorSource, Weights};
use sd_vae::{AutoencoderKl, FirstStage, Taesd, TilingParams, VaeConfig, VaeParts};

use crate::diffusion::unet::{UNetConfig, UNetModel};
use crate::files::{ModelFiles, ModelSources, Prediction as FilePrediction, PredictionSource};
use crate::loader::{dtype_of, FileSource};
use crate::sampling::{
    img2img_sigmas, noised_latent, sample, txt2img_latent, Denoised, DiscreteSchedule, GuidedDenoiser, ModelInput,
    ModelOutput, ModelVersion, Prediction, RngKind, SampleMethod, ScheduleContext, Scheduler,
};
use crate::text::clip::{clip_specs, ClipConfig, ClipTextModel};
use crate::text::conditioning::{encode_prompt, Conditioning};
use crate::text::ClipTokenizer;

/// Errors of a generation, each naming the stage and what failed.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Model files.
    #[error(transparent)]
    Files(#[from] crate::files::FilesError),
    /// A setting that cannot work.
    #[error("{0}")]
    Invalid(String),
    /// Loading or running the text encoder.
    #[error("text encoder: {0}")]
    Text(#[from] crate::text::clip::ClipError),
    /// Loading or running the UNet.
    #[error("diffusion model: {0}")]
    Diffusion(#[from] crate::diffusion::DiffusionError),
    /// Loading or running the VAE.
    #[error("VAE: {0}")]
    Vae(#[from] sd_vae::VaeError),
    /// Sampling.
    #[error("sampling: {0}")]
    Sampling(#[from] crate::sampling::SamplingError),
    /// Weights or execution.
    #[error(transparent)]
    Sched(#[from] sd_sched::SchedError),
}

/// Result alias.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

/// The device (backend) each module computes on.
#[derive(Clone, Debug)]
pub struct ModuleDevices {
    /// Text encoder.
    pub te: Arc<Backend>,
    /// UNet.
    pub diffusion: Arc<Backend>,
    /// VAE / TAESD.
    pub vae: Arc<Backend>,
}

/// How to load the model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The files.
    pub sources: ModelSources,
    /// `--prediction`.
    pub prediction: Option<FilePrediction>,
    /// `--type`: store weights in this type.
    pub wtype: Option<GgmlType>,
    /// Where each module runs.
    pub devices: ModuleDevices,
    /// `--diffusion-fa`.
    pub flash_attn: bool,
    /// Where parameters live, device budgets, segmented-execution flags.
    pub placement: Placement,
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
}

impl Default for ModuleHomes {
    fn default() -> Self {
        Self { te: ParamHome::Compute, diffusion: ParamHome::Compute, vae: ParamHome::Compute }
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
}

/// The staging group of a text-encoder or VAE tensor: its name up to the first block index
/// (`...encoder.layers.3`, `...decoder.up.1`), or without its last part.
fn block_group(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.iter().position(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
        Some(i) => parts[..=i].join("."),
        None => parts[..parts.len().saturating_sub(1).max(1)].join("."),
    }
}

/// One generation request (the reference's flags).
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
    /// `--cfg-scale`.
    pub cfg_scale: f32,
    /// `--sampling-method`.
    pub method: SampleMethod,
    /// `--scheduler`.
    pub scheduler: Scheduler,
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
    /// img2img: the init image, planar `[3, H, W]` in `[0, 1]`, and `--strength`.
    pub init_image: Option<(Vec<f32>, f32)>,
    /// VAE tiling.
    pub tiling: TilingParams,
    /// Cap on one VAE graph's compute buffer (triggers the tiled retry).
    pub vae_max_compute_bytes: Option<usize>,
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

/// What the pipeline reports while it runs.
#[derive(Clone, Debug)]
pub enum Progress {
    /// A stage finished, with its duration.
    Stage { name: &'static str, seconds: f64 },
    /// A sampling step finished.
    Step { image: usize, step: usize, steps: usize, seconds: f64 },
}

/// The loaded model family and its settings; weights are loaded per phase.
pub struct Pipeline {
    files: Arc<ModelFiles>,
    arch: &'static str,
    prediction: Prediction,
    clip: ClipConfig,
    unet: UNetConfig,
    opts: LoadOptions,
    tokenizer: ClipTokenizer,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pipeline({}, {:?})", self.arch, self.prediction)
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
    /// Opens the files, detects the architecture and checks the tensors against it.
    pub fn open(opts: LoadOptions) -> Result<Self> {
        let files = ModelFiles::open(&opts.sources)?;
        Self::from_files(files, opts)
    }

    /// Like [`Pipeline::open`], for files the caller has already opened (e.g. to plan).
    pub fn from_files(files: ModelFiles, opts: LoadOptions) -> Result<Self> {
        let detected = files.detect(opts.prediction)?;
        let (clip, unet) = match detected.arch {
            "sd1" => (ClipConfig::vit_l14(), UNetConfig::sd15()),
            "sd2" => (ClipConfig::vit_h14(), UNetConfig::sd21()),
            other => return Err(PipelineError::Invalid(format!("architecture `{other}` has no runtime yet"))),
        };
        let prediction = match detected.prediction {
            Some(FilePrediction::V) => Prediction::V,
            Some(FilePrediction::Eps) => Prediction::Eps,
            None => {
                tracing::warn!("the model files do not say whether the model predicts eps or v; assuming eps (use --prediction v for 768-v models)");
                Prediction::Eps
            }
        };
        if let PredictionSource::Metadata { key } = &detected.prediction_source {
            tracing::info!("prediction {} (from `{key}`)", prediction.name());
        }
        tracing::info!("model: {} ({} tensors), prediction {}", detected.arch, files.index().len(), prediction.name());
        let files = Arc::new(files);
        Ok(Self { files, arch: detected.arch, prediction, clip, unet, opts, tokenizer: ClipTokenizer::new() })
    }

    /// The detected architecture (`sd1`, `sd2`).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The sampling method the reference uses for this model when none is given.
    pub fn default_sample_method(&self) -> SampleMethod {
        SampleMethod::default_for(ModelVersion::from_arch(self.arch).unwrap_or_default())
    }

    /// The opened files.
    pub fn files(&self) -> &ModelFiles {
        &self.files
    }

    fn source(&self) -> Arc<dyn TensorSource + Send + Sync> {
        Arc::new(SharedFiles(self.files.clone()))
    }

    /// Gives `w` its home (groups: one per layer or stage); the runner stages them.
    fn place(&self, w: &mut Weights, module: &str, home: &ParamHome, compute: &Arc<Backend>) -> Result<()> {
        let p = &self.opts.placement;
        w.place(module, home.clone(), compute.clone(), &p.ledgers, &block_group, self.source())?;
        Ok(())
    }

    fn runner(&self, name: &str, backend: &Arc<Backend>) -> Runner {
        let p = &self.opts.placement;
        Runner::with_ledger(name, backend.clone(), p.ledgers.get(&backend.device().name()), p.sched)
    }

    fn load_clip(&self) -> Result<ClipTextModel> {
        let dtype = dtype_of(&self.files);
        let mut w = Weights::new(clip_specs(&self.clip, &dtype, self.opts.wtype))?;
        self.place(&mut w, "te", &self.opts.placement.homes.te, &self.opts.devices.te)?;
        Ok(ClipTextModel::new(self.clip.clone(), w)?)
    }

    fn load_unet(&self) -> Result<UNetModel> {
        let dtype = dtype_of(&self.files);
        let mut m = UNetModel::new(self.unet.clone(), &dtype, self.opts.wtype)?;
        let p = &self.opts.placement;
        let home = p.homes.diffusion.clone();
        let backend = self.opts.devices.diffusion.clone();
        m.weights.place("unet", home, backend, &p.ledgers, &crate::diffusion::unet::group_of, self.source())?;
        m.flash_attn = self.opts.flash_attn;
        Ok(m)
    }

    fn load_first_stage(&self, need_encoder: bool) -> Result<Box<dyn FirstStage>> {
        let home = &self.opts.placement.homes.vae;
        let backend = &self.opts.devices.vae;
        let vae_err = |e| sd_vae::VaeError::Weights { module: "VAE", source: e };
        if self.opts.sources.taesd.is_some() {
            let parts = if need_encoder { sd_vae::TaesdParts::Full } else { sd_vae::TaesdParts::DecoderOnly };
            let cfg = sd_vae::TaesdConfig::sd();
            let mut w = Weights::new(sd_vae::taesd_specs(&cfg, parts)).map_err(vae_err)?;
            self.place(&mut w, "vae", home, backend)?;
            return Ok(Box::new(Taesd::from_weights(cfg, w)?));
        }
        let parts = if need_encoder { VaeParts::Full } else { VaeParts::DecoderOnly };
        let mut w = Weights::new(sd_vae::vae_specs(&VaeConfig::sd(), parts)).map_err(vae_err)?;
        self.place(&mut w, "vae", home, backend)?;
        Ok(Box::new(AutoencoderKl::from_weights(VaeConfig::sd(), w)?))
    }

    /// One line per device for `-v`: managed high-water mark and budget.
    pub fn device_report(&self) -> Vec<String> {
        self.opts
            .placement
            .ledgers
            .all()
            .iter()
            .map(|l| {
                let budget = l
                    .budget()
                    .map_or_else(|| "no budget".to_string(), |b| format!("budget {:.1} MiB", b as f64 / 1048576.0));
                format!("{}: managed high-water {:.1} MiB ({budget})", l.device(), l.high_water() as f64 / 1048576.0)
            })
            .collect()
    }

    /// Generates `params.batch_count` images.
    pub fn generate(&self, p: &GenerateParams, progress: &mut dyn FnMut(Progress)) -> Result<Vec<Image>> {
        if p.width == 0 || p.height == 0 || !p.width.is_multiple_of(8) || !p.height.is_multiple_of(8) {
            return Err(PipelineError::Invalid(format!(
                "-W {} -H {}: width and height must be positive multiples of 8",
                p.width, p.height
            )));
        }
        if p.steps == 0 {
            return Err(PipelineError::Invalid("--steps 0: at least one sampling step is needed".into()));
        }
        if p.batch_count == 0 {
            return Err(PipelineError::Invalid("-b 0: the batch count must be at least 1".into()));
        }
        if !p.cfg_scale.is_finite() {
            return Err(PipelineError::Invalid(format!("--cfg-scale {}: not a number", p.cfg_scale)));
        }
        let (lw, lh) = (p.width / 8, p.height / 8);
        let channels = self.unet.in_channels as usize;
        let guided = p.cfg_scale != 1.0;

        // 1. Text.
        let t = Instant::now();
        let (cond, uncond) = {
            let model = self.load_clip()?;
            let mut runner = self.runner("te", &self.opts.devices.te);
            let cond = encode_prompt(&model, &mut runner, &self.tokenizer, &p.prompt, p.clip_skip)?;
            let uncond = if guided {
                Some(encode_prompt(&model, &mut runner, &self.tokenizer, &p.negative_prompt, p.clip_skip)?)
            } else {
                None
            };
            tracing::debug!("te params {}; {}", model.weights().home_description(), runner.summary());
            (cond, uncond)
        };
        let secs = t.elapsed().as_secs_f64();
        tracing::info!("text encoding took {secs:.2} s");
        progress(Progress::Stage { name: "text encode", seconds: secs });

        // 2. Schedule and, for img2img, the init latent.
        let schedule = DiscreteSchedule::sd();
        let model = ModelVersion::from_arch(self.arch).unwrap_or_default();
        let ctx = ScheduleContext { model, image_seq_len: lw * lh };
        let full = p.scheduler.sigmas_for(p.steps, &schedule, &ctx)?;
        let mut init_latent: Option<Vec<f32>> = None;
        let sigmas = match &p.init_image {
            None => full,
            Some((image, strength)) => {
                let t = Instant::now();
                let vae = self.load_first_stage(true)?;
                let mut runner = self.runner("vae", &self.opts.devices.vae);
                let px: Vec<f32> = match vae.image_range() {
                    sd_vae::ImageRange::MinusOneToOne => image.iter().map(|v| v * 2.0 - 1.0).collect(),
                    sd_vae::ImageRange::ZeroToOne => image.clone(),
                };
                let mut rng = p.rng.seeded(p.seed);
                let latent =
                    encode_latent(vae.as_ref(), &mut runner, &px, (p.width, p.height), &p.tiling, rng.as_mut())?;
                init_latent = Some(latent);
                let secs = t.elapsed().as_secs_f64();
                tracing::info!("init image encoded in {secs:.2} s");
                progress(Progress::Stage { name: "image encode", seconds: secs });
                img2img_sigmas(&full, *strength)?
            }
        };
        if sigmas.len() < 2 {
            return Err(PipelineError::Invalid("--strength too low: no sampling step remains".into()));
        }

        // 3. Sampling.
        let mut latents = Vec::with_capacity(p.batch_count);
        {
            let unet = self.load_unet()?;
            let mut runner = self.runner("unet", &self.opts.devices.diffusion);
            for b in 0..p.batch_count {
                let mut rng = p.rng.seeded(p.seed.wrapping_add(b as u64));
                let noise = rng.randn(channels * lh * lw);
                let x = match &init_latent {
                    None => txt2img_latent(&noise, sigmas[0]),
                    Some(init) => noised_latent(init, &noise, sigmas[0])?,
                };
                let mut step_start = Instant::now();
                let model = |inp: ModelInput<'_>| -> Result<ModelOutput> {
                    let out = eval_guided(
                        &unet,
                        &mut runner,
                        inp.x,
                        (lw, lh),
                        inp.timestep,
                        &cond,
                        uncond.as_ref().filter(|_| inp.uncond),
                    )?;
                    Ok(out)
                };
                let mut denoiser = GuidedDenoiser::new(&schedule, self.prediction, p.cfg_scale, model);
                let with_uncond = p.method.needs_uncond_denoised();
                let mut denoise = |x: &[f32], sigma: f32, step: crate::sampling::Step| -> Result<Denoised> {
                    let out = denoiser.denoise_full::<PipelineError>(x, sigma, step, with_uncond)?;
                    if step.last_eval {
                        let secs = step_start.elapsed().as_secs_f64();
                        tracing::info!(
                            "image {}/{} step {}/{} took {secs:.2} s",
                            b + 1,
                            p.batch_count,
                            step.index + 1,
                            step.count
                        );
                        progress(Progress::Step { image: b, step: step.index, steps: step.count, seconds: secs });
                        step_start = Instant::now();
                    }
                    Ok(out)
                };
                let eta = p.eta.unwrap_or_else(|| p.method.default_eta());
                let out = sample(p.method, &mut denoise, x, &sigmas, rng.as_mut(), eta)?;
                latents.push(out);
            }
            let moved = unet.weights.stats();
            tracing::debug!(
                "unet params {}; {}; copied {:.1} MiB to {} in {:.2} s",
                unet.weights.home_description(),
                runner.summary(),
                moved.copied_bytes as f64 / 1048576.0,
                runner.backend().device().name(),
                moved.copy_nanos as f64 * 1e-9
            );
        }

        // 4. Decoding.
        let t = Instant::now();
        let vae = self.load_first_stage(false)?;
        let mut runner = self.runner("vae", &self.opts.devices.vae);
        let mut images = Vec::with_capacity(latents.len());
        for mut latent in latents {
            vae.diffusion_to_vae(&mut latent);
            let img = sd_vae::decode_tiled(
                vae.as_ref(),
                &mut runner,
                &latent,
                (lw, lh),
                channels,
                &p.tiling,
                p.vae_max_compute_bytes,
            )?;
            images.push(planar_to_rgb8(&img, p.width, p.height, vae.image_range()));
        }
        tracing::debug!("vae; {}", runner.summary());
        let secs = t.elapsed().as_secs_f64();
        tracing::info!("decoding took {secs:.2} s");
        progress(Progress::Stage { name: "decode", seconds: secs });
        Ok(images)
    }
}

/// One guided model evaluation: cond and uncond as one batch of 2 when their token
/// counts agree (the same numbers as two runs to a few f16 ulps, fewer graph launches), else two runs.
fn eval_guided(
    unet: &UNetModel,
    runner: &mut Runner,
    x: &[f32],
    dims: (usize, usize),
    timestep: f32,
    cond: &Conditioning,
    uncond: Option<&Conditioning>,
) -> Result<ModelOutput> {
    match uncond {
        None => {
            let c = unet.eval(runner, x, dims, &[timestep], &cond.data, cond.n_tokens, 1)?;
            Ok(ModelOutput { cond: c, uncond: None })
        }
        Some(u) if u.n_tokens == cond.n_tokens => {
            let mut xx = Vec::with_capacity(2 * x.len());
            xx.extend_from_slice(x);
            xx.extend_from_slice(x);
            let mut ctx = Vec::with_capacity(cond.data.len() * 2);
            ctx.extend_from_slice(&cond.data);
            ctx.extend_from_slice(&u.data);
            let mut out = unet.eval(runner, &xx, dims, &[timestep, timestep], &ctx, cond.n_tokens, 2)?;
            let un = out.split_off(x.len());
            Ok(ModelOutput { cond: out, uncond: Some(un) })
        }
        Some(u) => {
            let c = unet.eval(runner, x, dims, &[timestep], &cond.data, cond.n_tokens, 1)?;
            let un = unet.eval(runner, x, dims, &[timestep], &u.data, u.n_tokens, 1)?;
            Ok(ModelOutput { cond: c, uncond: Some(un) })
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
) -> Result<Vec<f32>> {
    let (out, c) = sd_vae::encode_tiled(vae, runner, px, (w, h), 3, tiling, None)?;
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

fn planar_to_rgb8(img: &[f32], w: usize, h: usize, range: sd_vae::ImageRange) -> Image {
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
