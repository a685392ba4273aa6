//! Explicit placement: `--backend`, `--params-backend` and `--split-mode` resolved per module.
//!
//! A module without an assignment runs on the default device; params without an assignment
//! follow the runtime ("If --params-backend is not set, parameters use the same backend as their
//! module runtime backend"; with a layer split each block range's params stay on its own
//! device). A `&` list becomes a layer split, or a row split when `--split-mode` asks for it and
//! every listed device can split rows within one backend registry; otherwise the module falls
//! back (with a warning) as stable-diffusion.cpp's `docs/backend.md` says. Every entry is resolved, even for modules the model
//! lacks, so a misspelt device is reported whatever the model.

use crate::budget::Budget;
use crate::device::{default_device, resolve_device, Device, DeviceType};
use crate::error::{Flag, PlanError};
use crate::model::{ComponentSummary, Module};
use crate::placement::{Layout, Params, Placement, Range};
use crate::spec::{Assignment, Entry, ParamsValue, RuntimeValue, SplitMode};
use crate::split::{partition, weights};

/// A resolved `--backend` value.
enum Runtime {
    One(usize),
    Many(Vec<usize>, String),
}

fn resolve_runtime(
    devices: &[Device],
    e: &Entry<RuntimeValue>,
    warnings: &mut Vec<String>,
) -> Result<Runtime, PlanError> {
    match &e.value {
        RuntimeValue::Device(t) => Ok(Runtime::One(resolve_device(devices, t, Flag::Backend, &e.entry)?)),
        RuntimeValue::List(ts) => {
            let mut idx: Vec<usize> = Vec::new();
            for t in ts {
                let i = resolve_device(devices, t, Flag::Backend, &e.entry)?;
                if idx.contains(&i) {
                    warnings.push(format!("--backend '{}' lists {} twice; using it once", e.entry, devices[i].name));
                } else {
                    idx.push(i);
                }
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
    warnings: &mut Vec<String>,
) -> Result<Explicit, PlanError> {
    // Validate every entry up front (the model may lack the module an entry names).
    let mut scratch = Vec::new();
    for e in backend.default.iter().chain(backend.modules.values()) {
        resolve_runtime(devices, e, &mut scratch)?;
    }
    for e in params.default.iter().chain(params.modules.values()) {
        resolve_params(devices, e)?;
    }
    let default = default_device(devices)
        .ok_or_else(|| PlanError::InvalidDevices { reason: "no GPU, integrated GPU or CPU device to run on".into() })?;

    let mut placements = Vec::new();
    for s in summaries {
        let module = s.module;
        let runtime = match backend.get(module) {
            Some(e) => resolve_runtime(devices, e, warnings)?,
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
                multi_device(s, devices, budgets, &list, &entry, mode, warnings)
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
    Ok(Explicit { placements, main })
}

fn multi_device(
    s: &ComponentSummary,
    devices: &[Device],
    budgets: &[Budget],
    list: &[usize],
    entry: &str,
    mode: SplitMode,
    warnings: &mut Vec<String>,
) -> Layout {
    let module = s.module;
    let first = list[0];
    if s.blocks.is_empty() {
        warnings.push(format!(
            "{module} has no recognizable transformer blocks; '{entry}' falls back to its first device {}",
            devices[first].name
        ));
        return Layout::Single(first);
    }
    if let Some(&c) = list.iter().find(|&&i| devices[i].kind == DeviceType::Cpu) {
        warnings.push(format!(
            "{module}: a split across the CPU device {} is not supported; using {} (use --params-backend {module}=cpu to keep weights in RAM)",
            devices[c].name, devices[first].name
        ));
        return Layout::Single(first);
    }
    if mode == SplitMode::Row {
        let registry = devices[first].registry_name().to_lowercase();
        if let Some(&i) = list.iter().find(|&&i| !devices[i].row_split) {
            warnings.push(format!(
                "{module}: row split unavailable ({} cannot split rows); falling back to layer split",
                devices[i].name
            ));
        } else if let Some(&i) = list.iter().find(|&&i| devices[i].registry_name().to_lowercase() != registry) {
            warnings.push(format!(
                "{module}: row split unavailable (devices belong to different backend registries: {} is {}, {} is {}); falling back to layer split",
                devices[first].name,
                devices[first].registry_name(),
                devices[i].name,
                devices[i].registry_name()
            ));
        } else {
            return Layout::Row(list.to_vec());
        }
    }
    let w = weights(devices, budgets, list);
    let block_bytes: Vec<u64> = s.blocks.iter().map(|b| b.bytes).collect();
    let mut ranges = partition(&block_bytes, &w);
    // The main device runs the graph's inputs and outputs: it keeps at least the first block.
    if let Some(first) = ranges.first_mut() {
        if first.1 == 0 && !block_bytes.is_empty() {
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
            warnings.push(format!(
                "{module}: {} receives no block in the layer split '{entry}' (too little memory or too few blocks)",
                devices[d].name
            ));
            continue;
        }
        out.push(Range { device: d, start, end });
    }
    Layout::Layer(out)
}
