//! The entry point [`plan`], its request, and the plan as a serde value with a text rendering.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::autofit::{auto_fit, ram_reserve};
use crate::budget::{resolve_budgets, Budget, BudgetRule};
use crate::cost::fmt_secs;
use crate::device::{validate_names, Device, DeviceType};
use crate::error::PlanError;
use crate::explicit::{explicit, Sizing};
use crate::memcheck::{check, gpu_figure, spread_over_gpus, MemoryCheck, Verdict};
use crate::model::{ComponentSummary, ModelDescription, Module};
use crate::placement::{account, names, reserve, Layout, Params, Placement, Usage};
use crate::spec::{
    parse_auto_fit, parse_max_vram, parse_pipeline_copies, parse_split_by, parse_split_mode, Flags, SplitBy,
    PIPELINE_COPIES_ENV,
};
use crate::units::{fmt_bytes, fmt_opt};

/// Everything [`plan`] needs: raw flag strings, devices, RAM, the model and (optionally) the
/// devices' measured speeds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanRequest {
    /// The flags as given on a command line.
    #[serde(default)]
    pub flags: Flags,
    /// Devices in listing order (ggml's order). A `CPU` device is added when none is listed.
    pub devices: Vec<Device>,
    /// Available system RAM in bytes (MemAvailable); `None` when it cannot be read.
    #[serde(default)]
    pub ram_available_bytes: Option<u64>,
    /// The model.
    pub model: ModelDescription,
    /// Measured device speeds by device name (case-insensitive), in bytes of block weights
    /// evaluated per second (a block of B bytes timed at t seconds per evaluation gives B / t).
    /// `--split-by speed` sizes layer splits with them, and the plan predicts a split module's
    /// time when every device of it has one. Names of absent devices are ignored; a listed
    /// device's value must be positive and finite.
    #[serde(default)]
    pub device_speeds: BTreeMap<String, f64>,
}

/// A contiguous block range on one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SplitRange {
    /// Device name.
    pub device: String,
    /// First block index (inclusive).
    pub first_block: u32,
    /// Last block index (inclusive).
    pub last_block: u32,
    /// Bytes of params this device holds for the module (its blocks; plus the non-block tensors
    /// on the main device; a row split counts the split tensors' full size on every device).
    pub param_bytes: u64,
    /// Layer split with a known speed for the device: the seconds this range takes per module
    /// evaluation, `param_bytes / speed` (the main range includes the non-block tensors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_s: Option<f64>,
    /// Graph-level row split: this device's share of the split weights' output rows (0..1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_share: Option<f64>,
}

/// Predicted time of a layer-split module per evaluation (one micro-batch), from the device
/// speeds. The ranges run one after another, so one pass takes the sum of the range times
/// whatever the sizing; with `--pipeline-copies` > 1 the devices overlap micro-batches and, once
/// the pipeline is full, a micro-batch completes every slowest-range time: `--split-by speed`
/// makes that maximum as small as the devices' memory allows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PredictedTime {
    /// Seconds of one evaluation: the sum over the ranges of bytes / speed.
    pub single_pass_s: f64,
    /// Seconds per micro-batch when pipelined: the slowest range (the largest bytes / speed).
    pub pipelined_s: f64,
}

/// How a module is split across devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitKind {
    /// One runtime device.
    None,
    /// Contiguous block ranges.
    Layer,
    /// Row-split block weights.
    Row,
}

/// Where one module runs and where its params live.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModulePlan {
    /// The module.
    pub module: Module,
    /// Runtime device names; the first is the main device.
    pub runtime: Vec<String>,
    /// Where params live (written as a device name, `disk`, or the runtime devices of a split
    /// joined by `&`).
    pub params: ParamsHome,
    /// Total params bytes.
    pub param_bytes: u64,
    /// Estimated compute reserve on each runtime device (a layer split's is multiplied by the
    /// pipeline copy count).
    pub compute_reserve_bytes: u64,
    /// Staging space for the largest tensor when params live away from the runtime device.
    pub staging_bytes: u64,
    /// Split kind.
    pub split_mode: SplitKind,
    /// Per-device block ranges; empty without a split.
    pub split: Vec<SplitRange>,
    /// How a layer split's ranges were sized (`speed` falls back to `memory` when a device's
    /// speed is unknown or no speed-sized split fits); absent without a layer split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sized_by: Option<SplitBy>,
    /// Predicted time per evaluation of a layer split whose every device has a known speed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<PredictedTime>,
}

