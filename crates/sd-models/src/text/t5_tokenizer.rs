//! T5's SentencePiece unigram tokenizer, with stable-diffusion.cpp's text handling.
//!
//! The vocabulary is T5's 32100 pieces with their log-probability scores (32000 SentencePiece
//! pieces and the 100 `<extra_id_N>` sentinels), embedded from `data/t5_vocab.tsv.gz` (see
//! `crates/sd-models/data/README.md` for its origin and license). One piece of text goes
//! through these steps, each as the reference's `T5UniGramTokenizer` does it:
//!
//! 1. runs of two or more spaces become one (only U+0020; tabs and newlines are kept, and no
//!    NFKC normalisation is done: the reference leaves SentencePiece's normaliser out);
//! 2. the literal special tokens `<pad>`, `</s>` and `<unk>` are cut out and map to 0, 1, 2;
//! 3. each other segment is pre-tokenized: a U+2581 (`▁`) is put in front, and every space is
//!    replaced by `▁`, except that a trailing space is dropped (the reference splits on
//!    spaces with `std::getline`, which yields no empty last field);
//! 4. the segment is cut by Viterbi into the pieces of the highest total score (`f32` sums, the
//!    first best path kept on ties, candidates taken by start then by length); a character no
//!    piece starts with becomes `<unk>` (id 2) with the score of the lowest piece minus 10,
//!    one `<unk>` per character. Every piece of the vocabulary is a candidate, the special
//!    and sentinel pieces included (their score is 0).
//!
//! No EOS is added by [`T5Tokenizer::tokenize`]; FLUX's conditioner adds it per chunk
//! ([`T5Tokenizer::tokenize_weighted`]).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::sync::{Arc, OnceLock};

use flate2::read::GzDecoder;

use super::chunk::Chunk;
use super::prompt::parse_prompt_attention;
use super::TokenizeError;

/// `<pad>`: fills a chunk after its EOS.
pub const T5_PAD_ID: u32 = 0;
/// `</s>`: ends every chunk.
pub const T5_EOS_ID: u32 = 1;
/// `<unk>`: a character no piece covers.
pub const T5_UNK_ID: u32 = 2;
/// Pieces in the vocabulary (the encoder's embedding has 32128 rows; ids above 32099 are
/// never produced).
pub const T5_VOCAB_PIECES: usize = 32100;
/// Ids per chunk in FLUX's conditioner: 255 tokens and EOS.
pub const FLUX_T5_CHUNK_LEN: usize = 256;

/// The reference's penalty below the lowest piece score for an unknown character.
const UNK_PENALTY: f32 = 10.0;
const METASPACE: &str = "\u{2581}";
const SPECIAL_TOKENS: [(&str, u32); 3] = [("<pad>", T5_PAD_ID), ("</s>", T5_EOS_ID), ("<unk>", T5_UNK_ID)];
static EMBEDDED_VOCAB_GZ: &[u8] = include_bytes!("../../data/t5_vocab.tsv.gz");

/// The T5 tokenizer. Cloning is cheap: the parsed vocabulary is shared.
#[derive(Clone)]
pub struct T5Tokenizer {
    vocab: Arc<Vocab>,
}

impl std::fmt::Debug for T5Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("T5Tokenizer").field("pieces", &self.vocab.pieces.len()).finish()
    }
}

struct Vocab {
    /// Piece strings and scores, indexed by id.
    pieces: Vec<(String, f32)>,
    /// Piece bytes -> id.
    ids: HashMap<Vec<u8>, u32>,
    /// Longest piece, in bytes.
    max_len: usize,
    /// Lowest score of any piece.
    min_score: f32,
}

impl Vocab {
    fn from_tsv_gz(gz: &[u8]) -> Result<Self, String> {
        let reader = BufReader::new(GzDecoder::new(gz));
        let mut pieces = Vec::with_capacity(T5_VOCAB_PIECES);
        for (n, line) in reader.lines().enumerate() {
            let line = line.map_err(|e| format!("line {}: {e}", n + 1))?;
            let (score, piece) = line.split_once('\t').ok_or_else(|| format!("line {}: no tab", n + 1))?;
            // As the reference: the JSON number to double, then to float.
            let score: f64 = score.parse().map_err(|e| format!("line {}: score `{score}`: {e}", n + 1))?;
            if piece.is_empty() {
                return Err(format!("line {}: empty piece", n + 1));
            }
            pieces.push((piece.to_owned(), score as f32));
        }
        if pieces.len() != T5_VOCAB_PIECES {
            return Err(format!("{} pieces, expected {T5_VOCAB_PIECES}", pieces.len()));
        }
        let mut ids = HashMap::with_capacity(pieces.len());
        for (id, (piece, _)) in pieces.iter().enumerate() {
            if ids.insert(piece.as_bytes().to_vec(), id as u32).is_some() {
                return Err(format!("piece `{piece}` appears twice"));
            }
        }
        let max_len = pieces.iter().map(|(p, _)| p.len()).max().unwrap_or(0);
        let min_score = pieces.iter().map(|&(_, s)| s).fold(f32::MAX, f32::min);
        Ok(Self { pieces, ids, max_len, min_score })
    }

