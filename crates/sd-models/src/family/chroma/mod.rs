//! The Chroma family (Chroma1-HD, Chroma1-Base, the `chroma-unlocked` releases): T5-XXL's hidden
//! states with a text mask (`text.rs`), FLUX.1-schnell's DiT with the distilled-guidance
//! approximator in place of its embedders and modulation projections
//! (`crate::diffusion::flux::chroma`, configuration read from the file), FLUX.1's 16-channel
//! VAE and flow-matching sampling with FLUX's time shift 1.0 (the reference's default for a
//! FLUX-style model without `guidance_in`), as the reference runs them.
//!
//! **Chroma1-Radiance** (`chroma-radiance`) is the same family in pixel space: its DiT reads
//! and predicts the RGB image in `[-1, 1]` through a patch convolution and a NeRF head
//! (`crate::diffusion::flux::radiance`), and there is no VAE (the first stage is
//! [`sd_vae::PixelSpace`], as the reference's `FakeVAE`). Sizes are multiples of the patch (16).
//! A `--vae` or `--taesd` given with it is ignored with a warning.
//!
//! Files come as the reference takes them: `--diffusion-model`, `--t5xxl` and `--vae`. Without
//! T5 or the VAE a generation is refused with [`PipelineError::MissingComponent`]. A `--clip_l`
//! is ignored with a warning, as the reference's T5-only conditioner leaves it unused.
//!
//! Guidance is real classifier-free guidance with the negative prompt: `--cfg-scale` defaults
//! to the reference's 7; the approximator's guidance input is 0 whatever `--guidance` says (the
//! reference fills it with 0). `--model-args` takes the reference's keys for Chroma:
//! `chroma_use_dit_mask` (default true), `chroma_t5_mask_pad` (default 1) and
//! `chroma_use_t5_mask` (false only: T5 here takes no attention mask); another key is an error.
//!
//! LoRA: Chroma's LoRAs use FLUX.1's names (kohya `lora_unet_double_blocks_*`, BFL's dotted
//! names, diffusers' `transformer.*`), so FLUX.1's table serves; keys of modules Chroma pruned
//! (the modulation projections, the embedders) find no parameter.

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
use crate::text::t5::{self, T5Config, T5Encoder};
use crate::text::T5Tokenizer;
use text::{ChromaText, ChromaTextError};

/// FLUX's time shift of a model without `guidance_in`.
const MU: f32 = 1.0;
/// The reference's default `--cfg-scale`.
const CFG_SCALE: f32 = 7.0;
/// T5-XXL's token embedding under the internal names (`--t5xxl` files land there).
const T5_PROBE: &str = "text_encoders.t5xxl.transformer.shared.weight";
/// CLIP-L's token embedding (`--clip_l` files land there).
const CLIP_L_PROBE: &str = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight";
/// The VAE's decoder input convolution (`--vae` files land there).
const VAE_PROBE: &str = "first_stage_model.decoder.conv_in.weight";

/// Chroma built for a set of files.
#[derive(Debug)]
struct Chroma {
    dit: FluxConfig,
    t5: T5Config,
    /// `chroma_t5_mask_pad`.
    mask_pad: usize,
}

fn build(detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let index = files.index();
    let tensors: Vec<(String, Vec<u64>)> =
        index.entries().iter().filter(|e| e.name.starts_with(flux::PREFIX)).map(|e| (e.name.clone(), e.ne())).collect();
    let dit = FluxConfig::from_file(&tensors)?;
    if dit.chroma.is_none() {
        return Err(PipelineError::Invalid(format!("a Chroma model needs '{}'", sd_arch::chroma::PROBE)));
    }
    let pixel_space = dit.radiance.is_some();
    if pixel_space != (detected.arch == "chroma-radiance") {
        return Err(PipelineError::Invalid(format!(
            "the {} model's files {} a NeRF head ('{}.{}')",
            detected.arch,
            if pixel_space { "hold" } else { "lack" },
            flux::PREFIX,
            flux::radiance::PROBE
        )));
    }
    if !index.contains(T5_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: "Chroma",
            role: FileRole::T5xxl,
            what: "its T5-XXL text encoder (no text_encoders.t5xxl tensors in the files)".into(),
        });
    }
    let taesd = index.files().iter().any(|f| f.role == FileRole::Taesd);
    if pixel_space {
        if taesd || index.contains(VAE_PROBE) {
            tracing::warn!("Chroma1-Radiance works in pixel space and has no VAE: the --vae / --taesd file is ignored");
        }
    } else if !taesd && !index.contains(VAE_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: "Chroma",
            role: FileRole::Vae,
            what: "its VAE (FLUX.1's 16-channel autoencoder; no first_stage_model tensors in the files)".into(),
        });
    }
    if index.contains(CLIP_L_PROBE) {
        tracing::warn!("Chroma encodes with T5-XXL alone: the CLIP-L text encoder (--clip_l) is ignored");
    }
    let t5 = T5Config::xxl_of(index);
    if t5.d_model as i64 != dit.context_in_dim {
        return Err(PipelineError::Invalid(format!(
            "T5 is {} wide, the Chroma model's txt_in takes {} (tensor 'model.diffusion_model.txt_in.weight')",
            t5.d_model, dit.context_in_dim
        )));
    }
    Ok(Box::new(Chroma { dit, t5, mask_pad: text::DEFAULT_MASK_PAD }))
}

inventory::submit! { FamilySpec { arch: "chroma", build } }
inventory::submit! { FamilySpec { arch: "chroma-radiance", build } }

