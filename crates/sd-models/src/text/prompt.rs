//! Prompt weighting: the A1111 attention syntax as stable-diffusion.cpp parses it.
//!
//! Syntax (A1111, `modules/prompt_parser.py`):
//! - `(text)` multiplies the weight of `text` by 1.1, `[text]` divides it by 1.1;
//! - `(text:1.3)` multiplies it by 1.3 (brackets nest, factors multiply);
//! - a bracket left open applies to the rest of the prompt; `)` or `]` with nothing open is text;
//! - `\(` is a literal `(`; `BREAK` starts a new chunk;
//! - neighbouring fragments with equal weights are merged.
//!
//! Where the reference differs from A1111 we follow the reference:
//! - the weight must be `:` then `[+-]?[.0-9]+` then `)` with nothing in between (A1111 allows
//!   spaces), and the number is read like C's `strtof` (longest numeric prefix: `1.2.3` is 1.2);
//! - a `:W)` with no open `(` is dropped (A1111 keeps it as text);
//! - only `\(` loses its backslash: `\)`, `\[`, `\]` and `\\` reach the tokenizer as written;
//! - `BREAK` needs a word boundary only after it, so `aBREAK b` breaks too;
//! - weights are `f32`, multiplied in the same order as the reference;
//! - the reference aborts on a weight with no number (`(x:.)`) or out of `f32` range; we return
//!   [`TokenizeError`].
//!
//! Bounds the reference lacks: brackets nest at most `MAX_NESTING` (256) levels (so parsing stays
//! linear in the prompt's length: each closing bracket multiplies the fragments it encloses)
//! and every weight, the product of its brackets' factors, is at most `MAX_WEIGHT` (100) in
//! magnitude (5000 nested `(` make 1.1^5000, an infinite weight, which the reference feeds to
//! the encoder: NaN conditioning, a black image). Both are [`TokenizeError`]s.
//!
//! A fragment is a `BREAK` exactly when its text is `BREAK` and its weight is -1 after merging
//! (the reference's test), so `(BREAK)` is the text "BREAK" with weight -1.1.

use super::TokenizeError;

/// One piece of a parsed prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptFragment {
    /// Text whose tokens all get `weight`.
    Text { text: String, weight: f32 },
    /// Pad the current chunk so the next text starts a new one.
    Break,
}

impl PromptFragment {
    /// The fragment as the reference's parser yields it, text and weight: a `BREAK` is the text
    /// "BREAK" with weight -1, which is what the encoders without chunk breaks (T5, FLUX's and
    /// SD3's CLIPs) tokenize and weight.
    pub fn text_and_weight(&self) -> (&str, f32) {
        match self {
            PromptFragment::Text { text, weight } => (text, *weight),
            PromptFragment::Break => (BREAK, BREAK_WEIGHT),
        }
    }
}

/// The deepest bracket nesting accepted (open `(` and `[` together).
const MAX_NESTING: usize = 256;

/// The largest magnitude of a fragment's weight: a token weighted beyond it outweighs its
/// whole 77-token chunk a hundredfold, and CLIP hidden values of a few hundred times it
/// approach f16's 65504, where the UNet's cross attention computes. `(x)` nested 48 deep is
/// 1.1^48 = 97.
const MAX_WEIGHT: f32 = 100.0;

const ROUND_MULTIPLIER: f32 = 1.1;
const SQUARE_MULTIPLIER: f32 = 1.0 / 1.1;
const BREAK: &str = "BREAK";
const BREAK_WEIGHT: f32 = -1.0;

