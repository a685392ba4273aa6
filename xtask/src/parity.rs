//! `cargo xtask parity`: our text encoder, UNet, VAE and whole generations against stable-diffusion.cpp.
//!
//! ```text
//! cargo xtask parity [sd15|sd21|all] [--threads N]
//! cargo xtask parity [sd15|sd21|all] --write-test-data [--test-data-dir DIR]
//! cargo xtask parity --fuzz N --model PATH [--seed S]   (random cases: xtask/src/fuzz.rs)
//! cargo xtask parity samplers ...   (every sampler and scheduler: see parity_samplers.rs)
//! cargo xtask parity ops ...        (each ggml op, ours against the reference's: parity_ops.rs)
//! ```
//!
//! For each family, on the cached fixture (`sd_models::fixture::cached_path`, seed 42,
//! f16; written if missing, as `cargo xtask fixture <family>` would),
//! the reference runs as its own process (`sdref`, xtask/reference) and ours in
//! this process (components) or as `sd-cli` (whole generations):
//!
//! - (a) text: the conditioning of [`PROMPT`] (ours: `encode_prompt`; ref:
//!   `sdref encode-text`), and of [`WEIGHTED_PROMPT`], which adds attention
//!   weights and `BREAK` (two 77-token chunks);
//! - (b) UNet: one evaluation on a pseudo-random latent `[1, 4, 32, 32]` (written
//!   to a file for both) at timestep 999, with the reference's conditioning as
//!   the context of both, so that (a) does not leak into (b);
//! - (c) VAE: the decode of another pseudo-random latent `[1, 4, 32, 32]`
//!   (diffusion space; both divide by 0.18215), before clamping;
//! - (d) image: `txt2img` 256x256, 4 steps euler, cfg 7, seed 42, rng cuda, PNGs.
//!
//! Every comparison prints the max and mean absolute difference, the scale of
//! the reference output (max |ref| and its standard deviation), the relative
//! errors `rel_rms = rms(ours - ref) / rms(ref)` and `rel_max = max|ours - ref| /
//! max|ref|`, and PASS/FAIL. The command exits non-zero when any check fails.
//!
//! # Tolerances
//!
//! Images (d): the issue's bound, in 8-bit levels, mean |diff| <= 1 and max <= 8.
//!
//! Tensors (a)-(c): both programs run the same f16 weights through ggml's CPU
//! kernels. The only rounding that is large compared with f32 is f16: ggml's
//! `mul_mat` with an f16 weight first converts the f32 activations to f16 (its
//! `vec_dot_type`), and a convolution with an f16 kernel does the same through
//! `im2col` to f16. Each such rounding point has a unit roundoff of
//! `u = 2^-11 ~ 4.9e-4`. Two programs that feed bit-identical f32 values to a
//! rounding point round them identically; they differ where their f32 values
//! already differ (accumulation order: SIMD width, thread split, ggml version,
//! fused or unfused ops, which give differences of order 1e-7 relative), and
//! such a difference is amplified to a whole f16 step (up to `2u` relative) in
//! the elements where it crosses a rounding boundary. So each rounding point
//! adds at most about `u` of relative error; the layers are normalised (layer
//! or group norm before every block, residual sums), so errors from successive
//! points add like a random walk rather than multiply: after `N` points the
//! relative RMS error is at most about `u * sqrt(N)`. We allow a factor 4 on
//! that (rounding points the count below misses, e.g. attention softmax inputs
//! and sd.cpp's f16 KV casts, and the amplification of the layer norms over
//! random weights):
//!
//! `rel_rms <= 4 u sqrt(N)`, and, for the worst element, `rel_max <= 8 u sqrt(N)`
//! (a few-sigma tail of the same error, measured against the largest output).
//!
//! `N` counts the rounded matmul/conv inputs on the longest path:
//! - CLIP: 4 per layer (qkv, out projection, fc1, fc2): ViT-L/14, 12 layers:
//!   N = 48; OpenCLIP ViT-H/14 up to the penultimate layer, 23 layers: N = 92;
//! - UNet: 2 convs per ResNet block (22 blocks: 2 per down level, 2 mid, 3 per
//!   up level) and its timestep-embedding linear (one point each), 8 per
//!   transformer block (proj_in, q/k/v, out, cross q, cross out, GEGLU in,
//!   GEGLU out, proj_out; 16 blocks), the 6 down/up samplers and
//!   conv_in/out: N ~ 44 + 22 + 128 + 8 = 202;
//! - VAE decoder: post_quant_conv, conv_in, mid (2 ResNet blocks, attention with
//!   q/k/v/out), 4 levels x 3 ResNet blocks x 2 convs, 3 upsample convs,
//!   conv_out: N ~ 1 + 1 + 4 + 2 + 24 + 3 + 1 = 36.
//!
//! Resulting bounds (rel_rms / rel_max): CLIP-L 1.4e-2 / 2.7e-2, CLIP-H 1.9e-2 /
//! 3.7e-2, UNet 2.8e-2 / 5.6e-2, VAE 1.2e-2 / 2.3e-2. They are bounds, not
//! expectations. When this command was written (2 threads, f16 fixtures) the
//! observed rel_rms were 1.6e-3 (CLIP-L), 1.8e-3 (CLIP-H), 2.6e-3 / 3.6e-4
//! (UNet SD1 / SD2) and 2.4e-3 (VAE): 5 to 80 times inside the bounds, and
//! the differences are uncorrelated with the values (no scale or offset
//! error), as rounding noise should be. The 256x256 PNGs differed by at most
//! 2 levels, 0.2 on average.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_backends::{Backend, BackendManager, PluginRegistry, PluginSearch};
use sd_models::diffusion::unet::{UNetConfig, UNetModel};
use sd_models::files::ModelFiles;
use sd_models::fixture::{self, Family, WeightType};
use sd_models::loader::{dtype_of, FileSource};
use sd_models::text::clip::{clip_specs, ClipConfig, ClipTextModel};
use sd_models::text::conditioning::encode_prompt;
use sd_models::text::ClipTokenizer;
use sd_sched::{Runner, Weights};
use sd_vae::{AutoencoderKl, VaeConfig, VaeParts};

