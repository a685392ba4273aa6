//! The FLUX.1 family (dev, schnell): CLIP ViT-L/14's pooled output and T5-XXL's hidden states
//! (`crate::text::flux`), the FLUX DiT (`crate::diffusion::flux`, configuration read from the
//! file), the 16-channel VAE (`sd_vae::VaeConfig::flux`) and flow-matching sampling (FLUX.1's
//! time shift: `mu` 1.15 for dev, 1.0 for schnell; `euler` by default), as the reference runs
//! them.
//!
//! Files come as the reference takes them: `--diffusion-model` (BFL's or ComfyUI's DiT),
//! `--clip_l`, `--t5xxl` and `--vae`. Without CLIP-L the pooled vector is zeros (a warning, as
//! in the reference); without T5 the prompt would be ignored, which the reference only warns
//! about and we refuse. A T5 file with fewer than 24 blocks
//! runs with the blocks it has (the reference refuses it). `sd_arch::flux` detects
//! the two architectures (`flux`, `flux-schnell`); this file registers their runtime.
//!
//! The distilled guidance of dev (`--guidance`, default 3.5) is a setting of the loaded
//! model; `--cfg-scale` stays the classifier-free guidance of the sampler (1 for FLUX, which
//! skips the negative prompt).

pub(crate) mod lora;

use std::sync::Arc;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};
use sd_vae::{TaesdConfig, VaeConfig};

use super::{
    DiffusionModel, DiffusionSettings, DtypeOf, Family, FamilySpec, SamplingDefaults, TextEncoder, TextRequest,
};
use crate::diffusion::flux::{self, FluxConfig, FluxModel};
use crate::files::{Detected, FileRole, ModelFiles};
use crate::pipeline::{Notice, PipelineError, Result};
use crate::sampling::{AysLevels, FlowSchedule, SampleMethod};
use crate::text::clip::ClipConfig;
use crate::text::flux::FluxText;
use crate::text::t5::T5Config;
use crate::text::ClipTokenizer;

/// Pixels per latent position.
const VAE_SCALE_FACTOR: usize = 8;
/// The DiT reads 2x2 patches of the latent.
const PATCH: usize = 2;
/// CLIP-L's token embedding under the internal names (`--clip_l` files land there).
const CLIP_L_PROBE: &str = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight";
/// T5-XXL's token embedding under the internal names (`--t5xxl` files land there).
const T5_PROBE: &str = "text_encoders.t5xxl.transformer.shared.weight";

/// FLUX.1's time shift `mu`: 1.15 for a model with distilled guidance (dev: its file has
/// `guidance_in.in_layer.weight`), 1.0 otherwise (schnell), as the reference decides it.
fn default_mu(has_guidance_embedding: bool) -> f32 {
    if has_guidance_embedding {
        1.15
    } else {
        1.0
    }
}

/// FLUX built for a set of files.
#[derive(Debug)]
struct Flux {
    arch: &'static str,
    dit: FluxConfig,
    clip_l: Option<ClipConfig>,
    t5: Option<T5Config>,
    tokenizer: Arc<ClipTokenizer>,
}

fn build(detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let index = files.index();
    let tensors: Vec<(String, Vec<u64>)> =
        index.entries().iter().filter(|e| e.name.starts_with(flux::PREFIX)).map(|e| (e.name.clone(), e.ne())).collect();
    let dit = FluxConfig::from_file(&tensors)?;
    let clip_l = index.contains(CLIP_L_PROBE).then(ClipConfig::vit_l14);
    // The reference builds all 24 blocks; a file with fewer (a cut-down encoder) runs with
    // the blocks it has.
    let t5 = index.contains(T5_PROBE).then(|| T5Config::xxl_of(index));
    if t5.is_none() {
        // The reference warns and samples with a zero context, which ignores the prompt: no
        // user wants that image, so it is refused here.
        return Err(PipelineError::MissingComponent {
            family: "FLUX.1",
            role: FileRole::T5xxl,
            what: "its T5-XXL text encoder (no text_encoders.t5xxl tensors in the files)".into(),
        });
    }
    Ok(Box::new(Flux { arch: detected.arch, dit, clip_l, t5, tokenizer: Arc::new(ClipTokenizer::new()) }))
}

inventory::submit! { FamilySpec { arch: "flux", build } }
inventory::submit! { FamilySpec { arch: "flux-schnell", build } }

/// A failure of FLUX's conditioner (loading or encoding), kept as the error's source.
fn conditioner_error(e: crate::text::flux::FluxTextError) -> PipelineError {
    PipelineError::Conditioner { what: "FLUX text encoders", source: Box::new(e) }
}

/// Whether a DiT parameter is cut by output rows in a row split: the matmul weights of the
/// double and single blocks (attention qkv and projections, MLPs, modulations).
pub(crate) fn dit_row_splittable(spec: &TensorSpec) -> bool {
    const LEAVES: [&str; 8] = [
        "_attn.qkv.weight",
        "_attn.proj.weight",
        "_mlp.0.weight",
        "_mlp.2.weight",
        "_mod.lin.weight",
        ".linear1.weight",
        ".linear2.weight",
        ".modulation.lin.weight",
    ];
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&d| d == 1);
    let name = &spec.name;
    matrix
        && (name.contains(".double_blocks.") || name.contains(".single_blocks."))
        && LEAVES.iter().any(|l| name.ends_with(l))
}

