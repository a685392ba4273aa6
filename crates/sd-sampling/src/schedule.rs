//! Noise schedules: the SD training schedule, the flow-matching schedules of the DiT models
//! (FLUX.1, SD3), sigma<->timestep conversion and the step schedulers.
//!
//! Every scheduler reads a model's schedule only through [`NoiseSchedule`] (`sigma_min`,
//! `sigma_max`, `t_to_sigma`), as the reference's schedulers read its `Denoiser`, so the same
//! `--scheduler` spacing applies to [`DiscreteSchedule`] and [`FlowSchedule`] alike.
//!
//! SD 1.x/2.x were trained on 1000 discrete timesteps with "scaled linear" betas; the sampler
//! works in sigma space (`sigma_t = sqrt((1 - alphabar_t) / alphabar_t)`), and the UNet is given
//! the (fractional) timestep found by interpolating `log sigma` in that table. A scheduler picks
//! `steps` sigmas from high to low and appends a final 0.
//!
//! Every formula follows the reference's float/double rounding step by step (see the comments),
//! because a 1-ulp difference in a sigma changes every later step. Two places deliberately differ:
//! `karras` and `exponential` with a single step divide 0 by 0 in the reference and give NaN; here
//! they give `[sigma_max, 0]`.

use std::fmt;
use std::str::FromStr;

use super::{parse_name, SamplingError};

/// Number of training timesteps of the SD 1.x/2.x noise schedule.
pub const TIMESTEPS: usize = 1000;

/// `linear_start` of SD 1.x/2.x's scaled-linear betas.
pub const SD_LINEAR_START: f32 = 0.00085;
/// `linear_end` of SD 1.x/2.x's scaled-linear betas.
pub const SD_LINEAR_END: f32 = 0.0120;

/// `alphas_cumprod` of a "scaled linear" beta schedule (betas linear in sqrt space), in float with
/// a running product, as the reference computes it when the checkpoint carries no table.
pub fn scaled_linear_alphas_cumprod(linear_start: f32, linear_end: f32) -> Vec<f32> {
    let ls_sqrt = linear_start.sqrt();
    let le_sqrt = linear_end.sqrt();
    let amount = le_sqrt - ls_sqrt;
    let mut product = 1.0_f32;
    (0..TIMESTEPS)
        .map(|i| {
            let beta = ls_sqrt + amount * (i as f32 / (TIMESTEPS - 1) as f32);
            // `powf(beta, 2.0f)`: compilers fold it to beta * beta, which is exact-rounded anyway.
            product *= 1.0 - beta * beta;
            product
        })
        .collect()
}

/// `std::min(a, b)`: returns `a` unless `b < a` (so a NaN `b` yields `a`).
pub(super) fn cpp_min(a: f32, b: f32) -> f32 {
    if b < a {
        b
    } else {
        a
    }
}

/// `std::max(a, b)`: returns `a` unless `a < b`.
pub(super) fn cpp_max(a: f32, b: f32) -> f32 {
    if a < b {
        b
    } else {
        a
    }
}

/// The discrete (CompVis) noise schedule of an SD model: 1000 sigmas and their logs.
#[derive(Clone)]
pub struct DiscreteSchedule {
    sigmas: Vec<f32>,
    log_sigmas: Vec<f32>,
}

impl fmt::Debug for DiscreteSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiscreteSchedule")
            .field("sigma_min", &self.sigma_min())
            .field("sigma_max", &self.sigma_max())
            .finish_non_exhaustive()
    }
}

impl Default for DiscreteSchedule {
    fn default() -> Self {
        Self::sd()
    }
}

impl DiscreteSchedule {
    /// The SD 1.x/2.x schedule (scaled linear, 0.00085 .. 0.012, 1000 steps).
    pub fn sd() -> Self {
        Self::from_valid_alphas_cumprod(&scaled_linear_alphas_cumprod(SD_LINEAR_START, SD_LINEAR_END))
    }

    /// A schedule from a checkpoint's own `alphas_cumprod` tensor (1000 values, each in (0, 1)).
    pub fn from_alphas_cumprod(alphas_cumprod: &[f32]) -> Result<Self, SamplingError> {
        if alphas_cumprod.len() != TIMESTEPS {
            return Err(SamplingError::InvalidAlphasCumprod(format!(
                "expected {TIMESTEPS} values, got {}",
                alphas_cumprod.len()
            )));
        }
        if let Some((i, v)) = alphas_cumprod.iter().enumerate().find(|(_, v)| !(**v > 0.0 && **v < 1.0)) {
            return Err(SamplingError::InvalidAlphasCumprod(format!("value {v} at index {i} is not in (0, 1)")));
        }
        Ok(Self::from_valid_alphas_cumprod(alphas_cumprod))
    }

    fn from_valid_alphas_cumprod(alphas_cumprod: &[f32]) -> Self {
        let sigmas: Vec<f32> = alphas_cumprod.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect();
        let log_sigmas = sigmas.iter().map(|s| s.ln()).collect();
        DiscreteSchedule { sigmas, log_sigmas }
    }

