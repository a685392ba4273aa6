//! FLUX.1's use of CLIP-L: the pooled output of the prompt's first 77 ids, no projection.
//!
//! The reference's FLUX conditioner (`FluxCLIPEmbedder` in `conditioning/conditioner.hpp`)
//! feeds the diffusion model T5-XXL's hidden states as context and CLIP ViT-L/14's *pooled*
//! state as the `y` vector (768 values); CLIP-L's hidden states are not used. The pooled
//! state is computed on the first chunk's 77 ids (BOS, the prompt's tokens, EOS, padding with
//! EOS): every layer whatever `--clip-skip` says (the reference passes no skip when it pools),
//! the final LayerNorm, the row at the first EOS (the last position when there is none), and
//! no text projection: the reference declares `text_projection` only for ViT-bigG, so ViT-L's
//! projection is the identity even when the file carries one. Prompt weights do not touch it.
//! Without a `--clip_l` file the reference uses 768 zeros.

use sd_sched::Runner;

use super::clip::{ClipEncoder, Result};
use super::{ClipTokenizer, EOS_ID};

/// The pooling position of a chunk: its first EOS, the last position when it has none.
fn pooled_index(ids: &[u32]) -> usize {
    let last = ids.len().saturating_sub(1);
    ids.iter().position(|&id| id == EOS_ID).unwrap_or(last).min(last)
}

/// FLUX.1's pooled CLIP-L vector of `prompt`: the hidden size of `clip_l` (768 for ViT-L/14).
pub fn flux_clip_l_pooled(
    clip_l: ClipEncoder<'_>,
    runner: &mut Runner,
    tokenizer: &ClipTokenizer,
    prompt: &str,
) -> Result<Vec<f32>> {
    let chunks = tokenizer.tokenize_weighted(prompt, &clip_l.config().chunk_config())?;
    let ids = &chunks[0].ids;
    clip_l.encode_pooled(runner, ids, pooled_index(ids))
}

#[cfg(test)]
mod tests {
    use sd_backends::GgmlType;
    use sd_sched::Runner;

    use super::*;
    use crate::text::clip::test_support::{backend, model, reference_pooled_plain, tiny};
    use crate::text::clip::Activation;
    use crate::text::BOS_ID;

    #[test]
    fn pooled_index_is_the_first_eos() {
        assert_eq!(pooled_index(&[BOS_ID, 320, EOS_ID, EOS_ID]), 2);
        assert_eq!(pooled_index(&[BOS_ID, 320, 321]), 2);
        assert_eq!(pooled_index(&[]), 0);
    }

    /// The pooled vector of a tiny ViT-L-shaped encoder (no projection) against the f64
    /// encoder: the final-LayerNorm row at the first EOS, every layer; and a long prompt pools
    /// its first chunk only.
    #[test]
    fn flux_pooled_output_is_the_unprojected_eos_row() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let cfg = tiny(Activation::QuickGelu, 1, EOS_ID);
        assert!(cfg.projection_dim.is_none());
        let m = model(&cfg, GgmlType::GGML_TYPE_F32, &backend);
        let tokenizer = ClipTokenizer::new();
        let prompt = "a photo of a (cat:1.3)";
        let got = flux_clip_l_pooled(m.encoder(), &mut runner, &tokenizer, prompt).unwrap();
        assert_eq!(got.len(), cfg.hidden_size);
        let chunks = tokenizer.tokenize_weighted(prompt, &cfg.chunk_config()).unwrap();
        let ids = &chunks[0].ids;
        let index = pooled_index(ids);
        assert!(index > 1 && ids[index] == EOS_ID);
        let want = reference_pooled_plain(&cfg, ids, index);
        let scale = want.iter().fold(0.0f64, |a, v| a.max(v.abs())).max(1.0);
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            assert!((f64::from(g) - w).abs() <= 1e-4 * scale, "[{i}]: got {g}, f64 {w}");
        }
        // Weights do not change the pooled state (the same ids without the weight syntax).
        let plain = flux_clip_l_pooled(m.encoder(), &mut runner, &tokenizer, "a photo of a cat").unwrap();
        assert_eq!(plain, got);
        // Another row (the token before EOS) differs: the index matters.
        let other = reference_pooled_plain(&cfg, ids, index - 1);
        assert!(other.iter().zip(&want).any(|(a, b)| (a - b).abs() > 1e-3));
    }
}
