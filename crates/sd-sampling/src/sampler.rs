//! The k-diffusion samplers (`--sampling-method`), step for step as the reference runs them.
//!
//! Each sampler integrates the probability-flow ODE (or its ancestral SDE variant) over the given
//! sigmas, calling the denoiser once or twice per step. To reproduce the reference's latents to the
//! bit, every sampler here keeps the reference's order of operations, its float/double mixes (a
//! C++ `exp`/`log` on a float runs in double), the number and order of denoiser calls, and the
//! points where ancestral samplers draw noise (a whole latent at a time, from the sampler RNG;
//! `dpm++2s_a` draws even when its noise scale is 0).

use std::fmt;
use std::str::FromStr;

use super::methods;
use super::rng::NoiseRng;
use super::schedule::{cpp_max, cpp_min, Scheduler};
use super::{parse_name, SamplingError, Step};

/// A sampling method (`--sampling-method`), in the reference's enum order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SampleMethod {
    /// Euler (first order, one model call per step).
    Euler,
    /// Euler ancestral (adds fresh noise each step; the reference's default sampler for UNet models).
    #[default]
    EulerA,
    /// Heun (second order, two calls per step except the last).
    Heun,
    /// DPM-Solver-2 (midpoint in log sigma, two calls per step except the last).
    Dpm2,
    /// DPM-Solver++(2S) ancestral (two calls per step except the last; adds noise).
    DpmPp2sA,
    /// DPM-Solver++(2M) (multistep, one call per step).
    DpmPp2m,
    /// DPM-Solver++(2M) with the step size taken as the mean of the last two (`dpm++2mv2`).
    DpmPp2mV2,
    /// Improved pseudo-numerical (Adams-Bashforth up to 4th order on the ODE derivative).
    Ipndm,
    /// iPNDM with variable step sizes in its second-order step.
    IpndmV,
    /// Latent consistency model sampling (the model's x0 re-noised to the next sigma).
    Lcm,
    /// DDIM with trailing timesteps: Euler ancestral (eta 0 by default) on the `simple` schedule.
    DdimTrailing,
    /// Trajectory consistency distillation sampling (DDIM-like, with its own alphas).
    Tcd,
    /// RES multistep (exponential integrator with a second-order history term).
    ResMultistep,
    /// RES 2s (two-stage exponential integrator, two calls per step except the last).
    Res2s,
    /// Extended-reverse-time SDE solver (up to third order; adds noise).
    ErSde,
    /// Euler with CFG++ (steps along the unconditional prediction).
    EulerCfgPp,
    /// Euler ancestral with CFG++ (adds noise).
    EulerACfgPp,
    /// Euler with gradient estimation (a weighted blend of this and the last derivative).
    EulerGe,
}

impl SampleMethod {
    /// Every method of the reference, in its enum order.
    pub const ALL: [SampleMethod; 18] = [
        SampleMethod::Euler,
        SampleMethod::EulerA,
        SampleMethod::Heun,
        SampleMethod::Dpm2,
        SampleMethod::DpmPp2sA,
        SampleMethod::DpmPp2m,
        SampleMethod::DpmPp2mV2,
        SampleMethod::Ipndm,
        SampleMethod::IpndmV,
        SampleMethod::Lcm,
        SampleMethod::DdimTrailing,
        SampleMethod::Tcd,
        SampleMethod::ResMultistep,
        SampleMethod::Res2s,
        SampleMethod::ErSde,
        SampleMethod::EulerCfgPp,
        SampleMethod::EulerACfgPp,
        SampleMethod::EulerGe,
    ];