    /// The 1000 training sigmas, lowest noise first.
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// The smallest training sigma (timestep 0).
    pub fn sigma_min(&self) -> f32 {
        self.sigmas[0]
    }

    /// The largest training sigma (timestep 999).
    pub fn sigma_max(&self) -> f32 {
        self.sigmas[TIMESTEPS - 1]
    }

    /// `log sigma` at a table index as the reference reads it. Index -1 happens for some step
    /// counts of the discrete scheduler (its last timestep rounds to -6.1e-5); the reference then
    /// reads one float before its `log_sigmas` array, which is the last entry of its `sigmas` array
    /// (not a log). We read the same value so that those schedules agree. Other indexes never occur
    /// for the schedulers here; they are clamped.
    fn log_sigma_at(&self, index: i64) -> f32 {
        if index == -1 {
            self.sigmas[TIMESTEPS - 1]
        } else {
            self.log_sigmas[index.clamp(0, TIMESTEPS as i64 - 1) as usize]
        }
    }

    /// The fractional timestep of `sigma`: linear interpolation of `log sigma` between the two
    /// neighbouring table entries, clamped to [0, 999]. This is what the UNet is given.
    pub fn sigma_to_t(&self, sigma: f32) -> f32 {
        let log_sigma = sigma.ln();
        let count = self.log_sigmas.iter().filter(|&&ls| log_sigma - ls >= 0.0).count() as i64;
        let low_idx = (count - 1).clamp(0, TIMESTEPS as i64 - 2);
        let high_idx = low_idx + 1;
        let low = self.log_sigmas[low_idx as usize];
        let high = self.log_sigmas[high_idx as usize];
        let w = (low - log_sigma) / (low - high);
        let w = cpp_max(0.0, cpp_min(1.0, w));
        (1.0 - w) * low_idx as f32 + w * high_idx as f32
    }

    /// The sigma of a fractional timestep: `exp` of the linearly interpolated `log sigma`.
    pub fn t_to_sigma(&self, t: f32) -> f32 {
        let low_idx = t.floor() as i64;
        let high_idx = t.ceil() as i64;
        let w = t - low_idx as f32;
        let log_sigma = (1.0 - w) * self.log_sigma_at(low_idx) + w * self.log_sigma_at(high_idx);
        log_sigma.exp()
    }
}

/// What the schedulers and the denoiser read from a model's noise schedule (the reference's
/// `Denoiser` interface): the sigma range, timestep -> sigma for the schedulers, and sigma ->
/// the timestep the diffusion model is given.
pub trait NoiseSchedule {
    /// The smallest sigma (timestep 0).
    fn sigma_min(&self) -> f32;
    /// The largest sigma (timestep 999).
    fn sigma_max(&self) -> f32;
    /// The sigma of a (fractional) timestep in [0, 999].
    fn t_to_sigma(&self, t: f32) -> f32;
    /// The timestep the diffusion model reads for `sigma`.
    fn sigma_to_t(&self, sigma: f32) -> f32;
    /// Whether this is a flow-matching schedule (the reference's `is_flow_denoiser`): sigma in
    /// (0, 1], `x = (1 - sigma) x0 + sigma noise`, and the ancestral samplers' flow variants.
    fn is_flow(&self) -> bool {
        false
    }
}

impl NoiseSchedule for DiscreteSchedule {
    fn sigma_min(&self) -> f32 {
        DiscreteSchedule::sigma_min(self)
    }

    fn sigma_max(&self) -> f32 {
        DiscreteSchedule::sigma_max(self)
    }

    fn t_to_sigma(&self, t: f32) -> f32 {
        DiscreteSchedule::t_to_sigma(self, t)
    }

    fn sigma_to_t(&self, sigma: f32) -> f32 {
        DiscreteSchedule::sigma_to_t(self, sigma)
    }
}

/// Which flow-matching time shift a [`FlowSchedule`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlowShift {
    /// `sigma = e^mu / (e^mu + (1/t - 1))` with `mu = shift` (FLUX.1's; the reference's
    /// `FluxFlowDenoiser`); the model reads the timestep `sigma` itself.
    Exponential,
    /// `sigma = shift t / (1 + (shift - 1) t)` (SD3's; the reference's
    /// `DiscreteFlowDenoiser`); the model reads `sigma * 1000`.
    Linear,
    /// The exponential shift with a `mu` derived from the step count and the image's latent
    /// positions ([`empirical_mu`], the reference's `compute_empirical_mu`); see
    /// [`FlowSchedule::for_image`]. Until resolved it runs as [`FlowShift::Exponential`] with
    /// its `shift`.
    Empirical,
}

