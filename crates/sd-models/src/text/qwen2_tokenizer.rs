//! Qwen2's byte-level BPE tokenizer (Qwen2.5, Qwen3) as stable-diffusion.cpp runs it.
//!
//! The LLM text encoders of Z-Image and FLUX.2 klein (Qwen3) read these ids. Each step is the
//! reference's (`src/tokenizers/qwen2_tokenizer.cpp`, `bpe_tokenizer.cpp`,
//! `tokenize_util.cpp` of the pinned sd.cpp), including where it departs from Hugging Face's
//! tokenizer:
//! 1. the 31 special tokens (`<|endoftext|>` 151643, `<|im_start|>` 151644, ...) are cut out of
//!    the raw text, leftmost first (case-sensitive), and map to their ids;
//! 2. the rest is pre-tokenized by a hand-written version of Qwen2's pattern
//!    `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!    with the reference's rules: `\p{L}` is its own table of ranges (`data/qwen2_letters.txt`),
//!    `\p{N}` is an ASCII digit, a contraction is lowercased (`'S` gives the piece `'s`) and
//!    `'d` never is one, a whitespace run takes everything [`is_unicode_space`] says up to the
//!    first non-newline after a newline, which it keeps *and* leaves for the next piece (so
//!    `"\n a"` gives `"\n "` and `" a"`), and `\s` elsewhere is C's `isspace`. One departure
//!    from the reference: it calls `isspace` on code points above 255, which reads past the C
//!    library's table, so whether such a character (punctuation, symbols, variation selectors;
//!    never a letter or digit) counts as a space depends on the C library's memory layout; where
//!    it does, the reference drops the character (U+FE0F after an emoji, with Debian's glibc
//!    2.36). We take none of them as spaces and keep them, as Hugging Face's tokenizer does;
//! 3. each piece's UTF-8 bytes go through GPT-2's byte-to-unicode table and are merged by rank
//!    (`data/qwen2_merges.txt.gz`; ids: 256 bytes, then one per merge, then the specials).
//!
//! No normalisation (no NFC), no BOS or EOS: the chat template of each family supplies
//! `<|im_start|>` and friends as text, see [`ChatTemplate`].

use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, OnceLock};

use flate2::read::GzDecoder;

use super::prompt::{parse_prompt_attention, PromptFragment};
use super::tokenizer::{bytes_to_unicode, merge_symbols};
use super::TokenizeError;

/// Qwen2's merges, as stable-diffusion.cpp embeds them (see data/README.md).
static EMBEDDED_MERGES_GZ: &[u8] = include_bytes!("../../data/qwen2_merges.txt.gz");
/// The reference's `\p{L}` ranges, `<first hex> <last hex>` per line, sorted and disjoint.
static LETTER_RANGES: &str = include_str!("../../data/qwen2_letters.txt");

/// Number of merges in Qwen2's vocabulary.
const MERGE_COUNT: usize = 151_387;
/// `<|endoftext|>`: the reference's UNK, EOS and padding id.
pub const QWEN2_ENDOFTEXT_ID: u32 = 151_643;
/// Number of ids: 256 bytes, 151387 merges, 31 special tokens. (The model's embedding table
/// has more rows, 151936 in Qwen3; the rest are never produced.)
pub const QWEN2_VOCAB_SIZE: usize = 151_674;

/// The special tokens in id order from [`QWEN2_ENDOFTEXT_ID`], as the reference lists them.
const SPECIAL_TOKENS: [&str; 31] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|boi_token|>",
    "<|bor_token|>",
    "<|eor_token|>",
    "<|bot_token|>",
    "<|tms_token|>",
];

/// The text a family's conditioner puts around the user's prompt before the LLM reads it.
/// The prefix and suffix are tokenized on their own, with weight 1; the prompt in between
/// keeps its weighting syntax (`(word:1.2)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatTemplate {
    pub prefix: &'static str,
    pub suffix: &'static str,
}

impl ChatTemplate {
    /// Z-Image (Turbo and base) without reference images: a user turn and an open assistant
    /// turn (the reference's `LLMEmbedder::get_learned_condition`, `sd_version_is_z_image`).
    pub const Z_IMAGE: ChatTemplate =
        ChatTemplate { prefix: "<|im_start|>user\n", suffix: "<|im_end|>\n<|im_start|>assistant\n" };

    /// FLUX.2 dev (Mistral's tokenizer): its system prompt and `[INST]`, then `[/INST]` (the
    /// reference's `VERSION_FLUX2` template; the tokenizer adds BOS).
    pub const FLUX2_DEV: ChatTemplate = ChatTemplate {
        prefix: "[SYSTEM_PROMPT]You are an AI that reasons about image descriptions. You give structured responses \
                 focusing on object relationships, object\nattribution and actions without speculation.[/SYSTEM_PROMPT][INST]",
        suffix: "[/INST]",
    };