use crate::bench::run_measured;
use crate::reference;

const USAGE: &str = "usage: cargo xtask parity [sd15|sd21|all] [--threads N] [--write-test-data [--test-data-dir DIR]]";

/// The prompt of the text check (a) and the whole generation (d).
pub const PROMPT: &str = "a photo of a cat";
/// A prompt with attention weights and two chunks, for the tokenizer and weighting path.
const WEIGHTED_PROMPT: &str = "a (photo:1.3) of a [cat], ((masterpiece)) BREAK studio lighting";
/// The UNet's timestep in (b): the first step of a 1000-step discrete schedule.
const TIMESTEP: f32 = 999.0;
/// Latent size of (b) and (c): a 256x256 image.
const LATENT_SIDE: usize = 32;
/// f16's unit roundoff, 2^-11.
const F16_U: f64 = 1.0 / 2048.0;

/// The fixture of `family` (seed 42, f16, safetensors) from the fixture cache, written
/// first if missing.
pub fn ensure_fixture(family: Family) -> Result<PathBuf> {
    let path = fixture::cached_path(family, 42, WeightType::F16);
    if !path.is_file() {
        eprintln!("parity: writing the {} fixture to {} (full size, takes a while)", family.name(), path.display());
    }
    let t = Instant::now();
    let (path, written) = fixture::ensure_cached(family, 42, WeightType::F16)?;
    if written {
        eprintln!("parity: fixture written in {:.0} s", t.elapsed().as_secs_f64());
    }
    Ok(path)
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Builds `sd-cli` in release mode and returns the executable's path (from cargo's
/// JSON messages, so that `CARGO_TARGET_DIR` is honoured).
pub fn build_sd_cli() -> Result<PathBuf> {
    let out = Command::new(cargo())
        .args(["build", "--release", "-p", "sd-cli", "--bin", "sd-cli", "--message-format=json-render-diagnostics"])
        .current_dir(crate::workspace_root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo build for sd-cli")?;
    if !out.status.success() {
        bail!("building sd-cli failed: {}", out.status);
    }
    let exe = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "sd-cli")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo did not report the sd-cli executable")?;
    Ok(exe)
}

/// Parsed command line.
#[derive(Debug, PartialEq)]
struct Args {
    families: Vec<Family>,
    threads: u32,
    write_test_data: bool,
    test_data_dir: PathBuf,
}

fn parse(args: &[String]) -> Result<Args> {
    let mut families = None;
    let mut threads = 2u32;
    let mut write_test_data = false;
    let mut test_data_dir = crate::workspace_root().join("tests/data");
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| it.next().with_context(|| format!("{flag} needs a value\n{USAGE}")).cloned();
        match arg.as_str() {
            "--threads" | "-t" => {
                let v = value(arg)?;
                threads =
                    v.parse().ok().filter(|&n| n > 0).with_context(|| format!("--threads {v}: a positive integer"))?;
            }
            "--write-test-data" => write_test_data = true,
            "--test-data-dir" => test_data_dir = PathBuf::from(value(arg)?),
            "-h" | "--help" => bail!("{USAGE}"),
            s if s.starts_with('-') => bail!("unknown option `{s}`\n{USAGE}"),
            s if families.is_none() => {
                families = Some(match s {
                    "all" => vec![Family::Sd15, Family::Sd21],
                    "sd15" => vec![Family::Sd15],
                    "sd21" => vec![Family::Sd21],
                    other => bail!("unknown family `{other}`: accepted are sd15, sd21 and all"),
                })
            }
            s => bail!("unexpected argument `{s}` (the families are already chosen)\n{USAGE}"),
        }
    }
    Ok(Args {
        families: families.unwrap_or_else(|| vec![Family::Sd15, Family::Sd21]),
        threads,
        write_test_data,
        test_data_dir,
    })
}

