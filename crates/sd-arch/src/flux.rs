//! FLUX.1 dev and schnell: their detection, registered as two `ArchSpec`s, and the DiT's
//! block numbering Chroma shares.
//!
//! Detected as the reference's model loader does: a `double_blocks.` tensor in the diffusion
//! model, with `guidance_in.in_layer.weight` for dev and without it for schnell; the context
//! width is `txt_in.weight`'s input width (T5-XXL's 4096). FLUX predicts a flow, which
//! `sd_formats::Prediction` does not name yet: the prediction is left unknown for the flow
//! sampler.

use std::sync::Arc;

use sd_formats::arch::BlockFn;
use sd_formats::index::numbered;
use sd_formats::{ArchSpec, Detected, PredictionSource, TensorIndex};

use crate::encoders::{clip_layer_of, t5_block_of};

/// The text projection, `[hidden, context_in_dim]` (PyTorch order).
pub(crate) const TXT_IN: &str = "model.diffusion_model.txt_in.weight";
/// Present in dev, absent in schnell.
const GUIDANCE_IN: &str = "model.diffusion_model.guidance_in.in_layer.weight";
/// Where the double-stream blocks' tensors start.
pub(crate) const DOUBLE_BLOCKS: &str = "model.diffusion_model.double_blocks.";

/// The tensors an unknown-architecture error shows when present.
const NOTABLE: [&str; 2] = [TXT_IN, GUIDANCE_IN];

/// The DiT's blocks in execution order, for the tensors of `index`: the double-stream
/// blocks, then the single-stream ones. `img_in`, `txt_in`, the embedders and the final
/// layer have none.
pub(crate) fn dit_block_numbering(index: &TensorIndex) -> impl Fn(&str) -> Option<u32> + Send + Sync + 'static {
    const SINGLE: &str = "model.diffusion_model.single_blocks.";
    let doubles = index.entries().iter().filter_map(|e| numbered(&e.name, DOUBLE_BLOCKS)).max().map_or(0, |n| n + 1);
    move |name: &str| numbered(name, DOUBLE_BLOCKS).or_else(|| numbered(name, SINGLE).map(|n| doubles + n))
}

fn context_width(index: &TensorIndex) -> Option<u64> {
    // A Chroma file (FLUX.1-schnell's blocks with an approximator) is Chroma's, never FLUX.1's;
    // a FLUX.2 file (its shared modulation) is FLUX.2's.
    if crate::chroma::is_chroma(index) || crate::flux2::is_flux2(index) {
        return None;
    }
    if !index.with_prefix(DOUBLE_BLOCKS).any(|_| true) {
        return None;
    }
    let txt_in = index.get(TXT_IN)?;
    (txt_in.shape.len() == 2).then_some(txt_in.shape[1])
}

fn detected(arch: &'static str, context_dim: u64) -> Detected {
    Detected { arch, context_dim, prediction: None, prediction_source: PredictionSource::Unknown }
}

/// FLUX blocks: the DiT's, and the layers of the dominant text encoder (T5-XXL where the
/// files hold it, else CLIP-L); the other encoder's layers stay with the non-block tensors.
fn blocks(index: &TensorIndex) -> BlockFn {
    let dit = dit_block_numbering(index);
    let has_t5 = index.entries().iter().any(|e| t5_block_of(&e.name).is_some());
    Arc::new(move |name| dit(name).or_else(|| if has_t5 { t5_block_of(name) } else { clip_layer_of(name, 0) }))
}

fn detect_dev(index: &TensorIndex) -> Option<Detected> {
    let width = context_width(index)?;
    index.get(GUIDANCE_IN).is_some().then(|| detected("flux", width))
}

fn detect_schnell(index: &TensorIndex) -> Option<Detected> {
    let width = context_width(index)?;
    index.get(GUIDANCE_IN).is_none().then(|| detected("flux-schnell", width))
}

inventory::submit! {
    ArchSpec { name: "flux", description: "FLUX.1-dev (guidance-distilled DiT)", detect: detect_dev, notable: &NOTABLE, blocks }
}
inventory::submit! {
    ArchSpec { name: "flux-schnell", description: "FLUX.1-schnell (timestep-distilled DiT)", detect: detect_schnell, notable: &NOTABLE, blocks }
}