/// Where a module's params live. In text and JSON it is written as `--params-backend` values
/// are: a device name, `disk`, or a split's runtime devices joined by `&`. Host RAM is the CPU
/// device's memory: [`ParamsHome::Device`] naming the CPU device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", from = "String")]
pub enum ParamsHome {
    /// On one device (by name): the runtime device, another device, or the CPU (host RAM).
    Device(String),
    /// Re-read from the model files on demand.
    Disk,
    /// Each runtime device of a split keeps its own part (names in split order, main first).
    Split(Vec<String>),
}

impl ParamsHome {
    /// The device holding every parameter, if one does.
    pub fn device(&self) -> Option<&str> {
        match self {
            ParamsHome::Device(d) => Some(d),
            ParamsHome::Disk | ParamsHome::Split(_) => None,
        }
    }
}

impl std::fmt::Display for ParamsHome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParamsHome::Device(d) => f.write_str(d),
            ParamsHome::Disk => f.write_str("disk"),
            ParamsHome::Split(devs) => f.write_str(&devs.join("&")),
        }
    }
}

impl From<ParamsHome> for String {
    fn from(h: ParamsHome) -> String {
        h.to_string()
    }
}

impl From<String> for ParamsHome {
    /// Reads the written form back (`disk` in any case, `A&B`, else a device name).
    fn from(s: String) -> Self {
        if s.eq_ignore_ascii_case("disk") {
            ParamsHome::Disk
        } else if s.contains('&') {
            ParamsHome::Split(s.split('&').map(str::to_string).collect())
        } else {
            ParamsHome::Device(s)
        }
    }
}

impl PartialEq<&str> for ParamsHome {
    fn eq(&self, other: &&str) -> bool {
        match self {
            ParamsHome::Device(d) => d == other,
            ParamsHome::Disk => *other == "disk",
            // the written form `A&B`, compared part by part
            ParamsHome::Split(devs) => {
                let mut parts = other.split('&');
                devs.iter().all(|d| parts.next() == Some(d.as_str())) && parts.next().is_none()
            }
        }
    }
}

/// What one device holds and may hold.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceUsage {
    /// Device name.
    pub device: String,
    /// Device kind.
    #[serde(rename = "type")]
    pub kind: DeviceType,
    /// Reported free memory.
    pub free_bytes: Option<u64>,
    /// Reported total memory.
    pub total_bytes: Option<u64>,
    /// Planning budget (available RAM for the CPU); `None` = unknown, not checked.
    pub budget_bytes: Option<u64>,
    /// The rule the budget comes from.
    pub budget_rule: BudgetRule,
    /// Resident params.
    pub param_bytes: u64,
    /// Compute space: the largest compute reserve of the modules running here.
    pub compute_bytes: u64,
    /// Staging space: the largest tensor of each module running here with params elsewhere.
    pub staging_bytes: u64,
    /// `param_bytes + compute_bytes + staging_bytes`.
    pub used_bytes: u64,
    /// `used_bytes <= budget_bytes` (true when the budget is unknown).
    pub fits: bool,
}

/// The version of [`Plan`]'s JSON layout (`schema_version`, the first field of
/// `sd-cli plan --json` and of a run report's plan): raised when a field is renamed, removed
/// or changes meaning; a field added leaves it.
pub const PLAN_SCHEMA_VERSION: u32 = 1;