    /// FLUX.2 klein: a user turn, then an assistant turn with an empty thinking block (the
    /// reference's `VERSION_FLUX2_KLEIN` template).
    pub const FLUX2_KLEIN: ChatTemplate = ChatTemplate {
        prefix: "<|im_start|>user\n",
        suffix: "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    };
}

/// The Qwen2 tokenizer. Cloning is cheap: the parsed vocabulary is shared.
#[derive(Clone)]
pub struct Qwen2Tokenizer {
    vocab: Arc<Vocab>,
}

impl std::fmt::Debug for Qwen2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen2Tokenizer").field("vocab_size", &self.vocab.tokens.len()).finish()
    }
}

/// A byte-level BPE vocabulary as the reference's `BPETokenizer` runs it: Qwen2's (ids built
/// from the merges) or one read from a token list (Mistral's, `super::mistral_tokenizer`).
pub(super) struct Vocab {
    /// Token strings in byte-to-unicode form (the specials as themselves), indexed by id.
    pub(super) tokens: Vec<String>,
    /// The special tokens in the reference's list order, with their ids.
    specials: Vec<(String, u32)>,
    /// Id of each byte as a one-byte symbol.
    byte_id: [u32; 256],
    /// (left id, right id) -> (rank, id of the merged symbol).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Sorted, disjoint `\p{L}` ranges.
    letters: Vec<(u32, u32)>,
}

impl Default for Qwen2Tokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Qwen2Tokenizer {
    /// The tokenizer over the embedded vocabulary, parsed on first use and then shared.
    pub fn new() -> Self {
        static SHARED: OnceLock<Arc<Vocab>> = OnceLock::new();
        let vocab = SHARED.get_or_init(|| {
            let vocab = Vocab::qwen2(EMBEDDED_MERGES_GZ)
                .unwrap_or_else(|e| panic!("embedded Qwen2 vocabulary is corrupt (a build bug): {e}"));
            tracing::debug!(ids = vocab.tokens.len(), merges = vocab.merges.len(), "Qwen2 vocabulary loaded");
            Arc::new(vocab)
        });
        Self { vocab: Arc::clone(vocab) }
    }

    /// Number of token ids (151674).
    pub fn vocab_size(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// Token ids of `text` (the reference's `encode`): special tokens, pre-tokenization and
    /// BPE, no weighting syntax, nothing added.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.vocab.encode(text)
    }

    /// The ids and per-token weights the LLM reads for `prompt` in `template`: the prefix, each
    /// fragment of the prompt's weighting syntax and the suffix, each encoded on its own (so no
    /// BPE piece crosses them). A `BREAK` is the text `BREAK` with weight -1, as in the
    /// reference (its LLM conditioner has no chunks to break).
    pub fn tokenize_chat(&self, template: &ChatTemplate, prompt: &str) -> Result<(Vec<u32>, Vec<f32>), TokenizeError> {
        self.vocab.tokenize_chat(template, prompt)
    }

    /// The vocabulary string of `id` (bytes in GPT-2's byte-to-unicode form, a special token as
    /// itself), what the reference's debug log prints; `None` for an unknown id.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }
}

/// The text of a gzip-compressed data file.
pub(super) fn gunzip(what: &str, gz: &[u8]) -> Result<String, String> {
    let mut text = String::new();
    GzDecoder::new(gz).read_to_string(&mut text).map_err(|e| format!("{what}: {e}"))?;
    Ok(text)
}

/// The `left right` merge lines of `text`; the reference keeps the lines that end in a newline.
pub(super) fn merge_lines(text: &str) -> Result<Vec<(&str, &str)>, String> {
    let lines: Vec<&str> = text.split('\n').collect();
    lines[..lines.len() - 1]
        .iter()
        .enumerate()
        .map(|(n, l)| l.split_once(' ').ok_or_else(|| format!("merge line {} has no space: {l:?}", n + 1)))
        .collect()
}

