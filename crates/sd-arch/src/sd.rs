//! SD 1.x and SD 2.x (UNet with CLIP ViT-L/14 or OpenCLIP ViT-H/14 text encoder): their
//! detection, registered as two `ArchSpec`s, and the UNet's block numbering SDXL shares.

use std::sync::Arc;

use sd_formats::arch::{prediction_from_metadata, BlockFn};
use sd_formats::index::numbered;
use sd_formats::{ArchSpec, Detected, Prediction, PredictionSource, TensorIndex};

use crate::encoders::clip_layer_of;

/// The text encoder's token embedding, `[vocab, width]`.
const TOKEN_EMBEDDING: &str = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight";
/// The UNet's input convolution, `[320, in_channels, 3, 3]`.
pub const UNET_CONV_IN: &str = "model.diffusion_model.input_blocks.0.0.weight";
/// The UNet's class embedding of the ADM vector (SDXL), `[time_embed_dim, adm]`.
pub(crate) const LABEL_EMB: &str = "model.diffusion_model.label_emb.0.0.weight";
/// The first cross-attention key projection, `[320, context_dim]`.
const UNET_CROSS_ATTN_K: &str = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight";

/// The tensors an unknown-architecture error shows when present (their shapes tell SD 1.x,
/// 2.x, SDXL and inpainting apart).
const NOTABLE: [&str; 6] = [
    TOKEN_EMBEDDING,
    UNET_CONV_IN,
    UNET_CROSS_ATTN_K,
    "model.diffusion_model.middle_block.1.norm.weight",
    LABEL_EMB,
    "first_stage_model.decoder.conv_in.weight",
];

/// The UNet input channels of the SD 1.x/2.x/SDXL checkpoints we run: 4 (the latent), or 9
/// for an inpainting checkpoint (the latent, the mask and the masked image's latent).
pub(crate) const INPUT_CHANNELS: [u64; 2] = [4, 9];

/// The UNet's blocks in execution order, for the tensors of `index`: `input_blocks.N` is
/// block N, `middle_block` comes after the file's input blocks, `output_blocks.N` after the
/// middle block. Embeddings, `time_embed` and `out` have none.
pub(crate) fn unet_block_numbering(index: &TensorIndex) -> impl Fn(&str) -> Option<u32> + Send + Sync + 'static {
    const INPUT: &str = "model.diffusion_model.input_blocks.";
    const MIDDLE: &str = "model.diffusion_model.middle_block.";
    const OUTPUT: &str = "model.diffusion_model.output_blocks.";
    let inputs = index.entries().iter().filter_map(|e| numbered(&e.name, INPUT)).max().map_or(0, |n| n + 1);
    move |name: &str| {
        if name.starts_with(MIDDLE) {
            return Some(inputs);
        }
        numbered(name, INPUT).or_else(|| numbered(name, OUTPUT).map(|n| inputs + 1 + n))
    }
}

/// The facts both SD 1.x and 2.x detection read, as sd.cpp's `get_sd_version` does:
/// a UNet with a middle block and 4 latent input channels, or 9 (inpainting; 8 is
/// instruct-pix2pix, another architecture), one text encoder (a second is SDXL),
/// and the context width from the text encoder's token embedding, or from the UNet's
/// cross-attention when only the UNet is given. When both are present they must agree.
fn context_width(index: &TensorIndex) -> Option<u64> {
    let conv_in = index.get(UNET_CONV_IN)?;
    if conv_in.shape.len() != 4 || !INPUT_CHANNELS.contains(&conv_in.shape[1]) {
        return None;
    }
    if !index.with_prefix("model.diffusion_model.middle_block.1.").any(|_| true) {
        return None;
    }
    if index.with_prefix("cond_stage_model.1.").any(|_| true) {
        return None;
    }
    // A class embedding (label_emb) is SDXL's (or another ADM model's), not SD 1.x/2.x.
    if index.get(LABEL_EMB).is_some() {
        return None;
    }
    let from_te = index.get(TOKEN_EMBEDDING).and_then(|e| (e.shape.len() == 2).then_some(e.shape[1]));
    let from_unet = index.get(UNET_CROSS_ATTN_K).and_then(|e| (e.shape.len() == 2).then_some(e.shape[1]));
    match (from_te, from_unet) {
        (Some(a), Some(b)) if a != b => None,
        (a, b) => a.or(b),
    }
}

fn detected(index: &TensorIndex, arch: &'static str, context_dim: u64) -> Detected {
    let (prediction, prediction_source) = match prediction_from_metadata(index) {
        Some((p, key)) => (Some(p), PredictionSource::Metadata { key }),
        None if arch == "sd1" => (Some(Prediction::Eps), PredictionSource::ArchDefault),
        None => (None, PredictionSource::Unknown),
    };
    Detected { arch, context_dim, prediction, prediction_source }
}

/// SD 1.x/2.x blocks: the UNet's, and the layers of its one CLIP text encoder.
fn blocks(index: &TensorIndex) -> BlockFn {
    let unet = unet_block_numbering(index);
    Arc::new(move |name| unet(name).or_else(|| clip_layer_of(name, 0)))
}

fn detect_sd1(index: &TensorIndex) -> Option<Detected> {
    (context_width(index)? == 768).then(|| detected(index, "sd1", 768))
}

fn detect_sd2(index: &TensorIndex) -> Option<Detected> {
    (context_width(index)? == 1024).then(|| detected(index, "sd2", 1024))
}

inventory::submit! {
    ArchSpec { name: "sd1", description: "Stable Diffusion 1.x", detect: detect_sd1, notable: &NOTABLE, blocks }
}
inventory::submit! {
    ArchSpec { name: "sd2", description: "Stable Diffusion 2.x", detect: detect_sd2, notable: &NOTABLE, blocks }
}