    /// Names the reference accepts that are not implemented here (none).
    pub const NOT_IMPLEMENTED: [&'static str; 0] = [];

    /// The name the reference's CLI accepts.
    pub fn name(self) -> &'static str {
        match self {
            SampleMethod::Euler => "euler",
            SampleMethod::EulerA => "euler_a",
            SampleMethod::Heun => "heun",
            SampleMethod::Dpm2 => "dpm2",
            SampleMethod::DpmPp2sA => "dpm++2s_a",
            SampleMethod::DpmPp2m => "dpm++2m",
            SampleMethod::DpmPp2mV2 => "dpm++2mv2",
            SampleMethod::Ipndm => "ipndm",
            SampleMethod::IpndmV => "ipndm_v",
            SampleMethod::Lcm => "lcm",
            SampleMethod::DdimTrailing => "ddim_trailing",
            SampleMethod::Tcd => "tcd",
            SampleMethod::ResMultistep => "res_multistep",
            SampleMethod::Res2s => "res_2s",
            SampleMethod::ErSde => "er_sde",
            SampleMethod::EulerCfgPp => "euler_cfg_pp",
            SampleMethod::EulerACfgPp => "euler_a_cfg_pp",
            SampleMethod::EulerGe => "euler_ge",
        }
    }

    /// The name the reference writes in logs and in the PNG `parameters` text (A1111 style).
    pub fn display_name(self) -> &'static str {
        match self {
            SampleMethod::Euler => "Euler",
            SampleMethod::EulerA => "Euler A",
            SampleMethod::Heun => "Heun",
            SampleMethod::Dpm2 => "DPM2",
            SampleMethod::DpmPp2sA => "DPM++ (2s)",
            SampleMethod::DpmPp2m => "DPM++ (2M)",
            SampleMethod::DpmPp2mV2 => "modified DPM++ (2M)",
            SampleMethod::Ipndm => "iPNDM",
            SampleMethod::IpndmV => "iPNDM_v",
            SampleMethod::Lcm => "LCM",
            SampleMethod::DdimTrailing => "DDIM \"trailing\"",
            SampleMethod::Tcd => "TCD",
            SampleMethod::ResMultistep => "Res Multistep",
            SampleMethod::Res2s => "Res 2s",
            SampleMethod::ErSde => "ER-SDE",
            SampleMethod::EulerCfgPp => "Euler CFG++",
            SampleMethod::EulerACfgPp => "Euler A CFG++",
            SampleMethod::EulerGe => "Euler GE",
        }
    }

    /// The noise multiplier used when `--eta` is not given, as the reference resolves it: 1 for
    /// `euler_a`, `dpm++2s_a`, `er_sde` and `euler_a_cfg_pp`, else 0.
    pub fn default_eta(self) -> f32 {
        match self {
            SampleMethod::EulerA | SampleMethod::DpmPp2sA | SampleMethod::ErSde | SampleMethod::EulerACfgPp => 1.0,
            _ => 0.0,
        }
    }

    /// The scheduler used when `--scheduler` is not given (SD 1.x/2.x): `lcm` for LCM and TCD,
    /// `simple` for DDIM trailing, else `discrete`.
    pub fn default_scheduler(self) -> Scheduler {
        match self {
            SampleMethod::Lcm | SampleMethod::Tcd => Scheduler::Lcm,
            SampleMethod::DdimTrailing => Scheduler::Simple,
            _ => Scheduler::Discrete,
        }
    }

    /// Whether the method draws noise from the sampler RNG with its default eta.
    pub fn is_stochastic(self) -> bool {
        self.default_eta() > 0.0 || self == SampleMethod::Lcm
    }

    /// Whether the method needs the unconditional denoised estimate too (the CFG++ samplers).
    pub fn needs_uncond_denoised(self) -> bool {
        matches!(self, SampleMethod::EulerCfgPp | SampleMethod::EulerACfgPp)
    }
}

impl fmt::Display for SampleMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SampleMethod {
    type Err = SamplingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("sampling method", s, &SampleMethod::ALL, |k| k.name(), &SampleMethod::NOT_IMPLEMENTED)
    }
}

/// What a denoiser evaluation returns: the (guided) denoised estimate and, for the CFG++
/// samplers, the unconditional one. A plain `Vec<f32>` converts to a `Denoised` without an
/// unconditional estimate; the CFG++ samplers then use the denoised estimate in its place,
/// which is what the reference does when it runs without guidance.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Denoised {
    /// The denoised estimate.
    pub pred: Vec<f32>,
    /// The unconditional model output turned into a denoised estimate (same scalings).
    pub uncond: Option<Vec<f32>>,
}

