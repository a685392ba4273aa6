//! The text encoders' layer numbering: which layer of CLIP, T5-XXL or the Qwen3 LLM a tensor
//! of the internal naming belongs to (the families' block numberings give the dominant
//! encoder's layers block numbers from these).

use sd_formats::index::numbered;

/// The layer of a CLIP text-encoder tensor: `encoder.layers.N` of the first encoder
/// (`encoder == 0`) or of the second (SDXL's bigG, `encoder == 1`).
pub fn clip_layer_of(name: &str, encoder: usize) -> Option<u32> {
    const LAYERS: [&str; 2] = [
        "cond_stage_model.transformer.text_model.encoder.layers.",
        "cond_stage_model.1.transformer.text_model.encoder.layers.",
    ];
    numbered(name, LAYERS.get(encoder)?)
}

/// The block of a T5-XXL tensor: `encoder.block.N`.
pub fn t5_block_of(name: &str) -> Option<u32> {
    numbered(name, "text_encoders.t5xxl.transformer.encoder.block.")
}

/// The layer of an LLM tensor: `model.layers.N`.
pub fn qwen3_block_of(name: &str) -> Option<u32> {
    numbered(name, "text_encoders.llm.model.layers.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_of_each_encoder() {
        let l = "cond_stage_model.transformer.text_model.encoder.layers.3.mlp.fc1.weight";
        let g = "cond_stage_model.1.transformer.text_model.encoder.layers.14.self_attn.q_proj.weight";
        assert_eq!((clip_layer_of(l, 0), clip_layer_of(l, 1)), (Some(3), None));
        assert_eq!((clip_layer_of(g, 0), clip_layer_of(g, 1), clip_layer_of(g, 2)), (None, Some(14), None));
        assert_eq!(
            t5_block_of("text_encoders.t5xxl.transformer.encoder.block.23.layer.0.SelfAttention.q.weight"),
            Some(23)
        );
        assert_eq!(t5_block_of("text_encoders.t5xxl.transformer.shared.weight"), None);
        assert_eq!(qwen3_block_of("text_encoders.llm.model.layers.35.mlp.up_proj.weight"), Some(35));
        assert_eq!(qwen3_block_of("text_encoders.llm.model.norm.weight"), None);
    }
}
