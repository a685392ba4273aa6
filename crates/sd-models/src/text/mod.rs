//! Text side of generation: the CLIP BPE tokenizer, prompt weighting and chunking.
//!
//! The goal is token-for-token agreement with stable-diffusion.cpp, so that the text encoder
//! sees exactly the ids and per-token weights the reference would feed it. Where the
//! reference departs from upstream CLIP or from A1111, we follow the reference and say so:
//!
//! - [`ClipTokenizer`] is CLIP's byte-level BPE (49408 ids, `</w>` end-of-word suffix) with
//!   the reference's text cleanup: ASCII whitespace collapsed, ASCII-only lowercasing, no
//!   ftfy or HTML unescaping, and a pre-tokenizer whose letter and digit classes are ASCII
//!   (the reference runs `std::regex` over bytes). For ASCII prompts this is upstream CLIP.
//! - [`parse_prompt_attention`] reads the A1111 weighting syntax (`(x)`, `(x:1.3)`, `[x]`,
//!   escapes, `BREAK`) with the reference's quirks, in `f32` like the reference.
//! - [`ClipTokenizer::tokenize_weighted`] turns a prompt into [`Chunk`]s of 77 ids (BOS, up to
//!   75 tokens, EOS, padding) with a weight per id, ready for the encoder; the pad id per
//!   model family lives in [`ChunkConfig`].
//!
//! - [`T5Tokenizer`] is T5's SentencePiece unigram tokenizer (`t5_tokenizer.rs`) as the
//!   reference runs it, with FLUX's 256-id chunks; [`t5`] is the T5 v1.1 encoder.
//! - [`Qwen2Tokenizer`] is Qwen2's byte-level BPE (`qwen2_tokenizer.rs`, the vocabulary in
//!   `data/qwen2_merges.txt.gz`) for the Qwen3 LLM encoder ([`qwen3`]), with each family's
//!   [`ChatTemplate`]. [`MistralTokenizer`] runs the same machinery over Mistral's tables
//!   (`mistral_tokenizer.rs`, `data/mistral_*.txt.gz`) for FLUX.2 dev's Mistral-Small-3.2, which
//!   [`qwen3`] runs as `LlmArch::Mistral`.
//! - `flux` is FLUX's conditioner: T5-XXL's hidden states and CLIP-L's pooled output.
//! - [`sdxl`] is SDXL's conditioner over CLIP ViT-L/14 and OpenCLIP ViT-bigG/14 (both in
//!   [`clip`]): concatenated hidden states and the ADM vector.
//!
//! The vocabulary is OpenAI CLIP's `bpe_simple_vocab_16e6.txt.gz`, embedded in the binary
//! (see `crates/sd-models/data/README.md` for its origin and license) and parsed once per
//! process. Textual-inversion embeddings and LoRA tags are not handled here.

mod chunk;
pub mod clip;
pub mod conditioning;
pub(crate) mod flux;
mod mistral_tokenizer;
mod prompt;
mod qwen2_tokenizer;
pub mod qwen3;
pub mod sdxl;
pub mod t5;
mod t5_tokenizer;
mod tokenizer;

pub(crate) use chunk::build_chunks;
pub use chunk::{Chunk, ChunkConfig};
pub use mistral_tokenizer::{MistralTokenizer, MISTRAL_BOS_ID, MISTRAL_VOCAB_SIZE};
pub use prompt::{parse_prompt_attention, PromptFragment};
pub use qwen2_tokenizer::{ChatTemplate, Qwen2Tokenizer, QWEN2_ENDOFTEXT_ID, QWEN2_VOCAB_SIZE};
pub use t5_tokenizer::{T5Tokenizer, FLUX_T5_CHUNK_LEN, T5_EOS_ID, T5_PAD_ID, T5_UNK_ID, T5_VOCAB_PIECES};
pub use tokenizer::{ClipTokenizer, BOS_ID, EOS_ID, VOCAB_SIZE};

/// Why a prompt could not be turned into encoder input.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum TokenizeError {
    /// `(text:W)` where `W` holds no number (the reference aborts on these).
    #[error(
        "prompt weight `{weight}` at byte {offset} is not a number; \
         write a weight like `(word:1.2)` or escape the bracket as `\\(`"
    )]
    InvalidWeight { weight: String, offset: usize },
    /// `(text:W)` where `W` does not fit a normal `f32` (the reference aborts on these).
    #[error(
        "prompt weight `{weight}` at byte {offset} is out of range; \
         weights must be normal f32 numbers such as 0.5 or 1.3"
    )]
    WeightOutOfRange { weight: String, offset: usize },
    /// Brackets nested deeper than `prompt::MAX_NESTING` (each level multiplies a weight by 1.1 or
    /// 1/1.1: 5000 levels make an infinite weight).
    #[error("prompt brackets nest deeper than {max} levels at byte {offset}; escape a literal bracket as `\\(`")]
    NestingTooDeep { offset: usize, max: usize },
    /// A fragment whose weight (the product of its brackets' factors) is not finite or beyond
    /// `prompt::MAX_WEIGHT` in magnitude.
    #[error("prompt weight {weight:e} of `{text}` (the product of its brackets) is beyond {max} in magnitude")]
    WeightTooLarge { weight: f32, text: String, max: f32 },
    /// A [`ChunkConfig`] whose chunks cannot hold BOS, EOS and one token.
    #[error("chunk length {0} is too short: a chunk holds BOS, EOS and at least one token (3 or more)")]
    ChunkTooShort(usize),
    /// A T5 chunk length that cannot hold EOS and one token.
    #[error("T5 chunk length {0} is too short: a chunk holds EOS and at least one token (2 or more)")]
    T5ChunkTooShort(usize),
}

/// A parameter an encoder needs that its weights lack, or hold with another shape.
#[derive(Debug)]
pub(crate) enum SpecMismatch {
    /// Not in the weights.
    Missing(String),
    /// Another shape than the encoder's.
    Shape { name: String, expected: Vec<i64>, got: Vec<i64> },
}

/// The first of `wanted` that `weights` lacks or holds with another shape. A weight cut for a
/// row split is there as its chunks, with its whole shape declared.
pub(crate) fn first_mismatch(weights: &sd_sched::Weights, wanted: Vec<sd_sched::TensorSpec>) -> Option<SpecMismatch> {
    let have: std::collections::HashMap<&str, &sd_sched::TensorSpec> =
        weights.specs().iter().map(|s| (s.name.as_str(), s)).collect();
    for want in wanted {
        let got = match have.get(want.name.as_str()) {
            Some(got) => Some(got.ne.clone()),
            None if weights.is_row_split() => weights.declared_ne(&want.name),
            None => None,
        };
        match got {
            None => return Some(SpecMismatch::Missing(want.name)),
            Some(got) if got != want.ne => {
                return Some(SpecMismatch::Shape { name: want.name, expected: want.ne, got })
            }
            Some(_) => {}
        }
    }
    None
}

#[cfg(test)]
mod tests;
