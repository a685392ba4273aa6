//! The cost model's inputs on this machine: the workload from the model's tensor shapes, device figures from calibration, a profile, the speed cache or nominal values; `sd-cli calibrate`.
//!
//! Calibration measures, per device, in a few seconds: f16 matmul throughput (a probe shaped
//! like the speed probe of `--split-by speed`, at 512 activation rows: its bytes per second
//! times the rows are FLOP/s; each timed compute ends with a read of the output, which waits
//! for it on an RPC device too), memory bandwidth (a matrix-vector product through a 50 MiB
//! f16 weight, larger than the caches, which reads the weight once), convolution throughput (a 3x3
//! convolution of 320 channels over 32x32 positions, through ggml's im2col), and the host link (the best of three
//! uploads of a 128 MiB tensor, each followed by a read, and of a 2-byte read for the
//! latency). The figures are kept beside the speed cache (`sd_models::speed::cache_path`) in
//! a JSON file ([`figures_path`]), keyed by device name and description (the driver's
//! description, an RPC device's endpoint). The other op classes (quantized matmuls,
//! attention) are not measured and fall back to the f16 figure.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, Result};
use clap::Args;
use sd_backends::{Backend, GgmlType};
use sd_models::files::index::Component;
use sd_models::files::ModelFiles;
use sd_placement::{
    nominal_figures, Device, DeviceFigures, DeviceProfile, DeviceType, Figures, Module, ModuleLoad, WeightShape,
    WeightType, Workload,
};
use serde::{Deserialize, Serialize};

/// Activation rows of the throughput probe.
const PROBE_ROWS: u64 = 512;
/// Bytes of the link probe's tensor (as large as a UNet segment, so the link's setup costs
/// weigh what they weigh in streaming).
const LINK_BYTES: i64 = 128 << 20;
/// Text-encoder tokens (CLIP's context).
const TE_TOKENS: u64 = 77;

/// Options of `calibrate`.
#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Print the figures as JSON.
    #[arg(long = "json")]
    pub json: bool,
    /// CPU threads of the local CPU device (as a generation's `-t`; default: the physical
    /// cores).
    #[arg(short = 't', long = "threads", value_name = "N", default_value_t = -1, allow_negative_numbers = true)]
    pub threads: i64,
    /// Instead of probing, fit the calibrated throughputs to a generation's run report
    /// (`--report-json`): each device's figures are scaled by its measured compute time over
    /// the predicted one (the probes' best case against the model's real kernels), of the
    /// diffusion model where it ran on the device, else of its other modules. A block takes
    /// the longer of its compute and its weights' read, so one fit is exact only where compute
    /// bounds every block: fitting again to a new run's report refines it.
    #[arg(long = "from-report", value_name = "PATH")]
    pub from_report: Option<PathBuf>,
}

/// One calibrated device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Entry {
    device: String,
    description: String,
    figures: DeviceFigures,
}

/// The calibration file: a list of devices.
#[derive(Debug, Default, Serialize, Deserialize)]
struct CalibrationFile {
    #[serde(default)]
    device: Vec<Entry>,
}

/// The calibration file: a JSON file beside the speed cache.
fn figures_path() -> PathBuf {
    sd_models::fixture::cache_dir().join("device-figures.json")
}

fn read_file() -> CalibrationFile {
    let path = figures_path();
    match sd_models::files::open::read_text(&path, 1 << 20) {
        Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
            tracing::warn!("{}: not a calibration file ({e}); ignored", path.display());
            CalibrationFile::default()
        }),
        Err(_) => CalibrationFile::default(),
    }
}

fn write_file(file: &CalibrationFile) -> Result<()> {
    let path = figures_path();
    let text = serde_json::to_string_pretty(file)?;
    let tmp = path.with_extension(format!("json.{}", std::process::id()));
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|_| std::fs::write(&tmp, text))
        .and_then(|_| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        std::fs::remove_file(&tmp).ok();
        return Err(e).with_context(|| format!("writing the calibration file {}", path.display()));
    }
    Ok(())
}

