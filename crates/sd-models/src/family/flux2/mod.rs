//! The FLUX.2 family, klein (4B and 9B, distilled and base) and dev (32B, guidance-distilled,
//! Mistral-Small-3.2-24B as its text encoder, see `text.rs`). Klein: Qwen3's hidden states after layers
//! 9, 18 and 27 side by side as the context (`crate::text::qwen3`, klein's chat template, the
//! prompt padded to 512 tokens), FLUX's DiT with FLUX.2's shared modulations and gated MLPs
//! (`crate::diffusion::flux`, configuration read from the file), FLUX.2's 32-channel VAE whose
//! latent the DiT reads in 2x2 patches ([`vae_config`]: 128 channels at 1/16 of
//! the image) and flow-matching sampling with FLUX.2's shift derived from the steps and the
//! image size (`FlowSchedule::flux2`), as the reference runs them.
//!
//! Files come as the reference takes them: `--diffusion-model`, `--llm` (Qwen3-4B for klein 4B,
//! Qwen3-8B for 9B) and `--vae`. Without the LLM or the VAE a generation is refused with
//! [`PipelineError::MissingComponent`]; an LLM of the wrong width or with fewer than 27 layers
//! is refused before anything loads. FLUX.2 dev (a 48th single block, as the reference detects
//! it) takes a Mistral `--llm` (no q/k norms; a Qwen3 file is refused by name) of at least 30
//! layers, embeds `--guidance` (default 3.5) and samples like klein.
//!
//! `--cfg-scale` defaults to 1: klein is distilled to sample without classifier-free guidance
//! in four steps (its base models want `--cfg-scale` set). `--flow-shift` does not move the
//! shift (the reference derives it again for every run). `--taesd` takes TAEF2 ([`taef2`]).
//! Reference images (`-r`) are encoded by the VAE (resized as the reference does unless
//! `--disable-auto-resize-ref-image`) and read by the DiT as tokens after the image's, for the
//! prompt and the negative prompt alike (`crate::diffusion::flux::rope_pe_with_refs`).

mod text;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};
use sd_vae::{LatentStats, TaesdConfig, VaeConfig};

use super::{
    DiffusionModel, DiffusionSettings, DtypeOf, Family, FamilySpec, SamplingDefaults, TextEncoder, TextRequest,
};
use crate::diffusion::flux::{self, FluxConfig, FluxModel};
use crate::files::{Detected, FileRole, ModelFiles};
use crate::pipeline::{PipelineError, Result};
use crate::sampling::{AysLevels, FlowSchedule, SampleMethod};
use crate::text::conditioning::Conditioning;
use crate::text::qwen3::{self, Qwen3Config, Qwen3Encoder};
use crate::text::{MistralTokenizer, Qwen2Tokenizer};
use text::{conditioner_error, dev_conditioner_error, DEV_OUT_LAYERS, OUT_LAYERS};

/// Pixels per diffusion latent position (the VAE's 8, times its 2x2 patches).
const LATENT_SCALE: usize = 16;
/// Qwen3's token embedding under the internal names (`--llm` files land there).
const LLM_PROBE: &str = "text_encoders.llm.model.embed_tokens.weight";
/// The VAE's decoder input convolution (`--vae` files land there).
const VAE_PROBE: &str = "first_stage_model.decoder.conv_in.weight";

