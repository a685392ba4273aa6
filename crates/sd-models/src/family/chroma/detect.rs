//! Detection of Chroma files (FLUX.1-schnell's blocks with the distilled-guidance approximator
//! of `crate::diffusion::flux::chroma`).
//!
//! Detected as the reference does (`is_chroma` in stable-diffusion.cpp's `stable-diffusion.cpp`
//! and `Flux::FluxConfig::detect_from_weights`): `double_blocks.` tensors (a FLUX-style DiT)
//! with `distilled_guidance_layer.in_proj.weight`. FLUX.1's detectors refuse files with that
//! tensor, so a Chroma file is never taken for FLUX.1 and the reverse.

use std::sync::Arc;

use crate::diffusion::flux::{self, chroma};
use crate::files::arch::BlockFn;
use crate::files::{ArchSpec, Detected, PredictionSource, TensorIndex};
use crate::text::t5;

/// The text projection, `[hidden, context_in_dim]` (PyTorch order).
const TXT_IN: &str = "model.diffusion_model.txt_in.weight";

/// The tensors an unknown-architecture error shows when present.
const NOTABLE: [&str; 2] = [chroma::PROBE, TXT_IN];

/// Whether `index` holds a Chroma approximator (FLUX.1's detectors ask too).
pub(crate) fn is_chroma(index: &TensorIndex) -> bool {
    index.contains(chroma::PROBE)
}

fn detect(index: &TensorIndex) -> Option<Detected> {
    if !is_chroma(index) || !index.with_prefix("model.diffusion_model.double_blocks.").any(|_| true) {
        return None;
    }
    let txt_in = index.get(TXT_IN)?;
    let width = (txt_in.shape.len() == 2).then_some(txt_in.shape[1])?;
    Some(Detected {
        arch: "chroma",
        context_dim: width,
        prediction: None,
        prediction_source: PredictionSource::Unknown,
    })
}

/// Chroma blocks: the DiT's (double blocks, then single blocks) and T5's layers.
fn blocks(index: &TensorIndex) -> BlockFn {
    let dit = flux::block_numbering(index);
    Arc::new(move |name| dit(name).or_else(|| t5::block_of(name)))
}

inventory::submit! {
    ArchSpec { name: "chroma", description: "Chroma (FLUX.1-schnell DiT with a distilled-guidance approximator, T5 only)", detect, notable: &NOTABLE, blocks }
}