/// The weight type's class for the cost model.
fn weight_type(d: sd_models::files::DType) -> WeightType {
    use sd_models::files::DType as D;
    match d {
        D::F32 | D::F16 | D::BF16 | D::F64 | D::I8 | D::I16 | D::I32 | D::I64 => WeightType::Float,
        D::Q8_0 | D::Q8_1 | D::Q8_K => WeightType::Q8,
        _ => WeightType::Q4,
    }
}

/// Key/value tokens of an attention whose query projection `name` is, by common naming
/// schemes: `Some(0)` self attention, `Some(n)` cross attention over `n` text tokens. (A FLUX-
/// style DiT's attention is marked on its output projections instead: [`dit_rows`].)
fn attention(name: &str) -> Option<u64> {
    if name.contains("attn2.to_q") {
        return Some(TE_TOKENS);
    }
    let self_attn = ["attn1.to_q", "attn.to_q", "self_attn.q_proj", "attn_1.q.", "attn.q."];
    self_attn.iter().any(|k| name.contains(k)).then_some(0)
}

/// A FLUX-style DiT's weight (FLUX.1, Chroma): its activation rows and attention, from its
/// name. Image tokens `img`, text tokens `txt`, `batch` samples per evaluation. The
/// modulation layers run on one vector per sample (Chroma's approximator on its 344 rows), the
/// text stream on the text tokens, single blocks on both streams joined; the joint attention
/// of `img + txt` tokens is counted once per stream at its output projection (whose rows are
/// the width, unlike a fused qkv's three).
fn dit_rows(name: &str, img: u64, txt: u64, batch: u64) -> (u64, Option<u64>) {
    const MODULATION: [&str; 7] =
        ["_mod.lin", "modulation.lin", "time_in.", "vector_in.", "guidance_in.", "adaLN_modulation", "approximator"];
    if name.contains("distilled_guidance_layer.") {
        return (344 * batch, None);
    }
    if MODULATION.iter().any(|k| name.contains(k)) {
        return (batch, None);
    }
    if name.contains("single_blocks.") {
        let attention = name.contains(".linear2.").then_some(0);
        return ((img + txt) * batch, attention);
    }
    let joint = (name.contains("img_attn.proj") || name.contains("txt_attn.proj")).then_some(img + txt);
    if name.contains("txt_in.") || name.contains(".txt_attn.") || name.contains(".txt_mlp.") {
        return (txt * batch, joint);
    }
    (img * batch, joint)
}

/// What `workload` is for: the image size, the steps and the CFG scale asked for (`None`: the
/// family's default, which guides SD and Chroma and not FLUX.1's distilled models).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunShape {
    pub width: usize,
    pub height: usize,
    pub steps: usize,
    pub cfg_scale: Option<f32>,
}

/// A UNet's resolution levels: a third of its `input_blocks` (SD 1.x/2.x: 12, four levels;
/// SDXL: 9, three); 0 without them.
fn unet_levels<'a>(names: impl Iterator<Item = &'a str>) -> u32 {
    let n = names.filter_map(|n| block_number(n, "input_blocks.")).max().map_or(0, |m| m + 1);
    n / 3
}

fn block_number(name: &str, key: &str) -> Option<u32> {
    let at = name.find(key)?;
    name[at + key.len()..].split('.').next()?.parse().ok()
}

/// Activation rows of a weight whose module runs at `rows` (the diffusion model's) or whose
/// VAE decodes `latent` positions: a UNet block at level `l` sees `rows / 4^l` (input block
/// `i` is at level `i / 3`, output block `j` at `levels - 1 - j / 3`, the middle block at the
/// deepest); the VAE decoder's `up.k` runs at `latent · 4^(3-k)`, its `conv_out` at the
/// image's positions; the VAE encoder does not run in text-to-image. `None`: the module's own.
fn level_rows(name: &str, levels: u32, rows: u64, latent: u64) -> Option<u64> {
    if levels > 0 {
        let level = if let Some(i) = block_number(name, "input_blocks.") {
            Some(i / 3)
        } else if let Some(j) = block_number(name, "output_blocks.") {
            Some(levels.saturating_sub(1 + j / 3))
        } else if name.contains("middle_block.") {
            Some(levels - 1)
        } else {
            None
        };
        if let Some(l) = level {
            return Some(rows >> (2 * l.min(16)));
        }
    }
    if name.contains("first_stage_model.encoder.") || name.contains("tae.encoder.") {
        return Some(0);
    }
    if name.contains("first_stage_model.decoder.") {
        if let Some(k) = block_number(name, "decoder.up.") {
            return Some(latent << (2 * 3u32.saturating_sub(k.min(3))));
        }
        if name.contains("decoder.conv_out") || name.contains("decoder.norm_out") {
            return Some(latent * 64);
        }
        return Some(latent);
    }
    None
}

