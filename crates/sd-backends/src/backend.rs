//! Backend instances (execution streams on a device) and the manager that shares them.
//!
//! Ownership: a [`Backend`] owns its `ggml_backend_t` and frees it on drop.
//! The [`BackendManager`] keeps one instance per resolved device name and hands
//! out `Arc<Backend>`: modules that ask for the same device share one instance
//! (stable-diffusion.cpp's `docs/backend.md`, "Backend sharing and lifetime"); runtime and parameter
//! assignments share the same cache; the last `Arc` frees the instance.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ggml_sys as sys;

use crate::buffer::BufferType;
use crate::device::{Device, DeviceKind};
use crate::error::{BackendError, Result};
use crate::graph::Graph;

/// An execution stream on one device.
pub struct Backend {
    raw: sys::ggml_backend_t,
    device: Device,
    /// Extra buffer types weights computed here may be stored in (none unless asked for).
    weight_bufts: Vec<BufferType>,
    /// ggml backends are not re-entrant: one graph at a time.
    pub(crate) lock: Mutex<()>,
}

// SAFETY: the backend handle may move between threads; concurrent use is
// serialised by `lock` for compute and by ggml for tensor copies.
unsafe impl Send for Backend {}
// SAFETY: as above.
unsafe impl Sync for Backend {}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({})", self.device.name())
    }
}

impl Backend {
    /// Creates a new instance on `device` (prefer [`BackendManager::get`]).
    pub fn new(device: Device) -> Result<Self> {
        // SAFETY: a live device; null params means defaults.
        let raw = unsafe { sys::ggml_backend_dev_init(device.as_raw(), std::ptr::null()) };
        if raw.is_null() {
            return Err(BackendError::BackendInit(device.name()));
        }
        Ok(Self { raw, device, weight_bufts: Vec::new(), lock: Mutex::new(()) })
    }

    /// With `on`, weights computed on this backend may be stored in the device's extra buffer
    /// types ([`Device::extra_buffer_types`]) where one takes them; only CPU devices are
    /// asked (a GPU plugin's extra types, such as CUDA's split buffer, are not weight homes
    /// of this kind). Without it (and by default) every weight is in the device's buffer type.
    pub fn with_extra_buffer_types(mut self, on: bool) -> Self {
        self.weight_bufts =
            if on && self.device.kind() == DeviceKind::Cpu { self.device.extra_buffer_types() } else { Vec::new() };
        self
    }

    /// The extra buffer types weights computed here may be stored in, in order of preference
    /// (empty: the device's own buffer type only).
    pub fn weight_buffer_types(&self) -> &[BufferType] {
        &self.weight_bufts
    }

    /// The raw handle.
    pub fn as_raw(&self) -> sys::ggml_backend_t {
        self.raw
    }

    /// The device this backend runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Sets the thread count, where the backend supports it (CPU).
    pub fn set_threads(&self, n: usize) {
        // SAFETY: a live device's registration.
        let reg = unsafe { sys::ggml_backend_dev_backend_reg(self.device.as_raw()) };
        // SAFETY: live registration, NUL-terminated name.
        let p = unsafe { sys::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_set_n_threads".as_ptr()) };
        if !p.is_null() {
            // SAFETY: the symbol has ggml's `ggml_backend_set_n_threads_t` signature.
            let f: sys::SetNThreadsFn = unsafe { std::mem::transmute(p) };
            // SAFETY: a live backend of that registration.
            unsafe { f(self.raw, n.max(1) as i32) };
        }
    }

    /// Runs a graph whose tensors are all allocated, and waits for it.
    pub fn compute(&self, graph: &Graph<'_>) -> Result<()> {
        crate::buffer::check_extra_uses(self.device, graph)?;
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: live backend and graph; the graph's tensors are allocated (caller contract
        // of every allocator in this crate).
        let status = unsafe { sys::ggml_backend_graph_compute(self.raw, graph.as_raw()) };
        if status != sys::ggml_status::GGML_STATUS_SUCCESS {
            crate::rpc::check_lost()?;
            return Err(BackendError::Compute { device: self.device.name(), status: status.0 });
        }
        // Some backends (RPC) return once the work is queued, even from this synchronous
        // call: reading a few bytes of the last node waits until the graph has really run,
        // so "computed" means computed for every caller (and compute times are honest).
        if let Some(last) = graph.n_nodes().checked_sub(1) {
            graph.node(last).read_range(0, 4)?;
        }
        crate::rpc::check_lost()
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: we own the backend; no graph runs (we have &mut self).
        unsafe { sys::ggml_backend_free(self.raw) }
    }
}

/// The thread count a CPU backend gets for a request of `requested`: at most the machine's
/// hardware threads (ggml's workers synchronise at every node, so each thread beyond a core
/// only slows the graph down, 30x at 4096 threads on 2 cores) and never above ggml's
/// `GGML_MAX_N_THREADS`; at least 1. A warning says when the request is lowered.
pub fn usable_threads(requested: usize) -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let cap = cores.min(sys::GGML_MAX_N_THREADS as usize).max(1);
    if requested > cap {
        tracing::warn!(
            "{requested} threads requested but this machine has {cores} hardware threads; using {cap} \
             (more threads than cores only slow ggml down)"
        );
    }
    requested.clamp(1, cap)
}

