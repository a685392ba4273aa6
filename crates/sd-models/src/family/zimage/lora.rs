//! Where Z-Image LoRA keys point, as the reference reads them (stable-diffusion.cpp's
//! `convert_tensor_name` and `convert_diffusers_dit_to_original_lumina2`):
//!
//! - the original (ComfyUI's) names (`diffusion_model.layers.0.attention.qkv.lora_A.weight`);
//! - diffusers' names under any of the DiT's prefixes (`diffusion_model.`, as ai-toolkit saves
//!   them, or `transformer.`): a block's `attention.to_q`, `to_k`, `to_v` adapt the row blocks
//!   of the fused `attention.qkv` (query heads, then key and value heads), `attention.to_out.0`
//!   is `attention.out`, `all_x_embedder.2-1` and `all_final_layer.2-1` the patch embedder and
//!   the final layer;
//! - kohya's flat names (`lora_unet_layers_0_feed_forward_w1`), then as above. The reference
//!   turns every `_` of `feed_forward`, `noise_refiner`, `context_refiner`,
//!   `adaLN_modulation`, `t_embedder` and `cap_embedder` into a `.` and so drops those
//!   adapters; here they apply.
//!
//! The LLM (Qwen3) takes no adapters yet.

use crate::files::FileRole::DiffusionModel;
use crate::lora::{LoraBody, LoraPrefix as P};

pub(crate) const LORA_PREFIXES: [P; 4] = [
    P { prefix: "lora_unet_", role: DiffusionModel, body: LoraBody::Mapped(kohya) },
    P { prefix: "diffusion_model.", role: DiffusionModel, body: LoraBody::Mapped(diffusers) },
    P { prefix: "model.diffusion_model.", role: DiffusionModel, body: LoraBody::Mapped(diffusers) },
    P { prefix: "transformer.", role: DiffusionModel, body: LoraBody::Mapped(diffusers) },
];

/// A kohya flat body, made dotted, then as [`diffusers`].
fn kohya(body: &str) -> Option<(String, Option<usize>)> {
    diffusers(&crate::lora::dotted(body))
}

/// A module path in diffusers' or the original names as the original one, and the row block
/// of the fused `qkv` a split projection adapts. Original names pass unchanged.
pub(crate) fn diffusers(body: &str) -> Option<(String, Option<usize>)> {
    let seg: Vec<&str> = body.split('.').collect();
    let whole = |s: String| Some((s, None));
    match seg.as_slice() {
        ["all_x_embedder", "2-1", rest @ ..] => whole(join("x_embedder", rest)),
        ["all_final_layer", "2-1", rest @ ..] => whole(join("final_layer", rest)),
        [b @ ("layers" | "noise_refiner" | "context_refiner"), i, "attention", leaf @ ..] => {
            let i: usize = i.parse().ok()?;
            let p = format!("{b}.{i}.attention");
            match leaf {
                ["to_q"] => Some((format!("{p}.qkv"), Some(0))),
                ["to_k"] => Some((format!("{p}.qkv"), Some(1))),
                ["to_v"] => Some((format!("{p}.qkv"), Some(2))),
                ["to_out", "0"] => whole(format!("{p}.out")),
                _ => whole(body.to_string()),
            }
        }
        _ => whole(body.to_string()),
    }
}

fn join(head: &str, rest: &[&str]) -> String {
    std::iter::once(head).chain(rest.iter().copied()).collect::<Vec<_>>().join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diffusers_and_kohya_names_reach_the_original_modules() {
        let d = |s: &str| diffusers(s).unwrap();
        assert_eq!(d("layers.3.attention.to_k"), ("layers.3.attention.qkv".into(), Some(1)));
        assert_eq!(d("noise_refiner.1.attention.to_v"), ("noise_refiner.1.attention.qkv".into(), Some(2)));
        assert_eq!(d("context_refiner.0.attention.to_out.0"), ("context_refiner.0.attention.out".into(), None));
        assert_eq!(d("all_x_embedder.2-1"), ("x_embedder".into(), None));
        assert_eq!(d("all_final_layer.2-1.linear"), ("final_layer.linear".into(), None));
        // Original names are kept.
        assert_eq!(d("layers.0.attention.qkv"), ("layers.0.attention.qkv".into(), None));
        assert_eq!(d("layers.0.feed_forward.w2"), ("layers.0.feed_forward.w2".into(), None));
        let k = |s: &str| kohya(s).unwrap();
        assert_eq!(k("layers_12_feed_forward_w1"), ("layers.12.feed_forward.w1".into(), None));
        assert_eq!(k("noise_refiner_0_adaLN_modulation_0"), ("noise_refiner.0.adaLN_modulation.0".into(), None));
        assert_eq!(k("context_refiner_1_attention_to_q"), ("context_refiner.1.attention.qkv".into(), Some(0)));
        assert_eq!(k("t_embedder_mlp_0"), ("t_embedder.mlp.0".into(), None));
        assert_eq!(k("cap_embedder_1"), ("cap_embedder.1".into(), None));
    }
}
