//! The ControlNet's part of a sampling step: its residuals for each batch the UNet evaluates.

use sd_sched::Runner;

use super::Result;
use crate::diffusion::controlnet::{ControlNetModel, ControlResiduals};
use crate::text::conditioning::Conditioning;

/// A loaded ControlNet with its runner, its hint (the control image, planar `[3, H, W]` in
/// `[0, 1]`, as the reference's `sd_image_to_tensor` gives it) and the strength.
pub(super) struct ControlStage {
    pub model: ControlNetModel,
    pub runner: Runner,
    pub hint: Vec<f32>,
    pub strength: f32,
}

impl ControlStage {
    /// The residuals for latents `x` (one per conditioning, the latent's channels only) at
    /// `timesteps`: the ControlNet runs on the same input as the UNet, with each sample's
    /// text context (the reference runs it for the cond pass and again for the uncond one).
    pub fn residuals(
        &mut self,
        x: &[f32],
        dims: (usize, usize),
        timesteps: &[f32],
        conds: &[&Conditioning],
    ) -> Result<ControlResiduals> {
        let Some(first) = conds.first() else {
            return Err(super::PipelineError::Invalid("a ControlNet batch needs a conditioning".into()));
        };
        let context: Vec<f32> = conds.iter().flat_map(|c| c.data.iter().copied()).collect();
        let y: Vec<f32> = conds.iter().flat_map(|c| c.vector.iter().copied()).collect();
        let hint: Vec<f32> = std::iter::repeat_n(&self.hint, conds.len()).flatten().copied().collect();
        let n = conds.len();
        let r = self.model.eval(
            &mut self.runner,
            x,
            dims,
            &hint,
            timesteps,
            &context,
            first.n_tokens,
            n,
            &y,
            self.strength,
        )?;
        Ok(r)
    }
}
