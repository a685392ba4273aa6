//! The cost model: seconds per step a [`Plan`] would take, from device and link figures and the model's weight shapes.
//!
//! # Inputs
//!
//! * [`Figures`]: per device ([`DeviceFigures`]) its compute throughput by [`OpClass`]
//!   (FLOP/s), its memory bandwidth, and its link to the host (bandwidth and latency: PCIe for
//!   a local GPU, the network for an RPC endpoint); the disk's read bandwidth. They come from
//!   calibration (`sd-cli calibrate`), a device profile's `[device.cost]` table, or the speed
//!   cache of `--split-by speed` (a matmul f16 figure only).
//! * [`Workload`]: the weight tensors' shapes per module and block ([`WeightShape`]), and per
//!   module the activations' token count and how many times it runs in a generation
//!   ([`ModuleLoad`]).
//!
//! # The model
//!
//! A block's cost ([`block_costs`]) is computed from shapes, never measured: a 2-D weight of
//! `[out, in]` applied to `T` tokens is `2·in·out·T` FLOPs of a matmul of the weight's type; a
//! 4-D weight `[cout, cin, kh, kw]` is `2·cout·cin·kh·kw·T` convolution FLOPs; a weight marked
//! as an attention's query projection adds `4·T·T_kv·out` attention FLOPs. A block computes
//! on a device in `max(Σ FLOPs_c / rate_c, weight bytes / memory bandwidth)` (a roofline).
//!
//! [`predict`] replays each module of a plan as the runtime executes it:
//!
//! * params resident on the computing device: the blocks' compute, one graph per run;
//! * params elsewhere (another device, RAM, disk): the blocks that stay resident once warm are
//!   the ones the executor's segment planner ([`crate::segments`]) keeps, replayed here for
//!   three runs on the device's budget and free memory (other modules' weights there do not
//!   count: modules run one after another, and the ledger evicts idle replicas of any module),
//!   one segment per block with a workspace of its widest activations; the others are streamed each run, the next segment's weights prefetched while
//!   the current one computes: `t_0 + Σ max(c_i, t_{i+1})`, where `t_i` is segment `i`'s
//!   transfer (0 for a kept block) and `c_i` its compute;
//! * a layer split: the stages in sequence plus each boundary's activation copy (device to
//!   host to device); with `m` micro-batches (`--pipeline-copies`, at most the batch) a stage
//!   takes `s/m` per micro-batch and the run `Σ s_j/m + (m-1)·max s_j/m`, except when two
//!   stages' devices compute on one host's cores ([`DeviceFigures::host`]): they take turns,
//!   so the stages run in sequence (`m = 1`);
//! * a row split is not predicted (listed in [`Prediction::unpredicted`]).
//!
//! The peak on each device is the plan's own accounting ([`crate::DeviceUsage::used_bytes`]).
//!
//! The segment planner is the executor's own (sd-sched re-exports [`crate::segments`]), so
//! the bytes predicted per step are what the executor's schedules copy for the same segments
//! and room; sd-sched's tests check this against its `Simulator` on equal blocks.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::device::DeviceType;
use crate::model::Module;
use crate::plan::{ModulePlan, ParamsHome, Plan, SplitKind};
use crate::segments::{DeviceState, Estimate, ModuleGraph, Options, ParamGroup, Segment, Simulator};
use crate::units::fmt_bytes;

/// A class of operation whose throughput a device reports separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    /// Matrix products with f16, bf16 or f32 weights.
    MatmulF16,
    /// Matrix products with 8-bit quantized weights.
    MatmulQ8,
    /// Matrix products with weights of 6 bits or fewer.
    MatmulQ4,
    /// Convolutions (4-D weights).
    Conv,
    /// Attention (`QKᵀ` and `·V`).
    Attention,
}

