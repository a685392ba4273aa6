//! Mistral's byte-level BPE tokenizer (Mistral-Small-3.2, FLUX.2 dev's text encoder) as
//! stable-diffusion.cpp runs it (`src/tokenizers/mistral_tokenizer.cpp` of the pinned sd.cpp):
//! the machinery of [`super::Qwen2Tokenizer`] (its special-token cutting, its pre-tokenizer,
//! byte-to-unicode symbols merged by rank) over Mistral's own tables:
//! - the ids are the 131072 tokens of `data/mistral_vocab.txt.gz` in id order (0-999 the
//!   special tokens, 1000-1255 the bytes, then the merged tokens), not derived from the merges;
//! - the merges are `data/mistral_merges.txt.gz` (269443, in rank order);
//! - the special tokens cut out of the text are the reference's list: `<unk>`, `<s>`, `</s>`,
//!   `[INST]`, `[/INST]`, ..., `[SYSTEM_PROMPT]`, `[/SYSTEM_PROMPT]`, `[TOOL_CONTENT]`, then
//!   `<SPECIAL_20>` to `<SPECIAL_999>`;
//! - a sequence starts with BOS `<s>` (1), weight 1 (the reference's `add_bos_token` in its
//!   `pad_tokens`), and is not padded.

use std::sync::{Arc, OnceLock};

use super::qwen2_tokenizer::{gunzip, merge_lines, Vocab};
use super::{ChatTemplate, TokenizeError};

/// Mistral's token list in id order, one per line (see data/README.md).
static EMBEDDED_VOCAB_GZ: &[u8] = include_bytes!("../../data/mistral_vocab.txt.gz");
/// Mistral's merges in rank order (see data/README.md).
static EMBEDDED_MERGES_GZ: &[u8] = include_bytes!("../../data/mistral_merges.txt.gz");

/// Number of ids.
pub const MISTRAL_VOCAB_SIZE: usize = 131_072;
/// Number of merges.
const MERGE_COUNT: usize = 269_443;
/// `<s>`, which starts every sequence.
pub const MISTRAL_BOS_ID: u32 = 1;

/// The named special tokens, in the reference's list order (`<SPECIAL_20>`.. follow them).
const NAMED_SPECIALS: [&str; 20] = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
];

/// The Mistral tokenizer. Cloning is cheap: the parsed vocabulary is shared.
#[derive(Clone)]
pub struct MistralTokenizer {
    vocab: Arc<Vocab>,
}

impl std::fmt::Debug for MistralTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MistralTokenizer").field("vocab_size", &self.vocab.tokens.len()).finish()
    }
}

impl Default for MistralTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

fn parse() -> Result<Vocab, String> {
    let text = gunzip("vocabulary", EMBEDDED_VOCAB_GZ)?;
    let tokens: Vec<String> = text.split_terminator('\n').map(str::to_owned).collect();
    if tokens.len() != MISTRAL_VOCAB_SIZE {
        return Err(format!("{} tokens found, {MISTRAL_VOCAB_SIZE} expected", tokens.len()));
    }
    let merges_text = gunzip("merges", EMBEDDED_MERGES_GZ)?;
    let merges = merge_lines(&merges_text)?;
    if merges.len() != MERGE_COUNT {
        return Err(format!("{} merges found, {MERGE_COUNT} expected", merges.len()));
    }
    // The named specials are ids 0-19, `<SPECIAL_n>` id n.
    let specials = NAMED_SPECIALS
        .iter()
        .map(|s| s.to_string())
        .chain((20..1000).map(|n| format!("<SPECIAL_{n}>")))
        .enumerate()
        .map(|(id, s)| (s, id as u32))
        .collect();
    Vocab::build(tokens, specials, &merges)
}

impl MistralTokenizer {
    /// The tokenizer over the embedded vocabulary, parsed on first use and then shared.
    pub fn new() -> Self {
        static SHARED: OnceLock<Arc<Vocab>> = OnceLock::new();
        let vocab = SHARED.get_or_init(|| {
            let vocab = parse().unwrap_or_else(|e| panic!("embedded Mistral vocabulary is corrupt (a build bug): {e}"));
            tracing::debug!(ids = vocab.tokens.len(), "Mistral vocabulary loaded");
            Arc::new(vocab)
        });
        Self { vocab: Arc::clone(vocab) }
    }

