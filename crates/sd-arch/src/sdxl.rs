//! SDXL (base 1.0, SDXL-Turbo, and distilled UNets such as SSD-1B and Vega): its detection,
//! registered as an `ArchSpec`, and its block numbering (the UNet's, then the dominant CLIP
//! encoder's layers).
//!
//! Detection: a UNet with a class embedding (`label_emb.0.0`) of width 2816 taking 4 latent
//! channels (or 9, inpainting); the refiner (ADM 2560) is another architecture.

use std::sync::Arc;

use sd_formats::arch::{prediction_from_metadata, BlockFn};
use sd_formats::{ArchSpec, Detected, Prediction, PredictionSource, TensorIndex};

use crate::encoders::clip_layer_of;
use crate::sd::{unet_block_numbering, INPUT_CHANNELS, LABEL_EMB, UNET_CONV_IN};

/// ADM width of SDXL base: pooled bigG embedding (1280) and six 256-wide size embeddings.
const ADM_IN_CHANNELS: u64 = 2816;
/// Width of the context the UNet cross-attends to (768 + 1280).
const CONTEXT_DIM: u64 = 2048;

fn detect(index: &TensorIndex) -> Option<Detected> {
    let label = index.get(LABEL_EMB)?;
    if label.shape.len() != 2 || label.shape[1] != ADM_IN_CHANNELS {
        return None;
    }
    let conv_in = index.get(UNET_CONV_IN)?;
    if conv_in.shape.len() != 4 || !INPUT_CHANNELS.contains(&conv_in.shape[1]) {
        return None;
    }
    let (prediction, prediction_source) = match prediction_from_metadata(index) {
        Some((p, key)) => (Some(p), PredictionSource::Metadata { key }),
        None => (Some(Prediction::Eps), PredictionSource::ArchDefault),
    };
    Some(Detected { arch: "sdxl", context_dim: CONTEXT_DIM, prediction, prediction_source })
}

/// SDXL blocks: the UNet's, and the layers of the dominant text encoder (bigG where the
/// files hold it, else CLIP-L); the other encoder's layers stay with the non-block tensors.
fn blocks(index: &TensorIndex) -> BlockFn {
    let unet = unet_block_numbering(index);
    let encoder = if index.entries().iter().any(|e| clip_layer_of(&e.name, 1).is_some()) { 1 } else { 0 };
    Arc::new(move |name| unet(name).or_else(|| clip_layer_of(name, encoder)))
}

inventory::submit! {
    ArchSpec {
        name: "sdxl",
        description: "Stable Diffusion XL (base, Turbo, SSD-1B, Vega)",
        detect,
        notable: &[LABEL_EMB, UNET_CONV_IN],
        blocks,
    }
}
