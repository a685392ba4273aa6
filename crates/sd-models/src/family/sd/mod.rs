//! The SD 1.x / 2.x family (SD-Turbo too): one CLIP text encoder (OpenAI ViT-L/14 for 1.x,
//! OpenCLIP ViT-H/14 for 2.x), the `openaimodel` UNet, the KL-f8 VAE, a discrete DDPM
//! schedule and `euler_a` by default, as the reference runs them.
//!
//! `sd_arch::sd` detects the two architectures (`sd1`, `sd2`) and numbers their blocks; this
//! file registers their runtime.

use std::sync::Arc;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};
use sd_vae::{TaesdConfig, VaeConfig};

use super::{
    DiffusionModel, DiffusionSettings, DtypeOf, Family, FamilySpec, SamplingDefaults, TextEncoder, TextRequest,
};
use crate::diffusion::controlnet::{ControlNetConfig, ControlResiduals};
use crate::diffusion::unet::{self, UNetConfig, UNetModel};
use crate::files::{Detected, FileRole, ModelFiles};
use crate::lora::{LoraBody, LoraPrefix};
use crate::pipeline::{PipelineError, Result};
use crate::sampling::{AysLevels, DiscreteSchedule, SampleMethod, AYS_SD15};
use crate::text::clip::{clip_specs, ClipConfig, ClipTextModel};
use crate::text::conditioning::{encode_prompt, Conditioning};
use crate::text::ClipTokenizer;

/// Pixels per latent position.
const VAE_SCALE_FACTOR: usize = 8;
/// How much the UNet downsamples a latent (three stride-2 levels).
const UNET_DOWN_FACTOR: usize = 8;

/// The text encoder and UNet configurations of an SD 1.x (`sd1`) or 2.x (`sd2`) file; `None`
/// for another architecture.
pub fn configs(arch: &str) -> Option<(ClipConfig, UNetConfig)> {
    match arch {
        "sd1" => Some((ClipConfig::vit_l14(), UNetConfig::sd15())),
        "sd2" => Some((ClipConfig::vit_h14(), UNetConfig::sd21())),
        _ => None,
    }
}

/// Where SD 1.x / 2.x LoRA keys point: kohya's flat names of the UNet and the text encoder,
/// and diffusers/PEFT's dotted ones (bodies in diffusers or LDM layout, normalised as files of
/// that role are).
pub(crate) const LORA_PREFIXES: [LoraPrefix; 6] = [
    LoraPrefix { prefix: "lora_unet_", role: FileRole::DiffusionModel, body: LoraBody::Flat },
    LoraPrefix { prefix: "lora_te_", role: FileRole::TextEncoder(0), body: LoraBody::Flat },
    LoraPrefix { prefix: "unet.", role: FileRole::DiffusionModel, body: LoraBody::Dotted },
    LoraPrefix { prefix: "model.diffusion_model.", role: FileRole::DiffusionModel, body: LoraBody::Dotted },
    LoraPrefix { prefix: "text_encoder.", role: FileRole::TextEncoder(0), body: LoraBody::Dotted },
    LoraPrefix { prefix: "cond_stage_model.transformer.", role: FileRole::TextEncoder(0), body: LoraBody::Dotted },
];

/// SD 1.x or 2.x, built for a set of files.
#[derive(Debug)]
struct Sd {
    arch: &'static str,
    clip: ClipConfig,
    unet: UNetConfig,
    tokenizer: Arc<ClipTokenizer>,
}

fn build(detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let (clip, mut unet) = configs(detected.arch)
        .ok_or_else(|| PipelineError::Invalid(format!("`{}` is not an SD 1.x / 2.x architecture", detected.arch)))?;
    // An inpainting checkpoint's UNet takes 9 channels (detection admits only 4 or 9).
    if let Some(e) = files.index().get(sd_arch::sd::UNET_CONV_IN).filter(|e| e.shape.len() == 4) {
        unet.in_channels = e.shape[1] as i64;
    }
    Ok(Box::new(Sd { arch: detected.arch, clip, unet, tokenizer: Arc::new(ClipTokenizer::new()) }))
}

inventory::submit! { FamilySpec { arch: "sd1", build } }
inventory::submit! { FamilySpec { arch: "sd2", build } }

