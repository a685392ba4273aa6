//! Where SD3 LoRA keys point, as the reference reads them (stable-diffusion.cpp's
//! `convert_tensor_name` and `convert_diffusers_dit_to_original_sd3`):
//!
//! - the original names (`diffusion_model.joint_blocks.0.x_block.attn.qkv.lora_A.weight`, as
//!   ComfyUI saves them);
//! - diffusers' names (`transformer.transformer_blocks.0.attn.to_q.lora_A.weight`, as diffusers'
//!   SD3 trainers save them): a block's `attn.to_q`, `to_k`, `to_v` (and `attn2.*` of MMDiT-X)
//!   adapt the row blocks of the image stream's fused `qkv`, `add_q_proj`, `add_k_proj`,
//!   `add_v_proj` those of the context stream's; `norm1` and `norm1_context` are the streams'
//!   modulations, `ff` and `ff_context` their MLPs, `to_out.0` and `to_add_out` their
//!   projections; `proj_out` and `norm_out.linear` the final layer;
//! - kohya's flat names (`lora_unet_joint_blocks_0_x_block_attn_qkv`), made dotted, then as
//!   above; `lora_te1_`, `lora_te2_`, `lora_te3_` for CLIP-L, CLIP-G and T5-XXL, and the
//!   encoders' own prefixes in SD3's single files.

use crate::files::FileRole::{DiffusionModel, T5xxl, TextEncoder};
use crate::lora::{LoraBody, LoraPrefix as P};

pub(crate) const LORA_PREFIXES: [P; 10] = [
    P { prefix: "lora_unet_", role: DiffusionModel, body: LoraBody::Mapped(kohya) },
    P { prefix: "lora_te1_", role: TextEncoder(0), body: LoraBody::Flat },
    P { prefix: "lora_te2_", role: TextEncoder(1), body: LoraBody::Flat },
    P { prefix: "lora_te3_", role: T5xxl, body: LoraBody::Flat },
    P { prefix: "diffusion_model.", role: DiffusionModel, body: LoraBody::Mapped(diffusers) },
    P { prefix: "model.diffusion_model.", role: DiffusionModel, body: LoraBody::Mapped(diffusers) },
    P { prefix: "transformer.", role: DiffusionModel, body: LoraBody::Mapped(diffusers) },
    P { prefix: "text_encoders.clip_l.transformer.", role: TextEncoder(0), body: LoraBody::Dotted },
    P { prefix: "text_encoders.clip_g.transformer.", role: TextEncoder(1), body: LoraBody::Dotted },
    P { prefix: "text_encoders.t5xxl.transformer.", role: T5xxl, body: LoraBody::Dotted },
];

/// The MMDiT's module names (and diffusers') that contain `_`, kept beside the shared list of
/// `crate::lora::dotted_keeping`.
const KEEP_UNDERSCORE: [&str; 9] = [
    "joint_blocks",
    "context_block",
    "x_block",
    "y_embedder",
    "context_embedder",
    "to_add_out",
    "norm1_context",
    "ff_context",
    "pos_embed",
];

/// A kohya flat body, made dotted (SD3's names with `_` kept), then as [`diffusers`].
fn kohya(body: &str) -> Option<(String, Option<usize>)> {
    diffusers(&crate::lora::dotted_keeping(body, &KEEP_UNDERSCORE))
}