/// What a generation of `run`'s size in its steps computes: every tensor's shape from the
/// model's headers. A UNet runs at the latent positions per sample (a block at its level's
/// positions, [`level_rows`]), a DiT at a quarter of them (2x2 patches) beside the text tokens
/// ([`dit_rows`]); with guidance (cfg ≠ 1) each step evaluates two samples and the text
/// encoder runs twice (prompt, negative prompt). CLIP reads 77 tokens, T5 a chunk (the
/// family's `text_tokens`: FLUX.1 256, Chroma 512). The VAE runs once (its decoder's blocks at their resolutions; other VAE
/// weights at 16 times the latent positions).
pub(crate) fn workload(files: &ModelFiles, run: RunShape) -> Workload {
    let index = files.index();
    let latent = sd_models::speed::latent_tokens(run.width, run.height);
    let steps = u32::try_from(run.steps).unwrap_or(u32::MAX);
    // A FLUX-style DiT patchifies the latent by 2x2. Guidance (two samples per step) and the
    // text chunk are the family's: FLUX.1 is guidance-distilled, Chroma and the UNets are not.
    let dit = index.entries().iter().any(|e| e.name.contains("double_blocks."));
    let family = sd_models::family::of_files_quietly(files);
    let default_cfg = family.as_ref().map_or(7.0, |f| f.sampling().cfg_scale);
    let guided = run.cfg_scale.unwrap_or(default_cfg) != 1.0;
    let batch: u64 = if guided { 2 } else { 1 };
    let t5_tokens: u64 = family.as_ref().map_or(TE_TOKENS, |f| f.text_tokens());
    let rows = if dit { latent / 4 * batch } else { latent * batch };
    let levels = unet_levels(index.entries().iter().map(|e| e.name.as_str()));
    let mut weights = Vec::new();
    for e in index.entries() {
        let module = match index.component(e) {
            Component::Diffusion => Module::Diffusion,
            Component::TextEncoder(_) => Module::Te,
            Component::Vae | Component::Taesd => Module::Vae,
            _ => continue,
        };
        let (rows, attention) = match module {
            Module::Diffusion if dit => {
                let (r, a) = dit_rows(&e.name, latent / 4, t5_tokens, batch);
                (Some(r), a)
            }
            Module::Te if e.name.starts_with("text_encoders.t5xxl.") => (Some(t5_tokens), attention(&e.name)),
            _ => (level_rows(&e.name, levels, rows, latent), attention(&e.name)),
        };
        weights.push(WeightShape {
            module,
            block: index.block(e),
            shape: e.shape.clone(),
            ty: weight_type(e.dtype),
            bytes: e.dtype.loaded_bytes(e.len, &e.shape),
            attention_kv_tokens: attention,
            rows,
        });
    }
    Workload {
        steps,
        modules: vec![
            ModuleLoad { module: Module::Diffusion, tokens: rows, batch: batch as u32, runs: steps },
            ModuleLoad { module: Module::Te, tokens: TE_TOKENS, batch: 1, runs: batch as u32 },
            ModuleLoad { module: Module::Vae, tokens: latent * 16, batch: 1, runs: 1 },
        ],
        weights,
    }
}

