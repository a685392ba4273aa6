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
    /// A per-sample vector besides the tokens (SDXL's ADM input: the pooled text embedding
    /// and the size embeddings); empty for families that have none.
    pub vector: Vec<f32>,
    /// The token states are zero by design, not by a fault (SDXL's empty negative prompt,
    /// as the reference zeroes it): health checks skip them.
    pub zeroed: bool,
    /// Latents the diffusion model reads beside the one it denoises (FLUX.2's reference
    /// images, `-r`): the pipeline adds them to the prompt's and the negative prompt's
    /// conditioning, as the reference hands them to both. Empty for a text-only conditioning.
    pub references: Vec<ReferenceLatent>,
    /// How a FLUX.1 model numbers the references (`--increase-ref-index`): each on its own
    /// RoPE index instead of all on one, side by side.
    pub increase_ref_index: bool,
}

/// One reference image's latent: `channels x height x width` values, row-major (ggml
/// `[width, height, channels]`), at the latent resolution the diffusion model reads.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceLatent {
    /// The values.
    pub data: Vec<f32>,
    /// Latent columns.
    pub width: usize,
    /// Latent rows.
    pub height: usize,
}

impl Conditioning {
    /// The states of `n_tokens` tokens, `hidden_size` values each, with `vector` beside them
    /// (empty for families without one): not zero by design, no reference latents.
    pub fn tokens(data: Vec<f32>, hidden_size: usize, n_tokens: usize, vector: Vec<f32>) -> Self {
        Self { data, hidden_size, n_tokens, vector, zeroed: false, references: Vec::new(), increase_ref_index: false }
    }

    /// ggml shape `[hidden_size, n_tokens]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.hidden_size, self.n_tokens]
    }

    /// Whether `other` can share a batch with this one (same token count, width and vector
    /// length, reference latents of the same sizes).
    pub fn batches_with(&self, other: &Conditioning) -> bool {
        let sizes =
            |c: &Conditioning| c.references.iter().map(|r| (r.width, r.height, r.data.len())).collect::<Vec<_>>();
        self.shape() == other.shape() && self.vector.len() == other.vector.len() && sizes(self) == sizes(other)
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
    Ok(Conditioning::tokens(data, hidden_size, n_tokens, Vec::new()))
}