impl Vocab {
    /// Qwen2's vocabulary: the 256 bytes, one id per merge in file order, then the specials.
    fn qwen2(merges_gz: &[u8]) -> Result<Self, String> {
        let text = gunzip("merges", merges_gz)?;
        let merges = merge_lines(&text)?;
        if merges.len() != MERGE_COUNT {
            return Err(format!("{} merges found, {MERGE_COUNT} expected", merges.len()));
        }
        let byte_chars = bytes_to_unicode();
        let mut tokens: Vec<String> = Vec::with_capacity(QWEN2_VOCAB_SIZE);
        tokens.extend(byte_chars.iter().map(|(_, c)| c.to_string()));
        tokens.extend(merges.iter().map(|(a, b)| format!("{a}{b}")));
        tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
        if tokens.len() != QWEN2_VOCAB_SIZE || tokens[QWEN2_ENDOFTEXT_ID as usize] != SPECIAL_TOKENS[0] {
            return Err(format!("{} ids built, {QWEN2_VOCAB_SIZE} expected", tokens.len()));
        }
        let specials =
            SPECIAL_TOKENS.iter().enumerate().map(|(n, s)| (s.to_string(), QWEN2_ENDOFTEXT_ID + n as u32)).collect();
        Self::build(tokens, specials, &merges)
    }

