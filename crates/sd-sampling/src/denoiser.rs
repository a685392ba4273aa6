//! Turning a raw UNet output into the denoised estimate the samplers need (k-diffusion style).
//!
//! The samplers only ever ask "what is the clean latent for `x` at noise level `sigma`?". For an
//! SD checkpoint that answer is assembled from the UNet's raw prediction exactly as the reference
//! does it: scalings `c_skip, c_out, c_in` of the parameterisation (CompVis eps or v), the model
//! input `x * c_in`, the timestep `t = sigma_to_t(sigma)` from the discrete schedule,
//! classifier-free guidance `uncond + cfg * (cond - uncond)` (the unconditional pass only when
//! `cfg != 1`), then `pred * c_out + x * c_skip`.
//!
//! A flow-matching schedule ([`FlowSchedule`](super::FlowSchedule): FLUX.1, SD3) brings its own
//! parameterisation, as the reference's flow denoisers do: [`Scalings::flow`] (`c_skip = 1`,
//! `c_out = -sigma`, `c_in = 1`; the model predicts the velocity `noise - x0`), and the timestep
//! is the schedule's (`sigma` for FLUX.1, `1000 sigma` for SD3). The [`Prediction`] is then not read.
//!
//! [`GuidedDenoiser`] does that around a caller-supplied model callback, so the pipeline can run
//! the UNet once per sigma on cond and uncond together (one batch) and hand back both outputs.

use std::fmt;
use std::str::FromStr;

use super::sampler::Denoised;
use super::schedule::NoiseSchedule;
use super::{parse_name, SamplingError, SkipLayerGuidance, Step};

/// What the diffusion model predicts (`--prediction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Prediction {
    /// Noise (epsilon) prediction: SD 1.x, SD 2.x base (512), SD-Turbo.
    Eps,
    /// Velocity prediction: SD 2.x 768-v.
    V,
}

impl Prediction {
    /// The parameterisations implemented here.
    pub const ALL: [Prediction; 2] = [Prediction::Eps, Prediction::V];

    /// Names the reference accepts that are not implemented here.
    pub const NOT_IMPLEMENTED: [&'static str; 4] = ["edm_v", "sd3_flow", "flux_flow", "flux2_flow"];

    /// The name the reference's CLI accepts.
    pub fn name(self) -> &'static str {
        match self {
            Prediction::Eps => "eps",
            Prediction::V => "v",
        }
    }

    /// The prediction a metadata value names: sd.cpp's `eps` / `v` and the spellings found in
    /// model files (`epsilon`, `v_prediction`, `v-prediction`, `vpred`, `v_pred`), ignoring
    /// ASCII case; `None` for anything else.
    pub fn from_metadata(s: &str) -> Option<Prediction> {
        match s.to_ascii_lowercase().as_str() {
            "eps" | "epsilon" => Some(Prediction::Eps),
            "v" | "v_prediction" | "v-prediction" | "vpred" | "v_pred" => Some(Prediction::V),
            _ => None,
        }
    }

    /// The k-diffusion scalings at `sigma` (sigma_data = 1), in the reference's operation order.
    pub fn scalings(self, sigma: f32) -> Scalings {
        const SIGMA_DATA: f32 = 1.0;
        let var = sigma * sigma + SIGMA_DATA * SIGMA_DATA;
        let c_in = 1.0 / var.sqrt();
        match self {
            Prediction::Eps => Scalings { c_skip: 1.0, c_out: -sigma, c_in },
            Prediction::V => {
                Scalings { c_skip: SIGMA_DATA * SIGMA_DATA / var, c_out: -sigma * SIGMA_DATA / var.sqrt(), c_in }
            }
        }
    }
}

impl fmt::Display for Prediction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Prediction {
    type Err = SamplingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("prediction", s, &Prediction::ALL, |k| k.name(), &Prediction::NOT_IMPLEMENTED)
    }
}

/// `denoised = model_output * c_out + x * c_skip`, with the model fed `x * c_in`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scalings {
    /// Weight of the noisy input in the denoised estimate.
    pub c_skip: f32,
    /// Weight of the model output in the denoised estimate.
    pub c_out: f32,
    /// Scale applied to the noisy input before the model sees it.
    pub c_in: f32,
}

