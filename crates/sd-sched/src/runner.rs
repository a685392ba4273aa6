//! A runner executes a module's graphs on one device and owns its compute buffer.
//!
//! Usage: build a graph in a metadata-only `Context` (inputs marked with
//! `set_input`), call [`Runner::alloc`], set the inputs' data, call
//! [`Runner::compute`], read the outputs. The compute buffer is measured with
//! ggml's measure-only allocator before allocating, and its size is logged at
//! debug per backend the first time and whenever it changes.

use std::sync::Arc;

use sd_backends::{Backend, Graph, GraphAllocator};

use crate::error::{Result, SchedError};

/// Graph execution on one backend.
#[derive(Debug)]
pub struct Runner {
    name: String,
    backend: Arc<Backend>,
    alloc: GraphAllocator,
    last_logged: usize,
}

impl Runner {
    /// A runner named `name` (for logs) on `backend`.
    pub fn new(name: impl Into<String>, backend: Arc<Backend>) -> Self {
        let alloc = GraphAllocator::new(backend.device().buffer_type());
        Self { name: name.into(), backend, alloc, last_logged: 0 }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// Measures and allocates the compute buffer for `graph`.
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<()> {
        let need = self.alloc.measure(graph);
        if need != self.last_logged {
            tracing::debug!(
                "{} compute buffer size: {:.2} MB on {} (peak across 1 segment)",
                self.name,
                need as f64 / (1024.0 * 1024.0),
                self.backend.device().name()
            );
            self.last_logged = need;
        }
        self.alloc.alloc_graph(graph).map_err(|_| SchedError::Alloc {
            device: self.backend.device().name(),
            bytes: need,
            what: format!("the {} compute buffer", self.name),
        })
    }

    /// Runs an allocated graph.
    pub fn compute(&self, graph: &Graph<'_>) -> Result<()> {
        let _span = tracing::trace_span!("compute", module = %self.name).entered();
        Ok(self.backend.compute(graph)?)
    }

    /// Bytes of the current compute buffer.
    pub fn compute_buffer_size(&self) -> usize {
        self.alloc.buffer_size()
    }
}