impl OpClass {
    /// Every class.
    pub const ALL: [OpClass; 5] =
        [OpClass::MatmulF16, OpClass::MatmulQ8, OpClass::MatmulQ4, OpClass::Conv, OpClass::Attention];

    fn index(self) -> usize {
        self as usize
    }
}

/// One device's figures. A throughput of 0 (not measured) falls back to `matmul_f16`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeviceFigures {
    /// FLOP/s of f16 matrix products (required: the fallback of the other classes).
    pub matmul_f16: f64,
    /// FLOP/s of 8-bit quantized matrix products.
    pub matmul_q8: f64,
    /// FLOP/s of 4-bit quantized matrix products.
    pub matmul_q4: f64,
    /// FLOP/s of convolutions.
    pub conv: f64,
    /// FLOP/s of attention.
    pub attention: f64,
    /// Bytes/s the device reads its own memory at (0: no memory bound).
    pub memory_bytes_per_s: f64,
    /// Bytes/s between host RAM and the device (0: no link, the CPU's own memory).
    pub link_bytes_per_s: f64,
    /// Seconds of one round trip to the device (a graph launch or a transfer; an RPC
    /// endpoint's network latency).
    pub link_latency_s: f64,
    /// The machine whose cores and memory the device computes with, when other devices may
    /// share them (the local CPU and RPC servers on loopback: `localhost`; RPC servers: their
    /// host); empty for a device with compute of its own (a GPU). Devices naming one host do
    /// not overlap in a pipelined layer split: they take turns on the same cores.
    pub host: String,
}

impl DeviceFigures {
    /// FLOP/s of `class`.
    pub fn rate(&self, class: OpClass) -> f64 {
        let r = match class {
            OpClass::MatmulF16 => self.matmul_f16,
            OpClass::MatmulQ8 => self.matmul_q8,
            OpClass::MatmulQ4 => self.matmul_q4,
            OpClass::Conv => self.conv,
            OpClass::Attention => self.attention,
        };
        if r > 0.0 {
            r
        } else {
            self.matmul_f16
        }
    }

    /// Whether every figure is a finite number, not negative, and `matmul_f16` is positive.
    pub fn check(&self) -> Result<(), String> {
        let all = [
            ("matmul_f16", self.matmul_f16),
            ("matmul_q8", self.matmul_q8),
            ("matmul_q4", self.matmul_q4),
            ("conv", self.conv),
            ("attention", self.attention),
            ("memory_bytes_per_s", self.memory_bytes_per_s),
            ("link_bytes_per_s", self.link_bytes_per_s),
            ("link_latency_s", self.link_latency_s),
        ];
        if let Some((k, v)) = all.iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
            return Err(format!("{k} = {v} is not a finite number >= 0"));
        }
        if self.matmul_f16 <= 0.0 {
            return Err("matmul_f16 must be a positive number of FLOP/s".into());
        }
        Ok(())
    }

    /// Seconds to move `bytes` over the link (no link: free; latency counted once).
    fn link_s(&self, bytes: u64) -> f64 {
        if bytes == 0 {
            return 0.0;
        }
        let bw = if self.link_bytes_per_s > 0.0 { bytes as f64 / self.link_bytes_per_s } else { 0.0 };
        bw + self.link_latency_s
    }
}

/// Every device's figures and the disk's.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// By device name (case-insensitive).
    pub devices: BTreeMap<String, DeviceFigures>,
    /// Bytes/s the model files are read at (params on `disk`); 0: not known (disk plans are
    /// not predicted).
    #[serde(default)]
    pub disk_bytes_per_s: f64,
    /// Where the figures come from, for a person (`calibrated`, `profile`, `speed cache`).
    #[serde(default)]
    pub source: String,
}

impl Figures {
    /// The figures of device `name`.
    pub fn device(&self, name: &str) -> Option<&DeviceFigures> {
        self.devices.iter().find(|(k, _)| k.trim().eq_ignore_ascii_case(name.trim())).map(|(_, v)| v)
    }
}