impl From<Vec<f32>> for Denoised {
    fn from(pred: Vec<f32>) -> Self {
        Denoised { pred, uncond: None }
    }
}

/// `(sigma_down, sigma_up)` of an ancestral step from `sigma_from` to `sigma_to` with noise `eta`.
pub(super) fn ancestral_step(sigma_from: f32, sigma_to: f32, eta: f32) -> (f32, f32) {
    if eta <= 0.0 {
        return (sigma_to, 0.0);
    }
    let mut sigma_up = 0.0_f32;
    let from_sq = sigma_from * sigma_from;
    let to_sq = sigma_to * sigma_to;
    if from_sq > 0.0 {
        let term = to_sq * (from_sq - to_sq) / from_sq;
        let term = if term < 0.0 { 0.0 } else { term };
        let up = eta * term.sqrt();
        sigma_up = if up < sigma_to { up } else { sigma_to };
    }
    let down_sq = to_sq - sigma_up * sigma_up;
    let sigma_down = if down_sq > 0.0 { down_sq.sqrt() } else { 0.0 };
    (sigma_down, sigma_up)
}

/// `(sigma_down, sigma_up, alpha_scale)` of a flow-matching ancestral step (the reference's
/// `get_ancestral_step_flow`): eta clamped to 1, `sigma_down` between 0 and `sigma_to`, and the
/// rescale of `x` by `alpha_scale` before the noise is added, all in f32.
pub(super) fn ancestral_step_flow(sigma_from: f32, sigma_to: f32, eta: f32) -> (f32, f32, f32) {
    if eta <= 0.0 || sigma_from <= 0.0 || sigma_to <= 0.0 {
        return (sigma_to, 0.0, 1.0);
    }
    let eta = cpp_min(eta, 1.0);
    let ratio = sigma_to / sigma_from;
    let down = sigma_to * (1.0 + (ratio - 1.0) * eta);
    let down = cpp_max(0.0, cpp_min(sigma_to, down));
    let denom = 1.0 - down;
    if denom <= 0.0 {
        return (sigma_to, 0.0, 1.0);
    }
    let alpha_scale = (1.0 - sigma_to) / denom;
    let term = (down / sigma_to) * alpha_scale;
    let term = cpp_max(-1.0, cpp_min(1.0, term));
    let up = sigma_to * cpp_max(1.0 - term * term, 0.0).sqrt();
    (down, up, alpha_scale)
}

/// `(sigma_down, sigma_up, alpha_scale)` of an ancestral step: [`ancestral_step_flow`] on a
/// flow-matching schedule, else [`ancestral_step`] with no rescale (the reference's
/// `get_ancestral_step` with `is_flow_denoiser`).
pub(super) fn ancestral(sigma_from: f32, sigma_to: f32, eta: f32, flow: bool) -> (f32, f32, f32) {
    if flow {
        return ancestral_step_flow(sigma_from, sigma_to, eta);
    }
    let (down, up) = ancestral_step(sigma_from, sigma_to, eta);
    (down, up, 1.0)
}

/// `-log(sigma)`, computed in double and rounded to float like the reference's `t_fn`.
fn t_fn(sigma: f32) -> f32 {
    (-f64::from(sigma).ln()) as f32
}

/// `exp(-t)`, computed in double and rounded to float like the reference's `sigma_fn`.
fn sigma_fn(t: f32) -> f32 {
    f64::from(-t).exp() as f32
}

/// `exp(v) - 1` in double, rounded to float when it scales a tensor.
fn expm1_ref(v: f32) -> f32 {
    (f64::from(v).exp() - 1.0) as f32
}

/// The denoiser as the step loops call it: checks lengths and fills in [`Step`].
pub(super) struct Evals<'d, D> {
    denoise: &'d mut D,
    /// Number of steps of the run.
    pub steps: usize,
    /// Latent length.
    pub n: usize,
}

