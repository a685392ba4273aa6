//! Stable Diffusion 3 and 3.5 (the MMDiT with CLIP-L, CLIP-G and T5-XXL): their detection,
//! registered as an `ArchSpec`, and their block numbering (the joint blocks, then T5-XXL's
//! layers, the dominant encoder's, or CLIP-G's when the files hold no T5).
//!
//! Detected as the reference's model loader does: a `joint_blocks.` tensor in the diffusion
//! model. The context width is `context_embedder.weight`'s input width (4096: CLIP-L and CLIP-G
//! padded to T5-XXL's width). SD3 predicts a flow, which `sd_formats::Prediction` does not name:
//! the prediction is left unknown for the flow sampler. Its single files' CLIP prefixes are
//! registered as `sd_formats::names::CheckpointPrefix`es.

use std::sync::Arc;

use sd_formats::arch::BlockFn;
use sd_formats::index::numbered;
use sd_formats::names::CheckpointPrefix;
use sd_formats::{ArchSpec, Detected, PredictionSource, TensorIndex};

use crate::encoders::{clip_layer_of, t5_block_of};

/// Where the joint blocks' tensors start.
const JOINT_BLOCKS: &str = "model.diffusion_model.joint_blocks.";
/// The context projection, `[hidden, context_size]` (PyTorch order).
pub const CONTEXT_EMBEDDER: &str = "model.diffusion_model.context_embedder.weight";

/// The tensors an unknown-architecture error shows when present.
const NOTABLE: [&str; 1] = [CONTEXT_EMBEDDER];

fn detect(index: &TensorIndex) -> Option<Detected> {
    if !index.with_prefix(JOINT_BLOCKS).any(|_| true) {
        return None;
    }
    let width = index.get(CONTEXT_EMBEDDER).and_then(|e| (e.shape.len() == 2).then_some(e.shape[1])).unwrap_or(4096);
    Some(Detected { arch: "sd3", context_dim: width, prediction: None, prediction_source: PredictionSource::Unknown })
}

/// SD3 blocks: the joint blocks, and the dominant text encoder's layers (T5-XXL where the files
/// hold it, else CLIP-G); the other encoders' layers stay with the non-block tensors.
fn blocks(index: &TensorIndex) -> BlockFn {
    let has_t5 = index.entries().iter().any(|e| t5_block_of(&e.name).is_some());
    Arc::new(move |name| {
        numbered(name, JOINT_BLOCKS).or_else(|| if has_t5 { t5_block_of(name) } else { clip_layer_of(name, 1) })
    })
}

// SD3 single files with their encoders inside (`sd3_medium_incl_clips*.safetensors`) keep the
// CLIPs in Hugging Face's layout under these prefixes: CLIP-L is the first CLIP encoder, CLIP-G
// (`CLIPTextModelWithProjection`) the second. T5's `text_encoders.t5xxl.transformer.` is the
// internal prefix already.
inventory::submit! { CheckpointPrefix { from: "text_encoders.clip_l.transformer.", to: "cond_stage_model.transformer." } }
inventory::submit! { CheckpointPrefix { from: "text_encoders.clip_g.transformer.", to: "cond_stage_model.1.transformer." } }

inventory::submit! {
    ArchSpec { name: "sd3", description: "Stable Diffusion 3 / 3.5 (MMDiT)", detect, notable: &NOTABLE, blocks }
}

#[cfg(test)]
mod tests {
    use sd_formats::names::{normalize, Normalized};
    use sd_formats::{FileRole, TensorIndex};

    fn index_of(names: &[&str]) -> TensorIndex {
        let shape = |n: &str| if n.ends_with("context_embedder.weight") { vec![1536, 4096] } else { vec![4] };
        let named: Vec<(&str, Vec<u64>)> = names.iter().map(|&n| (n, shape(n))).collect();
        crate::test_support::index_of(FileRole::Checkpoint, &named)
    }

    #[test]
    fn joint_blocks_are_sd3_and_number_before_t5() {
        let mut names = vec![
            "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
            "model.diffusion_model.joint_blocks.23.context_block.attn.qkv.weight",
            "model.diffusion_model.context_embedder.weight",
            "cond_stage_model.1.transformer.text_model.encoder.layers.31.mlp.fc1.weight",
        ];
        let detected = sd_formats::arch::detect(&index_of(&names), None).unwrap();
        assert_eq!((detected.arch, detected.context_dim), ("sd3", 4096));
        let spec = sd_formats::arch::registered().into_iter().find(|s| s.name == "sd3").unwrap();
        // Without T5 the dominant encoder is CLIP-G.
        let blocks = (spec.blocks)(&index_of(&names));
        assert_eq!(blocks(names[0]), Some(0));
        assert_eq!(blocks(names[1]), Some(23));
        assert_eq!(blocks(names[2]), None);
        assert_eq!(blocks(names[3]), Some(31));
        names.push("text_encoders.t5xxl.transformer.encoder.block.5.layer.0.SelfAttention.q.weight");
        let blocks = (spec.blocks)(&index_of(&names));
        assert_eq!((blocks(names[3]), blocks(names[4])), (None, Some(5)));
    }

    #[test]
    fn single_files_carry_the_clips_under_sd3_prefixes() {
        let one = |name: &str| match normalize(name, FileRole::Checkpoint) {
            Normalized::One(n) => n,
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(
            one("text_encoders.clip_g.transformer.text_model.encoder.layers.0.mlp.fc1.weight"),
            "cond_stage_model.1.transformer.text_model.encoder.layers.0.mlp.fc1.weight"
        );
        assert_eq!(
            one("text_encoders.clip_g.transformer.text_projection.weight"),
            "cond_stage_model.1.transformer.text_model.text_projection"
        );
        assert_eq!(
            one("text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight"),
            "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
        );
        let t5 = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight";
        assert_eq!(one(t5), t5);
    }
}