/// The environment variable that switches the CPU's extra weight buffer types
/// (`on`/`off`, `1`/`0`; unset: on) for managers that are not told otherwise.
pub const CPU_EXTRA_BUFTS_ENV: &str = "SD_CPU_EXTRA_BUFTS";

/// Whether [`CPU_EXTRA_BUFTS_ENV`] leaves the CPU's extra buffer types on (the default), or
/// the value it holds when it is not one of the accepted words.
pub fn cpu_extra_bufts_from_env() -> std::result::Result<bool, String> {
    match std::env::var(CPU_EXTRA_BUFTS_ENV) {
        Err(_) => Ok(true),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" | "on" | "1" | "true" => Ok(true),
            "off" | "0" | "false" => Ok(false),
            _ => Err(v),
        },
    }
}

/// The environment switches of the CPU's kernels (read by the C++ of
/// `crates/ggml-sys/patches/cpu-speed/`, which treats exactly `off` and `0` as off and any
/// other value as on) and of [`CPU_EXTRA_BUFTS_ENV`], each with the values it takes.
const CPU_ENV: [(&str, &str); 3] = [
    ("SD_CPU_AMX_F16", "on, off, 1, 0"),
    ("SD_CPU_F16_GEMM", "on, off, 1, 0"),
    (CPU_EXTRA_BUFTS_ENV, "on, off, 1, 0, true, false"),
];

/// Checks every CPU environment switch ([`CPU_ENV`]) before any work: a value the kernels
/// would silently take for "on" (`OFF`, `no`, `disabled`) is an error naming the variable
/// and the values it takes. Unset or empty is the default (on).
pub fn check_cpu_env() -> Result<()> {
    for (variable, accepted) in CPU_ENV {
        let Some(raw) = std::env::var_os(variable) else { continue };
        let value = raw.to_string_lossy().into_owned();
        let ok = raw.to_str().is_some()
            && if variable == CPU_EXTRA_BUFTS_ENV {
                cpu_extra_bufts_from_env().is_ok()
            } else {
                // Exactly as the C++ compares: `OFF` would be on there.
                ["", "on", "off", "1", "0"].contains(&value.as_str())
            };
        if !ok {
            return Err(BackendError::BadEnv { variable, value, accepted });
        }
    }
    Ok(())
}

/// One shared backend instance per device name.
#[derive(Debug, Default)]
pub struct BackendManager {
    cache: Mutex<HashMap<String, Arc<Backend>>>,
    threads: Option<usize>,
    cpu_extra_bufts: bool,
}

impl BackendManager {
    /// A manager that sets `threads` on every CPU-like backend it creates (through
    /// [`usable_threads`]: at most the machine's hardware threads), with the CPU's extra
    /// weight buffer types as [`CPU_EXTRA_BUFTS_ENV`] says (on when it is unset or unreadable).
    pub fn new(threads: Option<usize>) -> Self {
        Self {
            cache: Mutex::new(HashMap::new()),
            threads: threads.map(usable_threads),
            cpu_extra_bufts: cpu_extra_bufts_from_env().unwrap_or(true),
        }
    }

    /// Whether the CPU backends this manager creates store weights in the CPU's extra buffer
    /// types ([`Backend::with_extra_buffer_types`]).
    pub fn with_cpu_extra_bufts(mut self, on: bool) -> Self {
        self.cpu_extra_bufts = on;
        self
    }

    /// The shared backend of `device`, created on first use.
    pub fn get(&self, device: Device) -> Result<Arc<Backend>> {
        let name = device.name();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = cache.get(&name) {
            return Ok(b.clone());
        }
        let b = Arc::new(Backend::new(device)?.with_extra_buffer_types(self.cpu_extra_bufts));
        if let Some(t) = self.threads {
            b.set_threads(t);
        }
        tracing::debug!(
            device = %name,
            extra_buffer_types = ?b.weight_buffer_types().iter().map(|t| t.name()).collect::<Vec<_>>(),
            "created backend instance"
        );
        cache.insert(name, b.clone());
        Ok(b)
    }

    /// How many distinct instances exist.
    pub fn len(&self) -> usize {
        self.cache.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Whether no instance exists.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
