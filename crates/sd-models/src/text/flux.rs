//! FLUX's conditioner: T5-XXL's hidden states as the context, CLIP ViT-L/14's pooled output as
//! the vector.
//!
//! This is the reference's `FluxCLIPEmbedder` (stable-diffusion.cpp
//! `conditioning/conditioner.hpp`), step for step:
//!
//! 1. The weighting syntax is parsed once ([`parse_prompt_attention`]); `BREAK` is no break
//!    here: both tokenizers read it as the text "BREAK" (weight -1), as the reference does.
//! 2. CLIP-L: the fragments' ids one after another, then one sequence of 77: BOS, the first 75
//!    ids, EOS, EOS padding (the reference pads with 77 as both the minimum and the maximum and
//!    keeps the first 77). Its pooled output ([`ClipEncoder::encode_pooled`]): every layer, the
//!    final LayerNorm, the state at the first EOS; CLIP-L has no text projection, so that state
//!    is the vector (768 values). Prompt weights do not touch it, and neither does
//!    `--clip-skip` (the reference's pooled path runs every layer whatever the skip).
//! 3. T5: [`T5Tokenizer::tokenize_weighted`] in chunks of 256 ids (EOS, `<pad>`), each chunk
//!    encoded on its own, the prompt weights applied per chunk with the mean kept (the SD
//!    rule of [`crate::text::conditioning`]), chunks joined on the token axis.
//!
//! Without CLIP-L the vector is 768 zeros; without T5 the context is one chunk of zeros
//! (the reference warns and does the same; the family decides whether to allow it).

use std::sync::Arc;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};

use super::clip::{clip_specs, ClipConfig, ClipEncoder, ClipError};
use super::conditioning::{apply_token_weights, Conditioning};
use super::t5::{t5_specs, T5Config, T5Encoder, T5Error};
use super::{parse_prompt_attention, ClipTokenizer, T5Tokenizer, TokenizeError};
use super::{BOS_ID, EOS_ID, FLUX_T5_CHUNK_LEN};

/// Width of the vector without CLIP-L (CLIP ViT-L/14's hidden size).
const POOLED_WIDTH: usize = 768;
/// Width of the context without T5 (T5-XXL's `d_model`).
const T5_WIDTH: usize = 4096;

