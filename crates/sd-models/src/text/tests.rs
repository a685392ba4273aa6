//! Tokenizer tests against data/tokenizer_cases.json (made by data/gen_tokenizer_cases.py from
//! the upstream CLIP tokenizer and cross-checked against stable-diffusion.cpp's own code).

use proptest::prelude::*;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::*;

const CASES: &str = include_str!("../../data/tokenizer_cases.json");

#[derive(Deserialize)]
struct Cases {
    tokenize: Vec<PlainCase>,
    weighted: Vec<WeightedCase>,
}

#[derive(Deserialize)]
struct PlainCase {
    name: String,
    rule: String,
    prompt: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct WeightedCase {
    name: String,
    rule: String,
    prompt: String,
    parsed: Vec<(String, f64)>,
    sd1: Expected,
    sd2: Expected,
}

#[derive(Deserialize)]
struct Expected {
    ids: Vec<u32>,
    weights: Vec<f64>,
}

fn cases() -> Cases {
    serde_json::from_str(CASES).expect("data/tokenizer_cases.json parses")
}

#[test]
fn token_ids_match_the_reference() {
    let tok = ClipTokenizer::new();
    let cases = cases();
    assert!(cases.tokenize.len() >= 20);
    for case in &cases.tokenize {
        assert_eq!(tok.tokenize(&case.prompt), case.ids, "case {} ({}): {:?}", case.name, case.rule, case.prompt);
    }
}

#[test]
fn weighted_prompts_match_the_reference() {
    let tok = ClipTokenizer::new();
    let cases = cases();
    assert!(cases.weighted.len() >= 25);
    for case in &cases.weighted {
        let what = format!("case {} ({}): {:?}", case.name, case.rule, case.prompt);
        // The reference's representation: BREAK is the text "BREAK" with weight -1.
        let parsed: Vec<(String, f32)> = parse_prompt_attention(&case.prompt)
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .into_iter()
            .map(|f| match f {
                PromptFragment::Text { text, weight } => (text, weight),
                PromptFragment::Break => ("BREAK".to_string(), -1.0),
            })
            .collect();
        let expected: Vec<(String, f32)> = case.parsed.iter().map(|(t, w)| (t.clone(), *w as f32)).collect();
        assert_eq!(parsed, expected, "{what}");

        for (cfg, exp) in [(ChunkConfig::sd1(), &case.sd1), (ChunkConfig::sd2(), &case.sd2)] {
            let chunks = tok.tokenize_weighted(&case.prompt, &cfg).unwrap_or_else(|e| panic!("{what}: {e}"));
            let ids: Vec<u32> = chunks.iter().flat_map(|c| c.ids.iter().copied()).collect();
            let weights: Vec<f32> = chunks.iter().flat_map(|c| c.weights.iter().copied()).collect();
            let exp_weights: Vec<f32> = exp.weights.iter().map(|&w| w as f32).collect();
            assert_eq!(ids, exp.ids, "{what}, pad {}", cfg.pad_id);
            assert_eq!(weights, exp_weights, "{what}, pad {}", cfg.pad_id);
            assert!(chunks.iter().all(|c| c.ids.len() == 77 && c.weights.len() == 77), "{what}");
        }
    }
}

#[test]
fn vocabulary_layout() {
    // CLIP: 256 byte tokens, 256 byte+</w> tokens, 48894 merges, then the two special tokens.
    let tok = ClipTokenizer::new();
    assert_eq!(tok.vocab_size(), VOCAB_SIZE);
    assert_eq!(tok.tokenize("<|startoftext|><|endoftext|>"), [BOS_ID, EOS_ID]);
    // '!' is byte token 0; "a" is byte token 64 ('a' - '!'), "a</w>" is 256 + 64.
    assert_eq!(tok.tokenize("!"), [256]);
    assert_eq!(tok.tokenize("a"), [320]);
    // The first merge ("i n") is id 512, the first token after the byte tokens.
    assert_eq!(tok.decode(&[512]), "in");
}

#[test]
fn embedded_vocabulary_is_the_documented_file() {
    // data/README.md names this sha256 for open_clip/bpe_simple_vocab_16e6.txt.gz.
    let digest = Sha256::digest(include_bytes!("../../data/bpe_simple_vocab_16e6.txt.gz"));
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a");
    let readme = include_str!("../../data/README.md");
    assert!(readme.contains(&hex), "data/README.md must state the vocabulary's sha256");
}

#[test]
fn tokenizers_share_one_vocabulary() {
    let a = ClipTokenizer::new();
    let b = ClipTokenizer::new();
    assert!(a.shares_vocab_with(&b.clone()));
}

#[test]
fn decode_inverts_tokenize_for_words() {
    let tok = ClipTokenizer::new();
    for text in ["a photo of a cat", "supercalifragilisticexpialidocious", "東京タワー"] {
        assert_eq!(tok.decode(&tok.tokenize(text)), text);
    }
}

#[test]
fn chunk_config_errors_reach_the_caller() {
    let tok = ClipTokenizer::new();
    let cfg = ChunkConfig { chunk_len: 2, pad_id: 0 };
    assert_eq!(tok.tokenize_weighted("a cat", &cfg), Err(TokenizeError::ChunkTooShort(2)));
    assert!(matches!(tok.tokenize_weighted("(a:.)", &ChunkConfig::sd1()), Err(TokenizeError::InvalidWeight { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_prompt_gives_well_formed_chunks(prompt in "[ -~é東🐱\\t\\n]{0,120}") {
        let tok = ClipTokenizer::new();
        for id in tok.tokenize(&prompt) {
            prop_assert!((id as usize) < VOCAB_SIZE);
        }
        match tok.tokenize_weighted(&prompt, &ChunkConfig::sd2()) {
            Ok(chunks) => {
                prop_assert!(!chunks.is_empty());
                for c in &chunks {
                    prop_assert_eq!(c.ids.len(), 77);
                    prop_assert_eq!(c.weights.len(), 77);
                    prop_assert_eq!(c.ids[0], BOS_ID);
                    prop_assert!(c.ids.contains(&EOS_ID));
                }
            }
            Err(TokenizeError::InvalidWeight { .. } | TokenizeError::WeightOutOfRange { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}

/// One prompt of data/reference_prompt_tokens.json: the reference's ids and weights.
#[derive(Deserialize)]
struct ReferenceCase {
    prompt: String,
    sd1: Expected,
    sd2: Expected,
}

#[test]
fn prompts_match_the_reference_tokenizer_table() {
    // data/reference_prompt_tokens.json: the cases of issue 10 (a weighted span of several
    // words after a comma, nested weights with [x] and escapes, BREAK, weighted negative
    // prompts, special tokens in capitals) and 56 prompts of the fuzz grammar
    // (`cargo xtask parity --fuzz-prompts 40 --seed 1`), run through stable-diffusion.cpp's
    // own parser, tokenizer and conditioner loop (data/README.md).
    let table: Vec<ReferenceCase> =
        serde_json::from_str(include_str!("../../data/reference_prompt_tokens.json")).expect("table parses");
    assert!(table.len() >= 60);
    let tok = ClipTokenizer::new();
    let mut failures = Vec::new();
    for case in &table {
        for (cfg, exp) in [(ChunkConfig::sd1(), &case.sd1), (ChunkConfig::sd2(), &case.sd2)] {
            let chunks = tok.tokenize_weighted(&case.prompt, &cfg).unwrap_or_else(|e| panic!("{:?}: {e}", case.prompt));
            let ids: Vec<u32> = chunks.iter().flat_map(|c| c.ids.iter().copied()).collect();
            let weights: Vec<f32> = chunks.iter().flat_map(|c| c.weights.iter().copied()).collect();
            let exp_weights: Vec<f32> = exp.weights.iter().map(|&w| w as f32).collect();
            if ids != exp.ids || weights != exp_weights {
                let at = ids.iter().zip(&exp.ids).position(|(a, b)| a != b);
                failures.push(format!("{:?} (pad {}): first id difference at {at:?}", case.prompt, cfg.pad_id));
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} prompts differ:\n{}", failures.len(), 2 * table.len(), failures.join("\n"));
}