/// One match of the reference's attention pattern at the start of the remaining text.
enum Lexeme<'a> {
    OpenRound,
    OpenSquare,
    /// `:W)`; the number `W` and its byte offset in the prompt.
    Weight(&'a str, usize),
    CloseRound,
    CloseSquare,
    /// `\(`.
    EscapedOpenRound,
    Break,
    /// Anything else, kept as written.
    Text(&'a str),
}

/// Parses the weighting syntax of `text` into fragments, merged by equal weight. An empty
/// prompt gives one empty text fragment.
pub fn parse_prompt_attention(text: &str) -> Result<Vec<PromptFragment>, TokenizeError> {
    let mut res: Vec<(String, f32)> = Vec::new();
    let mut round: Vec<usize> = Vec::new();
    let mut square: Vec<usize> = Vec::new();
    let multiply_range = |res: &mut Vec<(String, f32)>, start: usize, m: f32| {
        for item in &mut res[start..] {
            item.1 *= m;
        }
    };

    let mut pos = 0;
    while pos < text.len() {
        let (lexeme, len) = next_lexeme(text, pos);
        if matches!(lexeme, Lexeme::OpenRound | Lexeme::OpenSquare) && round.len() + square.len() >= MAX_NESTING {
            return Err(TokenizeError::NestingTooDeep { offset: pos, max: MAX_NESTING });
        }
        pos += len;
        match lexeme {
            Lexeme::OpenRound => round.push(res.len()),
            Lexeme::OpenSquare => square.push(res.len()),
            Lexeme::Weight(w, offset) => {
                if let Some(start) = round.pop() {
                    multiply_range(&mut res, start, parse_weight(w, offset)?);
                }
            }
            Lexeme::CloseRound => match round.pop() {
                Some(start) => multiply_range(&mut res, start, ROUND_MULTIPLIER),
                None => res.push((")".into(), 1.0)),
            },
            Lexeme::CloseSquare => match square.pop() {
                Some(start) => multiply_range(&mut res, start, SQUARE_MULTIPLIER),
                None => res.push(("]".into(), 1.0)),
            },
            Lexeme::EscapedOpenRound => res.push(("(".into(), 1.0)),
            Lexeme::Break => res.push((BREAK.into(), BREAK_WEIGHT)),
            Lexeme::Text(t) => res.push((t.into(), 1.0)),
        }
    }
    for &start in &round {
        multiply_range(&mut res, start, ROUND_MULTIPLIER);
    }
    for &start in &square {
        multiply_range(&mut res, start, SQUARE_MULTIPLIER);
    }
    if res.is_empty() {
        res.push((String::new(), 1.0));
    }

    if let Some((t, w)) = res.iter().find(|(_, w)| w.is_nan() || w.abs() > MAX_WEIGHT) {
        let mut text: String = t.chars().take(40).flat_map(char::escape_debug).collect();
        if t.chars().nth(40).is_some() {
            text.push_str("...");
        }
        return Err(TokenizeError::WeightTooLarge { weight: *w, text, max: MAX_WEIGHT });
    }
    let mut merged: Vec<(String, f32)> = Vec::with_capacity(res.len());
    for (t, w) in res {
        match merged.last_mut() {
            Some(last) if last.1 == w => last.0.push_str(&t),
            _ => merged.push((t, w)),
        }
    }
    Ok(merged
        .into_iter()
        .map(|(text, weight)| {
            if text == BREAK && weight == BREAK_WEIGHT {
                PromptFragment::Break
            } else {
                PromptFragment::Text { text, weight }
            }
        })
        .collect())
}

/// The reference's pattern, alternatives in its order:
/// `\\\(|\\\)|\\\[|\\\]|\\\\|\\|\(|\[|:([+-]?[.\d]+)\)|\)|\]|\bBREAK\b|[^\\()\[\]:B]+|:|\bB`.
/// The reference matches against the remaining text alone, so `\b` before BREAK or B always
/// holds; the one after BREAK needs a non-word byte (ASCII `[A-Za-z0-9_]` are word bytes) or
/// the end. Some alternative always matches at the first byte, so nothing is skipped.
fn next_lexeme(text: &str, pos: usize) -> (Lexeme<'_>, usize) {
    let rest = &text[pos..];
    let bytes = rest.as_bytes();
    match bytes[0] {
        b'\\' => match bytes.get(1) {
            Some(b'(') => (Lexeme::EscapedOpenRound, 2),
            Some(b')' | b'[' | b']' | b'\\') => (Lexeme::Text(&rest[..2]), 2),
            _ => (Lexeme::Text(&rest[..1]), 1),
        },
        b'(' => (Lexeme::OpenRound, 1),
        b'[' => (Lexeme::OpenSquare, 1),
        b':' => {
            let sign = usize::from(matches!(bytes.get(1), Some(b'+' | b'-')));
            let digits = bytes[1 + sign..].iter().take_while(|b| b.is_ascii_digit() || **b == b'.').count();
            if digits > 0 && bytes.get(1 + sign + digits) == Some(&b')') {
                let end = 1 + sign + digits;
                (Lexeme::Weight(&rest[1..end], pos + 1), end + 1)
            } else {
                (Lexeme::Text(&rest[..1]), 1)
            }
        }
        b')' => (Lexeme::CloseRound, 1),
        b']' => (Lexeme::CloseSquare, 1),
        b'B' => {
            let word_after = bytes.get(BREAK.len()).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_');
            if rest.starts_with(BREAK) && !word_after {
                (Lexeme::Break, BREAK.len())
            } else {
                (Lexeme::Text(&rest[..1]), 1)
            }
        }
        _ => {
            let len =
                bytes.iter().take_while(|b| !matches!(b, b'\\' | b'(' | b')' | b'[' | b']' | b':' | b'B')).count();
            (Lexeme::Text(&rest[..len]), len)
        }
    }
}

/// Reads a weight like C's `strtof` reads the reference's `[+-]?[.0-9]+` match: the longest
/// prefix `[+-]?(digits[.digits] | .digits)`, correctly rounded to `f32`.
fn parse_weight(w: &str, offset: usize) -> Result<f32, TokenizeError> {
    let b = w.as_bytes();
    let sign = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let int = b[sign..].iter().take_while(|c| c.is_ascii_digit()).count();
    let mut end = sign + int;
    if b.get(end) == Some(&b'.') {
        let frac = b[end + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if int > 0 || frac > 0 {
            end += 1 + frac;
        }
    }
    let invalid = || TokenizeError::InvalidWeight { weight: w.to_string(), offset };
    if end == sign + int && int == 0 {
        return Err(invalid());
    }
    let prefix = &w[..end];
    let value: f32 = prefix.parse().map_err(|_| invalid())?;
    // strtof reports ERANGE (and the reference's stof throws) on overflow and on underflow.
    let nonzero_digits = prefix.bytes().any(|c| matches!(c, b'1'..=b'9'));
    if value.is_infinite() || (value.abs() < f32::MIN_POSITIVE && nonzero_digits) {
        return Err(TokenizeError::WeightOutOfRange { weight: w.to_string(), offset });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &str, weight: f32) -> PromptFragment {
        PromptFragment::Text { text: t.to_string(), weight }
    }

    fn check(prompt: &str, expected: &[PromptFragment], rule: &str) {
        let got = parse_prompt_attention(prompt).unwrap_or_else(|e| panic!("{prompt:?}: {e}"));
        assert_eq!(got, expected, "prompt {prompt:?}, rule: {rule}");
    }

    #[test]
    fn weighting_table() {
        let r = 1.1f32;
        let s = 1.0f32 / 1.1f32;
        let cases: Vec<(&str, Vec<PromptFragment>, &str)> = vec![
            ("normal text", vec![text("normal text", 1.0)], "A1111: plain text has weight 1"),
            ("", vec![text("", 1.0)], "A1111: an empty prompt is one empty fragment"),
            (
                "an (important) word",
                vec![text("an ", 1.0), text("important", r), text(" word", 1.0)],
                "A1111: (x) multiplies by 1.1",
            ),
            ("((x))", vec![text("x", r * r)], "A1111: nested brackets multiply, innermost first"),
            ("[x]", vec![text("x", s)], "A1111: [x] multiplies by 1/1.1"),
            ("[[x]]", vec![text("x", s * s)], "A1111: nested [] multiply"),
            ("(x:1.3)", vec![text("x", 1.3)], "A1111: (x:w) multiplies by w"),
            ("((x:1.3))", vec![text("x", 1.3f32 * r)], "A1111: explicit weight inside (), factors multiply"),
            ("(x:0.5) y", vec![text("x", 0.5), text(" y", 1.0)], "A1111: weight below 1"),
            ("(unbalanced", vec![text("unbalanced", r)], "A1111: an open ( applies to the rest"),
            ("[a (b", vec![text("a ", s), text("b", r * s)], "A1111: open ( applied before open ["),
            ("a) b]", vec![text("a) b]", 1.0)], "A1111: ) and ] with nothing open are text"),
            ("(unnecessary)(parens)", vec![text("unnecessaryparens", r)], "A1111: equal weights merge"),
            (
                "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
                vec![
                    text("a ", 1.0),
                    text("house", 1.3f32 * r * r),
                    text(" ", r),
                    text("on", s * r),
                    text(" a ", r),
                    text("hill", 0.5f32 * r),
                    text(", sun, ", r),
                    text("sky", r * r * r * r),
                    text(".", r),
                ],
                "A1111 docstring example; on = (1/1.1)*1.1 rounds to 1.0 in f32",
            ),
            ("[x:1.5]", vec![text("x:1.5", s)], "A1111: :w) needs a round bracket; inside [] it is text"),
            ("a BREAK b", vec![text("a ", 1.0), PromptFragment::Break, text(" b", 1.0)], "A1111: BREAK"),
            ("BREAKfast", vec![text("BREAKfast", 1.0)], "A1111: BREAK must end at a word boundary"),
            ("(BREAK)", vec![text("BREAK", -r)], "sd.cpp: a weighted BREAK is text (weight != -1)"),
            ("\\(x\\)", vec![text("(x\\)", 1.0)], "sd.cpp: only \\( drops its backslash"),
            ("a \\\\ b \\", vec![text("a \\\\ b \\", 1.0)], "sd.cpp: \\\\ and a lone \\ stay as written"),
            ("(x: 1.3)", vec![text("x: 1.3", r)], "sd.cpp: no space before the weight; (x) rule applies"),
            ("(x:1.3 )", vec![text("x:1.3 ", r)], "sd.cpp: no space after the weight"),
            (":1.3) y", vec![text(" y", 1.0)], "sd.cpp: a weight with no open ( is dropped"),
            ("(x:1.2.3)", vec![text("x", 1.2)], "sd.cpp: strtof reads the longest number prefix"),
            ("(x:+.5)", vec![text("x", 0.5)], "sd.cpp: sign and leading dot"),
            ("(x:2.)", vec![text("x", 2.0)], "sd.cpp: trailing dot"),
            ("(x:-1)", vec![text("x", -1.0)], "sd.cpp: negative weights are accepted"),
            (
                "aBREAK b",
                vec![text("a", 1.0), PromptFragment::Break, text(" b", 1.0)],
                "sd.cpp: no boundary needed before BREAK",
            ),
            ("BREAKé", vec![PromptFragment::Break, text("é", 1.0)], "sd.cpp: non-ASCII is not a word byte"),
            (
                "x BREAK[]BREAK y",
                vec![text("x ", 1.0), text("BREAKBREAK", -1.0), text(" y", 1.0)],
                "sd.cpp: adjacent BREAKs merge into text",
            ),
            ("Big aBc", vec![text("Big aBc", 1.0)], "sd.cpp: B is matched alone and merged back"),
        ];
        for (prompt, expected, rule) in cases {
            check(prompt, &expected, rule);
        }
    }

    #[test]
    fn bad_weights_are_errors_with_their_offset() {
        // The reference aborts (std::stof throws) on these; a weight with no open ( is never read.
        for (prompt, offset) in [("(x:.)", 3), ("ab (x:+.)", 6), ("(x:..5)", 3), ("(a:-.)", 3)] {
            match parse_prompt_attention(prompt) {
                Err(TokenizeError::InvalidWeight { offset: o, .. }) => {
                    assert_eq!(o, offset, "{prompt}")
                }
                other => panic!("{prompt}: expected InvalidWeight, got {other:?}"),
            }
        }
        let huge = format!("(x:{})", "9".repeat(40));
        assert!(matches!(parse_prompt_attention(&huge), Err(TokenizeError::WeightOutOfRange { .. })));
        let tiny = format!("(x:0.{}1)", "0".repeat(60));
        assert!(matches!(parse_prompt_attention(&tiny), Err(TokenizeError::WeightOutOfRange { .. })));
        assert!(parse_prompt_attention(":.) x").is_ok(), "no open (: the weight is dropped unread");
        assert_eq!(parse_prompt_attention("(x:0.0)").unwrap(), vec![text("x", 0.0)]);
    }

    #[test]
    fn deep_nesting_and_huge_weights_are_refused_never_infinite() {
        // 5000 nested ( make 1.1^5000 = inf in the reference; refused at the first bracket too
        // deep, with its offset.
        let deep = "(".repeat(5000) + "cat";
        assert_eq!(
            parse_prompt_attention(&deep),
            Err(TokenizeError::NestingTooDeep { offset: MAX_NESTING, max: MAX_NESTING })
        );
        // `(` and `[` count together; the deepest accepted nesting parses.
        let open = "([".repeat(MAX_NESTING / 2);
        let closed = open.clone() + "x" + &"])".repeat(MAX_NESTING / 2) + "(y)";
        assert_eq!(parse_prompt_attention(&closed).unwrap().len(), 2, "closed brackets no longer count");
        assert!(matches!(parse_prompt_attention(&(open + "[x")), Err(TokenizeError::NestingTooDeep { .. })));
        // 1.1^48 = 97 is accepted, 1.1^49 = 107 is not; nor is an explicit weight beyond 100.
        let ok = "(".repeat(48) + "x";
        let w = match &parse_prompt_attention(&ok).unwrap()[..] {
            [PromptFragment::Text { weight, .. }] => *weight,
            other => panic!("{other:?}"),
        };
        assert!((w - 1.1f32.powi(48)).abs() < 0.01, "{w}");
        for (prompt, weight) in [("(".repeat(49) + "x", 1.1f32.powi(49)), ("a (b:150) c".into(), 150.0)] {
            match parse_prompt_attention(&prompt) {
                Err(e @ TokenizeError::WeightTooLarge { .. }) => {
                    let TokenizeError::WeightTooLarge { weight: got, .. } = &e else { unreachable!() };
                    assert!((got - weight).abs() < 0.01 * weight, "{e}");
                    assert!(e.to_string().contains("beyond 100"), "{e}");
                }
                other => panic!("{prompt}: expected WeightTooLarge, got {other:?}"),
            }
        }
        assert!(parse_prompt_attention("(x:-150)").is_err(), "a magnitude bound");
        // The fragment is quoted with control characters escaped.
        let e = parse_prompt_attention("(a\x1b[2Jb:200)").unwrap_err().to_string();
        assert!(e.contains("\\u{1b}") && !e.contains('\x1b'), "{e}");
    }
}