impl<D> Evals<'_, D> {
    /// One evaluation at `sigma` for step `index`; `last_eval` when it completes the step.
    pub fn full<R, E>(&mut self, x: &[f32], sigma: f32, index: usize, last_eval: bool) -> Result<Denoised, E>
    where
        D: FnMut(&[f32], f32, Step) -> Result<R, E>,
        R: Into<Denoised>,
        E: From<SamplingError>,
    {
        self.eval(x, sigma, Step { index, count: self.steps, last_eval, leading: false })
    }

    /// [`Evals::pred`] for the first evaluation of a two-evaluation step ([`Step::leading`]).
    pub fn pred_leading<R, E>(&mut self, x: &[f32], sigma: f32, index: usize, last_eval: bool) -> Result<Vec<f32>, E>
    where
        D: FnMut(&[f32], f32, Step) -> Result<R, E>,
        R: Into<Denoised>,
        E: From<SamplingError>,
    {
        Ok(self.eval(x, sigma, Step { index, count: self.steps, last_eval, leading: true })?.pred)
    }

    fn eval<R, E>(&mut self, x: &[f32], sigma: f32, step: Step) -> Result<Denoised, E>
    where
        D: FnMut(&[f32], f32, Step) -> Result<R, E>,
        R: Into<Denoised>,
        E: From<SamplingError>,
    {
        let out: Denoised = (self.denoise)(x, sigma, step)?.into();
        if out.pred.len() != self.n {
            return Err(SamplingError::LengthMismatch {
                what: "denoiser output",
                expected: self.n,
                got: out.pred.len(),
            }
            .into());
        }
        if let Some(u) = &out.uncond {
            if u.len() != self.n {
                return Err(SamplingError::LengthMismatch {
                    what: "unconditional denoiser output",
                    expected: self.n,
                    got: u.len(),
                }
                .into());
            }
        }
        Ok(out)
    }

    /// The denoised estimate only.
    pub fn pred<R, E>(&mut self, x: &[f32], sigma: f32, index: usize, last_eval: bool) -> Result<Vec<f32>, E>
    where
        D: FnMut(&[f32], f32, Step) -> Result<R, E>,
        R: Into<Denoised>,
        E: From<SamplingError>,
    {
        Ok(self.full(x, sigma, index, last_eval)?.pred)
    }
}

/// One latent's worth of sampler noise.
pub(super) fn draw<E: From<SamplingError>>(rng: &mut dyn NoiseRng, n: usize) -> Result<Vec<f32>, E> {
    let v = rng.randn(n);
    if v.len() != n {
        return Err(SamplingError::LengthMismatch { what: "sampler noise", expected: n, got: v.len() }.into());
    }
    Ok(v)
}

/// Runs `method` from the latent `x` (already noised to `sigmas[0]`) down the `sigmas` (whose last
/// entry is normally 0) and returns the final latent.
///
/// `denoise(x, sigma, step)` must return the denoised estimate (same length as `x`), as a
/// `Vec<f32>` or a [`Denoised`] (the CFG++ samplers use its unconditional estimate); see
/// [`GuidedDenoiser`](super::GuidedDenoiser) for building one from a UNet. `rng` is the sampler
/// RNG: in the reference it is the same generator that drew the initial noise, continuing its
/// stream. `eta` scales the ancestral noise (use [`SampleMethod::default_eta`] when not set).
pub fn sample<E, D, R>(
    method: SampleMethod,
    denoise: &mut D,
    x: Vec<f32>,
    sigmas: &[f32],
    rng: &mut dyn NoiseRng,
    eta: f32,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    sample_on(method, denoise, x, sigmas, rng, eta, false)
}

