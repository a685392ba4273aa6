//! Noise generators, noise schedules, denoiser parameterisations and samplers (pure Rust on `f32`).
//!
//! Design: sampling is a few hundred floating-point operations per latent element per step, so it
//! lives on the CPU in plain Rust on flat `f32` slices, with no ggml; the UNet is reached only
//! through a callback. The goal is to reproduce stable-diffusion.cpp's sampling to the bit, so that
//! the same seed and settings give the same image: every generator, scheduler and sampler follows
//! the reference's algorithm *and* its rounding (float vs double intermediate steps, operation
//! order, the order and size of noise draws, the number of model calls). Where the reference's
//! result depends on something outside its source (the C++ standard library, libm) we follow what
//! a Linux/libstdc++ build of the reference does; the module docs say where.
//!
//! Pieces, in the order a generation uses them:
//! - [`rng`]: [`NoiseRng`] and the reference's three generators (`--rng cuda|std_default|cpu`).
//! - [`schedule`]: the SD training schedule ([`DiscreteSchedule`]: sigma <-> timestep), the
//!   flow-matching schedules of FLUX.1 and SD3 ([`FlowSchedule`]; both behind [`NoiseSchedule`]), the
//!   [`Scheduler`]s that pick the sampling sigmas, img2img's [`img2img_sigmas`] and the initial
//!   latent ([`txt2img_latent`], [`noised_latent`]).
//! - [`denoiser`]: eps / v [`Prediction`] scalings and [`GuidedDenoiser`], which wraps a raw UNet
//!   callback with classifier-free guidance into the denoiser the samplers call.
//! - [`sampler`]: [`SampleMethod`] (all 18 of the reference's methods; the newer ones' loops are in
//!   `methods.rs`), [`sample`] and, on a flow schedule, [`sample_flow`].
//!
//! A text-to-image run, as the reference does it per image (seed `s + batch_index`):
//! ```
//! use sd_sampling::*;
//! # fn unet(_: ModelInput<'_>) -> Result<ModelOutput, SamplingError> { unimplemented!() }
//! # fn run() -> Result<Vec<f32>, SamplingError> {
//! let schedule = DiscreteSchedule::sd();
//! let method = SampleMethod::EulerA;
//! let sigmas = method.default_scheduler().sigmas(20, &schedule)?;
//! let mut rng = RngKind::Cuda.seeded(42);
//! let x = txt2img_latent(&rng.randn(4 * 64 * 64), sigmas[0]);
//! let mut den = GuidedDenoiser::new(&schedule, Prediction::Eps, 7.0, unet);
//! sample(method, &mut |x, s, st| den.denoise(x, s, st), x, &sigmas, rng.as_mut(), method.default_eta())
//! # }
//! ```
//! The noise is drawn in the reference's tensor order (width fastest, then height, then channel),
//! i.e. the row-major order of a `[C, H, W]` latent.

#![forbid(unsafe_code)]

pub mod denoiser;
mod methods;
pub mod rng;
pub mod sampler;
pub mod schedule;

#[cfg(test)]
mod tests;

// The README's example runs as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

pub use denoiser::{GuidedDenoiser, ModelInput, ModelOutput, Prediction, Scalings};
pub use rng::{new_rng, NoiseRng, PhiloxRng, RngKind, StdDefaultRng, TorchCpuRng};
pub use sampler::{sample, sample_flow, Denoised, SampleMethod};
pub use schedule::{
    empirical_mu, img2img_sigmas, noised_latent, scaled_linear_alphas_cumprod, txt2img_latent, AysLevels,
    DiscreteSchedule, FlowSchedule, FlowShift, NoiseSchedule, Schedule, ScheduleContext, Scheduler, AYS_SD15, AYS_SDXL,
    TIMESTEPS,
};

/// Where a denoiser evaluation sits in the sampling loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    /// The sampling step, counting from 0.
    pub index: usize,
    /// The number of sampling steps of the run (`sigmas.len() - 1`).
    pub count: usize,
    /// Whether this is the step's last model evaluation (second-order samplers evaluate twice per
    /// step except on their final step): a progress display advances after it.
    pub last_eval: bool,
    /// The first evaluation of a step of a sampler that evaluates twice per step (heun, dpm2,
    /// dpm++2s_a, res_2s), which the reference numbers negative: skip-layer guidance never
    /// applies to it ([`SkipLayerGuidance::applies`]).
    pub leading: bool,
}

