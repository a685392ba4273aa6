//! `cargo xtask parity --fuzz N --model PATH`: random cases against the reference, each disagreement with its first stage.
//!
//! ```text
//! cargo xtask parity --fuzz N --model PATH [--seed S] [--threads T] [--max-steps K] [--out DIR]
//!                    [--text-only] [--sdref EXE] [--sd-cli EXE] [-p PROMPT] [-n NEGATIVE] [--clip-skip K]
//! cargo xtask parity --fuzz-prompts N [--seed S]      # print the grammar's prompts, NUL-separated
//! ```
//!
//! Each case is drawn from `--seed` and its index, so `--seed S` reproduces a run and case
//! `k` of a run is the same whatever `N` is. A case is a prompt and a negative prompt from
//! [`prompt`] (the whole weighting syntax: nested `()`/`[]`, `(several words:w)`, commas,
//! escapes, `BREAK`, unicode, emoji, over-long prompts of several 77-token chunks, empty
//! prompts), a size (multiples of 64, often not square), a sampler and scheduler among
//! those we implement, a seed, `--clip-skip`, cfg 1 or more, and sometimes img2img with a
//! strength. It runs on any checkpoint: the reference (`sdref`) and ours load the same file.
//!
//! Stages, in pipeline order; the first that disagrees is the case's verdict:
//!
//! 1. `tokens`: our ids before chunking ([`ClipTokenizer::weighted_tokens`]) against the
//!    reference's, read from `sdref encode-text -v` (its tokenizer logs every fragment's
//!    tokens and every `BREAK` padding; token strings map to ids through the vocabulary).
//!    Exact match required. The reference's log lines are cut at 4096 bytes; a prompt whose
//!    fragment does not fit is reported as `n/a` here (the conditioning still compares it).
//! 2. `cond` / `uncond`: the conditioning of the prompt (and, with cfg != 1, of the negative
//!    prompt): ours in process (the family's conditioner, as the pipeline builds it through
//!    `sd_models::family`) against `sdref encode-text` at the case's size. Tolerance: the f16
//!    rounding bound of the parity module (`Tolerance::rounding_points`), reported with the
//!    token whose hidden state is furthest off. For SDXL also `vector` / `neg vector`: the
//!    ADM vector (bigG's pooled output and the size embeddings), with bigG's bound. Neither
//!    side zeroes SDXL's empty negative prompt here (`sdref encode-text` cannot say a prompt
//!    is the negative one); the image stage covers the zeroing.
//! 3. `unet` (SD 1.x/2.x; other families go from the text to the image): one UNet evaluation on identical inputs (a latent of the case's size, the
//!    reference's conditioning, a timestep drawn from the case), ours in process against
//!    `sdref unet`: the kernels' drift alone, with the UNet bound of the parity module.
//! 4. `vae`: one VAE decode on identical inputs (a standard-normal latent of 16x16, seeded
//!    by the case), ours in process against `sdref vae-decode`, with the VAE bound.
//! 5. `image`: `sd-cli` against `sdref txt2img` with the same flags, in 8-bit levels, the
//!    issue's bound (mean <= 1, max <= 8).
//!
//! A checkpoint on which both programs' UNet outputs are entirely NaN or infinite (weights
//! so large that f16 activations overflow, e.g. N(0, 0.05) everywhere in SD 2.x) has no
//! UNet or image comparison: the stages say so instead of reporting a disagreement.
//!
//! Sampler steps are not compared per case (the reference exposes no latent between steps);
//! a case whose UNet and VAE stages agree but whose image does not points there, or at the
//! amplification of the UNet's drift through the steps.
//!
//! Our own outputs are kept (`caseN.*.ours.f32`, `caseN.ours.png`), so two runs of the same
//! cases with different kernels (`SD_PLUGIN_PATH` pointing at another CPU plugin build, e.g.
//! `SD_GGML_CPU_LLAMAFILE=off`) can be compared stage by stage:
//! `cargo xtask parity --compare-runs DIR_A DIR_B` gives our kernel-order floor per stage.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::diffusion::unet::{UNetConfig, UNetModel};
use sd_models::family::TextRequest;
use sd_models::files::ModelFiles;
use sd_models::loader::{dtype_of, FileSource};
use sd_models::sampling::{SampleMethod, Scheduler};
use sd_models::text::ClipTokenizer;
use sd_sched::Runner;
use sd_vae::{AutoencoderKl, VaeConfig, VaeParts};

use crate::bench::run_measured;
use crate::parity::{self, Diff, Tolerance};
use crate::reference;

/// The fuzz harness's flags, parsed with `cargo xtask parity`'s (whose `--threads` it uses).
#[derive(clap::Args, Debug, PartialEq)]
#[command(group(clap::ArgGroup::new("fuzz_mode").multiple(false)))]
pub struct Flags {
    /// Run N random cases on --model.
    #[arg(long = "fuzz", value_name = "N", group = "fuzz_mode", value_parser = positive)]
    fuzz: Option<u64>,
    /// Print the prompts of N random cases (NUL-separated) and stop.
    #[arg(long = "fuzz-prompts", value_name = "N", group = "fuzz_mode", value_parser = positive)]
    fuzz_prompts: Option<u64>,
    /// The checkpoint (any SD 1.x / 2.x or SDXL).
    #[arg(long = "model", short = 'm', value_name = "PATH", requires = "fuzz_mode")]
    model: Option<PathBuf>,
    /// Seed of the cases.
    #[arg(long = "seed", short = 's', default_value_t = 1, requires = "fuzz_mode")]
    seed: u64,
    /// Most sampling steps of a case.
    #[arg(long = "max-steps", value_name = "K", default_value_t = 4, value_parser = positive_u32, requires = "fuzz_mode")]
    max_steps: u32,
    /// Where the cases' files go (default: target/parity/fuzz).
    #[arg(long = "out", value_name = "DIR", requires = "fuzz_mode")]
    out: Option<PathBuf>,
    /// Compare tokens and conditioning only (seconds per case instead of minutes).
    #[arg(long = "text-only", requires = "fuzz_mode")]
    text_only: bool,
    /// A prebuilt reference executable (otherwise it is built first).
    #[arg(long = "sdref", value_name = "EXE", requires = "fuzz_mode")]
    sdref: Option<PathBuf>,
    /// A prebuilt sd-cli (otherwise it is built first).
    #[arg(long = "sd-cli", value_name = "EXE", requires = "fuzz_mode")]
    sd_cli: Option<PathBuf>,
    /// A fixed prompt instead of the grammar's (to chase one disagreement).
    #[arg(long = "prompt", short = 'p', requires = "fuzz_mode")]
    prompt: Option<String>,
    /// A fixed negative prompt.
    #[arg(long = "negative-prompt", short = 'n', requires = "fuzz_mode")]
    negative: Option<String>,
    /// A fixed clip skip.
    #[arg(long = "clip-skip", value_name = "K", allow_negative_numbers = true, requires = "fuzz_mode")]
    clip_skip: Option<i32>,
    /// Compare our outputs of two runs of the same cases (e.g. two CPU plugin builds) and stop.
    #[arg(long = "compare-runs", num_args = 2, value_names = ["DIR_A", "DIR_B"], group = "fuzz_mode")]
    compare_runs: Option<Vec<PathBuf>>,
}

fn positive(v: &str) -> Result<u64, String> {
    v.parse::<u64>().ok().filter(|&n| n > 0).ok_or_else(|| format!("{v}: a positive integer"))
}

fn positive_u32(v: &str) -> Result<u32, String> {
    v.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| format!("{v}: a positive integer"))
}

impl Flags {
    /// Whether the fuzz harness was asked for (`--fuzz` or `--fuzz-prompts`).
    pub fn active(&self) -> bool {
        self.fuzz.is_some() || self.fuzz_prompts.is_some() || self.compare_runs.is_some()
    }
}