/// A module path in diffusers' or the original names as the original one, and the row block
/// of a fused `qkv` a split projection adapts. Original names pass unchanged.
pub(crate) fn diffusers(body: &str) -> Option<(String, Option<usize>)> {
    let seg: Vec<&str> = body.split('.').collect();
    let whole = |s: &str| Some((s.to_string(), None));
    match seg.as_slice() {
        ["time_text_embed", "timestep_embedder", "linear_1"] => whole("t_embedder.mlp.0"),
        ["time_text_embed", "timestep_embedder", "linear_2"] => whole("t_embedder.mlp.2"),
        ["time_text_embed", "text_embedder", "linear_1"] => whole("y_embedder.mlp.0"),
        ["time_text_embed", "text_embedder", "linear_2"] => whole("y_embedder.mlp.2"),
        ["pos_embed", "proj"] => whole("x_embedder.proj"),
        ["proj_out"] => whole("final_layer.linear"),
        ["norm_out", "linear"] => whole("final_layer.adaLN_modulation.1"),
        ["transformer_blocks", i, rest @ ..] => {
            let i: usize = i.parse().ok()?;
            let (stream, leaf, part) = match rest {
                ["norm1", "linear"] => ("x_block", "adaLN_modulation.1", None),
                ["norm1_context", "linear"] => ("context_block", "adaLN_modulation.1", None),
                [a @ ("attn" | "attn2"), proj] => {
                    let (stream, part) = match *proj {
                        "to_q" => ("x_block", Some(0)),
                        "to_k" => ("x_block", Some(1)),
                        "to_v" => ("x_block", Some(2)),
                        "add_q_proj" => ("context_block", Some(0)),
                        "add_k_proj" => ("context_block", Some(1)),
                        "add_v_proj" => ("context_block", Some(2)),
                        "to_add_out" => return Some((format!("joint_blocks.{i}.context_block.{a}.proj"), None)),
                        _ => return None,
                    };
                    return Some((format!("joint_blocks.{i}.{stream}.{a}.qkv"), part));
                }
                [a @ ("attn" | "attn2"), "to_out", "0"] => {
                    return Some((format!("joint_blocks.{i}.x_block.{a}.proj"), None));
                }
                ["ff", "net", "0", "proj"] => ("x_block", "mlp.fc1", None),
                ["ff", "net", "2"] => ("x_block", "mlp.fc2", None),
                ["ff_context", "net", "0", "proj"] => ("context_block", "mlp.fc1", None),
                ["ff_context", "net", "2"] => ("context_block", "mlp.fc2", None),
                _ => return None,
            };
            Some((format!("joint_blocks.{i}.{stream}.{leaf}"), part))
        }
        _ => whole(body),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diffusers_and_kohya_names_reach_the_original_modules() {
        let d = |s: &str| diffusers(s).unwrap();
        assert_eq!(d("transformer_blocks.3.attn.to_k"), ("joint_blocks.3.x_block.attn.qkv".into(), Some(1)));
        assert_eq!(
            d("transformer_blocks.0.attn.add_v_proj"),
            ("joint_blocks.0.context_block.attn.qkv".into(), Some(2))
        );
        assert_eq!(d("transformer_blocks.1.attn2.to_q"), ("joint_blocks.1.x_block.attn2.qkv".into(), Some(0)));
        assert_eq!(d("transformer_blocks.2.attn.to_out.0"), ("joint_blocks.2.x_block.attn.proj".into(), None));
        assert_eq!(d("transformer_blocks.2.attn.to_add_out"), ("joint_blocks.2.context_block.attn.proj".into(), None));
        assert_eq!(d("transformer_blocks.4.ff_context.net.2"), ("joint_blocks.4.context_block.mlp.fc2".into(), None));
        assert_eq!(d("transformer_blocks.4.norm1.linear"), ("joint_blocks.4.x_block.adaLN_modulation.1".into(), None));
        assert_eq!(d("norm_out.linear"), ("final_layer.adaLN_modulation.1".into(), None));
        assert_eq!(d("proj_out"), ("final_layer.linear".into(), None));
        assert_eq!(d("context_embedder"), ("context_embedder".into(), None));
        assert_eq!(diffusers("transformer_blocks.0.attn.norm_q"), None, "no adapter of a norm");
        // Original names are kept.
        assert_eq!(d("joint_blocks.0.x_block.attn.qkv"), ("joint_blocks.0.x_block.attn.qkv".into(), None));
        let k = |s: &str| kohya(s).unwrap();
        assert_eq!(k("joint_blocks_12_x_block_attn_qkv"), ("joint_blocks.12.x_block.attn.qkv".into(), None));
        assert_eq!(
            k("joint_blocks_0_context_block_adaLN_modulation_1"),
            ("joint_blocks.0.context_block.adaLN_modulation.1".into(), None)
        );
        assert_eq!(k("joint_blocks_3_x_block_attn2_proj"), ("joint_blocks.3.x_block.attn2.proj".into(), None));
        assert_eq!(k("transformer_blocks_1_attn_to_v"), ("joint_blocks.1.x_block.attn.qkv".into(), Some(2)));
        assert_eq!(k("final_layer_linear"), ("final_layer.linear".into(), None));
        assert_eq!(k("context_embedder"), ("context_embedder".into(), None));
    }
}
