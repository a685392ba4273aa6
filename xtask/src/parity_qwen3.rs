//! `cargo xtask parity qwen3`: our LLM encoder against the reference's on one `--llm` file.
//!
//! ```text
//! cargo xtask parity qwen3 --llm FILE [--arch qwen3|mistral|qwen2.5vl] [-p PROMPT]... [--out-layer L] [--threads N]
//! ```
//!
//! `--arch mistral` runs both as FLUX.2 dev's Mistral-Small-3.2 (its tokenizer and template),
//! `--arch qwen2.5vl` as Qwen-Image's Qwen2.5-VL text model (tokenized as for Z-Image).
//!
//! For each prompt, `sdref llm-encode` tokenizes it as Z-Image's conditioner does (its chat
//! template, the prompt's weights) and runs the reference's `LLMRunner` (`QWEN3`) with
//! `out_layers = {L}` (Z-Image: 35) and the causal mask; we tokenize with
//! `sd_models::text::Qwen2Tokenizer` and run `Qwen3Encoder` on the same file. The ids must be
//! equal; the hidden states (before the token weights) are compared with
//! `Tolerance::rounding_points` over the encoder's rounding points. The reference reads depth
//! and widths from the file, so a reduced fixture (`cargo xtask fixture qwen3 --layers 2
//! --hidden 256 --intermediate 512 -o F`) runs in seconds; a layer past its depth gives the
//! final norm's output in both programs.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::files::{ModelFiles, ModelSources};
use sd_models::loader::{dtype_of, FileSource};
use sd_models::text::qwen3::{qwen3_specs, Qwen3Config, Qwen3Encoder};
use sd_models::text::{ChatTemplate, MistralTokenizer, Qwen2Tokenizer};
use sd_sched::{Runner, Weights};

use crate::parity::{read_raw, Tolerance, Verdict};
use crate::reference;

/// f16 rounding points on one layer's longest path (seven matrix products and the attention's
/// two), per layer.
const POINTS_PER_LAYER: u32 = 9;

/// `cargo xtask parity qwen3` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// A Qwen3 file (safetensors with Hugging Face names or GGUF with llama.cpp's).
    #[arg(long = "llm", value_name = "FILE")]
    llm: PathBuf,
    /// Prompts (default: two, one of them weighted).
    #[arg(short = 'p', long = "prompt", value_name = "TEXT")]
    prompts: Vec<String>,
    /// The decoder: qwen3, mistral or qwen2.5vl.
    #[arg(long = "arch", default_value = "qwen3", value_parser = ["qwen3", "mistral", "qwen2.5vl"])]
    arch: String,
    /// The layer whose hidden states are compared (Z-Image: 35).
    #[arg(long = "out-layer", default_value_t = 35)]
    out_layer: u32,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
}

/// The configuration of the `arch` model in `files` ([`Qwen3Config::from_index_as`]).
fn config_of(files: &ModelFiles, arch: &str) -> Result<Qwen3Config> {
    let base = match arch {
        "mistral" => Qwen3Config::mistral_small_3_2(),
        "qwen2.5vl" => Qwen3Config::qwen25_vl_7b(),
        _ => Qwen3Config::qwen3_4b(),
    };
    Ok(Qwen3Config::from_index_as(files.index(), base)?)
}

/// Entry point of `cargo xtask parity qwen3`.
pub fn run(args: Args) -> Result<()> {
    let prompts = if args.prompts.is_empty() {
        vec!["a photo of a cat".to_owned(), "a (red:1.3) fox in [the snow], 日本語, highly detailed".to_owned()]
    } else {
        args.prompts.clone()
    };
    let exe = reference::build()?;
    let dir = std::env::temp_dir().join(format!("parity-qwen3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = args.llm.to_str().context("the LLM path is not UTF-8")?;

    let cpu = crate::parity::Cpu::new(args.threads)?;
    let files = ModelFiles::open(&ModelSources { llm: Some(args.llm.clone()), ..Default::default() })?;
    let cfg = config_of(&files, &args.arch)?;
    let mut w = Weights::new(qwen3_specs(&cfg, &dtype_of(&files), None))?;
    w.allocate(cpu.backend.device().buffer_type())?;
    w.load_from(&FileSource::new(&files))?;
    let encoder = Qwen3Encoder::new(&cfg, &w)?;
    let mut runner = Runner::new("llm", cpu.backend.clone());
    let tokenizer = Qwen2Tokenizer::new();
    let layers = (args.out_layer as usize).clamp(1, cfg.n_layers) as u32;
    let tol = Tolerance::rounding_points(POINTS_PER_LAYER * layers);
    println!("ours: {} layers, width {}, SwiGLU {}", cfg.n_layers, cfg.hidden, cfg.intermediate);

    let mut failed = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        let out = dir.join(format!("ref-{i}.f32"));
        let t = Instant::now();
        let status = Command::new(&exe)
            .args(["llm-encode", "--llm", path, "--arch", &args.arch, "-p", prompt])
            .args(["--out-layer", &args.out_layer.to_string()])
            .args(["-t", &args.threads.to_string(), "-o"])
            .arg(&out)
            .status()
            .context("running sdref llm-encode")?;
        if !status.success() {
            bail!("sdref llm-encode failed on {prompt:?}: {status}");
        }
        let ref_s = t.elapsed().as_secs_f64();
        let (shape, reference) = read_raw(&out)?;
        let side: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.with_extension("f32.json"))?)?;
        let ref_ids: Vec<u32> = serde_json::from_value(side["ids"].clone())?;

        let t = Instant::now();
        let (ids, _) = if args.arch == "mistral" {
            MistralTokenizer::new().tokenize_chat(&ChatTemplate::FLUX2_DEV, prompt)?
        } else {
            tokenizer.tokenize_chat(&ChatTemplate::Z_IMAGE, prompt)?
        };
        if ids != ref_ids {
            bail!("{prompt:?}: our ids differ from the reference's\n ours {ids:?}\n ref  {ref_ids:?}");
        }
        let ours = encoder.encode_ids(&mut runner, &ids, args.out_layer as usize)?;
        let ours_s = t.elapsed().as_secs_f64();
        let v = Verdict::of(&ours, &reference, tol)?;
        failed += usize::from(!v.pass);
        println!(
            "{} {prompt:?} {shape:?}: {}  sdref {ref_s:.1} s  ours {ours_s:.1} s  {}",
            args.arch,
            v.figures,
            v.word()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    if failed > 0 {
        bail!("{failed} of {} prompts outside the bound", prompts.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_line() {
        let a: Args = crate::parse_test("--llm q.gguf -p a --out-layer 3 --threads 4").unwrap();
        assert_eq!((a.llm, a.prompts, a.out_layer, a.threads), (PathBuf::from("q.gguf"), vec!["a".into()], 3, 4));
        assert!(crate::parse_test::<Args>("-p a").is_err(), "--llm is required");
    }
}