/// Applies prompt weights to one chunk's hidden states (`hidden_size` values per token, one
/// weight per token) the way the reference does: nothing when every weight is exactly 1;
/// otherwise scale each token by its weight, then rescale everything by
/// `mean_before / mean_after` (f32), skipped when a mean is not finite or the new mean is 0.
///
/// # Panics
/// When `hidden.len() != hidden_size * weights.len()` (a caller bug).
pub(crate) fn apply_token_weights(hidden: &mut [f32], hidden_size: usize, weights: &[f32]) {
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

#[cfg(test)]
mod tests {
    use sd_backends::GgmlType;
    use sd_sched::Runner;

    use super::*;
    use crate::text::clip::test_support::{backend, model, tiny};
    use crate::text::clip::{Activation, ClipError};
    use crate::text::{BOS_ID, EOS_ID};

    #[test]
    fn token_weights_scale_then_restore_the_mean() {
        // Two values per token, weights (1, 2, 1): [1,2 | 6,8 | 5,6], mean 28/6 against 3.5
        // before, so everything is multiplied by 3.5 / (28/6) = 0.75.
        let mut h = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        apply_token_weights(&mut h, 2, &[1.0, 2.0, 1.0]);
        let want = [0.75, 1.5, 4.5, 6.0, 3.75, 4.5];
        for (g, w) in h.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{h:?}");
        }
    }

    #[test]
    fn token_weights_edge_cases_follow_the_reference() {
        // All weights exactly 1: untouched, even non-finite values.
        let mut h = vec![f32::NAN, 1.0];
        apply_token_weights(&mut h, 1, &[1.0, 1.0]);
        assert!(h[0].is_nan() && h[1] == 1.0);
        // New mean 0: weighted but not rescaled.
        let mut h = vec![1.0, -1.0, 3.0, -3.0];
        apply_token_weights(&mut h, 2, &[2.0, 1.0]);
        assert_eq!(h, [2.0, -2.0, 3.0, -3.0]);
        // Every weight 0: all zeros, no division by zero.
        let mut h = vec![1.0, 2.0];
        apply_token_weights(&mut h, 1, &[0.0, 0.0]);
        assert_eq!(h, [0.0, 0.0]);
        // A non-finite mean before weighting: weighted only.
        let mut h = vec![f32::INFINITY, 2.0];
        apply_token_weights(&mut h, 1, &[1.0, 0.5]);
        assert_eq!(h, [f32::INFINITY, 1.0]);
    }

    /// `tokens` hidden states of `width` values: a fixed pseudo-random pattern, made zero-mean
    /// per token (what a LayerNorm with gain 1 and bias 0 outputs), plus `offset`.
    fn states(tokens: usize, width: usize, offset: f32) -> Vec<f32> {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut out = Vec::with_capacity(tokens * width);
        for _ in 0..tokens {
            let row: Vec<f32> = (0..width)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                })
                .collect();
            let m = row.iter().sum::<f32>() / width as f32;
            out.extend(row.iter().map(|v| v - m + offset));
        }
        out
    }

    /// The rescale factor `apply_token_weights` applied: weighted / (input * weights).
    fn factor_of(h: &[f32], width: usize, weights: &[f32]) -> f64 {
        let mut w = h.to_vec();
        apply_token_weights(&mut w, width, weights);
        let (i, v) = h.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
        f64::from(w[i]) / (f64::from(*v) * f64::from(weights[i / width]))
    }

    #[test]
    fn the_mean_renormalisation_is_ill_conditioned_for_zero_mean_states() {
        // Issue 10: on checkpoints whose final LayerNorm has gain 1 and bias 0, every token's
        // hidden state has mean 0, so the reference's factor mean_before / mean_after is a
        // ratio of rounding noise: a relative perturbation of 1e-6 of the values (far below
        // the kernel drift between two ggml versions) moves it by more than 1% (6% here), and the two
        // programs' weighted conditionings disagree by a scale. With a mean of 5% of the
        // values' scale (real CLIP states have one), the same perturbation moves it by < 1e-4.
        let (tokens, width) = (77, 64);
        let mut weights = vec![1.0f32; tokens];
        weights[7] = 1.3;
        weights[8] = 1.3;
        let perturb = |h: &[f32]| -> Vec<f32> {
            h.iter().enumerate().map(|(i, v)| v * (1.0 + if i % 3 == 0 { 1e-6 } else { -1e-6 })).collect()
        };
        for (offset, sensitive) in [(0.0f32, true), (0.05 * 0.29, false)] {
            let h = states(tokens, width, offset);
            let (a, b) = (factor_of(&h, width, &weights), factor_of(&perturb(&h), width, &weights));
            let change = ((a - b) / a).abs();
            if sensitive {
                assert!(change > 0.01, "zero-mean states: factor {a} -> {b}");
            } else {
                assert!(change < 1e-4, "offset {offset}: factor {a} -> {b}");
                assert!((a - 1.0).abs() < 0.05, "a small weight on 2 of 77 tokens rescales little: {a}");
            }
        }
    }

    fn padded(body: &[u32], pad: u32) -> Vec<u32> {
        let mut ids = vec![BOS_ID];
        ids.extend_from_slice(body);
        ids.push(EOS_ID);
        ids.resize(77, pad);
        ids
    }

    #[test]
    fn prompts_become_chunks_encoded_one_by_one() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let tok = ClipTokenizer::new();
        // SD 2.x-like: pad 0, default clip skip 2.
        let cfg = tiny(Activation::GeluTanh, 2, 0);
        let model = model(&cfg, GgmlType::GGML_TYPE_F16, &backend);

        // Empty prompt: one chunk BOS, EOS, padding; default clip skip.
        let empty = encode_prompt(&model, &mut runner, &tok, "", -1).unwrap();
        assert_eq!(empty.shape(), [32, 77]);
        assert_eq!(empty.data, model.encode_ids(&mut runner, &padded(&[], 0), 2).unwrap());
        // An explicit clip skip is honoured.
        let skip1 = encode_prompt(&model, &mut runner, &tok, "", 1).unwrap();
        assert_eq!(skip1.data, model.encode_ids(&mut runner, &padded(&[], 0), 1).unwrap());
        assert_ne!(skip1.data, empty.data);

        // 80 tokens: two chunks (75 + 5), concatenated along the token axis.
        let prompt = vec!["cat"; 80].join(" ");
        let cat = tok.tokenize("cat");
        assert_eq!(cat.len(), 1);
        let long = encode_prompt(&model, &mut runner, &tok, &prompt, 0).unwrap();
        assert_eq!(long.shape(), [32, 154]);
        let first = model.encode_ids(&mut runner, &padded(&[cat[0]; 75], 0), 2).unwrap();
        let second = model.encode_ids(&mut runner, &padded(&[cat[0]; 5], 0), 2).unwrap();
        assert_eq!(long.data[..32 * 77], first[..]);
        assert_eq!(long.data[32 * 77..], second[..]);

        let e = encode_prompt(&model, &mut runner, &tok, "a cat", 4).unwrap_err();
        assert!(matches!(e, ClipError::ClipSkip { requested: 4, layers: 3, .. }), "{e}");
        let e = encode_prompt(&model, &mut runner, &tok, "(cat:.)", 0).unwrap_err();
        assert!(matches!(e, ClipError::Tokenize(_)), "{e}");
    }

    #[test]
    fn weighted_prompt_scales_its_tokens_and_keeps_the_mean() {
        let backend = backend();
        let mut runner = Runner::new("clip", backend.clone());
        let tok = ClipTokenizer::new();
        let cfg = tiny(Activation::QuickGelu, 1, EOS_ID);
        let model = model(&cfg, GgmlType::GGML_TYPE_F32, &backend);

        let weighted = encode_prompt(&model, &mut runner, &tok, "a (red:1.5) cat", 0).unwrap();
        let plain = encode_prompt(&model, &mut runner, &tok, "a red cat", 0).unwrap();
        let body: Vec<u32> = ["a", "red", "cat"].iter().flat_map(|w| tok.tokenize(w)).collect();
        assert_eq!(body.len(), 3);
        let raw = model.encode_ids(&mut runner, &padded(&body, EOS_ID), 1).unwrap();
        // Same ids, so the unweighted prompt is the raw encoder output.
        assert_eq!(plain.data, raw);

        // In f64: token 2 ("red") times 1.5, then everything times mean(raw) / mean(weighted).
        let h = cfg.hidden_size;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let raw64: Vec<f64> = raw.iter().map(|&v| v as f64).collect();
        let mut scaled = raw64.clone();
        scaled[2 * h..3 * h].iter_mut().for_each(|v| *v *= 1.5);
        let factor = mean(&raw64) / mean(&scaled);
        for (i, (&got, want)) in weighted.data.iter().zip(scaled.iter().map(|v| v * factor)).enumerate() {
            assert!((got as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "value {i}: {got} vs {want}");
        }
        let got64: Vec<f64> = weighted.data.iter().map(|&v| v as f64).collect();
        assert!((mean(&got64) - mean(&raw64)).abs() < 1e-6);
    }
}
