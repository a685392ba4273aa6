//! The multi-backend scheduler (ggml_backend_sched): splits a graph across devices.
//!
//! Ownership: a [`Scheduler`] owns its `ggml_backend_sched_t` and keeps an
//! `Arc` of every backend it uses, so the backends outlive it. Pipeline
//! parallelism (`parallel = true`) keeps `GGML_SCHED_MAX_COPIES` copies of every
//! cross-device input; the copy count is logged with each backend's compute
//! buffer size so its cost is visible.

use std::sync::Arc;

use ggml_sys as sys;

use crate::backend::Backend;
use crate::error::{BackendError, Result};
use crate::graph::Graph;
use crate::Tensor;

/// A scheduler over several backends; the last one must be the CPU.
pub struct Scheduler {
    raw: sys::ggml_backend_sched_t,
    backends: Vec<Arc<Backend>>,
}

// SAFETY: owned handle used from one thread at a time.
unsafe impl Send for Scheduler {}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scheduler({:?})", self.backends)
    }
}

impl Scheduler {
    /// A scheduler over `backends` (priority order; the CPU last).
    pub fn new(backends: Vec<Arc<Backend>>, graph_size: usize, parallel: bool) -> Result<Self> {
        let mut raw_b: Vec<sys::ggml_backend_t> = backends.iter().map(|b| b.as_raw()).collect();
        // SAFETY: live backends (kept alive by self.backends); null bufts = defaults.
        let raw = unsafe {
            sys::ggml_backend_sched_new(
                raw_b.as_mut_ptr(),
                std::ptr::null_mut(),
                raw_b.len() as i32,
                graph_size,
                parallel,
                true,
            )
        };
        if raw.is_null() {
            return Err(BackendError::BackendInit("scheduler".into()));
        }
        // SAFETY: live scheduler.
        let copies = unsafe { sys::ggml_backend_sched_get_n_copies(raw) };
        if copies > 1 {
            tracing::info!("pipeline parallelism enabled (n_copies={copies})");
        }
        Ok(Self { raw, backends })
    }

    /// Pins the node `t` to `backend`.
    pub fn set_tensor_backend(&self, t: Tensor<'_>, backend: &Backend) {
        // SAFETY: live scheduler, tensor and backend.
        unsafe { sys::ggml_backend_sched_set_tensor_backend(self.raw, t.as_raw(), backend.as_raw()) }
    }

    /// Allocates the graph across backends.
    ///
    /// # Safety
    /// As [`crate::GraphAllocator::alloc_graph`]: the graph's tensors must not be used
    /// after the scheduler is dropped, reset or allocates another graph.
    pub unsafe fn alloc_graph(&self, graph: &Graph<'_>) -> Result<()> {
        // SAFETY: live scheduler and graph.
        if unsafe { sys::ggml_backend_sched_alloc_graph(self.raw, graph.as_raw()) } {
            Ok(())
        } else {
            crate::rpc::check_lost()?;
            Err(BackendError::Alloc { device: "scheduler".into(), bytes: 0 })
        }
    }

    /// Runs the graph.
    pub fn compute(&self, graph: &Graph<'_>) -> Result<()> {
        // SAFETY: live scheduler and graph.
        let status = unsafe { sys::ggml_backend_sched_graph_compute(self.raw, graph.as_raw()) };
        if status != sys::ggml_status::GGML_STATUS_SUCCESS {
            crate::rpc::check_lost()?;
            return Err(BackendError::Compute { device: "scheduler".into(), status: status.0 });
        }
        crate::rpc::check_lost()
    }

    /// Frees the previous graph's allocation.
    pub fn reset(&self) {
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_reset(self.raw) }
    }

    /// Number of splits of the last graph.
    pub fn n_splits(&self) -> usize {
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_get_n_splits(self.raw) as usize }
    }

    /// Compute buffer size per backend, in the order given to `new`.
    pub fn buffer_sizes(&self) -> Vec<(String, usize)> {
        self.backends
            .iter()
            // SAFETY: live scheduler and one of its backends.
            .map(|b| (b.device().name(), unsafe { sys::ggml_backend_sched_get_buffer_size(self.raw, b.as_raw()) }))
            .collect()
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: we own it; backends are still alive (held in self.backends).
        unsafe { sys::ggml_backend_sched_free(self.raw) }
    }
}
