//! Devices: a physical (or remote) compute device exposed by a plugin.
//!
//! Ownership: a [`Device`] is a non-owning, copyable handle. Devices belong to
//! their plugin's registration, which lives for the rest of the process (plugins
//! are never unloaded), so a handle is valid forever.

use ggml_sys as sys;
use serde::{Deserialize, Serialize};

use crate::buffer::BufferType;
use crate::registry::cstr;

/// The kind of a device, as ggml reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The host CPU.
    Cpu,
    /// A discrete GPU with its own memory.
    Gpu,
    /// An integrated GPU sharing host memory.
    Igpu,
    /// An accelerator used together with the CPU (BLAS, AMX, ...).
    Accel,
    /// ggml's multi-device "meta" device.
    Meta,
}

impl DeviceKind {
    /// The short lowercase name used in tables and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Gpu => "gpu",
            Self::Igpu => "igpu",
            Self::Accel => "accel",
            Self::Meta => "meta",
        }
    }
}

/// What a device can do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceCaps {
    /// Asynchronous operations.
    pub async_ops: bool,
    /// Events for synchronisation.
    pub events: bool,
    /// A pinned host buffer type.
    pub host_buffer: bool,
    /// Buffers created from host pointers.
    pub buffer_from_host_ptr: bool,
    /// Weights can be memory-mapped for loading.
    pub mmap: bool,
}

/// A device handle. See the module docs for its lifetime.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Device {
    raw: sys::ggml_backend_dev_t,
}

// SAFETY: device handles are process-lifetime objects and ggml's device API is
// safe to call from any thread.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.name()).finish()
    }
}

impl Device {
    pub(crate) fn from_raw(raw: sys::ggml_backend_dev_t) -> Option<Self> {
        (!raw.is_null()).then_some(Self { raw })
    }

    /// The raw handle, for FFI calls in this workspace.
    pub fn as_raw(self) -> sys::ggml_backend_dev_t {
        self.raw
    }

    pub(crate) fn reg_raw(self) -> sys::ggml_backend_reg_t {
        // SAFETY: a live device.
        unsafe { sys::ggml_backend_dev_backend_reg(self.raw) }
    }

    /// The device name (`CPU`, `CUDA0`, `RPC0`, ...).
    pub fn name(self) -> String {
        // SAFETY: a live device returns a static name.
        unsafe { cstr(sys::ggml_backend_dev_name(self.raw)) }
    }

    /// A human description (model name, or the endpoint for RPC devices).
    pub fn description(self) -> String {
        // SAFETY: a live device.
        unsafe { cstr(sys::ggml_backend_dev_description(self.raw)) }
    }

    /// The device kind.
    pub fn kind(self) -> DeviceKind {
        let mut props = sys::ggml_backend_dev_props::default();
        // SAFETY: a live device and a valid out-pointer.
        unsafe { sys::ggml_backend_dev_get_props(self.raw, &mut props) };
        match props.type_ {
            sys::ggml_backend_dev_type::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceKind::Cpu,
            sys::ggml_backend_dev_type::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceKind::Gpu,
            sys::ggml_backend_dev_type::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceKind::Igpu,
            sys::ggml_backend_dev_type::GGML_BACKEND_DEVICE_TYPE_ACCEL => DeviceKind::Accel,
            _ => DeviceKind::Meta,
        }
    }

    /// Free and total memory in bytes, as the device reports them now.
    pub fn memory(self) -> (u64, u64) {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: a live device and valid out-pointers.
        unsafe { sys::ggml_backend_dev_memory(self.raw, &mut free, &mut total) };
        (free as u64, total as u64)
    }

    /// Capabilities.
    pub fn caps(self) -> DeviceCaps {
        let mut props = sys::ggml_backend_dev_props::default();
        // SAFETY: a live device and a valid out-pointer.
        unsafe { sys::ggml_backend_dev_get_props(self.raw, &mut props) };
        DeviceCaps {
            async_ops: props.caps.async_,
            events: props.caps.events,
            host_buffer: props.caps.host_buffer,
            buffer_from_host_ptr: props.caps.buffer_from_host_ptr,
            mmap: props.caps.mmap_support,
        }
    }

    /// The device's default buffer type.
    pub fn buffer_type(self) -> BufferType {
        // SAFETY: a live device; buffer types live as long as their device.
        BufferType::from_raw(unsafe { sys::ggml_backend_dev_buffer_type(self.raw) })
    }

    /// The device's extra buffer types for weights, in the plugin's order of preference: for
    /// ggml's CPU plugin the AMX buffer type (variants built with AMX-INT8, on a CPU that
    /// grants the process AMX tiles) and `CPU_REPACK` (quantized weights re-laid out for the
    /// ISA's GEMM kernels). Reached through the registration's
    /// `ggml_backend_dev_get_extra_bufts`; empty when the plugin exports none. Tensors in them
    /// are written with `ggml_backend_tensor_set` (which converts) and never read back
    /// ([`BufferType::is_extra`]).
    pub fn extra_buffer_types(self) -> Vec<BufferType> {
        // SAFETY: a live registration; the name is NUL-terminated.
        let p = unsafe {
            sys::ggml_backend_reg_get_proc_address(self.reg_raw(), c"ggml_backend_dev_get_extra_bufts".as_ptr())
        };
        if p.is_null() {
            return Vec::new();
        }
        // SAFETY: the symbol has ggml's `ggml_backend_dev_get_extra_bufts_t` signature.
        let f: sys::DevGetExtraBuftsFn = unsafe { std::mem::transmute(p) };
        // SAFETY: a live device of that registration; the plugin returns a static array
        // ending with a null entry.
        let mut at = unsafe { f(self.raw) };
        let mut out = Vec::new();
        while !at.is_null() {
            // SAFETY: `at` points inside the null-terminated array.
            let b = unsafe { *at };
            if b.is_null() {
                break;
            }
            out.push(BufferType::from_raw(b));
            // SAFETY: the array continues up to its null entry.
            at = unsafe { at.add(1) };
        }
        crate::buffer::remember_extra(&out);
        out
    }

    /// Whether this device can run the operation that produces `t`.
    pub fn supports_op(self, t: crate::Tensor<'_>) -> bool {
        // SAFETY: a live device and a live tensor.
        unsafe { sys::ggml_backend_dev_supports_op(self.raw, t.as_raw()) }
    }
}

/// A serialisable description of a device, for listings and planners.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Description.
    pub description: String,
    /// `cpu`, `gpu`, `igpu`, `accel`.
    #[serde(rename = "type")]
    pub kind: DeviceKind,
    /// Free memory in bytes.
    pub memory_free: u64,
    /// Total memory in bytes.
    pub memory_total: u64,
    /// The plugin file (and endpoint for remote devices).
    pub plugin: String,
    /// The registration name (`CPU`, `RPC[host:port]`, ...).
    pub registry: String,
    /// Capabilities.
    pub caps: DeviceCaps,
}