/// [`sample`] on a flow-matching schedule (sigmas in (0, 1], the reference's
/// `is_flow_denoiser`): the ancestral samplers (`euler_a`, `ddim_trailing`, and `res_multistep`,
/// `res_2s`, `euler_ge` with `eta > 0`) take flow ancestral steps (`x` rescaled by
/// `alpha_scale` before the noise), `lcm` re-noises `(1 - sigma_next) x0 + sigma_next noise`,
/// `dpm++2s_a` runs its flow loop and `er_sde` its flow lambdas and alphas; the others run as
/// on a discrete schedule, as in the reference.
pub fn sample_flow<E, D, R>(
    method: SampleMethod,
    denoise: &mut D,
    x: Vec<f32>,
    sigmas: &[f32],
    rng: &mut dyn NoiseRng,
    eta: f32,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    sample_on(method, denoise, x, sigmas, rng, eta, true)
}

/// Checks the schedule, then runs `method`'s step loop over it ([`sample`], [`sample_flow`]).
fn sample_on<E, D, R>(
    method: SampleMethod,
    denoise: &mut D,
    x: Vec<f32>,
    sigmas: &[f32],
    rng: &mut dyn NoiseRng,
    eta: f32,
    flow: bool,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    if sigmas.len() < 2 {
        return Err(SamplingError::EmptySchedule(sigmas.len()).into());
    }
    let ev = &mut Evals { denoise, steps: sigmas.len() - 1, n: x.len() };
    match method {
        SampleMethod::Euler => euler(ev, x, sigmas),
        // DDIM is Euler ancestral on the simple schedule (the reference runs the same loop).
        SampleMethod::EulerA | SampleMethod::DdimTrailing => euler_ancestral(ev, x, sigmas, rng, eta, flow),
        SampleMethod::Heun => heun(ev, x, sigmas),
        SampleMethod::Dpm2 => dpm2(ev, x, sigmas),
        SampleMethod::DpmPp2sA if flow => methods::dpmpp_2s_a_flow(ev, x, sigmas, rng, eta),
        SampleMethod::DpmPp2sA => dpmpp_2s_a(ev, x, sigmas, rng, eta),
        SampleMethod::DpmPp2m => dpmpp_2m(ev, x, sigmas),
        SampleMethod::Lcm => lcm(ev, x, sigmas, rng, flow),
        SampleMethod::DpmPp2mV2 => methods::dpmpp_2m_v2(ev, x, sigmas),
        SampleMethod::Ipndm => methods::ipndm(ev, x, sigmas, false),
        SampleMethod::IpndmV => methods::ipndm(ev, x, sigmas, true),
        SampleMethod::Tcd => methods::tcd(ev, x, sigmas, rng, eta),
        SampleMethod::ResMultistep => methods::res_multistep(ev, x, sigmas, rng, eta, flow),
        SampleMethod::Res2s => methods::res_2s(ev, x, sigmas, rng, eta, flow),
        SampleMethod::ErSde => methods::er_sde(ev, x, sigmas, rng, eta, flow),
        SampleMethod::EulerCfgPp => methods::euler_cfg_pp(ev, x, sigmas, None),
        SampleMethod::EulerACfgPp => methods::euler_cfg_pp(ev, x, sigmas, Some((rng, eta))),
        SampleMethod::EulerGe => methods::euler_ge(ev, x, sigmas, rng, eta, flow),
    }
}

/// Euler: one step along the derivative `(x - D) / sigma` per denoiser call.
fn euler<D, R, E>(ev: &mut Evals<'_, D>, mut x: Vec<f32>, sigmas: &[f32]) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    for i in 0..ev.steps {
        let sigma = sigmas[i];
        let den = ev.pred(&x, sigma, i, true)?;
        let dt = sigmas[i + 1] - sigma;
        for (xv, &dv) in x.iter_mut().zip(&den) {
            let d = (*xv - dv) / sigma;
            *xv += d * dt;
        }
    }
    Ok(x)
}

