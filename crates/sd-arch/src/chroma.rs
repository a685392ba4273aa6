//! Chroma (FLUX.1-schnell's blocks with a distilled-guidance approximator) and
//! Chroma1-Radiance: their detection, registered as two `ArchSpec`s, and their block
//! numbering (FLUX.1's DiT numbering, then T5-XXL's layers).
//!
//! Detected as the reference does (`is_chroma` in stable-diffusion.cpp's `stable-diffusion.cpp`
//! and `Flux::FluxConfig::detect_from_weights`): `double_blocks.` tensors (a FLUX-style DiT)
//! with `distilled_guidance_layer.in_proj.weight`. FLUX.1's detectors refuse files with that
//! tensor, so a Chroma file is never taken for FLUX.1 and the reverse.

use std::sync::Arc;

use sd_formats::arch::BlockFn;
use sd_formats::{ArchSpec, Detected, PredictionSource, TensorIndex};

use crate::encoders::t5_block_of;
use crate::flux::{dit_block_numbering, DOUBLE_BLOCKS, TXT_IN};

/// The tensor whose presence marks a Chroma file (the reference's test): the approximator's
/// input projection.
pub const PROBE: &str = "model.diffusion_model.distilled_guidance_layer.in_proj.weight";

/// The tensors an unknown-architecture error shows when present.
const NOTABLE: [&str; 2] = [PROBE, TXT_IN];

/// Whether `index` holds a Chroma approximator (FLUX.1's detectors ask too).
pub(crate) fn is_chroma(index: &TensorIndex) -> bool {
    index.contains(PROBE)
}

/// Chroma1-Radiance's pixel-space head (the reference tests it before any FLUX-style version).
const RADIANCE_HEAD: &str = "model.diffusion_model.nerf_final_layer_conv.";

fn is_radiance(index: &TensorIndex) -> bool {
    index.with_prefix(RADIANCE_HEAD).any(|_| true)
}

/// `arch` when `index` holds an approximator and double blocks, with `txt_in`'s input width.
fn detected(index: &TensorIndex, arch: &'static str) -> Option<Detected> {
    if !is_chroma(index) || !index.with_prefix(DOUBLE_BLOCKS).any(|_| true) {
        return None;
    }
    let txt_in = index.get(TXT_IN)?;
    let width = (txt_in.shape.len() == 2).then_some(txt_in.shape[1])?;
    Some(Detected { arch, context_dim: width, prediction: None, prediction_source: PredictionSource::Unknown })
}

fn detect(index: &TensorIndex) -> Option<Detected> {
    if is_radiance(index) {
        return None;
    }
    detected(index, "chroma")
}

/// Chroma1-Radiance (pixel space: a patch convolution in, a NeRF head out, no VAE) is detected
/// as its own architecture, never run as Chroma (`sd_models`' Chroma family builds both).
fn detect_radiance(index: &TensorIndex) -> Option<Detected> {
    if !is_radiance(index) {
        return None;
    }
    detected(index, "chroma-radiance")
}

/// Chroma blocks: the DiT's (double blocks, then single blocks) and T5's layers.
fn blocks(index: &TensorIndex) -> BlockFn {
    let dit = dit_block_numbering(index);
    Arc::new(move |name| dit(name).or_else(|| t5_block_of(name)))
}

inventory::submit! {
    ArchSpec { name: "chroma", description: "Chroma (FLUX.1-schnell DiT with a distilled-guidance approximator, T5 only)", detect, notable: &NOTABLE, blocks }
}
inventory::submit! {
    ArchSpec { name: "chroma-radiance", description: "Chroma1-Radiance (pixel-space Chroma with a NeRF head)", detect: detect_radiance, notable: &NOTABLE, blocks }
}

#[cfg(test)]
mod tests {
    use sd_formats::{FileRole, TensorIndex};

    fn index_of(names: &[(&str, Vec<u64>)]) -> TensorIndex {
        crate::test_support::index_of(FileRole::DiffusionModel, names)
    }

    #[test]
    fn chroma_radiance_and_flux_are_told_apart() {
        let mut names = vec![
            ("model.diffusion_model.double_blocks.0.img_attn.qkv.weight", vec![768, 256]),
            ("model.diffusion_model.txt_in.weight", vec![256, 4096]),
        ];
        let arch = |names: &[(&str, Vec<u64>)]| sd_formats::arch::detect(&index_of(names), None).unwrap().arch;
        assert_eq!(arch(&names), "flux-schnell");
        names.push(("model.diffusion_model.distilled_guidance_layer.in_proj.weight", vec![5120, 64]));
        assert_eq!(arch(&names), "chroma");
        names.push(("model.diffusion_model.nerf_final_layer_conv.conv.weight", vec![3, 64, 3, 3]));
        assert_eq!(arch(&names), "chroma-radiance");
    }
}
