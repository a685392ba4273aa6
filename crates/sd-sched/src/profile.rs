//! Per-op and per-block profiles of a runner's graphs: where the compute time goes.
//!
//! With profiling on ([`crate::Runner::set_profiling`]), a runner computes each allocated
//! graph one node at a time (a one-node view of it, in the graph's order, so every operand is
//! computed and still in place), timing each node and charging it to its op (ggml's op
//! description: `MUL_MAT`, `IM2COL`, `GELU`, ...) and to the block whose cut added it (the
//! segment name: `input_blocks.4`, `clip_text.layers.7`; `graph` for a graph run without
//! cuts). Matrix products and flash attention also count their floating-point operations, so
//! the table gives achieved GFLOP/s where that means something; every op counts the bytes it
//! writes. Computing node by node costs a graph launch per node (tens of microseconds on the
//! CPU): the figures are for finding where time goes, not for wall-clock claims.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use sd_backends::{Backend, Graph, Tensor};

use crate::error::Result;

/// One op or block's share of a profile.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileEntry {
    /// Nodes computed.
    pub nodes: u64,
    /// Compute time, seconds.
    pub seconds: f64,
    /// Floating-point operations (matrix products and attention only; 0 for other ops).
    pub flops: f64,
    /// Bytes of the outputs written.
    pub bytes_out: u64,
}

impl ProfileEntry {
    fn add(&mut self, seconds: f64, flops: f64, bytes: u64) {
        self.nodes += 1;
        self.seconds += seconds;
        self.flops += flops;
        self.bytes_out += bytes;
    }
}

/// A runner's profile, summed over its runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// By op description.
    pub ops: BTreeMap<String, ProfileEntry>,
    /// By block (segment) name.
    pub blocks: BTreeMap<String, ProfileEntry>,
}

/// Floating-point operations of node `t`: `2 K M N` for a matrix product of a `K x M` weight
/// by `K x N` activations (times the batch dimensions), `4 D Nq Nkv H` for flash attention.
fn flops(t: Tensor<'_>) -> f64 {
    let (Some(a), Some(b)) = (t.src(0), t.src(1)) else { return 0.0 };
    match t.op_desc().as_str() {
        "MUL_MAT" => {
            let (a, out) = (a.shape(), t.shape());
            2.0 * a[0] as f64 * out[0] as f64 * out[1] as f64 * out[2] as f64 * out[3] as f64
        }
        "FLASH_ATTN_EXT" => {
            // q: [D, Nq, H, B], k: [D, Nkv, H_kv, B]
            let (q, k) = (a.shape(), b.shape());
            4.0 * q[0] as f64 * q[1] as f64 * k[1] as f64 * q[2] as f64 * q[3] as f64
        }
        _ => 0.0,
    }
}

impl Profile {
    /// Computes the allocated `graph` on `backend` node by node, charging node `i` to the
    /// block `block_of(i)`.
    pub(crate) fn compute(
        &mut self,
        backend: &Backend,
        graph: &Graph<'_>,
        block_of: &dyn Fn(usize) -> String,
    ) -> Result<()> {
        for i in 0..graph.n_nodes() {
            let node = graph.node(i);
            let view = graph.view(i..i + 1);
            let t0 = Instant::now();
            backend.compute(&view.graph())?;
            let secs = t0.elapsed().as_secs_f64();
            let (f, bytes) = (flops(node), node.nbytes() as u64);
            self.ops.entry(node.op_desc()).or_default().add(secs, f, bytes);
            self.blocks.entry(block_of(i)).or_default().add(secs, f, bytes);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use sd_backends::{Context, GgmlType, PluginRegistry, PluginSearch};

    use crate::{Runner, TensorSpec, Weights};

    #[test]
    fn a_profiled_graph_counts_every_node_by_op_and_block_with_matmul_flops() {
        let search = PluginSearch::only(vec![PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)]);
        let reg: &'static PluginRegistry = Box::leak(Box::new(PluginRegistry::discover(&search)));
        let cpu = Arc::new(sd_backends::Backend::new(reg.device("cpu").unwrap()).unwrap());
        let specs = vec![TensorSpec { name: "w".into(), ty: GgmlType::GGML_TYPE_F32, ne: vec![32, 16] }];
        let mut w = Weights::new(specs).unwrap();
        w.allocate(cpu.device().buffer_type()).unwrap();
        let g = Context::for_graph(16, 16).unwrap();
        let x = g.new_f32(&[32, 8]).set_input();
        let h = g.mul_mat(w.get("w").unwrap(), x); // [16, 8]: 2 * 32 * 16 * 8 flops
        let out = g.gelu(h).set_output();
        let mut runner = Runner::new("m", cpu);
        runner.set_profiling(true);
        runner.run(&w, &g, 16, &[("first".to_string(), h)], out, &mut || Ok(x.set_f32(&[0.5; 256])?)).unwrap();
        let p = runner.profile().unwrap();
        assert_eq!(p.ops["MUL_MAT"].nodes, 1);
        assert_eq!(p.ops["MUL_MAT"].flops, (2 * 32 * 16 * 8) as f64);
        assert_eq!(p.ops["GELU"].nodes, 1, "{:?}", p.ops.keys());
        assert_eq!(p.blocks["first"].nodes, 1);
        assert_eq!(p.blocks["output"].nodes, 1, "{:?}", p.blocks.keys());
        assert!(p.ops.values().all(|e| e.seconds >= 0.0));
        runner.set_profiling(false);
        assert!(runner.profile().is_none());
    }
}