/// Euler ancestral (and DDIM trailing): a deterministic step down to `sigma_down`, then fresh
/// noise of scale `sigma_up`; with `eta` 0 the plain interpolation towards the denoised estimate.
fn euler_ancestral<D, R, E>(
    ev: &mut Evals<'_, D>,
    mut x: Vec<f32>,
    sigmas: &[f32],
    rng: &mut dyn NoiseRng,
    eta: f32,
    flow: bool,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    for i in 0..ev.steps {
        let sigma = sigmas[i];
        let sigma_to = sigmas[i + 1];
        let den = ev.pred(&x, sigma, i, true)?;
        if sigma_to == 0.0 {
            x = den;
        } else if eta == 0.0 {
            let ratio = sigma_to / sigma;
            // `(1.0 - ratio)` is a double expression in the reference.
            let keep = (1.0_f64 - f64::from(ratio)) as f32;
            for (xv, &dv) in x.iter_mut().zip(&den) {
                *xv = ratio * *xv + keep * dv;
            }
        } else {
            let (sigma_down, sigma_up, alpha_scale) = ancestral(sigma, sigma_to, eta, flow);
            let ratio = sigma_down / sigma;
            let keep = 1.0 - ratio;
            for (xv, &dv) in x.iter_mut().zip(&den) {
                *xv = ratio * *xv + keep * dv;
            }
            if sigma_up > 0.0 {
                if flow {
                    for xv in x.iter_mut() {
                        *xv *= alpha_scale;
                    }
                }
                let z = draw::<E>(rng, ev.n)?;
                for (xv, &zv) in x.iter_mut().zip(&z) {
                    *xv += zv * sigma_up;
                }
            }
        }
    }
    Ok(x)
}

/// Heun: an Euler step, then the average of its derivative and the derivative at its end
/// (a plain Euler step for the last, to sigma 0).
fn heun<D, R, E>(ev: &mut Evals<'_, D>, mut x: Vec<f32>, sigmas: &[f32]) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    for i in 0..ev.steps {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let den = ev.pred_leading(&x, s, i, s_next == 0.0)?;
        let d: Vec<f32> = x.iter().zip(&den).map(|(&xv, &dv)| (xv - dv) / s).collect();
        let dt = s_next - s;
        if s_next == 0.0 {
            for (xv, &dv) in x.iter_mut().zip(&d) {
                *xv += dv * dt;
            }
        } else {
            let x2: Vec<f32> = x.iter().zip(&d).map(|(&xv, &dv)| xv + dv * dt).collect();
            let den2 = ev.pred(&x2, s_next, i, true)?;
            for (((xv, &dv), &x2v), &d2v) in x.iter_mut().zip(&d).zip(&x2).zip(&den2) {
                let d_avg = (dv + (x2v - d2v) / s_next) / 2.0;
                *xv += d_avg * dt;
            }
        }
    }
    Ok(x)
}

/// DPM-Solver-2: the whole step taken with the derivative at the midpoint in log sigma
/// (a plain Euler step for the last, to sigma 0).
fn dpm2<D, R, E>(ev: &mut Evals<'_, D>, mut x: Vec<f32>, sigmas: &[f32]) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    for i in 0..ev.steps {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let den = ev.pred_leading(&x, s, i, s_next == 0.0)?;
        let d: Vec<f32> = x.iter().zip(&den).map(|(&xv, &dv)| (xv - dv) / s).collect();
        if s_next == 0.0 {
            let dt = s_next - s;
            for (xv, &dv) in x.iter_mut().zip(&d) {
                *xv += dv * dt;
            }
        } else {
            let sigma_mid = (0.5 * (f64::from(s).ln() + f64::from(s_next).ln())).exp() as f32;
            let dt_1 = sigma_mid - s;
            let dt_2 = s_next - s;
            let x2: Vec<f32> = x.iter().zip(&d).map(|(&xv, &dv)| xv + dv * dt_1).collect();
            let den2 = ev.pred(&x2, sigma_mid, i, true)?;
            for ((xv, &x2v), &d2v) in x.iter_mut().zip(&x2).zip(&den2) {
                *xv += ((x2v - d2v) / sigma_mid) * dt_2;
            }
        }
    }
    Ok(x)
}