impl Scalings {
    /// The flow-matching scalings at `sigma` (the reference's `DiscreteFlowDenoiser`, which
    /// FLUX.1's denoiser inherits): `c_skip = 1`, `c_out = -sigma`, `c_in = 1`.
    pub fn flow(sigma: f32) -> Self {
        Scalings { c_skip: 1.0, c_out: -sigma, c_in: 1.0 }
    }
}

/// What the model callback of a [`GuidedDenoiser`] is asked to compute.
#[derive(Debug)]
pub struct ModelInput<'a> {
    /// The model's input latent, already scaled: `x * c_in`.
    pub x: &'a [f32],
    /// The (fractional) timestep for the model's time embedding: `sigma_to_t(sigma)`.
    pub timestep: f32,
    /// The noise level being denoised (for logging; the model uses `timestep`).
    pub sigma: f32,
    /// Which sampling step this evaluation belongs to.
    pub step: Step,
    /// Whether the unconditional (negative-prompt) output is needed as well (the reference:
    /// `cfg` differs from the image guidance scale, 1 unless set).
    pub uncond: bool,
    /// Whether the image-unconditional output is needed as well (an image guidance scale other
    /// than 1): the negative prompt without the images the model reads beside the latent
    /// (FLUX.2's reference images).
    pub img_uncond: bool,
    /// Skip-layer guidance at this evaluation: the blocks to leave out of a further evaluation
    /// of the prompt's conditioning ([`ModelOutput::skipped`]).
    pub skip_layers: Option<&'a [usize]>,
}

/// The model callback's answer: the conditional output, and the unconditional one if asked.
#[derive(Clone, Debug, Default)]
pub struct ModelOutput {
    /// Output for the prompt's conditioning.
    pub cond: Vec<f32>,
    /// Output for the negative prompt's conditioning; required when [`ModelInput::uncond`] is set.
    pub uncond: Option<Vec<f32>>,
    /// Output for the prompt's conditioning with [`ModelInput::skip_layers`] left out; required
    /// when they are given.
    pub skipped: Option<Vec<f32>>,
    /// Output for the image-unconditional conditioning; required when [`ModelInput::img_uncond`]
    /// is set.
    pub img_uncond: Option<Vec<f32>>,
}

/// A denoiser for the samplers built from a raw model callback, a parameterisation, the
/// noise schedule (for timesteps; a flow schedule also sets the scalings) and a
/// classifier-free-guidance scale.
pub struct GuidedDenoiser<'s, F> {
    schedule: &'s dyn NoiseSchedule,
    prediction: Prediction,
    cfg_scale: f32,
    /// The image guidance scale (`--img-cfg-scale`; 1: off).
    img_cfg: f32,
    slg: Option<SkipLayerGuidance>,
    model: F,
}

impl<F> fmt::Debug for GuidedDenoiser<'_, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuidedDenoiser")
            .field("prediction", &self.prediction)
            .field("cfg_scale", &self.cfg_scale)
            .finish_non_exhaustive()
    }
}

impl<'s, F> GuidedDenoiser<'s, F> {
    /// Wraps `model`; with `cfg_scale == 1` the unconditional pass is never requested.
    pub fn new(schedule: &'s dyn NoiseSchedule, prediction: Prediction, cfg_scale: f32, model: F) -> Self {
        GuidedDenoiser { schedule, prediction, cfg_scale, img_cfg: 1.0, slg: None, model }
    }

    /// With an image guidance scale (`--img-cfg-scale`; 1: off): the reference's three-pass
    /// guidance `img_uncond + img_cfg (uncond - img_uncond) + cfg (cond - uncond)`.
    pub fn with_image_guidance(mut self, img_cfg: f32) -> Self {
        self.img_cfg = img_cfg;
        self
    }

    /// With skip-layer guidance (`None` or a scale of 0: without).
    pub fn with_skip_layer_guidance(mut self, slg: Option<SkipLayerGuidance>) -> Self {
        self.slg = slg.filter(|s| s.scale != 0.0 && !s.layers.is_empty());
        self
    }

    /// Whether each evaluation needs the unconditional output (the reference: `cfg` differs from
    /// the image guidance scale, 1 unless set).
    fn uses_uncond(&self) -> bool {
        self.cfg_scale != self.img_cfg
    }