// ---------------------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------------------

/// How far two outputs are apart, and the scale of the reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Diff {
    /// Number of values compared.
    pub n: usize,
    /// max |ours - ref|.
    pub max_abs: f64,
    /// mean |ours - ref|.
    pub mean_abs: f64,
    /// sqrt(mean (ours - ref)^2).
    pub rms: f64,
    /// max |ref|.
    pub ref_max_abs: f64,
    /// Standard deviation of the reference values.
    pub ref_std: f64,
    /// sqrt(mean ref^2).
    pub ref_rms: f64,
    /// Values that are NaN or infinite, in either output.
    pub non_finite: usize,
}

impl Diff {
    /// Compares `ours` with `reference` element by element (same length required).
    pub fn of(ours: &[f64], reference: &[f64]) -> Result<Diff> {
        if ours.len() != reference.len() || ours.is_empty() {
            bail!("cannot compare {} values with {}", ours.len(), reference.len());
        }
        let n = ours.len();
        let (mut max_abs, mut sum_abs, mut sum_sq) = (0.0f64, 0.0f64, 0.0f64);
        let (mut ref_max_abs, mut ref_sum, mut ref_sq) = (0.0f64, 0.0f64, 0.0f64);
        let mut non_finite = 0;
        for (&a, &b) in ours.iter().zip(reference) {
            if !a.is_finite() || !b.is_finite() {
                non_finite += 1;
                continue;
            }
            let d = (a - b).abs();
            max_abs = max_abs.max(d);
            sum_abs += d;
            sum_sq += d * d;
            ref_max_abs = ref_max_abs.max(b.abs());
            ref_sum += b;
            ref_sq += b * b;
        }
        let nf = n as f64;
        let mean = ref_sum / nf;
        Ok(Diff {
            n,
            max_abs,
            mean_abs: sum_abs / nf,
            rms: (sum_sq / nf).sqrt(),
            ref_max_abs,
            ref_std: (ref_sq / nf - mean * mean).max(0.0).sqrt(),
            ref_rms: (ref_sq / nf).sqrt(),
            non_finite,
        })
    }

    /// rms(ours - ref) / rms(ref).
    pub fn rel_rms(&self) -> f64 {
        if self.ref_rms > 0.0 {
            self.rms / self.ref_rms
        } else {
            f64::INFINITY
        }
    }

    /// max|ours - ref| / max|ref|.
    pub fn rel_max(&self) -> f64 {
        if self.ref_max_abs > 0.0 {
            self.max_abs / self.ref_max_abs
        } else {
            f64::INFINITY
        }
    }
}

/// What a comparison must satisfy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// Tensors: relative errors (see the module doc).
    Relative { rel_rms: f64, rel_max: f64 },
    /// 8-bit images: absolute, in levels.
    Levels { mean: f64, max: f64 },
}

impl Tolerance {
    /// The bound for a path with `n` f16 rounding points: `4 u sqrt(n)` / `8 u sqrt(n)`.
    pub fn rounding_points(n: u32) -> Tolerance {
        let r = F16_U * f64::from(n).sqrt();
        Tolerance::Relative { rel_rms: 4.0 * r, rel_max: 8.0 * r }
    }

    /// The issue's PNG bound: mean <= 1/255, max <= 8/255.
    pub const PNG: Tolerance = Tolerance::Levels { mean: 1.0, max: 8.0 };

    /// Whether `d` is within this tolerance (never with non-finite values).
    pub fn accepts(&self, d: &Diff) -> bool {
        if d.non_finite > 0 {
            return false;
        }
        match *self {
            Tolerance::Relative { rel_rms, rel_max } => d.rel_rms() <= rel_rms && d.rel_max() <= rel_max,
            Tolerance::Levels { mean, max } => d.mean_abs <= mean && d.max_abs <= max,
        }
    }

    pub(crate) fn describe(&self) -> String {
        match *self {
            Tolerance::Relative { rel_rms, rel_max } => {
                format!("rel_rms<={rel_rms:.1e} rel_max<={rel_max:.1e}")
            }
            Tolerance::Levels { mean, max } => format!("mean<={mean} max<={max} levels"),
        }
    }
}