/// DPM-Solver++(2S) ancestral on a discrete schedule: a second-order step through the
/// midpoint in `-log sigma` down to `sigma_down`, then noise of scale `sigma_up`.
fn dpmpp_2s_a<D, R, E>(
    ev: &mut Evals<'_, D>,
    mut x: Vec<f32>,
    sigmas: &[f32],
    rng: &mut dyn NoiseRng,
    eta: f32,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    for i in 0..ev.steps {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let (sigma_down, sigma_up) = ancestral_step(s, s_next, eta);
        let den = ev.pred_leading(&x, s, i, sigma_down == 0.0)?;
        if sigma_down == 0.0 {
            x = den;
        } else {
            let t = t_fn(s);
            let t_next = t_fn(sigma_down);
            let h = t_next - t;
            let s_mid = t + 0.5 * h;
            let sigma_s = sigma_fn(s_mid);
            let a = sigma_s / sigma_fn(t);
            let b = expm1_ref(-h * 0.5);
            let x2: Vec<f32> = x.iter().zip(&den).map(|(&xv, &dv)| a * xv - b * dv).collect();
            let den2 = ev.pred(&x2, sigma_s, i, true)?;
            let a2 = sigma_fn(t_next) / sigma_fn(t);
            let b2 = expm1_ref(-h);
            for (xv, &dv) in x.iter_mut().zip(&den2) {
                *xv = a2 * *xv - b2 * dv;
            }
        }
        if s_next > 0.0 {
            // Drawn even when sigma_up is 0 (eta 0), which keeps the RNG stream aligned.
            let z = draw::<E>(rng, ev.n)?;
            for (xv, &zv) in x.iter_mut().zip(&z) {
                *xv += zv * sigma_up;
            }
        }
    }
    Ok(x)
}

/// DPM-Solver++(2M): a multistep second-order update that blends this step's denoised
/// estimate with the last one (first order on the first step and the last, to sigma 0).
fn dpmpp_2m<D, R, E>(ev: &mut Evals<'_, D>, mut x: Vec<f32>, sigmas: &[f32]) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    let mut old_denoised = x.clone();
    for i in 0..ev.steps {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let den = ev.pred(&x, s, i, true)?;
        let t = t_fn(s);
        let t_next = t_fn(s_next);
        let h = t_next - t;
        let a = s_next / s;
        let b = expm1_ref(-h);
        if i == 0 || s_next == 0.0 {
            for (xv, &dv) in x.iter_mut().zip(&den) {
                *xv = a * *xv - b * dv;
            }
        } else {
            let h_last = t - t_fn(sigmas[i - 1]);
            let r = h_last / h;
            let c_new = 1.0 + 1.0 / (2.0 * r);
            let c_old = 1.0 / (2.0 * r);
            for ((xv, &dv), &ov) in x.iter_mut().zip(&den).zip(&old_denoised) {
                let dd = c_new * dv - c_old * ov;
                *xv = a * *xv - b * dd;
            }
        }
        old_denoised = den;
    }
    Ok(x)
}

/// LCM: the model's denoised estimate re-noised to the next sigma with fresh noise (on a flow
/// schedule the estimate is first scaled by `1 - sigma_next`).
fn lcm<D, R, E>(
    ev: &mut Evals<'_, D>,
    mut x: Vec<f32>,
    sigmas: &[f32],
    rng: &mut dyn NoiseRng,
    flow: bool,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    for i in 0..ev.steps {
        let s_next = sigmas[i + 1];
        x = ev.pred(&x, sigmas[i], i, true)?;
        if s_next > 0.0 {
            if flow {
                let keep = 1.0 - s_next;
                for xv in x.iter_mut() {
                    *xv *= keep;
                }
            }
            // The reference's default noise_scale is exactly 1.
            let z = draw::<E>(rng, ev.n)?;
            for (xv, &zv) in x.iter_mut().zip(&z) {
                *xv += zv * s_next;
            }
        }
    }
    Ok(x)
}