/// A placement plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// [`PLAN_SCHEMA_VERSION`] when the plan was made (a reader refuses a version it does not
    /// know).
    #[serde(default = "schema_version")]
    pub schema_version: u32,
    /// Whether auto-fit made the placement.
    pub auto_fit: bool,
    /// Every device within its budget and the memory check not refusing.
    pub fits: bool,
    /// The computing device: auto-fit's main GPU (or the CPU), else diffusion's main device.
    pub main_device: String,
    /// Equivalent `--backend` (one entry per present module).
    pub backend: String,
    /// Equivalent `--params-backend` (entries where params do not follow the runtime).
    pub params_backend: String,
    /// Equivalent `--split-mode` (row entries only).
    pub split_mode: String,
    /// `--split-by`: how layer splits are sized (per module, see [`ModulePlan::sized_by`]).
    #[serde(default)]
    pub split_by: SplitBy,
    /// `--pipeline-copies` (or `SD_PIPELINE_COPIES`): micro-batches a layer-split module keeps
    /// in flight, each device holding that many copies of its cross-device inputs; 1 = none.
    #[serde(default = "one")]
    pub pipeline_copies: u32,
    /// Available RAM.
    pub ram_available_bytes: Option<u64>,
    /// RAM auto-fit keeps free (max(2 GiB, 10%)); `None` when not auto-fit or RAM unknown.
    pub ram_reserve_bytes: Option<u64>,
    /// Per-device usage, in listing order.
    pub devices: Vec<DeviceUsage>,
    /// Per-module placement, in the table order of stable-diffusion.cpp's `docs/backend.md`; only modules the model has.
    pub modules: Vec<ModulePlan>,
    /// The pre-load memory check.
    pub memory_check: MemoryCheck,
    /// Things a person should know.
    pub warnings: Vec<String>,
    /// How auto-fit by time chose (one line; [`crate::plan_by_time`]); absent from [`plan`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice: Option<String>,
}

fn one() -> u32 {
    1
}

fn schema_version() -> u32 {
    PLAN_SCHEMA_VERSION
}

