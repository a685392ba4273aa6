//! Where FLUX.1 LoRA keys point, as the reference reads them (stable-diffusion.cpp's
//! `convert_tensor_name` and `convert_diffusers_dit_to_original_flux`):
//!
//! - kohya (`lora_unet_double_blocks_0_img_attn_qkv`, `lora_te1_` for CLIP-L, `lora_te3_` for
//!   T5-XXL), flat bodies in BFL's names;
//! - BFL's dotted names (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`, as
//!   ComfyUI and most trainers save them);
//! - diffusers' names (`transformer.transformer_blocks.0.attn.to_q.lora_A.weight`, as
//!   diffusers and ai-toolkit save them), whose `to_q`, `to_k`, `to_v` (and a single block's
//!   `proj_mlp`) adapt row blocks of BFL's fused `qkv` and `linear1`.

use crate::files::FileRole::{DiffusionModel, T5xxl, TextEncoder};
use crate::lora::{LoraBody, LoraPrefix as P};

pub(crate) const LORA_PREFIXES: [P; 9] = [
    P { prefix: "lora_unet_", role: DiffusionModel, body: LoraBody::Flat },
    P { prefix: "lora_te1_", role: TextEncoder(0), body: LoraBody::Flat },
    P { prefix: "lora_te3_", role: T5xxl, body: LoraBody::Flat },
    P { prefix: "diffusion_model.", role: DiffusionModel, body: LoraBody::Dotted },
    P { prefix: "model.diffusion_model.", role: DiffusionModel, body: LoraBody::Dotted },
    P { prefix: "transformer.", role: DiffusionModel, body: LoraBody::Mapped(diffusers) },
    P { prefix: "text_encoder.", role: TextEncoder(0), body: LoraBody::Dotted },
    P { prefix: "text_encoders.clip_l.transformer.", role: TextEncoder(0), body: LoraBody::Dotted },
    P { prefix: "text_encoders.t5xxl.transformer.", role: T5xxl, body: LoraBody::Dotted },
];

/// A diffusers module path of the FLUX transformer (`transformer_blocks.3.attn.to_k`) as BFL's
/// module path and the row block of it (`double_blocks.3.img_attn.qkv`, part `Some(1)`;
/// `None` for a weight adapted whole).
pub(crate) fn diffusers(body: &str) -> Option<(String, Option<usize>)> {
    let seg: Vec<&str> = body.split('.').collect();
    let whole = |s: String| Some((s, None));
    match seg.as_slice() {
        ["x_embedder"] => whole("img_in".into()),
        ["context_embedder"] => whole("txt_in".into()),
        ["time_text_embed" | "time_embed", "timestep_embedder", l] => whole(format!("time_in.{}", embedder(l)?)),
        ["time_text_embed", "text_embedder", l] => whole(format!("vector_in.{}", embedder(l)?)),
        ["time_text_embed", "guidance_embedder", l] => whole(format!("guidance_in.{}", embedder(l)?)),
        ["proj_out"] => whole("final_layer.linear".into()),
        ["norm_out", "linear"] => whole("final_layer.adaLN_modulation.1".into()),
        ["transformer_blocks", i, rest @ ..] => {
            let i: usize = i.parse().ok()?;
            let p = format!("double_blocks.{i}");
            let (leaf, part) = match rest {
                ["norm1", "linear"] => ("img_mod.lin", None),
                ["norm1_context", "linear"] => ("txt_mod.lin", None),
                ["attn", "to_q"] => ("img_attn.qkv", Some(0)),
                ["attn", "to_k"] => ("img_attn.qkv", Some(1)),
                ["attn", "to_v"] => ("img_attn.qkv", Some(2)),
                ["attn", "add_q_proj"] => ("txt_attn.qkv", Some(0)),
                ["attn", "add_k_proj"] => ("txt_attn.qkv", Some(1)),
                ["attn", "add_v_proj"] => ("txt_attn.qkv", Some(2)),
                ["attn", "to_out", "0"] => ("img_attn.proj", None),
                ["attn", "to_add_out"] => ("txt_attn.proj", None),
                ["ff", "net", "0", "proj"] => ("img_mlp.0", None),
                ["ff", "net", "2"] => ("img_mlp.2", None),
                ["ff_context", "net", "0", "proj"] => ("txt_mlp.0", None),
                ["ff_context", "net", "2"] => ("txt_mlp.2", None),
                _ => return None,
            };
            Some((format!("{p}.{leaf}"), part))
        }
        ["single_transformer_blocks", i, rest @ ..] => {
            let i: usize = i.parse().ok()?;
            let p = format!("single_blocks.{i}");
            let (leaf, part) = match rest {
                ["norm", "linear"] => ("modulation.lin", None),
                ["attn", "to_q"] => ("linear1", Some(0)),
                ["attn", "to_k"] => ("linear1", Some(1)),
                ["attn", "to_v"] => ("linear1", Some(2)),
                ["proj_mlp"] => ("linear1", Some(3)),
                ["proj_out"] => ("linear2", None),
                _ => return None,
            };
            Some((format!("{p}.{leaf}"), part))
        }
        _ => None,
    }
}

/// `linear_1` / `linear_2` of a diffusers embedder as BFL's `in_layer` / `out_layer`.
fn embedder(leaf: &str) -> Option<&'static str> {
    match leaf {
        "linear_1" => Some("in_layer"),
        "linear_2" => Some("out_layer"),
        _ => None,
    }
}
