//! FLUX.2 klein's conditioner (the reference's `LLMEmbedder` for `VERSION_FLUX2_KLEIN`): the
//! prompt in klein's chat template (a user turn, then an assistant turn with an empty thinking
//! block), the prompt's weighting syntax kept; the ids padded on the right to 512 with Qwen's
//! `<|endoftext|>` (151643, weight 1), which no token attends to; Qwen3's hidden states after
//! layers 9, 18 and 27 side by side per token; the token weights applied with the mean kept.
//! Every token is the context (the template and the padding included).
//!
//! FLUX.2 dev's (`VERSION_FLUX2`): BOS, the prompt between FLUX.2 dev's system prompt and
//! `[INST]` and a closing `[/INST]`, Mistral's tokenizer, no padding through the LLM;
//! Mistral-Small-3.2's hidden states after layers 10, 20 and 30 side by side, the token weights
//! applied, then zeros appended up to 512 tokens (the reference's `hidden_states_min_length`).

use sd_sched::{Runner, Weights};

use crate::pipeline::PipelineError;
use crate::text::conditioning::{apply_token_weights, Conditioning};
use crate::text::qwen3::{Qwen3Config, Qwen3Encoder};
use crate::text::{ChatTemplate, MistralTokenizer, Qwen2Tokenizer};

/// The LLM layers whose hidden states are the context (1-based; the reference's `{9, 18, 27}`).
pub(super) const OUT_LAYERS: [usize; 3] = [9, 18, 27];
/// The context is padded to at least this many tokens (the reference's `min_length`).
pub(super) const MIN_TOKENS: usize = 512;
/// Qwen's padding token, `<|endoftext|>`.
const PAD_ID: u32 = 151_643;
/// FLUX.2 dev: the Mistral layers whose hidden states are the context (1-based).
pub(super) const DEV_OUT_LAYERS: [usize; 3] = [10, 20, 30];

/// A failure of FLUX.2 klein's conditioner (loading or encoding), kept as the error's source.
pub(super) fn conditioner_error(e: impl std::error::Error + Send + Sync + 'static) -> PipelineError {
    PipelineError::Conditioner { what: "FLUX.2 klein text encoder (Qwen3)", source: Box::new(e) }
}

/// A failure of FLUX.2 dev's conditioner (loading or encoding), kept as the error's source.
pub(super) fn dev_conditioner_error(e: impl std::error::Error + Send + Sync + 'static) -> PipelineError {
    PipelineError::Conditioner { what: "FLUX.2 dev text encoder (Mistral-Small-3.2)", source: Box::new(e) }
}

/// FLUX.2 dev's conditioner: Mistral over its placed weights with Mistral's tokenizer.
pub(super) struct DevText {
    pub(super) cfg: Qwen3Config,
    pub(super) weights: Weights,
    pub(super) tokenizer: MistralTokenizer,
}

impl DevText {
    pub(super) fn encode(&self, runner: &mut Runner, prompt: &str) -> Result<Conditioning, PipelineError> {
        let encoder = Qwen3Encoder::new(&self.cfg, &self.weights).map_err(dev_conditioner_error)?;
        let (ids, weights) =
            self.tokenizer.tokenize_chat(&ChatTemplate::FLUX2_DEV, prompt).map_err(dev_conditioner_error)?;
        let mut data = encoder.encode(runner, &ids, None, &DEV_OUT_LAYERS).map_err(dev_conditioner_error)?;
        let hidden_size = DEV_OUT_LAYERS.len() * self.cfg.hidden;
        apply_token_weights(&mut data, hidden_size, &weights);
        let n_tokens = ids.len().max(MIN_TOKENS);
        data.resize(n_tokens * hidden_size, 0.0);
        tracing::debug!(tokens = ids.len(), hidden_size, "FLUX.2 dev prompt encoded");
        Ok(Conditioning::tokens(data, hidden_size, n_tokens, Vec::new()))
    }
}

