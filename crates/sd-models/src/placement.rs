//! A placement plan made real: the backend each module computes on and the home of its parameters.
//!
//! [`sd_placement::plan`] decides where each module runs and where its parameters live, by
//! device name, without touching a device. [`RuntimePlacement::from_plan`] turns that plan into
//! what [`crate::pipeline::Pipeline`] loads with: one shared backend per computing device
//! ([`ModuleDevices`]), one [`ParamHome`] per module ([`ModuleHomes`]) and the device ledgers
//! carrying the plan's managed budgets ([`Placement`]).
//!
//! A module with a layer split ([`SplitKind::Layer`]) gets a [`LayerSplit`]: every listed
//! device's backend and the block range the plan gave it; the pipeline places each block's
//! parameters on its range's device and runs the module with a runner over all of them
//! (`sd_sched`'s split execution). A graph-level row split (the plan's row split with a share
//! per device, [`SplitRange::row_share`](sd_placement::SplitRange)) is a [`LayerSplit`] with
//! [`LayerSplit::rows`] set: the module's layer matmul weights are cut by output rows across the
//! devices (`sd_sched`'s `rowsplit`). What the runtime cannot do yet is said once here, as a
//! warning, and never silently dropped: a split-buffer row split runs on its main device.

use std::sync::Arc;

use sd_backends::{Backend, BackendError, BackendManager, DeviceKind, PluginRegistry};
use sd_placement::{Module, ModulePlan, ParamsHome, Plan, SplitKind};
use sd_sched::ParamHome;

use crate::pipeline::{ModuleDevices, ModuleHomes, Placement};

/// A device of the plan that the registry cannot give.
#[derive(Debug, thiserror::Error)]
#[error("placing the {module}")]
pub struct PlacementError {
    /// The module being placed.
    pub module: &'static str,
    /// The registry's or backend's error.
    #[source]
    pub source: BackendError,
}

/// A module's layer split: its devices (main first) and the blocks each one runs.
#[derive(Clone, Debug)]
pub struct LayerSplit {
    /// The computing devices, main first.
    pub devices: Vec<Arc<Backend>>,
    /// Each device's blocks, first and last (inclusive), in the plan's block numbering
    /// ([`crate::files::TensorIndex::block_of`]); empty for a row split.
    pub ranges: Vec<(u32, u32)>,
    /// A graph-level row split instead of a layer split: each device's share of the rows.
    pub rows: Option<Vec<f64>>,
    /// The host CPU backend ggml's scheduler ends with (a row split whose last device is not
    /// the CPU).
    pub host: Option<Arc<Backend>>,
}

impl LayerSplit {
    /// The index of the device that runs block `block`; non-block tensors (`None`) and
    /// blocks outside every range run on the main device.
    pub fn device_of_block(&self, block: Option<u32>) -> usize {
        block.and_then(|b| self.ranges.iter().position(|&(first, last)| first <= b && b <= last)).unwrap_or(0)
    }

    /// The device names joined as `--backend` lists them.
    fn describe(&self) -> String {
        self.devices.iter().map(|b| b.device().name()).collect::<Vec<_>>().join("&")
    }
}

/// The run-time side of a [`Plan`]: computing backends and parameter homes per module.
#[derive(Clone, Debug)]
pub struct RuntimePlacement {
    /// Where each module computes.
    pub devices: ModuleDevices,
    /// Where each module's parameters live, the ledgers and the segmented-execution options.
    pub placement: Placement,
}

impl RuntimePlacement {
    /// Opens the backends `plan` names (through `manager`, one per device) and gives each
    /// module its parameter home; `sched` are the segmented-execution options. Managed budgets
    /// are the plan's (a positive `--max-vram`, or the startup snapshot a negative one gives; 0
    /// sets none: live free memory is the limit).
    pub fn from_plan(
        plan: &Plan,
        registry: &PluginRegistry,
        manager: &BackendManager,
        sched: sd_sched::plan::Options,
    ) -> Result<Self, PlacementError> {
        let wiring = Wiring { plan, registry, manager };
        let devices = ModuleDevices {
            te: wiring.backend(Module::Te)?,
            diffusion: wiring.backend(Module::Diffusion)?,
            vae: wiring.backend(Module::Vae)?,
            te_split: wiring.split(Module::Te)?,
            diffusion_split: wiring.split(Module::Diffusion)?,
            controlnet: wiring.backend(Module::ControlNet)?,
        };
        let homes = ModuleHomes {
            te: wiring.home(Module::Te, &devices.te)?,
            diffusion: wiring.home(Module::Diffusion, &devices.diffusion)?,
            vae: wiring.home(Module::Vae, &devices.vae)?,
            controlnet: wiring.home(Module::ControlNet, &devices.controlnet)?,
        };
        let placement = Placement {
            homes,
            ledgers: sd_sched::Ledgers::with_budgets(plan.runtime_budgets().into_iter().collect()),
            sched,
            pipeline_copies: plan.pipeline_copies as usize,
            profile: false,
            no_mmap: false,
        };
        Ok(Self { devices, placement })
    }
}

struct Wiring<'a> {
    plan: &'a Plan,
    registry: &'a PluginRegistry,
    manager: &'a BackendManager,
}