/// The empirical time shift `mu` for `steps` steps over `image_seq_len` latent positions, in
/// f32 as the reference's `compute_empirical_mu` computes it.
#[allow(clippy::excessive_precision)]
pub fn empirical_mu(steps: u32, image_seq_len: usize) -> f32 {
    let (a1, b1, a2, b2) = (8.73809524e-05_f32, 1.89833333_f32, 0.00016927_f32, 0.45666666_f32);
    let seq = image_seq_len as f32;
    if image_seq_len > 4300 {
        return a2 * seq + b2;
    }
    let m_200 = a2 * seq + b2;
    let m_10 = a1 * seq + b1;
    let a = (m_200 - m_10) / 190.0;
    let b = m_200 - 200.0 * a;
    a * steps as f32 + b
}

/// A flow-matching schedule: 1000 training timesteps `t = (i + 1) / 1000` mapped to sigmas by a
/// time shift, scalings `c_skip = 1, c_out = -sigma, c_in = 1` ([`crate::Prediction::Flow`]).
///
/// A family picks the kind and its default shift (a constant `mu`, or one derived from the
/// image size); `--flow-shift` overrides a constant shift.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlowSchedule {
    kind: FlowShift,
    shift: f32,
}

impl FlowSchedule {
    /// The exponential time shift with `mu` ([`FlowShift::Exponential`]).
    pub fn exponential(mu: f32) -> Self {
        FlowSchedule { kind: FlowShift::Exponential, shift: mu }
    }

    /// The linear time shift with `shift` ([`FlowShift::Linear`]).
    pub fn linear(shift: f32) -> Self {
        FlowSchedule { kind: FlowShift::Linear, shift }
    }

    /// The empirical schedule ([`FlowShift::Empirical`]): its `mu` follows the image and the
    /// steps.
    pub fn empirical() -> Self {
        FlowSchedule { kind: FlowShift::Empirical, shift: 1.0 }
    }

    /// The same kind with another shift (`--flow-shift`). The empirical shift is derived from
    /// the image whatever is asked (the reference sets it again in `get_sigmas`), so it stays.
    pub fn with_shift(self, shift: f32) -> Self {
        match self.kind {
            FlowShift::Empirical => self,
            _ => FlowSchedule { shift, ..self },
        }
    }

    /// The schedule a run of `steps` steps over `image_seq_len` latent positions samples with:
    /// the empirical one becomes the exponential shift with [`empirical_mu`]; the others stay.
    pub fn for_image(self, steps: usize, image_seq_len: usize) -> Self {
        match self.kind {
            FlowShift::Empirical => {
                FlowSchedule::exponential(empirical_mu(u32::try_from(steps).unwrap_or(u32::MAX), image_seq_len))
            }
            _ => self,
        }
    }

    /// The kind of time shift.
    pub fn kind(&self) -> FlowShift {
        self.kind
    }

    /// The shift (`mu` of the exponential shift).
    pub fn shift(&self) -> f32 {
        self.shift
    }

    /// The flow noising `latent * (1 - sigma) + noise * sigma` (img2img's start, in f32 in this
    /// order as the reference's `noise_scaling`).
    pub fn noised_latent(&self, init: &[f32], noise: &[f32], sigma: f32) -> Result<Vec<f32>, SamplingError> {
        if init.len() != noise.len() {
            return Err(SamplingError::LengthMismatch { what: "noise", expected: init.len(), got: noise.len() });
        }
        let keep = 1.0 - sigma;
        Ok(init.iter().zip(noise).map(|(&l, &n)| l * keep + n * sigma).collect())
    }
}

impl NoiseSchedule for FlowSchedule {
    fn sigma_min(&self) -> f32 {
        self.t_to_sigma(0.0)
    }

    fn sigma_max(&self) -> f32 {
        self.t_to_sigma(T_MAX as f32)
    }

    fn t_to_sigma(&self, t: f32) -> f32 {
        let t = (t + 1.0) / TIMESTEPS as f32;
        match self.kind {
            FlowShift::Exponential | FlowShift::Empirical => {
                // `expf(mu) / (expf(mu) + powf(1/t - 1, 1.0f))`, all in float.
                let e = self.shift.exp();
                e / (e + (1.0 / t - 1.0).powf(1.0))
            }
            FlowShift::Linear => {
                if self.shift == 1.0 {
                    t
                } else {
                    self.shift * t / (1.0 + (self.shift - 1.0) * t)
                }
            }
        }
    }

    fn sigma_to_t(&self, sigma: f32) -> f32 {
        match self.kind {
            FlowShift::Exponential | FlowShift::Empirical => sigma,
            FlowShift::Linear => sigma * 1000.0,
        }
    }

    fn is_flow(&self) -> bool {
        true
    }
}

/// A model's noise schedule, discrete (SD 1.x/2.x, SDXL) or flow-matching (FLUX.1, SD3): what a
/// family's sampling defaults name, converted from either.
#[derive(Clone, Debug)]
pub enum Schedule {
    /// The CompVis discrete schedule.
    Discrete(DiscreteSchedule),
    /// A flow-matching schedule.
    Flow(FlowSchedule),
}

impl From<DiscreteSchedule> for Schedule {
    fn from(s: DiscreteSchedule) -> Self {
        Schedule::Discrete(s)
    }
}

