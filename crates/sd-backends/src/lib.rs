//! ggml devices for the rest of the workspace: plugins, devices, backends and safe wrappers.
//!
//! What it is for: finding and loading vendor backends (ggml's dynamic backend
//! modules) at run time with our own registry ([`PluginRegistry`]), describing
//! their devices ([`Device`], [`DeviceInfo`]), sharing one backend instance per
//! device ([`BackendManager`]), adding remote devices over ggml's RPC protocol
//! ([`rpc`]), routing ggml's logs into `tracing` ([`install_log_bridge`]), and
//! safe wrappers over the ggml objects model code needs: [`Context`],
//! [`Tensor`], [`Graph`], [`Buffer`], [`BufferType`], [`Backend`],
//! [`GraphAllocator`], [`Scheduler`]. Each wrapper's module states its
//! ownership rule.
//!
//! What it refuses to do: it never calls upstream's loader (`ggml_backend_load*`),
//! never searches the working directory, never unloads a plugin, and never
//! hands an RPC endpoint to ggml before probing it, and never lets a lost RPC
//! server abort or block the process (the RPC plugin is patched for that; a loss
//! is [`BackendError::RpcLost`] at the next operation).
//! It knows nothing about models or placement policy.

pub mod alloc;
pub mod backend;
pub mod buffer;
pub mod context;
pub mod convert;
pub mod device;
pub mod error;
pub mod graph;
mod log;
pub mod ops;
pub mod registry;
pub mod rpc;
pub mod rpc_front;
pub mod rpc_guard;
pub mod rpc_wire;
pub mod sched;
pub mod threads;

pub use alloc::GraphAllocator;
pub use backend::{usable_threads, Backend, BackendManager};
pub use buffer::{Buffer, BufferType, BufferUsage};
pub use context::{row_size, type_name, Context, GgmlType, Tensor};
pub use device::{Device, DeviceCaps, DeviceInfo, DeviceKind};
pub use error::{BackendError, Result};
pub use graph::{Graph, GraphView};
pub use log::install_log_bridge;
pub use ops::ScaleMode;
pub use registry::{LoadedPlugin, PluginRegistry, PluginSearch, SkipReason, SkippedPlugin};
pub use sched::Scheduler;

/// The ggml version this build uses and where its source came from.
pub fn ggml_version() -> (&'static str, &'static str) {
    (ggml_sys::GGML_VERSION, ggml_sys::GGML_SOURCE_PACKAGE)
}

impl PluginRegistry {
    /// A [`DeviceInfo`] for every device, with the plugin it came from.
    pub fn device_infos(&self) -> Vec<DeviceInfo> {
        self.devices()
            .into_iter()
            .map(|d| {
                let (free, total) = d.memory();
                let plugin = self.plugin_of(&d);
                DeviceInfo {
                    name: d.name(),
                    description: d.description(),
                    kind: d.kind(),
                    memory_free: free,
                    memory_total: total,
                    plugin: plugin
                        .map(|p| match &p.endpoint {
                            Some(e) => format!("{} ({e})", p.path.display()),
                            None => p.path.display().to_string(),
                        })
                        .unwrap_or_default(),
                    registry: plugin.map(|p| p.name.clone()).unwrap_or_default(),
                    caps: d.caps(),
                }
            })
            .collect()
    }
}
