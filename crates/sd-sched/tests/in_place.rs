//! Weights used in place from a source's mapped bytes (`Weights::use_in_place`) on the real CPU
//! plugin: which tensors are mapped (the device's own buffer type, aligned, stored as asked),
//! that products read them as they would a copy, that writes to them are refused, and that
//! their pages are released when the set goes.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use sd_backends::{Backend, BackendError, Context, Device, GgmlType, PluginRegistry, PluginSearch};
use sd_sched::{Ledgers, MappedBytes, ParamHome, Runner, SourceError, TensorSource, TensorSpec, Weights};

fn device() -> Device {
    static REG: OnceLock<PluginRegistry> = OnceLock::new();
    REG.get_or_init(|| PluginRegistry::discover(&PluginSearch::only(vec![PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)])))
        .device("cpu")
        .unwrap()
}

fn cpu() -> Arc<Backend> {
    let b = Backend::new(device()).unwrap().with_extra_buffer_types(true);
    b.set_threads(2);
    Arc::new(b)
}

const K: i64 = 256;
const N: i64 = 64;
const COLS: i64 = 8;

/// Tensors packed into one immovable arena, as a file's map holds them, at the offsets given;
/// `release` calls are logged.
struct Arena {
    bytes: Box<[u8]>,
    at: HashMap<String, (usize, usize, GgmlType)>,
    released: Mutex<Vec<String>>,
}

impl Arena {
    /// `tensors`: name, type, values and byte offset in the arena (at least 32: the 32 bytes
    /// before a mapped tensor belong to the map).
    fn new(tensors: &[(&str, GgmlType, Vec<f32>, usize)]) -> Self {
        let mut packed = Vec::new();
        for (name, ty, values, off) in tensors {
            let b = sd_backends::convert::pack_f32(*ty, values, K).unwrap();
            packed.push((name.to_string(), *ty, b, *off));
        }
        let end = packed.iter().map(|(_, _, b, off)| off + b.len()).max().unwrap_or(0);
        let mut bytes = vec![0u8; end + 64].into_boxed_slice();
        let mut at = HashMap::new();
        for (name, ty, b, off) in packed {
            bytes[off..off + b.len()].copy_from_slice(&b);
            at.insert(name, (off, b.len(), ty));
        }
        Arena { bytes, at, released: Mutex::new(Vec::new()) }
    }

    fn slice(&self, name: &str) -> Option<(&[u8], GgmlType)> {
        self.at.get(name).map(|&(off, len, ty)| (&self.bytes[off..off + len], ty))
    }

    fn released(&self) -> Vec<String> {
        let mut v = self.released.lock().unwrap().clone();
        v.sort();
        v
    }
}

impl TensorSource for Arena {
    fn load(&self, name: &str, ty: GgmlType, _ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        match self.slice(name) {
            Some((b, stored)) if stored == ty => Ok(Cow::Borrowed(b)),
            _ => Err(SourceError::new(format!("no `{name}` as {ty:?}"))),
        }
    }

    fn release(&self, name: &str) {
        self.released.lock().unwrap().push(name.to_string());
    }