impl From<FlowSchedule> for Schedule {
    fn from(s: FlowSchedule) -> Self {
        Schedule::Flow(s)
    }
}

impl Schedule {
    /// The schedule a run of `steps` steps over `image_seq_len` latent positions samples with
    /// ([`FlowSchedule::for_image`]).
    pub fn for_image(&self, steps: usize, image_seq_len: usize) -> Self {
        match self {
            Schedule::Flow(f) => Schedule::Flow(f.for_image(steps, image_seq_len)),
            other => other.clone(),
        }
    }

    fn inner(&self) -> &dyn NoiseSchedule {
        match self {
            Schedule::Discrete(d) => d,
            Schedule::Flow(f) => f,
        }
    }
}

impl NoiseSchedule for Schedule {
    fn sigma_min(&self) -> f32 {
        self.inner().sigma_min()
    }

    fn sigma_max(&self) -> f32 {
        self.inner().sigma_max()
    }

    fn t_to_sigma(&self, t: f32) -> f32 {
        self.inner().t_to_sigma(t)
    }

    fn sigma_to_t(&self, sigma: f32) -> f32 {
        self.inner().sigma_to_t(sigma)
    }

    fn is_flow(&self) -> bool {
        self.inner().is_flow()
    }
}

/// Align Your Steps' noise levels for a model (`--scheduler ays`): NVIDIA publishes 10-step
/// tables per model, so the model's family says which one it uses, or that it has none.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AysLevels {
    /// A published 10-step table ([`AYS_SD15`], [`AYS_SDXL`]).
    Table(&'static [f32; 11]),
    /// No published table; the text names the model (`SD 2.x`) in the error.
    Unpublished(&'static str),
}

impl Default for AysLevels {
    /// The SD 1.5 table, as the reference uses when it is given no model.
    fn default() -> Self {
        AysLevels::Table(&AYS_SD15)
    }
}

/// What a scheduler may depend on besides the step count and the noise schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScheduleContext {
    /// The model's Align Your Steps levels (`ays`).
    pub ays: AysLevels,
    /// Latent positions of the image, `(H / 8) * (W / 8)` (`ltx2` shifts by it; 0 means the
    /// reference's fallback of 4096).
    pub image_seq_len: usize,
}

/// How the sampling sigmas are spaced (`--scheduler`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scheduler {
    /// Timesteps evenly spaced from 999 to 0 (inclusive), mapped to sigmas.
    #[default]
    Discrete,
    /// Karras et al. 2022, rho = 7, between the model's sigma_min and sigma_max.
    Karras,
    /// Evenly spaced in log sigma between sigma_max and sigma_min.
    Exponential,
    /// Align Your Steps: NVIDIA's 10-step SD 1.5 noise levels, log-linearly resampled to `n`.
    Ays,
    /// GITS (coefficient 1.20): searched SD 1.5 sigma tables for 2-20 steps, resampled beyond.
    Gits,
    /// `n + 1` timesteps evenly spaced from 999 to 0; the last one replaced by sigma 0.
    SgmUniform,
    /// Every `1000 / n`-th timestep from the top (integer truncation), as ComfyUI's "simple".
    Simple,
    /// Smoothstep-shaped timesteps.
    Smoothstep,
    /// "KL optimal": evenly spaced in atan(sigma).
    KlOptimal,
    /// The LCM training timesteps (50 original steps, every 20th timestep).
    Lcm,
    /// Two arctangent ramps (sigma_max to the midpoint, then to sigma_min), pivots at 60%.
    BongTangent,
    /// LTX-2's flow schedule: `1 - i/n` shifted by the image's token count and stretched so the
    /// last non-zero sigma is 0.1. Sigmas stay in (0, 1], which for an SD model is low noise.
    Ltx2,
}

impl Scheduler {
    /// Every scheduler of the reference, in its enum order.
    pub const ALL: [Scheduler; 12] = [
        Scheduler::Discrete,
        Scheduler::Karras,
        Scheduler::Exponential,
        Scheduler::Ays,
        Scheduler::Gits,
        Scheduler::SgmUniform,
        Scheduler::Simple,
        Scheduler::Smoothstep,
        Scheduler::KlOptimal,
        Scheduler::Lcm,
        Scheduler::BongTangent,
        Scheduler::Ltx2,
    ];