/// Device figures for planning, and whether every device has measured ones (calibration or a
/// profile's `[device.cost]`): auto-fit chooses by time only then.
/// `descriptions`: each device's description (the calibration key), empty for a profile.
pub(crate) fn figures(
    devices: &[Device],
    descriptions: &BTreeMap<String, String>,
    profile: Option<&DeviceProfile>,
    speeds: &BTreeMap<String, f64>,
) -> (Figures, bool) {
    let file = if profile.is_some() { CalibrationFile::default() } else { read_file() };
    let mut out = Figures { source: String::new(), ..Figures::default() };
    let mut measured = true;
    let mut sources: Vec<String> = Vec::new();
    let mut cpu_listed = false;
    for d in devices {
        cpu_listed |= d.kind == DeviceType::Cpu;
        let rpc = d.registry_name().eq_ignore_ascii_case("RPC");
        let desc = descriptions.get(&d.name).cloned().unwrap_or_default();
        let from_profile =
            profile.and_then(|p| p.devices.iter().find(|x| x.name.trim() == d.name.trim())?.cost.clone());
        let calibrated =
            file.device.iter().find(|e| e.device == d.name && e.description == desc).map(|e| e.figures.clone());
        let (f, src) = match (from_profile, calibrated) {
            (Some(f), _) => (f, "profile"),
            (None, Some(f)) => (f, "calibrated"),
            (None, None) => {
                measured = false;
                let mut f = nominal_figures(d.kind, rpc);
                match speeds.get(&d.name) {
                    // The speed cache's figure at 512x512 (f16 block weights per second).
                    Some(&s) => {
                        f.matmul_f16 = s * sd_models::speed::latent_tokens(512, 512) as f64;
                        (f, "speed cache")
                    }
                    None => (f, "nominal"),
                }
            }
        };
        sources.push(format!("{} {src}", d.name));
        // A profile says its devices' hosts itself; for this machine's they are derived.
        let f = if src == "profile" { f } else { with_host(f, d.kind, rpc, &desc) };
        out.devices.insert(d.name.clone(), f);
    }
    if !cpu_listed {
        // The planner adds a CPU device when none is listed.
        let f = file.device.iter().find(|e| e.device == "CPU").map(|e| e.figures.clone());
        measured &= f.is_some();
        sources.push(format!("CPU {}", if f.is_some() { "calibrated" } else { "nominal" }));
        let f = f.unwrap_or_else(|| nominal_figures(DeviceType::Cpu, false));
        out.devices.insert("CPU".into(), with_host(f, DeviceType::Cpu, false, ""));
    }
    out.source = sources.join(", ");
    (out, measured)
}

/// `f` with its [`DeviceFigures::host`]: the machine whose cores the device computes with, when
/// others may share them. The local CPU and an RPC server on loopback compute on this
/// machine (`localhost`); another RPC server on its endpoint's host (two servers on one host
/// share it); a GPU or accelerator has compute of its own (empty).
fn with_host(mut f: DeviceFigures, kind: DeviceType, rpc: bool, description: &str) -> DeviceFigures {
    f.host = if kind == DeviceType::Cpu && !rpc {
        "localhost".into()
    } else if rpc {
        rpc_host(description)
    } else {
        String::new()
    };
    f
}

/// The host of an RPC endpoint `host:port` (`[v6]:port`), `localhost` for a loopback one.
fn rpc_host(endpoint: &str) -> String {
    let e = endpoint.trim();
    let host = match e.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => e.rsplit_once(':').map_or(e, |(h, _)| h),
    };
    let loopback =
        host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback {
        "localhost".into()
    } else {
        host.to_ascii_lowercase()
    }
}

/// A tensor source of zeros, borrowed (a load times the copy only).
struct Zeros(Vec<u8>);