/// The latent's mean per patched channel (the reference's `get_latents_mean_std`; the
/// released VAE's batch-norm running mean).
#[rustfmt::skip]
const LATENT_MEAN: [f32; 128] = [
    -0.0676, -0.0715, -0.0753, -0.0745, 0.0223, 0.0180, 0.0142, 0.0184,
    -0.0001, -0.0063, -0.0002, -0.0031, -0.0272, -0.0281, -0.0276, -0.0290,
    -0.0769, -0.0672, -0.0902, -0.0892, 0.0168, 0.0152, 0.0079, 0.0086,
    0.0083, 0.0015, 0.0003, -0.0043, -0.0439, -0.0419, -0.0438, -0.0431,
    -0.0102, -0.0132, -0.0066, -0.0048, -0.0311, -0.0306, -0.0279, -0.0180,
    0.0030, 0.0015, 0.0126, 0.0145, 0.0347, 0.0338, 0.0337, 0.0283,
    0.0020, 0.0047, 0.0047, 0.0050, 0.0123, 0.0081, 0.0081, 0.0146,
    0.0681, 0.0679, 0.0767, 0.0732, -0.0462, -0.0474, -0.0392, -0.0511,
    -0.0528, -0.0477, -0.0470, -0.0517, -0.0317, -0.0316, -0.0345, -0.0283,
    0.0510, 0.0445, 0.0578, 0.0458, -0.0412, -0.0458, -0.0487, -0.0467,
    -0.0088, -0.0106, -0.0088, -0.0046, -0.0376, -0.0432, -0.0436, -0.0499,
    0.0118, 0.0166, 0.0203, 0.0279, 0.0113, 0.0129, 0.0016, 0.0072,
    -0.0118, -0.0018, -0.0141, -0.0054, -0.0091, -0.0138, -0.0145, -0.0187,
    0.0323, 0.0305, 0.0259, 0.0300, 0.0540, 0.0614, 0.0495, 0.0590,
    -0.0511, -0.0603, -0.0478, -0.0524, -0.0227, -0.0274, -0.0154, -0.0255,
    -0.0572, -0.0565, -0.0518, -0.0496, 0.0116, 0.0054, 0.0163, 0.0104,
];

/// The latent's standard deviation per patched channel (the reference's values).
#[rustfmt::skip]
const LATENT_STD: [f32; 128] = [
    1.8029, 1.7786, 1.7868, 1.7837, 1.7717, 1.7590, 1.7610, 1.7479,
    1.7336, 1.7373, 1.7340, 1.7343, 1.8626, 1.8527, 1.8629, 1.8589,
    1.7593, 1.7526, 1.7556, 1.7583, 1.7363, 1.7400, 1.7355, 1.7394,
    1.7342, 1.7246, 1.7392, 1.7304, 1.7551, 1.7513, 1.7559, 1.7488,
    1.8449, 1.8454, 1.8550, 1.8535, 1.8240, 1.7813, 1.7854, 1.7945,
    1.8047, 1.7876, 1.7695, 1.7676, 1.7782, 1.7667, 1.7925, 1.7848,
    1.7579, 1.7407, 1.7483, 1.7368, 1.7961, 1.7998, 1.7920, 1.7925,
    1.7780, 1.7747, 1.7727, 1.7749, 1.7526, 1.7447, 1.7657, 1.7495,
    1.7775, 1.7720, 1.7813, 1.7813, 1.8162, 1.8013, 1.8023, 1.8033,
    1.7527, 1.7331, 1.7563, 1.7482, 1.7610, 1.7507, 1.7681, 1.7613,
    1.7665, 1.7545, 1.7828, 1.7726, 1.7896, 1.7999, 1.7864, 1.7760,
    1.7613, 1.7625, 1.7560, 1.7577, 1.7783, 1.7671, 1.7810, 1.7799,
    1.7201, 1.7068, 1.7265, 1.7091, 1.7793, 1.7578, 1.7502, 1.7455,
    1.7587, 1.7500, 1.7525, 1.7362, 1.7616, 1.7572, 1.7444, 1.7430,
    1.7509, 1.7610, 1.7634, 1.7612, 1.7254, 1.7135, 1.7321, 1.7226,
    1.7664, 1.7624, 1.7718, 1.7664, 1.7457, 1.7441, 1.7569, 1.7530,
];

/// FLUX.2's autoencoder (`flux2-vae.safetensors`): the SD network with z 32 and quant convs,
/// its latent in 2x2 patches (128 channels at 1/16 of the image) normalised per channel with
/// [`LATENT_MEAN`] and [`LATENT_STD`], scale 1 and shift 0.
fn vae_config() -> VaeConfig {
    VaeConfig {
        z_channels: 32,
        embed_dim: 32,
        scale_factor: 1.0,
        shift_factor: 0.0,
        patched: true,
        latent_stats: Some(LatentStats { mean: &LATENT_MEAN, std: &LATENT_STD }),
        ..VaeConfig::sd()
    }
}