    /// A vocabulary of `tokens` (indexed by id) with the reference's `specials` (in its list
    /// order; each must be a token) and `merges` (in rank order).
    pub(super) fn build(
        tokens: Vec<String>,
        specials: Vec<(String, u32)>,
        merges: &[(&str, &str)],
    ) -> Result<Self, String> {
        let byte_chars = bytes_to_unicode();
        // A string maps to its last index, as in the reference's map.
        let mut id_of: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            id_of.insert(t.as_str(), id as u32);
        }
        let mut byte_id = [0u32; 256];
        for &(byte, c) in &byte_chars {
            byte_id[byte as usize] =
                *id_of.get(c.to_string().as_str()).ok_or_else(|| format!("no token for the byte {byte:#04x}"))?;
        }
        if let Some((s, _)) = specials.iter().find(|(s, id)| tokens.get(*id as usize) != Some(s)) {
            return Err(format!("the special token {s:?} is not at its id"));
        }
        // A later duplicate of a pair replaces the earlier rank, as in the reference's map.
        let mut merge_map = HashMap::with_capacity(merges.len());
        for (rank, (a, b)) in merges.iter().enumerate() {
            // A merge whose result has no id can never give a token (the reference maps what
            // it builds to its unknown id); none of the shipped vocabularies has one.
            if let (Some(&l), Some(&r), Some(&merged)) =
                (id_of.get(a), id_of.get(b), id_of.get(format!("{a}{b}").as_str()))
            {
                merge_map.insert((l, r), (rank as u32, merged));
            }
        }
        let letters = LETTER_RANGES
            .lines()
            .map(|l| {
                let (a, b) = l.split_once(' ').ok_or_else(|| format!("letter range {l:?}"))?;
                let a = u32::from_str_radix(a, 16).map_err(|e| format!("letter range {l:?}: {e}"))?;
                let b = u32::from_str_radix(b, 16).map_err(|e| format!("letter range {l:?}: {e}"))?;
                Ok((a, b))
            })
            .collect::<Result<Vec<_>, String>>()?;
        if letters.windows(2).any(|w| w[0].1 >= w[1].0) || letters.iter().any(|&(a, b)| a > b) {
            return Err("letter ranges are not sorted and disjoint".into());
        }
        Ok(Self { tokens, specials, byte_id, merges: merge_map, letters })
    }

    /// Token ids of `text` (the reference's `encode`): special tokens, pre-tokenization and
    /// BPE, no weighting syntax, nothing added.
    pub(super) fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            // Leftmost special token; at one position, the first in the list.
            let hit = self
                .specials
                .iter()
                .enumerate()
                .filter_map(|(n, (s, id))| rest.find(s.as_str()).map(|at| (at, n, s.len(), *id)))
                .min_by_key(|&(at, n, _, _)| (at, n));
            let (text_part, special) = match hit {
                Some((at, _, len, id)) => {
                    let part = &rest[..at];
                    rest = &rest[at + len..];
                    (part, Some(id))
                }
                None => (std::mem::take(&mut rest), None),
            };
            for piece in self.pre_tokenize(text_part) {
                let sym: Vec<u32> = piece.bytes().map(|b| self.byte_id[b as usize]).collect();
                merge_symbols(&self.merges, sym, &mut ids);
            }
            ids.extend(special);
        }
        ids
    }

    /// The ids and per-token weights of `prompt` in `template` (see
    /// [`Qwen2Tokenizer::tokenize_chat`]).
    pub(super) fn tokenize_chat(
        &self,
        template: &ChatTemplate,
        prompt: &str,
    ) -> Result<(Vec<u32>, Vec<f32>), TokenizeError> {
        let mut parts: Vec<(String, f32)> = vec![(template.prefix.to_owned(), 1.0)];
        for fragment in parse_prompt_attention(prompt)? {
            parts.push(match fragment {
                PromptFragment::Break => ("BREAK".to_owned(), -1.0),
                PromptFragment::Text { text, weight } => (text, weight),
            });
        }
        parts.push((template.suffix.to_owned(), 1.0));
        let mut ids = Vec::new();
        let mut weights = Vec::new();
        for (text, weight) in parts {
            let start = ids.len();
            ids.extend(self.encode(&text));
            weights.resize(weights.len() + (ids.len() - start), weight);
        }
        Ok((ids, weights))
    }

    fn is_letter(&self, c: char) -> bool {
        let c = c as u32;
        let i = self.letters.partition_point(|&(_, last)| last < c);
        self.letters.get(i).is_some_and(|&(first, _)| first <= c)
    }

    /// The reference's `token_split`: the pieces of `text`, in order (see the module doc).
    fn pre_tokenize<'t>(&self, text: &'t str) -> Vec<std::borrow::Cow<'t, str>> {
        use std::borrow::Cow;
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let n = chars.len();
        let at = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
        let slice = |i: usize, j: usize| Cow::Borrowed(&text[at(i)..at(j)]);
        let letter = |i: usize| i < n && self.is_letter(chars[i].1);
        let number = |i: usize| i < n && chars[i].1.is_ascii_digit();
        // `[^\s\p{L}\p{N}]` with C's isspace for `\s`.
        let other =
            |i: usize| i < n && !self.is_letter(chars[i].1) && !chars[i].1.is_ascii_digit() && !c_isspace(chars[i].1);
        let newline = |i: usize| i < n && matches!(chars[i].1, '\r' | '\n');
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < n {
            let c = chars[i].1;
            // `(?i:'s|'t|'re|'ve|'m|'ll|'d)`, lowercased, `'d` never matching.
            if c == '\'' && i + 1 < n {
                let mut next = ascii_lower(chars[i + 1].1);
                if matches!(next.as_str(), "s" | "t" | "m") {
                    pieces.push(Cow::Owned(format!("'{next}")));
                    i += 2;
                    continue;
                }
                if i + 2 < n {
                    next.push_str(&ascii_lower(chars[i + 2].1));
                    if matches!(next.as_str(), "re" | "ve" | "ll" | "d") {
                        pieces.push(Cow::Owned(format!("'{next}")));
                        i += 3;
                        continue;
                    }
                }
            }
            // `\p{N}`
            if number(i) {
                pieces.push(slice(i, i + 1));
                i += 1;
                continue;
            }
            // `[^\r\n\p{L}\p{N}]?\p{L}+`
            if !letter(i) && c != '\r' && c != '\n' && letter(i + 1) {
                let start = i;
                i += 1;
                while letter(i) {
                    i += 1;
                }
                pieces.push(slice(start, i));
                continue;
            }
            if letter(i) {
                let start = i;
                while letter(i) {
                    i += 1;
                }
                pieces.push(slice(start, i));
                continue;
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            if (c == ' ' && other(i + 1)) || other(i) {
                let start = i;
                i += if other(i) { 1 } else { 2 };
                while other(i) {
                    i += 1;
                }
                while newline(i) {
                    i += 1;
                }
                pieces.push(slice(start, i));
                continue;
            }
            // `\s*[\r\n]+|\s+(?!\S)|\s+`: a run of spaces; after a newline, the first other
            // space ends it and is kept in it, and also starts the next piece.
            if is_unicode_space(c) {
                let mut piece = String::new();
                let mut saw_newline = false;
                while i < n && is_unicode_space(chars[i].1) {
                    let ch = chars[i].1;
                    piece.push(ch);
                    if ch == '\r' || ch == '\n' {
                        saw_newline = true;
                    } else if saw_newline {
                        break;
                    }
                    i += 1;
                }
                pieces.push(Cow::Owned(piece));
                continue;
            }
            i += 1; // nothing matches: skipped, as in the reference
        }
        pieces
    }
}

/// C's `isspace` in the C locale: `\t \n \v \f \r` and space. (The reference also calls it
/// on code points above 255, which reads past the C library's table; we take those as not
/// spaces.)
fn c_isspace(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\u{b}' | '\u{c}' | '\r' | ' ')
}

/// The reference's `is_space`: ASCII whitespace and the Unicode space separators it lists.
fn is_unicode_space(c: char) -> bool {
    matches!(
        c as u32,
        0x09..=0x0D | 0x20 | 0xA0 | 0x1680 | 0x2000..=0x200A | 0x202F | 0x205F | 0x3000
    )
}

/// One character as UTF-8 with ASCII letters lowercased (`tolower` per byte, C locale).
fn ascii_lower(c: char) -> String {
    c.to_ascii_lowercase().to_string()
}

#[cfg(test)]
pub(super) mod tests;