    /// Names the reference accepts that are not implemented here (none).
    pub const NOT_IMPLEMENTED: [&'static str; 0] = [];

    /// The name the reference's CLI accepts.
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Discrete => "discrete",
            Scheduler::Karras => "karras",
            Scheduler::Exponential => "exponential",
            Scheduler::Ays => "ays",
            Scheduler::Gits => "gits",
            Scheduler::SgmUniform => "sgm_uniform",
            Scheduler::Simple => "simple",
            Scheduler::Smoothstep => "smoothstep",
            Scheduler::KlOptimal => "kl_optimal",
            Scheduler::Lcm => "lcm",
            Scheduler::BongTangent => "bong_tangent",
            Scheduler::Ltx2 => "ltx2",
        }
    }

    /// The `steps + 1` sigmas (the last one 0) for `schedule`, for an SD 1.x model of the
    /// reference's fallback size (see [`Scheduler::sigmas_for`]). Zero steps is an error.
    pub fn sigmas<S: NoiseSchedule + ?Sized>(self, steps: usize, schedule: &S) -> Result<Vec<f32>, SamplingError> {
        self.sigmas_for(steps, schedule, &ScheduleContext::default())
    }

    /// The `steps + 1` sigmas (the last one 0) for `schedule` and the model and image in `ctx`.
    /// Zero steps is an error, and so are the cases where the reference reads outside its
    /// tables (`gits` with one step, `ays` on SD 2.x).
    pub fn sigmas_for<S: NoiseSchedule + ?Sized>(
        self,
        steps: usize,
        schedule: &S,
        ctx: &ScheduleContext,
    ) -> Result<Vec<f32>, SamplingError> {
        if steps == 0 {
            return Err(SamplingError::ZeroSteps);
        }
        let n = u32::try_from(steps).map_err(|_| SamplingError::TooManySteps(steps))?;
        let unsupported =
            |reason: &str| SamplingError::UnsupportedSchedule { name: self.name(), reason: reason.into() };
        Ok(match self {
            Scheduler::Discrete => discrete(n, schedule),
            Scheduler::Karras => karras(n, schedule.sigma_min(), schedule.sigma_max()),
            Scheduler::Exponential => exponential(n, schedule.sigma_min(), schedule.sigma_max()),
            Scheduler::Ays => match ctx.ays {
                AysLevels::Table(levels) => ays(n, levels),
                AysLevels::Unpublished(model) => {
                    return Err(unsupported(&format!(
                        "Align Your Steps has noise levels for SD 1.5 (and SDXL/SVD), not {model}"
                    )))
                }
            },
            Scheduler::Gits => {
                if n < 2 {
                    return Err(unsupported("its tables start at 2 steps"));
                }
                gits(n)
            }
            Scheduler::SgmUniform => sgm_uniform(n, schedule),
            Scheduler::Simple => simple(n, schedule),
            Scheduler::Smoothstep => smoothstep(n, schedule),
            Scheduler::KlOptimal => kl_optimal(n, schedule.sigma_min(), schedule.sigma_max()),
            Scheduler::Lcm => lcm(n, schedule),
            Scheduler::BongTangent => bong_tangent(n, schedule.sigma_min(), schedule.sigma_max()),
            Scheduler::Ltx2 => ltx2(n, ctx.image_seq_len),
        })
    }
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Scheduler {
    type Err = SamplingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("scheduler", s, &Scheduler::ALL, |k| k.name(), &Scheduler::NOT_IMPLEMENTED)
    }
}

const T_MAX: i32 = TIMESTEPS as i32 - 1;

fn discrete<S: NoiseSchedule + ?Sized>(n: u32, schedule: &S) -> Vec<f32> {
    if n == 1 {
        return vec![schedule.t_to_sigma(T_MAX as f32), 0.0];
    }
    let step = T_MAX as f32 / (n - 1) as f32;
    let mut out: Vec<f32> = (0..n).map(|i| schedule.t_to_sigma(T_MAX as f32 - step * i as f32)).collect();
    out.push(0.0);
    out
}

fn karras(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    let rho = 7.0_f32;
    let sigma_min = if sigma_min <= 1e-6 { 1e-6 } else { sigma_min };
    // The reference's unqualified `pow` on floats is the double one.
    let min_inv_rho = f64::from(sigma_min).powf(f64::from(1.0_f32 / rho)) as f32;
    let max_inv_rho = f64::from(sigma_max).powf(f64::from(1.0_f32 / rho)) as f32;
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            // One step: the reference computes 0 / 0 here; we take the first point of the ramp.
            let ramp = if n == 1 { 0.0 } else { i as f32 / (n as f32 - 1.0) };
            let base = max_inv_rho + ramp * (min_inv_rho - max_inv_rho);
            f64::from(base).powf(f64::from(rho)) as f32
        })
        .collect();
    out.push(0.0);
    out
}

fn exponential(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    let log_sigma_min = sigma_min.ln();
    let log_sigma_max = sigma_max.ln();
    // One step: the reference divides by zero here (NaN); we keep the first point.
    let step = if n == 1 { 0.0 } else { (log_sigma_max - log_sigma_min) / (n - 1) as f32 };
    let mut out: Vec<f32> = (0..n).map(|i| (log_sigma_max - step * i as f32).exp()).collect();
    out.push(0.0);
    out
}

/// `n` float points from `start` to `end` by repeated addition of `(end - start) / (n - 1)`.
fn linear_space(start: f32, end: f32, num_points: usize) -> Vec<f32> {
    let inc = (end - start) / (num_points - 1) as f32;
    let mut out = Vec::with_capacity(num_points);
    let mut v = start;
    out.push(v);
    for _ in 1..num_points {
        v += inc;
        out.push(v);
    }
    out
}

