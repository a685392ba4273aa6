//! SD3's conditioner: CLIP-L, CLIP-G and T5-XXL at once.
//!
//! The reference's `SD3CLIPEmbedder` (stable-diffusion.cpp `conditioning/conditioner.hpp`),
//! step for step:
//!
//! 1. The weighting syntax is parsed once; `BREAK` is no break here: every tokenizer reads it as
//!    the text "BREAK" with weight -1, as the reference does.
//! 2. CLIP's ids (one tokenizer for both CLIPs) are cut into chunks of 77 (BOS, up to 75 ids,
//!    EOS, then EOS padding for CLIP-L and 0 for CLIP-G); T5's into chunks of 77 (up to 76
//!    ids, EOS, `<pad>`). Weights of BOS, EOS and padding are 1.
//! 3. Per chunk: CLIP-L and CLIP-G at the clip skip (<= 0: 2; no final LayerNorm), T5 on its
//!    ids; each encoder's states get the chunk's token weights with their mean kept. CLIP-L's
//!    768 and CLIP-G's 1280 values of a token are joined and zero-padded to T5's 4096, and the
//!    77 CLIP rows are followed by T5's 77 rows: 154 tokens of 4096 per chunk, chunks joined.
//! 4. The vector: chunk 0's pooled CLIP-L (every layer, final LayerNorm, the state at the first
//!    EOS, no projection: the reference loads none for ViT-L) then pooled CLIP-G (the same,
//!    times `text_projection`): 2048 values.
//!
//! An absent encoder contributes zeros of its width, as in the reference. Where the encoders'
//! chunk counts differ (a prompt of more than 75 CLIP tokens whose T5 tokens fit fewer chunks,
//! or the reverse), the reference reads past the shorter token list; here that encoder's
//! missing chunks are zeros.

use std::sync::Arc;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};

use crate::text::clip::{clip_specs, ClipConfig, ClipEncoder, ClipError};
use crate::text::conditioning::{apply_token_weights, Conditioning};
use crate::text::t5::{t5_specs, T5Config, T5Encoder, T5Error};
use crate::text::{build_chunks, parse_prompt_attention, Chunk, ChunkConfig, ClipTokenizer, T5Tokenizer};
use crate::text::{TokenizeError, EOS_ID};

/// Ids per chunk of every encoder.
pub(crate) const CHUNK_LEN: usize = 77;
/// Width of the context: T5-XXL's `d_model`, to which the CLIP states are padded.
pub(crate) const CONTEXT_WIDTH: usize = 4096;
/// Width of CLIP-L's states and pooled output.
const CLIP_L_WIDTH: usize = 768;
/// Width of CLIP-G's states and pooled output.
const CLIP_G_WIDTH: usize = 1280;

