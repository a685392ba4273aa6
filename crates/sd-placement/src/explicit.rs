//! Explicit placement: `--backend`, `--params-backend` and `--split-mode` resolved per module.
//!
//! A module without an assignment runs on the default device; params without an assignment
//! follow the runtime ("If --params-backend is not set, parameters use the same backend as their
//! module runtime backend"; with a layer split each block range's params stay on its own
//! device). A `&` list becomes a layer split, or a row split when `--split-mode` asks for it: in
//! the devices' split buffer type when every listed device has one within one backend registry,
//! else at graph level; where neither can run the module falls back (with a warning) to a layer
//! split, as stable-diffusion.cpp's `docs/backend.md` says. Every entry is resolved, even for modules the model
//! lacks, so a misspelt device is reported whatever the model.
//!
//! Beyond the reference: where no split buffer type is exported, a row split is a graph-level
//! one (`Layout::Rows`, each device's share of the rows by memory; the CPU only as the last
//! device); the CPU may take part in a layer split; a device
//! listed twice, or a layer split leaving a listed device without a block, is an error (the
//! reference drops such a device silently); `--split-by speed` sizes the ranges by device speed.

use crate::budget::Budget;
use crate::device::{default_device, resolve_device, Device, DeviceType};
use crate::error::{Flag, PlanError};
use crate::model::{ComponentSummary, Module};
use crate::placement::{Layout, Params, Placement, Range};
use crate::spec::{Assignment, Entry, ParamsValue, RuntimeValue, SplitBy, SplitMode};
use crate::split::{partition, partition_by_speed, speed_cap, weights};
use crate::units::fmt_bytes;

/// What a graph-level row split costs here, said once per plan that has one.
const ROW_SPLIT_NOTE: &str = "row split at graph level: each block matmul's rows are computed on every listed device \
and gathered on the main one; no device plugin here exports a split buffer type. Measured slower than a layer \
split of the same devices (SD 1.5 over two RPC servers: 1.15x the step time, `cargo xtask bench-placement \
--split`), since every product's input and output cross the devices: prefer a layer split where its ranges \
fit the devices";

/// A resolved `--backend` value.
enum Runtime {
    One(usize),
    Many(Vec<usize>, String),
}

/// Resolves one `--backend` entry of `module` (`None`: the default entry, never a list). A
/// device listed twice (after resolution, so `cpu&CPU` and a prefix of a listed name count) is
/// an error naming the module and the device.
fn resolve_runtime(devices: &[Device], module: Option<Module>, e: &Entry<RuntimeValue>) -> Result<Runtime, PlanError> {
    match &e.value {
        RuntimeValue::Device(t) => Ok(Runtime::One(resolve_device(devices, t, Flag::Backend, &e.entry)?)),
        RuntimeValue::List(ts) => {
            let mut idx: Vec<usize> = Vec::new();
            for t in ts {
                let i = resolve_device(devices, t, Flag::Backend, &e.entry)?;
                if idx.contains(&i) {
                    return Err(PlanError::DuplicateSplitDevice {
                        module: module.map_or_else(|| "the default".to_string(), |m| m.name().to_string()),
                        device: devices[i].name.trim().to_string(),
                        entry: e.entry.clone(),
                    });
                }
                idx.push(i);
            }
            Ok(if idx.len() == 1 { Runtime::One(idx[0]) } else { Runtime::Many(idx, e.entry.clone()) })
        }
    }
}

fn resolve_params(devices: &[Device], e: &Entry<ParamsValue>) -> Result<Params, PlanError> {
    match &e.value {
        ParamsValue::Disk => Ok(Params::Disk),
        ParamsValue::Device(t) => Ok(Params::Device(resolve_device(devices, t, Flag::ParamsBackend, &e.entry)?)),
    }
}