/// The conditioner: Qwen3 over its placed weights with the Qwen2 tokenizer.
pub(super) struct KleinText {
    pub(super) cfg: Qwen3Config,
    pub(super) weights: Weights,
    pub(super) tokenizer: Qwen2Tokenizer,
}

/// Token ids, their weights, and the padding mask (1 text, 0 padding).
type Tokens = (Vec<u32>, Vec<f32>, Vec<f32>);

/// The ids, token weights and padding mask of `prompt`.
pub(super) fn tokenize(tokenizer: &Qwen2Tokenizer, prompt: &str) -> Result<Tokens, PipelineError> {
    let (mut ids, mut weights) =
        tokenizer.tokenize_chat(&ChatTemplate::FLUX2_KLEIN, prompt).map_err(conditioner_error)?;
    let mut real = vec![1.0; ids.len()];
    if ids.len() < MIN_TOKENS {
        ids.resize(MIN_TOKENS, PAD_ID);
        weights.resize(MIN_TOKENS, 1.0);
        real.resize(MIN_TOKENS, 0.0);
    }
    Ok((ids, weights, real))
}

impl KleinText {
    pub(super) fn encode(&self, runner: &mut Runner, prompt: &str) -> Result<Conditioning, PipelineError> {
        let encoder = Qwen3Encoder::new(&self.cfg, &self.weights).map_err(conditioner_error)?;
        let (ids, weights, real) = tokenize(&self.tokenizer, prompt)?;
        let mut data = encoder.encode(runner, &ids, Some(&real), &OUT_LAYERS).map_err(conditioner_error)?;
        let hidden_size = OUT_LAYERS.len() * self.cfg.hidden;
        apply_token_weights(&mut data, hidden_size, &weights);
        tracing::debug!(tokens = ids.len(), hidden_size, "FLUX.2 klein prompt encoded");
        Ok(Conditioning::tokens(data, hidden_size, ids.len(), Vec::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The template around the prompt, the weights kept, the padding to 512 marked.
    #[test]
    fn tokens_are_templated_and_padded() {
        let t = Qwen2Tokenizer::new();
        let (ids, weights, real) = tokenize(&t, "a (red:1.5) fox").unwrap();
        assert_eq!((ids.len(), weights.len(), real.len()), (MIN_TOKENS, MIN_TOKENS, MIN_TOKENS));
        let text = real.iter().filter(|&&r| r == 1.0).count();
        assert!(text > 10 && real[..text].iter().all(|&r| r == 1.0), "{text}");
        assert!(ids[text..].iter().all(|&i| i == PAD_ID));
        assert!(weights.contains(&1.5));
        let (plain, _) = t.tokenize_chat(&ChatTemplate::FLUX2_KLEIN, "a red fox").unwrap();
        assert_eq!(t.token_text(plain[0]), Some("<|im_start|>"));
        let long = "fox ".repeat(600);
        let (ids, _, real) = tokenize(&t, &long).unwrap();
        assert!(ids.len() > MIN_TOKENS && real.iter().all(|&r| r == 1.0));
    }

    /// FLUX.2 dev: BOS, the system prompt's special tokens, the weights of the prompt only.
    #[test]
    fn dev_template_is_mistrals() {
        let t = MistralTokenizer::new();
        let (ids, weights) = t.tokenize_chat(&ChatTemplate::FLUX2_DEV, "a (red:1.5) fox").unwrap();
        assert_eq!((ids[0], ids[1]), (crate::text::MISTRAL_BOS_ID, 17), "BOS, [SYSTEM_PROMPT]");
        assert_eq!(*ids.last().unwrap(), 4, "[/INST]");
        assert!(ids.contains(&18) && ids.contains(&3), "[/SYSTEM_PROMPT][INST]");
        assert_eq!(weights.iter().filter(|&&w| w == 1.5).count(), 1, "{weights:?}");
        assert!(ChatTemplate::FLUX2_DEV.prefix.contains("object\nattribution"));
    }
}
