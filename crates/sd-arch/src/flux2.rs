//! FLUX.2 (klein and dev): their detection, registered as two `ArchSpec`s, and their block
//! numbering (FLUX's DiT numbering, then the LLM's layers).
//!
//! Detected as the reference's model loader does: the shared modulation
//! `double_stream_modulation_img.lin.weight` marks FLUX.2, and a 48th single block
//! (`single_blocks.47`) marks dev (32B, Mistral-Small-3.2 as its text encoder) rather than
//! klein (4B and 9B, Qwen3). FLUX.1's detectors refuse files with the probe, so a FLUX.2 file
//! is never taken for FLUX.1. The context width is `txt_in.weight`'s input width (three LLM
//! layers side by side: 7680 for klein 4B).

use std::sync::Arc;

use sd_formats::arch::BlockFn;
use sd_formats::{ArchSpec, Detected, PredictionSource, TensorIndex};

use crate::encoders::qwen3_block_of;
use crate::flux::{dit_block_numbering, DOUBLE_BLOCKS, TXT_IN};

/// The tensor whose presence marks a FLUX.2 file (the reference's test).
pub const PROBE: &str = "model.diffusion_model.double_stream_modulation_img.lin.weight";
/// Present in dev (48 single blocks), absent in klein.
const DEV_BLOCK: &str = "model.diffusion_model.single_blocks.47.linear1.weight";

/// The tensors an unknown-architecture error shows when present.
const NOTABLE: [&str; 2] = [PROBE, TXT_IN];

/// Whether `index` holds FLUX.2's shared modulation (FLUX.1's detectors ask too).
pub(crate) fn is_flux2(index: &TensorIndex) -> bool {
    index.contains(PROBE)
}

fn detected(index: &TensorIndex, arch: &'static str) -> Option<Detected> {
    if !is_flux2(index) || !index.with_prefix(DOUBLE_BLOCKS).any(|_| true) {
        return None;
    }
    let txt_in = index.get(TXT_IN)?;
    let width = (txt_in.shape.len() == 2).then_some(txt_in.shape[1])?;
    Some(Detected { arch, context_dim: width, prediction: None, prediction_source: PredictionSource::Unknown })
}

fn detect_klein(index: &TensorIndex) -> Option<Detected> {
    if index.contains(DEV_BLOCK) {
        return None;
    }
    detected(index, "flux2-klein")
}

/// FLUX.2 dev is detected so that it is named, never run as klein; its text encoder
/// (Mistral-Small-3.2) has no runtime yet, so a generation is refused and `plan` describes it
/// from its headers.
fn detect_dev(index: &TensorIndex) -> Option<Detected> {
    if !index.contains(DEV_BLOCK) {
        return None;
    }
    detected(index, "flux2")
}

/// FLUX.2 blocks: the DiT's (double blocks, then single blocks) and the LLM's layers.
fn blocks(index: &TensorIndex) -> BlockFn {
    let dit = dit_block_numbering(index);
    Arc::new(move |name| dit(name).or_else(|| qwen3_block_of(name)))
}

inventory::submit! {
    ArchSpec { name: "flux2-klein", description: "FLUX.2 klein (shared-modulation DiT with a Qwen3 text encoder)", detect: detect_klein, notable: &NOTABLE, blocks }
}
inventory::submit! {
    ArchSpec { name: "flux2", description: "FLUX.2 dev (32B shared-modulation DiT with a Mistral text encoder)", detect: detect_dev, notable: &NOTABLE, blocks }
}

#[cfg(test)]
mod tests {
    use sd_formats::{FileRole, TensorIndex};

    fn index_of(names: &[(&str, Vec<u64>)]) -> TensorIndex {
        crate::test_support::index_of(FileRole::DiffusionModel, names)
    }

    /// FLUX.1, klein and dev told apart by the shared modulation and the 48th single block;
    /// klein's context width is `txt_in`'s input; the LLM's layers number after the DiT's.
    #[test]
    fn flux1_klein_and_dev_are_told_apart() {
        let mut names = vec![
            ("model.diffusion_model.double_blocks.0.img_attn.qkv.weight", vec![768, 256]),
            ("model.diffusion_model.double_blocks.1.img_attn.qkv.weight", vec![768, 256]),
            ("model.diffusion_model.single_blocks.0.linear1.weight", vec![2304, 256]),
            ("model.diffusion_model.txt_in.weight", vec![256, 7680]),
            ("text_encoders.llm.model.layers.3.mlp.up_proj.weight", vec![512, 256]),
        ];
        let detect = |names: &[(&str, Vec<u64>)]| sd_formats::arch::detect(&index_of(names), None).unwrap();
        assert_eq!(detect(&names).arch, "flux-schnell");
        names.push(("model.diffusion_model.double_stream_modulation_img.lin.weight", vec![1536, 256]));
        let klein = detect(&names);
        assert_eq!((klein.arch, klein.context_dim), ("flux2-klein", 7680));
        let blocks = (super::blocks)(&index_of(&names));
        assert_eq!(blocks("model.diffusion_model.single_blocks.0.linear1.weight"), Some(2));
        assert_eq!(blocks("text_encoders.llm.model.layers.3.mlp.up_proj.weight"), Some(3));
        names.push(("model.diffusion_model.single_blocks.47.linear1.weight", vec![2304, 256]));
        assert_eq!(detect(&names).arch, "flux2");
    }
}