/// Errors of FLUX's conditioner.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FluxTextError {
    /// The prompt's weighting syntax.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// CLIP-L.
    #[error(transparent)]
    Clip(#[from] ClipError),
    /// T5-XXL.
    #[error(transparent)]
    T5(#[from] T5Error),
}

/// CLIP-L's one sequence for `prompt`, and the index of its first EOS (the pooling index).
pub(crate) fn clip_l_ids(
    tokenizer: &ClipTokenizer,
    prompt: &str,
    n_positions: usize,
) -> Result<(Vec<u32>, usize), TokenizeError> {
    let mut tokens = Vec::new();
    for fragment in parse_prompt_attention(prompt)? {
        tokens.extend(tokenizer.tokenize(fragment.text_and_weight().0));
    }
    let body = n_positions.saturating_sub(2);
    let mut ids = Vec::with_capacity(n_positions);
    ids.push(BOS_ID);
    ids.extend_from_slice(&tokens[..tokens.len().min(body)]);
    ids.push(EOS_ID);
    ids.resize(n_positions, EOS_ID);
    let eos = ids.iter().position(|&id| id == EOS_ID).unwrap_or(n_positions - 1);
    Ok((ids, eos))
}

/// Encodes `prompt` for FLUX with whichever encoders are present (see the module docs).
pub(crate) fn encode_flux(
    clip_l: Option<ClipEncoder<'_>>,
    t5: Option<T5Encoder<'_>>,
    runner: &mut Runner,
    clip_tokenizer: &ClipTokenizer,
    t5_tokenizer: &T5Tokenizer,
    prompt: &str,
) -> Result<Conditioning, FluxTextError> {
    let vector = match clip_l {
        Some(clip) => {
            let (ids, eos) = clip_l_ids(clip_tokenizer, prompt, clip.config().n_positions)?;
            clip.encode_pooled(runner, &ids, eos)?
        }
        None => vec![0.0; POOLED_WIDTH],
    };
    let (data, hidden_size) = match t5 {
        Some(t5) => {
            let width = t5.config().d_model;
            let mut data = Vec::new();
            for chunk in t5_tokenizer.tokenize_weighted(prompt, FLUX_T5_CHUNK_LEN)? {
                let mut hidden = t5.encode_ids(runner, &chunk.ids, chunk.ids.len())?;
                apply_token_weights(&mut hidden, width, &chunk.weights);
                data.extend(hidden);
            }
            (data, width)
        }
        None => (vec![0.0; T5_WIDTH * FLUX_T5_CHUNK_LEN], T5_WIDTH),
    };
    let n_tokens = data.len() / hidden_size;
    tracing::debug!(tokens = n_tokens, hidden_size, vector = vector.len(), "FLUX prompt encoded");
    Ok(Conditioning::tokens(data, hidden_size, n_tokens, vector))
}

/// FLUX's two text encoders over one weight set (the `te` module), with their tokenizers;
/// either may be absent (module docs).
#[derive(Debug)]
pub(crate) struct FluxText {
    clip_l: Option<ClipConfig>,
    t5: Option<T5Config>,
    weights: Weights,
    clip_tokenizer: Arc<ClipTokenizer>,
    t5_tokenizer: T5Tokenizer,
}

impl FluxText {
    /// The parameters of the present encoders (CLIP-L first).
    pub(crate) fn specs(
        clip_l: Option<&ClipConfig>,
        t5: Option<&T5Config>,
        dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
        wtype: Option<GgmlType>,
    ) -> Vec<TensorSpec> {
        let mut specs = clip_l.map(|c| clip_specs(c, dtype_of, wtype)).unwrap_or_default();
        specs.extend(t5.map(|c| t5_specs(c, dtype_of, wtype)).unwrap_or_default());
        specs
    }

    /// The encoders over `weights` (declared from [`FluxText::specs`], allocated, loaded); an
    /// error naming the first parameter an encoder misses or has the wrong shape of.
    pub(crate) fn new(
        clip_l: Option<ClipConfig>,
        t5: Option<T5Config>,
        weights: Weights,
        clip_tokenizer: Arc<ClipTokenizer>,
    ) -> Result<Self, FluxTextError> {
        if let Some(c) = &clip_l {
            ClipEncoder::new(c, &weights)?;
        }
        if let Some(c) = &t5 {
            T5Encoder::new(c, &weights)?;
        }
        Ok(Self { clip_l, t5, weights, clip_tokenizer, t5_tokenizer: T5Tokenizer::new() })
    }

    /// The weights of both encoders.
    pub(crate) fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The conditioning of `prompt` ([`encode_flux`]).
    pub(crate) fn encode(&self, runner: &mut Runner, prompt: &str) -> Result<Conditioning, FluxTextError> {
        let clip = self.clip_l.as_ref().map(|c| ClipEncoder::new(c, &self.weights)).transpose()?;
        let t5 = self.t5.as_ref().map(|c| T5Encoder::new(c, &self.weights)).transpose()?;
        encode_flux(clip, t5, runner, &self.clip_tokenizer, &self.t5_tokenizer, prompt)
    }
}

#[cfg(test)]
mod tests {
    use sd_backends::GgmlType;
    use sd_sched::{Runner, Weights};

    use super::*;
    use crate::text::clip::test_support::{backend, tiny, RANDOM};
    use crate::text::clip::{Activation, ClipConfig};
    use crate::text::t5::T5Config;

    const F32: GgmlType = GgmlType::GGML_TYPE_F32;

    fn configs() -> (ClipConfig, T5Config) {
        let clip = tiny(Activation::QuickGelu, 1, EOS_ID);
        let t5 = T5Config { d_model: 32, n_heads: 4, d_kv: 8, d_ff: 48, n_layers: 2, ..T5Config::xxl() };
        (clip, t5)
    }

    fn weights(clip: &ClipConfig, t5: &T5Config) -> Weights {
        let mut w = Weights::new(FluxText::specs(Some(clip), Some(t5), &|_| Some(F32), None)).unwrap();
        w.allocate(backend().device().buffer_type()).unwrap();
        w.load_from(&RANDOM).unwrap();
        w
    }

    #[test]
    fn clip_l_reads_one_sequence_with_break_as_text() {
        let tok = ClipTokenizer::new();
        let (ids, eos) = clip_l_ids(&tok, "a cat", 77).unwrap();
        assert_eq!(ids.len(), 77);
        assert_eq!(&ids[..1], &[BOS_ID]);
        assert_eq!(eos, 3, "{ids:?}");
        assert!(ids[3..].iter().all(|&id| id == EOS_ID));
        // Weights do not change the ids; BREAK is the word "break".
        assert_eq!(clip_l_ids(&tok, "(a:1.5) [cat]", 77).unwrap(), (ids.clone(), eos));
        let (with_break, eos_b) = clip_l_ids(&tok, "a BREAK cat", 77).unwrap();
        assert_eq!(eos_b, 4);
        assert_eq!(with_break[2], tok.tokenize("break")[0]);
        // A long prompt keeps its first 75 tokens and ends with EOS.
        let long = "cat ".repeat(200);
        let (ids, eos) = clip_l_ids(&tok, &long, 77).unwrap();
        assert_eq!((ids.len(), eos, ids[76]), (77, 76, EOS_ID));
        assert!(ids[1..76].iter().all(|&id| id == tok.tokenize("cat")[0]));
    }

    #[test]
    fn context_is_t5_and_vector_is_the_pooled_clip_l_state() {
        let (clip_cfg, t5_cfg) = configs();
        let clip_cfg = ClipConfig { projection_dim: None, ..clip_cfg };
        let w = weights(&clip_cfg, &t5_cfg);
        let (clip, t5) = (ClipEncoder::new(&clip_cfg, &w).unwrap(), T5Encoder::new(&t5_cfg, &w).unwrap());
        let (ct, tt) = (ClipTokenizer::new(), T5Tokenizer::new());
        let mut runner = Runner::new("te", backend());
        let c = encode_flux(Some(clip), Some(t5), &mut runner, &ct, &tt, "a photo of a cat").unwrap();
        assert_eq!((c.hidden_size, c.n_tokens, c.vector.len()), (32, FLUX_T5_CHUNK_LEN, 32));
        // The context is T5 on the tokenized chunk, the vector CLIP-L's state at the first EOS.
        let chunk = &tt.tokenize_weighted("a photo of a cat", FLUX_T5_CHUNK_LEN).unwrap()[0];
        assert_eq!(c.data, t5.encode_ids(&mut runner, &chunk.ids, FLUX_T5_CHUNK_LEN).unwrap());
        let (ids, eos) = clip_l_ids(&ct, "a photo of a cat", 77).unwrap();
        assert_eq!(c.vector, clip.encode_pooled(&mut runner, &ids, eos).unwrap());
        // Weights change the context, not the vector.
        let weighted = encode_flux(Some(clip), Some(t5), &mut runner, &ct, &tt, "a photo of a (cat:1.4)").unwrap();
        assert_eq!(weighted.vector, c.vector);
        assert_ne!(weighted.data, c.data);
        // A prompt over 255 T5 tokens is two chunks.
        let long = "cat ".repeat(300);
        let l = encode_flux(Some(clip), Some(t5), &mut runner, &ct, &tt, &long).unwrap();
        assert_eq!(l.n_tokens, 2 * FLUX_T5_CHUNK_LEN);
        // The weight-set wrapper encodes the same.
        let text =
            FluxText::new(Some(clip_cfg.clone()), Some(t5_cfg.clone()), w, Arc::new(ClipTokenizer::new())).unwrap();
        assert!(text.weights().contains("text_encoders.t5xxl.transformer.shared.weight"));
        let again = text.encode(&mut runner, "a photo of a cat").unwrap();
        assert_eq!((again.data, again.vector), (c.data, c.vector));
        // Without encoders: zeros of the real widths.
        let none = encode_flux(None, None, &mut runner, &ct, &tt, "a cat").unwrap();
        assert_eq!((none.hidden_size, none.n_tokens, none.vector.len()), (T5_WIDTH, FLUX_T5_CHUNK_LEN, POOLED_WIDTH));
        assert!(none.data.iter().chain(&none.vector).all(|&v| v == 0.0));
    }
}
