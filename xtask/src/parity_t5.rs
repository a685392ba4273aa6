//! `cargo xtask parity t5`: our T5-XXL encoder against the reference's on one `--t5xxl` file.
//!
//! ```text
//! cargo xtask parity t5 --t5xxl FILE [-p PROMPT]... [--threads N]
//! ```
//!
//! For each prompt, `sdref t5-encode` tokenizes it as FLUX's conditioner does and runs the
//! reference's `T5Runner` on each 256-id chunk (no mask); we tokenize with
//! `sd_models::text::T5Tokenizer` and run `T5Encoder` on the same file. The ids must be
//! equal; the raw hidden states (before the token weights) are compared with the bound of
//! the other text encoders, `Tolerance::rounding_points` over T5's rounding points.
//!
//! The reference builds all 24 blocks whatever the file holds, so the file must be a full
//! T5-XXL (`cargo xtask fixture t5xxl --type q8_0`: about 5 GB). Not run in CI.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::files::{ModelFiles, ModelSources};
use sd_models::loader::{dtype_of, FileSource};
use sd_models::text::t5::{t5_specs, T5Config, T5Encoder};
use sd_models::text::{T5Tokenizer, FLUX_T5_CHUNK_LEN};
use sd_sched::{Runner, Weights};

use crate::parity::{read_raw, Tolerance, Verdict};
use crate::reference;

/// f16 rounding points on T5's longest path: per block the seven matrix products and the
/// GELU table (8), over 24 blocks. With quantized weights both programs quantize the
/// activations to the same blocks, so the count is the same.
const T5_POINTS: u32 = 24 * 8;

/// `cargo xtask parity t5` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// A full T5-XXL file (safetensors or GGUF, all 24 blocks).
    #[arg(long = "t5xxl", value_name = "FILE")]
    t5xxl: PathBuf,
    /// Prompts (default: two, one of them weighted).
    #[arg(short = 'p', long = "prompt", value_name = "TEXT")]
    prompts: Vec<String>,
    /// CPU threads of both programs.
    #[arg(long = "threads", short = 't', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
}

/// Entry point of `cargo xtask parity t5`.
pub fn run(args: Args) -> Result<()> {
    let prompts = if args.prompts.is_empty() {
        vec!["a photo of a cat".to_owned(), "a (red:1.3) fox in [the snow], highly detailed".to_owned()]
    } else {
        args.prompts.clone()
    };
    let exe = reference::build()?;
    let dir = std::env::temp_dir().join(format!("parity-t5-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = args.t5xxl.to_str().context("the T5 path is not UTF-8")?;

    // Ours: load once.
    let cpu = crate::parity::Cpu::new(args.threads)?;
    let files = ModelFiles::open(&ModelSources { t5xxl: Some(args.t5xxl.clone()), ..Default::default() })?;
    let cfg = T5Config::xxl();
    let t0 = Instant::now();
    let mut w = Weights::new(t5_specs(&cfg, &dtype_of(&files), None))?;
    w.allocate(cpu.backend.device().buffer_type())?;
    w.load_from(&FileSource::new(&files))?;
    let encoder = T5Encoder::new(&cfg, &w)?;
    println!("ours: T5 loaded in {:.1} s", t0.elapsed().as_secs_f64());
    let mut runner = Runner::new("t5", cpu.backend.clone());
    let tokenizer = T5Tokenizer::new();

    let tol = Tolerance::rounding_points(T5_POINTS);
    let mut failed = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        let out = dir.join(format!("ref-{i}.f32"));
        let t = Instant::now();
        let status = Command::new(&exe)
            .args(["t5-encode", "--t5xxl", path, "-p", prompt, "-t", &args.threads.to_string(), "-o"])
            .arg(&out)
            .status()
            .context("running sdref t5-encode")?;
        if !status.success() {
            bail!("sdref t5-encode failed on {prompt:?}: {status}");
        }
        let ref_s = t.elapsed().as_secs_f64();
        let (shape, reference) = read_raw(&out)?;
        let side: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.with_extension("f32.json"))?)?;
        let ref_ids: Vec<u32> = serde_json::from_value(side["ids"].clone())?;

        let t = Instant::now();
        let chunks = tokenizer.tokenize_weighted(prompt, FLUX_T5_CHUNK_LEN)?;
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.ids.iter().copied()).collect();
        if ids != ref_ids {
            bail!("{prompt:?}: our T5 ids differ from the reference's\n ours {ids:?}\n ref  {ref_ids:?}");
        }
        let mut ours = Vec::new();
        for c in &chunks {
            ours.extend(encoder.encode_ids(&mut runner, &c.ids, FLUX_T5_CHUNK_LEN)?);
        }
        let ours_s = t.elapsed().as_secs_f64();
        let v = Verdict::of(&ours, &reference, tol)?;
        failed += usize::from(!v.pass);
        println!("t5 {prompt:?} {shape:?}: {}  sdref {ref_s:.1} s  ours {ours_s:.1} s  {}", v.figures, v.word());
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
        let a: Args = crate::parse_test("--t5xxl t5.gguf -p a -p b --threads 4").unwrap();
        assert_eq!((a.t5xxl, a.prompts, a.threads), (PathBuf::from("t5.gguf"), vec!["a".into(), "b".into()], 4));
        assert!(crate::parse_test::<Args>("-p a").is_err(), "--t5xxl is required");
    }
}
