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

    /// A view of nodes `range` (in execution order) as a graph of its own, sharing the
    /// nodes, their use counts and hash set. Tensors the view reads from outside it become
    /// its leaves and must already have storage when it is allocated or computed.
    pub fn view(&self, range: std::ops::Range<usize>) -> GraphView<'c> {
        let end = range.end.min(self.n_nodes());
        let start = range.start.min(end);
        // SAFETY: live graph; indices within its nodes.
        let mut inner = Box::new(unsafe { sys::ggml_graph_view(self.raw, start as i32, end as i32) });
        // ggml's view has no leaves, and its allocator sizes its hash table from nodes plus
        // leaves: list the outside operands as leaves so the table holds them.
        let inside: std::collections::HashSet<usize> = (start..end).map(|i| self.node(i).as_raw() as usize).collect();
        let mut seen = std::collections::HashSet::new();
        let mut leaves: Vec<*mut sys::ggml_tensor> = Vec::new();
        for i in start..end {
            let node = self.node(i);
            let operands = (0..crate::context::MAX_SRC).filter_map(|j| node.src(j)).chain(node.view_src());
            for t in operands {
                let p = t.as_raw() as usize;
                if !inside.contains(&p) && seen.insert(p) {
                    leaves.push(t.as_raw());
                }
            }
        }
        inner.n_leafs = leaves.len() as i32;
        inner.leafs = leaves.as_mut_ptr();
        GraphView { inner, _leaves: leaves, _ctx: PhantomData }
    }

    /// The i-th node.
    pub fn node(&self, i: usize) -> Tensor<'c> {
        // SAFETY: index below n_nodes (ggml asserts otherwise).
        Tensor::from_raw(unsafe { sys::ggml_graph_node(self.raw, i as i32) })
    }
}

/// A range of a graph's nodes, usable wherever a [`Graph`] is (see [`Graph::view`]).
pub struct GraphView<'c> {
    inner: Box<sys::ggml_cgraph_layout>,
    /// The storage `inner.leafs` points into (a Vec's heap buffer does not move with it).
    _leaves: Vec<*mut sys::ggml_tensor>,
    _ctx: PhantomData<&'c Context>,
}

impl std::fmt::Debug for GraphView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphView({} nodes)", self.graph().n_nodes())
    }
}

impl<'c> GraphView<'c> {
    /// The view as a graph (borrowing the view).
    pub fn graph(&self) -> Graph<'_> {
        Graph { raw: (&*self.inner as *const sys::ggml_cgraph_layout).cast_mut().cast(), _ctx: PhantomData }
    }
}
