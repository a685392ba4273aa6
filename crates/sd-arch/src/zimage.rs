//! Z-Image (NextDiT with a Qwen3 text encoder): its detection, registered as an `ArchSpec`,
//! and its block numbering (the DiT's refiners and layers, then the LLM's layers).
//!
//! Detected as the reference's model loader does: `cap_embedder.0.weight` in the diffusion
//! model (its caption RMSNorm, as wide as the LLM's hidden states, which is the context
//! width). Z-Image predicts a flow, which `sd_formats::Prediction` does not name: the
//! prediction is left unknown for the flow sampler.

use std::sync::Arc;

use sd_formats::arch::BlockFn;
use sd_formats::index::numbered;
use sd_formats::{ArchSpec, Detected, PredictionSource, TensorIndex};

use crate::encoders::qwen3_block_of;

/// The caption RMSNorm's weight, `[cap_feat_dim]`.
pub const CAP_NORM: &str = "model.diffusion_model.cap_embedder.0.weight";

/// The tensors an unknown-architecture error shows when present.
const NOTABLE: [&str; 1] = [CAP_NORM];

/// The DiT's blocks in execution order for the tensors of `index`: the context refiners,
/// the noise refiners, then the main layers. The embedders and the final layer have none.
fn dit_block_numbering(index: &TensorIndex) -> impl Fn(&str) -> Option<u32> + Send + Sync + 'static {
    const CONTEXT: &str = "model.diffusion_model.context_refiner.";
    const NOISE: &str = "model.diffusion_model.noise_refiner.";
    const LAYERS: &str = "model.diffusion_model.layers.";
    let count = |p: &str| index.entries().iter().filter_map(|e| numbered(&e.name, p)).max().map_or(0, |n| n + 1);
    let (contexts, noises) = (count(CONTEXT), count(NOISE));
    move |name: &str| {
        numbered(name, CONTEXT)
            .or_else(|| numbered(name, NOISE).map(|n| contexts + n))
            .or_else(|| numbered(name, LAYERS).map(|n| contexts + noises + n))
    }
}

fn detect(index: &TensorIndex) -> Option<Detected> {
    let cap = index.get(CAP_NORM)?;
    let width = *cap.shape.first()?;
    Some(Detected {
        arch: "zimage",
        context_dim: width,
        prediction: None,
        prediction_source: PredictionSource::Unknown,
    })
}

/// Z-Image blocks: the DiT's (context refiners, noise refiners, layers) and the LLM's layers.
fn blocks(index: &TensorIndex) -> BlockFn {
    let dit = dit_block_numbering(index);
    Arc::new(move |name| dit(name).or_else(|| qwen3_block_of(name)))
}

inventory::submit! {
    ArchSpec { name: "zimage", description: "Z-Image (NextDiT with a Qwen3 text encoder)", detect, notable: &NOTABLE, blocks }
}
