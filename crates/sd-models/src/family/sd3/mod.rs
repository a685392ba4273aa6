//! The SD3 family (SD3 Medium, SD3.5 Large, Large Turbo and Medium): CLIP-L, CLIP-G and
//! T5-XXL's states and pooled outputs (`text.rs`), the MMDiT (`mmdit.rs`,
//! configuration read from the file, MMDiT-X included), SD3's 16-channel VAE
//! (FLUX.1's network with SD3's latent scale and shift) and flow-matching sampling with SD3's linear time shift 3 and
//! `euler`, as the reference runs them.
//!
//! Files come as the reference takes them: a checkpoint with the MMDiT and the VAE
//! (`sd3.5_large.safetensors`), with or without the encoders inside (`text_encoders.clip_l`,
//! `clip_g`, `t5xxl`), or `--diffusion-model` and `--vae`; the encoders as `--clip_l`,
//! `--clip_g` and `--t5xxl`. A missing encoder contributes zeros, as in the reference, with a
//! notice; files with none of the three are refused (the prompt would be ignored). Without the
//! VAE a generation is refused.
//!
//! `--cfg-scale` defaults to the reference's 7 (SD3.5 Large Turbo wants about 1 with 4 steps:
//! the reference has no defaults per model file, and neither do we). `--clip-skip` applies to
//! both CLIPs (<= 0: 2). LoRA keys: `lora.rs`. `--taesd` takes TAESD3 (16 latent channels).

mod lora;
pub mod mmdit;
mod text;

use std::sync::Arc;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};
use sd_vae::{TaesdConfig, VaeConfig};

use super::{
    DiffusionModel, DiffusionSettings, DtypeOf, Family, FamilySpec, SamplingDefaults, TextEncoder, TextRequest,
};
use crate::files::{Detected, FileRole, ModelFiles};
use crate::pipeline::{Notice, PipelineError, Result};
use crate::sampling::{AysLevels, FlowSchedule, SampleMethod};
use crate::text::clip::ClipConfig;
use crate::text::conditioning::Conditioning;
use crate::text::t5::T5Config;
use crate::text::{ClipTokenizer, T5Tokenizer};
use mmdit::{MmditConfig, MmditModel};
use text::{Encoders, Sd3Text, Sd3TextError};

/// Pixels per latent position.
const VAE_SCALE_FACTOR: usize = 8;
/// SD3's latent scale and shift (the reference's `scale_factor` and `shift_factor` for SD3).
const VAE_SCALE: f32 = 1.5305;
const VAE_SHIFT: f32 = 0.0609;
/// SD3's linear time shift (the reference's `default_flow_shift` 3).
const FLOW_SHIFT: f32 = 3.0;
/// The reference's default `--cfg-scale`.
const CFG_SCALE: f32 = 7.0;
/// CLIP-L's token embedding under the internal names (`--clip_l` files land there).
const CLIP_L_PROBE: &str = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight";
/// CLIP-G's token embedding under the internal names (`--clip_g` files land there).
const CLIP_G_PROBE: &str = "cond_stage_model.1.transformer.text_model.embeddings.token_embedding.weight";
/// T5-XXL's token embedding under the internal names (`--t5xxl` files land there).
const T5_PROBE: &str = "text_encoders.t5xxl.transformer.shared.weight";
/// The VAE's decoder input convolution (`--vae` files land there).
const VAE_PROBE: &str = "first_stage_model.decoder.conv_in.weight";

/// SD3 built for a set of files.
#[derive(Debug)]
struct Sd3 {
    dit: MmditConfig,
    encoders: Encoders,
    tokenizer: Arc<ClipTokenizer>,
}