/// A failure of Chroma's conditioner (loading or encoding), kept as the error's source.
fn conditioner_error(e: impl Into<ChromaTextError>) -> PipelineError {
    PipelineError::Conditioner { what: "Chroma text encoder (T5-XXL)", source: Box::new(e.into()) }
}

impl Family for Chroma {
    fn arch(&self) -> &'static str {
        if self.dit.radiance.is_some() {
            "chroma-radiance"
        } else {
            "chroma"
        }
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        t5::t5_specs(&self.t5, dtype, wtype)
    }

    /// `--clip-skip` has no effect: T5 runs every block.
    fn check_text(&self, _clip_skip: i64) -> Result<()> {
        Ok(())
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        T5Encoder::new(&self.t5, &weights).map_err(conditioner_error)?;
        Ok(Box::new(ChromaText {
            t5: self.t5.clone(),
            weights,
            tokenizer: T5Tokenizer::new(),
            mask_pad: self.mask_pad,
        }))
    }

    fn text_row_splittable(&self, spec: &TensorSpec) -> bool {
        t5::row_splittable(spec)
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

    /// Skip-layer guidance (`--slg-scale`) leaves blocks out: the double blocks numbered from 0,
    /// the single blocks after them.
    fn skips_layers(&self) -> bool {
        true
    }

    fn latent_channels(&self) -> usize {
        self.dit.latent_channels() as usize
    }

    /// Whole patches: the DiT's patch (2x2 latent positions, or Radiance's 16x16 pixels) in
    /// pixels.
    fn spatial_multiple(&self) -> usize {
        self.vae().map_or(1, |v| v.latent_scale()) * self.dit.patch as usize
    }

    /// The joint attention's scores over text (512 tokens) and image tokens, f32 (`tokens`
    /// counts latent positions; a token is a patch of them).
    /// T5 reads the prompt in chunks of 512 tokens.
    fn text_tokens(&self) -> u64 {
        text::CHUNK_LEN as u64
    }

    fn attention_bytes(&self, tokens: f64, _batch: f64, flash_attn: bool) -> f64 {
        if flash_attn {
            return 0.0;
        }
        let patch = self.dit.patch as f64;
        let all = tokens / (patch * patch) + text::CHUNK_LEN as f64;
        self.dit.num_heads as f64 * all * all * 4.0
    }

    /// FLUX.1's; none in pixel space.
    fn vae(&self) -> Option<VaeConfig> {
        self.dit.radiance.is_none().then(VaeConfig::flux)
    }

    /// TAEF1: Chroma decodes with FLUX.1's autoencoder (Radiance has none).
    fn taesd(&self) -> Option<TaesdConfig> {
        self.dit.radiance.is_none().then(TaesdConfig::flux)
    }

    /// The reference's Chroma options: `chroma_use_dit_mask` (true/false), `chroma_t5_mask_pad`
    /// (a count), `chroma_use_t5_mask` (only false: T5 here takes no attention mask).
    fn set_model_args(&mut self, args: &[(String, String)]) -> Result<()> {
        let bad = |key: &str, value: &str, want: &str| {
            Err(PipelineError::Invalid(format!("model argument {key}={value}: {want}")))
        };
        for (key, value) in args {
            let flag = match value.to_ascii_lowercase().as_str() {
                "true" | "1" | "on" => Some(true),
                "false" | "0" | "off" => Some(false),
                _ => None,
            };
            match key.as_str() {
                "chroma_use_dit_mask" => match flag {
                    Some(on) => self.dit.chroma.as_mut().expect("built with an approximator").dit_mask = on,
                    None => return bad(key, value, "true or false"),
                },
                "chroma_use_t5_mask" => match flag {
                    Some(false) => {}
                    Some(true) => return bad(key, value, "T5's attention mask is not supported here (T5 attends to its padding, the reference's default)"),
                    None => return bad(key, value, "true or false"),
                },
                "chroma_t5_mask_pad" => match value.parse::<usize>() {
                    Ok(n) => self.mask_pad = n,
                    Err(_) => return bad(key, value, "a count of padding tokens (0 or more)"),
                },
                _ => {
                    return Err(PipelineError::Invalid(format!(
                        "model argument '{key}': Chroma takes chroma_use_dit_mask, chroma_use_t5_mask, chroma_t5_mask_pad"
                    )))
                }
            }
        }
        Ok(())
    }

    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &super::flux::lora::LORA_PREFIXES
    }

    fn sampling(&self) -> SamplingDefaults {
        SamplingDefaults {
            ays: AysLevels::Unpublished("Chroma"),
            method: SampleMethod::Euler,
            schedule: FlowSchedule::exponential(MU).into(),
            cfg_scale: CFG_SCALE,
        }
    }
}

impl TextEncoder for ChromaText {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> Result<Conditioning> {
        ChromaText::encode(self, runner, request.prompt).map_err(conditioner_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Schedule;

    /// Euler on FLUX's flow schedule without shift, real CFG at the reference's 7.
    #[test]
    fn sampling_defaults() {
        let c = Chroma { dit: FluxConfig::schnell(), t5: T5Config::xxl(), mask_pad: 1 };
        let d = c.sampling();
        assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::Euler, AysLevels::Unpublished("Chroma"), 7.0));
        assert!(matches!(d.schedule, Schedule::Flow(f) if f == FlowSchedule::exponential(1.0)));
        assert_eq!(c.spatial_multiple(), 16);
    }
}