/// Makes a plan. Errors only on bad input (flags, devices); a plan that does not fit is a
/// [`Plan`] with `fits == false` (see [`Plan::ensure_loadable`] for the refusal error).
pub fn plan(req: &PlanRequest) -> Result<Plan, PlanError> {
    let mut warnings = Vec::new();
    validate_names(req.devices.iter().map(|d| d.name.as_str()))
        .map_err(|reason| PlanError::InvalidDevices { reason })?;
    let mut devices: Vec<Device> = req.devices.clone();
    if !devices.iter().any(|d| d.kind == DeviceType::Cpu) {
        let mut cpu = Device::cpu();
        if devices.iter().any(|d| d.name.trim().eq_ignore_ascii_case("cpu")) {
            cpu.name = "CPU-host".into();
        }
        devices.push(cpu);
    }
    let cpu = devices.iter().position(|d| d.kind == DeviceType::Cpu).unwrap_or(0);

    let flags = &req.flags;
    let backend_spec = flags.effective_backend();
    let params_spec = flags.effective_params_backend();
    let backend = flags.backend_assignment()?;
    let params = flags.params_assignment()?;
    let split = parse_split_mode(flags.split_mode.as_deref().unwrap_or(""))?;
    let split_by = parse_split_by(flags.split_by.as_deref())?;
    let copies = parse_pipeline_copies(flags.pipeline_copies.as_deref(), flags.pipeline_copies_env.as_deref())?;
    let max_vram = parse_max_vram(flags.max_vram.as_deref().unwrap_or(""))?;
    let auto_fit_flag = parse_auto_fit(flags.auto_fit.as_deref())?;
    let ram = req.ram_available_bytes;
    let budgets = resolve_budgets(&devices, ram, &max_vram, &mut warnings)?;

    let explicit_given = !backend_spec.trim().is_empty() || !params_spec.trim().is_empty();
    let auto = auto_fit_flag && !explicit_given;
    if auto_fit_flag && explicit_given && flags.auto_fit.is_some() {
        warnings
            .push("--auto-fit on is ignored: explicit --backend/--params-backend assignments disable auto-fit".into());
    }
    if auto && !split.is_empty() {
        warnings.push("--split-mode does not change auto-fit placements (auto-fit never splits a module)".into());
    }

    let speeds = device_speeds(&devices, &req.device_speeds)?;
    let summaries = req.model.summaries();
    let (placements, sizing, main) = if auto {
        let a = auto_fit(&summaries, &devices, &budgets, ram, cpu, &mut warnings);
        (a.placements, Vec::new(), a.main)
    } else {
        let sizing = Sizing { by: split_by, speeds: speeds.clone(), copies };
        let e = explicit(&summaries, &devices, &budgets, &backend, &params, &split, &sizing, &mut warnings)?;
        (e.placements, e.sizing, e.main)
    };
    if !placements.iter().any(|p| matches!(p.layout, Layout::Layer(_))) {
        if copies > 1 {
            warnings.push(format!(
                "--pipeline-copies {copies} has no effect: no module is layer-split (pipelining overlaps the devices of a layer split)"
            ));
        }
        if split_by == SplitBy::Speed {
            warnings.push("--split-by speed has no effect: no module is layer-split".into());
        }
    }

    let usage = account(&summaries, &placements, devices.len(), copies);
    let setting = match flags.pipeline_copies {
        Some(_) => format!("--pipeline-copies {copies}"),
        None => format!("{PIPELINE_COPIES_ENV}={copies}"),
    };
    check_copies(&summaries, &placements, &devices, &budgets, (copies, setting), &usage)?;
    let mut device_usage = Vec::with_capacity(devices.len());
    for ((d, u), b) in devices.iter().zip(&usage).zip(&budgets) {
        let fits = b.bytes.is_none_or(|b| u.total() <= b);
        if !fits {
            warnings.push(format!(
                "{} needs {} (params {} + compute {} + staging {}) but its budget is {}",
                d.name.trim(),
                fmt_bytes(u.total()),
                fmt_bytes(u.params),
                fmt_bytes(u.compute),
                fmt_bytes(u.staging),
                fmt_opt(b.bytes)
            ));
        }
        device_usage.push(DeviceUsage {
            device: d.name.trim().to_string(),
            kind: d.kind,
            free_bytes: d.free_bytes,
            total_bytes: d.total_bytes,
            budget_bytes: b.bytes,
            budget_rule: b.rule,
            param_bytes: u.params,
            compute_bytes: u.compute,
            staging_bytes: u.staging,
            used_bytes: u.total(),
            fits,
        });
    }

    let (file_bytes, from_files) = req.model.file_bytes();
    if !from_files {
        warnings.push("no source file sizes given: the memory check uses the sum of tensor sizes".into());
    }
    let mut memory_check = check(&devices, ram, main, file_bytes, flags.no_memory_check);
    // Every weight on discrete GPUs (none in RAM or on disk): nothing stays in system memory,
    // whatever one GPU's figure says; the check compares with the GPUs holding them.
    let holding: Vec<(String, Option<u64>)> = devices
        .iter()
        .zip(&device_usage)
        .filter(|(_, u)| u.param_bytes > 0)
        .map(|(d, _)| (d.name.trim().to_string(), (d.kind == DeviceType::Gpu).then(|| gpu_figure(d)).flatten()))
        .collect();
    let on_disk = placements.iter().any(|p| matches!(p.params, Params::Disk));
    if !on_disk && holding.len() > 1 && holding.iter().all(|(_, f)| f.is_some()) {
        let gpus: Vec<(String, u64)> = holding.into_iter().map(|(n, f)| (n, f.unwrap_or(0))).collect();
        spread_over_gpus(&mut memory_check, &gpus);
    }
    if matches!(memory_check.verdict, Verdict::Warn | Verdict::Refuse) {
        warnings.push(format!("memory check: {}", memory_check.message));
    }

    let modules: Vec<ModulePlan> = Module::ALL
        .iter()
        .filter_map(|m| {
            let p = placements.iter().find(|p| p.module == *m)?;
            let s = summaries.iter().find(|s| s.module == *m)?;
            let by = sizing.iter().find(|(m2, _)| m2 == m).map(|(_, b)| *b);
            Some(module_plan(s, p, &devices, copies, by, &speeds))
        })
        .collect();
    if auto {
        rpc_default_note(&modules, &devices, &mut warnings);
    }
    let fits = device_usage.iter().all(|u| u.fits) && memory_check.verdict != Verdict::Refuse;
    let (backend_eq, params_eq, split_eq) = equivalent_flags(&placements, &devices);
    Ok(Plan {
        schema_version: PLAN_SCHEMA_VERSION,
        auto_fit: auto,
        fits,
        main_device: devices[main].name.trim().to_string(),
        backend: backend_eq,
        params_backend: params_eq,
        split_mode: split_eq,
        split_by,
        pipeline_copies: copies,
        ram_available_bytes: ram,
        ram_reserve_bytes: if auto { ram.map(ram_reserve) } else { None },
        devices: device_usage,
        modules,
        memory_check,
        warnings,
        choice: None,
    })
}