/// Weight storage as far as the cost is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightType {
    /// f32, f16, bf16.
    Float,
    /// 8-bit quantized.
    Q8,
    /// 6 bits or fewer.
    Q4,
}

/// One weight tensor's shape, as a file header gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightShape {
    /// The module that runs it.
    pub module: Module,
    /// Its block (as [`crate::Tensor::block`]); `None`: a non-block tensor.
    pub block: Option<u32>,
    /// Shape, outermost dimension first (`[out, in]`, `[cout, cin, kh, kw]`).
    pub shape: Vec<u64>,
    /// Storage type.
    pub ty: WeightType,
    /// Bytes once loaded.
    pub bytes: u64,
    /// Set on an attention's query projection: the key/value token count (`Some(0)`: self
    /// attention, as many as the queries).
    #[serde(default)]
    pub attention_kv_tokens: Option<u64>,
    /// Activation rows this weight sees when they differ from its module's
    /// ([`ModuleLoad::tokens`]): a UNet level's downsampled positions, `Some(0)` for a weight
    /// that is not computed (a VAE's encoder in text-to-image).
    #[serde(default)]
    pub rows: Option<u64>,
}

/// How one module runs in a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModuleLoad {
    /// The module.
    pub module: Module,
    /// Activation rows every matmul sees in one run (tokens × batch).
    pub tokens: u64,
    /// Samples in one run (a CFG diffusion step evaluates 2): the most micro-batches a
    /// pipelined layer split can use.
    pub batch: u32,
    /// Runs in a generation (diffusion: the steps; te and vae: 1).
    pub runs: u32,
}

/// What a generation computes: shapes and how often each module runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Sampling steps.
    pub steps: u32,
    /// Per module.
    pub modules: Vec<ModuleLoad>,
    /// The weights.
    pub weights: Vec<WeightShape>,
}

/// The cost of one block (or of a module's non-block tensors) in one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockCost {
    /// Block index; `None` for the non-block tensors.
    pub index: Option<u32>,
    /// FLOPs by [`OpClass`] (in [`OpClass::ALL`] order).
    pub flops: [f64; 5],
    /// Weight bytes.
    pub weight_bytes: u64,
    /// Bytes of the block's output (f32 activations of its widest weight): what crosses a
    /// split boundary after it.
    pub out_bytes: u64,
}

impl BlockCost {
    fn empty(index: Option<u32>) -> Self {
        BlockCost { index, flops: [0.0; 5], weight_bytes: 0, out_bytes: 0 }
    }

    /// Seconds on a device: `max(Σ FLOPs_c / rate_c, weight bytes / memory bandwidth)`.
    pub fn compute_s(&self, d: &DeviceFigures) -> f64 {
        let flops: f64 = OpClass::ALL.iter().map(|c| self.flops[c.index()] / d.rate(*c)).sum();
        let mem = if d.memory_bytes_per_s > 0.0 { self.weight_bytes as f64 / d.memory_bytes_per_s } else { 0.0 };
        flops.max(mem)
    }
}