fn build(_detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let index = files.index();
    let tensors: Vec<(String, Vec<u64>)> = index
        .entries()
        .iter()
        .filter(|e| e.name.starts_with(mmdit::PREFIX))
        .map(|e| (e.name.clone(), e.ne()))
        .collect();
    let dit = MmditConfig::from_file(&tensors)?;
    let encoders = Encoders {
        clip_l: index.contains(CLIP_L_PROBE).then(ClipConfig::vit_l14_sdxl),
        clip_g: index.contains(CLIP_G_PROBE).then(ClipConfig::vit_bigg14),
        t5: index.contains(T5_PROBE).then(|| T5Config::xxl_of(index)),
    };
    if encoders.clip_l.is_none() && encoders.clip_g.is_none() && encoders.t5.is_none() {
        // The reference warns that it cannot process prompts and fails later; refused here.
        return Err(PipelineError::MissingComponent {
            family: "SD3",
            role: FileRole::TextEncoder(0),
            what: "its text encoders (none of CLIP-L, CLIP-G and T5-XXL is in the files; give --clip_l, --clip_g, --t5xxl)"
                .into(),
        });
    }
    let taesd = index.files().iter().any(|f| f.role == FileRole::Taesd);
    if !taesd && !index.contains(VAE_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: "SD3",
            role: FileRole::Vae,
            what: "its VAE (SD3's 16-channel autoencoder; no first_stage_model tensors in the files)".into(),
        });
    }
    let pooled = ClipConfig::vit_l14_sdxl().hidden_size + ClipConfig::vit_bigg14().hidden_size;
    if dit.adm_in_channels != pooled as i64 || dit.context_size != text::CONTEXT_WIDTH as i64 {
        return Err(PipelineError::Invalid(format!(
            "the MMDiT takes a pooled vector of {} and a context of {} (tensors 'model.diffusion_model.y_embedder.mlp.0.weight', \
             '{}'); SD3's encoders give {pooled} and {}",
            dit.adm_in_channels,
            dit.context_size,
            sd_arch::sd3::CONTEXT_EMBEDDER,
            text::CONTEXT_WIDTH
        )));
    }
    if let Some(t5) = &encoders.t5 {
        if t5.d_model != text::CONTEXT_WIDTH {
            return Err(PipelineError::Invalid(format!(
                "T5 is {} wide (tensor '{T5_PROBE}'); SD3 takes T5-XXL's {}",
                t5.d_model,
                text::CONTEXT_WIDTH
            )));
        }
    }
    Ok(Box::new(Sd3 { dit, encoders, tokenizer: Arc::new(ClipTokenizer::new()) }))
}

inventory::submit! { FamilySpec { arch: "sd3", build } }

/// A failure of SD3's conditioner (loading or encoding), kept as the error's source.
fn conditioner_error(e: impl Into<Sd3TextError>) -> PipelineError {
    PipelineError::Conditioner { what: "SD3 text encoders (CLIP-L, CLIP-G, T5-XXL)", source: Box::new(e.into()) }
}

