//! Weights residency and graph execution for model runners.
//!
//! What it is for: a model module (text encoder, UNet, VAE) declares its
//! parameters as [`TensorSpec`]s, gets a [`Weights`] set whose tensors it uses
//! as graph operands, and runs graphs through a [`Runner`] bound to one device.
//! Where parameters live and how they reach the computing device is decided
//! here, not in model code.
//!
//! What it refuses to do: it knows no model architecture and reads no file;
//! tensor bytes come from a [`TensorSource`] the caller provides.
//!
//! The planning half (segment lists, merging, eviction order) is pure logic and
//! uses no ggml type: it lives in `sd_placement::segments`, re-exported here as [`plan`];
//! the execution half uses `sd-backends`.

pub mod adapter;
pub mod error;
pub mod ledger;
/// The segment planner (pure logic, in sd-placement so that its cost model replays the same
/// schedules): [`sd_placement::segments`].
pub use sd_placement::segments as plan;
pub mod profile;
pub mod report;
pub mod rowsplit;
pub mod runner;
mod split;
pub use split::BatchJob;
pub mod weights;

/// The CPU backend of the plugins this build compiled, one per test process (unit tests).
#[cfg(test)]
pub(crate) fn test_cpu() -> std::sync::Arc<sd_backends::Backend> {
    use sd_backends::{Backend, PluginRegistry, PluginSearch};
    static CPU: std::sync::OnceLock<std::sync::Arc<Backend>> = std::sync::OnceLock::new();
    CPU.get_or_init(|| {
        let search = PluginSearch::only(vec![std::path::PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)]);
        let reg: &'static PluginRegistry = Box::leak(Box::new(PluginRegistry::discover(&search)));
        std::sync::Arc::new(Backend::new(reg.device("cpu").unwrap()).unwrap())
    })
    .clone()
}

pub use adapter::{add_linear_adapters, Adapter, AdapterTerm};
pub use error::{NoRoom, Result, SchedError};
pub use ledger::{Ledger, Ledgers};
pub use report::{DeviceReport, HomeReport, ModuleReport, Residency, RunnerReport, StageReport};
pub use rowsplit::{mul_mat_parts, RowSplitReport};
pub use runner::{RunStats, Runner};
pub use weights::{
    short_name, weight_buffer_type, MappedBytes, ParamHome, ResidencyStats, SourceError, TensorSource, TensorSpec,
    Weights,
};