/// The non-block cost (first) and each block's, in index order, of `module` at `tokens`
/// activation rows.
pub fn block_costs(weights: &[WeightShape], module: Module, tokens: u64) -> Vec<BlockCost> {
    let mut non_block = BlockCost::empty(None);
    let mut blocks: BTreeMap<u32, BlockCost> = BTreeMap::new();
    for w in weights.iter().filter(|w| w.module == module) {
        let rows = w.rows.unwrap_or(tokens);
        let t = rows as f64;
        let c = match w.block {
            Some(b) => blocks.entry(b).or_insert_with(|| BlockCost::empty(Some(b))),
            None => &mut non_block,
        };
        c.weight_bytes = c.weight_bytes.saturating_add(w.bytes);
        let dims: Vec<f64> = w.shape.iter().map(|&d| d as f64).collect();
        let out = w.shape.first().copied().unwrap_or(0);
        match dims.len() {
            2 => {
                let class = match w.ty {
                    WeightType::Float => OpClass::MatmulF16,
                    WeightType::Q8 => OpClass::MatmulQ8,
                    WeightType::Q4 => OpClass::MatmulQ4,
                };
                c.flops[class.index()] += 2.0 * dims[0] * dims[1] * t;
                c.out_bytes = c.out_bytes.max(out.saturating_mul(rows).saturating_mul(4));
            }
            4 => {
                c.flops[OpClass::Conv.index()] += 2.0 * dims.iter().product::<f64>() * t;
                c.out_bytes = c.out_bytes.max(out.saturating_mul(rows).saturating_mul(4));
            }
            _ => {}
        }
        if let (Some(kv), true) = (w.attention_kv_tokens, rows > 0) {
            let kv = if kv == 0 { t } else { kv as f64 };
            c.flops[OpClass::Attention.index()] += 4.0 * t * kv * out as f64;
        }
    }
    std::iter::once(non_block).chain(blocks.into_values()).collect()
}

/// Seconds of a run streamed segment by segment: `t_0 + Σ max(c_i, t_{i+1})` (`t_n = 0`), the
/// next segment's weights copied while the current one computes.
pub fn streamed_s(segments: &[(f64, f64)]) -> f64 {
    let Some(first) = segments.first() else { return 0.0 };
    let mut total = first.0;
    for (i, &(_, c)) in segments.iter().enumerate() {
        let next_t = segments.get(i + 1).map_or(0.0, |s| s.0);
        total += c.max(next_t);
    }
    total
}

/// Seconds of a layer split's run: stages (each with its boundary copy) in sequence, or, with
/// `m > 1` micro-batches, `Σ s_j/m + (m-1)·max s_j/m`.
pub fn pipelined_s(stages: &[f64], micro_batches: u32) -> f64 {
    let m = f64::from(micro_batches.max(1));
    let sum: f64 = stages.iter().sum();
    let max = stages.iter().copied().fold(0.0, f64::max);
    sum / m + (m - 1.0) * max / m
}

/// Predicted figures of one module.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModuleTime {
    /// The module.
    pub module: Module,
    /// Runs in a generation.
    pub runs: u32,
    /// Seconds of one run once warm (what every run after the first takes).
    pub run_s: f64,
    /// Seconds of the first run (weights not resident yet are copied then).
    pub first_run_s: f64,
    /// Of `run_s`, the seconds spent computing (the sum over blocks, all devices).
    pub compute_s: f64,
    /// Bytes copied between host and devices in one warm run (weights streamed, activations
    /// crossing a split).
    pub bytes_per_run: u64,
    /// How the run was modelled, for a person.
    pub how: String,
}

/// The prediction for one plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Seconds per sampling step (the diffusion module's warm runs); 0 without one.
    pub step_s: f64,
    /// Bytes moved per step.
    pub bytes_per_step: u64,
    /// Seconds of a whole generation (every module's runs, first runs included; weights'
    /// initial load from the files not counted).
    pub total_s: f64,
    /// Per module.
    pub modules: Vec<ModuleTime>,
    /// Peak bytes per device (the plan's accounting).
    pub peak: Vec<(String, u64)>,
    /// Modules that could not be predicted, with the reason; the totals leave them out.
    pub unpredicted: Vec<String>,
    /// Where the figures come from ([`Figures::source`]).
    #[serde(default)]
    pub figures: String,
}

impl Prediction {
    /// Whether every module was predicted.
    pub fn complete(&self) -> bool {
        self.unpredicted.is_empty()
    }
}

/// Activations live at once in a module's graph, as a multiple of its widest block output
/// (ggml's allocator reuses buffers: a block's input, output, residual and a few temporaries).
const LIVE_ACTIVATIONS: u64 = 16;

