//! `cargo xtask bench`: our `sd-cli` and the reference (`sdref`), alternating, same fixture and settings.
//!
//! ```text
//! cargo xtask bench [--model sd15|vega|flux] [--size 256|512|1024|both | --sizes 256,512,768,1024] [--type f16,q8_0,gguf:q4_K] [--runs N] [--threads N]
//!                   [--loras N] [--lora-apply-mode auto|immediately|at_runtime] [--reference both|default|llamafile]
//!                   [--server-requests N] [--server-size 64..128] [--server-only] [--sd-cli PATH]
//! ```
//!
//! After the table, the server row (`bench_server.rs`): `--server-requests` (10) jobs of
//! 2 steps at `--server-size` (128) to one `sd-cli serve` against as many `sd-cli` runs, with
//! the bytes of weights each staged anew, first and later.
//!
//! Three programs run as child processes on a fixture with the same flags: euler, seed 42,
//! the prompt "a photo of a cat", 256x256 with 4 steps and 512x512 with 2 steps, `--type` as
//! asked (`file`: none, each tensor as stored): ours, sd.cpp's default build (`cargo xtask reference`) and the build with ggml's
//! llamafile GEMM kernels (`cargo xtask reference --llamafile`, `cmake -DGGML_LLAMAFILE=ON`:
//! the fastest build of the reference a user can make from its options; `--reference` keeps
//! one of the two). Runs alternate (ours, ref, ref+llamafile, then backwards, ...) so
//! that a drift in machine load falls on every column; the ratios are ours over each.
//!
//! `--model`: `sd15` (default) the SD 1.5 f16 fixture (the cached
//! `sd15-fixture-seed42-f16.safetensors`, written if missing), cfg 7; `vega` Segmind Vega's
//! SDXL layout (both text encoders), cfg 7; `flux` a FLUX.1-dev DiT of full width with 1
//! double and 2 single blocks (1.3 GB at f16), the full T5-XXL at q8_0 (4.8 GB), CLIP-L
//! (`clip-l` fixture) and the FLUX VAE, as `--diffusion-model`, `--t5xxl`, `--clip_l`,
//! `--vae`, cfg 1. `--loras N` adds N kohya LoRA fixtures for that model (rank 4, seeds 1..N,
//! multiplier 1: `<lora:...>` tags for ours, `--lora` for the reference) applied in
//! `--lora-apply-mode` by both.
//!
//! What is measured, and how, is the same for both wherever it can be:
//! - whole run and peak RSS: measured here around the child process, the
//!   wall clock from spawn to reap and `ru_maxrss` from `wait4(2)` (the
//!   child's own high-water mark, exact, no polling);
//! - stage times: each program's own report. Ours come from `sd-cli`'s run
//!   report (`--report-json`, `sd_models::report::RunReport`: its stage and step
//!   times), the reference's from its `SDREF_TIMING` line (10 ms resolution).
//!   Our text-encode and decode columns add the load of that module's weights
//!   to the stage (the pipeline loads per phase; the report times both apart);
//!   the reference loads every weight once before encoding, so its stage times
//!   exclude loading, which is shown apart (`load_ms`, its `new_sd_ctx`, plus
//!   `tensor_load_ms`, sd.cpp's "loading tensors" time).

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::fixture::FixtureModel;
use sd_models::report::RunReport;

use crate::parity::{build_sd_cli, ensure_fixture};
use crate::reference;
use crate::workspace_root;

/// The prompt of every benchmark run.
pub const PROMPT: &str = "a photo of a cat";

/// One benchmark setting: image side and sampling steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Setting {
    pub(crate) side: u32,
    pub(crate) steps: u32,
}

pub(crate) const SETTING_256: Setting = Setting { side: 256, steps: 4 };
pub(crate) const SETTING_512: Setting = Setting { side: 512, steps: 2 };
/// SDXL's native size; one step (a step takes minutes on two cores).
pub(crate) const SETTING_1024: Setting = Setting { side: 1024, steps: 1 };

/// `--size` of the benchmarks that run one setting.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Size {
    /// 256x256, 4 steps.
    #[value(name = "256")]
    S256,
    /// 512x512, 2 steps.
    #[value(name = "512")]
    S512,
}

impl Size {
    pub(crate) fn setting(self) -> Setting {
        match self {
            Size::S256 => SETTING_256,
            Size::S512 => SETTING_512,
        }
    }
}

/// `cargo xtask bench`'s `--size`: one setting or both.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Sizes {
    /// 256x256, 4 steps.
    #[value(name = "256")]
    S256,
    /// 512x512, 2 steps.
    #[value(name = "512")]
    S512,
    /// 1024x1024, 1 step (SDXL's size).
    #[value(name = "1024")]
    S1024,
    /// 256 and 512, 256 first.
    Both,
}

/// `--model` of `cargo xtask bench`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Model {
    /// The SD 1.5 fixture.
    Sd15,
    /// Segmind Vega's SDXL layout.
    Vega,
    /// A reduced-depth FLUX.1-dev with the full T5-XXL.
    Flux,
    /// An SD3.5 Medium layout (24 MMDiT-X blocks of width 384) with full-size CLIP-L and
    /// CLIP-G inside, no T5-XXL.
    Sd3,
    /// FLUX.2 klein 4B's width (3072) at reduced depth (1 double + 2 single blocks) with a
    /// full-width Qwen3-4B of 30 layers at q8_0 (klein reads 27) and FLUX.2's VAE.
    Flux2,
}

/// `--reference`: which builds of the reference run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum References {
    /// sd.cpp's default build and the llamafile one.
    Both,
    /// sd.cpp's default build.
    Default,
    /// The llamafile build.
    Llamafile,
}