/// What a fuzz run does, from its flags.
#[derive(Debug, PartialEq)]
struct Args {
    cases: usize,
    model: Option<PathBuf>,
    seed: u64,
    threads: u32,
    max_steps: u32,
    out: PathBuf,
    prompts_only: bool,
    text_only: bool,
    sdref: Option<PathBuf>,
    sd_cli: Option<PathBuf>,
    prompt: Option<String>,
    negative: Option<String>,
    clip_skip: Option<i32>,
}

impl Args {
    fn from_flags(f: &Flags, threads: u32) -> Result<Self> {
        let prompts_only = f.fuzz_prompts.is_some();
        let cases = f.fuzz.or(f.fuzz_prompts).context("no --fuzz N given")? as usize;
        if !prompts_only && f.model.is_none() {
            bail!("--fuzz needs --model PATH (any SD 1.x / 2.x checkpoint)");
        }
        Ok(Args {
            cases,
            model: f.model.clone(),
            seed: f.seed,
            threads,
            max_steps: f.max_steps,
            out: f.out.clone().unwrap_or_else(|| crate::workspace_root().join("target/parity/fuzz")),
            prompts_only,
            text_only: f.text_only,
            sdref: f.sdref.clone(),
            sd_cli: f.sd_cli.clone(),
            prompt: f.prompt.clone(),
            negative: f.negative.clone(),
            clip_skip: f.clip_skip,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Random cases
// ---------------------------------------------------------------------------------------

/// SplitMix64: small, seedable, the same on every platform.
#[derive(Clone, Debug)]
pub(crate) struct CaseRng(u64);

impl CaseRng {
    /// The stream of case `index` of a run with `seed`.
    fn for_case(seed: u64, index: u64) -> Self {
        let mut r = CaseRng(seed ^ index.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Words: plain, capitalised (the reference matches `B` alone), digits, contractions,
/// non-ASCII letters and emoji (the reference's classes are ASCII-only), punctuation.
const WORDS: &[&str] = &[
    "a",
    "photo",
    "of",
    "cat",
    "dog",
    "lighthouse",
    "portrait",
    "masterpiece",
    "best",
    "quality",
    "studio",
    "lighting",
    "sunset",
    "over",
    "the",
    "sea",
    "red",
    "blue",
    "old",
    "man",
    "woman",
    "castle",
    "forest",
    "highly",
    "detailed",
    "sharp",
    "focus",
    "bokeh",
    "cinematic",
    "Big",
    "BOLD",
    "Bb",
    "aBc",
    "Boat",
    "B",
    "BREAKfast",
    "35mm",
    "8k",
    "400",
    "1girl",
    "it's",
    "don't",
    "we're",
    "I'LL",
    "café",
    "naïve",
    "東京",
    "Ünïcode",
    "São",
    "Paulo",
    "🐱",
    "🌅",
    "👍🏽",
    "✨",
    "—",
    "...",
    "!",
    "?",
    "-",
    "'",
    "\"",
    "&",
    "#1",
    "hdr",
    "uhd",
    "trending",
    "artstation",
    "<|endoftext|>",
    "<|ENDOFTEXT|>",
    "16:9",
    "x:y",
];

/// Weights as users write them (the reference reads `[+-]?[.\d]+` with `strtof`).
const WEIGHTS: &[&str] =
    &["1.3", "0.8", "1.2", "0.5", "1.5", ".9", "1", "1.25", "2.", "+1.1", "0", "-0.5", "1.05", "0.95"];

/// Separators between items: spaces, commas, odd whitespace.
const SEPARATORS: &[&str] = &[" ", " ", " ", ", ", ", ", ",", " , ", "  ", "\t", "\n", ". "];

fn words(rng: &mut CaseRng, n: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(rng.pick::<&str>(WORDS));
    }
    s
}

/// One item of a prompt: words, a bracketed span, an escape or `BREAK`.
fn item(rng: &mut CaseRng, depth: u32) -> String {
    let roll = rng.below(if depth >= 3 { 4 } else { 12 });
    match roll {
        0..=3 => {
            let n = 1 + rng.below(3);
            words(rng, n)
        }
        4 => format!("({})", span(rng, depth + 1)),
        5 => format!("[{}]", span(rng, depth + 1)),
        6 | 7 => format!("({}:{})", span(rng, depth + 1), rng.pick(WEIGHTS)),
        8 => format!("(({}))", words(rng, 1)),
        9 => {
            let esc = *rng.pick(&["\\(", "\\)", "\\[", "\\]", "\\\\", "\\"]);
            let close = *rng.pick(&["", "\\)", "\\]"]);
            format!("{esc}{}{close}", words(rng, 1))
        }
        10 => "BREAK".to_string(),
        _ => {
            // An unbalanced bracket, or a closing one with nothing open.
            let b = *rng.pick(&["(", "[", ")", "]"]);
            format!("{b}{}", words(rng, 1))
        }
    }
}

fn span(rng: &mut CaseRng, depth: u32) -> String {
    let n = 1 + rng.below(3);
    let mut s = String::new();
    for i in 0..n {
        if i > 0 {
            s.push_str(rng.pick::<&str>(SEPARATORS));
        }
        s.push_str(&item(rng, depth));
    }
    s
}

/// A prompt from the grammar: empty (1 in 12), over-long (several 77-token chunks, 1 in
/// 8), or 1 to 8 items.
pub fn prompt(rng: &mut CaseRng) -> String {
    if rng.chance(1.0 / 12.0) {
        return String::new();
    }
    let n = if rng.chance(1.0 / 8.0) { 40 + rng.below(80) } else { 1 + rng.below(8) };
    let mut s = String::new();
    for i in 0..n {
        if i > 0 {
            s.push_str(rng.pick::<&str>(SEPARATORS));
        }
        s.push_str(&item(rng, 0));
    }
    s
}

/// One generation, with the flags both programs share.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub index: u64,
    pub prompt: String,
    pub negative: String,
    pub width: u32,
    pub height: u32,
    pub method: &'static str,
    pub scheduler: Option<&'static str>,
    pub steps: u32,
    pub cfg: f32,
    pub seed: i64,
    pub clip_skip: i32,
    /// img2img strength; the init image is a pattern the harness writes.
    pub strength: Option<f32>,
}

impl Case {
    /// Case `index` of a run with `seed`; at most `max_steps` steps.
    pub fn draw(seed: u64, index: u64, max_steps: u32) -> Case {
        let mut rng = CaseRng::for_case(seed, index);
        let prompt = prompt(&mut rng);
        let negative = if rng.chance(0.5) { String::new() } else { self::prompt(&mut rng) };
        let sides = [64u32, 128, 192, 256, 320];
        let width = *rng.pick(&sides[1..]);
        let height = if rng.chance(0.4) { width } else { *rng.pick(&sides) };
        let method = rng.pick(&SampleMethod::ALL).name();
        let scheduler = if rng.chance(0.5) { None } else { Some(rng.pick(&Scheduler::ALL).name()) };
        let steps = 1 + rng.below(max_steps.max(1) as usize) as u32;
        let cfg = if rng.chance(0.3) { 1.0 } else { *rng.pick(&[3.0f32, 5.0, 7.0, 7.5]) };
        let seed = rng.below(1 << 31) as i64;
        let clip_skip = *rng.pick(&[-1, -1, 1, 2]);
        let strength = if rng.chance(0.2) { Some(*rng.pick(&[0.5f32, 0.75, 0.9])) } else { None };
        Case { index, prompt, negative, width, height, method, scheduler, steps, cfg, seed, clip_skip, strength }
    }

    /// `txt2img` flags understood by both `sd-cli` and `sdref txt2img` (prompts as
    /// `--flag=value`, so that one starting with `-` stays a value).
    pub fn flags(&self, threads: u32) -> Vec<String> {
        let mut f = vec![
            format!("--prompt={}", self.prompt),
            format!("--negative-prompt={}", self.negative),
            format!("--width={}", self.width),
            format!("--height={}", self.height),
            format!("--steps={}", self.steps),
            format!("--sampling-method={}", self.method),
            format!("--cfg-scale={}", self.cfg),
            format!("--seed={}", self.seed),
            format!("--clip-skip={}", self.clip_skip),
            format!("--threads={threads}"),
        ];
        if let Some(s) = self.scheduler {
            f.push(format!("--scheduler={s}"));
        }
        if let Some(s) = self.strength {
            f.push(format!("--strength={s}"));
        }
        f
    }

    /// A one-line description for the report.
    pub fn describe(&self) -> String {
        format!(
            "{}x{} {}{} steps {} cfg {} seed {} clip-skip {}{} prompt {:?} negative {:?}",
            self.width,
            self.height,
            self.method,
            self.scheduler.map(|s| format!("/{s}")).unwrap_or_default(),
            self.steps,
            self.cfg,
            self.seed,
            self.clip_skip,
            self.strength.map(|s| format!(" img2img {s}")).unwrap_or_default(),
            self.prompt,
            self.negative
        )
    }
}

// ---------------------------------------------------------------------------------------
// The reference's token ids, from its debug log
// ---------------------------------------------------------------------------------------

const SPLIT_MARK: &str = "split prompt \"";
const SPLIT_TOKENS: &str = "\" to tokens [";
const BREAK_MARK: &str = "BREAK token encountered, padding current chunk by ";

/// The token list (before chunking) the reference's tokenizer logged: each fragment's
/// tokens (`split prompt "TEXT" to tokens ["t1", "t2", ]`) and each `BREAK` padding, in
/// order. `id_of` maps a vocabulary string to its id. An error names what could not be read
/// (a line cut at the reference's 4096-byte log buffer, an unknown token).
fn reference_tokens(log: &str, id_of: &HashMap<String, u32>, eos: u32) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    let mut pos = 0;
    let mut fragments = 0;
    loop {
        let split = log[pos..].find(SPLIT_MARK).map(|i| pos + i);
        let brk = log[pos..].find(BREAK_MARK).map(|i| pos + i);
        match (split, brk) {
            (Some(s), b) if b.is_none_or(|b| s < b) => {
                let head = s + SPLIT_MARK.len();
                let list = log[head..]
                    .find(SPLIT_TOKENS)
                    .map(|i| head + i + SPLIT_TOKENS.len())
                    .ok_or("a `split prompt` line without its token list")?;
                let end = log[list..]
                    .find("]\n")
                    .map(|i| list + i)
                    .ok_or("a token list without its closing `]` (the log line was cut)")?;
                let body = &log[list..end];
                if !body.is_empty() {
                    let body = body
                        .strip_suffix(", ")
                        .and_then(|b| b.strip_prefix('"'))
                        .and_then(|b| b.strip_suffix('"'))
                        .ok_or_else(|| format!("token list `{}` is not quoted strings", short(body)))?;
                    // Tokens never hold a space (CLIP's byte table moves it to U+0120).
                    for t in body.split("\", \"") {
                        ids.push(*id_of.get(t).ok_or_else(|| format!("token `{t}` is not in the vocabulary"))?);
                    }
                }
                fragments += 1;
                pos = end + 2;
            }
            (_, Some(b)) => {
                let head = b + BREAK_MARK.len();
                let digits: String = log[head..].chars().take_while(char::is_ascii_digit).collect();
                let n: usize = digits.parse().map_err(|_| "a BREAK line without its padding count".to_string())?;
                ids.resize(ids.len() + n, eos);
                pos = head + digits.len();
            }
            (None, None) => break,
            (Some(_), None) => unreachable!("handled by the first arm"),
        }
    }
    if fragments == 0 {
        return Err("the reference logged no tokens (was `-v` given?)".into());
    }
    Ok(ids)
}

fn short(s: &str) -> String {
    let cut: String = s.chars().take(60).collect();
    if cut.len() < s.len() {
        format!("{cut}...")
    } else {
        cut
    }
}

// ---------------------------------------------------------------------------------------
// Running a case
// ---------------------------------------------------------------------------------------

/// How one stage of one case came out.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Agree,
    Differ,
    /// Not compared, and why.
    NotAvailable(String),
}

/// One stage of one case: its verdict and figures.
#[derive(Clone, Debug)]
pub struct Stage {
    pub name: &'static str,
    pub verdict: Verdict,
    pub detail: String,
    pub diff: Option<Diff>,
}

impl Stage {
    fn new(name: &'static str, verdict: Verdict, detail: String, diff: Option<Diff>) -> Stage {
        Stage { name, verdict, detail, diff }
    }
}

/// Our text side, loaded once for every case: the family's conditioner, as the pipeline
/// builds it.
struct OurText {
    family: parity::FamilyText,
    runner: Runner,
    tokenizer: ClipTokenizer,
    id_of: HashMap<String, u32>,
}

impl OurText {
    fn load(cpu: &parity::Cpu, files: &ModelFiles) -> Result<OurText> {
        let family = parity::load_family_text(cpu, files)?;
        let tokenizer = ClipTokenizer::new();
        let id_of = (0..tokenizer.vocab_size() as u32)
            .filter_map(|id| tokenizer.token_text(id).map(|t| (t.to_owned(), id)))
            .collect();
        Ok(OurText { family, runner: Runner::new("te", cpu.backend.clone()), tokenizer, id_of })
    }
}

/// Our UNet, loaded once, for the stage on identical inputs.
struct OurUnet {
    model: UNetModel,
    runner: Runner,
}

impl OurUnet {
    fn load(cpu: &parity::Cpu, files: &ModelFiles, cfg: &UNetConfig) -> Result<OurUnet> {
        let src = FileSource::new(files);
        let model = UNetModel::load(cfg.clone(), &dtype_of(files), None, cpu.backend.device().buffer_type(), &src)?;
        Ok(OurUnet { model, runner: Runner::new("unet", cpu.backend.clone()) })
    }
}

/// Our VAE decoder, loaded once, for the stage on identical inputs.
struct OurVae {
    model: AutoencoderKl,
    cfg: VaeConfig,
    runner: Runner,
}

impl OurVae {
    fn load(cpu: &parity::Cpu, files: &ModelFiles) -> Result<OurVae> {
        let src = FileSource::new(files);
        let cfg = VaeConfig::sd();
        let model = AutoencoderKl::load(cfg.clone(), VaeParts::DecoderOnly, &src, cpu.backend.device().buffer_type())?;
        Ok(OurVae { model, cfg, runner: Runner::new("vae", cpu.backend.clone()) })
    }
}

/// Why a case has no UNet or image comparison: both UNet outputs are NaN or infinite.
const DEGENERATE: &str = "both programs' UNet outputs are non-finite: the checkpoint overflows (f16 activations)";

/// The latent side of the VAE stage (a 128x128 image: the decoder's every op, cheaply).
const VAE_STAGE_SIDE: usize = 16;

/// The context every case needs.
struct Harness {
    sdref: PathBuf,
    sd_cli: PathBuf,
    model: PathBuf,
    threads: u32,
    dir: PathBuf,
    text: OurText,
    /// `None` with `--text-only`.
    unet: Option<OurUnet>,
    /// `None` with `--text-only`.
    vae: Option<OurVae>,
    text_only: bool,
}

impl Harness {
    fn sdref(&self, sub: &str) -> Command {
        let mut c = Command::new(&self.sdref);
        c.arg(sub).arg("-m").arg(&self.model).arg(format!("--threads={}", self.threads));
        c
    }

    /// Tokens and conditioning of one prompt (`which` is "cond" or "uncond").
    fn text_stages(&mut self, case: &Case, prompt: &str, which: &'static str) -> Result<Vec<Stage>> {
        let out = self.dir.join(format!("case{}.{which}.ref.f32", case.index));
        let mut c = self.sdref("encode-text");
        c.arg(format!("--prompt={prompt}"))
            .arg(format!("--clip-skip={}", case.clip_skip))
            .arg(format!("--width={}", case.width))
            .arg(format!("--height={}", case.height))
            .arg("-v")
            .arg("-o")
            .arg(&out);
        let m = run_measured(&mut c)?;
        let ours_tok = self.text.tokenizer.weighted_tokens(prompt, &self.text.family.chunks);
        let mut stages = Vec::new();
        let tok_name = if which == "cond" { "tokens" } else { "neg tokens" };
        if !m.success() {
            let tail = m.stderr.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
            let verdict = if ours_tok.is_err() { Verdict::Agree } else { Verdict::Differ };
            stages.push(Stage::new(
                tok_name,
                verdict,
                format!("the reference failed: {tail}; ours: {ours_tok:?}"),
                None,
            ));
            return Ok(stages);
        }
        let (ours_ids, ours_tok_weights) = match ours_tok {
            Ok(t) => t,
            Err(e) => {
                stages.push(Stage::new(tok_name, Verdict::Differ, format!("ours rejects it: {e}"), None));
                return Ok(stages);
            }
        };
        match reference_tokens(&m.stderr, &self.text.id_of, sd_models::text::EOS_ID) {
            Ok(ref_ids) => {
                let first = ours_ids.iter().zip(&ref_ids).position(|(a, b)| a != b);
                let (verdict, detail) = match first {
                    None if ours_ids.len() == ref_ids.len() => {
                        (Verdict::Agree, format!("{} ids equal", ours_ids.len()))
                    }
                    _ => {
                        let at = first.unwrap_or(ours_ids.len().min(ref_ids.len()));
                        let show = |ids: &[u32]| {
                            ids.iter()
                                .skip(at.saturating_sub(2))
                                .take(6)
                                .map(|&i| format!("{i}:{}", self.text.tokenizer.token_text(i).unwrap_or("?")))
                                .collect::<Vec<_>>()
                                .join(" ")
                        };
                        (
                            Verdict::Differ,
                            format!(
                                "first difference at token {at} ({} ours, {} ref): ours [{}] ref [{}]",
                                ours_ids.len(),
                                ref_ids.len(),
                                show(&ours_ids),
                                show(&ref_ids)
                            ),
                        )
                    }
                };
                stages.push(Stage::new(tok_name, verdict, detail, None));
            }
            Err(why) => stages.push(Stage::new(tok_name, Verdict::NotAvailable(why), String::new(), None)),
        }

        let (shape, r) = parity::read_raw(&out)?;
        // Not as the negative prompt: `sdref encode-text` never zeroes SDXL's empty negative
        // prompt (the image stage covers that), so both sides give the encoders' output.
        let request = TextRequest {
            prompt,
            clip_skip: case.clip_skip.into(),
            width: case.width as usize,
            height: case.height as usize,
            negative: false,
        };
        let ours = self.text.family.encoder.encode(&mut self.text.runner, &request)?;
        let tol = Tolerance::rounding_points(self.text.family.points);
        if shape.iter().product::<usize>() != ours.data.len() {
            stages.push(Stage::new(
                which,
                Verdict::Differ,
                format!("shapes differ: ref {shape:?}, ours [1, {}, {}]", ours.n_tokens, ours.hidden_size),
                None,
            ));
            return Ok(stages);
        }
        let ours_path = self.dir.join(format!("case{}.{which}.ours.f32", case.index));
        parity::write_raw(&ours_path, &shape, &ours.data, "our conditioning")?;
        let diff = Diff::of(&parity::to_f64(&ours.data), &parity::to_f64(&r))?;
        // The token whose hidden state is furthest off, relative to the reference's scale.
        let h = ours.hidden_size;
        let worst = ours
            .data
            .chunks_exact(h)
            .zip(r.chunks_exact(h))
            .map(|(a, b)| a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).fold(0.0, f64::max))
            .enumerate()
            .fold((0, 0.0), |acc, (i, d)| if d > acc.1 { (i, d) } else { acc });
        let mut verdict = if tol.accepts(&diff) { Verdict::Agree } else { Verdict::Differ };
        let mut detail = format!(
            "rel_rms {:.2e} rel_max {:.2e} [{}], worst token {} (max|d| {:.3e})",
            diff.rel_rms(),
            diff.rel_max(),
            tol.describe(),
            worst.0,
            worst.1
        );
        if verdict == Verdict::Differ {
            let weighted = ours_tok_weights.iter().any(|&w| w != 1.0);
            detail.push_str(&scale_note(&ours.data, &r, h * 77, weighted));
            if weighted {
                if let Some(note) = ill_conditioned_agreement(&ours.data, &r, h * 77, &tol)? {
                    verdict = Verdict::Agree;
                    detail.push_str(&note);
                }
            }
        }
        stages.push(Stage::new(which, verdict, detail, Some(diff)));
        if self.text.family.vector_points > 0 {
            stages.push(self.vector_stage(case, &out, &ours.vector, which)?);
        }
        Ok(stages)
    }

    /// The conditioning's vector (SDXL's ADM input: pooled output and size embeddings), ours
    /// against the one `sdref encode-text` wrote next to the token states.
    fn vector_stage(&self, case: &Case, ref_states: &Path, ours: &[f32], which: &'static str) -> Result<Stage> {
        let name = if which == "cond" { "vector" } else { "neg vector" };
        let mut path = ref_states.as_os_str().to_owned();
        path.push(".vector.f32");
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Ok(Stage::new(name, Verdict::Differ, "the reference wrote no vector".into(), None));
        }
        let (shape, r) = parity::read_raw(&path)?;
        if r.len() != ours.len() {
            let detail = format!("lengths differ: ref {shape:?}, ours {}", ours.len());
            return Ok(Stage::new(name, Verdict::Differ, detail, None));
        }
        let ours_path = self.dir.join(format!("case{}.{which}.vector.ours.f32", case.index));
        parity::write_raw(&ours_path, &shape, ours, "our conditioning vector")?;
        let diff = Diff::of(&parity::to_f64(ours), &parity::to_f64(&r))?;
        let tol = Tolerance::rounding_points(self.text.family.vector_points);
        let verdict = if tol.accepts(&diff) { Verdict::Agree } else { Verdict::Differ };
        let detail = format!("rel_rms {:.2e} rel_max {:.2e} [{}]", diff.rel_rms(), diff.rel_max(), tol.describe());
        Ok(Stage::new(name, verdict, detail, Some(diff)))
    }

    /// One UNet evaluation on identical inputs: a latent of the case's size (standard
    /// normal, seeded by the case), the reference's conditioning of the case's prompt, and
    /// a timestep drawn from the case; kernel drift without text or sampler differences.
    fn unet_stage(&mut self, case: &Case) -> Result<Stage> {
        let ctx_path = self.dir.join(format!("case{}.cond.ref.f32", case.index));
        let (ctx_shape, ctx) = parity::read_raw(&ctx_path)?;
        let n_ctx = ctx_shape.get(1).copied().context("the reference's conditioning has no token axis")?;
        let (lw, lh) = (case.width as usize / 8, case.height as usize / 8);
        let shape = [1, 4, lh, lw];
        let x = parity::normal_values(0x5eed_f000 ^ case.index, shape.iter().product());
        let timestep = [999.0f32, 750.0, 400.0, 1.0][(case.seed % 4) as usize];
        let x_path = self.dir.join(format!("case{}.unet_x.f32", case.index));
        parity::write_raw(&x_path, &shape, &x, "UNet input x, standard normal (splitmix64, seeded by the case)")?;
        let out = self.dir.join(format!("case{}.unet.ref.f32", case.index));
        let mut c = self.sdref("unet");
        c.arg("--latent").arg(&x_path).arg(format!("--timestep={timestep}")).arg("--context").arg(&ctx_path);
        c.arg("-o").arg(&out);
        run_measured(&mut c)?.check("sdref unet")?;
        let (_, r) = parity::read_raw(&out)?;
        let unet = self.unet.as_mut().context("the UNet is not loaded with --text-only")?;
        let o = unet.model.eval(&mut unet.runner, &x, (lw, lh), &[timestep], &ctx, n_ctx, 1)?;
        parity::write_raw(&self.dir.join(format!("case{}.unet.ours.f32", case.index)), &shape, &o, "our UNet output")?;
        if o.iter().chain(&r).all(|v| !v.is_finite()) {
            // Both programs overflow on this checkpoint: nothing to compare, here or after.
            return Ok(Stage::new("unet", Verdict::NotAvailable(DEGENERATE.into()), String::new(), None));
        }
        let diff = Diff::of(&parity::to_f64(&o), &parity::to_f64(&r))?;
        let tol = Tolerance::rounding_points(parity::UNET_POINTS);
        let verdict = if tol.accepts(&diff) { Verdict::Agree } else { Verdict::Differ };
        let detail = format!(
            "t={timestep} {}x{}: rel_rms {:.2e} rel_max {:.2e} [{}]",
            lw,
            lh,
            diff.rel_rms(),
            diff.rel_max(),
            tol.describe()
        );
        Ok(Stage::new("unet", verdict, detail, Some(diff)))
    }

    /// One VAE decode on identical inputs: a standard-normal diffusion-space latent of
    /// [`VAE_STAGE_SIDE`]², seeded by the case; the decoder's drift alone.
    fn vae_stage(&mut self, case: &Case) -> Result<Stage> {
        let shape = [1, 4, VAE_STAGE_SIDE, VAE_STAGE_SIDE];
        let z = parity::normal_values(0x5eed_7ae0 ^ case.index, shape.iter().product());
        let z_path = self.dir.join(format!("case{}.vae_z.f32", case.index));
        parity::write_raw(
            &z_path,
            &shape,
            &z,
            "diffusion-space latent, standard normal (splitmix64, seeded by the case)",
        )?;
        let out = self.dir.join(format!("case{}.vae.ref.f32", case.index));
        let mut c = self.sdref("vae-decode");
        c.arg("--latent").arg(&z_path).arg("-o").arg(&out);
        run_measured(&mut c)?.check("sdref vae-decode")?;
        let (ref_shape, r) = parity::read_raw(&out)?;
        let vae = self.vae.as_mut().context("the VAE is not loaded with --text-only")?;
        let mut zv = z.clone();
        vae.cfg.diffusion_to_vae(&mut zv);
        let o = vae.model.decode(&mut vae.runner, &zv, (VAE_STAGE_SIDE, VAE_STAGE_SIDE), vae.cfg.z_channels)?;
        parity::write_raw(
            &self.dir.join(format!("case{}.vae.ours.f32", case.index)),
            &ref_shape,
            &o,
            "our VAE output",
        )?;
        let diff = Diff::of(&parity::to_f64(&o), &parity::to_f64(&r))?;
        let tol = Tolerance::rounding_points(parity::VAE_POINTS);
        let verdict = if tol.accepts(&diff) { Verdict::Agree } else { Verdict::Differ };
        let detail = format!(
            "{VAE_STAGE_SIDE}x{VAE_STAGE_SIDE} latent: rel_rms {:.2e} rel_max {:.2e} [{}]",
            diff.rel_rms(),
            diff.rel_max(),
            tol.describe()
        );
        Ok(Stage::new("vae", verdict, detail, Some(diff)))
    }

    fn image_stage(&self, case: &Case) -> Result<Stage> {
        let flags = case.flags(self.threads);
        let stem = self.dir.join(format!("case{}", case.index));
        let mut extra: Vec<String> = Vec::new();
        if case.strength.is_some() {
            let init = stem.with_extension("init.png");
            write_init_png(&init, case.width, case.height, case.index)?;
            extra.push(format!("--init-img={}", init.display()));
        }
        let ref_png = stem.with_extension("ref.png");
        let ours_png = stem.with_extension("ours.png");
        let mut c = Command::new(&self.sdref);
        c.arg("txt2img").arg("-m").arg(&self.model).args(&flags).args(&extra).arg("-o").arg(&ref_png);
        let r = run_measured(&mut c)?;
        let mut c = Command::new(&self.sd_cli);
        c.arg("-m").arg(&self.model).args(&flags).args(&extra).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
        let o = run_measured(&mut c)?;
        let tail = |m: &crate::bench::Measured| m.stderr.lines().rev().take(2).collect::<Vec<_>>().join(" | ");
        match (r.success(), o.success()) {
            (true, true) => {
                let (diff, _) = parity::png_diff(&ours_png, &ref_png)?;
                let verdict = if Tolerance::PNG.accepts(&diff) { Verdict::Agree } else { Verdict::Differ };
                let detail = format!("mean {:.2} max {:.0} levels", diff.mean_abs, diff.max_abs);
                Ok(Stage::new("image", verdict, detail, Some(diff)))
            }
            (false, false) => Ok(Stage::new(
                "image",
                Verdict::Agree,
                format!("both fail: ref {} | ours {}", tail(&r), tail(&o)),
                None,
            )),
            (false, true) => {
                Ok(Stage::new("image", Verdict::Differ, format!("only the reference fails: {}", tail(&r)), None))
            }
            (true, false) => Ok(Stage::new("image", Verdict::Differ, format!("only ours fails: {}", tail(&o)), None)),
        }
    }

    fn run_case(&mut self, case: &Case) -> Result<Vec<Stage>> {
        let mut stages = self.text_stages(case, &case.prompt, "cond")?;
        if case.cfg != 1.0 {
            stages.extend(self.text_stages(case, &case.negative, "uncond")?);
        }
        if self.text_only {
            return Ok(stages);
        }
        if self.unet.is_none() {
            // Components on identical inputs exist for SD 1.x/2.x; other families go
            // straight to the image.
            let why = "not compared for this family yet: the image stage is".to_string();
            stages.push(Stage::new("unet", Verdict::NotAvailable(why.clone()), String::new(), None));
            stages.push(Stage::new("vae", Verdict::NotAvailable(why), String::new(), None));
        } else {
            if self.dir.join(format!("case{}.cond.ref.f32", case.index)).is_file() {
                stages.push(self.unet_stage(case)?);
            }
            stages.push(self.vae_stage(case)?);
        }
        let degenerate = stages.iter().any(|s| s.verdict == Verdict::NotAvailable(DEGENERATE.into()));
        if degenerate {
            // The images are whatever each program makes of NaN pixels (the reference's
            // float-to-byte conversion gives 255 on AVX-512, ours 0): not a comparison.
            stages.push(Stage::new("image", Verdict::NotAvailable(DEGENERATE.into()), String::new(), None));
        } else {
            stages.push(self.image_stage(case)?);
        }
        Ok(stages)
    }
}

/// One chunk of a conditioning against the reference's: the least-squares factor `s` with
/// `s * ours ~ ref`, and the reference's `|mean| / rms` (the renormalisation's condition).
struct ChunkFit {
    factor: f64,
    mean_over_rms: f64,
}

impl ChunkFit {
    /// `None` when either side is all zeros.
    fn of(o: &[f32], r: &[f32]) -> Option<ChunkFit> {
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>();
        let (or, oo, rr) = (dot(o, r), dot(o, o), dot(r, r));
        if oo == 0.0 || rr == 0.0 {
            return None;
        }
        let n = r.len() as f64;
        let mean_over_rms = (r.iter().map(|&v| f64::from(v)).sum::<f64>() / n).abs() / (rr / n).sqrt();
        Some(ChunkFit { factor: or / oo, mean_over_rms })
    }