/// Runs the executor's planner ([`crate::segments`]) has to settle: the first copies every
/// block, the second may still evict what the first left, the third is the steady state.
const RUNS_TO_WARM: usize = 3;

/// Which of `costs` (one segment each, in order) a warm run copies to `device`: the segment
/// planner the executor follows, replayed for [`RUNS_TO_WARM`] runs. Each segment's workspace
/// is [`LIVE_ACTIVATIONS`] times its output, at most the module's compute reserve.
fn streamed_when_warm(
    module: Module,
    costs: &[BlockCost],
    reserve: u64,
    device: DeviceState,
) -> Result<Vec<bool>, String> {
    let group = |i: usize| format!("{}/{i}", module.name());
    let segments = costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let groups = if c.weight_bytes > 0 { vec![ParamGroup::new(group(i), c.weight_bytes)] } else { Vec::new() };
            Segment::new(group(i), groups, c.out_bytes.saturating_mul(LIVE_ACTIVATIONS).min(reserve))
        })
        .collect();
    let graph = ModuleGraph { name: module.name().to_string(), segments };
    let name = device.name.clone();
    let mut sim = Simulator::new(device);
    let mut last = None;
    for _ in 0..RUNS_TO_WARM {
        let (_, report) = sim.run(&graph, &Options::default(), &mut Estimate).map_err(|e| format!("{name}: {e}"))?;
        last = Some(report);
    }
    let report = last.unwrap_or_default();
    let moved: std::collections::HashSet<&str> =
        report.loaded.iter().chain(&report.prefetched).map(String::as_str).collect();
    Ok((0..costs.len()).map(|i| moved.contains(group(i).as_str())).collect())
}

/// Predicts `plan` for `work` with `figures`.
pub fn predict(plan: &Plan, work: &Workload, figures: &Figures) -> Prediction {
    let mut out = Prediction {
        step_s: 0.0,
        bytes_per_step: 0,
        total_s: 0.0,
        modules: Vec::new(),
        peak: plan.devices.iter().map(|d| (d.device.clone(), d.used_bytes)).collect(),
        unpredicted: Vec::new(),
        figures: figures.source.clone(),
    };
    for m in &plan.modules {
        let Some(load) = work.modules.iter().find(|l| l.module == m.module) else {
            out.unpredicted.push(format!("{}: no workload given", m.module));
            continue;
        };
        let costs = block_costs(&work.weights, m.module, load.tokens);
        if costs.iter().all(|c| c.weight_bytes == 0) {
            out.unpredicted.push(format!("{}: no weight shapes given", m.module));
            continue;
        }
        match module_time(plan, m, load, &costs, figures) {
            Ok(t) => {
                out.total_s += t.first_run_s + f64::from(load.runs.saturating_sub(1)) * t.run_s;
                if m.module == Module::Diffusion && work.steps > 0 {
                    let per_step = f64::from(load.runs) / f64::from(work.steps);
                    out.step_s = t.run_s * per_step;
                    out.bytes_per_step = (t.bytes_per_run as f64 * per_step) as u64;
                }
                out.modules.push(t);
            }
            Err(why) => out.unpredicted.push(format!("{}: {why}", m.module)),
        }
    }
    out
}

fn figures_of<'a>(figures: &'a Figures, name: &str) -> Result<&'a DeviceFigures, String> {
    figures.device(name).ok_or_else(|| format!("no figures for device {name}"))
}

/// The host two of `devices` share ([`DeviceFigures::host`]), if any.
fn shared_host<'a>(figures: &'a Figures, devices: impl Iterator<Item = &'a str>) -> Result<Option<&'a str>, String> {
    let mut seen: Vec<&str> = Vec::new();
    for d in devices {
        let host = figures_of(figures, d)?.host.trim();
        if host.is_empty() {
            continue;
        }
        if seen.iter().any(|h| h.eq_ignore_ascii_case(host)) {
            return Ok(Some(host));
        }
        seen.push(host);
    }
    Ok(None)
}