/// `cargo xtask bench` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// What to generate with.
    #[arg(long = "model", value_enum, default_value_t = Model::Sd15)]
    model: Model,
    /// LoRA fixtures to apply (0 to 3).
    #[arg(long = "loras", value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=3))]
    loras: u32,
    /// Reference images (`-r`) both programs edit with (0 to 3; --model flux2 only): patterns
    /// of 128x128, 200x80 and 96x160 pixels, auto-resized to the image's area by both.
    #[arg(long = "refs", value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=3))]
    refs: u32,
    /// How both programs apply the LoRAs.
    #[arg(long = "lora-apply-mode", value_name = "MODE", default_value = "auto", value_parser = ["auto", "immediately", "at_runtime"])]
    lora_apply_mode: String,
    /// Which builds of the reference run beside ours.
    #[arg(long = "reference", value_enum, default_value_t = References::Both)]
    reference: References,
    /// Image side (256: 4 steps, 512: 2 steps) or both.
    #[arg(long = "size", value_enum, default_value_t = Sizes::Both)]
    size: Sizes,
    /// Image sides to run instead of --size (e.g. 256,512,768,1024; 4 steps up to 256, 2 up
    /// to 512, else 1), followed by a cost-against-size table: per-step time and peak RSS per
    /// size, their growth exponents against pixels, and FLOP/s against a measured FMA peak.
    #[arg(long = "sizes", value_name = "256,512,...", value_delimiter = ',', value_parser = crate::bench_sizes::side, conflicts_with = "size")]
    sizes: Vec<u32>,
    /// Runs of each program per setting.
    #[arg(long = "runs", value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// CPU threads of each program.
    #[arg(long = "threads", short = 't', value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    threads: u32,
    /// Weight types (`--type` of every program; the fixtures are f16, FLUX's T5-XXL q8_0);
    /// `file` passes no `--type` (each tensor as stored); `gguf:TYPE` (sd15 and vega) runs both
    /// on the model's fixture written as a GGUF file of TYPE (q8_0, q4_K, q6_K, ...: the files
    /// people download; cached beside the f16 one), with no `--type`.
    #[arg(long = "type", value_name = "f16,q8_0", value_delimiter = ',', default_value = "f16", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    types: Vec<String>,
    /// Requests of the server row: N to one `sd-cli serve` against N `sd-cli` runs of the same
    /// job, 2 steps at `--server-size` (`bench_server.rs`); 0: no server row.
    #[arg(long = "server-requests", value_name = "N", default_value_t = 10)]
    server_requests: u32,
    /// Image side of the server row's job.
    #[arg(long = "server-size", value_name = "64|128", default_value_t = 128, value_parser = clap::value_parser!(u32).range(64..=128))]
    server_size: u32,
    /// Only the server row: no reference is built, no main table is run.
    #[arg(long = "server-only")]
    server_only: bool,
    /// The sd-cli to run instead of building one (`--release`) first, e.g. `target/debug/sd-cli`
    /// for a smoke run.
    #[arg(long = "sd-cli", value_name = "PATH")]
    sd_cli: Option<PathBuf>,
}

impl Args {
    fn settings(&self) -> Vec<Setting> {
        if !self.sizes.is_empty() {
            return self
                .sizes
                .iter()
                .map(|&side| Setting { side, steps: crate::bench_sizes::steps_for(side) })
                .collect();
        }
        match self.size {
            Sizes::S256 => vec![SETTING_256],
            Sizes::S512 => vec![SETTING_512],
            Sizes::S1024 => vec![SETTING_1024],
            Sizes::Both => vec![SETTING_256, SETTING_512],
        }
    }
}

/// A finished child process with what it printed and what it cost.
#[derive(Debug)]
pub struct Measured {
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
    /// Exit code; `None` when a signal ended it.
    pub code: Option<i32>,
    /// Wall clock from spawn to reap.
    pub wall_s: f64,
    /// The child's peak resident set (`ru_maxrss` of `wait4`), KiB.
    pub max_rss_kib: u64,
}

impl Measured {
    /// Whether it exited with status 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// An error naming `what` with the end of its stderr, unless it succeeded.
    pub fn check(&self, what: &str) -> Result<()> {
        if self.success() {
            return Ok(());
        }
        let both = format!("{}{}", self.stdout, self.stderr);
        let tail: Vec<&str> = both.lines().rev().take(25).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{what} failed ({}); the end of its output:\n{}",
            self.code.map_or_else(|| "killed by a signal".to_owned(), |c| format!("exit code {c}")),
            tail.join("\n")
        )
    }
}

