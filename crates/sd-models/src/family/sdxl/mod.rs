//! The SDXL family (base 1.0, SDXL-Turbo, and distilled UNets such as SSD-1B and Vega): CLIP
//! ViT-L/14 and OpenCLIP ViT-bigG/14 text encoders, the SDXL UNet with its class embedding of
//! the ADM vector (`crate::diffusion::unet::UNetConfig::sdxl`, block depths read from the
//! file), the KL-f8 VAE with SDXL's latent scale.
//!
//! So far this folder holds the detection (so `sd-cli plan` describes SDXL files); the
//! runtime's [`super::FamilySpec`] is registered here once the two text encoders exist, and
//! until then a generation stops at once with "architecture `sdxl` has no runtime yet".
//!
//! Detection: a UNet with a class embedding (`label_emb.0.0`) of width 2816 taking 4 latent
//! channels; the refiner (ADM 2560) and inpainting variants are other architectures.

use crate::files::arch::{prediction_from_metadata, sd::LABEL_EMB};
use crate::files::{ArchSpec, Detected, PredictionSource, TensorIndex};
use crate::sampling::Prediction;

/// ADM width of SDXL base: pooled bigG embedding (1280) and six 256-wide size embeddings.
const ADM_IN_CHANNELS: u64 = 2816;
/// Width of the context the UNet cross-attends to (768 + 1280).
const CONTEXT_DIM: u64 = 2048;

fn detect(index: &TensorIndex) -> Option<Detected> {
    let label = index.get(LABEL_EMB)?;
    if label.shape.len() != 2 || label.shape[1] != ADM_IN_CHANNELS {
        return None;
    }
    let conv_in = index.get("model.diffusion_model.input_blocks.0.0.weight")?;
    if conv_in.shape.len() != 4 || conv_in.shape[1] != 4 {
        return None;
    }
    let (prediction, prediction_source) = match prediction_from_metadata(index) {
        Some((p, key)) => (Some(p), PredictionSource::Metadata { key }),
        None => (Some(Prediction::Eps), PredictionSource::ArchDefault),
    };
    Some(Detected { arch: "sdxl", context_dim: CONTEXT_DIM, prediction, prediction_source })
}

inventory::submit! {
    ArchSpec { name: "sdxl", description: "Stable Diffusion XL (base, Turbo, SSD-1B, Vega)", detect }
}