impl Wiring<'_> {
    fn module_plan(&self, module: Module) -> Option<&ModulePlan> {
        self.plan.modules.iter().find(|m| m.module == module)
    }

    fn backend_named(&self, module: Module, name: &str) -> Result<Arc<Backend>, PlacementError> {
        let err = |source| PlacementError { module: module.name(), source };
        self.manager.get(self.registry.device(name).map_err(err)?).map_err(err)
    }

    /// The module's main runtime device (the plan's main device for a module it does not list).
    fn backend(&self, module: Module) -> Result<Arc<Backend>, PlacementError> {
        let m = self.module_plan(module);
        let name = m.and_then(|m| m.runtime.first()).cloned().unwrap_or_else(|| self.plan.main_device.clone());
        if m.is_some_and(|m| {
            m.runtime.len() > 1 && m.split_mode == SplitKind::Row && m.split.iter().any(|r| r.row_share.is_none())
        }) {
            tracing::warn!(
                "{}: row split needs a device plugin that exports a split buffer type; running on {name}",
                module.name()
            );
        }
        self.backend_named(module, &name)
    }

    /// The module's layer split, when the plan gives it one over two or more devices.
    fn split(&self, module: Module) -> Result<Option<LayerSplit>, PlacementError> {
        let Some(m) = self.module_plan(module) else { return Ok(None) };
        if m.split_mode == SplitKind::Row && m.split.len() >= 2 && m.split.iter().all(|r| r.row_share.is_some()) {
            return self.row_split(module, m).map(Some);
        }
        if m.split_mode != SplitKind::Layer || m.split.len() < 2 {
            return Ok(None);
        }
        let mut devices = Vec::with_capacity(m.split.len());
        let mut ranges = Vec::with_capacity(m.split.len());
        for r in &m.split {
            devices.push(self.backend_named(module, &r.device)?);
            ranges.push((r.first_block, r.last_block));
        }
        let split = LayerSplit { devices, ranges, rows: None, host: None };
        tracing::info!(
            "{}: layer split over {} (blocks {})",
            module.name(),
            split.describe(),
            split.ranges.iter().map(|(a, b)| format!("{a}-{b}")).collect::<Vec<_>>().join(", ")
        );
        Ok(Some(split))
    }

    /// The module's graph-level row split: its devices, their shares, and the host backend.
    fn row_split(&self, module: Module, m: &ModulePlan) -> Result<LayerSplit, PlacementError> {
        let err = |source| PlacementError { module: module.name(), source };
        let mut devices = Vec::with_capacity(m.split.len());
        for r in &m.split {
            devices.push(self.backend_named(module, &r.device)?);
        }
        let host = match devices.last().map(|b| b.device().kind()) {
            Some(DeviceKind::Cpu) => None,
            _ => {
                let cpu =
                    self.registry.devices().into_iter().find(|d| d.kind() == DeviceKind::Cpu).ok_or_else(|| {
                        err(BackendError::PluginMissing("CPU".into(), "a row split needs a host CPU backend".into()))
                    })?;
                Some(self.manager.get(cpu).map_err(err)?)
            }
        };
        let shares: Vec<f64> = m.split.iter().map(|r| r.row_share.unwrap_or(0.0)).collect();
        let split = LayerSplit { devices, ranges: Vec::new(), rows: Some(shares), host };
        tracing::info!(
            "{}: row split over {} (row shares {})",
            module.name(),
            split.describe(),
            split.rows.iter().flatten().map(|s| format!("{:.1}%", s * 100.0)).collect::<Vec<_>>().join(", ")
        );
        Ok(split)
    }

    /// Where the module's parameters live, as the plan says.
    fn home(&self, module: Module, compute: &Arc<Backend>) -> Result<ParamHome, PlacementError> {
        let Some(m) = self.module_plan(module) else { return Ok(ParamHome::Compute) };
        let runtime = compute.device().name();
        let home = match &m.params {
            ParamsHome::Device(d) if d.is_empty() || *d == runtime => ParamHome::Compute,
            ParamsHome::Disk => ParamHome::Disk,
            // Each range's parameters on its own device (a layer split), or on the main one.
            ParamsHome::Split(_) => ParamHome::Compute,
            ParamsHome::Device(d) => {
                let dev = self.registry.device(d).map_err(|source| PlacementError { module: module.name(), source })?;
                if dev.kind() == DeviceKind::Cpu {
                    ParamHome::Host
                } else {
                    ParamHome::Device(self.backend_named(module, d)?)
                }
            }
        };
        if m.split.len() >= 2 && matches!(m.params, ParamsHome::Split(_)) {
            // The split's own line named its devices; `runtime` is only its main device.
            tracing::info!(
                "{}: split over {}, each device holding its part's params ({})",
                module.name(),
                m.runtime.join("&"),
                sd_placement::fmt_bytes(m.param_bytes)
            );
        } else {
            tracing::info!(
                "{}: runs on {runtime}, params {} ({})",
                module.name(),
                home.describe(),
                sd_placement::fmt_bytes(m.param_bytes)
            );
        }
        Ok(home)
    }
}
