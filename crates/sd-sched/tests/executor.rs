//! The executor on a synthetic model (a stack of identical blocks with random weights), on
//! the real CPU plugin and a real RPC server on loopback: segment boundaries, residency,
//! eviction order, prefetch and the budget, without any SD code.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use sd_backends::{Backend, Context, GgmlType, PluginRegistry, PluginSearch, Tensor};
use sd_sched::plan::Options;
use sd_sched::{Ledgers, ParamHome, Runner, SourceError, TensorSource, TensorSpec, Weights};

const DIM: i64 = 256;
const BLOCKS: usize = 8;
const TOKENS: i64 = 4;

fn registry() -> PluginRegistry {
    PluginRegistry::discover(&PluginSearch::only(vec![PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)]))
}

fn cpu() -> Arc<Backend> {
    static CPU: OnceLock<Arc<Backend>> = OnceLock::new();
    CPU.get_or_init(|| {
        let reg: &'static PluginRegistry = Box::leak(Box::new(registry()));
        let b = Backend::new(reg.device("cpu").unwrap()).unwrap();
        b.set_threads(2);
        Arc::new(b)
    })
    .clone()
}

/// An RPC device served on loopback by this process (one per test binary).
fn rpc() -> Arc<Backend> {
    static RPC: OnceLock<Arc<Backend>> = OnceLock::new();
    RPC.get_or_init(|| {
        let server: &'static PluginRegistry = Box::leak(Box::new(registry()));
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dev = server.device("cpu").unwrap();
        std::thread::spawn(move || sd_backends::rpc::serve(server, "127.0.0.1", port, &[dev], 2, None).unwrap());
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t.elapsed() < Duration::from_secs(10), "the RPC server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(50));
        let client: &'static mut PluginRegistry = Box::leak(Box::new(registry()));
        let devs = client.add_rpc_server(&format!("127.0.0.1:{port}")).unwrap();
        Arc::new(Backend::new(devs[0]).unwrap())
    })
    .clone()
}

/// Deterministic random f32 weights, kept in memory (the "model file").
struct Source(HashMap<String, Vec<u8>>);

impl TensorSource for Source {
    fn load(&self, name: &str, _ty: GgmlType, _ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        self.0.get(name).map(|b| Cow::Borrowed(b.as_slice())).ok_or_else(|| SourceError::new(format!("no `{name}`")))
    }
}

fn specs() -> Vec<TensorSpec> {
    let mut v = vec![TensorSpec { name: "embed.weight".into(), ty: GgmlType::GGML_TYPE_F32, ne: vec![DIM, DIM] }];
    for i in 0..BLOCKS {
        v.push(TensorSpec { name: format!("blocks.{i}.weight"), ty: GgmlType::GGML_TYPE_F32, ne: vec![DIM, DIM] });
        v.push(TensorSpec { name: format!("blocks.{i}.bias"), ty: GgmlType::GGML_TYPE_F32, ne: vec![DIM] });
    }
    v
}

fn source() -> Arc<Source> {
    let mut state = 0x2545F4914F6CDD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    };
    let map = specs()
        .into_iter()
        .map(|s| {
            let n: i64 = s.ne.iter().product();
            let bytes = (0..n).flat_map(|_| next().to_le_bytes()).collect();
            (s.name, bytes)
        })
        .collect();
    Arc::new(Source(map))
}

fn group_of(name: &str) -> String {
    name.rsplit_once('.').map_or(name, |(g, _)| g).to_string()
}

/// e = embed·x, used by every block (a tensor crossing every cut); block i:
/// h = gelu(W_i h + b_i) + e + h.
fn forward<'g>(g: &'g Context, w: &Weights, x: Tensor<'g>) -> (Vec<(String, Tensor<'g>)>, Tensor<'g>) {
    forward_blocks(g, w, x, 0..BLOCKS)
}