    /// Viterbi segmentation of one pre-tokenized segment into piece ids, appended to `out`.
    fn encode_segment(&self, text: &str, out: &mut Vec<u32>) {
        let bytes = text.as_bytes();
        let size = bytes.len();
        if size == 0 {
            return;
        }
        #[derive(Clone, Copy)]
        struct Node {
            id: u32,
            score: f32,
            /// Start of the last piece of the best path ending here; `None`: not reached yet.
            start: Option<usize>,
        }
        let unk_score = self.min_score - UNK_PENALTY;
        let mut best = vec![Node { id: T5_UNK_ID, score: 0.0, start: None }; size + 1];
        let offer = |best: &mut [Node], end: usize, start: usize, id: u32, score: f32| {
            let node = &mut best[end];
            if node.start.is_none() || score > node.score {
                *node = Node { id, score, start: Some(start) };
            }
        };
        let mut start = 0;
        while start < size {
            let here = best[start].score;
            let char_len = text[start..].chars().next().map_or(1, char::len_utf8);
            let mut has_single = false;
            for len in 1..=self.max_len.min(size - start) {
                if let Some(&id) = self.ids.get(&bytes[start..start + len]) {
                    offer(&mut best, start + len, start, id, self.pieces[id as usize].1 + here);
                    has_single |= len == char_len;
                }
            }
            if !has_single {
                offer(&mut best, start + char_len, start, T5_UNK_ID, unk_score + here);
            }
            start += char_len;
        }
        let first = out.len();
        let mut end = size;
        while end > 0 {
            let node = best[end];
            // Every character boundary is reached (a piece or `<unk>` ends there).
            let start = node.start.expect("Viterbi left a character boundary unreached");
            out.push(node.id);
            end = start;
        }
        out[first..].reverse();
    }
}

impl Default for T5Tokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl T5Tokenizer {
    /// The tokenizer over the embedded T5 vocabulary, parsed on first use and then shared.
    pub fn new() -> Self {
        static SHARED: OnceLock<Arc<Vocab>> = OnceLock::new();
        let vocab = SHARED.get_or_init(|| {
            let vocab = Vocab::from_tsv_gz(EMBEDDED_VOCAB_GZ)
                .unwrap_or_else(|e| panic!("embedded T5 vocabulary is corrupt (a build bug): {e}"));
            tracing::debug!(pieces = vocab.pieces.len(), "T5 vocabulary loaded");
            Arc::new(vocab)
        });
        Self { vocab: Arc::clone(vocab) }
    }

    /// Number of pieces (32100).
    pub fn vocab_size(&self) -> usize {
        self.vocab.pieces.len()
    }