/// Says when auto-fit computes the text encoder or the VAE on a remote (RPC) device: ggml
/// reports RPC devices as GPUs, and auto-fit (as stable-diffusion.cpp's, whose default device
/// is the first GPU) places every module on its main GPU, so `--rpc-servers` alone moves them
/// off this machine; the note names the flag that keeps them here.
fn rpc_default_note(modules: &[ModulePlan], devices: &[Device], warnings: &mut Vec<String>) {
    let is_rpc =
        |name: &str| devices.iter().any(|d| d.name.trim() == name && d.registry.trim().eq_ignore_ascii_case("rpc"));
    let moved: Vec<(&str, &str)> = modules
        .iter()
        .filter(|m| matches!(m.module, Module::Te | Module::Vae))
        .filter_map(|m| m.runtime.first().filter(|d| is_rpc(d)).map(|d| (m.module.name(), d.as_str())))
        .collect();
    if moved.is_empty() {
        return;
    }
    let list = moved.iter().map(|(m, d)| format!("{m} on {d}")).collect::<Vec<_>>().join(", ");
    let keep = moved.iter().map(|(m, _)| format!("{m}=cpu")).collect::<Vec<_>>().join(",");
    warnings.push(format!(
        "{list}: ggml reports RPC devices as GPUs and auto-fit computes on the main GPU, as \
         stable-diffusion.cpp does; --backend \"{keep}\" (with the other modules' devices) keeps them on this machine"
    ));
}

/// Fails when the pipeline copies alone break a budget: a device over its budget with `copies`
/// that fits with one copy. The error names the device, its bytes and the most copies that fit.
fn check_copies(
    summaries: &[ComponentSummary],
    placements: &[Placement],
    devices: &[Device],
    budgets: &[Budget],
    (copies, setting): (u32, String),
    usage: &[Usage],
) -> Result<(), PlanError> {
    if copies <= 1 {
        return Ok(());
    }
    let over = |u: &[Usage]| u.iter().zip(budgets).position(|(u, b)| b.bytes.is_some_and(|b| u.total() > b));
    let Some(d) = over(usage) else { return Ok(()) };
    if over(&account(summaries, placements, devices.len(), 1)).is_some() {
        return Ok(()); // over budget whatever the copies: an ordinary plan that does not fit
    }
    // The reserve grows linearly with the copies: the largest count that fits, by bisection.
    let (mut lo, mut hi) = (1u32, copies);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if over(&account(summaries, placements, devices.len(), mid)).is_none() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Err(PlanError::TooManyPipelineCopies {
        setting,
        copies,
        device: devices[d].name.trim().to_string(),
        needed_bytes: usage[d].total(),
        compute_bytes: usage[d].compute,
        budget_bytes: budgets[d].bytes.unwrap_or(0),
        max_copies: lo,
    })
}

