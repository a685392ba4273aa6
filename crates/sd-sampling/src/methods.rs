//! The step loops of the samplers beyond the first k-diffusion seven (`dpm++2mv2` to `euler_ge`).
//!
//! Same rules as [`sampler`](super::sampler): each loop keeps the reference's operation order and
//! its float/double mixes so that latents agree to the bit. Where the reference calls a float
//! function (`logf`, `expf`, `std::pow(float, float)`, `std::sqrt(float)`) we call the `f32` one;
//! where it calls an unqualified `exp`/`log`/`pow` on a float (the double overload) we go through
//! `f64`. A tensor expression like `a * x + b * d` is evaluated per element with the scalars
//! rounded to float first, as the reference's tensor operators do.

use super::rng::NoiseRng;
use super::sampler::{ancestral, ancestral_step, ancestral_step_flow, draw, Denoised, Evals};
use super::schedule::{cpp_max, cpp_min, SD_LINEAR_END, SD_LINEAR_START, TIMESTEPS};
use super::{SamplingError, Step};

/// `-log(sigma)` in double, rounded to float (the reference's lambda with unqualified `log`).
fn t_fn_double(sigma: f32) -> f32 {
    (-f64::from(sigma).ln()) as f32
}

/// DPM-Solver++(2M) whose second-order step uses the mean of the last two step sizes.
pub(super) fn dpmpp_2m_v2<D, R, E>(ev: &mut Evals<'_, D>, mut x: Vec<f32>, sigmas: &[f32]) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    let mut old_denoised = x.clone();
    for i in 0..ev.steps {
        let (s, s_next) = (sigmas[i], sigmas[i + 1]);
        let den = ev.pred(&x, s, i, true)?;
        let t = t_fn_double(s);
        let t_next = t_fn_double(s_next);
        let h = t_next - t;
        let a = s_next / s;
        if i == 0 || s_next == 0.0 {
            let b = (f64::from(-h).exp() - 1.0) as f32;
            for (xv, &dv) in x.iter_mut().zip(&den) {
                *xv = a * *xv - b * dv;
            }
        } else {
            let h_last = t - t_fn_double(sigmas[i - 1]);
            let (h_min, h_max) = (cpp_min(h_last, h), cpp_max(h_last, h));
            let r = h_max / h_min;
            let h_d = (h_max + h_min) / 2.0;
            let b = (f64::from(-h_d).exp() - 1.0) as f32;
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

/// iPNDM: Adams-Bashforth of order `min(4, step + 1)` on the derivatives `(x - D) / sigma`.
/// `variable` is `ipndm_v`, whose second-order step weighs by the ratio of the step sizes.
pub(super) fn ipndm<D, R, E>(
    ev: &mut Evals<'_, D>,
    mut x: Vec<f32>,
    sigmas: &[f32],
    variable: bool,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    const MAX_ORDER: usize = 4;
    let mut hist: Vec<Vec<f32>> = Vec::with_capacity(MAX_ORDER - 1);
    for i in 0..ev.steps {
        let (sigma, sigma_next) = (sigmas[i], sigmas[i + 1]);
        let den = ev.pred(&x, sigma, i, true)?;
        let d_cur: Vec<f32> = x.iter().zip(&den).map(|(&xv, &dv)| (xv - dv) / sigma).collect();
        let order = MAX_ORDER.min(i + 1);
        let dt = sigma_next - sigma;
        let h = |back: usize| &hist[hist.len() - back];
        match order {
            1 => {
                for (xv, &d) in x.iter_mut().zip(&d_cur) {
                    *xv += d * dt;
                }
            }
            2 if variable => {
                let h_prev = sigma - sigmas[i - 1];
                let ratio = dt / h_prev;
                let c = 2.0 + ratio;
                for ((xv, &d), &h1) in x.iter_mut().zip(&d_cur).zip(h(1)) {
                    *xv += ((c * d - ratio * h1) / 2.0) * dt;
                }
            }
            2 => {
                for ((xv, &d), &h1) in x.iter_mut().zip(&d_cur).zip(h(1)) {
                    *xv += ((3.0 * d - h1) / 2.0) * dt;
                }
            }
            3 => {
                for (((xv, &d), &h1), &h2) in x.iter_mut().zip(&d_cur).zip(h(1)).zip(h(2)) {
                    *xv += ((23.0 * d - 16.0 * h1 + 5.0 * h2) / 12.0) * dt;
                }
            }
            _ => {
                for ((((xv, &d), &h1), &h2), &h3) in x.iter_mut().zip(&d_cur).zip(h(1)).zip(h(2)).zip(h(3)) {
                    *xv += ((55.0 * d - 59.0 * h1 + 37.0 * h2 - 9.0 * h3) / 24.0) * dt;
                }
            }
        }
        if hist.len() == MAX_ORDER - 1 {
            hist.remove(0);
        }
        hist.push(d_cur);
    }
    Ok(x)
}

/// `(e^t - 1) / t`, with its Taylor series near 0 (float, as the RES samplers compute it).
fn phi1(t: f32) -> f32 {
    if t.abs() < 1e-6 {
        return 1.0 + t * 0.5 + (t * t) / 6.0;
    }
    (t.exp() - 1.0) / t
}

/// `(phi1(t) - 1) / t`, with its Taylor series near 0.
fn phi2(t: f32) -> f32 {
    if t.abs() < 1e-6 {
        return 0.5 + t / 6.0 + (t * t) / 24.0;
    }
    (phi1(t) - 1.0) / t
}

/// Adds `noise * scale` to `x`, drawing one latent of noise.
fn add_noise<E: From<SamplingError>>(x: &mut [f32], rng: &mut dyn NoiseRng, scale: f32) -> Result<(), E> {
    let z = draw::<E>(rng, x.len())?;
    for (xv, &zv) in x.iter_mut().zip(&z) {
        *xv += zv * scale;
    }
    Ok(())
}

/// DPM-Solver++(2S) ancestral on a flow schedule (the reference's own loop for flow models):
/// the midpoint in `log((1 - sigma) / sigma)` written as `sigma_s = 1 / (e^s + 1)` with
/// `e^s = sqrt((1 - sigma) / sigma * (1 - sigma_down) / sigma_down)`, one evaluation only when
/// sigma is 1 (within 1e-6, where the midpoint is sigma itself), the flow ancestral step, and
/// noise only with `eta > 0`.
pub(super) fn dpmpp_2s_a_flow<D, R, E>(
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
        let (sigma, sigma_to) = (sigmas[i], sigmas[i + 1]);
        // `1.0 - sigma` is a double expression in the reference.
        let first_at_one = 1.0 - f64::from(sigma) < 1e-6;
        let den = ev.pred(&x, sigma, i, first_at_one || sigma_to == 0.0)?;
        if sigma_to == 0.0 {
            x = den;
            continue;
        }
        let (sigma_down, sigma_up, alpha_scale) = ancestral_step_flow(sigma, sigma_to, eta);
        let d_i = if first_at_one {
            den
        } else {
            let exp_s = (((1.0 - sigma) / sigma) * ((1.0 - sigma_down) / sigma_down)).sqrt();
            let sigma_s = 1.0 / (exp_s + 1.0);
            let ratio = sigma_s / sigma;
            let keep = 1.0 - ratio;
            let u: Vec<f32> = x.iter().zip(&den).map(|(&xv, &dv)| xv * ratio + dv * keep).collect();
            ev.pred(&u, sigma_s, i, true)?
        };
        let ratio = sigma_down / sigma;
        let keep = 1.0 - ratio;
        for (xv, &dv) in x.iter_mut().zip(&d_i) {
            *xv = *xv * ratio + dv * keep;
        }
        if eta > 0.0 {
            rescale_and_add_noise::<E>(&mut x, rng, Some(alpha_scale), sigma_up)?;
        }
    }
    Ok(x)
}

/// A flow ancestral step's noise: `x` times `alpha_scale` (when given), then `noise * scale` added.
fn rescale_and_add_noise<E: From<SamplingError>>(
    x: &mut [f32],
    rng: &mut dyn NoiseRng,
    alpha_scale: Option<f32>,
    scale: f32,
) -> Result<(), E> {
    if let Some(a) = alpha_scale {
        for xv in x.iter_mut() {
            *xv *= a;
        }
    }
    add_noise(x, rng, scale)
}

/// RES multistep: an exponential integrator in `-log sigma` with one step of history; on a
/// flow schedule (`flow`) the ancestral step is the flow one and `x` is rescaled before the noise.
pub(super) fn res_multistep<D, R, E>(
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
    let t_fn = |sigma: f32| -sigma.ln();
    let mut old_denoised = x.clone();
    let mut old_sigma_down: Option<f32> = None;
    for i in 0..ev.steps {
        let den = ev.pred(&x, sigmas[i], i, true)?;
        let (sigma_from, sigma_to) = (sigmas[i], sigmas[i + 1]);
        let (sigma_down, sigma_up, alpha_scale) = ancestral(sigma_from, sigma_to, eta, flow);
        match old_sigma_down {
            Some(old_down) if sigma_down != 0.0 => {
                let t = t_fn(sigma_from);
                let t_old = t_fn(old_down);
                let t_next = t_fn(sigma_down);
                let t_prev = t_fn(sigmas[i - 1]);
                let h = t_next - t;
                let c2 = (t_prev - t_old) / h;
                let p1 = phi1(-h);
                let p2 = phi2(-h);
                let b1 = p1 - p2 / c2;
                let b2 = p2 / c2;
                let b1 = if b1.is_finite() { b1 } else { 0.0 };
                let b2 = if b2.is_finite() { b2 } else { 0.0 };
                let decay = (-h).exp();
                for ((xv, &dv), &ov) in x.iter_mut().zip(&den).zip(&old_denoised) {
                    *xv = decay * *xv + h * (b1 * dv + b2 * ov);
                }
            }
            _ => {
                let dt = sigma_down - sigma_from;
                for (xv, &dv) in x.iter_mut().zip(&den) {
                    *xv += ((*xv - dv) / sigma_from) * dt;
                }
            }
        }
        if sigma_to > 0.0 && sigma_up > 0.0 {
            rescale_and_add_noise::<E>(&mut x, rng, flow.then_some(alpha_scale), sigma_up)?;
        }
        old_denoised = den;
        old_sigma_down = Some(sigma_down);
    }
    Ok(x)
}

/// RES 2s: a two-stage exponential integrator (midpoint `c2 = 1/2` in `-log sigma`); `flow` as
/// in [`res_multistep`].
pub(super) fn res_2s<D, R, E>(
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
    const C2: f32 = 0.5;
    let t_fn = |sigma: f32| -sigma.ln();
    for i in 0..ev.steps {
        let (sigma_from, sigma_to) = (sigmas[i], sigmas[i + 1]);
        let (sigma_down, sigma_up, alpha_scale) = ancestral(sigma_from, sigma_to, eta, flow);
        let single = sigma_down == 0.0 || sigma_from == 0.0;
        let den = ev.pred_leading(&x, sigma_from, i, single)?;
        if single {
            x = den;
        } else {
            let t = t_fn(sigma_from);
            let t_next = t_fn(sigma_down);
            let h = t_next - t;
            let a21 = C2 * phi1(-h * C2);
            let p1 = phi1(-h);
            let p2 = phi2(-h);
            let b2 = p2 / C2;
            let b1 = p1 - b2;
            let sigma_c2 = (-(t + h * C2)).exp();
            let eps1: Vec<f32> = den.iter().zip(&x).map(|(&dv, &xv)| dv - xv).collect();
            let k = h * a21;
            let x2: Vec<f32> = x.iter().zip(&eps1).map(|(&xv, &e)| xv + e * k).collect();
            let den2 = ev.pred(&x2, sigma_c2, i, true)?;
            for ((xv, &e1), &d2) in x.iter_mut().zip(&eps1).zip(&den2) {
                let e2 = d2 - *xv;
                *xv += h * (b1 * e1 + b2 * e2);
            }
        }
        if sigma_to > 0.0 && sigma_up > 0.0 {
            rescale_and_add_noise::<E>(&mut x, rng, flow.then_some(alpha_scale), sigma_up)?;
        }
    }
    Ok(x)
}

/// ER-SDE (extended reverse-time SDE, up to 3 stages): the noise scaler `x (e^(x^0.3) + 10)`,
/// 200-point quadrature of its inverse. For a non-flow model lambda = sigma and alpha = 1; on a
/// flow schedule sigma is clamped to [1e-6, 1 - 1e-4], lambda = sigma / (1 - sigma) and
/// alpha = 1 - sigma (and a sigma above 1 is clamped before the model sees it).
pub(super) fn er_sde<D, R, E>(
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
    const MAX_STAGE: usize = 3;
    const POINTS: i32 = 200;
    let s_noise = eta;
    let scaler = |v: f32| {
        let v = v.max(0.0);
        v * (v.powf(0.3).exp() + 10.0)
    };
    let clamp = |s: f32| cpp_min(cpp_max(s, 1e-6), 1.0 - 1e-4);
    let lambda = |s: f32| if flow { clamp(s) / cpp_max(1.0 - clamp(s), 1e-6) } else { cpp_max(s, 1e-6) };
    let alpha = |s: f32| if flow { 1.0 - clamp(s) } else { 1.0 };
    let mut sigmas = sigmas.to_vec();
    if flow {
        let n = sigmas.len();
        for s in &mut sigmas[..n - 1] {
            if *s > 1.0 {
                *s = clamp(*s);
            }
        }
    }
    let lambdas: Vec<f32> = sigmas.iter().map(|&s| lambda(s)).collect();
    let mut old_denoised: Option<Vec<f32>> = None;
    let mut old_denoised_d: Option<Vec<f32>> = None;
    for i in 0..ev.steps {
        let den = ev.pred(&x, sigmas[i], i, true)?;
        let stage = MAX_STAGE.min(i + 1);
        if sigmas[i + 1] == 0.0 {
            x = den.clone();
        } else {
            let (alpha_s, alpha_t) = (alpha(sigmas[i]), alpha(sigmas[i + 1]));
            let r_alpha = if alpha_s > 0.0 { alpha_t / alpha_s } else { 0.0 };
            let (ls, lt) = (lambdas[i], lambdas[i + 1]);
            let (scaled_s, scaled_t) = (scaler(ls), scaler(lt));
            let r = if scaled_s > 0.0 { scaled_t / scaled_s } else { 0.0 };
            let (kx, kd) = (r_alpha * r, alpha_t * (1.0 - r));
            for (xv, &dv) in x.iter_mut().zip(&den) {
                *xv = kx * *xv + kd * dv;
            }
            if let (true, Some(old)) = (stage >= 2, &old_denoised) {
                let third = stage >= 3 && old_denoised_d.is_some();
                let dt = lt - ls;
                let step = -dt / POINTS as f32;
                let (mut s, mut s_u) = (0.0_f32, 0.0_f32);
                for p in 0..POINTS {
                    let lambda_pos = lt + p as f32 * step;
                    let scaled_pos = scaler(lambda_pos);
                    if scaled_pos <= 0.0 {
                        continue;
                    }
                    s += 1.0 / scaled_pos;
                    if third {
                        s_u += (lambda_pos - ls) / scaled_pos;
                    }
                }
                s *= step;
                let denom_d = ls - lambdas[i - 1];
                if denom_d.abs() > 1e-12 {
                    let coeff_d = alpha_t * (dt + s * scaled_t);
                    let den_d: Vec<f32> = den.iter().zip(old).map(|(&dv, &ov)| (dv - ov) / denom_d).collect();
                    for (xv, &dd) in x.iter_mut().zip(&den_d) {
                        *xv += coeff_d * dd;
                    }
                    if let (true, Some(old_d)) = (third, &old_denoised_d) {
                        let denom_u = (ls - lambdas[i - 2]) * 0.5;
                        if denom_u.abs() > 1e-12 {
                            s_u *= step;
                            let coeff_u = alpha_t * (0.5 * dt * dt + s_u * scaled_t);
                            for ((xv, &dd), &od) in x.iter_mut().zip(&den_d).zip(old_d) {
                                *xv += coeff_u * ((dd - od) / denom_u);
                            }
                        }
                    }
                    old_denoised_d = Some(den_d);
                }
            }
            let noise_sq = lt * lt - ls * ls * r * r;
            if s_noise > 0.0 && noise_sq > 0.0 {
                add_noise::<E>(&mut x, rng, alpha_t * noise_sq.max(0.0).sqrt())?;
            }
        }
        old_denoised = Some(den);
    }
    Ok(x)
}

/// TCD: DDIM-like steps with the SD training alphas (in double, as the reference builds them),
/// stepping to timestep `floor((1 - eta) * t_prev)` and, with `eta > 0`, re-noising.
pub(super) fn tcd<D, R, E>(
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
    // sqrt(beta) in float, its square and the running product in double.
    let (ls, le) = (SD_LINEAR_START.sqrt(), SD_LINEAR_END.sqrt());
    let mut prod = 1.0_f64;
    let alphas_cumprod: Vec<f64> = (0..TIMESTEPS)
        .map(|i| {
            let beta_sqrt = f64::from(ls + (le - ls) * (i as f32 / (TIMESTEPS - 1) as f32));
            prod *= 1.0 - beta_sqrt * beta_sqrt;
            prod
        })
        .collect();
    let table: Vec<f64> = alphas_cumprod.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect();
    // The nearest table entry (ties to the lower), found from the first entry >= s.
    let timestep_of = |s: f32| -> usize {
        let s = f64::from(s);
        let hi = table.partition_point(|&v| v < s);
        if hi == 0 {
            return 0;
        }
        if hi == table.len() {
            return table.len() - 1;
        }
        if (table[hi] - s).abs() < (table[hi - 1] - s).abs() {
            hi
        } else {
            hi - 1
        }
    };
    for i in 0..ev.steps {
        let (sigma, sigma_to) = (sigmas[i], sigmas[i + 1]);
        let prev_timestep = timestep_of(sigma_to);
        let timestep_s = ((1.0 - eta) * prev_timestep as f32).floor() as i64;
        let den = ev.pred(&x, sigma, i, true)?;
        let alpha_prod_t_prev = 1.0 / (sigma_to * sigma_to + 1.0);
        // A negative index (eta > 1) is outside the reference's table too; clamp it to 0.
        let alpha_prod_s = alphas_cumprod[timestep_s.clamp(0, TIMESTEPS as i64 - 1) as usize] as f32;
        let beta_prod_s = 1.0 - alpha_prod_s;
        let (k_den, k_d) = ((alpha_prod_s / alpha_prod_t_prev).sqrt(), (beta_prod_s / alpha_prod_t_prev).sqrt());
        for (xv, &dv) in x.iter_mut().zip(&den) {
            let d = (*xv - dv) / sigma;
            *xv = k_den * dv + k_d * d;
        }
        if eta > 0.0 && sigma_to > 0.0 {
            let k_x = (alpha_prod_t_prev / alpha_prod_s).sqrt();
            let k_z = (1.0 / alpha_prod_t_prev - 1.0 / alpha_prod_s).sqrt();
            let z = draw::<E>(rng, x.len())?;
            for (xv, &zv) in x.iter_mut().zip(&z) {
                *xv = k_x * *xv + k_z * zv;
            }
        }
    }
    Ok(x)
}

/// Euler CFG++ (`ancestral` `None`) and Euler ancestral CFG++ (`Some((rng, eta))`): the step's
/// direction comes from the unconditional estimate, its target from the guided one.
pub(super) fn euler_cfg_pp<D, R, E>(
    ev: &mut Evals<'_, D>,
    mut x: Vec<f32>,
    sigmas: &[f32],
    mut ancestral: Option<(&mut dyn NoiseRng, f32)>,
) -> Result<Vec<f32>, E>
where
    D: FnMut(&[f32], f32, Step) -> Result<R, E>,
    R: Into<Denoised>,
    E: From<SamplingError>,
{
    for i in 0..ev.steps {
        let sigma = sigmas[i];
        let Denoised { pred, uncond } = ev.full(&x, sigma, i, true)?;
        let uncond = uncond.as_ref().unwrap_or(&pred);
        let (sigma_down, sigma_up) = match &ancestral {
            Some((_, eta)) => ancestral_step(sigma, sigmas[i + 1], *eta),
            None => (sigmas[i + 1], 0.0),
        };
        for ((xv, &pv), &uv) in x.iter_mut().zip(&pred).zip(uncond) {
            let d = (*xv - uv) / sigma;
            *xv = pv + d * sigma_down;
        }
        if let Some((rng, _)) = &mut ancestral {
            if sigmas[i + 1] > 0.0 {
                add_noise::<E>(&mut x, &mut **rng, sigma_up)?;
            }
        }
    }
    Ok(x)
}

/// Euler with gradient estimation (`gamma` 2): from the second step on, the derivative is
/// `gamma d + (1 - gamma) d_old`; with `eta > 0`, ancestral noise as in `euler_a` (on a flow
/// schedule, its flow step).
pub(super) fn euler_ge<D, R, E>(
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
    const GAMMA: f32 = 2.0;
    let mut old_d: Option<Vec<f32>> = None;
    for i in 0..ev.steps {
        let (sigma, sigma_to) = (sigmas[i], sigmas[i + 1]);
        let den = ev.pred(&x, sigma, i, true)?;
        if sigma_to == 0.0 {
            x = den;
            continue;
        }
        let (sigma_down, sigma_up, alpha_scale) = ancestral(sigma, sigma_to, eta, flow);
        let d: Vec<f32> = x.iter().zip(&den).map(|(&xv, &dv)| (xv - dv) / sigma).collect();
        let dt = sigma_down - sigma;
        match &old_d {
            Some(old) => {
                for ((xv, &dv), &ov) in x.iter_mut().zip(&d).zip(old) {
                    *xv += (dv * GAMMA + ov * (1.0 - GAMMA)) * dt;
                }
            }
            None => {
                for (xv, &dv) in x.iter_mut().zip(&d) {
                    *xv += dv * dt;
                }
            }
        }
        old_d = Some(d);
        if sigma_up > 0.0 {
            rescale_and_add_noise::<E>(&mut x, rng, flow.then_some(alpha_scale), sigma_up)?;
        }
    }
    Ok(x)
}