/// Seconds to bring `bytes` of weights from `home` to device `to` (through the host).
fn transfer_s(figures: &Figures, home: &ParamsHome, to: &DeviceFigures, bytes: u64) -> Result<f64, String> {
    if bytes == 0 {
        return Ok(0.0);
    }
    let from = match home {
        ParamsHome::Disk => {
            if figures.disk_bytes_per_s <= 0.0 {
                return Err("params on disk and no disk read figure".into());
            }
            bytes as f64 / figures.disk_bytes_per_s
        }
        ParamsHome::Device(d) => figures_of(figures, d)?.link_s(bytes),
        ParamsHome::Split(_) => 0.0,
    };
    Ok(from + to.link_s(bytes))
}

fn module_time(
    plan: &Plan,
    m: &ModulePlan,
    load: &ModuleLoad,
    costs: &[BlockCost],
    figures: &Figures,
) -> Result<ModuleTime, String> {
    let runs = load.runs;
    match m.split_mode {
        SplitKind::Row => Err("row splits are not predicted".into()),
        SplitKind::None => {
            let rt = m.runtime.first().ok_or("no runtime device")?;
            let f = figures_of(figures, rt)?;
            let compute: Vec<f64> = costs.iter().map(|c| c.compute_s(f)).collect();
            let compute_s: f64 = compute.iter().sum();
            let resident = m.params.device().is_some_and(|d| d.eq_ignore_ascii_case(rt));
            if resident {
                let run_s = compute_s + f.link_latency_s;
                return Ok(ModuleTime {
                    module: m.module,
                    runs,
                    run_s,
                    first_run_s: run_s,
                    compute_s,
                    bytes_per_run: 0,
                    how: format!("resident on {rt}, one graph"),
                });
            }
            // Params elsewhere: which blocks stay once warm is what the executor's own planner
            // decides; replay it on the device's budget and free memory. Other modules' weights
            // there do not count: modules run one after another, and the ledger evicts idle
            // replicas of any module when a charge needs the room.
            let total: u64 = costs.iter().map(|c| c.weight_bytes).sum();
            let usage = plan.devices.iter().find(|d| d.device.eq_ignore_ascii_case(rt));
            let device =
                DeviceState::new(rt.clone(), usage.and_then(|d| d.budget_bytes), usage.and_then(|d| d.free_bytes));
            let streamed_blocks = streamed_when_warm(m.module, costs, m.compute_reserve_bytes, device)?;
            let first: Vec<(f64, f64)> = costs
                .iter()
                .zip(&compute)
                .map(|(c, &cs)| Ok((transfer_s(figures, &m.params, f, c.weight_bytes)?, cs + f.link_latency_s)))
                .collect::<Result<_, String>>()?;
            let first_run_s = streamed_s(&first);
            if !streamed_blocks.iter().any(|&b| b) {
                let run_s = compute_s + f.link_latency_s;
                return Ok(ModuleTime {
                    module: m.module,
                    runs,
                    run_s,
                    first_run_s,
                    compute_s,
                    bytes_per_run: 0,
                    how: format!("params on {}, copied to {rt} once, resident after the first run", m.params),
                });
            }
            let mut streamed = 0u64;
            let mut warm = Vec::with_capacity(costs.len());
            for ((c, &(t, cs)), &moved) in costs.iter().zip(&first).zip(&streamed_blocks) {
                if moved {
                    streamed = streamed.saturating_add(c.weight_bytes);
                    warm.push((t, cs));
                } else {
                    warm.push((0.0, cs));
                }
            }
            Ok(ModuleTime {
                module: m.module,
                runs,
                run_s: streamed_s(&warm),
                first_run_s,
                compute_s,
                bytes_per_run: streamed,
                how: format!(
                    "params on {}, segmented on {rt}: {} stay resident, {} streamed per run with prefetch",
                    m.params,
                    fmt_bytes(total - streamed),
                    fmt_bytes(streamed)
                ),
            })
        }
        SplitKind::Layer => {
            if !matches!(m.params, ParamsHome::Split(_)) {
                return Err("a layer split with params away from its devices is not predicted".into());
            }
            let mut stages = Vec::with_capacity(m.split.len());
            let mut compute_s = 0.0;
            let mut bytes = 0u64;
            for (i, r) in m.split.iter().enumerate() {
                let f = figures_of(figures, &r.device)?;
                let mut s = f.link_latency_s;
                let mut last_out = 0;
                for c in costs {
                    let inside = match c.index {
                        None => i == 0,
                        Some(b) => (r.first_block..=r.last_block).contains(&b),
                    };
                    if inside {
                        let t = c.compute_s(f);
                        s += t;
                        compute_s += t;
                        if c.index.is_some() {
                            last_out = c.out_bytes;
                        }
                    }
                }
                if let Some(next) = m.split.get(i + 1) {
                    let g = figures_of(figures, &next.device)?;
                    s += f.link_s(last_out) + g.link_s(last_out);
                    bytes = bytes.saturating_add(last_out.saturating_mul(2));
                }
                stages.push(s);
            }
            let shared = shared_host(figures, m.split.iter().map(|r| r.device.as_str()))?;
            let micro = if shared.is_some() { 1 } else { plan.pipeline_copies.min(load.batch).max(1) };
            let run_s = pipelined_s(&stages, micro);
            let mut how = format!("layer split over {} stages, {micro} micro-batch(es)", stages.len());
            if let Some(host) = shared {
                how.push_str(&format!(" (stages share the cores of {host}: they take turns, no overlap)"));
            }
            Ok(ModuleTime { module: m.module, runs, run_s, first_run_s: run_s, compute_s, bytes_per_run: bytes, how })
        }
    }
}