/// The speed of each device (by index) from the request's map; an invalid value of a device
/// that is present is an error.
fn device_speeds(devices: &[Device], given: &BTreeMap<String, f64>) -> Result<Vec<Option<f64>>, PlanError> {
    let mut out = vec![None; devices.len()];
    for (name, &v) in given {
        let Some(i) = devices.iter().position(|d| d.name.trim().eq_ignore_ascii_case(name.trim())) else {
            continue;
        };
        if !v.is_finite() || v <= 0.0 {
            return Err(PlanError::InvalidSpeed { device: name.clone(), value: v });
        }
        out[i] = Some(v);
    }
    Ok(out)
}

fn module_plan(
    s: &ComponentSummary,
    p: &Placement,
    devices: &[Device],
    copies: u32,
    sized_by: Option<SplitBy>,
    speeds: &[Option<f64>],
) -> ModulePlan {
    let runtime = names(devices, &p.layout.devices());
    let params = match p.params {
        Params::Disk => ParamsHome::Disk,
        Params::Device(d) => ParamsHome::Device(devices[d].name.trim().to_string()),
        Params::Follow if runtime.len() == 1 => ParamsHome::Device(runtime[0].clone()),
        Params::Follow => ParamsHome::Split(runtime.clone()),
    };
    let offloaded = match (&p.layout, p.params) {
        (Layout::Single(r), Params::Device(d)) => d != *r,
        (_, Params::Follow) => false,
        (Layout::Row(devs) | Layout::Rows(devs, _), Params::Device(d)) => !devs.contains(&d),
        _ => true,
    };
    let largest = match p.layout {
        Layout::Single(_) => s.largest_tensor,
        Layout::Row(_) | Layout::Rows(..) => s.largest_non_block,
        Layout::Layer(_) => s.largest_tensor,
    };
    let mut split = Vec::new();
    let (kind, first_all, last_all) =
        (&p.layout, s.blocks.first().map_or(0, |b| b.index), s.blocks.last().map_or(0, |b| b.index));
    let split_mode = match kind {
        Layout::Single(_) => SplitKind::None,
        Layout::Layer(ranges) => {
            for (i, r) in ranges.iter().enumerate() {
                if r.start == r.end {
                    continue;
                }
                let blocks = &s.blocks[r.start..r.end];
                let mut bytes = blocks.iter().fold(0u64, |a, b| a.saturating_add(b.bytes));
                if i == 0 {
                    bytes = bytes.saturating_add(s.non_block_bytes);
                }
                split.push(SplitRange {
                    device: devices[r.device].name.trim().to_string(),
                    first_block: blocks[0].index,
                    last_block: blocks[blocks.len() - 1].index,
                    param_bytes: bytes,
                    predicted_s: speeds[r.device].map(|v| bytes as f64 / v),
                    row_share: None,
                });
            }
            SplitKind::Layer
        }
        Layout::Row(devs) => {
            let split_bytes = s.param_bytes.saturating_sub(s.non_block_bytes);
            for (i, &d) in devs.iter().enumerate() {
                let own_non_block = i == 0 && matches!(p.params, Params::Follow);
                split.push(SplitRange {
                    device: devices[d].name.trim().to_string(),
                    first_block: first_all,
                    last_block: last_all,
                    param_bytes: if own_non_block {
                        split_bytes.saturating_add(s.non_block_bytes)
                    } else {
                        split_bytes
                    },
                    predicted_s: None,
                    row_share: None,
                });
            }
            SplitKind::Row
        }
        Layout::Rows(devs, ppm) => {
            let block_bytes = s.param_bytes.saturating_sub(s.non_block_bytes);
            for (i, (&d, &share)) in devs.iter().zip(ppm).enumerate() {
                split.push(SplitRange {
                    device: devices[d].name.trim().to_string(),
                    first_block: first_all,
                    last_block: last_all,
                    param_bytes: if i == 0 { s.param_bytes } else { crate::placement::rows_share(block_bytes, share) },
                    predicted_s: None,
                    row_share: Some(f64::from(share) / 1e6),
                });
            }
            SplitKind::Row
        }
    };
    let times: Option<Vec<f64>> = split.iter().map(|r| r.predicted_s).collect();
    let predicted = match (split_mode, times) {
        (SplitKind::Layer, Some(t)) if !t.is_empty() => {
            Some(PredictedTime { single_pass_s: t.iter().sum(), pipelined_s: t.iter().copied().fold(0.0, f64::max) })
        }
        _ => None,
    };
    ModulePlan {
        module: s.module,
        runtime,
        params,
        param_bytes: s.param_bytes,
        compute_reserve_bytes: reserve(s, p, copies),
        staging_bytes: if offloaded { largest } else { 0 },
        split_mode,
        split,
        sized_by,
        predicted,
    }
}