fn sgm_uniform<S: NoiseSchedule + ?Sized>(n: u32, schedule: &S) -> Vec<f32> {
    let timesteps = linear_space(T_MAX as f32, 0.0, n as usize + 1);
    let mut out: Vec<f32> = timesteps[..n as usize].iter().map(|&t| schedule.t_to_sigma(t)).collect();
    out.push(0.0);
    out
}

fn simple<S: NoiseSchedule + ?Sized>(n: u32, schedule: &S) -> Vec<f32> {
    let len = TIMESTEPS as i32;
    let step_factor = len as f32 / n as f32;
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let offset = (i as f32 * step_factor) as i32;
            let index = (len - 1 - offset).max(0);
            schedule.t_to_sigma(index as f32)
        })
        .collect();
    out.push(0.0);
    out
}

fn smoothstep<S: NoiseSchedule + ?Sized>(n: u32, schedule: &S) -> Vec<f32> {
    if n == 1 {
        return vec![schedule.t_to_sigma(T_MAX as f32), 0.0];
    }
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let u = 1.0 - i as f32 / n as f32;
            let s = u * u * (3.0 - 2.0 * u);
            schedule.t_to_sigma((s * T_MAX as f32).round())
        })
        .collect();
    out.push(0.0);
    out
}

fn kl_optimal(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    if n == 1 {
        return vec![sigma_max, 0.0];
    }
    let sigma_min = if sigma_min <= 1e-6 { 1e-6 } else { sigma_min };
    let alpha_min = sigma_min.atan();
    let alpha_max = sigma_max.atan();
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let t = i as f32 / (n - 1) as f32;
            (t * alpha_min + (1.0 - t) * alpha_max).tan()
        })
        .collect();
    out.push(0.0);
    out
}

fn lcm<S: NoiseSchedule + ?Sized>(n: u32, schedule: &S) -> Vec<f32> {
    const ORIGINAL_STEPS: u32 = 50;
    const K: i32 = TIMESTEPS as i32 / ORIGINAL_STEPS as i32;
    let mut out: Vec<f32> = (0..n)
        .map(|i| {
            let index = (u64::from(i) * u64::from(ORIGINAL_STEPS) / u64::from(n)) as i32;
            let timestep = (ORIGINAL_STEPS as i32 - index) * K - 1;
            schedule.t_to_sigma(timestep as f32)
        })
        .collect();
    out.push(0.0);
    out
}

/// GITS sigmas for coefficient 1.20 (the reference's fixed choice), for 2 to 20 steps: row
/// `steps - 2` has `steps + 1` entries. Data from the GITS paper's SD 1.5 search, as the reference ships it.
#[allow(clippy::excessive_precision)]
const GITS_1_20: [&[f32]; 19] = [
    &[14.61464119, 0.803307, 0.02916753],
    &[14.61464119, 1.56271636, 0.52423614, 0.02916753],
    &[14.61464119, 2.36326075, 0.92192322, 0.36617002, 0.02916753],
    &[14.61464119, 2.84484982, 1.24153244, 0.59516323, 0.25053367, 0.02916753],
    &[14.61464119, 5.85520077, 2.05039096, 0.95350921, 0.45573691, 0.17026083, 0.02916753],
    &[14.61464119, 5.85520077, 2.45070267, 1.24153244, 0.64427125, 0.29807833, 0.09824532, 0.02916753],
    &[14.61464119, 5.85520077, 2.45070267, 1.36964464, 0.803307, 0.45573691, 0.25053367, 0.09824532, 0.02916753],
    &[
        14.61464119,
        5.85520077,
        2.84484982,
        1.61558151,
        0.95350921,
        0.59516323,
        0.36617002,
        0.19894916,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        5.85520077,
        2.84484982,
        1.67050016,
        1.08895338,
        0.74807048,
        0.50118381,
        0.32104823,
        0.19894916,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        5.85520077,
        2.95596409,
        1.84880662,
        1.24153244,
        0.83188516,
        0.59516323,
        0.41087446,
        0.27464288,
        0.17026083,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        5.85520077,
        3.07277966,
        1.98035145,
        1.36964464,
        0.95350921,
        0.69515091,
        0.50118381,
        0.36617002,
        0.25053367,
        0.17026083,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        6.77309084,
        3.46139455,
        2.36326075,
        1.56271636,
        1.08895338,
        0.803307,
        0.59516323,
        0.45573691,
        0.34370604,
        0.25053367,
        0.17026083,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        6.77309084,
        3.46139455,
        2.45070267,
        1.61558151,
        1.162866,
        0.86115354,
        0.64427125,
        0.50118381,
        0.38853383,
        0.29807833,
        0.22545385,
        0.17026083,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        7.49001646,
        4.65472794,
        3.07277966,
        2.12350607,
        1.51179266,
        1.08895338,
        0.83188516,
        0.64427125,
        0.50118381,
        0.38853383,
        0.29807833,
        0.22545385,
        0.17026083,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        7.49001646,
        4.65472794,
        3.07277966,
        2.12350607,
        1.51179266,
        1.08895338,
        0.83188516,
        0.64427125,
        0.50118381,
        0.41087446,
        0.32104823,
        0.25053367,
        0.19894916,
        0.13792117,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        7.49001646,
        4.65472794,
        3.07277966,
        2.12350607,
        1.51179266,
        1.08895338,
        0.83188516,
        0.64427125,
        0.50118381,
        0.41087446,
        0.34370604,
        0.27464288,
        0.22545385,
        0.17026083,
        0.13792117,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        7.49001646,
        4.65472794,
        3.07277966,
        2.19988537,
        1.61558151,
        1.20157266,
        0.92192322,
        0.72133851,
        0.57119018,
        0.45573691,
        0.36617002,
        0.29807833,
        0.25053367,
        0.19894916,
        0.17026083,
        0.13792117,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        7.49001646,
        4.65472794,
        3.07277966,
        2.19988537,
        1.61558151,
        1.24153244,
        0.95350921,
        0.74807048,
        0.59516323,
        0.4783645,
        0.38853383,
        0.32104823,
        0.27464288,
        0.22545385,
        0.19894916,
        0.17026083,
        0.13792117,
        0.09824532,
        0.02916753,
    ],
    &[
        14.61464119,
        7.49001646,
        4.65472794,
        3.07277966,
        2.19988537,
        1.61558151,
        1.24153244,
        0.95350921,
        0.74807048,
        0.59516323,
        0.50118381,
        0.41087446,
        0.34370604,
        0.29807833,
        0.25053367,
        0.22545385,
        0.19894916,
        0.17026083,
        0.13792117,
        0.09824532,
        0.02916753,
    ],
];