/// Rounding points per module (counted in the module doc).
const CLIP_L_POINTS: u32 = 48;
const CLIP_H_POINTS: u32 = 92;
pub(crate) const UNET_POINTS: u32 = 202;
pub(crate) const VAE_POINTS: u32 = 36;

/// One line of the report.
#[derive(Debug)]
pub(crate) struct Row {
    pub family: &'static str,
    pub what: String,
    pub shape: String,
    pub diff: Diff,
    pub tol: Tolerance,
}

impl Row {
    pub fn pass(&self) -> bool {
        self.tol.accepts(&self.diff)
    }

    /// An image row with both programs' wall times.
    pub fn print_timed(&self, ref_s: f64, ours_s: f64) {
        let d = &self.diff;
        println!(
            "{:<30} mean|d| {:<7.3} max|d| {:<4} (levels){}  sdref {:>5.1} s  sd-cli {:>5.1} s  {}",
            self.what,
            d.mean_abs,
            d.max_abs,
            if d.non_finite > 0 { format!(" NON-FINITE {}", d.non_finite) } else { String::new() },
            ref_s,
            ours_s,
            if self.pass() { "PASS" } else { "FAIL" }
        );
    }

    fn print(&self) {
        let d = &self.diff;
        println!(
            "{:<5} {:<16} {:<14} max|d| {:<9.3e} mean|d| {:<9.3e} max|ref| {:<9.3e} std(ref) {:<9.3e} rel_rms {:<9.3e} rel_max {:<9.3e}{} [{}] {}",
            self.family,
            self.what,
            self.shape,
            d.max_abs,
            d.mean_abs,
            d.ref_max_abs,
            d.ref_std,
            d.rel_rms(),
            d.rel_max(),
            if d.non_finite > 0 { format!(" NON-FINITE {}", d.non_finite) } else { String::new() },
            self.tol.describe(),
            if self.pass() { "PASS" } else { "FAIL" }
        );
    }
}

// ---------------------------------------------------------------------------------------
// Files shared with sdref
// ---------------------------------------------------------------------------------------

/// Writes raw little-endian f32 and the sdref sidecar (`PATH.json`) with `shape`.
pub fn write_raw(path: &Path, shape: &[usize], data: &[f32], what: &str) -> Result<()> {
    if shape.iter().product::<usize>() != data.len() {
        bail!("{}: shape {shape:?} does not hold {} values", path.display(), data.len());
    }
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    let side = serde_json::json!({
        "format": "sdref-f32", "dtype": "f32", "byte_order": "little", "shape": shape,
        "axis_order": "outermost first, last axis contiguous (PyTorch)", "what": what,
    });
    let side_path = sidecar(path);
    std::fs::write(&side_path, serde_json::to_string_pretty(&side)? + "\n")
        .with_context(|| format!("writing {}", side_path.display()))
}

fn sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// Reads a raw f32 file and its sidecar's shape.
pub fn read_raw(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let side_path = sidecar(path);
    let side: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&side_path).with_context(|| format!("reading {}", side_path.display()))?,
    )
    .with_context(|| format!("parsing {}", side_path.display()))?;
    let shape: Vec<usize> = side["shape"]
        .as_array()
        .and_then(|a| a.iter().map(|v| v.as_u64().and_then(|x| usize::try_from(x).ok())).collect())
        .with_context(|| format!("{}: no integer `shape` array", side_path.display()))?;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let n: usize = shape.iter().product();
    if bytes.len() != n * 4 {
        bail!("{}: {} bytes, but shape {shape:?} of f32 needs {}", path.display(), bytes.len(), n * 4);
    }
    let data = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok((shape, data))
}