fn equivalent_flags(placements: &[Placement], devices: &[Device]) -> (String, String, String) {
    let mut backend = Vec::new();
    let mut params = Vec::new();
    let mut split = Vec::new();
    let mut sorted: Vec<&Placement> = placements.iter().collect();
    sorted.sort_by_key(|p| Module::PRIORITY.iter().position(|m| *m == p.module));
    for p in sorted {
        let m = p.module.name();
        backend.push(format!("{m}={}", names(devices, &p.layout.devices()).join("&")));
        match (&p.layout, p.params) {
            (_, Params::Disk) => params.push(format!("{m}=disk")),
            (Layout::Single(r), Params::Device(d)) if d == *r => {}
            (_, Params::Device(d)) => params.push(format!("{m}={}", devices[d].name.trim())),
            (_, Params::Follow) => {}
        }
        if matches!(p.layout, Layout::Row(_) | Layout::Rows(..)) {
            split.push(format!("{m}=row"));
        }
    }
    (backend.join(","), params.join(","), split.join(","))
}

impl Plan {
    /// The managed per-device budgets the runtime's ledgers enforce, as `(device, bytes)`:
    /// a positive `--max-vram` (the managed budget, capped by free memory) and a negative
    /// one (the startup free-memory snapshot less the reserve). `--max-vram 0` and no
    /// `--max-vram` set no managed budget: "0 uses the device's current free memory
    /// without an explicit budget" (performance.md; in the reference's code, 0 is its
    /// default and sets no graph budget), so only live free memory limits the runtime.
    /// The CPU never has one (its planning budget is available RAM).
    pub fn runtime_budgets(&self) -> Vec<(String, u64)> {
        self.devices
            .iter()
            .filter(|d| matches!(d.budget_rule, BudgetRule::Managed(_) | BudgetRule::FreeMinus(_)))
            .filter_map(|d| d.budget_bytes.map(|b| (d.device.clone(), b)))
            .collect()
    }

    /// `Err(PlanError::MemoryRefused)` when the memory check refuses the model: a loader calls
    /// this before loading.
    pub fn ensure_loadable(&self) -> Result<(), PlanError> {
        let mc = &self.memory_check;
        if mc.verdict != Verdict::Refuse {
            return Ok(());
        }
        Err(PlanError::MemoryRefused {
            estimate_bytes: mc.estimate_bytes,
            limit_bytes: mc.limit_bytes.unwrap_or(0),
            figures: mc.figures.clone(),
            device: mc.device.clone().unwrap_or_default(),
        })
    }