/// Align Your Steps' 10-step noise levels for SD 1.5 (NVIDIA's published table).
#[allow(clippy::excessive_precision)]
pub const AYS_SD15: [f32; 11] = [
    14.6146412293,
    6.4745760956,
    3.8636745985,
    2.6946151520,
    1.8841921177,
    1.3943805092,
    0.9642583904,
    0.6523686016,
    0.3977456272,
    0.1515232662,
    0.0291671582,
];

/// Align Your Steps' 10-step noise levels for SDXL (NVIDIA's published table).
#[allow(clippy::excessive_precision)]
pub const AYS_SDXL: [f32; 11] = [
    14.6146412293,
    6.3184485287,
    3.7681790315,
    2.1811480769,
    1.3405244945,
    0.8620721141,
    0.5550693289,
    0.3798540708,
    0.2332364134,
    0.1114188177,
    0.0291671582,
];

/// Resamples a descending sigma table to `new_len` points, linearly in log sigma over an evenly
/// spaced [0, 1] (float grids by repeated addition, interpolation in double).
fn log_linear_interpolation(sigmas: &[f32], new_len: usize) -> Vec<f32> {
    let len = sigmas.len();
    let xs = linear_space(0.0, 1.0, len);
    let ys: Vec<f32> = sigmas.iter().rev().map(|s| s.ln()).collect();
    let mut new_xs = linear_space(0.0, 1.0, new_len);
    // Keep the new grid inside the old one at both ends.
    if new_xs[0] < xs[0] {
        new_xs[0] = xs[0];
    }
    if new_xs[new_len - 1] > xs[len - 1] {
        new_xs[new_len - 1] = xs[len - 1];
    }
    let mut new_ys = vec![0.0_f64; new_len];
    let mut j = 0;
    let mut i = 0;
    while i < new_len {
        if xs[j] > new_xs[i] || new_xs[i] > xs[j + 1] {
            j += 1;
            continue;
        }
        let perc = f64::from(new_xs[i] - xs[j]) / f64::from(xs[j + 1] - xs[j]);
        new_ys[i] = f64::from(ys[j]) * (1.0 - perc) + f64::from(ys[j + 1]) * perc;
        i += 1;
    }
    (0..new_len).map(|i| new_ys[new_len - 1 - i].exp() as f32).collect()
}

fn ays(n: u32, levels: &[f32]) -> Vec<f32> {
    let n = n as usize;
    let mut out = if n + 1 == levels.len() { levels.to_vec() } else { log_linear_interpolation(levels, n + 1) };
    out[n] = 0.0;
    out
}

fn gits(n: u32) -> Vec<f32> {
    let n = n as usize;
    let mut out = if n <= 20 {
        GITS_1_20[n - 2].to_vec()
    } else {
        log_linear_interpolation(GITS_1_20[GITS_1_20.len() - 1], n + 1)
    };
    out[n] = 0.0;
    out
}