    /// Token ids of `text` (the reference's `T5UniGramTokenizer::encode`): no EOS, no
    /// weighting syntax. An empty text is one `▁` (id 3), as in the reference.
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        let normalized = collapse_spaces(text);
        let mut ids = Vec::new();
        let segments = split_special(&normalized);
        if segments.is_empty() {
            self.vocab.encode_segment(&pre_tokenize(""), &mut ids);
        }
        for segment in segments {
            match segment {
                Segment::Special(id) => ids.push(id),
                Segment::Text(t) => self.vocab.encode_segment(&pre_tokenize(t), &mut ids),
            }
        }
        ids
    }

    /// What FLUX's conditioner feeds T5 for `prompt`: the weighting syntax parsed, each
    /// fragment tokenized on its own (so each starts with `▁`) with its weight, then cut into
    /// chunks of `chunk_len` ids: up to `chunk_len - 1` tokens, EOS, `<pad>` up to
    /// `chunk_len`, weight 1.0 on EOS and padding. A prompt of `chunk_len - 1` tokens or fewer
    /// is one chunk. `BREAK` is no break here: the reference encodes it as the text "BREAK"
    /// with weight -1.
    pub fn tokenize_weighted(&self, prompt: &str, chunk_len: usize) -> Result<Vec<Chunk>, TokenizeError> {
        if chunk_len < 2 {
            return Err(TokenizeError::T5ChunkTooShort(chunk_len));
        }
        let mut ids = Vec::new();
        let mut weights = Vec::new();
        for fragment in parse_prompt_attention(prompt)? {
            let (text, weight) = fragment.text_and_weight();
            let start = ids.len();
            ids.extend(self.tokenize(text));
            weights.resize(weights.len() + (ids.len() - start), weight);
        }
        let body = chunk_len - 1;
        let parts: Vec<(&[u32], &[f32])> = if ids.len() <= body {
            vec![(&ids, &weights)]
        } else {
            ids.chunks(body).zip(weights.chunks(body)).collect()
        };
        let chunks = parts
            .into_iter()
            .map(|(part_ids, part_weights)| {
                let mut chunk = Chunk { ids: Vec::with_capacity(chunk_len), weights: Vec::with_capacity(chunk_len) };
                chunk.ids.extend_from_slice(part_ids);
                chunk.ids.push(T5_EOS_ID);
                chunk.weights.extend_from_slice(part_weights);
                chunk.weights.push(1.0);
                chunk.ids.resize(chunk_len, T5_PAD_ID);
                chunk.weights.resize(chunk_len, 1.0);
                chunk
            })
            .collect::<Vec<_>>();
        tracing::debug!(tokens = ids.len(), chunks = chunks.len(), "T5 prompt tokenized");
        Ok(chunks)
    }

    /// The piece of `id` (with `▁` for spaces); `None` for an id outside the vocabulary.
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.vocab.pieces.get(id as usize).map(|(p, _)| p.as_str())
    }

    /// Text of `ids` for logs and tests: pad and EOS skipped, `▁` as a space, the leading
    /// space dropped; unknown ids are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut text = String::new();
        for &id in ids {
            if id == T5_PAD_ID || id == T5_EOS_ID {
                continue;
            }
            if let Some(p) = self.piece(id) {
                text.push_str(p);
            }
        }
        let text = text.replace(METASPACE, " ");
        text.strip_prefix(' ').map(str::to_owned).unwrap_or(text)
    }
}

/// Runs of two or more U+0020 become one (the reference's regex ` {2,}`).
fn collapse_spaces(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut prev_space = false;
    for c in text.chars() {
        if c == ' ' && prev_space {
            continue;
        }
        prev_space = c == ' ';
        out.push(c);
    }
    out
}

enum Segment<'a> {
    Special(u32),
    Text(&'a str),
}

/// Cuts the special tokens out of `text`, leftmost match first; an empty text gives nothing.
fn split_special(text: &str) -> Vec<Segment<'_>> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let next = SPECIAL_TOKENS
            .iter()
            .filter_map(|&(tok, id)| rest.find(tok).map(|pos| (pos, tok, id)))
            .min_by_key(|&(pos, _, _)| pos);
        match next {
            Some((pos, tok, id)) => {
                if pos > 0 {
                    out.push(Segment::Text(&rest[..pos]));
                }
                out.push(Segment::Special(id));
                rest = &rest[pos + tok.len()..];
            }
            None => {
                out.push(Segment::Text(rest));
                break;
            }
        }
    }
    out
}