    /// The relative rms residual of `factor * o` against `r`.
    fn residual(&self, o: &[f32], r: &[f32]) -> f64 {
        let rr: f64 = r.iter().map(|&y| f64::from(y).powi(2)).sum();
        let resid: f64 = o.iter().zip(r).map(|(x, y)| (self.factor * f64::from(*x) - f64::from(*y)).powi(2)).sum();
        (resid / rr).sqrt()
    }
}

/// Whether two conditionings differ by one scale factor per chunk, the signature of the
/// weighting's mean renormalisation (`mean_before / mean_after`, applied to the whole chunk):
/// for each chunk of `chunk` values, the least-squares factor `s` with `s * ours ~ ref`, the
/// residual after it, and the reference's `|mean| / rms` after weighting (the
/// factor's condition: a mean near 0 next to the values' scale makes it a ratio of rounding
/// noise, so uncorrelated kernel drift decides it).
fn scale_note(ours: &[f32], reference: &[f32], chunk: usize, weighted: bool) -> String {
    let mut parts = Vec::new();
    for (k, (o, r)) in ours.chunks(chunk).zip(reference.chunks(chunk)).enumerate() {
        let Some(fit) = ChunkFit::of(o, r) else { continue };
        let (s, rel, mean_over_rms) = (fit.factor, fit.residual(o, r), fit.mean_over_rms);
        parts.push(format!(
            "chunk {k}: ref = {s:.4} x ours, residual rel_rms {rel:.1e}, ref |mean|/rms {mean_over_rms:.1e}"
        ));
    }
    let what = if weighted {
        "weighted prompt: a scale-only difference is the mean renormalisation's factor"
    } else {
        "unweighted prompt"
    };
    format!("; {what}; {}", parts.join("; "))
}

/// Below this `|mean| / rms` (of the reference's chunk after weighting), the weighting's mean
/// renormalisation `mean_before / mean_after` is a ratio of two near-zero means: rounding
/// differences of the size every chunk shows (rel_rms ~2e-3) move it by percents (measured on
/// the Vega fixture: 1.5e-4 gave a factor 1.21, 4.4e-4 gave 0.98, 2.6e-3 gave 1.0009). Random
/// weights with LayerNorm outputs make such chunks; a trained encoder's states carry a mean.
const ILL_CONDITIONED_MEAN: f64 = 1e-3;

/// The agreement of a weighted conditioning that differs only by the renormalisation factor of
/// ill-conditioned chunks ([`ILL_CONDITIONED_MEAN`]): each such chunk of ours is scaled by its
/// least-squares factor, every other chunk kept as it is, and the whole compared again under
/// `tol`. `Some(note)` naming the chunks and factors when that agrees; `None` when it does not
/// or when no chunk is ill-conditioned (then the difference stands).
fn ill_conditioned_agreement(ours: &[f32], reference: &[f32], chunk: usize, tol: &Tolerance) -> Result<Option<String>> {
    let mut adjusted: Vec<f64> = Vec::with_capacity(ours.len());
    let mut notes = Vec::new();
    for (k, (o, r)) in ours.chunks(chunk).zip(reference.chunks(chunk)).enumerate() {
        match ChunkFit::of(o, r).filter(|f| f.mean_over_rms < ILL_CONDITIONED_MEAN) {
            Some(f) => {
                notes.push(format!(
                    "chunk {k} (ref |mean|/rms {:.1e}) up to its factor {:.4}",
                    f.mean_over_rms, f.factor
                ));
                adjusted.extend(o.iter().map(|&v| f.factor * f64::from(v)));
            }
            None => adjusted.extend(o.iter().map(|&v| f64::from(v))),
        }
    }
    if notes.is_empty() {
        return Ok(None);
    }
    let d = Diff::of(&adjusted, &parity::to_f64(reference))?;
    Ok(tol.accepts(&d).then(|| {
        format!(
            "; => agree: the renormalisation is ill-conditioned in {}; compared so: rel_rms {:.2e} rel_max {:.2e}",
            notes.join(", "),
            d.rel_rms(),
            d.rel_max()
        )
    }))
}

/// A deterministic RGB pattern for img2img (gradients and a checker).
fn write_init_png(path: &Path, w: u32, h: u32, salt: u64) -> Result<()> {
    let mut px = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            let checker = if ((x / 16) + (y / 16) + salt as u32).is_multiple_of(2) { 40 } else { 0 };
            px.push(((x * 255) / w.max(1)) as u8);
            px.push(((y * 255) / h.max(1)) as u8);
            px.push((128 + checker) as u8);
        }
    }
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&px).with_context(|| format!("writing {}", path.display()))
}

