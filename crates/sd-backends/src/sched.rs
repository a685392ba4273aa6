//! ggml's multi-backend scheduler (`ggml_backend_sched`): one graph over several backends.
//!
//! Ownership: a [`Scheduler`] owns its `ggml_backend_sched_t` and the compute buffers it
//! allocates on each backend (one per backend, sized by the largest graph it has seen), and
//! keeps an `Arc` of every backend it was built over, so none is freed before it. Tensors it
//! places point into those buffers without keeping them alive: [`Scheduler::alloc_graph`] is
//! `unsafe` with that contract, as [`crate::GraphAllocator::alloc_graph`] is.
//!
//! Assignment: the caller says which backend runs which node (`assign`, by index into the
//! backend list); ggml assigns the rest (weights run where their buffer is, inputs on the
//! last backend). Where two nodes on different backends meet, the scheduler copies the
//! operand to the reading backend's buffer (through the host when the buffers cannot copy
//! directly, as between two RPC servers). ggml requires the last backend to be the CPU; the
//! constructor checks it (and the backend count) and returns an error instead of ggml's abort.
//! One copy of the inputs (`parallel = false`): no pipelining inside the scheduler.

use std::sync::Arc;

use ggml_sys as sys;

use crate::backend::Backend;
use crate::context::Tensor;
use crate::device::DeviceKind;
use crate::error::{BackendError, Result};
use crate::graph::Graph;

/// The most backends ggml's scheduler takes (`GGML_SCHED_MAX_BACKENDS`).
const MAX_BACKENDS: usize = 16;

/// A scheduler over several backends (the last one the CPU).
pub struct Scheduler {
    raw: sys::ggml_backend_sched_t,
    backends: Vec<Arc<Backend>>,
    graph_size: usize,
}

// SAFETY: an owned handle, used through `&mut self` only (one thread at a time); the backends
// are `Send + Sync`.
unsafe impl Send for Scheduler {}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.backends.iter().map(|b| b.device().name()).collect();
        write!(f, "Scheduler([{}])", names.join(", "))
    }
}

impl Scheduler {
    /// A scheduler over `backends` for graphs of up to `graph_size` nodes (and as many leafs).
    /// The last backend must be a CPU one; at most 16 backends.
    pub fn new(backends: Vec<Arc<Backend>>, graph_size: usize) -> Result<Self> {
        let names = || backends.iter().map(|b| b.device().name()).collect::<Vec<_>>().join(", ");
        if backends.is_empty() || backends.len() > MAX_BACKENDS {
            return Err(BackendError::Placement {
                name: "scheduler".into(),
                reason: format!(
                    "{} backends [{}]; ggml's scheduler takes 1 to {MAX_BACKENDS}",
                    backends.len(),
                    names()
                ),
            });
        }
        if backends.last().map(|b| b.device().kind()) != Some(DeviceKind::Cpu) {
            return Err(BackendError::Placement {
                name: "scheduler".into(),
                reason: format!("the last of [{}] must be a CPU backend", names()),
            });
        }
        let mut raw_backends: Vec<sys::ggml_backend_t> = backends.iter().map(|b| b.as_raw()).collect();
        // Room for every node and every leaf of the largest graph.
        let hash = graph_size.max(1) * 2;
        // SAFETY: live backends; null buffer types mean each backend's default; the count
        // and the CPU-last rule are checked above, so ggml's asserts hold.
        let raw = unsafe {
            sys::ggml_backend_sched_new(
                raw_backends.as_mut_ptr(),
                std::ptr::null_mut(),
                raw_backends.len() as i32,
                hash,
                false,
                false,
            )
        };
        if raw.is_null() {
            return Err(BackendError::Placement {
                name: "scheduler".into(),
                reason: "ggml_backend_sched_new failed".into(),
            });
        }
        Ok(Self { raw, backends, graph_size: hash })
    }

    /// The backends, in the order given.
    pub fn backends(&self) -> &[Arc<Backend>] {
        &self.backends
    }

    fn check_size(&self, graph: &Graph<'_>) -> Result<()> {
        if graph.n_nodes() * 2 > self.graph_size {
            return Err(BackendError::Placement {
                name: "scheduler".into(),
                reason: format!("a graph of {} nodes exceeds the scheduler's {}", graph.n_nodes(), self.graph_size / 2),
            });
        }
        Ok(())
    }