impl Family for Sd3 {
    fn arch(&self) -> &'static str {
        "sd3"
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        self.encoders.specs(dtype, wtype)
    }

    /// `--clip-skip` against both CLIPs' depths.
    fn check_text(&self, clip_skip: i64) -> Result<()> {
        for c in [&self.encoders.clip_l, &self.encoders.clip_g].into_iter().flatten() {
            c.resolve_clip_skip(clip_skip).map_err(conditioner_error)?;
        }
        Ok(())
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        let e = &self.encoders;
        for c in [&e.clip_l, &e.clip_g].into_iter().flatten() {
            crate::text::clip::ClipEncoder::new(c, &weights).map_err(conditioner_error)?;
        }
        if let Some(c) = &e.t5 {
            crate::text::t5::T5Encoder::new(c, &weights).map_err(conditioner_error)?;
        }
        Ok(Box::new(Sd3Text {
            encoders: e.clone(),
            weights,
            clip_tokenizer: self.tokenizer.clone(),
            t5_tokenizer: T5Tokenizer::new(),
        }))
    }

    /// The CLIPs' layer matmuls and T5's block matmuls.
    fn text_row_splittable(&self, spec: &TensorSpec) -> bool {
        crate::text::clip::row_splittable(spec) || crate::text::t5::row_splittable(spec)
    }

    fn diffusion_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        mmdit::mmdit_specs(&self.dit, dtype, wtype)
    }

    fn diffusion_group(&self, name: &str) -> String {
        mmdit::group_of(name)
    }

    fn diffusion_row_splittable(&self, spec: &TensorSpec) -> bool {
        mmdit::row_splittable(spec)
    }

    fn load_diffusion(&self, weights: Weights, settings: &DiffusionSettings) -> Result<Box<dyn DiffusionModel>> {
        self.dit.validate()?;
        Ok(Box::new(MmditModel { cfg: self.dit.clone(), weights, flash_attn: settings.flash_attn }))
    }

    /// Skip-layer guidance (`--slg-scale`) leaves joint blocks out.
    fn skips_layers(&self) -> bool {
        true
    }

    fn latent_channels(&self) -> usize {
        self.dit.in_channels as usize
    }

    fn spatial_multiple(&self) -> usize {
        VAE_SCALE_FACTOR * self.dit.patch as usize
    }

    /// One chunk is 77 CLIP rows and 77 T5 rows.
    fn text_tokens(&self) -> u64 {
        2 * text::CHUNK_LEN as u64
    }

    /// The joint attention's scores over text and image tokens (heads x tokens²), f32.
    fn attention_bytes(&self, tokens: f64, _batch: f64, flash_attn: bool) -> f64 {
        if flash_attn {
            return 0.0;
        }
        let patch = (self.dit.patch * self.dit.patch) as f64;
        let all = tokens / patch + self.text_tokens() as f64;
        self.dit.num_heads() as f64 * all * all * 4.0
    }

    /// FLUX.1's network (z 16, no quant convs) with SD3's latent scale and shift.
    fn vae(&self) -> Option<VaeConfig> {
        Some(VaeConfig { scale_factor: VAE_SCALE, shift_factor: VAE_SHIFT, ..VaeConfig::flux() })
    }

    fn notices(&self) -> Vec<Notice> {
        let e = &self.encoders;
        let missing = [
            (e.clip_l.is_none(), FileRole::TextEncoder(0), "CLIP-L text encoder"),
            (e.clip_g.is_none(), FileRole::TextEncoder(1), "CLIP-G text encoder"),
            (e.t5.is_none(), FileRole::T5xxl, "T5-XXL text encoder"),
        ];
        missing
            .into_iter()
            .filter(|(absent, _, _)| *absent)
            .map(|(_, role, what)| Notice::MissingOptional {
                role,
                what,
                effect: "its part of SD3's conditioning is zeros, prompt adherence degrades",
            })
            .collect()
    }

    /// TAESD3: TAESD's graph on 16 latent channels, decoding the latents as they are (the
    /// reference builds its TAE so for every DiT model; TAEF1's configuration).
    fn taesd(&self) -> Option<TaesdConfig> {
        Some(TaesdConfig::flux())
    }

    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &lora::LORA_PREFIXES
    }

    fn sampling(&self) -> SamplingDefaults {
        SamplingDefaults {
            ays: AysLevels::Unpublished("SD3"),
            method: SampleMethod::Euler,
            schedule: FlowSchedule::linear(FLOW_SHIFT).into(),
            cfg_scale: CFG_SCALE,
        }
    }
}

impl TextEncoder for Sd3Text {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> Result<Conditioning> {
        Sd3Text::encode(self, runner, request.prompt, request.clip_skip).map_err(conditioner_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Schedule;

    /// Euler on SD3's linear shift 3, real CFG at the reference's 7, 16-pixel sides.
    #[test]
    fn sampling_defaults() {
        let s = Sd3 {
            dit: MmditConfig::sd35_large(),
            encoders: Encoders { clip_l: None, clip_g: None, t5: Some(T5Config::xxl()) },
            tokenizer: Arc::new(ClipTokenizer::new()),
        };
        let d = s.sampling();
        assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::Euler, AysLevels::Unpublished("SD3"), 7.0));
        assert!(matches!(d.schedule, Schedule::Flow(f) if f == FlowSchedule::linear(3.0)));
        assert_eq!((s.spatial_multiple(), s.latent_channels(), s.text_tokens()), (16, 16, 154));
        // Both CLIPs missing: two notices naming their flags' roles.
        let roles: Vec<FileRole> = s
            .notices()
            .into_iter()
            .map(|n| match n {
                Notice::MissingOptional { role, .. } => role,
                other => panic!("unexpected notice {other:?}"),
            })
            .collect();
        assert_eq!(roles, [FileRole::TextEncoder(0), FileRole::TextEncoder(1)]);
    }
}