/// Skip-layer guidance (`--slg-scale`, `--skip-layers`, `--skip-layer-start`, `--skip-layer-end`),
/// as the reference's `SkipLayerGuidance`: on the steps it applies to, the guided prediction
/// moves by `scale (cond - skipped)`, `skipped` being the prompt's prediction with the
/// diffusion model's blocks `layers` left out.
#[derive(Clone, Debug, PartialEq)]
pub struct SkipLayerGuidance {
    /// The factor (0: off).
    pub scale: f32,
    /// The blocks left out (SD3's joint blocks; the reference's default 7, 8, 9).
    pub layers: Vec<usize>,
    /// The fraction of the schedule where it starts (default 0.01).
    pub start: f32,
    /// The fraction where it ends (default 0.2).
    pub end: f32,
}

impl SkipLayerGuidance {
    /// Whether it applies to the evaluation `step`: the reference numbers evaluations from 1
    /// (a leading one negative) and takes those strictly between `start` and `end` of the
    /// schedule's length (steps + 1), each cut to an integer.
    pub fn applies(&self, step: Step) -> bool {
        if self.layers.is_empty() || self.scale == 0.0 {
            return false;
        }
        let size = (step.count + 1) as f32;
        let (from, to) = ((self.start * size) as i64, (self.end * size) as i64);
        let n = (step.index + 1) as i64 * if step.leading { -1 } else { 1 };
        n > from && n < to
    }
}

/// Errors of the sampling module: bad names, bad settings, inconsistent lengths.
#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    /// A name (sampler, scheduler, rng, prediction) that the reference does not accept either.
    #[error("unknown {what} '{name}'; accepted values: {accepted}")]
    UnknownName {
        /// Which kind of name (e.g. "sampling method").
        what: &'static str,
        /// The name as given.
        name: String,
        /// The accepted names, comma separated.
        accepted: String,
    },
    /// A name the reference accepts that this runtime does not implement yet.
    #[error(
        "{what} '{name}' is accepted by stable-diffusion.cpp but not implemented here; implemented: {implemented}"
    )]
    NotImplemented {
        /// Which kind of name.
        what: &'static str,
        /// The name as given.
        name: String,
        /// The implemented names, comma separated.
        implemented: String,
    },
    /// A scheduler that has no sigmas for this model or step count.
    #[error("scheduler {name}: {reason}")]
    UnsupportedSchedule {
        /// The scheduler's name.
        name: &'static str,
        /// Why.
        reason: String,
    },
    /// `--steps 0`.
    #[error("the number of steps must be at least 1, got 0")]
    ZeroSteps,
    /// More steps than the schedulers' 32-bit arithmetic supports.
    #[error("{0} steps are too many (at most {max})", max = u32::MAX)]
    TooManySteps(usize),
    /// A sigma schedule without a single step.
    #[error("a sampling schedule needs at least 2 sigmas (one step), got {0}")]
    EmptySchedule(usize),
    /// `--strength` outside [0, 1] (or NaN).
    #[error("the img2img strength must be between 0 and 1, got {0}")]
    InvalidStrength(f32),
    /// A checkpoint's `alphas_cumprod` tensor that cannot be a noise schedule.
    #[error("invalid alphas_cumprod: {0}")]
    InvalidAlphasCumprod(String),
    /// Guidance is on (`cfg != 1`) but the model callback returned no unconditional output.
    #[error("classifier-free guidance needs the unconditional model output, but the model callback returned none")]
    MissingUncond,
    /// Skip-layer guidance applies, but the model callback returned no prediction without the
    /// skipped layers.
    #[error(
        "skip-layer guidance needs the model output without the skipped layers, but the model callback returned none"
    )]
    MissingSkipped,
    /// A vector whose length does not match the latent's.
    #[error("{what} has {got} values, expected {expected} (the latent's size)")]
    LengthMismatch {
        /// Which vector.
        what: &'static str,
        /// The latent's number of elements.
        expected: usize,
        /// The vector's number of elements.
        got: usize,
    },
}

/// Parses `name` as one of `implemented` (by `name_of`), telling apart names the reference also
/// accepts (`reference_only`) from unknown ones.
fn parse_name<T: Copy>(
    what: &'static str,
    name: &str,
    implemented: &[T],
    name_of: impl Fn(T) -> &'static str,
    reference_only: &[&str],
) -> Result<T, SamplingError> {
    if let Some(&found) = implemented.iter().find(|&&k| name_of(k) == name) {
        return Ok(found);
    }
    let implemented_names: Vec<&str> = implemented.iter().map(|&k| name_of(k)).collect();
    if reference_only.contains(&name) {
        return Err(SamplingError::NotImplemented {
            what,
            name: name.to_owned(),
            implemented: implemented_names.join(", "),
        });
    }
    Err(SamplingError::UnknownName { what, name: name.to_owned(), accepted: implemented_names.join(", ") })
}