    /// The plan as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The plan for a person.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "placement plan: {} (auto-fit {}, computing on {})",
            if self.fits { "fits" } else { "DOES NOT FIT" },
            if self.auto_fit { "on" } else { "off" },
            self.main_device
        );
        let _ = writeln!(o, "devices:");
        for d in &self.devices {
            let _ = writeln!(
                o,
                "  {:<10} {:<5} free {:>11}  budget {:>11} ({})  params {:>11}  compute {:>11}  staging {:>10}  used {:>11}  {}",
                d.device,
                d.kind.name(),
                fmt_opt(d.free_bytes),
                fmt_opt(d.budget_bytes),
                d.budget_rule.describe(),
                fmt_bytes(d.param_bytes),
                fmt_bytes(d.compute_bytes),
                fmt_bytes(d.staging_bytes),
                fmt_bytes(d.used_bytes),
                if d.budget_bytes.is_none() { "unchecked" } else if d.fits { "ok" } else { "OVER BUDGET" }
            );
        }
        if let Some(r) = self.ram_reserve_bytes {
            let _ = writeln!(o, "  RAM kept free by auto-fit: {}", fmt_bytes(r));
        }
        let _ = writeln!(o, "modules:");
        for m in &self.modules {
            let _ = write!(
                o,
                "  {:<11} runtime {:<12} params {:<12} {:>11}  reserve {}",
                m.module.name(),
                m.runtime.join("&"),
                m.params.to_string(),
                fmt_bytes(m.param_bytes),
                fmt_bytes(m.compute_reserve_bytes)
            );
            if m.staging_bytes > 0 {
                let _ = write!(o, " + staging {}", fmt_bytes(m.staging_bytes));
            }
            let _ = writeln!(o);
            for (i, r) in m.split.iter().enumerate() {
                if let Some(share) = r.row_share {
                    let _ = writeln!(
                        o,
                        "      row split: {} computes {:.1}% of the output rows of every block matmul weight \
                         (attention q/k/v/out, feed-forward, linear proj_in/proj_out){}, {} planned",
                        r.device,
                        share * 100.0,
                        if i == 0 { " and holds every other tensor" } else { "" },
                        fmt_bytes(r.param_bytes)
                    );
                    continue;
                }
                let _ = write!(
                    o,
                    "      {} split: {} blocks {}..={} ({})",
                    match m.split_mode {
                        SplitKind::Row => "row",
                        _ => "layer",
                    },
                    r.device,
                    r.first_block,
                    r.last_block,
                    fmt_bytes(r.param_bytes)
                );
                if let Some(t) = r.predicted_s {
                    let _ = write!(o, "  ~{}", fmt_secs(t));
                }
                let _ = writeln!(o);
            }
            if let Some(by) = m.sized_by {
                let _ = write!(o, "      sized by {}, pipeline copies {}", by.name(), self.pipeline_copies);
                match &m.predicted {
                    Some(t) => {
                        let _ = writeln!(
                            o,
                            "; predicted per evaluation: {} in one pass (ranges in sequence), {} per micro-batch pipelined (slowest range; with --pipeline-copies > 1)",
                            fmt_secs(t.single_pass_s),
                            fmt_secs(t.pipelined_s)
                        );
                    }
                    None => {
                        let _ = writeln!(o, "; no predicted time (device speeds unknown)");
                    }
                }
            }
        }
        let _ = writeln!(
            o,
            "memory check: {} (estimate {}){}",
            match self.memory_check.verdict {
                Verdict::Ok => "ok",
                Verdict::Warn => "warn",
                Verdict::Refuse => "refuse",
                Verdict::Skipped => "skipped",
            },
            fmt_bytes(self.memory_check.estimate_bytes),
            if self.memory_check.message.is_empty() {
                String::new()
            } else {
                format!(": {}", self.memory_check.message)
            }
        );
        let _ = write!(o, "equivalent flags: --backend \"{}\"", self.backend);
        if !self.params_backend.is_empty() {
            let _ = write!(o, " --params-backend \"{}\"", self.params_backend);
        }
        if !self.split_mode.is_empty() {
            let _ = write!(o, " --split-mode \"{}\"", self.split_mode);
        }
        if self.split_by != SplitBy::Memory {
            let _ = write!(o, " --split-by {}", self.split_by.name());
        }
        if self.pipeline_copies != 1 {
            let _ = write!(o, " --pipeline-copies {}", self.pipeline_copies);
        }
        let _ = writeln!(o);
        if let Some(c) = &self.choice {
            let _ = writeln!(o, "{c}");
        }
        if !self.warnings.is_empty() {
            let _ = writeln!(o, "warnings:");
            for w in &self.warnings {
                let _ = writeln!(o, "  - {w}");
            }
        }
        o
    }
}