impl sd_sched::TensorSource for Zeros {
    fn load(&self, _: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, sd_sched::SourceError> {
        let size = if ty == GgmlType::GGML_TYPE_F32 { 4 } else { 2 };
        let n = (ne.iter().product::<i64>().max(0) as usize) * size;
        Ok(Cow::Borrowed(&self.0[..n.min(self.0.len())]))
    }
}

/// The matmul probe's weight side (a transformer projection of SD 1.x).
const PROBE_SIDE: i64 = 1280;

/// Bytes of f16 weight per second of a `[PROBE_SIDE]²` weight times `rows` f32 activations on
/// `backend` ([`probe_s`]).
fn matmul_bytes_per_s(backend: &Arc<Backend>, rows: u64) -> Result<f64> {
    gemm_bytes_per_s(backend, PROBE_SIDE, PROBE_SIDE, rows)
}

/// Bytes of f16 weight per second of an `[out, inp]` weight times `rows` f32 activations.
fn gemm_bytes_per_s(backend: &Arc<Backend>, out: i64, inp: i64, rows: u64) -> Result<f64> {
    let rows = rows.clamp(1, 1 << 16) as i64;
    let s = probe_s(backend, vec![inp, out], vec![inp, rows], |g, w, x| g.mul_mat(w, x))?;
    Ok((out * inp * 2) as f64 / s)
}

/// The memory probe's weight, `[MEMORY_OUT, PROBE_SIDE]` f16 (50 MiB): larger than the caches,
/// so a matrix-vector product through it reads memory, as a model's weights are read.
const MEMORY_OUT: i64 = 20480;

/// Convolution FLOP/s: a 3x3 convolution of 320 channels over 32x32 positions (a UNet's first
/// level at 256x256), through ggml's im2col and matmul as the models run it ([`probe_s`]).
fn conv_flops_per_s(backend: &Arc<Backend>) -> Result<f64> {
    const C: i64 = 320;
    const SIDE: i64 = 32;
    let s = probe_s(backend, vec![3, 3, C, C], vec![SIDE, SIDE, C, 1], |g, k, x| g.conv_2d(k, x, 1, 1, 1, 1, 1, 1))?;
    Ok((2 * 9 * C * C * SIDE * SIDE) as f64 / s)
}

/// The best seconds of three computes of `op(w, x)` (`w` f16, `x` f32, shapes innermost
/// first) on `backend`, each followed by a 4-byte read of the output (which waits for the
/// compute on every backend, an RPC one included).
fn probe_s(
    backend: &Arc<Backend>,
    w_ne: Vec<i64>,
    x_ne: Vec<i64>,
    op: impl for<'c> Fn(
        &'c sd_backends::Context,
        sd_backends::Tensor<'_>,
        sd_backends::Tensor<'_>,
    ) -> sd_backends::Tensor<'c>,
) -> Result<f64> {
    let largest = w_ne.iter().product::<i64>().max(x_ne.iter().product::<i64>());
    let specs = vec![
        sd_sched::TensorSpec { name: "w".into(), ty: GgmlType::GGML_TYPE_F16, ne: w_ne },
        sd_sched::TensorSpec { name: "x".into(), ty: GgmlType::GGML_TYPE_F32, ne: x_ne },
    ];
    let mut w = sd_sched::Weights::new(specs)?;
    w.allocate(backend.device().buffer_type())?;
    w.load_from(&Zeros(vec![0u8; (largest * 4) as usize]))?;
    let g = sd_backends::Context::for_graph(16, 16)?;
    let y = op(&g, w.get("w")?, w.get("x")?);
    let graph = g.new_graph(16);
    graph.expand(y);
    let mut runner = sd_sched::Runner::new("calibration", backend.clone());
    runner.alloc(&graph)?;
    runner.compute(&graph)?;
    y.read_range(0, 4)?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t0 = Instant::now();
        runner.compute(&graph)?;
        y.read_range(0, 4)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best.max(1e-9))
}

/// Best seconds of three uploads of an f16 tensor of `bytes` to `backend`, each followed by a
/// 2-byte read (which waits for the upload: an RPC upload is not answered), and the best of a
/// 2-byte read alone (the round trip).
fn upload_s(backend: &Arc<Backend>, bytes: i64) -> Result<(f64, f64)> {
    let n = (bytes / 2).max(1);
    let specs = vec![sd_sched::TensorSpec { name: "x".into(), ty: GgmlType::GGML_TYPE_F16, ne: vec![n] }];
    let mut w = sd_sched::Weights::new(specs)?;
    w.allocate(backend.device().buffer_type())?;
    let src = Zeros(vec![0u8; (n * 2) as usize]);
    w.load_from(&src)?;
    let (mut best, mut trip) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        let t0 = Instant::now();
        w.load_from(&src)?;
        w.get("x")?.read_range(0, 2)?;
        best = best.min(t0.elapsed().as_secs_f64());
        let t1 = Instant::now();
        w.get("x")?.read_range(0, 2)?;
        trip = trip.min(t1.elapsed().as_secs_f64());
    }
    Ok((best, trip))
}