/// [`forward`] through the blocks of `blocks` only.
fn forward_blocks<'g>(
    g: &'g Context,
    w: &Weights,
    x: Tensor<'g>,
    blocks: std::ops::Range<usize>,
) -> (Vec<(String, Tensor<'g>)>, Tensor<'g>) {
    let mut cuts = Vec::new();
    let e = g.mul_mat(w.get("embed.weight").unwrap(), x);
    cuts.push(("embed".to_string(), e));
    let mut h = e;
    for i in blocks {
        let y = g.mul_mat(w.get(&format!("blocks.{i}.weight")).unwrap(), h);
        let b = g.reshape(w.get(&format!("blocks.{i}.bias")).unwrap(), &[DIM, 1]);
        let y = g.gelu(g.add(y, b));
        h = g.add(g.add(y, e), h);
        cuts.push((format!("blocks.{i}"), h));
    }
    let out = g.scale(h, 0.5);
    (cuts, out)
}

fn input() -> Vec<f32> {
    (0..DIM * TOKENS).map(|i| ((i * 37 % 101) as f32 / 101.0) - 0.5).collect()
}

/// Runs the model `steps` times with params at `home`, computing on `backend` with the
/// given budget; returns the outputs, the runner and the ledgers.
fn run(
    backend: Arc<Backend>,
    home: ParamHome,
    budget: Option<u64>,
    opts: Options,
    steps: usize,
) -> (Vec<Vec<f32>>, Runner, Ledgers, Weights) {
    let dev = backend.device().name();
    let ledgers = Ledgers::with_budgets(budget.map(|b| HashMap::from([(dev.clone(), b)])).unwrap_or_default());
    let mut w = Weights::new(specs()).unwrap();
    w.place("toy", home, backend.clone(), &ledgers, &group_of, source()).unwrap();
    let mut runner = Runner::with_ledger("toy", backend, ledgers.get(&dev), opts);
    let mut outs = Vec::new();
    for _ in 0..steps {
        let g = Context::for_graph(1024, 1024).unwrap();
        let x = g.new_f32(&[DIM, TOKENS]).set_input();
        let (cuts, out) = forward(&g, &w, x);
        let out = out.set_output();
        let data = input();
        runner.run(&w, &g, 1024, &cuts, out, &mut || Ok(x.set_f32(&data)?)).unwrap();
        outs.push(out.get_f32().unwrap());
    }
    (outs, runner, ledgers, w)
}

const BLOCK_BYTES: u64 = (DIM * DIM * 4 + DIM * 4) as u64;
const MIB: u64 = 1 << 20;

/// A budget that holds the cut buffer (eleven 4 KiB activations), a compute buffer and
/// about three of the nine weight groups.
fn tight_budget() -> u64 {
    3 * BLOCK_BYTES + 128 * 1024
}

fn no_reserve() -> Options {
    Options::default()
}

#[test]
fn every_residency_gives_the_same_numbers_as_params_on_the_device() {
    let (base, r, ..) = run(cpu(), ParamHome::Compute, None, no_reserve(), 1);
    assert_eq!(r.stats().segmented_runs, 0);
    for home in [ParamHome::Host, ParamHome::Disk, ParamHome::Device(rpc())] {
        let desc = home.describe();
        let (outs, r, ..) = run(cpu(), home, None, no_reserve(), 2);
        assert_eq!(outs[0], base[0], "params {desc}");
        assert_eq!(outs[1], base[0], "params {desc}, second run");
        assert_eq!(r.stats().segmented_runs, 0, "no budget: monolithic");
    }
}

#[test]
fn a_budget_smaller_than_the_model_runs_in_segments_within_it() {
    let (base, ..) = run(cpu(), ParamHome::Compute, None, no_reserve(), 1);
    // The scratch reserve and planning headroom apply to free memory and the monolithic
    // choice; with a small explicit budget the budget decides.
    let budget = tight_budget();
    let (outs, r, ledgers, w) = run(rpc(), ParamHome::Host, Some(budget), no_reserve(), 3);
    for o in &outs {
        assert_eq!(o, &base[0], "segmented on RPC = monolithic on the CPU (same kernels)");
    }
    let s = r.stats();
    assert_eq!(s.segmented_runs, 3);
    assert!(s.max_segments > 1, "{s:?}");
    let dev = rpc().device().name();
    let high = ledgers.get(&dev).high_water();
    assert!(high <= budget, "high-water {high} above the budget {budget}");
    assert!(high > 2 * BLOCK_BYTES, "the budget was used: {high}");
    assert!(s.evictions > 0, "{s:?}");
    assert!(s.prefetched_groups > 0, "prefetch on by default: {s:?}");
    // Replicas are evicted lazily, from the last segment backward, so the leading group stays
    // resident across runs, the middle ones were evicted to make room for the tail, and the
    // tail just computed is still there.
    let resident: Vec<String> = ledgers.get(&dev).replicas().into_iter().map(|r| r.group).collect();
    assert!(resident.contains(&"toy/embed".to_string()), "{resident:?}");
    assert!(resident.contains(&"toy/blocks.7".to_string()), "{resident:?}");
    assert!(!resident.contains(&"toy/blocks.3".to_string()), "{resident:?}");
    // Later runs copy less than the whole model: the leading group is not copied again.
    let total = 9 * BLOCK_BYTES;
    assert!(s.loaded_bytes + s.prefetched_bytes < 3 * total, "{s:?}");
    drop(r);
    drop(w);
    assert_eq!(ledgers.get(&dev).managed(), 0, "everything released");
}

#[test]
fn without_prefetch_loads_are_synchronous_and_numbers_unchanged() {
    let (base, ..) = run(cpu(), ParamHome::Compute, None, no_reserve(), 1);
    let opts = Options { disable_prefetch: true, ..Options::default() };
    let (outs, r, ledgers, _w) = run(cpu(), ParamHome::Disk, Some(tight_budget()), opts, 2);
    assert_eq!(outs[1], base[0]);
    assert_eq!(r.stats().prefetched_groups, 0);
    assert!(r.stats().loaded_bytes > 0);
    assert!(ledgers.get(&cpu().device().name()).high_water() <= tight_budget());
}

#[test]
fn disabled_segmentation_runs_whole_or_fails_naming_the_device_and_budget() {
    let opts = Options { disable_segmented_compute: true, ..Options::default() };
    let dev = cpu().device().name();
    let ledgers = Ledgers::with_budgets(HashMap::from([(dev.clone(), tight_budget())]));
    let mut w = Weights::new(specs()).unwrap();
    w.place("toy", ParamHome::Host, cpu(), &ledgers, &group_of, source()).unwrap();
    let mut runner = Runner::with_ledger("toy", cpu(), ledgers.get(&dev), opts);
    let g = Context::for_graph(1024, 1024).unwrap();
    let x = g.new_f32(&[DIM, TOKENS]).set_input();
    let (cuts, out) = forward(&g, &w, x);
    let err = runner.run(&w, &g, 1024, &cuts, out, &mut || Ok(())).unwrap_err().to_string();
    assert!(err.contains(&dev) && err.contains("toy"), "{err}");
    assert_eq!(ledgers.get(&dev).managed(), 0, "nothing left allocated: {err}");

    let (base, ..) = run(cpu(), ParamHome::Compute, None, no_reserve(), 1);
    let (outs, r, ..) = run(cpu(), ParamHome::Host, Some(64 * MIB), opts, 1);
    assert_eq!(outs[0], base[0]);
    assert_eq!(r.stats().segmented_runs, 0);
}

#[test]
fn a_budget_below_one_block_is_a_clear_error() {
    let dev = cpu().device().name();
    let ledgers = Ledgers::with_budgets(HashMap::from([(dev.clone(), BLOCK_BYTES / 2)]));
    let mut w = Weights::new(specs()).unwrap();
    w.place("toy", ParamHome::Host, cpu(), &ledgers, &group_of, source()).unwrap();
    let mut runner = Runner::with_ledger("toy", cpu(), ledgers.get(&dev), Options::default());
    let g = Context::for_graph(1024, 1024).unwrap();
    let x = g.new_f32(&[DIM, TOKENS]).set_input();
    let (cuts, out) = forward(&g, &w, x);
    let err = runner.run(&w, &g, 1024, &cuts, out, &mut || Ok(())).unwrap_err().to_string();
    assert!(err.contains(&dev), "{err}");
    assert!(ledgers.get(&dev).high_water() <= BLOCK_BYTES / 2);
}

/// One graph run of `w` through `blocks` for `tokens` tokens on `runner`: the output.
fn run_blocks(
    runner: &mut Runner,
    w: &Weights,
    blocks: std::ops::Range<usize>,
    tokens: i64,
) -> sd_sched::Result<Vec<f32>> {
    let g = Context::for_graph(1024, 1024).unwrap();
    let x = g.new_f32(&[DIM, tokens]).set_input();
    let (cuts, out) = forward_blocks(&g, w, x, blocks);
    let out = out.set_output();
    let data: Vec<f32> = (0..DIM * tokens).map(|i| ((i * 37 % 101) as f32 / 101.0) - 0.5).collect();
    runner.run(w, &g, 1024, &cuts, out, &mut || Ok(x.set_f32(&data)?))?;
    Ok(out.get_f32()?)
}

/// Two graphs of one weight set reading different blocks (as SDXL's two text encoders are
/// one module, run as two graphs), then another module, on one device under a budget that
/// holds about three groups. The first graph (one token) leaves the device full of its
/// replicas; the second (32 tokens) needs a larger cut buffer, charged before its first
/// segment's planned evictions: the ledger evicts the first graph's idle replicas, least
/// recently used first, to make room. Every output equals the one computed with the
/// parameters on the device and no budget.
#[test]
fn replicas_of_earlier_graphs_and_other_modules_are_evicted_under_pressure() {
    let halves = [0..BLOCKS / 2, BLOCKS / 2..BLOCKS];
    let tokens = [1, 32];
    let expected: Vec<Vec<f32>> = {
        let ledgers = Ledgers::default();
        let mut w = Weights::new(specs()).unwrap();
        w.place("te", ParamHome::Compute, cpu(), &ledgers, &group_of, source()).unwrap();
        let mut r = Runner::with_ledger("te", cpu(), ledgers.get(&cpu().device().name()), Options::default());
        (0..2).map(|h| run_blocks(&mut r, &w, halves[h].clone(), tokens[h]).unwrap()).collect()
    };
    let dev = cpu().device().name();
    let budget = tight_budget();
    let ledgers = Ledgers::with_budgets(HashMap::from([(dev.clone(), budget)]));
    let ledger = ledgers.get(&dev);
    let mut te = Weights::new(specs()).unwrap();
    te.place("te", ParamHome::Host, cpu(), &ledgers, &group_of, source()).unwrap();
    let mut runner = Runner::with_ledger("te", cpu(), ledger.clone(), Options::default());
    for (i, h) in [0, 1, 0, 1].into_iter().enumerate() {
        let out = run_blocks(&mut runner, &te, halves[h].clone(), tokens[h])
            .unwrap_or_else(|e| panic!("graph {i} (blocks {:?}): {e}", halves[h]));
        assert_eq!(out, expected[h], "graph {i} (blocks {:?})", halves[h]);
        assert!(ledger.high_water() <= budget, "graph {i}: high-water {} > {budget}", ledger.high_water());
    }
    let evicted = ledger.evictions();
    assert!(evicted > 0 && ledger.evicted_bytes() >= evicted as u64 * (DIM * DIM * 4) as u64, "evicted {evicted}");
    let te_resident = |l: &sd_sched::Ledger| l.replicas().iter().filter(|r| r.group.starts_with("te/")).count();
    assert!(te_resident(&ledger) > 0, "the last graph's groups stay resident");
    drop(runner);

    // Another module on the device while the first one's replicas are resident: its plan
    // evicts them (another runner's, idle), and the first module stages them again after.
    let mut other = Weights::new(specs()).unwrap();
    other.place("other", ParamHome::Host, cpu(), &ledgers, &group_of, source()).unwrap();
    let mut runner = Runner::with_ledger("other", cpu(), ledger.clone(), Options::default());
    let before = ledger.evictions();
    assert_eq!(run_blocks(&mut runner, &other, halves[1].clone(), tokens[1]).unwrap(), expected[1]);
    assert!(ledger.evictions() > before, "the other module's replicas were evicted");
    assert_eq!(te_resident(&ledger), 0, "{:?}", ledger.replicas());
    drop(runner);
    let mut runner = Runner::with_ledger("te", cpu(), ledger.clone(), Options::default());
    assert_eq!(run_blocks(&mut runner, &te, halves[0].clone(), tokens[0]).unwrap(), expected[0], "staged again");
    assert!(ledger.high_water() <= budget);
    drop((runner, te, other));
    assert_eq!(ledger.managed(), 0, "everything released");
}
