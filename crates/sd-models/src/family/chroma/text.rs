//! Chroma's conditioner: T5-XXL alone, with the text mask the DiT reads.
//!
//! The reference's `T5CLIPEmbedder` as it runs for Chroma (stable-diffusion.cpp
//! `conditioning/conditioner.hpp`): the prompt's weighting syntax parsed, T5's ids in chunks
//! of 512 (EOS, `<pad>`), each chunk encoded on its own and its token weights applied with the
//! mean kept; the context is the chunks joined. The mask has one value per token: 0 for the
//! prompt's tokens and EOS, -inf for padding; then the first `mask_pad` padding tokens
//! (`chroma_t5_mask_pad`, 1 by default) are unmasked. It travels as the conditioning's
//! `vector`, which the DiT takes as its attention mask when `chroma_use_dit_mask` is on.
//!
//! `chroma_use_t5_mask` (off by default: T5 itself attends to the padding) is not offered:
//! the T5 encoder here takes no attention mask.

use sd_sched::{Runner, Weights};

use crate::text::conditioning::{apply_token_weights, Conditioning};
use crate::text::t5::{T5Config, T5Encoder, T5Error};
use crate::text::{T5Tokenizer, TokenizeError, T5_PAD_ID};

/// T5's chunk length for Chroma (the reference's `chunk_len` of `T5CLIPEmbedder`).
pub(crate) const CHUNK_LEN: usize = 512;
/// The reference's default `chroma_t5_mask_pad`.
pub(crate) const DEFAULT_MASK_PAD: usize = 1;

/// Errors of Chroma's conditioner.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChromaTextError {
    /// The prompt's weighting syntax.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// T5-XXL.
    #[error(transparent)]
    T5(#[from] T5Error),
}

/// The text mask of chunks of `ids`: 0 for tokens up to each chunk's EOS, -inf for padding,
/// then the first `mask_pad` padding positions set to 0.
pub(crate) fn text_mask(ids: &[u32], mask_pad: usize) -> Vec<f32> {
    let mut mask: Vec<f32> = ids.iter().map(|&id| if id == T5_PAD_ID { f32::NEG_INFINITY } else { 0.0 }).collect();
    for m in mask.iter_mut().filter(|m| m.is_infinite()).take(mask_pad) {
        *m = 0.0;
    }
    mask
}

/// Encodes `prompt` for Chroma (module docs).
pub(crate) fn encode_chroma(
    t5: T5Encoder<'_>,
    runner: &mut Runner,
    tokenizer: &T5Tokenizer,
    prompt: &str,
    mask_pad: usize,
) -> Result<Conditioning, ChromaTextError> {
    let width = t5.config().d_model;
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for chunk in tokenizer.tokenize_weighted(prompt, CHUNK_LEN)? {
        let mut hidden = t5.encode_ids(runner, &chunk.ids, chunk.ids.len())?;
        apply_token_weights(&mut hidden, width, &chunk.weights);
        data.extend(hidden);
        ids.extend(chunk.ids);
    }
    let vector = text_mask(&ids, mask_pad);
    tracing::debug!(tokens = ids.len(), width, "Chroma prompt encoded");
    Ok(Conditioning::tokens(data, width, ids.len(), vector))
}

/// T5 over its placed weights, with the tokenizer and the mask option.
#[derive(Debug)]
pub(crate) struct ChromaText {
    pub(crate) t5: T5Config,
    pub(crate) weights: Weights,
    pub(crate) tokenizer: T5Tokenizer,
    pub(crate) mask_pad: usize,
}

impl ChromaText {
    /// The conditioning of `prompt` ([`encode_chroma`]).
    pub(crate) fn encode(&self, runner: &mut Runner, prompt: &str) -> Result<Conditioning, ChromaTextError> {
        let t5 = T5Encoder::new(&self.t5, &self.weights)?;
        encode_chroma(t5, runner, &self.tokenizer, prompt, self.mask_pad)
    }
}

#[cfg(test)]
mod tests {
    use sd_backends::GgmlType;

    use super::*;
    use crate::text::clip::test_support::{backend, RANDOM};
    use crate::text::t5::t5_specs;
    use crate::text::T5_EOS_ID;

    #[test]
    fn the_mask_opens_the_prompt_eos_and_the_first_pads() {
        let ids = [5, 7, T5_EOS_ID, T5_PAD_ID, T5_PAD_ID, T5_PAD_ID];
        let inf = f32::NEG_INFINITY;
        assert_eq!(text_mask(&ids, 1), [0.0, 0.0, 0.0, 0.0, inf, inf]);
        assert_eq!(text_mask(&ids, 0), [0.0, 0.0, 0.0, inf, inf, inf]);
        assert_eq!(text_mask(&ids, 8), [0.0; 6]);
    }

    #[test]
    fn context_is_t5_in_chunks_of_512_with_the_mask_as_vector() {
        let cfg = T5Config { d_model: 32, n_heads: 4, d_kv: 8, d_ff: 48, n_layers: 1, ..T5Config::xxl() };
        let mut w = Weights::new(t5_specs(&cfg, &|_| Some(GgmlType::GGML_TYPE_F32), None)).unwrap();
        w.allocate(backend().device().buffer_type()).unwrap();
        w.load_from(&RANDOM).unwrap();
        let text =
            ChromaText { t5: cfg.clone(), weights: w, tokenizer: T5Tokenizer::new(), mask_pad: DEFAULT_MASK_PAD };
        let mut runner = Runner::new("te", backend());
        let c = text.encode(&mut runner, "a photo of a cat").unwrap();
        assert_eq!((c.hidden_size, c.n_tokens, c.vector.len()), (32, CHUNK_LEN, CHUNK_LEN));
        let chunk = &text.tokenizer.tokenize_weighted("a photo of a cat", CHUNK_LEN).unwrap()[0];
        let real = chunk.ids.iter().position(|&i| i == T5_EOS_ID).unwrap() + 1;
        assert!(c.vector[..=real].iter().all(|&m| m == 0.0), "prompt, EOS and one pad open");
        assert!(c.vector[real + 1..].iter().all(|&m| m == f32::NEG_INFINITY));
        let t5 = T5Encoder::new(&cfg, &text.weights).unwrap();
        assert_eq!(c.data, t5.encode_ids(&mut runner, &chunk.ids, CHUNK_LEN).unwrap());
        let long = text.encode(&mut runner, &"cat ".repeat(600)).unwrap();
        assert_eq!((long.n_tokens, long.vector.len()), (2 * CHUNK_LEN, 2 * CHUNK_LEN));
    }
}