impl Family for Sd {
    fn arch(&self) -> &'static str {
        self.arch
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        clip_specs(&self.clip, dtype, wtype)
    }

    fn check_text(&self, clip_skip: i64) -> Result<()> {
        self.clip.resolve_clip_skip(clip_skip)?;
        Ok(())
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        let model = ClipTextModel::new(self.clip.clone(), weights)?;
        Ok(Box::new(SdText { model, tokenizer: self.tokenizer.clone() }))
    }

    fn diffusion_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        unet::unet_specs(&self.unet, dtype, wtype)
    }

    fn diffusion_group(&self, name: &str) -> String {
        unet::group_of(name)
    }

    fn diffusion_row_splittable(&self, spec: &TensorSpec) -> bool {
        unet::row_splittable(spec)
    }

    fn text_row_splittable(&self, spec: &TensorSpec) -> bool {
        crate::text::clip::row_splittable(spec)
    }

    fn load_diffusion(&self, weights: Weights, settings: &DiffusionSettings) -> Result<Box<dyn DiffusionModel>> {
        self.unet.validate()?;
        Ok(Box::new(UNetModel { cfg: self.unet.clone(), weights, flash_attn: settings.flash_attn }))
    }

    fn latent_channels(&self) -> usize {
        self.unet.out_channels as usize
    }

    fn concat_channels(&self) -> usize {
        (self.unet.in_channels - self.unet.out_channels) as usize
    }

    fn spatial_multiple(&self) -> usize {
        VAE_SCALE_FACTOR * UNET_DOWN_FACTOR
    }

    fn attention_bytes(&self, tokens: f64, batch: f64, flash_attn: bool) -> f64 {
        if flash_attn {
            0.0
        } else {
            self.unet.attention_scores_bytes(tokens, batch)
        }
    }

    fn vae(&self) -> Option<VaeConfig> {
        Some(VaeConfig::sd())
    }

    fn taesd(&self) -> Option<TaesdConfig> {
        Some(TaesdConfig::sd())
    }

    fn lora_prefixes(&self) -> &'static [LoraPrefix] {
        &LORA_PREFIXES
    }

    fn control_net(&self) -> Option<ControlNetConfig> {
        Some(ControlNetConfig::for_unet(&self.unet))
    }

    fn sampling(&self) -> SamplingDefaults {
        let ays = if self.arch == "sd2" { AysLevels::Unpublished("SD 2.x") } else { AysLevels::Table(&AYS_SD15) };
        SamplingDefaults { ays, method: SampleMethod::EulerA, schedule: DiscreteSchedule::sd().into(), cfg_scale: 7.0 }
    }
}

/// The CLIP text encoder with its tokenizer.
struct SdText {
    model: ClipTextModel,
    tokenizer: Arc<ClipTokenizer>,
}

impl TextEncoder for SdText {
    fn weights(&self) -> &Weights {
        self.model.weights()
    }

    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> Result<Conditioning> {
        Ok(encode_prompt(&self.model, runner, &self.tokenizer, request.prompt, request.clip_skip)?)
    }
}

impl DiffusionModel for UNetModel {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn eval(
        &self,
        runner: &mut Runner,
        x: &[f32],
        dims: (usize, usize),
        timesteps: &[f32],
        cond: &[&Conditioning],
    ) -> Result<Vec<f32>> {
        DiffusionModel::eval_controlled(self, runner, x, dims, timesteps, cond, None)
    }

    fn eval_controlled(
        &self,
        runner: &mut Runner,
        x: &[f32],
        dims: (usize, usize),
        timesteps: &[f32],
        cond: &[&Conditioning],
        controls: Option<&ControlResiduals>,
    ) -> Result<Vec<f32>> {
        let first = cond.first().ok_or_else(|| PipelineError::Invalid("a UNet batch needs a conditioning".into()))?;
        if let Some(other) = cond.iter().find(|c| !c.batches_with(first)) {
            return Err(PipelineError::Invalid(format!(
                "conditionings of one UNet batch differ in shape: {:?} and {:?}",
                first.shape(),
                other.shape()
            )));
        }
        let joined: Vec<f32>;
        let context: &[f32] = if cond.len() == 1 {
            &first.data
        } else {
            joined = cond.iter().flat_map(|c| c.data.iter().copied()).collect();
            &joined
        };
        let y: Vec<f32> = cond.iter().flat_map(|c| c.vector.iter().copied()).collect();
        Ok(UNetModel::eval_controlled(
            self,
            runner,
            x,
            dims,
            timesteps,
            context,
            first.n_tokens,
            cond.len(),
            &y,
            controls,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference samples SD 1.x and 2.x with `euler_a` at cfg 7; Align Your Steps has a
    /// published table for 1.5 only.
    #[test]
    fn sampling_defaults_of_1x_and_2x() {
        for (arch, ays) in [("sd1", AysLevels::Table(&AYS_SD15)), ("sd2", AysLevels::Unpublished("SD 2.x"))] {
            let (clip, unet) = configs(arch).unwrap();
            let sd = Sd { arch, clip, unet, tokenizer: Arc::new(ClipTokenizer::new()) };
            let d = sd.sampling();
            assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::EulerA, ays, 7.0), "{arch}");
        }
    }
}