pub(crate) struct Explicit {
    pub placements: Vec<Placement>,
    /// How each layer-split module's ranges were sized (speed falls back to memory per module).
    pub sizing: Vec<(Module, SplitBy)>,
    /// The device computing the diffusion model (or the first module), for the memory check.
    pub main: usize,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn explicit(
    summaries: &[ComponentSummary],
    devices: &[Device],
    budgets: &[Budget],
    backend: &Assignment<RuntimeValue>,
    params: &Assignment<ParamsValue>,
    split: &Assignment<SplitMode>,
    sizing: &Sizing,
    warnings: &mut Vec<String>,
) -> Result<Explicit, PlanError> {
    // Validate every entry up front (the model may lack the module an entry names).
    let entries = backend.default.iter().map(|e| (None, e));
    for (m, e) in entries.chain(backend.modules.iter().map(|(m, e)| (Some(*m), e))) {
        resolve_runtime(devices, m, e)?;
    }
    for e in params.default.iter().chain(params.modules.values()) {
        resolve_params(devices, e)?;
    }
    let default = default_device(devices)
        .ok_or_else(|| PlanError::InvalidDevices { reason: "no GPU, integrated GPU or CPU device to run on".into() })?;

    let mut placements = Vec::new();
    let mut sized = Vec::new();
    for s in summaries {
        let module = s.module;
        let runtime = match backend.get(module) {
            Some(e) => resolve_runtime(devices, Some(module), e)?,
            None => Runtime::One(default),
        };
        let p = match params.get(module) {
            Some(e) => resolve_params(devices, e)?,
            None => Params::Follow,
        };
        let layout = match runtime {
            Runtime::One(d) => Layout::Single(d),
            Runtime::Many(list, entry) => {
                let mode = split.get(module).map_or(SplitMode::Layer, |e| e.value);
                let follow = matches!(p, Params::Follow);
                let (layout, by) = multi_device(s, devices, budgets, &list, &entry, mode, follow, sizing, warnings)?;
                sized.extend(by.map(|b| (module, b)));
                layout
            }
        };
        let p = match (&layout, p) {
            (Layout::Single(d), Params::Follow) => Params::Device(*d),
            (_, p) => p,
        };
        placements.push(Placement { module, layout, params: p });
    }
    let main = placements
        .iter()
        .find(|p| p.module == Module::Diffusion)
        .or(placements.first())
        .map_or(default, |p| p.layout.main());
    Ok(Explicit { placements, sizing: sized, main })
}

/// What sizes a layer split: the `--split-by` policy, each device's speed (by device index;
/// `None` = unknown) in bytes of block weights per second, and the pipeline copy count.
pub(crate) struct Sizing {
    pub by: SplitBy,
    pub speeds: Vec<Option<f64>>,
    /// The pipeline copy count (it multiplies the compute reserve a speed-sized range leaves).
    pub copies: u32,
}

/// The layout of a module listed on several devices, and how a layer split was sized.
#[allow(clippy::too_many_arguments)]
fn multi_device(
    s: &ComponentSummary,
    devices: &[Device],
    budgets: &[Budget],
    list: &[usize],
    entry: &str,
    mode: SplitMode,
    params_follow: bool,
    sizing: &Sizing,
    warnings: &mut Vec<String>,
) -> Result<(Layout, Option<SplitBy>), PlanError> {
    let module = s.module;
    let first = list[0];
    if s.blocks.is_empty() {
        warnings.push(format!(
            "{module} has no recognizable transformer blocks; '{entry}' falls back to its first device {}",
            devices[first].name
        ));
        return Ok((Layout::Single(first), None));
    }
    if mode == SplitMode::Row {
        let registry = devices[first].registry_name().to_lowercase();
        let has_cpu = list.iter().any(|&i| devices[i].kind == DeviceType::Cpu);
        let buffer_split = !has_cpu
            && list.iter().all(|&i| devices[i].row_split && devices[i].registry_name().to_lowercase() == registry);
        if buffer_split {
            return Ok((Layout::Row(list.to_vec()), None));
        }
        // No split buffer type over these devices (the CPU and RPC export none, nor do devices
        // of different registries): a graph-level row split, where it can run.
        let cpu_not_last = list[..list.len() - 1].iter().find(|&&i| devices[i].kind == DeviceType::Cpu);
        let why_not = if !params_follow {
            Some("a graph-level row split needs the parameters on their computing devices, and --params-backend gives them another home".to_string())
        } else if let Some(&c) = cpu_not_last {
            Some(format!(
                "ggml's scheduler runs the CPU last, so the CPU device {} may take part only as the last listed device",
                devices[c].name.trim()
            ))
        } else {
            None
        };
        match why_not {
            None => {
                let w = weights(devices, budgets, list);
                let total: f64 = w.iter().sum();
                let mut ppm: Vec<u32> = w.iter().map(|x| (x / total * 1e6).round() as u32).collect();
                let rest: u32 = ppm[1..].iter().sum();
                ppm[0] = 1_000_000u32.saturating_sub(rest);
                warnings.push(format!("{module}: {ROW_SPLIT_NOTE}"));
                return Ok((Layout::Rows(list.to_vec(), ppm), None));
            }
            Some(reason) => {
                warnings.push(format!("{module}: row split unavailable ({reason}); falling back to layer split"))
            }
        }
    }
    let block_bytes: Vec<u64> = s.blocks.iter().map(|b| b.bytes).collect();
    let name = |d: usize| devices[d].name.trim().to_string();
    if block_bytes.len() < list.len() {
        return Err(PlanError::EmptySplitRange {
            module: module.name().into(),
            device: name(list[block_bytes.len()]),
            entry: entry.into(),
            reason: format!("too few blocks: {module} has {} blocks for {} devices", block_bytes.len(), list.len()),
            hint: format!("list at most {} devices", block_bytes.len()),
        });
    }
    let by_speed = if sizing.by == SplitBy::Speed {
        let unknown: Vec<String> = list.iter().filter(|&&d| sizing.speeds[d].is_none()).map(|&d| name(d)).collect();
        if unknown.is_empty() {
            let speeds: Vec<f64> = list.iter().map(|&d| sizing.speeds[d].unwrap_or(1.0)).collect();
            let reserve = s.compute_reserve.saturating_mul(u64::from(sizing.copies.max(1)));
            let caps: Vec<Option<u64>> = list.iter().map(|&d| speed_cap(budgets, d, reserve)).collect();
            let ranges = partition_by_speed(&block_bytes, s.non_block_bytes, &speeds, &caps);
            if ranges.is_none() {
                warnings.push(format!(
                    "{module}: no speed-sized layer split of '{entry}' fits every device's budget less {} of compute reserve; sizing by memory instead",
                    fmt_bytes(reserve)
                ));
            }
            ranges
        } else {
            warnings.push(format!(
                "{module}: --split-by speed: no speed known for {}; sizing the layer split '{entry}' by memory",
                unknown.join(", ")
            ));
            None
        }
    } else {
        None
    };
    if let Some(ranges) = by_speed {
        let out = list.iter().zip(ranges).map(|(&device, (start, end))| Range { device, start, end }).collect();
        return Ok((Layout::Layer(out), Some(SplitBy::Speed)));
    }
    let w = weights(devices, budgets, list);
    let mut ranges = partition(&block_bytes, &w);
    // The main device runs the graph's inputs and outputs: it keeps at least the first block.
    if let Some(first) = ranges.first_mut() {
        if first.1 == 0 {
            first.1 = 1;
        }
    }
    for k in 1..ranges.len() {
        let prev_end = ranges[k - 1].1;
        ranges[k].0 = ranges[k].0.max(prev_end);
        ranges[k].1 = ranges[k].1.max(ranges[k].0);
    }
    let mut out = Vec::new();
    for (k, (&d, (start, end))) in list.iter().zip(ranges).enumerate() {
        if k > 0 && start == end {
            let total_bytes: u64 = block_bytes.iter().sum();
            let share = total_bytes as f64 * w[k] / w.iter().sum::<f64>();
            return Err(PlanError::EmptySplitRange {
                module: module.name().into(),
                device: name(d),
                entry: entry.into(),
                reason: format!(
                    "too little memory: its share by memory is {} of {}'s {} of block weights, too small for one block (the smallest is {})",
                    fmt_bytes(share as u64),
                    module,
                    fmt_bytes(total_bytes),
                    fmt_bytes(block_bytes.iter().copied().min().unwrap_or(0))
                ),
                hint: format!("list fewer devices, or give {} a larger --max-vram", name(d)),
            });
        }
        out.push(Range { device: d, start, end });
    }
    Ok((Layout::Layer(out), Some(SplitBy::Memory)))
}