    /// The denoised estimate of `x` at `sigma`: one model evaluation (cond and, if guided, uncond).
    pub fn denoise<E>(&mut self, x: &[f32], sigma: f32, step: Step) -> Result<Vec<f32>, E>
    where
        F: FnMut(ModelInput<'_>) -> Result<ModelOutput, E>,
        E: From<SamplingError>,
    {
        Ok(self.denoise_full(x, sigma, step, false)?.pred)
    }

    /// Like [`GuidedDenoiser::denoise`]; with `with_uncond` (the CFG++ samplers, see
    /// [`SampleMethod::needs_uncond_denoised`](super::SampleMethod::needs_uncond_denoised)) also
    /// the unconditional output turned into a denoised estimate, or the conditional one when
    /// guidance is off, as the reference does.
    pub fn denoise_full<E>(&mut self, x: &[f32], sigma: f32, step: Step, with_uncond: bool) -> Result<Denoised, E>
    where
        F: FnMut(ModelInput<'_>) -> Result<ModelOutput, E>,
        E: From<SamplingError>,
    {
        let Scalings { c_skip, c_out, c_in } =
            if self.schedule.is_flow() { Scalings::flow(sigma) } else { self.prediction.scalings(sigma) };
        let timestep = self.schedule.sigma_to_t(sigma);
        let x_in: Vec<f32> = x.iter().map(|&v| v * c_in).collect();
        let uncond = self.uses_uncond();
        let img_uncond = self.img_cfg != 1.0;
        let slg = self.slg.as_ref().filter(|s| s.applies(step));
        let skip_layers = slg.map(|s| s.layers.as_slice());
        let out = (self.model)(ModelInput { x: &x_in, timestep, sigma, step, uncond, img_uncond, skip_layers })?;
        check_len("model output (cond)", x.len(), out.cond.len())?;
        let denoised =
            |pred: &[f32]| -> Vec<f32> { pred.iter().zip(x).map(|(&p, &xv)| p * c_out + xv * c_skip).collect() };
        // The prompt's prediction before guidance, for skip-layer guidance.
        let cond = slg.map(|_| out.cond.clone());
        let mut pred = out.cond;
        let mut uncond_denoised = None;
        let u = asked_output(out.uncond, uncond, "model output (uncond)", x.len())?;
        let iu = asked_output(out.img_uncond, img_uncond, "model output (image uncond)", x.len())?;
        // CFG++ takes the image-unconditional output, else the unconditional one.
        if with_uncond {
            uncond_denoised = iu.as_deref().or(u.as_deref()).map(&denoised);
        }
        let (cfg, img_cfg) = (self.cfg_scale, self.img_cfg);
        match (&u, &iu) {
            (Some(u), Some(iu)) => {
                for ((p, &u), &iu) in pred.iter_mut().zip(u).zip(iu) {
                    *p = iu + img_cfg * (u - iu) + cfg * (*p - u);
                }
            }
            (Some(u), None) => {
                for (p, &u) in pred.iter_mut().zip(u) {
                    *p = u + cfg * (*p - u);
                }
            }
            (None, Some(iu)) => {
                for (p, &iu) in pred.iter_mut().zip(iu) {
                    *p = iu + cfg * (*p - iu);
                }
            }
            (None, None) => {}
        }
        if let (Some(s), Some(cond)) = (slg, cond) {
            let Some(skipped) = out.skipped else {
                return Err(SamplingError::MissingSkipped.into());
            };
            check_len("model output (skipped layers)", x.len(), skipped.len())?;
            for ((p, &c), &k) in pred.iter_mut().zip(&cond).zip(&skipped) {
                *p += (c - k) * s.scale;
            }
        }
        let pred = denoised(&pred);
        if with_uncond && uncond_denoised.is_none() {
            uncond_denoised = Some(pred.clone());
        }
        Ok(Denoised { pred, uncond: uncond_denoised })
    }
}

/// A negative pass's output where it was asked for (`asked`), of the latent's length `n`.
fn asked_output(
    out: Option<Vec<f32>>,
    asked: bool,
    what: &'static str,
    n: usize,
) -> Result<Option<Vec<f32>>, SamplingError> {
    if !asked {
        return Ok(None);
    }
    let v = out.ok_or(SamplingError::MissingUncond)?;
    check_len(what, n, v.len())?;
    Ok(Some(v))
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), SamplingError> {
    if expected == got {
        Ok(())
    } else {
        Err(SamplingError::LengthMismatch { what, expected, got })
    }
}
