//! Prompt to UNet conditioning for SD 1.x / 2.x: tokenize, encode each 77-id chunk, weight, concatenate.
//!
//! This is the reference's `FrozenCLIPEmbedderWithCustomWords::get_learned_condition` for
//! SD 1.x and SD 2.x (stable-diffusion.cpp `conditioning/conditioner.hpp`), step for step:
//!
//! 1. The prompt is parsed for attention weights and tokenized into chunks of 77 ids (BOS,
//!    up to 75 tokens, EOS, padding), one weight per id ([`ClipTokenizer::tokenize_weighted`]).
//!    An empty prompt still gives one chunk (BOS, EOS, padding); a negative prompt is just
//!    another prompt.
//! 2. Each chunk is encoded on its own ([`ClipTextModel::encode_each`]), with the clip skip
//!    resolved from `--clip-skip` (<= 0: 1 for SD 1.x, 2 for SD 2.x).
//! 3. Prompt weights ([`apply_token_weights`]): unless every weight of the chunk is exactly
//!    1, each token's hidden state is multiplied by its weight, then the whole chunk is
//!    rescaled so that its mean over all values equals the mean before weighting. Means are
//!    summed in f64 in memory order and rounded to f32; the rescale factor is the f32 ratio
//!    of the two means, skipped when either mean is not finite or the new mean is 0.
//! 4. Chunks are concatenated along the token axis: the result is `[hidden, 77 * chunks]`
//!    (ggml order), what the UNet's cross-attention receives as context.
//!
//! Textual-inversion embeddings are not supported (the reference then keeps the token table
//! in f32; we do not need to).

use super::clip::{ClipTextModel, Result};
use super::ClipTokenizer;
use sd_sched::Runner;

/// The text conditioning of one prompt: `n_tokens` hidden states of `hidden_size` values,
/// tokens in order (ggml shape `[hidden_size, n_tokens]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Conditioning {
    /// Values, `hidden_size` per token.
    pub data: Vec<f32>,
    /// Width of one token's hidden state (768 for SD 1.x, 1024 for SD 2.x).
    pub hidden_size: usize,
    /// Number of tokens: 77 per chunk.
    pub n_tokens: usize,
}

impl Conditioning {
    /// ggml shape `[hidden_size, n_tokens]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.hidden_size, self.n_tokens]
    }
}

/// Encodes `prompt` (or a negative prompt) into the context tensor the reference feeds the
/// UNet. `clip_skip` is the `--clip-skip` value: <= 0 for the model's default.
pub fn encode_prompt(
    model: &ClipTextModel,
    runner: &mut Runner,
    tokenizer: &ClipTokenizer,
    prompt: &str,
    clip_skip: i64,
) -> Result<Conditioning> {
    let cfg = model.config();
    let clip_skip = cfg.resolve_clip_skip(clip_skip)?;
    let chunks = tokenizer.tokenize_weighted(prompt, &cfg.chunk_config())?;
    let _span = tracing::debug_span!("encode_prompt", chunks = chunks.len(), clip_skip).entered();

    let sequences: Vec<&[u32]> = chunks.iter().map(|c| c.ids.as_slice()).collect();
    let encoded = model.encode_each(runner, &sequences, clip_skip)?;

    let hidden_size = cfg.hidden_size;
    let mut data = Vec::with_capacity(hidden_size * cfg.n_positions * chunks.len());
    for (chunk, mut hidden) in chunks.iter().zip(encoded) {
        apply_token_weights(&mut hidden, hidden_size, &chunk.weights);
        data.extend_from_slice(&hidden);
    }
    let n_tokens = data.len() / hidden_size;
    tracing::debug!(tokens = n_tokens, hidden_size, "prompt encoded");
    Ok(Conditioning { data, hidden_size, n_tokens })
}

/// Applies prompt weights to one chunk's hidden states (`hidden_size` values per token, one
/// weight per token) the way the reference does: nothing when every weight is exactly 1;
/// otherwise scale each token by its weight, then rescale everything by
/// `mean_before / mean_after` (f32), skipped when a mean is not finite or the new mean is 0.
///
/// # Panics
/// When `hidden.len() != hidden_size * weights.len()` (a caller bug).
pub fn apply_token_weights(hidden: &mut [f32], hidden_size: usize, weights: &[f32]) {
    assert_eq!(hidden.len(), hidden_size * weights.len(), "one weight per token");
    if weights.iter().all(|&w| w == 1.0) {
        return;
    }
    let original_mean = mean(hidden);
    for (token, &w) in hidden.chunks_exact_mut(hidden_size).zip(weights) {
        for v in token {
            *v *= w;
        }
    }
    let new_mean = mean(hidden);
    if original_mean.is_finite() && new_mean.is_finite() && new_mean != 0.0 {
        let factor = original_mean / new_mean;
        for v in hidden.iter_mut() {
            *v *= factor;
        }
    }
}

/// Mean of all values: f64 sum in order, divided in f64, rounded to f32 (the reference's
/// `Tensor<float>::mean`).
fn mean(values: &[f32]) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    let sum: f64 = values.iter().map(|&v| v as f64).sum();
    (sum / values.len() as f64) as f32
}