/// The first stage of `stages` that disagrees.
fn first_divergence(stages: &[Stage]) -> Option<&Stage> {
    stages.iter().find(|s| s.verdict == Verdict::Differ)
}

/// Per-stage figures over all cases: compared, agreeing, and the worst and mean of the
/// mean/max absolute differences.
fn summary(all: &[(Case, Vec<Stage>)]) -> String {
    let mut out = String::new();
    for name in ["tokens", "neg tokens", "cond", "vector", "uncond", "neg vector", "unet", "vae", "image"] {
        let rows: Vec<&Stage> = all.iter().flat_map(|(_, s)| s.iter()).filter(|s| s.name == name).collect();
        if rows.is_empty() && name.contains("vector") {
            continue; // a family without a vector
        }
        let compared = rows.iter().filter(|s| !matches!(s.verdict, Verdict::NotAvailable(_))).count();
        let agree = rows.iter().filter(|s| s.verdict == Verdict::Agree).count();
        let diffs: Vec<&Diff> = rows.iter().filter_map(|s| s.diff.as_ref()).collect();
        let _ = write!(out, "  {name:<10} {agree}/{compared} agree ({} not available)", rows.len() - compared);
        if !diffs.is_empty() {
            let n = diffs.len() as f64;
            let worst_mean = diffs.iter().map(|d| d.mean_abs).fold(0.0, f64::max);
            let worst_max = diffs.iter().map(|d| d.max_abs).fold(0.0, f64::max);
            let avg_mean = diffs.iter().map(|d| d.mean_abs).sum::<f64>() / n;
            let avg_max = diffs.iter().map(|d| d.max_abs).sum::<f64>() / n;
            if name == "image" {
                let _ = write!(
                    out,
                    "; levels: mean|d| avg {avg_mean:.2} worst {worst_mean:.2}, max|d| avg {avg_max:.1} worst {worst_max:.0}"
                );
            } else {
                let worst_rel = diffs.iter().map(|d| d.rel_rms()).fold(0.0, f64::max);
                let avg_rel = diffs.iter().map(|d| d.rel_rms()).sum::<f64>() / n;
                let _ = write!(out, "; rel_rms avg {avg_rel:.2e} worst {worst_rel:.2e}, max|d| worst {worst_max:.2e}");
            }
        }
        out.push('\n');
    }
    out
}

