//! The SDXL family (base 1.0, SDXL-Turbo, and distilled UNets such as SSD-1B and Vega): CLIP
//! ViT-L/14 and OpenCLIP ViT-bigG/14 text encoders, the SDXL UNet with its class embedding of
//! the ADM vector (`crate::diffusion::unet::UNetConfig::sdxl`, block depths read from the
//! file), the KL-f8 VAE with SDXL's latent scale.
//!
//! The conditioner is `crate::text::sdxl::SdxlText` (both encoders in one `te` weight set);
//! an empty negative prompt is encoded zeroed, its ADM vector kept, as the reference does for
//! SDXL (it makes an exception for EDM v-parameterised files, which are not detected here).
//!
//! `sd_arch::sdxl` detects the files (a UNet with a class embedding of width 2816) and numbers
//! their blocks; this file registers the runtime.

use std::sync::Arc;

use sd_backends::GgmlType;
use sd_sched::{TensorSpec, Weights};
use sd_vae::{TaesdConfig, VaeConfig};

use super::{DiffusionModel, DiffusionSettings, DtypeOf, Family, FamilySpec, SamplingDefaults, TextEncoder};
use crate::diffusion::unet::{self, UNetConfig, UNetModel};
use crate::files::{Detected, FileRole, ModelFiles, TensorIndex};
use crate::pipeline::{PipelineError, Result};
use crate::sampling::{AysLevels, DiscreteSchedule, SampleMethod, AYS_SDXL};
use crate::text::clip::ClipConfig;
use crate::text::sdxl::SdxlText;
use crate::text::ClipTokenizer;

/// Where the second text encoder's (OpenCLIP bigG's) internal names start.
const BIGG_PREFIX: &str = "cond_stage_model.1.";

/// SDXL's latent scale factor (`sd_xl_base.yaml`).
const SCALE_FACTOR: f32 = 0.13025;
/// Pixels per latent position.
const VAE_SCALE_FACTOR: usize = 8;
/// The reference aligns every UNet's requests to 8 latent positions.
const UNET_DOWN_FACTOR: usize = 8;

/// SDXL built for a set of files.
#[derive(Debug)]
struct Sdxl {
    clip_l: ClipConfig,
    bigg: ClipConfig,
    unet: UNetConfig,
    tokenizer: Arc<ClipTokenizer>,
}

/// Each text encoder's token embedding, its width, and its name.
const ENCODER_WIDTHS: [(&str, u64, &str); 2] = [
    ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight", 768, "CLIP ViT-L/14"),
    ("cond_stage_model.1.transformer.text_model.embeddings.token_embedding.weight", 1280, "OpenCLIP ViT-bigG/14"),
];

/// A CLIP-L file given in bigG's role or a bigG one in CLIP-L's is named with the role it
/// belongs to (rather than as a tensor of the wrong shape).
fn check_encoder_files(index: &TensorIndex) -> Result<()> {
    for (i, (name, width, encoder)) in ENCODER_WIDTHS.iter().enumerate() {
        let Some(e) = index.get(name) else { continue };
        let got = e.ne().first().copied().unwrap_or(0);
        let (_, other_width, other) = ENCODER_WIDTHS[1 - i];
        if got != *width && got == other_width {
            return Err(PipelineError::MisplacedFile {
                path: index.files()[e.file].path.clone(),
                given: FileRole::TextEncoder(i as u8),
                found: FileRole::TextEncoder(1 - i as u8),
                problem: format!(
                    "holds a text encoder {got} wide (tensor '{}') where SDXL's {encoder} encoder is {width} wide: \
                     it looks like the {other} encoder",
                    e.original_name
                ),
            });
        }
    }
    Ok(())
}

fn build(_detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let index = files.index();
    check_encoder_files(index)?;
    let unet = UNetConfig::sdxl().adapted_to_file(&|name| index.get(name).map(|e| e.ne()));
    unet.validate()?;
    Ok(Box::new(Sdxl {
        clip_l: ClipConfig::vit_l14_sdxl(),
        bigg: ClipConfig::vit_bigg14(),
        unet,
        tokenizer: Arc::new(ClipTokenizer::new()),
    }))
}

inventory::submit! { FamilySpec { arch: "sdxl", build } }