    fn assign(&mut self, assign: &[(Tensor<'_>, usize)]) -> Result<()> {
        for &(t, b) in assign {
            let Some(backend) = self.backends.get(b) else {
                return Err(BackendError::Placement {
                    name: t.name(),
                    reason: format!("assigned backend {b} of {}", self.backends.len()),
                });
            };
            // SAFETY: live scheduler, tensor and backend (one of the scheduler's).
            unsafe { sys::ggml_backend_sched_set_tensor_backend(self.raw, t.as_raw(), backend.as_raw()) };
        }
        Ok(())
    }

    /// Sizes the compute buffers for `graph` with the nodes of `assign` on their backends
    /// (allocating them, or growing them to the largest graph seen) and returns each
    /// backend's compute-buffer bytes, in backend order. Nothing is placed, and the graph's
    /// operands are left as they were (ggml's reserve re-points them at its own copies).
    pub fn reserve(&mut self, graph: &Graph<'_>, assign: &[(Tensor<'_>, usize)]) -> Result<Vec<u64>> {
        self.check_size(graph)?;
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_reset(self.raw) };
        self.assign(assign)?;
        // ggml's scheduler points the operands that cross backends at copies it makes in a
        // context of its own, which the next split frees: kept, they would leave the graph that
        // `alloc_graph` splits next reading freed tensors. Their operands are restored after.
        let saved: Vec<(*mut sys::ggml_tensor, [*mut sys::ggml_tensor; sys::GGML_MAX_SRC as usize])> = (0..graph
            .n_nodes())
            .map(|i| {
                let n = graph.node(i).as_raw();
                // SAFETY: a live node of the graph.
                (n, unsafe { (*n).src })
            })
            .collect();
        // SAFETY: live scheduler and graph; its size is checked above.
        let ok = unsafe { sys::ggml_backend_sched_reserve(self.raw, graph.as_raw()) };
        for (n, src) in saved {
            // SAFETY: the same live nodes; their own operands, as they were before the reserve.
            unsafe { (*n).src = src };
        }
        crate::rpc::check_lost()?;
        if !ok {
            return Err(BackendError::Alloc { device: self.describe(), bytes: 0 });
        }
        Ok(self.buffer_sizes())
    }

    /// Each backend's compute-buffer bytes now, in backend order.
    pub fn buffer_sizes(&self) -> Vec<u64> {
        self.backends
            .iter()
            // SAFETY: live scheduler; the backend is one of its own.
            .map(|b| unsafe { sys::ggml_backend_sched_get_buffer_size(self.raw, b.as_raw()) } as u64)
            .collect()
    }

    /// How many pieces (consecutive nodes on one backend) the last graph was cut into.
    pub fn n_splits(&self) -> usize {
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_get_n_splits(self.raw) }.max(0) as usize
    }

    fn describe(&self) -> String {
        self.backends.iter().map(|b| b.device().name()).collect::<Vec<_>>().join(" + ")
    }

    /// Assigns the nodes of `assign`, splits `graph` and places its tensors in the compute
    /// buffers; the graph's inputs can then be written and the graph computed.
    ///
    /// # Safety
    /// The tensors of `graph` placed here point into the scheduler's buffers, which they do not
    /// keep alive: their data must not be read, written or computed with after the scheduler
    /// is dropped, reserves, or allocates another graph.
    pub unsafe fn alloc_graph(&mut self, graph: &Graph<'_>, assign: &[(Tensor<'_>, usize)]) -> Result<()> {
        self.check_size(graph)?;
        // SAFETY: live scheduler.
        unsafe { sys::ggml_backend_sched_reset(self.raw) };
        self.assign(assign)?;
        // SAFETY: live scheduler and graph (size checked); the caller keeps the contract above.
        let ok = unsafe { sys::ggml_backend_sched_alloc_graph(self.raw, graph.as_raw()) };
        crate::rpc::check_lost()?;
        if !ok {
            return Err(BackendError::Alloc { device: self.describe(), bytes: 0 });
        }
        Ok(())
    }

    /// Computes a graph placed by [`alloc_graph`](Self::alloc_graph) and waits for every
    /// backend. Holds each backend's compute lock meanwhile.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<()> {
        let mut guards = Vec::with_capacity(self.backends.len());
        let mut seen = Vec::new();
        for b in &self.backends {
            if !seen.contains(&b.as_raw()) {
                seen.push(b.as_raw());
                guards.push(b.lock.lock().unwrap_or_else(|e| e.into_inner()));
            }
        }
        // SAFETY: live scheduler and graph, allocated by `alloc_graph` (its contract).
        let status = unsafe { sys::ggml_backend_sched_graph_compute(self.raw, graph.as_raw()) };
        drop(guards);
        crate::rpc::check_lost()?;
        if status != sys::ggml_status::GGML_STATUS_SUCCESS {
            return Err(BackendError::Compute { device: self.describe(), status: status.0 });
        }
        Ok(())
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: we own the scheduler; its backends are still alive (we hold them).
        unsafe { sys::ggml_backend_sched_free(self.raw) }
    }
}