/// Our outputs a fuzz run keeps per case, by stage: (stage, file suffix).
const OUR_OUTPUTS: &[(&str, &str)] = &[
    ("cond", "cond.ours.f32"),
    ("uncond", "uncond.ours.f32"),
    ("unet", "unet.ours.f32"),
    ("vae", "vae.ours.f32"),
    ("image", "ours.png"),
];

/// `cargo xtask parity --compare-runs DIR_A DIR_B`: our outputs of two fuzz runs of the same
/// cases (the same seed; e.g. two CPU plugin builds), stage by stage; the kernel-order floor
/// the cross-program figures are read against. Returns the table it prints.
fn compare_runs(a: &Path, b: &Path) -> Result<String> {
    let mut out = String::new();
    let _ = writeln!(out, "our outputs, {} against {}:", a.display(), b.display());
    let mut cases = 0;
    for &(stage, suffix) in OUR_OUTPUTS {
        let mut diffs = Vec::new();
        for entry in std::fs::read_dir(a).with_context(|| format!("reading {}", a.display()))? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            let Some(case) = name.strip_prefix("case").and_then(|r| r.strip_suffix(&format!(".{suffix}"))) else {
                continue;
            };
            if case.parse::<u64>().is_err() || !b.join(&name).is_file() {
                continue;
            }
            let d = if suffix.ends_with(".png") {
                parity::png_diff(&a.join(&name), &b.join(&name))?.0
            } else {
                let (sa, va) = parity::read_raw(&a.join(&name))?;
                let (sb, vb) = parity::read_raw(&b.join(&name))?;
                if sa != sb {
                    bail!("{name}: shape {sa:?} in {} but {sb:?} in {}", a.display(), b.display());
                }
                Diff::of(&parity::to_f64(&va), &parity::to_f64(&vb))?
            };
            diffs.push(d);
        }
        if diffs.is_empty() {
            continue;
        }
        cases = cases.max(diffs.len());
        let n = diffs.len() as f64;
        let worst = |f: &dyn Fn(&Diff) -> f64| diffs.iter().map(f).fold(0.0, f64::max);
        let avg = |f: &dyn Fn(&Diff) -> f64| diffs.iter().map(f).sum::<f64>() / n;
        if stage == "image" {
            let _ = writeln!(
                out,
                "  {stage:<7} {} cases; levels: mean|d| avg {:.2} worst {:.2}, max|d| avg {:.1} worst {:.0}",
                diffs.len(),
                avg(&|d| d.mean_abs),
                worst(&|d| d.mean_abs),
                avg(&|d| d.max_abs),
                worst(&|d| d.max_abs)
            );
        } else {
            let _ = writeln!(
                out,
                "  {stage:<7} {} cases; rel_rms avg {:.2e} worst {:.2e}, rel_max worst {:.2e}",
                diffs.len(),
                avg(&|d| d.rel_rms()),
                worst(&|d| d.rel_rms()),
                worst(&|d| d.rel_max())
            );
        }
    }
    if cases == 0 {
        bail!("no case output is in both {} and {} (runs of the same seed?)", a.display(), b.display());
    }
    Ok(out)
}