/// Errors of SD3's conditioner.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Sd3TextError {
    /// The prompt's weighting syntax.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// CLIP-L or CLIP-G.
    #[error(transparent)]
    Clip(#[from] ClipError),
    /// T5-XXL.
    #[error(transparent)]
    T5(#[from] T5Error),
}

/// The present encoders' configurations.
#[derive(Clone, Debug)]
pub(crate) struct Encoders {
    pub clip_l: Option<ClipConfig>,
    pub clip_g: Option<ClipConfig>,
    pub t5: Option<T5Config>,
}

impl Encoders {
    /// The parameters of the present encoders (CLIP-L, CLIP-G, T5).
    pub(crate) fn specs(
        &self,
        dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
        wtype: Option<GgmlType>,
    ) -> Vec<TensorSpec> {
        let mut specs = Vec::new();
        for c in [&self.clip_l, &self.clip_g].into_iter().flatten() {
            specs.extend(clip_specs(c, dtype_of, wtype));
        }
        specs.extend(self.t5.iter().flat_map(|c| t5_specs(c, dtype_of, wtype)));
        specs
    }
}

/// Each encoder's chunks of one prompt.
pub(crate) struct Chunks {
    /// CLIP-L's (padded with EOS).
    pub l: Vec<Chunk>,
    /// CLIP-G's (the same ids, padded with 0).
    pub g: Vec<Chunk>,
    /// T5's.
    pub t5: Vec<Chunk>,
}

/// The CLIP chunks of `prompt` for each of the two pad ids (CLIP-L's EOS, CLIP-G's 0), and T5's.
pub(crate) fn tokenize(clip: &ClipTokenizer, t5: &T5Tokenizer, prompt: &str) -> Result<Chunks, TokenizeError> {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for fragment in parse_prompt_attention(prompt)? {
        let (text, weight) = fragment.text_and_weight();
        let start = ids.len();
        ids.extend(clip.tokenize(text));
        weights.resize(weights.len() + (ids.len() - start), weight);
    }
    let l = build_chunks(&ids, &weights, &ChunkConfig { chunk_len: CHUNK_LEN, pad_id: EOS_ID });
    let g = build_chunks(&ids, &weights, &ChunkConfig { chunk_len: CHUNK_LEN, pad_id: 0 });
    Ok(Chunks { l, g, t5: t5.tokenize_weighted(prompt, CHUNK_LEN)? })
}

/// The position of the first EOS in `ids` (the last position when there is none).
fn eos_index(ids: &[u32]) -> usize {
    ids.iter().position(|&id| id == EOS_ID).unwrap_or(ids.len()).min(ids.len().saturating_sub(1))
}

/// One CLIP's weighted states of `chunk` (zeros of `width` when the encoder or the chunk is
/// absent).
fn clip_states(
    clip: Option<&ClipEncoder<'_>>,
    runner: &mut Runner,
    chunk: Option<&Chunk>,
    skip: usize,
    width: usize,
) -> Result<Vec<f32>, Sd3TextError> {
    match (clip, chunk) {
        (Some(clip), Some(chunk)) => {
            let mut h = clip.encode_ids(runner, &chunk.ids, skip)?;
            apply_token_weights(&mut h, clip.config().hidden_size, &chunk.weights);
            Ok(h)
        }
        _ => Ok(vec![0.0; width * CHUNK_LEN]),
    }
}

/// SD3's encoders over one weight set (the `te` module), with their tokenizers.
#[derive(Debug)]
pub(crate) struct Sd3Text {
    pub encoders: Encoders,
    pub weights: Weights,
    pub clip_tokenizer: Arc<ClipTokenizer>,
    pub t5_tokenizer: T5Tokenizer,
}

impl Sd3Text {
    /// The conditioning of `prompt` at `clip_skip` (module docs).
    pub(crate) fn encode(
        &self,
        runner: &mut Runner,
        prompt: &str,
        clip_skip: i64,
    ) -> Result<Conditioning, Sd3TextError> {
        let e = &self.encoders;
        let clip_l = e.clip_l.as_ref().map(|c| ClipEncoder::new(c, &self.weights)).transpose()?;
        let clip_g = e.clip_g.as_ref().map(|c| ClipEncoder::new(c, &self.weights)).transpose()?;
        let t5 = e.t5.as_ref().map(|c| T5Encoder::new(c, &self.weights)).transpose()?;
        let skip_l = e.clip_l.as_ref().map(|c| c.resolve_clip_skip(clip_skip)).transpose()?.unwrap_or(2);
        let skip_g = e.clip_g.as_ref().map(|c| c.resolve_clip_skip(clip_skip)).transpose()?.unwrap_or(2);
        let Chunks { l: chunks_l, g: chunks_g, t5: chunks_t5 } =
            tokenize(&self.clip_tokenizer, &self.t5_tokenizer, prompt)?;
        let clips = clip_l.is_some() || clip_g.is_some();
        let n = if clips { chunks_l.len() } else { 0 }.max(if t5.is_some() { chunks_t5.len() } else { 0 }).max(1);
        let _span = tracing::debug_span!("encode_sd3", chunks = n).entered();

        let mut data = Vec::with_capacity(n * 2 * CHUNK_LEN * CONTEXT_WIDTH);
        for i in 0..n {
            let l = clip_states(clip_l.as_ref(), runner, chunks_l.get(i), skip_l, CLIP_L_WIDTH)?;
            let g = clip_states(clip_g.as_ref(), runner, chunks_g.get(i), skip_g, CLIP_G_WIDTH)?;
            let (wl, wg) = (l.len() / CHUNK_LEN, g.len() / CHUNK_LEN);
            for (tl, tg) in l.chunks_exact(wl).zip(g.chunks_exact(wg)) {
                data.extend_from_slice(tl);
                data.extend_from_slice(tg);
                data.resize(data.len() + CONTEXT_WIDTH.saturating_sub(wl + wg), 0.0);
            }
            match (&t5, chunks_t5.get(i)) {
                (Some(t5), Some(chunk)) => {
                    let mut h = t5.encode_ids(runner, &chunk.ids, chunk.ids.len())?;
                    apply_token_weights(&mut h, t5.config().d_model, &chunk.weights);
                    data.extend(h);
                }
                _ => data.resize(data.len() + CHUNK_LEN * CONTEXT_WIDTH, 0.0),
            }
        }
        let mut vector = match (&clip_l, chunks_l.first()) {
            (Some(c), Some(chunk)) => c.encode_pooled(runner, &chunk.ids, eos_index(&chunk.ids))?,
            _ => vec![0.0; CLIP_L_WIDTH],
        };
        vector.extend(match (&clip_g, chunks_g.first()) {
            (Some(c), Some(chunk)) => c.encode_pooled(runner, &chunk.ids, eos_index(&chunk.ids))?,
            _ => vec![0.0; CLIP_G_WIDTH],
        });
        let n_tokens = data.len() / CONTEXT_WIDTH;
        tracing::debug!(tokens = n_tokens, vector = vector.len(), "SD3 prompt encoded");
        Ok(Conditioning::tokens(data, CONTEXT_WIDTH, n_tokens, vector))
    }
}