/// TAEF2, FLUX.2's tiny autoencoder (`--taesd`): TAESD's graph on 32 channels with the
/// group-norm branch next to the latent, its latent in 2x2 patches like the VAE's (the
/// reference's `taef2`), decoded as it is (no statistics, as every TAE in the reference).
pub(crate) fn taef2() -> TaesdConfig {
    TaesdConfig { z_channels: 32, midblock_gn: true, patched: true, ..TaesdConfig::sd() }
}

/// FLUX.2 built for a set of files.
#[derive(Debug)]
struct Flux2 {
    dit: FluxConfig,
    llm: Qwen3Config,
    /// dev (Mistral) rather than klein (Qwen3).
    dev: bool,
}

/// The first layer's q norm, which Qwen3 has and Mistral has not.
const QK_NORM_PROBE: &str = "text_encoders.llm.model.layers.0.self_attn.q_norm.weight";

/// What tells klein and dev apart when their files are read.
struct Variant {
    dev: bool,
    family: &'static str,
    /// The encoder it reads, for messages.
    llm: &'static str,
    /// The encoder's fixed settings (its depth and widths come from the file).
    base: fn() -> Qwen3Config,
    out_layers: &'static [usize],
    /// Which encoder widths the released models take.
    widths: &'static str,
}

const KLEIN: Variant = Variant {
    dev: false,
    family: "FLUX.2 klein",
    llm: "Qwen3",
    base: Qwen3Config::qwen3_4b,
    out_layers: &OUT_LAYERS,
    widths: "klein 4B takes Qwen3-4B, 9B Qwen3-8B",
};

const DEV: Variant = Variant {
    dev: true,
    family: "FLUX.2 dev",
    llm: "Mistral-Small-3.2",
    base: Qwen3Config::mistral_small_3_2,
    out_layers: &DEV_OUT_LAYERS,
    widths: "dev takes Mistral-Small-3.2 (5120 wide)",
};

fn build(detected: &Detected, files: &ModelFiles) -> Result<Box<dyn Family>> {
    let v = if detected.arch == "flux2" { DEV } else { KLEIN };
    let failed =
        |e: crate::text::qwen3::Qwen3Error| if v.dev { dev_conditioner_error(e) } else { conditioner_error(e) };
    let index = files.index();
    let tensors: Vec<(String, Vec<u64>)> =
        index.entries().iter().filter(|e| e.name.starts_with(flux::PREFIX)).map(|e| (e.name.clone(), e.ne())).collect();
    let dit = FluxConfig::from_file(&tensors)?;
    if !dit.flux2 {
        return Err(PipelineError::Invalid(format!("a FLUX.2 model needs '{}'", sd_arch::flux2::PROBE)));
    }
    if !index.contains(LLM_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: v.family,
            role: FileRole::Llm,
            what: format!("its {} text encoder (no text_encoders.llm tensors in the files)", v.llm),
        });
    }
    if !index.contains(VAE_PROBE) {
        return Err(PipelineError::MissingComponent {
            family: v.family,
            role: FileRole::Vae,
            what: "its VAE (FLUX.2's 32-channel autoencoder; no first_stage_model tensors in the files)".into(),
        });
    }
    // Qwen3 has q/k norms, Mistral none: the other FLUX.2's encoder is named as such.
    let norm = QK_NORM_PROBE.trim_start_matches("text_encoders.llm.");
    match (index.contains(QK_NORM_PROBE), v.dev) {
        (true, true) => {
            return Err(PipelineError::Invalid(format!(
                "the LLM (--llm) holds '{norm}', a Qwen3 (FLUX.2 klein's encoder); FLUX.2 dev reads Mistral-Small-3.2"
            )))
        }
        (false, false) => {
            return Err(PipelineError::Invalid(format!(
                "the LLM (--llm) has no '{norm}': FLUX.2 klein reads a Qwen3 (a Mistral file is FLUX.2 dev's encoder)"
            )))
        }
        _ => {}
    }
    let llm = Qwen3Config::from_index_as(index, (v.base)()).map_err(failed)?;
    let deepest = v.out_layers[v.out_layers.len() - 1];
    if llm.n_layers < deepest {
        return Err(PipelineError::Invalid(format!(
            "the LLM (--llm) has {} layers; {} reads its layers {:?}, so it needs at least {deepest}",
            llm.n_layers, v.family, v.out_layers
        )));
    }
    let width = (v.out_layers.len() * llm.hidden) as i64;
    if width != dit.context_in_dim {
        return Err(PipelineError::Invalid(format!(
            "the LLM (--llm) is {} wide, so its {} layers give {width} values per token; the {} model's \
             txt_in takes {} (tensor 'model.diffusion_model.txt_in.weight'): {}",
            llm.hidden,
            v.out_layers.len(),
            v.family,
            dit.context_in_dim,
            v.widths
        )));
    }
    Ok(Box::new(Flux2 { dit, llm, dev: v.dev }))
}