impl Family for Flux {
    fn arch(&self) -> &'static str {
        self.arch
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        FluxText::specs(self.clip_l.as_ref(), self.t5.as_ref(), dtype, wtype)
    }

    /// `--clip-skip` has no effect: the pooled CLIP-L output runs every layer.
    fn check_text(&self, _clip_skip: i64) -> Result<()> {
        Ok(())
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        let text = FluxText::new(self.clip_l.clone(), self.t5.clone(), weights, self.tokenizer.clone())
            .map_err(conditioner_error)?;
        Ok(Box::new(FluxConditioner(text)))
    }

    /// CLIP-L's layer matmuls and T5's block matmuls (`te=a&b --split-mode te=row` cuts both).
    fn text_row_splittable(&self, spec: &TensorSpec) -> bool {
        crate::text::clip::row_splittable(spec) || crate::text::t5::row_splittable(spec)
    }

    fn diffusion_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        flux::flux_specs(&self.dit, dtype, wtype)
    }

    fn diffusion_group(&self, name: &str) -> String {
        flux::group_of(name)
    }

    fn diffusion_row_splittable(&self, spec: &TensorSpec) -> bool {
        dit_row_splittable(spec)
    }

    fn load_diffusion(&self, weights: Weights, settings: &DiffusionSettings) -> Result<Box<dyn DiffusionModel>> {
        self.dit.validate()?;
        if !self.dit.guidance_embed && settings.guidance != flux::DEFAULT_GUIDANCE {
            // The reference ignores it silently; a user who set it should hear why nothing changed.
            tracing::info!(
                "distilled guidance {} ignored: FLUX.1 schnell has no guidance input (cfg scale still applies)",
                settings.guidance
            );
        }
        Ok(Box::new(FluxModel {
            cfg: self.dit.clone(),
            weights,
            flash_attn: settings.flash_attn,
            guidance: settings.guidance,
        }))
    }

    /// Reference images (`-r`, FLUX.1 Kontext's edits): their latents as tokens after the
    /// image's, all on RoPE index 1, laid out side by side (`rope_pe_with_refs`).
    fn reads_reference_images(&self) -> bool {
        true
    }

    /// Skip-layer guidance (`--slg-scale`) leaves blocks out: the double blocks numbered from 0,
    /// the single blocks after them.
    fn skips_layers(&self) -> bool {
        true
    }

    fn latent_channels(&self) -> usize {
        self.dit.latent_channels() as usize
    }

    fn spatial_multiple(&self) -> usize {
        VAE_SCALE_FACTOR * PATCH
    }

    /// The joint attention's scores over text and image tokens (heads x tokens²), f32.
    /// T5 reads the prompt in chunks of 256 tokens.
    fn text_tokens(&self) -> u64 {
        crate::text::FLUX_T5_CHUNK_LEN as u64
    }

    fn attention_bytes(&self, tokens: f64, batch: f64, flash_attn: bool) -> f64 {
        if flash_attn {
            return 0.0;
        }
        // One sample per graph (the reference's FLUX takes batch 1), whatever `batch`.
        let _ = batch;
        let image = tokens / (PATCH * PATCH) as f64;
        let all = image + crate::text::FLUX_T5_CHUNK_LEN as f64;
        self.dit.num_heads as f64 * all * all * 4.0
    }

    fn vae(&self) -> Option<VaeConfig> {
        Some(VaeConfig::flux())
    }

    /// TAEF1, FLUX's 16-channel tiny autoencoder.
    fn notices(&self) -> Vec<Notice> {
        let no_clip = Notice::MissingOptional {
            role: FileRole::TextEncoder(0),
            what: "CLIP-L text encoder",
            effect: "FLUX's pooled vector is zeros, prompt adherence degrades",
        };
        self.clip_l.is_none().then_some(no_clip).into_iter().collect()
    }

    fn taesd(&self) -> Option<TaesdConfig> {
        Some(TaesdConfig::flux())
    }

    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &lora::LORA_PREFIXES
    }

    fn sampling(&self) -> SamplingDefaults {
        let schedule = FlowSchedule::exponential(default_mu(self.dit.guidance_embed)).into();
        // FLUX.1's guidance is distilled (dev: `--guidance`; schnell: none): one evaluation
        // per step unless `--cfg-scale` asks for a negative pass.
        SamplingDefaults { ays: AysLevels::Unpublished("FLUX"), method: SampleMethod::Euler, schedule, cfg_scale: 1.0 }
    }
}

/// [`FluxText`] as the pipeline's conditioner.
struct FluxConditioner(FluxText);

impl TextEncoder for FluxConditioner {
    fn weights(&self) -> &Weights {
        self.0.weights()
    }

    fn encode(
        &self,
        runner: &mut Runner,
        request: &TextRequest<'_>,
    ) -> Result<crate::text::conditioning::Conditioning> {
        self.0.encode(runner, request.prompt).map_err(conditioner_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{NoiseSchedule, Schedule};

    /// The reference samples FLUX.1 with `euler` on its flow schedule at cfg 1 (guidance is
    /// distilled); Align Your Steps has no FLUX levels.
    #[test]
    fn sampling_defaults() {
        let flux = Flux {
            arch: "flux",
            dit: FluxConfig::dev(),
            clip_l: None,
            t5: Some(T5Config::xxl()),
            tokenizer: Arc::new(ClipTokenizer::new()),
        };
        let d = flux.sampling();
        assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::Euler, AysLevels::Unpublished("FLUX"), 1.0));
        assert!(d.schedule.is_flow());
        assert!(matches!(d.schedule, Schedule::Flow(f) if f == FlowSchedule::exponential(1.15)));
        assert_eq!((default_mu(true), default_mu(false)), (1.15, 1.0));
    }
}
