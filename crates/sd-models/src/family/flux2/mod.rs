//! The FLUX.2 klein family (4B and 9B, distilled and base): Qwen3's hidden states after layers
//! 9, 18 and 27 side by side as the context (`crate::text::qwen3`, klein's chat template, the
//! prompt padded to 512 tokens), FLUX's DiT with FLUX.2's shared modulations and gated MLPs
//! (`crate::diffusion::flux`, configuration read from the file), FLUX.2's 32-channel VAE whose
//! latent the DiT reads in 2x2 patches (`sd_vae::VaeConfig::flux2`: 128 channels at 1/16 of
//! the image) and flow-matching sampling with FLUX.2's shift derived from the steps and the
//! image size (`FlowSchedule::flux2`), as the reference runs them.
//!
//! Files come as the reference takes them: `--diffusion-model`, `--llm` (Qwen3-4B for klein 4B,
//! Qwen3-8B for 9B) and `--vae`. Without the LLM or the VAE a generation is refused with
//! [`PipelineError::MissingComponent`]; an LLM of the wrong width or with fewer than 27 layers
//! is refused before anything loads. FLUX.2 dev (Mistral-Small-3.2 as its encoder) is detected
//! by `sd_arch::flux2` and refused as having no runtime yet.
//!
//! `--cfg-scale` defaults to 1: klein is distilled to sample without classifier-free guidance
//! in four steps (its base models want `--cfg-scale` set). `--flow-shift` does not move the
//! shift (the reference derives it again for every run). Reference images (`-r`) and TAESD
//! (the reference's TAEF2) are not supported yet and are refused.

mod text;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};
use sd_vae::{TaesdConfig, VaeConfig};

use super::{
    DiffusionModel, DiffusionSettings, DtypeOf, Family, FamilySpec, SamplingDefaults, TextEncoder, TextRequest,
};
use crate::diffusion::flux::{self, FluxConfig, FluxModel};
use crate::files::{Detected, FileRole, ModelFiles};
use crate::pipeline::{PipelineError, Result};
use crate::sampling::{AysLevels, FlowSchedule, SampleMethod};
use crate::text::conditioning::Conditioning;
use crate::text::qwen3::{self, Qwen3Config, Qwen3Encoder};
use crate::text::Qwen2Tokenizer;
use text::{conditioner_error, OUT_LAYERS};

/// Pixels per diffusion latent position (the VAE's 8, times its 2x2 patches).
const LATENT_SCALE: usize = 16;
/// Qwen3's token embedding under the internal names (`--llm` files land there).
const LLM_PROBE: &str = "text_encoders.llm.model.embed_tokens.weight";
/// The VAE's decoder input convolution (`--vae` files land there).
const VAE_PROBE: &str = "first_stage_model.decoder.conv_in.weight";

/// FLUX.2 klein built for a set of files.
#[derive(Debug)]
struct Flux2 {
    dit: FluxConfig,
    llm: Qwen3Config,
}

fn build(_detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let index = files.index();
    let tensors: Vec<(String, Vec<u64>)> =
        index.entries().iter().filter(|e| e.name.starts_with(flux::PREFIX)).map(|e| (e.name.clone(), e.ne())).collect();
    let dit = FluxConfig::from_file(&tensors)?;
    if !dit.flux2 {
        return Err(PipelineError::Invalid(format!("a FLUX.2 model needs '{}'", sd_arch::flux2::PROBE)));
    }
    if !index.contains(LLM_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: "FLUX.2 klein",
            role: FileRole::Llm,
            what: "its Qwen3 text encoder (no text_encoders.llm tensors in the files)".into(),
        });
    }
    if !index.contains(VAE_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: "FLUX.2 klein",
            role: FileRole::Vae,
            what: "its VAE (FLUX.2's 32-channel autoencoder; no first_stage_model tensors in the files)".into(),
        });
    }
    let llm = Qwen3Config::from_index(index).map_err(conditioner_error)?;
    let deepest = OUT_LAYERS[OUT_LAYERS.len() - 1];
    if llm.n_layers < deepest {
        return Err(PipelineError::Invalid(format!(
            "the LLM (--llm) has {} layers; FLUX.2 klein reads its layers {OUT_LAYERS:?}, so it needs at least {deepest}",
            llm.n_layers
        )));
    }
    let width = (OUT_LAYERS.len() * llm.hidden) as i64;
    if width != dit.context_in_dim {
        return Err(PipelineError::Invalid(format!(
            "the LLM (--llm) is {} wide, so its {} layers give {width} values per token; the FLUX.2 model's \
             txt_in takes {} (tensor 'model.diffusion_model.txt_in.weight'): klein 4B takes Qwen3-4B, 9B Qwen3-8B",
            llm.hidden,
            OUT_LAYERS.len(),
            dit.context_in_dim
        )));
    }
    Ok(Box::new(Flux2 { dit, llm }))
}