/// `steps` points of a normalised arctangent ramp from `start` to `end` around `pivot`.
fn bong_ramp(steps: i32, slope: f32, pivot: f32, start: f32, end: f32) -> Vec<f32> {
    const PI: f32 = std::f32::consts::PI;
    if steps <= 0 {
        return Vec::new();
    }
    let ramp = |x: f32| ((2.0 / PI) * (-slope * (x - pivot)).atan() + 1.0) * 0.5;
    let smax = ramp(0.0);
    let smin = ramp((steps - 1) as f32);
    let srange = smax - smin;
    let sscale = start - end;
    if srange.abs() < 1e-8 {
        if steps == 1 {
            return vec![start];
        }
        return (0..steps).map(|i| start + (end - start) * (i as f32 / (steps - 1) as f32)).collect();
    }
    let inv_srange = 1.0 / srange;
    (0..steps).map(|x| ((ramp(x as f32) - smin) * inv_srange) * sscale + end).collect()
}

fn bong_tangent(n: u32, sigma_min: f32, sigma_max: f32) -> Vec<f32> {
    const PIVOT: f32 = 0.6;
    const SLOPE: f32 = 0.2;
    let (start, end) = (sigma_max, sigma_min);
    let middle = sigma_min + (sigma_max - sigma_min) * 0.5;
    let steps = n as i32 + 2;
    let midpoint = ((steps as f32 * PIVOT + steps as f32 * PIVOT) * 0.5) as i32;
    let pivot_i = (steps as f32 * PIVOT) as i32;
    let slope = SLOPE / (steps as f32 / 40.0);
    let stage_2_len = steps - midpoint;
    let stage_1_len = steps - stage_2_len;
    let mut out = bong_ramp(stage_1_len, slope, pivot_i as f32, start, middle);
    out.pop();
    out.extend(bong_ramp(stage_2_len, slope, (pivot_i - stage_1_len) as f32, middle, end));
    let n = n as usize;
    out.resize(n + 1, end);
    out[n] = 0.0;
    out
}

fn ltx2(n: u32, image_seq_len: usize) -> Vec<f32> {
    const MAX_SHIFT: f32 = 2.05;
    const BASE_SHIFT: f32 = 0.95;
    const TERMINAL: f32 = 0.1;
    let tokens = if image_seq_len == 0 { 4096 } else { image_seq_len.min(i32::MAX as usize) as i32 };
    let m = (MAX_SHIFT - BASE_SHIFT) / (4096.0 - 1024.0);
    let b = BASE_SHIFT - m * 1024.0;
    let exp_shift = (tokens as f32 * m + b).exp();
    let mut out: Vec<f32> = (0..=n)
        .map(|i| {
            let sigma = 1.0 - i as f32 / n as f32;
            if sigma != 0.0 {
                exp_shift / (exp_shift + (1.0 / sigma - 1.0))
            } else {
                sigma
            }
        })
        .collect();
    let n = n as usize;
    if out.len() > 2 {
        let scale = (1.0 - out[n - 1]) / (1.0 - TERMINAL);
        if scale > 1e-8 {
            for v in &mut out[..n] {
                *v = 1.0 - (1.0 - *v) / scale;
            }
        }
    }
    out[n] = 0.0;
    out
}

/// The sigmas an img2img run uses: the tail of the full schedule that covers `strength` of it.
///
/// As the reference: `t_enc = floor(steps * strength)` (at most `steps - 1`), and sampling starts
/// at `sigmas[steps - t_enc - 1]`, so it runs `t_enc + 1` steps. `strength` 1 keeps the whole
/// schedule. `strength` must lie in [0, 1].
pub fn img2img_sigmas(sigmas: &[f32], strength: f32) -> Result<Vec<f32>, SamplingError> {
    if !(0.0..=1.0).contains(&strength) {
        return Err(SamplingError::InvalidStrength(strength));
    }
    if sigmas.len() < 2 {
        return Err(SamplingError::EmptySchedule(sigmas.len()));
    }
    let steps = sigmas.len() - 1;
    if strength >= 1.0 {
        return Ok(sigmas.to_vec());
    }
    // `int * float` is a float product; the cast truncates.
    let mut t_enc = (steps as f32 * strength) as usize;
    if t_enc == steps {
        t_enc -= 1;
    }
    Ok(sigmas[steps - t_enc - 1..].to_vec())
}

/// The starting latent of a run: `init + noise * sigma` (the reference's CompVis noise scaling).
/// For text-to-image `init` is all zeros; for image-to-image it is the encoded image's latent.
pub fn noised_latent(init: &[f32], noise: &[f32], sigma: f32) -> Result<Vec<f32>, SamplingError> {
    if init.len() != noise.len() {
        return Err(SamplingError::LengthMismatch { what: "noise", expected: init.len(), got: noise.len() });
    }
    Ok(init.iter().zip(noise).map(|(&l, &n)| l + n * sigma).collect())
}

/// The text-to-image starting latent: `0 + noise * sigma`, as [`noised_latent`] on a zero latent.
pub fn txt2img_latent(noise: &[f32], sigma: f32) -> Vec<f32> {
    noise.iter().map(|&n| 0.0 + n * sigma).collect()
}