/// Entry point of `cargo xtask parity --fuzz ...`.
pub fn run(flags: &Flags, threads: u32) -> Result<()> {
    if let Some([a, b]) = flags.compare_runs.as_deref() {
        print!("{}", compare_runs(a, b)?);
        return Ok(());
    }
    let a = Args::from_flags(flags, threads)?;
    if a.prompts_only {
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        for i in 0..a.cases as u64 {
            let c = Case::draw(a.seed, i, a.max_steps);
            stdout.write_all(c.prompt.as_bytes())?;
            stdout.write_all(b"\0")?;
            stdout.write_all(c.negative.as_bytes())?;
            stdout.write_all(b"\0")?;
        }
        return Ok(());
    }
    let model = a.model.clone().context("--model")?;
    if !model.is_file() {
        bail!("--model {}: no such file", model.display());
    }
    let sdref = match &a.sdref {
        Some(p) => p.clone(),
        None => {
            eprintln!("fuzz: building the reference (release)");
            reference::build()?
        }
    };
    let sd_cli = match (&a.sd_cli, a.text_only) {
        (Some(p), _) => p.clone(),
        (None, true) => PathBuf::from("sd-cli (not used with --text-only)"),
        (None, false) => {
            eprintln!("fuzz: building sd-cli (release)");
            parity::build_sd_cli()?
        }
    };
    let stem = model.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let dir = a.out.join(format!("{stem}-seed{}", a.seed));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let cpu = parity::Cpu::new(a.threads)?;
    let files = ModelFiles::open_model(&model)?;
    let text = OurText::load(&cpu, &files)?;
    // The component stages: SD 1.x/2.x only (`parity::configs` knows no other family).
    let components = if a.text_only { None } else { parity::configs(&files).ok() };
    let unet = components.as_ref().map(|(_, cfg, _)| OurUnet::load(&cpu, &files, cfg)).transpose()?;
    let vae = if unet.is_some() { Some(OurVae::load(&cpu, &files)?) } else { None };
    let mut h = Harness { sdref, sd_cli, model, threads: a.threads, dir, text, unet, vae, text_only: a.text_only };

    let start = Instant::now();
    let mut all = Vec::new();
    for i in 0..a.cases as u64 {
        let mut case = Case::draw(a.seed, i, a.max_steps);
        if let Some(p) = &a.prompt {
            case.prompt = p.clone();
        }
        if let Some(n) = &a.negative {
            case.negative = n.clone();
        }
        if let Some(c) = a.clip_skip {
            case.clip_skip = c;
        }
        let t = Instant::now();
        let stages = h.run_case(&case).with_context(|| format!("case {i}: {}", case.describe()))?;
        println!("case {i}: {} ({:.0} s)", case.describe(), t.elapsed().as_secs_f64());
        for s in &stages {
            let v = match &s.verdict {
                Verdict::Agree => "agree".to_string(),
                Verdict::Differ => "DIFFER".to_string(),
                Verdict::NotAvailable(why) => format!("n/a ({why})"),
            };
            println!("    {:<10} {v:<8} {}", s.name, s.detail);
        }
        match first_divergence(&stages) {
            Some(s) => println!("    => first divergence: {}", s.name),
            None => println!("    => agree"),
        }
        all.push((case, stages));
    }
    let diverged: Vec<String> = all
        .iter()
        .filter_map(|(c, s)| first_divergence(s).map(|st| format!("case {} at {}", c.index, st.name)))
        .collect();
    println!(
        "\nfuzz summary: {} cases on {} (seed {}, {} threads, {:.0} s)\n{}",
        all.len(),
        h.model.display(),
        a.seed,
        a.threads,
        start.elapsed().as_secs_f64(),
        summary(&all)
    );
    if diverged.is_empty() {
        println!("every case agrees");
        Ok(())
    } else {
        bail!("{} of {} cases disagree: {}", diverged.len(), all.len(), diverged.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sd_models::text::ChunkConfig;

    fn parse(line: &str) -> Result<Args> {
        let p: crate::parity::Args = crate::parse_test(line)?;
        Args::from_flags(p.fuzz_flags(), p.threads())
    }

    #[test]
    fn parses_the_documented_command_line() {
        let a = parse("--fuzz 5 --model m.safetensors --seed 9 --threads 4 --max-steps 2").unwrap();
        assert_eq!((a.cases, a.seed, a.threads, a.max_steps, a.prompts_only, a.text_only), (5, 9, 4, 2, false, false));
        let t = parse("--fuzz 2 --model m --text-only --sdref /x/sdref --sd-cli /y/sd-cli").unwrap();
        assert!(t.text_only);
        assert_eq!((t.sdref, t.sd_cli), (Some(PathBuf::from("/x/sdref")), Some(PathBuf::from("/y/sd-cli"))));
        assert_eq!(a.model, Some(PathBuf::from("m.safetensors")));
        assert!(parse("--fuzz-prompts 3").unwrap().prompts_only);
        for (line, needle) in [
            ("--fuzz 3", "--model"),
            ("--fuzz 0 --model m", "positive"),
            ("--model m", "--fuzz"),
            ("--fuzz 2 --model m --bogus", "--bogus"),
        ] {
            let e = parse(line).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }

    #[test]
    fn compare_runs_pairs_the_same_case_and_stage() {
        let root = std::env::temp_dir().join(format!("fuzz-compare-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        parity::write_raw(&a.join("case0.unet.ours.f32"), &[2], &[1.0, 2.0], "t").unwrap();
        parity::write_raw(&b.join("case0.unet.ours.f32"), &[2], &[1.0, 2.5], "t").unwrap();
        // only in one run: not compared
        parity::write_raw(&a.join("case1.vae.ours.f32"), &[1], &[1.0], "t").unwrap();
        let table = compare_runs(&a, &b).unwrap();
        assert!(table.contains("unet    1 cases"), "{table}");
        assert!(!table.contains("vae"), "{table}");
        parity::write_raw(&b.join("case1.vae.ours.f32"), &[2], &[1.0, 1.0], "t").unwrap();
        assert!(format!("{:#}", compare_runs(&a, &b).unwrap_err()).contains("shape"));
        let empty = root.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        assert!(compare_runs(&a, &empty).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn cases_are_reproducible_and_independent_of_the_count() {
        assert_eq!(Case::draw(7, 3, 4), Case::draw(7, 3, 4));
        assert_ne!(Case::draw(7, 3, 4), Case::draw(8, 3, 4));
        let c = Case::draw(7, 3, 4);
        assert!(c.width.is_multiple_of(64) && c.height.is_multiple_of(64) && (1..=4).contains(&c.steps));
    }

    #[test]
    fn the_grammar_reaches_every_part_of_the_syntax() {
        // Over 300 cases, each feature of the prompt syntax appears (the generator's
        // probabilities make a miss astronomically unlikely; the seed makes it certain).
        let prompts: Vec<String> = (0..300)
            .flat_map(|i| {
                let c = Case::draw(1, i, 4);
                [c.prompt, c.negative]
            })
            .collect();
        let tok = ClipTokenizer::new();
        let has = |f: &dyn Fn(&str) -> bool| prompts.iter().any(|p| f(p));
        assert!(has(&|p| p.is_empty()), "empty prompt");
        assert!(has(&|p| p.contains("BREAK") && !p.contains("BREAKfast")), "BREAK");
        assert!(has(&|p| p.contains("\\(")), "escaped bracket");
        assert!(has(&|p| p.contains("((")), "nested brackets");
        assert!(has(&|p| p.contains('[')), "square brackets");
        assert!(has(&|p| p.contains(", (") && p.contains(":1.3)")), "weighted span after a comma");
        assert!(has(&|p| p.chars().any(|c| c as u32 > 0x1F000)), "emoji");
        assert!(has(&|p| p.contains("東京") || p.contains("café")), "non-ASCII letters");
        assert!(
            has(&|p| { tok.weighted_tokens(p, &ChunkConfig::sd1()).is_ok_and(|(ids, _)| ids.len() > 150) }),
            "prompts of three or more chunks"
        );
        // Several words inside one weighted span.
        assert!(has(&|p| p
            .split('(')
            .skip(1)
            .any(|s| s.split(':').next().is_some_and(|w| w.trim().contains(' ') && s.contains(':')))));
        let cases: Vec<Case> = (0..300).map(|i| Case::draw(1, i, 4)).collect();
        assert!(cases.iter().any(|c| c.cfg == 1.0) && cases.iter().any(|c| c.cfg > 1.0));
        assert!(cases.iter().any(|c| c.width != c.height) && cases.iter().any(|c| c.strength.is_some()));
        for m in SampleMethod::ALL {
            assert!(cases.iter().any(|c| c.method == m.name()), "sampler {}", m.name());
        }
    }

    #[test]
    fn flags_keep_dashed_prompts_as_values() {
        let mut c = Case::draw(1, 0, 2);
        c.prompt = "-looks like a flag".into();
        let f = c.flags(2);
        assert_eq!(f[0], "--prompt=-looks like a flag");
        assert!(f.contains(&format!("--width={}", c.width)) && f.contains(&format!("--height={}", c.height)));
    }

    fn vocab() -> (ClipTokenizer, HashMap<String, u32>) {
        let tok = ClipTokenizer::new();
        let id_of = (0..tok.vocab_size() as u32).map(|i| (tok.token_text(i).unwrap().to_owned(), i)).collect();
        (tok, id_of)
    }

    #[test]
    fn reference_log_lines_give_the_token_ids() {
        // What sd.cpp's tokenizer logs (bpe_tokenizer.cpp and the conditioner) for
        // `a "cat" BREAK (dog:1.2)`, among other lines.
        let (tok, id_of) = vocab();
        let log = "[sd.cpp DEBUG] conditioner.hpp:315  - parse 'a \"cat\" BREAK (dog:1.2)' to [['a \"cat\" ', 1], ]\n\
                   [sd.cpp DEBUG] bpe_tokenizer.cpp:210  - split prompt \"a \"cat\" \" to tokens [\"a</w>\", \"\"</w>\", \"cat</w>\", \"\"</w>\", ]\n\
                   [sd.cpp DEBUG] conditioner.hpp:343  - BREAK token encountered, padding current chunk by 71 tokens.\n\
                   [sd.cpp DEBUG] bpe_tokenizer.cpp:210  - split prompt \"\" to tokens []\n\
                   [sd.cpp DEBUG] bpe_tokenizer.cpp:210  - split prompt \"dog\" to tokens [\"dog</w>\", ]\n";
        let ids = reference_tokens(log, &id_of, sd_models::text::EOS_ID).unwrap();
        let mut want = tok.tokenize("a \"cat\"");
        want.resize(75, sd_models::text::EOS_ID);
        want.extend(tok.tokenize("dog"));
        assert_eq!(ids, want);
        // What the same prompt gives through our own tokenizer.
        let (ours, _) = tok.weighted_tokens("a \"cat\" BREAK (dog:1.2)", &ChunkConfig::sd1()).unwrap();
        assert_eq!(ours, want);

        let cut = "split prompt \"a\" to tokens [\"a</w>\", \"ca";
        assert!(reference_tokens(cut, &id_of, 0).unwrap_err().contains("cut"));
        assert!(reference_tokens("no tokenizer lines", &id_of, 0).unwrap_err().contains("-v"));
        let unknown = "split prompt \"a\" to tokens [\"zz\u{2603}</w>\", ]\n";
        assert!(reference_tokens(unknown, &id_of, 0).unwrap_err().contains("vocabulary"));
    }

    #[test]
    fn scale_only_differences_are_named() {
        // Chunk 0 differs by a factor 1.5 exactly, chunk 1 by noise.
        let ours: Vec<f32> = (0..8).map(|i| (i as f32 - 3.5) * 0.25 + 0.1).collect();
        let mut r: Vec<f32> = ours[..4].iter().map(|v| v * 1.5).collect();
        r.extend([1.0, -2.0, 0.5, 3.0]);
        let note = scale_note(&ours, &r, 4, true);
        assert!(note.contains("chunk 0: ref = 1.5000 x ours, residual rel_rms 3.0e-8"), "{note}");
        assert!(note.contains("chunk 1: ref = 1.4622 x ours, residual rel_rms 8.6e-1"), "{note}");
        assert!(note.contains("chunk 1:") && note.contains("mean renormalisation"), "{note}");
        assert!(scale_note(&ours, &r, 4, false).contains("unweighted"));
    }

    #[test]
    fn only_a_near_zero_mean_chunk_is_compared_up_to_its_factor() {
        let tol = Tolerance::rounding_points(77 * 8);
        // Chunk 0 has mean 0 (values +-v): a factor 1.2 there is the renormalisation's noise.
        let zero_mean: Vec<f32> = (0..8).map(|i| if i % 2 == 0 { 1.0 + i as f32 } else { -(i as f32) }).collect();
        let carried: Vec<f32> = (0..8).map(|i| 2.0 + i as f32 * 0.1).collect();
        let ours: Vec<f32> = zero_mean.iter().chain(&carried).copied().collect();
        let mut r: Vec<f32> = zero_mean.iter().map(|v| v * 1.2).collect();
        r.extend(&carried);
        let note = ill_conditioned_agreement(&ours, &r, 8, &tol).unwrap().expect("agrees up to chunk 0's factor");
        assert!(note.contains("chunk 0") && note.contains("1.2000") && !note.contains("chunk 1"), "{note}");
        // The same factor on the chunk that carries a mean is a real difference.
        let mut r2: Vec<f32> = zero_mean.clone();
        r2.extend(carried.iter().map(|v| v * 1.2));
        assert!(ill_conditioned_agreement(&ours, &r2, 8, &tol).unwrap().is_none());
        // Other differences in the near-zero chunk are not forgiven either.
        let mut r3 = r.clone();
        r3[1] += 3.0;
        assert!(ill_conditioned_agreement(&ours, &r3, 8, &tol).unwrap().is_none());
    }

    #[test]
    fn first_divergence_is_the_earliest_differing_stage() {
        let s = |name, verdict| Stage::new(name, verdict, String::new(), None);
        let stages = vec![
            s("tokens", Verdict::NotAvailable("cut".into())),
            s("cond", Verdict::Agree),
            s("uncond", Verdict::Differ),
            s("image", Verdict::Differ),
        ];
        assert_eq!(first_divergence(&stages).map(|s| s.name), Some("uncond"));
        assert!(first_divergence(&stages[..2]).is_none());
    }
}