/// `n` standard-normal values from `seed` (splitmix64, Box-Muller): the same inputs
/// for both programs, independent of either program's generators.
pub fn normal_values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // Uniform in (0, 1] and [0, 1) from the top 53 bits.
        let u1 = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (next() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        out.push((r * a.cos()) as f32);
        out.push((r * a.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// An 8-bit RGB image from a PNG.
fn read_png_rgb(path: &Path) -> Result<(u32, u32, Vec<u8>)> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut dec = png::Decoder::new(std::io::BufReader::new(file));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().with_context(|| format!("reading {}", path.display()))?;
    let mut buf = vec![0; reader.output_buffer_size().context("PNG too large")?];
    let info = reader.next_frame(&mut buf).with_context(|| format!("decoding {}", path.display()))?;
    let px = info.width as usize * info.height as usize;
    let rgb = match info.color_type {
        png::ColorType::Rgb => buf[..px * 3].to_vec(),
        png::ColorType::Rgba => buf[..px * 4].chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => buf[..px].iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => buf[..px * 2].chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => bail!("{}: a palette image was not expanded", path.display()),
    };
    Ok((info.width, info.height, rgb))
}

/// Compares two PNGs in 8-bit levels.
pub(crate) fn png_diff(ours: &Path, reference: &Path) -> Result<(Diff, String)> {
    let (w1, h1, a) = read_png_rgb(ours)?;
    let (w2, h2, b) = read_png_rgb(reference)?;
    if (w1, h1) != (w2, h2) {
        bail!("{} is {w1}x{h1} but {} is {w2}x{h2}", ours.display(), reference.display());
    }
    let to = |v: &[u8]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    Ok((Diff::of(&to(&a), &to(&b))?, format!("{w1}x{h1}x3")))
}

pub(crate) fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn shape_str(s: &[usize]) -> String {
    s.iter().map(usize::to_string).collect::<Vec<_>>().join("x")
}

// ---------------------------------------------------------------------------------------
// Our side, in process (the wiring of sd_models::pipeline)
// ---------------------------------------------------------------------------------------

/// A CPU backend with `threads` threads; the registry stays alive with it.
pub(crate) struct Cpu {
    _registry: PluginRegistry,
    pub(crate) backend: Arc<Backend>,
}

impl Cpu {
    pub(crate) fn new(threads: u32) -> Result<Cpu> {
        let registry = PluginRegistry::discover(&PluginSearch::standard(Vec::new()));
        let device = registry
            .device("cpu")
            .context("no CPU device among the loaded ggml plugins (run `cargo xtask plugins`?)")?;
        let backend = BackendManager::new(Some(threads as usize)).get(device).context("creating the CPU backend")?;
        Ok(Cpu { _registry: registry, backend })
    }
}

/// The module configurations of the detected architecture.
pub(crate) fn configs(files: &ModelFiles) -> Result<(ClipConfig, UNetConfig, u32)> {
    let detected = files.detect(None)?;
    Ok(match detected.arch {
        "sd1" => (ClipConfig::vit_l14(), UNetConfig::sd15(), CLIP_L_POINTS),
        "sd2" => (ClipConfig::vit_h14(), UNetConfig::sd21(), CLIP_H_POINTS),
        other => bail!("architecture `{other}` is not compared by this command"),
    })
}

/// Our conditioning of each prompt, `(data, n_tokens, hidden)`.
fn our_text(
    cpu: &Cpu,
    files: &ModelFiles,
    clip: &ClipConfig,
    prompts: &[&str],
) -> Result<Vec<(Vec<f32>, usize, usize)>> {
    let src = FileSource::new(files);
    let dtype = dtype_of(files);
    let mut w = Weights::new(clip_specs(clip, &dtype, None))?;
    w.allocate(cpu.backend.device().buffer_type())?;
    w.load_from(&src)?;
    let model = ClipTextModel::new(clip.clone(), w)?;
    let mut runner = Runner::new("te", cpu.backend.clone());
    let tokenizer = ClipTokenizer::new();
    prompts
        .iter()
        .map(|p| {
            let c = encode_prompt(&model, &mut runner, &tokenizer, p, -1)?;
            Ok((c.data, c.n_tokens, c.hidden_size))
        })
        .collect()
}

fn our_unet(
    cpu: &Cpu,
    files: &ModelFiles,
    cfg: &UNetConfig,
    x: &[f32],
    context: &[f32],
    n_ctx: usize,
) -> Result<Vec<f32>> {
    let src = FileSource::new(files);
    let dtype = dtype_of(files);
    let unet = UNetModel::load(cfg.clone(), &dtype, None, cpu.backend.device().buffer_type(), &src)?;
    let mut runner = Runner::new("unet", cpu.backend.clone());
    Ok(unet.eval(&mut runner, x, (LATENT_SIDE, LATENT_SIDE), &[TIMESTEP], context, n_ctx, 1)?)
}

fn our_vae(cpu: &Cpu, files: &ModelFiles, latent: &[f32]) -> Result<Vec<f32>> {
    let src = FileSource::new(files);
    let cfg = VaeConfig::sd();
    let vae = AutoencoderKl::load(cfg.clone(), VaeParts::DecoderOnly, &src, cpu.backend.device().buffer_type())?;
    let mut runner = Runner::new("vae", cpu.backend.clone());
    let mut z = latent.to_vec();
    cfg.diffusion_to_vae(&mut z);
    Ok(vae.decode(&mut runner, &z, (LATENT_SIDE, LATENT_SIDE), cfg.z_channels)?)
}

// ---------------------------------------------------------------------------------------
// The reference's side
// ---------------------------------------------------------------------------------------

fn sdref(exe: &Path, sub: &str, model: &Path, threads: u32) -> Command {
    let mut c = Command::new(exe);
    c.arg(sub).arg("-m").arg(model).args(["-t", &threads.to_string()]);
    c
}

pub(crate) fn run_ok(mut cmd: Command, what: &str) -> Result<f64> {
    let m = run_measured(&mut cmd)?;
    m.check(what)?;
    Ok(m.wall_s)
}

/// `txt2img` flags shared by both programs.
fn gen_flags(prompt: &str, side: u32, steps: u32, threads: u32) -> Vec<String> {
    let side = side.to_string();
    [
        "-p",
        prompt,
        "-W",
        &side,
        "-H",
        &side,
        "--steps",
        &steps.to_string(),
        "--sampling-method",
        "euler",
        "--cfg-scale",
        "7",
        "-s",
        "42",
        "-t",
        &threads.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

// ---------------------------------------------------------------------------------------
// The checks
// ---------------------------------------------------------------------------------------

fn check_family(family: Family, threads: u32, sdref_exe: &Path, ours_exe: &Path, cpu: &Cpu) -> Result<Vec<Row>> {
    let name = family.name();
    let model = ensure_fixture(family)?;
    let dir = crate::workspace_root().join("target/parity").join(name);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let files = ModelFiles::open_model(&model)?;
    let (clip, unet_cfg, clip_points) = configs(&files)?;
    let mut rows = Vec::new();
    let mut push = |row: Row| {
        row.print();
        rows.push(row);
    };

    // (a) Text.
    let prompts = [PROMPT, WEIGHTED_PROMPT];
    let mut ref_te = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let out = dir.join(format!("te{i}.ref.f32"));
        let mut c = sdref(sdref_exe, "encode-text", &model, threads);
        c.args(["-p", p, "-o"]).arg(&out);
        let s = run_ok(c, "sdref encode-text")?;
        eprintln!("parity: {name}: sdref encode-text {:?} took {s:.1} s (with model load)", p);
        ref_te.push(read_raw(&out)?);
    }
    let t = Instant::now();
    let ours_te = our_text(cpu, &files, &clip, &prompts)?;
    eprintln!("parity: {name}: our text encoder took {:.1} s (with weight load)", t.elapsed().as_secs_f64());
    for (i, ((shape, r), (o, n_tok, hidden))) in ref_te.iter().zip(&ours_te).enumerate() {
        if shape.iter().product::<usize>() != o.len() {
            bail!("{name}: text {i}: the reference's conditioning is {shape:?}, ours [1, {n_tok}, {hidden}]");
        }
        write_raw(&dir.join(format!("te{i}.ours.f32")), &[1, *n_tok, *hidden], o, "our conditioning")?;
        push(Row {
            family: name,
            what: if i == 0 { "text".into() } else { "text (weighted)".into() },
            shape: shape_str(shape),
            diff: Diff::of(&to_f64(o), &to_f64(r))?,
            tol: Tolerance::rounding_points(clip_points),
        });
    }

    // (b) UNet, on the reference's conditioning.
    let (ctx_shape, ctx) = &ref_te[0];
    let n_ctx = ctx_shape.get(1).copied().context("the reference's conditioning has no token axis")?;
    let x_shape = [1, 4, LATENT_SIDE, LATENT_SIDE];
    let x = normal_values(0x5eed_0001, x_shape.iter().product());
    let x_path = dir.join("unet_x.f32");
    write_raw(&x_path, &x_shape, &x, "UNet input x (scaled by c_in), standard normal, splitmix64 seed 0x5eed0001")?;
    let out = dir.join("unet.ref.f32");
    let mut c = sdref(sdref_exe, "unet", &model, threads);
    c.arg("--latent")
        .arg(&x_path)
        .args(["--timestep", &TIMESTEP.to_string(), "--context"])
        .arg(dir.join("te0.ref.f32"));
    c.arg("-o").arg(&out);
    let s = run_ok(c, "sdref unet")?;
    eprintln!("parity: {name}: sdref unet took {s:.1} s (with model load)");
    let (shape, r) = read_raw(&out)?;
    let t = Instant::now();
    let o = our_unet(cpu, &files, &unet_cfg, &x, ctx, n_ctx)?;
    eprintln!("parity: {name}: our UNet took {:.1} s (with weight load)", t.elapsed().as_secs_f64());
    write_raw(&dir.join("unet.ours.f32"), &shape, &o, "our UNet output").ok();
    push(Row {
        family: name,
        what: format!("unet t={TIMESTEP}"),
        shape: shape_str(&shape),
        diff: Diff::of(&to_f64(&o), &to_f64(&r))?,
        tol: Tolerance::rounding_points(UNET_POINTS),
    });

    // (c) VAE decode.
    let z = normal_values(0x5eed_0002, x_shape.iter().product());
    let z_path = dir.join("vae_z.f32");
    write_raw(&z_path, &x_shape, &z, "diffusion-space latent, standard normal, splitmix64 seed 0x5eed0002")?;
    let out = dir.join("vae.ref.f32");
    let mut c = sdref(sdref_exe, "vae-decode", &model, threads);
    c.arg("--latent").arg(&z_path).arg("-o").arg(&out);
    let s = run_ok(c, "sdref vae-decode")?;
    eprintln!("parity: {name}: sdref vae-decode took {s:.1} s (with model load)");
    let (shape, r) = read_raw(&out)?;
    let t = Instant::now();
    let o = our_vae(cpu, &files, &z)?;
    eprintln!("parity: {name}: our VAE took {:.1} s (with weight load)", t.elapsed().as_secs_f64());
    write_raw(&dir.join("vae.ours.f32"), &shape, &o, "our VAE output").ok();
    push(Row {
        family: name,
        what: "vae decode".into(),
        shape: shape_str(&shape),
        diff: Diff::of(&to_f64(&o), &to_f64(&r))?,
        tol: Tolerance::rounding_points(VAE_POINTS),
    });
    drop(files);

    // (d) Whole generation.
    let flags = gen_flags(PROMPT, 256, 4, threads);
    let ref_png = dir.join("txt2img.ref.png");
    let mut c = Command::new(sdref_exe);
    c.arg("txt2img").arg("-m").arg(&model).args(&flags).arg("-o").arg(&ref_png);
    let s = run_ok(c, "sdref txt2img")?;
    eprintln!("parity: {name}: sdref txt2img took {s:.1} s");
    let ours_png = dir.join("txt2img.ours.png");
    let mut c = Command::new(ours_exe);
    c.arg("-m").arg(&model).args(&flags).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
    let s = run_ok(c, "sd-cli")?;
    eprintln!("parity: {name}: our sd-cli took {s:.1} s");
    let (diff, shape) = png_diff(&ours_png, &ref_png)?;
    push(Row { family: name, what: "png 256 euler4".into(), shape, diff, tol: Tolerance::PNG });
    Ok(rows)
}

/// The CI test inputs: `ref-<family>-f16-seed42-64x64-euler2-cfg7.png` (tests/data/README.md),
/// written by the reference, then compared with ours at the same settings.
fn write_test_data(family: Family, threads: u32, sdref_exe: &Path, ours_exe: &Path, dir: &Path) -> Result<Row> {
    let name = family.name();
    let model = ensure_fixture(family)?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let file = dir.join(format!("ref-{name}-f16-seed42-64x64-euler2-cfg7.png"));
    let tmp = dir.join(format!(".ref-{name}.partial.png"));
    let flags = gen_flags("a cat", 64, 2, threads);
    let mut c = Command::new(sdref_exe);
    c.arg("txt2img").arg("-m").arg(&model).args(&flags).arg("-o").arg(&tmp);
    run_ok(c, "sdref txt2img")?;
    std::fs::rename(&tmp, &file).with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))?;
    println!("wrote {}", file.display());
    let work = crate::workspace_root().join("target/parity").join(name);
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let ours_png = work.join("test-data.ours.png");
    let mut c = Command::new(ours_exe);
    c.arg("-m").arg(&model).args(&flags).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
    run_ok(c, "sd-cli")?;
    let (diff, shape) = png_diff(&ours_png, &file)?;
    Ok(Row { family: name, what: "png 64 euler2".into(), shape, diff, tol: Tolerance::PNG })
}

/// Entry point of `cargo xtask parity ...` (`args` excludes the subcommand name).
pub fn run(args: &[String]) -> Result<()> {
    if args.first().map(String::as_str) == Some("samplers") {
        return crate::parity_samplers::run(&args[1..]);
    }
    if args.first().map(String::as_str) == Some("ops") {
        return crate::parity_ops::run(&args[1..]);
    }
    if args.iter().any(|a| a == "--fuzz" || a == "--fuzz-prompts" || a == "--compare-runs") {
        return crate::fuzz::run(args);
    }
    let args = parse(args)?;
    eprintln!("parity: building the reference and sd-cli (release)");
    let sdref_exe = reference::build()?;
    let ours_exe = build_sd_cli()?;
    let start = Instant::now();
    let mut rows = Vec::new();
    if args.write_test_data {
        for &f in &args.families {
            let row = write_test_data(f, args.threads, &sdref_exe, &ours_exe, &args.test_data_dir)?;
            row.print();
            rows.push(row);
        }
    } else {
        let cpu = Cpu::new(args.threads)?;
        for &f in &args.families {
            rows.extend(check_family(f, args.threads, &sdref_exe, &ours_exe, &cpu)?);
        }
    }
    println!("\nparity summary ({} threads, {:.0} s):", args.threads, start.elapsed().as_secs_f64());
    for r in &rows {
        r.print();
    }
    let failed = rows.iter().filter(|r| !r.pass()).count();
    if failed > 0 {
        bail!("{failed} of {} parity checks failed", rows.len());
    }
    println!("all {} parity checks passed", rows.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_args as args;

    #[test]
    fn parses_the_documented_command_line() {
        let a = parse(&args("sd21 --threads 4")).unwrap();
        assert_eq!((a.families, a.threads, a.write_test_data), (vec![Family::Sd21], 4, false));
        let d = parse(&[]).unwrap();
        assert_eq!((d.families, d.threads), (vec![Family::Sd15, Family::Sd21], 2));
        let w = parse(&args("all --write-test-data --test-data-dir /tmp/x")).unwrap();
        assert!(w.write_test_data);
        assert_eq!(w.test_data_dir, PathBuf::from("/tmp/x"));
        for (line, needle) in
            [("sdxl", "sdxl"), ("sd15 sd21", "unexpected"), ("--threads 0", "--threads"), ("--quick", "--quick")]
        {
            let e = parse(&args(line)).unwrap_err();
            assert!(format!("{e:#}").contains(needle), "{line}: {e:#}");
        }
    }

    #[test]
    fn diff_statistics_match_hand_computed_values() {
        // ref = [1, -3, 2, 0], ours = ref + [0.5, 0, -1, 0]
        let r = [1.0, -3.0, 2.0, 0.0];
        let o = [1.5, -3.0, 1.0, 0.0];
        let d = Diff::of(&o, &r).unwrap();
        assert_eq!(d.max_abs, 1.0);
        assert_eq!(d.mean_abs, 0.375);
        assert!((d.rms - (1.25f64 / 4.0).sqrt()).abs() < 1e-12);
        assert_eq!(d.ref_max_abs, 3.0);
        // mean 0, mean square 14/4
        assert!((d.ref_std - 3.5f64.sqrt()).abs() < 1e-12);
        assert!((d.rel_max() - 1.0 / 3.0).abs() < 1e-12);
        assert!(Diff::of(&[1.0], &[1.0, 2.0]).is_err());
    }

    #[test]
    fn tolerances_reject_what_they_should() {
        let png = Tolerance::PNG;
        let within =
            Diff::of(&[10.0, 18.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], &[10.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]).unwrap();
        assert!(png.accepts(&within), "max 8, mean 1 is the limit itself");
        let over = Diff::of(&[19.0, 0.0], &[10.0, 0.0]).unwrap();
        assert!(!png.accepts(&over));
        let nan = Diff::of(&[f64::NAN, 1.0], &[1.0, 1.0]).unwrap();
        assert!(!png.accepts(&nan) && !Tolerance::rounding_points(1).accepts(&nan));
        // 4 u sqrt(N): 48 points give 1.35e-2.
        let Tolerance::Relative { rel_rms, rel_max } = Tolerance::rounding_points(48) else { unreachable!() };
        assert!((rel_rms - 4.0 * 48f64.sqrt() / 2048.0).abs() < 1e-15 && (rel_max - 2.0 * rel_rms).abs() < 1e-15);
    }

    #[test]
    fn normal_values_are_deterministic_and_standard() {
        let a = normal_values(7, 100_000);
        assert_eq!(a, normal_values(7, 100_000));
        assert_ne!(a[..10], normal_values(8, 10)[..]);
        let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / a.len() as f64;
        // Standard errors: 1/sqrt(n) = 0.003 for the mean, ~0.0045 for the variance.
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "mean {mean} var {var}");
        assert_eq!(normal_values(1, 3).len(), 3);
    }

    #[test]
    fn raw_files_round_trip_in_sdref_format() {
        let dir = std::env::temp_dir().join(format!("xtask-parity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.f32");
        let v = [0.5f32, -1.0, 2.25, f32::MIN_POSITIVE, 7.0, -0.0];
        write_raw(&p, &[1, 2, 3], &v, "test").unwrap();
        let (shape, back) = read_raw(&p).unwrap();
        assert_eq!(shape, vec![1, 2, 3]);
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // sdref reads little-endian f32, first value first.
        assert_eq!(&std::fs::read(&p).unwrap()[..4], &0.5f32.to_le_bytes());
        assert!(write_raw(&p, &[4], &v, "bad").is_err());
        std::fs::write(&p, [0u8; 8]).unwrap();
        assert!(format!("{:#}", read_raw(&p).unwrap_err()).contains("needs 24"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
