//! The Z-Image family (Turbo and base): Qwen3-4B's second-to-last hidden states as the
//! caption (`crate::text::qwen3`, Z-Image's chat template), the Z-Image DiT
//! (`crate::diffusion::zimage`, configuration read from the file), FLUX.1's 16-channel VAE
//! (`sd_vae::VaeConfig::flux`) and flow-matching sampling with SD3's linear time shift 3 and
//! `euler`, as the reference runs them.
//!
//! Files come as the reference takes them: `--diffusion-model` (ComfyUI's
//! `z_image_*.safetensors` or a GGUF of it), `--llm` (Qwen3-4B) and `--vae`. Without the LLM
//! or the VAE a generation is refused with [`PipelineError::MissingComponent`].
//!
//! The conditioner ([`ZImageText`]): the prompt in the chat template
//! (`ChatTemplate::Z_IMAGE`, the prompt's weighting syntax kept), the LLM's hidden states
//! after layer 35 of 36 (the reference's `out_layers = {35}`; a reduced-depth LLM gives its
//! final norm's output, as the reference does), the token weights applied with the mean
//! kept. Every token is the context (the template included: the reference starts at 0).
//!
//! `--cfg-scale` defaults to 1: the released Z-Image Turbo is distilled to sample without
//! classifier-free guidance (the reference's generic default is 7; the base model wants
//! `--cfg-scale` set).

mod lora;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};
use sd_vae::{TaesdConfig, VaeConfig};

use super::{
    DiffusionModel, DiffusionSettings, DtypeOf, Family, FamilySpec, SamplingDefaults, TextEncoder, TextRequest,
};
use crate::diffusion::zimage::{self, ZImageConfig, ZImageModel};
use crate::files::{Detected, FileRole, ModelFiles};
use crate::pipeline::{PipelineError, Result};
use crate::sampling::{AysLevels, FlowSchedule, SampleMethod};
use crate::text::conditioning::{apply_token_weights, Conditioning};
use crate::text::qwen3::{self, Qwen3Config, Qwen3Encoder, Qwen3Error};
use crate::text::{ChatTemplate, Qwen2Tokenizer};

/// Pixels per latent position.
const VAE_SCALE_FACTOR: usize = 8;
/// The DiT reads 2x2 patches of the latent.
const PATCH: usize = 2;
/// The LLM layer whose hidden states are the caption (1-based; the reference's `{35}`).
const OUT_LAYER: usize = 35;
/// SD3's linear time shift of Z-Image (the reference's `default_flow_shift` 3).
const FLOW_SHIFT: f32 = 3.0;
/// Qwen3's token embedding under the internal names (`--llm` files land there).
const LLM_PROBE: &str = "text_encoders.llm.model.embed_tokens.weight";
/// The VAE's decoder input convolution (`--vae` files land there).
const VAE_PROBE: &str = "first_stage_model.decoder.conv_in.weight";

/// Z-Image built for a set of files.
#[derive(Debug)]
struct ZImage {
    dit: ZImageConfig,
    llm: Qwen3Config,
}

fn build(_detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let index = files.index();
    let tensors: Vec<(String, Vec<u64>)> = index
        .entries()
        .iter()
        .filter(|e| e.name.starts_with(zimage::PREFIX))
        .map(|e| (e.name.clone(), e.ne()))
        .collect();
    let dit = ZImageConfig::from_file(&tensors)?;
    if !index.contains(LLM_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: "Z-Image",
            role: FileRole::Llm,
            what: "its Qwen3 text encoder (no text_encoders.llm tensors in the files)".into(),
        });
    }
    let taesd = index.files().iter().any(|f| f.role == FileRole::Taesd);
    if !taesd && !index.contains(VAE_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: "Z-Image",
            role: FileRole::Vae,
            what: "its VAE (FLUX.1's 16-channel autoencoder; no first_stage_model tensors in the files)".into(),
        });
    }
    let llm = Qwen3Config::from_index(index).map_err(conditioner_error)?;
    if llm.hidden as i64 != dit.cap_feat_dim {
        return Err(PipelineError::Invalid(format!(
            "the LLM is {} wide, the Z-Image model's cap_embedder takes {} (tensor '{}')",
            llm.hidden,
            dit.cap_feat_dim,
            sd_arch::zimage::CAP_NORM
        )));
    }
    Ok(Box::new(ZImage { dit, llm }))
}

inventory::submit! { FamilySpec { arch: "zimage", build } }

/// A failure of Z-Image's conditioner (loading or encoding), kept as the error's source.
fn conditioner_error(e: impl std::error::Error + Send + Sync + 'static) -> PipelineError {
    PipelineError::Conditioner { what: "Z-Image text encoder (Qwen3)", source: Box::new(e) }
}

