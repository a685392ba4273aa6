//! Noise schedules: the SD training schedule, sigma<->timestep conversion and the step schedulers.
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
fn cpp_min(a: f32, b: f32) -> f32 {
    if b < a {
        b
    } else {
        a
    }
}

/// `std::max(a, b)`: returns `a` unless `a < b`.
fn cpp_max(a: f32, b: f32) -> f32 {
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
}

impl Scheduler {
    /// The schedulers implemented here, in the reference's enum order.
    pub const ALL: [Scheduler; 8] = [
        Scheduler::Discrete,
        Scheduler::Karras,
        Scheduler::Exponential,
        Scheduler::SgmUniform,
        Scheduler::Simple,
        Scheduler::Smoothstep,
        Scheduler::KlOptimal,
        Scheduler::Lcm,
    ];

    /// Names the reference accepts that are not implemented here.
    pub const NOT_IMPLEMENTED: [&'static str; 4] = ["ays", "gits", "bong_tangent", "ltx2"];

    /// The name the reference's CLI accepts.
    pub fn name(self) -> &'static str {
        match self {
            Scheduler::Discrete => "discrete",
            Scheduler::Karras => "karras",
            Scheduler::Exponential => "exponential",
            Scheduler::SgmUniform => "sgm_uniform",
            Scheduler::Simple => "simple",
            Scheduler::Smoothstep => "smoothstep",
            Scheduler::KlOptimal => "kl_optimal",
            Scheduler::Lcm => "lcm",
        }
    }

    /// The `steps + 1` sigmas (the last one 0) for `schedule`. Zero steps is an error.
    pub fn sigmas(self, steps: usize, schedule: &DiscreteSchedule) -> Result<Vec<f32>, SamplingError> {
        if steps == 0 {
            return Err(SamplingError::ZeroSteps);
        }
        let n = u32::try_from(steps).map_err(|_| SamplingError::TooManySteps(steps))?;
        Ok(match self {
            Scheduler::Discrete => discrete(n, schedule),
            Scheduler::Karras => karras(n, schedule.sigma_min(), schedule.sigma_max()),
            Scheduler::Exponential => exponential(n, schedule.sigma_min(), schedule.sigma_max()),
            Scheduler::SgmUniform => sgm_uniform(n, schedule),
            Scheduler::Simple => simple(n, schedule),
            Scheduler::Smoothstep => smoothstep(n, schedule),
            Scheduler::KlOptimal => kl_optimal(n, schedule.sigma_min(), schedule.sigma_max()),
            Scheduler::Lcm => lcm(n, schedule),
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

fn discrete(n: u32, schedule: &DiscreteSchedule) -> Vec<f32> {
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

fn sgm_uniform(n: u32, schedule: &DiscreteSchedule) -> Vec<f32> {
    let timesteps = linear_space(T_MAX as f32, 0.0, n as usize + 1);
    let mut out: Vec<f32> = timesteps[..n as usize].iter().map(|&t| schedule.t_to_sigma(t)).collect();
    out.push(0.0);
    out
}

fn simple(n: u32, schedule: &DiscreteSchedule) -> Vec<f32> {
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

fn smoothstep(n: u32, schedule: &DiscreteSchedule) -> Vec<f32> {
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

fn lcm(n: u32, schedule: &DiscreteSchedule) -> Vec<f32> {
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