/// Runs `cmd` to completion, capturing its output, and measures its wall time and
/// peak RSS with `wait4`, the same way for every program.
pub fn run_measured(cmd: &mut Command) -> Result<Measured> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().with_context(|| format!("cannot start {:?}", cmd.get_program()))?;
    let pid = libc::pid_t::try_from(child.id()).context("child pid out of range")?;
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = pipe(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = pipe(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is our own child, not yet reaped (std's `Child` never waited on
        // it); `status` and `usage` are valid for writes.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e).context("wait4 on the child");
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    // The child is reaped: `child` must not be waited on again; dropping it does nothing.
    drop(child);
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    // ru_maxrss is in KiB on Linux.
    let max_rss_kib = u64::try_from(usage.ru_maxrss).unwrap_or(0);
    Ok(Measured { stdout, stderr, code, wall_s, max_rss_kib })
}

/// Stage times of one run, seconds; `None` where the program did not report it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// Text encoding (prompt and negative prompt).
    pub text_encode_s: Option<f64>,
    /// Each sampling step (with cfg: cond and uncond evaluations).
    pub steps_s: Vec<f64>,
    /// VAE decoding.
    pub decode_s: Option<f64>,
    /// The program's own generation time (ours: the sum of its report's stages; ref: `generate_image`).
    pub generation_s: Option<f64>,
    /// Weight loading: ours, the sum of the report's load stages (`te load`, `unet load`,
    /// `vae load`: reading, converting, LoRA merging, staging); the reference's `new_sd_ctx`
    /// plus sd.cpp's tensor loading (its LoRA merge comes later, inside generation).
    pub load_s: Option<f64>,
}

/// Our stage times from a run report: text encode and decode each with the load of their
/// module, generation as the sum of every stage (from the first load to the images written).
pub fn ours_timings(r: &RunReport) -> Timings {
    let sum = |names: &[&str]| -> Option<f64> {
        let v: Vec<f64> = r.stages.iter().filter(|s| names.contains(&s.name.as_str())).map(|s| s.seconds).collect();
        (!v.is_empty()).then(|| v.iter().sum())
    };
    Timings {
        text_encode_s: sum(&["te load", "text encode"]),
        steps_s: r.steps.iter().map(|s| s.seconds).collect(),
        decode_s: sum(&["vae load", "decode"]),
        generation_s: (!r.stages.is_empty()).then(|| r.stages.iter().map(|s| s.seconds).sum()),
        load_s: {
            let v: Vec<f64> = r.stages.iter().filter(|s| s.name.ends_with(" load")).map(|s| s.seconds).collect();
            (!v.is_empty()).then(|| v.iter().sum())
        },
    }
}

/// The run report `sd-cli` wrote to `path` (`--report-json`, see [`our_command`]).
pub fn read_report(path: &Path) -> Result<RunReport> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read the run report {}", path.display()))?;
    RunReport::from_json(&text).with_context(|| format!("run report {}", path.display()))
}

/// Where [`our_command`] asks `sd-cli` to write the run report of the image `out`.
pub fn report_path(out: &Path) -> PathBuf {
    out.with_extension("json")
}

/// Parses the reference's `SDREF_TIMING` line.
pub fn parse_ref(stderr: &str) -> Timings {
    let Some(f) = reference::parse_tagged_line(stderr, "SDREF_TIMING") else {
        return Timings::default();
    };
    let ms = |k: &str| reference::field_f64(&f, k).map(|v| v / 1000.0);
    let steps_s = f
        .get("step_ms")
        .map(|s| s.split(',').filter_map(|v| v.parse::<f64>().ok()).map(|v| v / 1000.0).collect())
        .unwrap_or_default();
    Timings {
        text_encode_s: ms("text_encode_ms"),
        steps_s,
        decode_s: ms("decode_ms"),
        generation_s: ms("generate_ms"),
        load_s: match (ms("load_ms"), ms("tensor_load_ms")) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        },
    }
}

/// The median of `v` (mean of the middle two for an even count); `None` when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Some(if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 })
}

/// One program's runs at one setting.
#[derive(Debug, Default)]
struct Side {
    timings: Vec<Timings>,
    wall_s: Vec<f64>,
    rss_kib: Vec<u64>,
    /// The reference's self-reported peak (getrusage SELF), for a cross-check.
    self_rss_kib: Vec<u64>,
}

impl Side {
    fn step_median(&self) -> Option<f64> {
        median(&self.timings.iter().flat_map(|t| t.steps_s.iter().copied()).collect::<Vec<_>>())
    }
    fn med(&self, f: impl Fn(&Timings) -> Option<f64>) -> Option<f64> {
        median(&self.timings.iter().filter_map(f).collect::<Vec<_>>())
    }
    fn wall(&self) -> Option<f64> {
        median(&self.wall_s)
    }
    fn rss_mib(&self) -> Option<f64> {
        self.rss_kib.iter().max().map(|&k| k as f64 / 1024.0)
    }
}

pub(crate) fn our_command(exe: &Path, model: &Path, s: Setting, threads: u32, out: &Path) -> Command {
    let model = [OsString::from("-m"), model.as_os_str().to_owned()];
    our_command_with(exe, &model, "7", PROMPT, s, threads, out)
}

/// [`our_command`] with other model flags (`-m FILE`, or a FLUX model's component files), cfg
/// scale and prompt.
fn our_command_with(
    exe: &Path,
    model: &[OsString],
    cfg: &str,
    prompt: &str,
    s: Setting,
    threads: u32,
    out: &Path,
) -> Command {
    let mut c = Command::new(exe);
    c.args(model);
    c.args(["-p", prompt, "-W", &s.side.to_string(), "-H", &s.side.to_string()]);
    c.args(["--steps", &s.steps.to_string(), "--sampling-method", "euler", "--cfg-scale", cfg, "-s", "42"]);
    c.args(["-t", &threads.to_string(), "-o"]).arg(out);
    c.arg("--report-json").arg(report_path(out));
    c.env("NO_COLOR", "1");
    c
}

pub(crate) fn ref_command(exe: &Path, model: &Path, s: Setting, threads: u32, out: &Path) -> Command {
    let model = [OsString::from("-m"), model.as_os_str().to_owned()];
    ref_command_with(exe, &model, "7", s, threads, out)
}

