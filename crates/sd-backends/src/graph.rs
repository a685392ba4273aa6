//! Computation graphs.
//!
//! Ownership: a [`Graph`] lives inside the [`Context`] that created it and is
//! borrowed from it, like a tensor.

use std::marker::PhantomData;

use ggml_sys as sys;

use crate::context::{Context, Tensor};

/// A graph of tensor operations.
#[derive(Clone, Copy)]
pub struct Graph<'c> {
    raw: *mut sys::ggml_cgraph,
    _ctx: PhantomData<&'c Context>,
}

impl std::fmt::Debug for Graph<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph({} nodes)", self.n_nodes())
    }
}

impl Context {
    /// A new empty graph with room for `size` nodes.
    pub fn new_graph(&self, size: usize) -> Graph<'_> {
        // SAFETY: live context sized for the graph (Context::for_graph).
        let raw = unsafe { sys::ggml_new_graph_custom(self.as_raw(), size, false) };
        assert!(!raw.is_null(), "ggml returned a null graph");
        Graph { raw, _ctx: PhantomData }
    }
}

impl<'c> Graph<'c> {
    /// The raw pointer.
    pub fn as_raw(&self) -> *mut sys::ggml_cgraph {
        self.raw
    }

    /// Adds `t` and everything it depends on.
    pub fn expand(&self, t: Tensor<'_>) {
        // SAFETY: live graph and tensor.
        unsafe { sys::ggml_build_forward_expand(self.raw, t.as_raw()) }
    }

    /// Number of operation nodes.
    pub fn n_nodes(&self) -> usize {
        // SAFETY: live graph.
        unsafe { sys::ggml_graph_n_nodes(self.raw) as usize }
    }

    /// The i-th node.
    pub fn node(&self, i: usize) -> Tensor<'c> {
        // SAFETY: index below n_nodes (ggml asserts otherwise).
        Tensor::from_raw(unsafe { sys::ggml_graph_node(self.raw, i as i32) })
    }
}