    fn mapped(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Option<MappedBytes>, SourceError> {
        let b = self.load(name, ty, ne)?;
        let Cow::Borrowed(b) = b else { unreachable!("the arena only lends") };
        // SAFETY: the arena's boxed bytes never move or change and live as long as the
        // source; every tensor starts at least 32 bytes into them.
        Ok(Some(unsafe { MappedBytes::new(b) }))
    }
}

fn values(seed: u64, n: i64) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn spec(name: &str, ty: GgmlType) -> TensorSpec {
    TensorSpec { name: name.into(), ty, ne: vec![K, N] }
}

/// The arena: `f32` and `f16` aligned, `odd` (f16) at an odd address, `q` a q4_0 matrix (which
/// an AVX2 CPU repacks into its extra buffer type).
fn arena() -> Arc<Arena> {
    let (f32_bytes, f16_bytes) = ((4 * K * N) as usize, (2 * K * N) as usize);
    Arc::new(Arena::new(&[
        ("f32", GgmlType::GGML_TYPE_F32, values(1, K * N), 64),
        ("f16", GgmlType::GGML_TYPE_F16, values(2, K * N), 64 + f32_bytes),
        ("odd", GgmlType::GGML_TYPE_F16, values(3, K * N), 64 + f32_bytes + f16_bytes + 1),
        ("q", GgmlType::GGML_TYPE_Q4_0, values(4, K * N), 128 + f32_bytes + 2 * f16_bytes),
    ]))
}

fn specs() -> Vec<TensorSpec> {
    vec![
        spec("f32", GgmlType::GGML_TYPE_F32),
        spec("f16", GgmlType::GGML_TYPE_F16),
        spec("odd", GgmlType::GGML_TYPE_F16),
        spec("q", GgmlType::GGML_TYPE_Q4_0),
    ]
}

fn data_address(w: &Weights, name: &str) -> usize {
    // SAFETY: a placed tensor of a live set; only its data pointer is read.
    unsafe { (*w.get(name).unwrap().as_raw()).data as usize }
}

/// Every weight times the same input, on `backend`.
fn products(w: &Weights, backend: &Arc<Backend>) -> Vec<Vec<f32>> {
    let mut runner = Runner::new("m", backend.clone());
    let g = Context::for_graph(16, 32).unwrap();
    let x = g.new_f32(&[K, COLS]).set_input();
    let ys: Vec<_> = ["f32", "f16", "odd", "q"].iter().map(|n| g.mul_mat(w.get(n).unwrap(), x).set_output()).collect();
    let graph = g.new_graph(32);
    for &y in &ys {
        graph.expand(y);
    }
    runner.alloc(&graph).unwrap();
    x.set_f32(&values(9, K * COLS)).unwrap();
    runner.compute(&graph).unwrap();
    ys.iter().map(|y| y.get_f32().unwrap()).collect()
}

fn placed(src: &Arc<Arena>, in_place: bool, ledgers: &Ledgers, backend: &Arc<Backend>) -> Weights {
    let mut w = Weights::new(specs()).unwrap();
    w.use_in_place(in_place);
    w.place("m", ParamHome::Compute, backend.clone(), ledgers, &|_| "g".into(), src.clone()).unwrap();
    w
}

#[test]
fn mapped_tensors_in_the_devices_own_buffer_are_used_in_place_and_compute_as_copies() {
    let backend = cpu();
    let src = arena();
    let ledgers = Ledgers::with_budgets(HashMap::new());
    let copied = placed(&src, false, &ledgers, &backend);
    assert_eq!(copied.in_place_totals(), (0, 0));
    let expected = products(&copied, &backend);
    drop(copied);
    src.released.lock().unwrap().clear();

    let w = placed(&src, true, &ledgers, &backend);
    let repacked = w.buffer_types_on(&backend)[3].name() != "CPU";
    let base = src.bytes.as_ptr() as usize;
    let at = |n: &str| base + src.at[n].0;
    assert_eq!(data_address(&w, "f32"), at("f32"), "the f32 matrix is read where the source maps it");
    assert_eq!(data_address(&w, "f16"), at("f16"));
    assert_ne!(data_address(&w, "odd"), at("odd"), "an f16 tensor at an odd address is copied");
    // A q4_0 matrix is mapped when it stays in the plain buffer, copied when repacked.
    assert_eq!(data_address(&w, "q") == at("q"), !repacked, "q4_0 repacked: {repacked}");
    let mapped_bytes = (4 + 2) * (K * N) as u64 + if repacked { 0 } else { (K * N / 32 * 18) as u64 };
    assert_eq!(w.in_place_totals(), (if repacked { 2 } else { 3 }, mapped_bytes));
    // The copied tensors' pages were released after their copy; the mapped ones are in use.
    let copied_names: Vec<String> = if repacked { vec!["odd".into(), "q".into()] } else { vec!["odd".into()] };
    assert_eq!(src.released(), copied_names);
    // The ledger charges mapped weights like copies: they are resident while used.
    assert!(ledgers.get("CPU").high_water() >= mapped_bytes);

    let got = products(&w, &backend);
    for (name, (g, e)) in ["f32", "f16", "odd", "q"].iter().zip(got.iter().zip(&expected)) {
        assert!(g == e, "{name}: in place and copied give different products");
    }

    // Writing a mapped tensor is refused, and its bytes stay as they were.
    let t = w.get("f16").unwrap();
    let err = t.set_bytes(&vec![0u8; t.nbytes()]).unwrap_err();
    assert!(matches!(err, BackendError::ReadOnly { .. }), "{err}");
    assert!(err.to_string().contains("f16"), "{err}");
    assert!(products(&w, &backend)[1] == expected[1], "a refused write changed the weight");
    // A copied one takes writes as before.
    let t = w.get("odd").unwrap();
    t.set_bytes(&vec![0u8; t.nbytes()]).unwrap();

    // Dropping the set releases the mapped tensors' pages.
    drop(w);
    let mut all: Vec<String> = copied_names.clone();
    all.extend(["f16".to_string(), "f32".to_string()]);
    if !repacked {
        all.push("q".into());
    }
    all.sort();
    assert_eq!(src.released(), all);
}

/// The sum of every weight times the same input, run by a runner that stages the set's
/// groups when they live off the device.
fn staged_sum(w: &Weights, backend: &Arc<Backend>) -> Vec<f32> {
    let mut runner = Runner::new("m", backend.clone());
    let g = Context::for_graph(16, 32).unwrap();
    let x = g.new_f32(&[K, COLS]).set_input();
    let mut y = g.mul_mat(w.get("f32").unwrap(), x);
    for n in ["f16", "odd", "q"] {
        y = g.add(y, g.mul_mat(w.get(n).unwrap(), x));
    }
    let y = y.set_output();
    let input = values(9, K * COLS);
    runner.run(w, &g, 32, &[], y, &mut || Ok(x.set_f32(&input)?)).unwrap();
    y.get_f32().unwrap()
}

#[test]
fn parameters_in_ram_are_the_map_and_stage_as_copies_and_disk_never_keeps_it() {
    let backend = cpu();
    let src = arena();
    let ledgers = Ledgers::with_budgets(HashMap::new());
    // Staged replicas keep the device's own buffer type (no repacked q4_0): the reference is
    // a RAM copy of the set's own.
    let copy = |home: ParamHome| {
        let mut w = Weights::new(specs()).unwrap();
        w.place("m", home, backend.clone(), &ledgers, &|_| "g".into(), src.clone()).unwrap();
        assert_eq!(w.in_place_totals(), (0, 0));
        w
    };
    let expected = staged_sum(&copy(ParamHome::Host), &backend);
    assert!(expected.iter().all(|v| v.is_finite()) && expected.iter().any(|&v| v != 0.0));
    src.released.lock().unwrap().clear();
    // In RAM: every tensor's home copy is the map (no alignment or buffer type matters for a
    // home that replicas are copied from), and the staged replicas compute as pinned copies.
    let mut w = Weights::new(specs()).unwrap();
    w.use_in_place(true);
    w.place("m", ParamHome::Host, backend.clone(), &ledgers, &|_| "g".into(), src.clone()).unwrap();
    let all = (4 + 2 + 2) * (K * N) as u64 + (K * N / 32 * 18) as u64;
    assert_eq!(w.in_place_totals(), (4, all));
    assert!(staged_sum(&w, &backend) == expected, "staged from the map, the product differs");
    assert!(src.released().is_empty(), "the map is the RAM copy: nothing released while it is used");
    drop(w);
    assert_eq!(src.released(), ["f16", "f32", "odd", "q"]);
    // On disk: re-read at every staging, the map never kept.
    let mut w = Weights::new(specs()).unwrap();
    w.use_in_place(true);
    w.place("m", ParamHome::Disk, backend.clone(), &ledgers, &|_| "g".into(), src.clone()).unwrap();
    assert_eq!(w.in_place_totals(), (0, 0));
    assert!(staged_sum(&w, &backend) == expected, "from disk, the product differs");
}