/// Where SDXL LoRA keys point: kohya's `lora_unet_`, `lora_te1_` (CLIP-L), `lora_te2_`
/// (OpenCLIP bigG, HF names) and diffusers/PEFT's `unet.`, `text_encoder.`, `text_encoder_2.`.
pub(crate) const LORA_PREFIXES: [crate::lora::LoraPrefix; 6] = {
    use crate::files::FileRole::{DiffusionModel, TextEncoder};
    use crate::lora::{LoraBody, LoraPrefix as P};
    [
        P { prefix: "lora_unet_", role: DiffusionModel, body: LoraBody::Flat },
        P { prefix: "lora_te1_", role: TextEncoder(0), body: LoraBody::Flat },
        P { prefix: "lora_te2_", role: TextEncoder(1), body: LoraBody::Flat },
        P { prefix: "unet.", role: DiffusionModel, body: LoraBody::Dotted },
        P { prefix: "text_encoder.", role: TextEncoder(0), body: LoraBody::Dotted },
        P { prefix: "text_encoder_2.", role: TextEncoder(1), body: LoraBody::Dotted },
    ]
};

impl Family for Sdxl {
    fn arch(&self) -> &'static str {
        "sdxl"
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        SdxlText::specs(&self.clip_l, &self.bigg, dtype, wtype)
    }

    fn check_text(&self, clip_skip: i64) -> Result<()> {
        Ok(SdxlText::check_clip_skip(&self.clip_l, &self.bigg, clip_skip)?)
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        let text = SdxlText::new(self.clip_l.clone(), self.bigg.clone(), weights, self.tokenizer.clone())?;
        Ok(Box::new(text))
    }

    /// `cond_stage_model.1.` numbers the second encoder (bigG), not a block: each of its
    /// layers is a group of its own.
    fn text_group(&self, name: &str) -> String {
        match name.strip_prefix(BIGG_PREFIX) {
            Some(rest) => format!("{BIGG_PREFIX}{}", super::block_group(rest)),
            None => super::block_group(name),
        }
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
        Some(VaeConfig { scale_factor: SCALE_FACTOR, ..VaeConfig::sd() })
    }

    fn taesd(&self) -> Option<TaesdConfig> {
        Some(TaesdConfig::sd())
    }

    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &LORA_PREFIXES
    }

    /// SDXL's ControlNet as the reference builds it for every SDXL-family model (Vega and
    /// SSD-1B included): the base SDXL layout, whatever blocks a distilled UNet dropped (its
    /// skip connections keep their shapes).
    fn control_net(&self) -> Option<crate::diffusion::controlnet::ControlNetConfig> {
        Some(crate::diffusion::controlnet::ControlNetConfig::for_unet(&UNetConfig::sdxl()))
    }

    fn sampling(&self) -> SamplingDefaults {
        SamplingDefaults {
            ays: AysLevels::Table(&AYS_SDXL),
            method: SampleMethod::EulerA,
            schedule: DiscreteSchedule::sd().into(),
            cfg_scale: 7.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bigg_layers_are_groups_of_their_own() {
        let sdxl = Sdxl {
            clip_l: ClipConfig::vit_l14_sdxl(),
            bigg: ClipConfig::vit_bigg14(),
            unet: UNetConfig::sdxl(),
            tokenizer: Arc::new(ClipTokenizer::new()),
        };
        let g = |n: &str| sdxl.text_group(n);
        let big_g = "cond_stage_model.1.transformer.text_model.encoder.layers.14.self_attn.q_proj.weight";
        assert_eq!(g(big_g), "cond_stage_model.1.transformer.text_model.encoder.layers.14");
        assert_eq!(
            g("cond_stage_model.1.transformer.text_model.final_layer_norm.weight"),
            "cond_stage_model.1.transformer.text_model.final_layer_norm"
        );
        let l = "cond_stage_model.transformer.text_model.encoder.layers.3.mlp.fc1.weight";
        assert_eq!(g(l), "cond_stage_model.transformer.text_model.encoder.layers.3");
    }

    /// The reference samples SDXL with `euler_a` at cfg 7, with NVIDIA's SDXL levels for `ays`.
    #[test]
    fn sampling_defaults() {
        let sdxl = Sdxl {
            clip_l: ClipConfig::vit_l14_sdxl(),
            bigg: ClipConfig::vit_bigg14(),
            unet: UNetConfig::sdxl(),
            tokenizer: Arc::new(ClipTokenizer::new()),
        };
        let d = sdxl.sampling();
        assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::EulerA, AysLevels::Table(&AYS_SDXL), 7.0));
    }
}