/// [`ref_command`] with other model flags and cfg scale (the prompt is [`PROMPT`]).
fn ref_command_with(exe: &Path, model: &[OsString], cfg: &str, s: Setting, threads: u32, out: &Path) -> Command {
    let mut c = Command::new(exe);
    c.arg("txt2img").args(model);
    c.args(["-p", PROMPT, "-W", &s.side.to_string(), "-H", &s.side.to_string()]);
    c.args(["--steps", &s.steps.to_string(), "--sampling-method", "euler", "--cfg-scale", cfg, "-s", "42"]);
    c.args(["-t", &threads.to_string(), "-o"]).arg(out);
    c
}

/// The family and file type a `--type` entry `gguf:TYPE` asks for; `None` for other entries.
fn gguf_type(model: Model, ty: &str) -> Result<Option<(FixtureModel, sd_models::fixture::WeightType)>> {
    let Some(name) = ty.strip_prefix("gguf:") else { return Ok(None) };
    let family = match model {
        Model::Sd15 => FixtureModel::Sd15,
        Model::Vega => FixtureModel::Vega,
        Model::Flux | Model::Sd3 | Model::Flux2 => {
            anyhow::bail!("--type {ty}: GGUF fixtures are written for --model sd15 and vega only")
        }
    };
    let wtype = sd_models::fixture::WeightType::parse(name).ok_or_else(|| {
        anyhow::anyhow!("--type {ty}: {}", sd_models::fixture::FixtureError::UnknownType(name.to_owned()))
    })?;
    if !wtype.is_quantized() {
        anyhow::bail!(
            "--type {ty}: not a quantized type (a GGUF fixture of {wtype} would be the plain --type {wtype})"
        );
    }
    Ok(Some((family, wtype)))
}

/// The files and settings of a `--model`, with its LoRA fixtures.
#[derive(Clone)]
struct Workload {
    /// What the table heading calls it.
    label: String,
    /// The model flags, the same for both programs.
    model: Vec<OsString>,
    cfg: &'static str,
    /// LoRA files (multiplier 1 each) and their directory.
    loras: Vec<PathBuf>,
    lora_dir: PathBuf,
    lora_mode: String,
}

