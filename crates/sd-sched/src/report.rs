//! The scheduler's part of a run report: what a module's weights, a runner and a device's ledger did, as plain data.
//!
//! Nothing here keeps counts of its own: each report is read from where the figures already
//! live ([`RunStats`] of a [`Runner`], the [`Ledger`] of a device, the residency of a placed
//! [`Weights`] set). The types serialise with serde; byte counts are in bytes, times in
//! seconds. `sd-models` gathers them into its run report.

use serde::{Deserialize, Serialize};

use crate::ledger::{Ledger, Ledgers};
use crate::runner::{RunStats, Runner};
use crate::weights::Weights;

/// Where a module's parameters live between uses (`--params-backend`), as a report names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HomeReport {
    /// On the computing device, loaded once and pinned.
    Compute,
    /// On another device, `device`, copied to the computing device as needed.
    Device {
        /// The device holding the home copy.
        device: String,
    },
    /// In CPU RAM, copied to the computing device as needed.
    Host,
    /// Read again from the model file each time they are needed.
    Disk,
}

/// How a module's weights reached the computing device during the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Pinned on the computing device for the whole run (params home is the computing device).
    Resident,
    /// Staged whole from their home before the module ran (no run was segmented).
    Staged,
    /// At least one run executed in segments, staging, evicting and prefetching groups.
    Segmented,
}

/// One module (text encoder, UNet, VAE) as it ran.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleReport {
    /// The module's name as the pipeline calls it (`te`, `unet`, `vae`, ...).
    pub module: String,
    /// The devices it computed on (one today; a split module lists each).
    pub devices: Vec<String>,
    /// Where its parameters live.
    pub params: HomeReport,
    /// How its weights reached the computing device.
    pub residency: Residency,
    /// Bytes of its parameters on the computing device (aligned per staging group).
    pub param_bytes: u64,
    /// Staging groups (one per block or layer).
    pub groups: usize,
    /// The weights a graph-level row split cut by output rows (declared names, in declaration
    /// order); empty without a row split.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_split_weights: Vec<String>,
}

/// One runner's work, summed over its graph runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunnerReport {
    /// The runner's name (`te`, `unet`, `vae`).
    pub name: String,
    /// The device it computed on.
    pub device: String,
    /// What it ran and moved ([`RunStats`]'s fields, at this level of the JSON).
    #[serde(flatten)]
    pub stats: RunStats,
    /// Bytes of its weights copied to the computing device (every upload: the initial load
    /// of pinned weights, staging, prefetches).
    pub uploaded_bytes: u64,
    /// Time spent on those copies, summed over threads.
    pub upload_seconds: f64,
    /// A layer-split module's stages in its last run, in execution order (empty without a
    /// split).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageReport>,
    /// Where its compute time went, by op and by block, when it was profiled (`--profile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<crate::profile::Profile>,
}

/// One stage of a layer-split run: the device and the graph segments (block cuts) it ran.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReport {
    /// The device.
    pub device: String,
    /// The segments, by cut name (`input_blocks.4`, `clip_text.layers.7`, `output` for the
    /// part after the last cut).
    pub segments: Vec<String>,
}

/// One device's managed memory (`--max-vram`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceReport {
    /// The device name.
    pub device: String,
    /// The managed budget in bytes; `None` when none is set (live free memory is the limit).
    pub budget_bytes: Option<u64>,
    /// The most managed bytes at any moment of the run.
    pub high_water_bytes: u64,
    /// Managed bytes when the report was taken.
    pub managed_bytes: u64,
    /// Weight replicas the device's ledger evicted because an allocation needed the room
    /// (unpinned and not in use, least recently used first: `ledger.rs`).
    #[serde(default)]
    pub pressure_evictions: usize,
    /// Bytes of those replicas.
    #[serde(default)]
    pub pressure_evicted_bytes: u64,
}

impl ModuleReport {
    /// The report of `module`, whose weights `w` ran through `runner`.
    pub fn of(module: &str, w: &Weights, runner: &Runner) -> Self {
        let residency = if w.is_pinned() {
            Residency::Resident
        } else if runner.stats().segmented_runs > 0 {
            Residency::Segmented
        } else {
            Residency::Staged
        };
        let (param_bytes, groups) = w.group_totals();
        Self {
            module: module.to_string(),
            devices: runner.backends().iter().map(|b| b.device().name()).collect(),
            params: w.home_report(),
            residency,
            param_bytes,
            groups,
            row_split_weights: w.row_split_names(),
        }
    }
}

impl RunnerReport {
    /// The report of `runner`, which ran the weights `w`.
    pub fn of(runner: &Runner, w: &Weights) -> Self {
        Self {
            name: runner.name().to_string(),
            device: runner.backend().device().name(),
            stats: runner.stats().clone(),
            uploaded_bytes: w.stats().copied_bytes,
            upload_seconds: w.stats().copy_nanos as f64 * 1e-9,
            stages: runner.last_stages().to_vec(),
            profile: runner.profile().cloned(),
        }
    }
}

impl DeviceReport {
    /// The report of one device's ledger.
    pub fn of(l: &Ledger) -> Self {
        Self {
            device: l.device().to_string(),
            budget_bytes: l.budget(),
            high_water_bytes: l.high_water(),
            managed_bytes: l.managed(),
            pressure_evictions: l.evictions(),
            pressure_evicted_bytes: l.evicted_bytes(),
        }
    }

    /// Every device that had a ledger, by name.
    pub fn all(ledgers: &Ledgers) -> Vec<Self> {
        ledgers.all().iter().map(Self::of).collect()
    }
}