impl Family for ZImage {
    fn arch(&self) -> &'static str {
        "zimage"
    }

    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &lora::LORA_PREFIXES
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        qwen3::qwen3_specs(&self.llm, dtype, wtype)
    }

    /// `--clip-skip` has no effect: the caption is layer 35's output.
    fn check_text(&self, _clip_skip: i64) -> Result<()> {
        Ok(())
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        Qwen3Encoder::new(&self.llm, &weights).map_err(conditioner_error)?;
        Ok(Box::new(ZImageText { cfg: self.llm.clone(), weights, tokenizer: Qwen2Tokenizer::new() }))
    }

    fn text_row_splittable(&self, spec: &TensorSpec) -> bool {
        qwen3::row_splittable(spec)
    }

    fn diffusion_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        zimage::zimage_specs(&self.dit, dtype, wtype)
    }

    fn diffusion_group(&self, name: &str) -> String {
        zimage::group_of(name)
    }

    fn diffusion_row_splittable(&self, spec: &TensorSpec) -> bool {
        zimage::row_splittable(spec)
    }

    fn load_diffusion(&self, weights: Weights, settings: &DiffusionSettings) -> Result<Box<dyn DiffusionModel>> {
        self.dit.validate()?;
        Ok(Box::new(ZImageModel { cfg: self.dit.clone(), weights, flash_attn: settings.flash_attn }))
    }

    fn latent_channels(&self) -> usize {
        self.dit.in_channels as usize
    }

    fn spatial_multiple(&self) -> usize {
        VAE_SCALE_FACTOR * PATCH
    }

    /// The joint attention's scores over the padded text and image tokens (heads x tokens²),
    /// f32, for a prompt of up to 512 tokens.
    fn attention_bytes(&self, tokens: f64, _batch: f64, flash_attn: bool) -> f64 {
        if flash_attn {
            return 0.0;
        }
        let all = tokens / (PATCH * PATCH) as f64 + 512.0;
        self.dit.num_heads as f64 * all * all * 4.0
    }

    fn vae(&self) -> Option<VaeConfig> {
        Some(VaeConfig::flux())
    }

    /// TAEF1: Z-Image decodes with FLUX.1's autoencoder.
    fn taesd(&self) -> Option<TaesdConfig> {
        Some(TaesdConfig::flux())
    }

    fn sampling(&self) -> SamplingDefaults {
        let schedule = FlowSchedule::linear(FLOW_SHIFT).into();
        SamplingDefaults {
            ays: AysLevels::Unpublished("Z-Image"),
            method: SampleMethod::Euler,
            schedule,
            cfg_scale: 1.0,
        }
    }
}

/// The conditioner: Qwen3 over its placed weights with the Qwen2 tokenizer.
struct ZImageText {
    cfg: Qwen3Config,
    weights: Weights,
    tokenizer: Qwen2Tokenizer,
}

/// The caption of `prompt`: the chat template's ids through the LLM to layer [`OUT_LAYER`],
/// the prompt weights applied with the mean kept.
pub(crate) fn encode_caption(
    encoder: Qwen3Encoder<'_>,
    tokenizer: &Qwen2Tokenizer,
    runner: &mut Runner,
    prompt: &str,
) -> std::result::Result<Conditioning, PipelineError> {
    let (ids, weights) = tokenizer.tokenize_chat(&ChatTemplate::Z_IMAGE, prompt).map_err(conditioner_error)?;
    let mut data = encoder.encode_ids(runner, &ids, OUT_LAYER).map_err(|e: Qwen3Error| conditioner_error(e))?;
    let hidden_size = encoder.config().hidden;
    apply_token_weights(&mut data, hidden_size, &weights);
    tracing::debug!(tokens = ids.len(), hidden_size, "Z-Image prompt encoded");
    Ok(Conditioning::tokens(data, hidden_size, ids.len(), Vec::new()))
}

impl TextEncoder for ZImageText {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> Result<Conditioning> {
        let encoder = Qwen3Encoder::new(&self.cfg, &self.weights).map_err(conditioner_error)?;
        encode_caption(encoder, &self.tokenizer, runner, request.prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{NoiseSchedule, Schedule};

    /// Euler on SD3's linear shift 3, the model reading `1000 - 1000 sigma`.
    #[test]
    fn sampling_defaults() {
        let z = ZImage { dit: ZImageConfig::turbo(), llm: Qwen3Config::qwen3_4b() };
        let d = z.sampling();
        assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::Euler, AysLevels::Unpublished("Z-Image"), 1.0));
        let Schedule::Flow(f) = d.schedule else { panic!("not a flow schedule") };
        assert_eq!(f, FlowSchedule::linear(3.0));
        // The top timestep is sigma 1, which Z-Image reads as its timestep 0.
        assert_eq!(zimage::model_timestep(f.sigma_to_t(f.t_to_sigma(999.0))), 0.0);
        assert_eq!(z.spatial_multiple(), 16);
    }
}
