//! Detection of Z-Image files (the diffusion transformer of `crate::diffusion::zimage`).
//!
//! Detected as the reference's model loader does: `cap_embedder.0.weight` in the diffusion
//! model (its caption RMSNorm, as wide as the LLM's hidden states, which is the context
//! width). Z-Image predicts a flow, which [`crate::files::Prediction`] does not name: the
//! prediction is left unknown for the flow sampler.

use std::sync::Arc;

use crate::diffusion::zimage;
use crate::files::arch::BlockFn;
use crate::files::{ArchSpec, Detected, PredictionSource, TensorIndex};
use crate::text::qwen3;

/// The caption RMSNorm's weight, `[cap_feat_dim]`.
pub(crate) const CAP_NORM: &str = "model.diffusion_model.cap_embedder.0.weight";

/// The tensors an unknown-architecture error shows when present.
const NOTABLE: [&str; 1] = [CAP_NORM];

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
    let dit = zimage::block_numbering(index);
    Arc::new(move |name| dit(name).or_else(|| qwen3::block_of(name)))
}

inventory::submit! {
    ArchSpec { name: "zimage", description: "Z-Image (NextDiT with a Qwen3 text encoder)", detect, notable: &NOTABLE, blocks }
}