impl Workload {
    /// Writes (or finds) the files of `args.model` and `args.loras` LoRAs under `dir`.
    fn prepare(args: &Args, dir: &Path) -> Result<Workload> {
        use sd_models::fixture::lora::{write_flux_lora, write_lora, write_sdxl_lora, LoraFixture, LoraLayout};
        use sd_models::fixture::{self, flux, flux_vae, t5, FileFormat, WeightType};
        let lora_dir = dir.join("loras");
        std::fs::create_dir_all(&lora_dir).with_context(|| format!("cannot create {}", lora_dir.display()))?;
        let flux_cfg = flux::reduced(3072, 1, 2, false);
        let (label, model, cfg) = match args.model {
            Model::Sd15 => {
                ("sd15 fixture".to_owned(), vec!["-m".into(), ensure_fixture(FixtureModel::Sd15)?.into()], "7")
            }
            Model::Vega => {
                ("vega fixture".to_owned(), vec!["-m".into(), ensure_fixture(FixtureModel::Vega)?.into()], "7")
            }
            Model::Flux => {
                std::fs::create_dir_all(fixture::cache_dir())?;
                let dit = flux::cached_flux_path(&flux_cfg, 42, WeightType::F16);
                if !dit.exists() {
                    eprintln!("bench: writing the FLUX DiT fixture {}", dit.display());
                    flux::write_flux(&dit, &flux_cfg, 42, WeightType::F16, FileFormat::Safetensors)?;
                }
                let t5 = t5::cached_t5xxl_path(24, 42, WeightType::Q8_0);
                if !t5.exists() {
                    eprintln!("bench: writing the T5-XXL fixture {} (4.8 GB)", t5.display());
                    let cfg = sd_models::text::t5::T5Config::xxl();
                    t5::write_t5xxl(&t5, &cfg, 42, WeightType::Q8_0, FileFormat::Gguf)?;
                }
                let vae = flux_vae::cached_flux_vae_path(42, WeightType::F16);
                if !vae.exists() {
                    flux_vae::write_flux_vae(&vae, 42, WeightType::F16, FileFormat::Safetensors)?;
                }
                let clip = fixture::cached_clip_l_path(42, WeightType::F16);
                if !clip.exists() {
                    fixture::write_clip_l(&clip, 42, WeightType::F16, FileFormat::Safetensors)?;
                }
                let mut m: Vec<OsString> = Vec::new();
                for (flag, file) in [("--diffusion-model", dit), ("--t5xxl", t5), ("--clip_l", clip), ("--vae", vae)] {
                    m.push(flag.into());
                    m.push(file.into());
                }
                ("flux fixture (width 3072, 1 double + 2 single blocks; T5-XXL q8_0)".to_owned(), m, "1")
            }
            Model::Sd3 => {
                use sd_models::family::sd3::mmdit::MmditConfig;
                use sd_models::fixture::sd3;
                std::fs::create_dir_all(fixture::cache_dir())?;
                let base = MmditConfig::sd35_medium();
                let side = base.pos_embed_max_size;
                let cfg = sd3::reduced(base, 384, 24, side);
                let path = sd3::cached_sd3_path(&cfg, 42, WeightType::F16, true);
                if !path.exists() {
                    eprintln!("bench: writing the SD3 fixture {}", path.display());
                    sd3::write_sd3(&path, &cfg, 42, None, WeightType::F16, FileFormat::Safetensors, true)?;
                }
                let label = "sd3 fixture (SD3.5 Medium layout, width 384, 24 blocks; CLIP-L, CLIP-G, no T5)";
                (label.to_owned(), vec!["-m".into(), path.into()], "7")
            }
            Model::Flux2 => {
                use sd_models::fixture::qwen3;
                use sd_models::text::qwen3::Qwen3Config;
                std::fs::create_dir_all(fixture::cache_dir())?;
                let cfg = flux::reduced_flux2(3072, 1, 2, 3 * 2560);
                let dit = flux::cached_flux2_path(&cfg, 42, None, WeightType::F16);
                if !dit.exists() {
                    eprintln!("bench: writing the FLUX.2 klein DiT fixture {}", dit.display());
                    flux::write_flux2(&dit, &cfg, 42, None, WeightType::F16, FileFormat::Safetensors)?;
                }
                let llm = fixture::cache_dir().join("qwen3-fixture-seed42-q8_0-30l-h2560.gguf");
                if !llm.exists() {
                    eprintln!("bench: writing the Qwen3 fixture {} (3.5 GB)", llm.display());
                    let cfg = Qwen3Config { n_layers: 30, ..Qwen3Config::qwen3_4b() };
                    qwen3::write_qwen3(&llm, &cfg, 42, None, WeightType::Q8_0, FileFormat::Gguf)?;
                }
                let vae = flux_vae::cached_flux2_vae_path(42, WeightType::F16);
                if !vae.exists() {
                    flux_vae::write_flux2_vae(&vae, 42, WeightType::F16, FileFormat::Safetensors)?;
                }
                let mut m: Vec<OsString> = Vec::new();
                for (flag, file) in [("--diffusion-model", dit), ("--llm", llm), ("--vae", vae)] {
                    m.push(flag.into());
                    m.push(file.into());
                }
                let label = "flux2 fixture (klein 4B's width 3072, 1 double + 2 single blocks; Qwen3-4B width, 30 layers, q8_0)";
                (label.to_owned(), m, "1")
            }
        };
        let (label, model) = if args.refs == 0 {
            (label, model)
        } else if args.model != Model::Flux2 {
            anyhow::bail!("--refs: reference images are benchmarked with --model flux2 only");
        } else {
            let mut model = model;
            for (k, (w, h)) in
                [(128usize, 128usize), (200, 80), (96, 160)].into_iter().take(args.refs as usize).enumerate()
            {
                let rgb = (0..w * h)
                    .flat_map(|i| {
                        let (x, y) = (i % w, i / w);
                        [(x * 5 + y * 3 + k * 40) as u8, (x * y / 7) as u8, 255u8.wrapping_sub((x + 2 * y) as u8)]
                    })
                    .collect();
                let img = sd_models::pipeline::Image { width: w, height: h, rgb };
                let path = dir.join(format!("bench-ref-{w}x{h}.png"));
                sd_models::image_io::save_image(&path, &img, sd_models::image_io::OutputFormat::Png, None)?;
                model.push("-r".into());
                model.push(path.into());
            }
            (format!("{label}, {} reference image(s)", args.refs), model)
        };
        let mut loras = Vec::new();
        for k in 1..=args.loras as u64 {
            let req = LoraFixture { layout: LoraLayout::Kohya, rank: 4, seed: k, scale: 0.05, text_encoder: true };
            let name = format!("{:?}-{k}", args.model).to_lowercase();
            let path = lora_dir.join(format!("bench-{name}.safetensors"));
            match args.model {
                Model::Sd15 => write_lora(&path, &req)?,
                Model::Vega => write_sdxl_lora(&path, &fixture::UnetLayout::vega(), &req)?,
                Model::Flux => write_flux_lora(&path, &flux_cfg, &req)?,
                Model::Sd3 => anyhow::bail!("--loras: SD3 takes no LoRA yet"),
                Model::Flux2 => anyhow::bail!("--loras: the FLUX.2 bench takes no LoRA"),
            };
            loras.push(path);
        }
        let label = match loras.len() {
            0 => label,
            n => format!("{label}, {n} LoRA(s) {}", args.lora_apply_mode),
        };
        Ok(Workload { label, model, cfg, loras, lora_dir, lora_mode: args.lora_apply_mode.clone() })
    }

    /// This workload for the `--type` entry `ty`: for `gguf:TYPE`, the model's fixture as a
    /// GGUF file of TYPE (written once, cached), else unchanged.
    fn for_type(&self, model: Model, ty: &str) -> Result<Workload> {
        let Some((family, wtype)) = gguf_type(model, ty)? else { return Ok(self.clone()) };
        let path = sd_models::fixture::cached_path(family, 42, wtype);
        if !path.is_file() {
            eprintln!("bench: writing the {} fixture as {} ({})", family.name(), wtype, path.display());
        }
        let (path, _) = sd_models::fixture::ensure_cached(family, 42, wtype)
            .with_context(|| format!("cannot write the {} fixture as {wtype}", family.name()))?;
        Ok(Workload { model: vec!["-m".into(), path.into()], ..self.clone() })
    }

    fn ours(&self, exe: &Path, s: Setting, threads: u32, out: &Path) -> Command {
        let mut prompt = PROMPT.to_owned();
        for l in &self.loras {
            let stem = l.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            prompt += &format!("<lora:{stem}:1>");
        }
        let mut c = our_command_with(exe, &self.model, self.cfg, &prompt, s, threads, out);
        if !self.loras.is_empty() {
            c.arg("--lora-model-dir").arg(&self.lora_dir).args(["--lora-apply-mode", &self.lora_mode]);
        }
        c
    }

    fn reference(&self, exe: &Path, s: Setting, threads: u32, out: &Path) -> Command {
        let mut c = ref_command_with(exe, &self.model, self.cfg, s, threads, out);
        for l in &self.loras {
            let mut arg = l.as_os_str().to_owned();
            arg.push(":1");
            c.arg("--lora").arg(arg);
        }
        if !self.loras.is_empty() {
            c.args(["--lora-apply-mode", &self.lora_mode]);
        }
        c
    }
}

