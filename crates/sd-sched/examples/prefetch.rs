//! Prefetch overlap on the CPU device: a stack of large identical blocks whose weights live in
//! RAM (`ParamHome::Host`) and are staged per block under a budget of a few blocks, run with
//! and without prefetch. Prints, per run: step time, compute time, copy time (summed over
//! threads) and step / max(copy, compute).
//!
//! ```text
//! cargo run --release -p sd-sched --example prefetch [-- DIM BLOCKS TOKENS RUNS]
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use sd_backends::{Backend, Context, GgmlType, PluginRegistry, PluginSearch};
use sd_sched::plan::Options;
use sd_sched::{Ledgers, ParamHome, Runner, SourceError, TensorSource, TensorSpec, Weights};

struct Source(HashMap<String, Vec<u8>>);

impl TensorSource for Source {
    fn load(&self, name: &str, _ty: GgmlType, _ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        self.0.get(name).map(|b| Cow::Borrowed(b.as_slice())).ok_or_else(|| SourceError::new(format!("no `{name}`")))
    }
}

fn main() {
    let arg = |i: usize, d: i64| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (dim, blocks, tokens, runs) = (arg(1, 2048), arg(2, 16) as usize, arg(3, 16), arg(4, 5) as usize);
    let reg: &'static PluginRegistry =
        Box::leak(Box::new(PluginRegistry::discover(&PluginSearch::only(vec![PathBuf::from(
            ggml_sys::BUILD_PLUGIN_DIR,
        )]))));
    let cpu = Arc::new(Backend::new(reg.device("cpu").expect("the CPU plugin")).expect("a CPU backend"));
    cpu.set_threads(std::thread::available_parallelism().map_or(1, |n| n.get()));
    let specs: Vec<TensorSpec> = (0..blocks)
        .map(|i| TensorSpec { name: format!("blocks.{i}.weight"), ty: GgmlType::GGML_TYPE_F16, ne: vec![dim, dim] })
        .collect();
    let block_bytes = (dim * dim * 2) as u64;
    let src = Arc::new(Source(
        specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let v: Vec<u8> = (0..dim * dim)
                    .flat_map(|j| half_bits(((j * 7 + i as i64 * 13) % 97) as f32 / 97.0 - 0.5).to_le_bytes())
                    .collect();
                (s.name.clone(), v)
            })
            .collect(),
    ));
    println!(
        "{blocks} blocks of {dim}x{dim} f16 ({:.1} MiB each), {tokens} tokens, budget 4 blocks + cut buffer",
        block_bytes as f64 / 1048576.0
    );
    for prefetch in [true, false] {
        // Four blocks, the cut buffer (every block's output lives there for the run) and room
        // for the compute buffer.
        let cuts = (blocks as i64 * dim * tokens * 4) as u64;
        let ledgers = Ledgers::with_budgets(HashMap::from([("CPU".to_string(), 4 * block_bytes + cuts + (8 << 20))]));
        let mut w = Weights::new(specs.clone()).unwrap();
        let group = |n: &str| n.rsplit_once('.').map_or(n, |(g, _)| g).to_string();
        w.place("toy", ParamHome::Host, cpu.clone(), &ledgers, &group, src.clone()).unwrap();
        let opts = Options { disable_prefetch: !prefetch, ..Options::default() };
        let mut runner = Runner::with_ledger("toy", cpu.clone(), ledgers.get("CPU"), opts);
        let mut steps = Vec::new();
        for _ in 0..runs {
            let g = Context::for_graph(4096, 4096).unwrap();
            let x = g.new_f32(&[dim, tokens]).set_input();
            let mut h = x;
            let mut cuts = Vec::new();
            for i in 0..blocks {
                h = g.tanh(g.mul_mat(w.get(&format!("blocks.{i}.weight")).unwrap(), h));
                cuts.push((format!("blocks.{i}"), h));
            }
            let out = cuts.pop().unwrap().1.set_output();
            let data: Vec<f32> = (0..dim * tokens).map(|i| (i % 13) as f32 / 13.0).collect();
            let t = Instant::now();
            runner.run(&w, &g, 4096, &cuts, out, &mut || Ok(x.set_f32(&data)?)).unwrap();
            steps.push(t.elapsed().as_secs_f64());
        }
        let s = runner.stats().clone();
        let copy = w.stats().copy_nanos as f64 * 1e-9;
        let n = runs as f64;
        let step = steps[1..].iter().sum::<f64>() / (n - 1.0).max(1.0);
        let (compute, copy) = (s.compute_secs / n, copy / n);
        println!(
            "prefetch {:<5}: step {:.1} ms (runs 2..), compute {:.1} ms, copy {:.1} ms, blocking loads {:.1} ms, \
             prefetch waits {:.1} ms per run; step / max(copy, compute) = {:.2}; high-water {:.1} MiB",
            prefetch,
            step * 1e3,
            compute * 1e3,
            copy * 1e3,
            s.load_secs / n * 1e3,
            s.prefetch_wait_secs / n * 1e3,
            step / compute.max(copy),
            ledgers.get("CPU").high_water() as f64 / 1048576.0
        );
    }
}

/// f32 -> IEEE half bits (round to nearest), enough for test values in [-0.5, 0.5].
fn half_bits(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}