/// Measures one device.
fn measure(backend: &Arc<Backend>, is_cpu: bool) -> Result<DeviceFigures> {
    let matmul_f16 = matmul_bytes_per_s(backend, PROBE_ROWS)? * PROBE_ROWS as f64;
    let memory_bytes_per_s = gemm_bytes_per_s(backend, MEMORY_OUT, PROBE_SIDE, 1)?;
    let conv = conv_flops_per_s(backend)?;
    let (link_bytes_per_s, link_latency_s) = if is_cpu {
        (0.0, 0.0)
    } else {
        let (big, latency) = upload_s(backend, LINK_BYTES)?;
        (LINK_BYTES as f64 / (big - latency).max(1e-9), latency)
    };
    Ok(DeviceFigures { matmul_f16, conv, memory_bytes_per_s, link_bytes_per_s, link_latency_s, ..Default::default() })
}

/// Runs `calibrate`: measures every device (the speed cache answers for probes already run)
/// and stores the figures.
pub fn run(args: &CalibrateArgs, dev_args: &crate::DeviceArgs) -> Result<ExitCode> {
    let reg = crate::devices::open(dev_args)?;
    if let Some(path) = &args.from_report {
        return fit(path, &descriptions(&reg));
    }
    let manager = sd_backends::BackendManager::new(Some(sd_backends::threads::resolve_threads(args.threads)));
    let mut file = read_file();
    let mut measured = Vec::new();
    for dev in reg.devices().into_iter().filter(|d| d.kind() != sd_backends::DeviceKind::Meta) {
        let (name, description) = (dev.name(), dev.description());
        let is_cpu = dev.kind() == sd_backends::DeviceKind::Cpu;
        let backend = manager.get(dev)?;
        let t0 = Instant::now();
        let f = measure(&backend, is_cpu).with_context(|| format!("calibrating {name}"))?;
        tracing::info!("{name}: calibrated in {:.1} s", t0.elapsed().as_secs_f64());
        file.device.retain(|e| !(e.device == name && e.description == description));
        file.device.push(Entry { device: name.clone(), description: description.clone(), figures: f.clone() });
        measured.push(Entry { device: name, description, figures: f });
    }
    write_file(&file)?;
    if args.json {
        crate::out!("{}", serde_json::to_string_pretty(&measured)?);
    } else {
        for e in &measured {
            let f = &e.figures;
            crate::out!(
                "{:<10} matmul f16 {:>8.1} GFLOP/s  conv {:>8.1} GFLOP/s  memory {:>7.1} GB/s  link {}  ({})",
                e.device,
                f.matmul_f16 / 1e9,
                f.conv / 1e9,
                f.memory_bytes_per_s / 1e9,
                if f.link_bytes_per_s > 0.0 {
                    format!("{:.2} GB/s, {:.2} ms", f.link_bytes_per_s / 1e9, f.link_latency_s * 1e3)
                } else {
                    "none (host memory)".into()
                },
                e.description
            );
        }
        crate::out!("stored in {}", figures_path().display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Each device's description by name (the calibration key).
pub(crate) fn descriptions(reg: &sd_backends::PluginRegistry) -> BTreeMap<String, String> {
    reg.device_infos().into_iter().map(|i| (i.name, i.description)).collect()
}

/// The plan of `request` chosen by predicted time ([`sd_placement::plan_by_time`]). With
/// figures that are not all measured, the ladder's plan is kept (the prediction and the
/// alternatives are still given), and the reason says so.
pub(crate) fn choose(
    request: &sd_placement::PlanRequest,
    work: &Workload,
    figures: &Figures,
    measured: bool,
) -> Result<(sd_placement::Plan, sd_placement::Explain)> {
    let (chosen, mut explain) = sd_placement::plan_by_time(request, work, figures)?;
    if measured || explain.ladder.is_none() {
        return Ok((chosen, explain));
    }
    let mut ladder = sd_placement::plan(request)?;
    let reason = format!(
        "auto-fit by time: the ladder's plan kept: not every device has measured figures ({}); run `sd-cli calibrate`",
        figures.source
    );
    ladder.choice = Some(reason.clone());
    explain.chosen = explain.ladder.clone().unwrap_or(explain.chosen);
    explain.reason = reason;
    Ok((ladder, explain))
}

/// Per device of a run report, the compute to fit: `(measured seconds, predicted seconds,
/// whether of the diffusion model)` of its single-device modules. The diffusion model alone
/// sets a device's factor where it ran there: it is what a step runs, and the modules'
/// kernels differ in how far they fall short of the probes (the SD 1.5 UNet by about 1.3x
/// more than its VAE on this project's two-core machine).
fn fit_times(
    report: &sd_models::report::RunReport,
    predicted: &sd_placement::Prediction,
) -> BTreeMap<String, (f64, f64, bool)> {
    let mut per: BTreeMap<String, (f64, f64, bool)> = BTreeMap::new();
    for r in report.runners.iter().filter(|r| r.stages.is_empty()) {
        let Some(module) = Module::parse(&r.name) else { continue };
        let Some(m) = predicted.modules.iter().find(|m| m.module == module) else { continue };
        let (measured, predicted) = (r.stats.compute_secs, m.compute_s * r.stats.runs as f64);
        let diffusion = module == Module::Diffusion;
        let e = per.entry(r.device.clone()).or_default();
        match (e.2, diffusion) {
            (true, false) => {}
            (false, true) => *e = (measured, predicted, true),
            _ => {
                e.0 += measured;
                e.1 += predicted;
            }
        }
    }
    per
}

/// `calibrate --from-report`: scales each device's calibrated throughputs so that the report's
/// prediction of its single-device modules' compute matches the measured compute.
fn fit(path: &std::path::Path, descriptions: &BTreeMap<String, String>) -> Result<ExitCode> {
    let text = sd_models::files::open::read_text(path, 256 << 20).context("--from-report")?;
    let report = sd_models::report::RunReport::from_json(&text).with_context(|| format!("{}", path.display()))?;
    let predicted = report.predicted.as_ref().with_context(|| {
        format!("{}: the report has no prediction (written by an older sd-cli, or by `plan`)", path.display())
    })?;
    let per = fit_times(&report, predicted);
    if per.is_empty() {
        anyhow::bail!("{}: no module ran on one device with a prediction to fit", path.display());
    }
    let mut file = read_file();
    for (device, (measured, predicted, diffusion)) in &per {
        let description = descriptions.get(device).cloned().unwrap_or_default();
        let Some(e) = file.device.iter_mut().find(|e| &e.device == device && e.description == description) else {
            anyhow::bail!("{device} ({description}) has no calibrated figures to fit: run `sd-cli calibrate` first");
        };
        if *measured <= 0.0 || *predicted <= 0.0 {
            continue;
        }
        let factor = measured / predicted;
        let f = &mut e.figures;
        for v in [&mut f.matmul_f16, &mut f.matmul_q8, &mut f.matmul_q4, &mut f.conv, &mut f.attention] {
            *v /= factor;
        }
        crate::out!(
            "{device}: measured compute {measured:.2} s against {predicted:.2} s predicted{}: throughputs scaled by 1/{factor:.2} \
             (matmul f16 now {:.1} GFLOP/s)",
            if *diffusion { " (the diffusion model's)" } else { "" },
            f.matmul_f16 / 1e9
        );
    }
    write_file(&file)?;
    crate::out!("stored in {}", figures_path().display());
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fit_takes_the_diffusion_models_compute_where_it_ran() {
        use sd_models::report::{RunReport, RunnerReport};
        let runner = |name: &str, device: &str, runs, compute_secs| RunnerReport {
            name: name.into(),
            device: device.into(),
            stats: sd_sched::RunStats { runs, compute_secs, ..Default::default() },
            uploaded_bytes: 0,
            upload_seconds: 0.0,
            stages: Vec::new(),
            profile: None,
        };
        let module = |module, compute_s| sd_placement::ModuleTime {
            module,
            runs: 1,
            run_s: compute_s,
            first_run_s: compute_s,
            compute_s,
            bytes_per_run: 0,
            how: String::new(),
        };
        let mut r = RunReport::new("generate", Vec::new());
        // te before the UNet on GPU0: the UNet alone counts there; te and the VAE on the CPU
        // both count.
        r.runners = vec![
            runner("te", "GPU0", 2, 0.5),
            runner("unet", "GPU0", 4, 8.0),
            runner("te", "CPU", 1, 0.3),
            runner("vae", "CPU", 1, 3.0),
        ];
        let p = sd_placement::Prediction {
            step_s: 0.0,
            bytes_per_step: 0,
            total_s: 0.0,
            modules: vec![module(Module::Te, 0.1), module(Module::Diffusion, 0.5), module(Module::Vae, 1.0)],
            peak: Vec::new(),
            unpredicted: Vec::new(),
            figures: String::new(),
        };
        let t = fit_times(&r, &p);
        assert_eq!(t["GPU0"], (8.0, 2.0, true));
        let (m, q, d) = t["CPU"];
        assert!((m - 3.3).abs() < 1e-12 && (q - 1.1).abs() < 1e-12 && !d, "{:?}", t["CPU"]);
    }

    #[test]
    fn devices_on_one_machine_name_its_host() {
        assert_eq!(rpc_host("127.0.0.1:50052"), "localhost");
        assert_eq!(rpc_host("127.3.4.5:1"), "localhost");
        assert_eq!(rpc_host("LocalHost:50052"), "localhost");
        assert_eq!(rpc_host("[::1]:50052"), "localhost");
        assert_eq!(rpc_host("Box-7.lan:50052"), "box-7.lan");
        assert_eq!(rpc_host("[fe80::2]:9"), "fe80::2");
        assert_eq!(rpc_host("10.0.0.7:1"), rpc_host("10.0.0.7:2"), "two servers on one host share it");
        let f = || nominal_figures(DeviceType::Gpu, true);
        assert_eq!(with_host(f(), DeviceType::Gpu, true, "127.0.0.1:9").host, "localhost");
        assert_eq!(with_host(f(), DeviceType::Cpu, false, "Intel Xeon").host, "localhost");
        assert_eq!(with_host(f(), DeviceType::Gpu, false, "NVIDIA H100").host, "", "a GPU computes on its own");
    }

    /// FLUX.1-dev's real layout (sparse header-only files) at 1024x1024: each stream's rows
    /// and the text encoders' tokens and runs, with and without guidance.
    #[test]
    fn a_flux_workload_has_each_streams_rows_and_t5s_tokens() {
        let dir = std::env::temp_dir().join(format!("sd-cli-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sources = sd_models::presets::write_layouts("flux-dev", &dir).unwrap();
        let files = ModelFiles::open(&sources).unwrap();
        let run = RunShape { width: 1024, height: 1024, steps: 20, cfg_scale: None };
        let work = workload(&files, run);
        let guided = workload(&files, RunShape { cfg_scale: Some(3.5), ..run });
        drop(files);
        let _ = std::fs::remove_dir_all(&dir);
        let (img, txt) = (4096, 256);
        let rows_of = |w: &Workload, module: Module, shape: &[u64]| -> Vec<(Option<u64>, Option<u64>)> {
            let mut v: Vec<_> = w
                .weights
                .iter()
                .filter(|s| s.module == module && s.shape == shape)
                .map(|s| (s.rows, s.attention_kv_tokens))
                .collect();
            v.sort();
            v.dedup();
            v
        };
        // A double block's modulation (18432 x 3072) runs on one vector per sample.
        assert_eq!(rows_of(&work, Module::Diffusion, &[18432, 3072]), [(Some(1), None)]);
        assert_eq!(rows_of(&guided, Module::Diffusion, &[18432, 3072]), [(Some(2), None)]);
        // The MLPs' first layers (12288 x 3072): image rows and text rows.
        assert_eq!(rows_of(&work, Module::Diffusion, &[12288, 3072]), [(Some(txt), None), (Some(img), None)]);
        // A single block's linear2 (3072 x 15360): both streams, with their self attention.
        assert_eq!(rows_of(&work, Module::Diffusion, &[3072, 15360]), [(Some(img + txt), Some(0))]);
        // The attention output projections (3072 x 3072) carry the joint attention.
        assert!(rows_of(&work, Module::Diffusion, &[3072, 3072]).contains(&(Some(img), Some(img + txt))));
        // T5-XXL's feed-forward (10240 x 4096) reads a 256-token chunk; the encoders run once
        // without guidance and twice with it.
        assert_eq!(rows_of(&work, Module::Te, &[10240, 4096]), [(Some(txt), None)]);
        let te_runs = |w: &Workload| w.modules.iter().find(|m| m.module == Module::Te).unwrap().runs;
        assert_eq!((te_runs(&work), te_runs(&guided)), (1, 2));
    }
}