pub(crate) fn fmt_s(v: Option<f64>) -> String {
    v.map_or_else(|| "?".to_owned(), |v| format!("{v:.2} s"))
}

pub(crate) fn fmt_ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "?".to_owned(),
    }
}

/// A program the benchmark runs: ours or one build of the reference.
struct Contender {
    /// Its column heading.
    label: &'static str,
    exe: PathBuf,
    ours: bool,
}

/// The programs of `cargo xtask bench`, ours first: sd.cpp's default build and the build with
/// ggml's llamafile GEMM kernels (`cmake -DGGML_LLAMAFILE=ON`, the fastest a user can build).
fn contenders(which: References, ours: PathBuf) -> Result<Vec<Contender>> {
    let mut who = vec![Contender { label: "ours", exe: ours, ours: true }];
    if which != References::Llamafile {
        who.push(Contender { label: "reference", exe: reference::build()?, ours: false });
    }
    if which != References::Default {
        let exe = reference::build_kernels(reference::Kernels::Llamafile)?;
        who.push(Contender { label: "ref+llamafile", exe, ours: false });
    }
    Ok(who)
}

#[allow(clippy::too_many_arguments)]
fn print_table(w: &Workload, s: Setting, ty: &str, threads: u32, runs: usize, who: &[Contender], sides: &[Side]) {
    println!();
    println!(
        "{} ({ty}), {2}x{2}, {3} steps euler, cfg {1}, seed 42, -t {threads}, {runs} run(s) each, alternating",
        w.label, w.cfg, s.side, s.steps
    );
    let refs: Vec<usize> = (1..who.len()).collect();
    let mut head = format!("{:<28}", "");
    for c in who {
        head += &format!(" {:>14}", c.label);
    }
    for &r in &refs {
        head += &format!(" {:>18}", format!("ours/{}", who[r].label));
    }
    println!("{head}");
    let row = |name: &str, f: &dyn Fn(&Side) -> Option<f64>, fmt: &dyn Fn(Option<f64>) -> String| {
        let mut line = format!("{name:<28}");
        for side in sides {
            line += &format!(" {:>14}", fmt(f(side)));
        }
        for &r in &refs {
            line += &format!(" {:>18}", fmt_ratio(f(&sides[0]), f(&sides[r])));
        }
        println!("{line}");
    };
    let secs = |v: Option<f64>| fmt_s(v);
    let mib = |v: Option<f64>| v.map_or_else(|| "?".to_owned(), |v| format!("{v:.0} MiB"));
    row("per step (median)", &|x| x.step_median(), &secs);
    row("text encode (1)", &|x| x.med(|t| t.text_encode_s), &secs);
    row("decode (1)", &|x| x.med(|t| t.decode_s), &secs);
    row("generation (2)", &|x| x.med(|t| t.generation_s), &secs);
    row("weight load (3)", &|x| x.med(|t| t.load_s), &secs);
    row("whole run (wall)", &|x| x.wall(), &secs);
    row("peak RSS (wait4 ru_maxrss)", &|x| x.rss_mib(), &mib);
    for (c, side) in who.iter().zip(sides).filter(|(c, _)| !c.ours) {
        let self_rss = side.self_rss_kib.iter().max().map(|&k| k as f64 / 1024.0);
        println!(
            "  {}: weight loading (new_sd_ctx + loading tensors) {}; self-reported peak RSS {}",
            c.label,
            fmt_s(side.med(|t| t.load_s)),
            mib(self_rss)
        );
    }
    for (c, side) in who.iter().zip(sides) {
        println!("  all steps, {}: {:?}", c.label, side.timings.iter().map(|t| t.steps_s.clone()).collect::<Vec<_>>());
    }
    println!("  (1) ours includes loading that module's weights; the reference's excludes it (above).");
    println!("  (2) ours: the stages of its run report, first weight load to the PNG written; reference: generate_image only.");
    println!("  (3) ours: its load stages (a LoRA merged immediately is merged there); reference: new_sd_ctx + loading tensors.");
}

/// The cost-against-size tables of `--sizes` (`bench_sizes.rs`): one profiled run of ours per
/// size counts the diffusion model's FLOPs per step, the FMA probe gives the machine's peak.
fn print_growth(
    args: &Args,
    work: &Workload,
    ours: &Path,
    dir: &Path,
    who: &[Contender],
    results: &[(Setting, &str, Vec<Side>)],
) -> Result<()> {
    let mut flops = Vec::new();
    for &side in &args.sizes {
        let s = Setting { side, steps: 1 };
        let out = dir.join(format!("profile-{side}.png"));
        let mut cmd = work.ours(ours, s, args.threads, &out);
        cmd.arg("--profile");
        eprintln!("bench: counting FLOPs of one step at {side}x{side} (sd-cli --profile)");
        let m = run_measured(&mut cmd)?;
        let f = m.check("sd-cli --profile").ok().and_then(|_| read_report(&report_path(&out)).ok()).and_then(|r| {
            let unet = r.runners.iter().find(|r| r.name == "unet" || r.name == "diffusion")?;
            Some(unet.profile.as_ref()?.ops.values().map(|e| e.flops).sum::<f64>())
        });
        flops.push(f);
    }
    eprintln!("bench: measuring this machine's FMA peak on {} thread(s)", args.threads);
    let peak = crate::bench_sizes::fma_peak_gflops(args.threads);
    for ty in &args.types {
        let columns: Vec<(&str, Vec<crate::bench_sizes::Point>)> = who
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let points = results
                    .iter()
                    .filter(|(_, t, _)| t == ty)
                    .map(|(s, _, sides)| crate::bench_sizes::Point {
                        side: s.side,
                        step_s: sides[k].step_median(),
                        rss_mib: sides[k].rss_mib(),
                    })
                    .collect();
                (c.label, points)
            })
            .collect();
        crate::bench_sizes::print(&work.label, ty, args.threads, &columns, &flops, peak);
    }
    Ok(())
}