inventory::submit! { FamilySpec { arch: "flux2-klein", build } }
inventory::submit! { FamilySpec { arch: "flux2", build } }

impl Family for Flux2 {
    fn arch(&self) -> &'static str {
        if self.dev {
            "flux2"
        } else {
            "flux2-klein"
        }
    }

    fn lora_prefixes(&self) -> &'static [crate::lora::LoraPrefix] {
        &super::flux::lora::LORA_PREFIXES
    }

    fn text_specs(&self, dtype: DtypeOf<'_>, wtype: Option<GgmlType>) -> Vec<TensorSpec> {
        qwen3::qwen3_specs(&self.llm, dtype, wtype)
    }

    /// `--clip-skip` has no effect: the context is layers 9, 18 and 27 (dev: 10, 20, 30).
    fn check_text(&self, _clip_skip: i64) -> Result<()> {
        Ok(())
    }

    fn load_text(&self, weights: Weights) -> Result<Box<dyn TextEncoder>> {
        if self.dev {
            Qwen3Encoder::new(&self.llm, &weights).map_err(dev_conditioner_error)?;
            return Ok(Box::new(text::DevText { cfg: self.llm.clone(), weights, tokenizer: MistralTokenizer::new() }));
        }
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

    /// Reference images (`-r`), FLUX.2's edits: their patched latents as tokens after the
    /// image's, each on a RoPE index of its own.
    fn reads_reference_images(&self) -> bool {
        true
    }

    /// Skip-layer guidance (`--slg-scale`) leaves blocks out: the double blocks numbered from 0,
    /// the single blocks after them.
    fn skips_layers(&self) -> bool {
        true
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

    fn vae(&self) -> Option<VaeConfig> {
        Some(vae_config())
    }

    /// TAEF2 ([`taef2`]).
    fn taesd(&self) -> Option<TaesdConfig> {
        Some(taef2())
    }

    fn sampling(&self) -> SamplingDefaults {
        SamplingDefaults {
            ays: AysLevels::Unpublished("FLUX.2"),
            method: SampleMethod::Euler,
            schedule: FlowSchedule::empirical().into(),
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

impl TextEncoder for text::DevText {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> Result<Conditioning> {
        text::DevText::encode(self, runner, request.prompt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Schedule;

    /// Euler on FLUX.2's image-dependent shift, no classifier-free guidance, 16-pixel latents.
    #[test]
    fn sampling_defaults() {
        let k = Flux2 { dit: FluxConfig::flux2_klein_4b(), llm: Qwen3Config::qwen3_4b(), dev: false };
        let d = k.sampling();
        assert_eq!((d.method, d.ays, d.cfg_scale), (SampleMethod::Euler, AysLevels::Unpublished("FLUX.2"), 1.0));
        assert!(matches!(d.schedule, Schedule::Flow(f) if f == FlowSchedule::empirical()));
        assert_eq!((k.spatial_multiple(), k.latent_channels()), (16, 128));
        assert_eq!(k.vae().map(|v| v.latent_scale()), Some(16));
        assert_eq!(k.dit.context_in_dim, (OUT_LAYERS.len() * k.llm.hidden) as i64);
        let d = Flux2 { dit: FluxConfig::flux2_dev(), llm: Qwen3Config::mistral_small_3_2(), dev: true };
        assert_eq!(d.arch(), "flux2");
        assert_eq!(d.dit.context_in_dim, (DEV_OUT_LAYERS.len() * d.llm.hidden) as i64);
    }
}