/// The reference's Metaspace pre-tokenizer: `▁` first, then the space-separated fields joined
/// by `▁`, a trailing empty field dropped (as `std::getline` yields none).
fn pre_tokenize(text: &str) -> String {
    let mut fields: Vec<&str> = text.split(' ').collect();
    if fields.last() == Some(&"") {
        fields.pop();
    }
    let mut out = String::with_capacity(text.len() + 3 * (fields.len() + 1));
    out.push_str(METASPACE);
    out.push_str(&fields.join(METASPACE));
    out
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use sha2::{Digest, Sha256};

    use super::*;

    /// Ids computed by the reference's own tokenizer (data/gen_t5_tokenizer_cases.py).
    const CASES: &str = include_str!("../../data/t5_tokenizer_cases.json");

    #[derive(Deserialize)]
    struct Cases {
        flux_chunk_len: usize,
        raw: Vec<RawCase>,
        flux: Vec<FluxCase>,
    }

    #[derive(Deserialize)]
    struct RawCase {
        prompt: String,
        ids: Vec<u32>,
    }

    #[derive(Deserialize)]
    struct FluxCase {
        prompt: String,
        ids: Vec<u32>,
        weights: Vec<f32>,
    }

    fn cases() -> Cases {
        serde_json::from_str(CASES).expect("t5_tokenizer_cases.json parses")
    }

    #[test]
    fn ids_equal_the_reference_tokenizer() {
        // Rule: T5UniGramTokenizer::encode, on a corpus of ASCII, Unicode (unknown characters,
        // combining marks, CJK, emoji), whitespace runs, special and sentinel tokens, long text.
        let tok = T5Tokenizer::new();
        let cases = cases();
        assert!(cases.raw.len() >= 40);
        for c in &cases.raw {
            assert_eq!(tok.tokenize(&c.prompt), c.ids, "prompt {:?}", c.prompt);
        }
    }

    #[test]
    fn flux_chunks_equal_the_reference_conditioner() {
        // Rule: FluxCLIPEmbedder::tokenize: weights per fragment, each fragment encoded alone,
        // pad_tokens(256, 256, overflow expansion) with EOS and pad 0; BREAK is text, weight -1.
        let tok = T5Tokenizer::new();
        let cases = cases();
        assert_eq!(cases.flux_chunk_len, FLUX_T5_CHUNK_LEN);
        let mut multi_chunk = 0;
        for c in &cases.flux {
            let chunks = tok.tokenize_weighted(&c.prompt, FLUX_T5_CHUNK_LEN).unwrap();
            let ids: Vec<u32> = chunks.iter().flat_map(|ch| ch.ids.iter().copied()).collect();
            let weights: Vec<f32> = chunks.iter().flat_map(|ch| ch.weights.iter().copied()).collect();
            assert_eq!(ids, c.ids, "ids of {:?}", c.prompt);
            assert_eq!(weights, c.weights, "weights of {:?}", c.prompt);
            multi_chunk += usize::from(chunks.len() > 1);
        }
        assert!(multi_chunk >= 2, "the corpus must hold prompts longer than one chunk");
    }

    #[test]
    fn embedded_vocabulary_is_the_extracted_one() {
        // data/README.md records the file's digest; a changed file must change the record.
        let digest = Sha256::digest(EMBEDDED_VOCAB_GZ);
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "34b1ce2350891df1adacba3058ba1cb4560ab44633b2a01778c17680ec706586");
        let tok = T5Tokenizer::new();
        assert_eq!(tok.vocab_size(), T5_VOCAB_PIECES);
        assert_eq!(
            (tok.piece(T5_PAD_ID), tok.piece(T5_EOS_ID), tok.piece(T5_UNK_ID)),
            (Some("<pad>"), Some("</s>"), Some("<unk>"))
        );
        assert_eq!(tok.piece(32099), Some("<extra_id_0>"));
        assert_eq!(tok.piece(32100), None);
    }

    #[test]
    fn decode_inverts_known_pieces() {
        let tok = T5Tokenizer::new();
        let ids = tok.tokenize("a photo of a cat");
        assert_eq!(tok.decode(&ids), "a photo of a cat");
        assert_eq!(tok.decode(&[3, 9, 1, 0, 0]), "a");
    }

    #[test]
    fn short_chunks_are_an_error() {
        let tok = T5Tokenizer::new();
        for len in [0, 1] {
            assert_eq!(tok.tokenize_weighted("x", len), Err(TokenizeError::T5ChunkTooShort(len)));
        }
        let two = tok.tokenize_weighted("a b", 2).unwrap();
        assert!(two.iter().all(|c| c.ids.len() == 2 && c.ids[1] == T5_EOS_ID));
        assert!(matches!(tok.tokenize_weighted("(x:.)", 256), Err(TokenizeError::InvalidWeight { .. })));
    }

    #[test]
    fn pre_tokenizer_follows_getline() {
        // Rule: MetaspacePreTokenizer::tokenize with add_prefix_space (getline on ' ').
        for (input, want) in [
            ("", "▁"),
            (" ", "▁"),
            ("a", "▁a"),
            ("a ", "▁a"),
            (" a", "▁▁a"),
            ("a b", "▁a▁b"),
            ("a  b", "▁a▁▁b"),
            ("a\tb", "▁a\tb"),
        ] {
            assert_eq!(pre_tokenize(input), want, "{input:?}");
        }
    }

    #[test]
    fn spaces_collapse_but_other_whitespace_stays() {
        assert_eq!(collapse_spaces("a   b  c d"), "a b c d");
        assert_eq!(collapse_spaces("a\t\tb\n\n"), "a\t\tb\n\n");
    }

    #[test]
    fn special_tokens_are_cut_leftmost_first() {
        let segs = split_special("x</s><pad>y<unk>");
        let seen: Vec<String> = segs
            .iter()
            .map(|s| match s {
                Segment::Special(id) => format!("#{id}"),
                Segment::Text(t) => (*t).to_owned(),
            })
            .collect();
        assert_eq!(seen, ["x", "#1", "#0", "y", "#2"]);
        assert!(split_special("").is_empty());
    }
}