/// Entry point of `cargo xtask bench ...` (`args` excludes the subcommand name).
pub fn run(args: Args) -> Result<()> {
    for ty in &args.types {
        gguf_type(args.model, ty)?;
    }
    let root = workspace_root();
    let ours = match &args.sd_cli {
        Some(exe) => exe.clone(),
        None => {
            eprintln!("bench: building sd-cli (release)");
            build_sd_cli()?
        }
    };
    let who = if args.server_only {
        Vec::new()
    } else {
        eprintln!("bench: building the reference");
        contenders(args.reference, ours.clone())?
    };
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let work = Workload::prepare(&args, &dir)?;
    let mut results: Vec<(Setting, &str, Vec<Side>)> = Vec::new();
    let settings = if args.server_only { Vec::new() } else { args.settings() };
    for s in settings {
        for ty in &args.types {
            let work = work.for_type(args.model, ty)?;
            let mut sides: Vec<Side> = who.iter().map(|_| Side::default()).collect();
            for i in 0..args.runs {
                // forward on even rounds, backward on odd ones: load drift falls on every column
                let mut order: Vec<usize> = (0..who.len()).collect();
                if i % 2 == 1 {
                    order.reverse();
                }
                for k in order {
                    let c = &who[k];
                    let file = format!("{}-{ty}-{}-{i}.png", c.label.replace('+', "-"), s.side);
                    let out: PathBuf = dir.join(file);
                    let mut cmd = if c.ours {
                        work.ours(&c.exe, s, args.threads, &out)
                    } else {
                        work.reference(&c.exe, s, args.threads, &out)
                    };
                    if ty != "file" && !ty.starts_with("gguf:") {
                        cmd.args(["--type", ty]);
                    }
                    eprintln!("bench: {0}x{0} {ty} run {1}/{2}: {3}", s.side, i + 1, args.runs, c.label);
                    let m = run_measured(&mut cmd)?;
                    m.check(&format!("{} at {1}x{1} ({ty})", c.label, s.side))?;
                    let t = if c.ours { ours_timings(&read_report(&report_path(&out))?) } else { parse_ref(&m.stderr) };
                    if t.steps_s.len() != s.steps as usize {
                        eprintln!(
                            "bench: warning: found {} step times in {}'s report, expected {}",
                            t.steps_s.len(),
                            c.label,
                            s.steps
                        );
                    }
                    if t.text_encode_s.is_none() || t.decode_s.is_none() {
                        eprintln!(
                            "bench: warning: {}'s text-encode or decode time is missing from its report",
                            c.label
                        );
                    }
                    let side = &mut sides[k];
                    if !c.ours {
                        if let Some(kib) = reference::parse_tagged_line(&m.stderr, "SDREF_RSS")
                            .and_then(|f| reference::field_f64(&f, "peak_rss_kib"))
                        {
                            side.self_rss_kib.push(kib as u64);
                        }
                    }
                    side.timings.push(t);
                    side.wall_s.push(m.wall_s);
                    side.rss_kib.push(m.max_rss_kib);
                }
            }
            results.push((s, ty.as_str(), sides));
        }
    }
    let server = if args.server_requests > 0 {
        let s = Setting { side: args.server_size, steps: 2 };
        let row = crate::bench_server::run(
            &ours,
            &work.model,
            work.cfg,
            s,
            args.threads,
            args.server_requests as usize,
            &dir,
        )?;
        Some((s, row))
    } else {
        None
    };
    let mut load = String::new();
    if let Ok(l) = std::fs::read_to_string("/proc/loadavg") {
        load = l.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    }
    for (s, ty, sides) in &results {
        print_table(&work, *s, ty, args.threads, args.runs as usize, &who, sides);
    }
    if !args.sizes.is_empty() && !results.is_empty() {
        print_growth(&args, &work, &ours, &dir, &who, &results)?;
    }
    if let Some((s, row)) = &server {
        // The row's job has no LoRA whatever --loras says.
        let label = work.label.split(", ").next().unwrap_or_default();
        crate::bench_server::print(row, label, *s, args.threads);
    }
    println!("\nload average at the end (1, 5, 15 min): {load}");
    for (s, ty, sides) in &results {
        let ratios: Vec<String> = (1..who.len())
            .map(|r| {
                format!(
                    "ours/{}: step {} whole {} rss {}",
                    who[r].label,
                    fmt_ratio(sides[0].step_median(), sides[r].step_median()),
                    fmt_ratio(sides[0].wall(), sides[r].wall()),
                    fmt_ratio(sides[0].rss_mib(), sides[r].rss_mib())
                )
            })
            .collect();
        println!("{}, {1}x{1} {ty}: {2}", work.label, s.side, ratios.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sd_models::report::StepTime;

    #[test]
    fn parses_the_documented_command_line() {
        let a: Args = crate::parse_test("--size 512 --runs 3 --threads 4 --type f16,q8_0").unwrap();
        assert_eq!((a.settings(), a.runs, a.threads), (vec![SETTING_512], 3, 4));
        assert_eq!((a.model, a.loras, a.reference), (Model::Sd15, 0, References::Both));
        let f: Args =
            crate::parse_test("--model flux --loras 3 --lora-apply-mode at_runtime --reference default").unwrap();
        assert_eq!(
            (f.model, f.loras, f.lora_apply_mode.as_str(), f.reference),
            (Model::Flux, 3, "at_runtime", References::Default)
        );
        assert_eq!(a.types, ["f16", "q8_0"]);
        let d: Args = crate::parse_test("").unwrap();
        assert_eq!((d.settings(), d.runs, d.threads), (vec![SETTING_256, SETTING_512], 2, 2));
        let x: Args = crate::parse_test("--model vega --size 1024").unwrap();
        assert_eq!(x.settings(), vec![SETTING_1024]);
        assert_eq!(d.types, ["f16"]);
        let z: Args = crate::parse_test("--sizes 256,768").unwrap();
        assert_eq!(z.settings(), vec![SETTING_256, Setting { side: 768, steps: 1 }]);
        assert!(crate::parse_test::<Args>("--sizes 256,700").is_err());
        assert!(crate::parse_test::<Args>("--sizes 256 --size 512").is_err());
        // gguf:TYPE names a quantized fixture file of sd15 or vega; anything else is refused
        // before any build.
        let g: Args = crate::parse_test("--type gguf:q4_K,gguf:Q6_K,f16").unwrap();
        assert_eq!(
            gguf_type(g.model, &g.types[0]).unwrap(),
            Some((FixtureModel::Sd15, sd_models::fixture::WeightType::Q4K))
        );
        assert_eq!(
            gguf_type(Model::Vega, &g.types[1]).unwrap(),
            Some((FixtureModel::Vega, sd_models::fixture::WeightType::Q6K))
        );
        assert_eq!(gguf_type(g.model, &g.types[2]).unwrap(), None);
        for (model, bad, says) in [
            (Model::Flux, "gguf:q8_0", "sd15 and vega only"),
            (Model::Sd15, "gguf:q3_K", "unknown weight type 'q3_K'"),
            (Model::Sd15, "gguf:f16", "not a quantized type"),
        ] {
            let e = gguf_type(model, bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(says), "{bad}: {e}");
        }
        for (line, needle) in [
            ("--size 128", "128"),
            ("--runs 0", "--runs"),
            ("--threads x", "--threads"),
            ("--type ,", "--type"),
            ("--fast", "--fast"),
            ("--loras 4", "--loras"),
            ("--model wan", "wan"),
            ("--lora-apply-mode later", "later"),
        ] {
            let e = crate::parse_test::<Args>(line).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }

    #[test]
    fn our_report_gives_the_stage_times_with_each_load_in_its_stage() {
        let mut r = RunReport::new("generate", Vec::new());
        for (name, secs) in [("te load", 0.25), ("text encode", 1.0), ("unet load", 0.5), ("sampling", 6.75)] {
            r.stage(name, secs);
        }
        for (name, secs) in [("vae load", 0.5), ("decode", 1.5), ("write", 0.25)] {
            r.stage(name, secs);
        }
        r.steps = [3.5, 3.25].iter().enumerate().map(|(step, &seconds)| StepTime { image: 0, step, seconds }).collect();
        let text = r.to_json();
        let t = ours_timings(&RunReport::from_json(&text).unwrap());
        assert_eq!(t.text_encode_s, Some(1.25));
        assert_eq!(t.steps_s, vec![3.5, 3.25]);
        assert_eq!(t.decode_s, Some(2.0));
        assert_eq!(t.generation_s, Some(10.75));
        assert_eq!(t.load_s, Some(1.25));
        // A report without stages (a failed run) has no times rather than zeros.
        assert_eq!(ours_timings(&RunReport::new("generate", Vec::new())), Timings::default());
    }

    #[test]
    fn the_reference_line_gives_seconds() {
        let log = "SDREF_TIMING load_ms=1500 text_encode_ms=640 sampling_ms=8000 steps=2 step_ms=4000,4100 \
                   step_mean_ms=4050 decode_ms=unknown tensor_load_ms=2500 generate_ms=9000 total_ms=11000\n";
        let t = parse_ref(log);
        assert_eq!(t.steps_s, vec![4.0, 4.1]);
        assert_eq!(t.text_encode_s, Some(0.64));
        assert_eq!(t.decode_s, None);
        assert_eq!(t.load_s, Some(4.0));
        assert_eq!(parse_ref("no timing here"), Timings::default());
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn a_child_is_measured_and_its_failure_reported() {
        // A shell that allocates nothing special: its peak RSS is positive and small,
        // its output and exit code come back.
        let m = run_measured(Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"])).unwrap();
        assert_eq!(m.stdout.trim(), "out");
        assert_eq!(m.stderr.trim(), "err");
        assert_eq!(m.code, Some(3));
        assert!(m.max_rss_kib > 0 && m.max_rss_kib < 1024 * 1024, "{}", m.max_rss_kib);
        let e = m.check("sh").unwrap_err();
        assert!(format!("{e}").contains("exit code 3") && format!("{e}").contains("err"), "{e}");
    }

    #[test]
    fn peak_rss_sees_a_large_allocation_in_the_child() {
        // dd allocates its 200 MiB block and fills it from /dev/zero: the child's own
        // peak must show in ru_maxrss.
        let m = run_measured(Command::new("dd").args(["if=/dev/zero", "of=/dev/null", "bs=200M", "count=1"])).unwrap();
        m.check("dd").unwrap();
        assert!(m.max_rss_kib > 190 * 1024, "{} KiB", m.max_rss_kib);
    }
}