inventory::submit! { FamilySpec { arch: "flux2-klein", build } }

impl Family for Flux2 {
    fn arch(&self) -> &'static str {
        "flux2-klein"
    }

    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &super::flux::lora::LORA_PREFIXES
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        qwen3::qwen3_specs(&self.llm, dtype, wtype)
    }

    /// `--clip-skip` has no effect: the context is layers 9, 18 and 27.
    fn check_text(&self, _clip_skip: i64) -> Result<()> {
        Ok(())
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        Qwen3Encoder::new(&self.llm, &weights).map_err(conditioner_error)?;
        Ok(Box::new(text::KleinText { cfg: self.llm.clone(), weights, tokenizer: Qwen2Tokenizer::new() }))
    }

    fn text_row_splittable(&self, spec: &TensorSpec) -> bool {
        qwen3::row_splittable(spec)
    }

    fn diffusion_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        flux::flux_specs(&self.dit, dtype, wtype)
    }

    fn diffusion_group(&self, name: &str) -> String {
        flux::group_of(name)
    }

    fn diffusion_row_splittable(&self, spec: &TensorSpec) -> bool {
        super::flux::dit_row_splittable(spec)
    }

    fn load_diffusion(&self, weights: Weights, settings: &DiffusionSettings) -> Result<Box<dyn DiffusionModel>> {
        self.dit.validate()?;
        Ok(Box::new(FluxModel {
            cfg: self.dit.clone(),
            weights,
            flash_attn: settings.flash_attn,
            guidance: settings.guidance,
        }))
    }

    /// 128: the VAE's 32 channels in 2x2 patches.
    fn latent_channels(&self) -> usize {
        self.dit.latent_channels() as usize
    }

    fn spatial_multiple(&self) -> usize {
        LATENT_SCALE
    }

    fn text_tokens(&self) -> u64 {
        text::MIN_TOKENS as u64
    }

    /// The joint attention's scores over the padded text and the image tokens (one per latent
    /// position), f32.
    fn attention_bytes(&self, tokens: f64, _batch: f64, flash_attn: bool) -> f64 {
        if flash_attn {
            return 0.0;
        }
        let all = tokens + text::MIN_TOKENS as f64;
        self.dit.num_heads as f64 * all * all * 4.0
    }

    fn vae(&self) -> VaeConfig {
        VaeConfig::flux2()
    }

    /// None yet: the reference's TAEF2 is not supported.
    fn taesd(&self) -> Option<TaesdConfig> {
        None
    }

    fn sampling(&self) -> SamplingDefaults {
        SamplingDefaults {
            ays: AysLevels::Unpublished("FLUX.2"),
            method: SampleMethod::Euler,
            schedule: FlowSchedule::flux2().into(),
            cfg_scale: 1.0,
        }
    }
}

impl TextEncoder for text::KleinText {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> Result<Conditioning> {
        text::KleinText::encode(self, runner, request.prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Schedule;

    /// Euler on FLUX.2's image-dependent shift, no classifier-free guidance, 16-pixel latents.
    #[test]
    fn sampling_defaults() {
        let k = Flux2 { dit: FluxConfig::flux2_klein_4b(), llm: Qwen3Config::qwen3_4b() };
        let d = k.sampling();
        assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::Euler, AysLevels::Unpublished("FLUX.2"), 1.0));
        assert!(matches!(d.schedule, Schedule::Flow(f) if f == FlowSchedule::flux2()));
        assert_eq!((k.spatial_multiple(), k.latent_channels()), (16, 128));
        assert_eq!(k.vae().latent_scale(), 16);
        assert_eq!(k.dit.context_in_dim, (OUT_LAYERS.len() * k.llm.hidden) as i64);
    }
}