    /// Number of token ids (131072).
    pub fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// Token ids of `text` (the reference's `encode`): special tokens, pre-tokenization and
    /// BPE, no weighting syntax, nothing added.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.vocab.encode(text)
    }

    /// The ids and per-token weights the LLM reads for `prompt` in `template`: BOS, then the
    /// prefix, each fragment of the prompt's weighting syntax and the suffix, each encoded on
    /// its own (as [`super::Qwen2Tokenizer::tokenize_chat`]).
    pub fn tokenize_chat(&self, template: &ChatTemplate, prompt: &str) -> Result<(Vec<u32>, Vec<f32>), TokenizeError> {
        let (ids, weights) = self.vocab.tokenize_chat(template, prompt)?;
        Ok(([MISTRAL_BOS_ID].into_iter().chain(ids).collect(), [1.0].into_iter().chain(weights).collect()))
    }

    /// The vocabulary string of `id` (bytes in GPT-2's byte-to-unicode form, a special token as
    /// itself); `None` for an unknown id.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference's own ids (`data/mistral_tokenizer_cases.json`, see data/README.md).
    const CASES: &str = include_str!("../../data/mistral_tokenizer_cases.json");

    #[derive(serde::Deserialize)]
    struct Case {
        prompt: String,
        ids: Vec<u32>,
        #[serde(default)]
        weights: Vec<f32>,
    }

    #[derive(serde::Deserialize)]
    struct Cases {
        raw: Vec<Case>,
        flux2: Vec<Case>,
    }

    use crate::text::qwen2_tokenizer::tests::reference_text;

    #[test]
    fn ids_equal_the_reference_tokenizer() {
        // Rule: MistralTokenizer::encode, on prompts written for the other tokenizers and on
        // Mistral's control tokens.
        let t = MistralTokenizer::new();
        let cases: Cases = serde_json::from_str(CASES).expect("mistral_tokenizer_cases.json parses");
        assert!(cases.raw.len() >= 100);
        for c in &cases.raw {
            assert_eq!(t.encode(&reference_text(&c.prompt)), c.ids, "prompt {:?}", c.prompt);
        }
    }

    #[test]
    fn flux2_dev_template_equals_the_reference_conditioner() {
        // Rule: LLMEmbedder for VERSION_FLUX2: BOS, the system prompt and [INST], each weighted
        // fragment, [/INST], each encoded alone.
        let t = MistralTokenizer::new();
        let cases: Cases = serde_json::from_str(CASES).expect("mistral_tokenizer_cases.json parses");
        assert_eq!(cases.flux2.len(), cases.raw.len());
        for c in &cases.flux2 {
            let (ids, weights) = t.tokenize_chat(&ChatTemplate::FLUX2_DEV, &reference_text(&c.prompt)).unwrap();
            assert_eq!(ids, c.ids, "prompt {:?}", c.prompt);
            assert_eq!(weights, c.weights, "prompt {:?}", c.prompt);
        }
    }

    /// The tables parse, the specials sit at their ids, and text around them is BPE-encoded
    /// into tokens that spell it again.
    #[test]
    fn specials_and_text_round_trip() {
        let t = MistralTokenizer::new();
        assert_eq!(t.vocab_size(), MISTRAL_VOCAB_SIZE);
        assert_eq!(t.token_text(17), Some("[SYSTEM_PROMPT]"));
        assert_eq!(t.token_text(999), Some("<SPECIAL_999>"));
        let ids = t.encode("[INST]a red fox[/INST]<SPECIAL_42>");
        assert_eq!((ids[0], ids[ids.len() - 2], ids[ids.len() - 1]), (3, 4, 42));
        let spelled: String = ids[1..ids.len() - 2].iter().map(|&i| t.token_text(i).unwrap()).collect();
        assert_eq!(spelled, "aĠredĠfox");
        assert!(ids[1..ids.len() - 2].iter().all(|&i| i >= 1000), "{ids:?}");
        let template = ChatTemplate { prefix: "[INST]", suffix: "[/INST]" };
        let (ids, weights) = t.tokenize_chat(&template, "a (fox:1.5)").unwrap();
        assert_eq!((ids[0], ids[1], *ids.last().unwrap()), (MISTRAL_BOS_ID, 3, 4));
        assert_eq!(ids.len(), weights.len());
        assert_eq!((weights[0], weights[ids.len() - 2]), (1.0, 1.5));
    }
}
