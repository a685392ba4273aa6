//! The graph allocator: plans and owns the compute buffer of a graph on one buffer type.
//!
//! Ownership: a [`GraphAllocator`] owns a `ggml_gallocr_t` and the compute
//! buffer it allocates; tensors it placed become invalid when it is dropped or
//! allocates the next graph (which may free and replace the buffer). Nothing in
//! a tensor handle ties it to the allocator, so [`GraphAllocator::alloc_graph`]
//! is `unsafe` with that contract.

use ggml_sys as sys;

use crate::buffer::BufferType;
use crate::error::{BackendError, Result};
use crate::graph::Graph;

/// A compute-buffer allocator.
pub struct GraphAllocator {
    raw: sys::ggml_gallocr_t,
    buft: BufferType,
}

// SAFETY: owned handle, used from one thread at a time.
unsafe impl Send for GraphAllocator {}

impl std::fmt::Debug for GraphAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphAllocator({}, {} bytes)", self.buft.name(), self.buffer_size())
    }
}

impl GraphAllocator {
    /// An allocator for `buft`.
    pub fn new(buft: BufferType) -> Self {
        // SAFETY: a live buffer type.
        let raw = unsafe { sys::ggml_gallocr_new(buft.as_raw()) };
        assert!(!raw.is_null(), "ggml_gallocr_new returned null");
        Self { raw, buft }
    }

    /// Bytes the compute buffer of `graph` needs, measured without allocating.
    /// Tensors that already have storage (weights) are not counted.
    ///
    /// The measurement uses a fresh, throw-away allocator: a measured (no-alloc)
    /// reservation leaves an allocator believing its buffers exist.
    pub fn measure(&self, graph: &Graph<'_>) -> usize {
        measure(self.buft, graph)
    }

    /// Allocates the compute buffer for `graph` and places its tensors.
    ///
    /// # Safety
    /// The tensors of `graph` placed here point into the allocator's buffer, which they
    /// do not keep alive: their data must not be read, written or computed with after this
    /// allocator is dropped or allocates another graph (that may free the buffer).
    ///
    /// ```compile_fail,E0133
    /// fn f(graph: &sd_backends::Graph<'_>, out: sd_backends::Tensor<'_>, buft: sd_backends::BufferType) {
    ///     let mut alloc = sd_backends::GraphAllocator::new(buft);
    ///     alloc.alloc_graph(graph).unwrap(); // error: call to unsafe function
    ///     drop(alloc);
    ///     let _ = out.get_f32();
    /// }
    /// ```
    pub unsafe fn alloc_graph(&mut self, graph: &Graph<'_>) -> Result<()> {
        // SAFETY: live allocator and graph.
        if unsafe { sys::ggml_gallocr_alloc_graph(self.raw, graph.as_raw()) } {
            Ok(())
        } else {
            crate::rpc::check_lost()?;
            Err(BackendError::Alloc { device: self.buft.name(), bytes: self.measure(graph) })
        }
    }

    /// Size of the allocated compute buffer.
    pub fn buffer_size(&self) -> usize {
        // SAFETY: live allocator; buffer 0 always exists.
        unsafe { sys::ggml_gallocr_get_buffer_size(self.raw, 0) }
    }
}

/// Bytes the compute buffer of `graph` needs on `buft`, measured without allocating.
pub fn measure(buft: BufferType, graph: &Graph<'_>) -> usize {
    let tmp = GraphAllocator::new(buft);
    let mut size = 0usize;
    // SAFETY: live fresh allocator and graph; one buffer type, so null id arrays
    // mean "everything in buffer 0" and `size` has one slot.
    unsafe { sys::ggml_gallocr_reserve_n_size(tmp.raw, graph.as_raw(), std::ptr::null(), std::ptr::null(), &mut size) };
    size
}

impl Drop for GraphAllocator {
    fn drop(&mut self) {
        // SAFETY: we own it.
        unsafe { sys::ggml_gallocr_free(self.raw) }
    }
}