/// Nominal figures by device type, for planning before calibration (`plan --explain` says so):
/// a CPU of 200 GFLOP/s and 20 GB/s, a GPU of 20 TFLOP/s and 300 GB/s behind a 12 GB/s link,
/// an integrated GPU of 2 TFLOP/s sharing host memory; an RPC device's link 100 MB/s and 1 ms.
pub fn nominal(kind: DeviceType, rpc: bool) -> DeviceFigures {
    let (flops, mem, link) = match kind {
        DeviceType::Cpu => (200e9, 20e9, 0.0),
        DeviceType::Gpu => (20e12, 300e9, 12e9),
        DeviceType::Igpu => (2e12, 50e9, 20e9),
        DeviceType::Accel => (200e9, 20e9, 0.0),
    };
    let mut d =
        DeviceFigures { matmul_f16: flops, memory_bytes_per_s: mem, link_bytes_per_s: link, ..Default::default() };
    if rpc {
        d.link_bytes_per_s = 100e6;
        d.link_latency_s = 1e-3;
    }
    d
}

/// Seconds for a person: `1.23 s`, `45.6 ms`.
pub(crate) fn fmt_secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1000.0)
    }
}

impl Prediction {
    /// A few lines for a person.
    pub fn render(&self, title: &str) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "{title}: {} per step, {} moved per step, {} per generation",
            fmt_secs(self.step_s),
            fmt_bytes(self.bytes_per_step),
            fmt_secs(self.total_s)
        );
        for m in &self.modules {
            let _ = writeln!(
                o,
                "  {:<11} {:>3} run(s) x {:>9} (first {:>9}; compute {:>9}; {} moved per run): {}",
                m.module.name(),
                m.runs,
                fmt_secs(m.run_s),
                fmt_secs(m.first_run_s),
                fmt_secs(m.compute_s),
                fmt_bytes(m.bytes_per_run),
                m.how
            );
        }
        for u in &self.unpredicted {
            let _ = writeln!(o, "  not predicted: {u}");
        }
        o
    }
}
