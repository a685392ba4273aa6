//! Encoder chunks: BOS, up to `chunk_len - 2` tokens, EOS, padding, with one weight per id.

use super::tokenizer::{BOS_ID, EOS_ID};
use super::TokenizeError;

/// How token ids are laid out for one text encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkConfig {
    /// Ids per chunk, BOS and EOS included: the encoder's context length (77 for CLIP).
    pub chunk_len: usize,
    /// Id that fills a chunk after its EOS.
    pub pad_id: u32,
}

impl ChunkConfig {
    /// CLIP ViT-L/14 of SD 1.x (and SDXL's first encoder): padding with EOS (49407).
    pub const fn sd1() -> Self {
        Self { chunk_len: 77, pad_id: EOS_ID }
    }

    /// OpenCLIP ViT-H/14 of SD 2.x: padding with id 0 (the reference builds this tokenizer
    /// with pad id 0 for SD 2.x versions only).
    pub const fn sd2() -> Self {
        Self { chunk_len: 77, pad_id: 0 }
    }

    /// Tokens a chunk holds besides BOS and EOS (75 for CLIP); also the `BREAK` period.
    pub(crate) fn body_len(&self) -> Result<usize, TokenizeError> {
        match self.chunk_len.checked_sub(2) {
            Some(body) if body > 0 => Ok(body),
            _ => Err(TokenizeError::ChunkTooShort(self.chunk_len)),
        }
    }
}

/// One encoder input: `chunk_len` ids and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Lays `ids` (with `weights`, same length) out in chunks: one chunk when they fit, otherwise
/// one per `chunk_len - 2` tokens. `cfg` must have passed [`ChunkConfig::body_len`].
pub(crate) fn build_chunks(ids: &[u32], weights: &[f32], cfg: &ChunkConfig) -> Vec<Chunk> {
    debug_assert_eq!(ids.len(), weights.len());
    let body = cfg.chunk_len.saturating_sub(2).max(1);
    let parts: Vec<(&[u32], &[f32])> =
        if ids.len() <= body { vec![(ids, weights)] } else { ids.chunks(body).zip(weights.chunks(body)).collect() };
    parts
        .into_iter()
        .map(|(part_ids, part_weights)| {
            let mut chunk =
                Chunk { ids: Vec::with_capacity(cfg.chunk_len), weights: Vec::with_capacity(cfg.chunk_len) };
            chunk.ids.push(BOS_ID);
            chunk.ids.extend_from_slice(part_ids);
            chunk.ids.push(EOS_ID);
            chunk.weights.push(1.0);
            chunk.weights.extend_from_slice(part_weights);
            chunk.weights.push(1.0);
            chunk.ids.resize(cfg.chunk_len, cfg.pad_id);
            chunk.weights.resize(cfg.chunk_len, 1.0);
            chunk
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_of_short_and_long_token_lists() {
        // Rule (reference pad_tokens with min = max = 77, overflow expanded): <= 75 tokens make
        // one chunk; more are cut every 75, each chunk BOS + part + EOS + padding.
        let cfg = ChunkConfig::sd2();
        let empty = build_chunks(&[], &[], &cfg);
        assert_eq!(empty.len(), 1);
        assert_eq!(&empty[0].ids[..3], &[BOS_ID, EOS_ID, 0]);
        assert_eq!(empty[0].ids.len(), 77);

        let ids: Vec<u32> = (1..=76).collect();
        let w = vec![2.0; 76];
        let chunks = build_chunks(&ids, &w, &cfg);
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].ids[76], EOS_ID);
        assert_eq!(chunks[0].ids[75], 75);
        assert_eq!(&chunks[1].ids[..4], &[BOS_ID, 76, EOS_ID, 0]);
        assert_eq!(&chunks[1].weights[..4], &[1.0, 2.0, 1.0, 1.0]);
        assert!(chunks.iter().all(|c| c.ids.len() == 77 && c.weights.len() == 77));
    }

    #[test]
    fn too_short_chunks_are_rejected() {
        for len in [0, 1, 2] {
            let cfg = ChunkConfig { chunk_len: len, pad_id: 0 };
            assert_eq!(cfg.body_len(), Err(TokenizeError::ChunkTooShort(len)));
        }
        assert_eq!(ChunkConfig { chunk_len: 3, pad_id: 0 }.body_len(), Ok(1));
    }
}
