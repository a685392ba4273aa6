//! Matrix products of the CPU plugin with f16 and f32 operands, where this project's AMX
//! kernel (`crates/ggml-sys/patches/cpu-speed/sdrs-f16-amx.cpp`) takes them on a CPU with
//! AMX-BF16, its AVX-512 kernel (`sdrs-gemm-avx512.cpp` there) on a CPU with AVX-512 and no
//! AMX, and ggml's own kernels elsewhere: random shapes (edges of the 16- and 32-row
//! tiles, k not a multiple of 32, broadcast batches, strided rows), 1 to 4 threads, every
//! output compared with an f64 product of the operands as ggml reads them (an f32 src1
//! rounded to f16 for an f16 src0). The bound is f32 accumulation's, plus what the kernel's
//! bf16 splits leave (a wrong tile, row or batch is off by the size of the terms). An f32
//! src0 takes the kernel only where k is not a multiple of 16 (attention's head of 40).

use sd_backends::{Backend, Context, GgmlType, GraphAllocator};

mod common;
use common::{cpu, f16_to_f32, f32_to_f16, Rng};

const F32: GgmlType = GgmlType::GGML_TYPE_F32;
const F16: GgmlType = GgmlType::GGML_TYPE_F16;

#[derive(Clone, Copy, Debug)]
struct Case {
    m: i64,
    n: i64,
    k: i64,
    /// src0's batch; src1's is `b0 * r2`
    b0: i64,
    r2: i64,
    src0: GgmlType,
    src1: GgmlType,
    /// src0 rows this many values apart (>= k: a strided view)
    ld0: i64,
    threads: usize,
}

/// Values as ggml reads them, and their bytes in the tensor's type.
fn values(n: usize, ty: GgmlType, scale: f32, rng: &mut Rng) -> (Vec<f64>, Vec<u8>) {
    let mut vals = Vec::with_capacity(n);
    let mut bytes = Vec::with_capacity(n * 4);
    for _ in 0..n {
        // some exact zeros and some small values among the rest
        let v = match rng.int(0, 9) {
            0 => 0.0,
            1 => rng.val() * scale * 1e-3,
            _ => rng.val() * scale,
        };
        if ty == F16 {
            let h = f32_to_f16(v);
            vals.push(f16_to_f32(h) as f64);
            bytes.extend_from_slice(&h.to_le_bytes());
        } else {
            vals.push(v as f64);
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
    (vals, bytes)
}

/// The product of src0's rows `rows` (of each of its `b0` batches, stored `ld0` values
/// apart) by src1, computed on `threads` threads: the output's shape and values.
fn product(
    backend: &Backend,
    c: &Case,
    w_bytes: &[u8],
    a_bytes: &[u8],
    rows: std::ops::Range<i64>,
    threads: usize,
) -> ([i64; 4], Vec<f32>) {
    let params = Context::for_tensors(2).unwrap();
    let w_store = params.new_tensor(c.src0, &[c.ld0, c.m, c.b0]);
    let a = params.new_tensor(c.src1, &[c.k, c.n, c.b0 * c.r2]);
    let buft = backend.device().buffer_type();
    // SAFETY: `_buf` lives to the end of the function, past every use of the tensors.
    let _buf = unsafe { buft.alloc_ctx_tensors(&params) }.unwrap().unwrap();
    w_store.set_bytes(w_bytes).unwrap();
    a.set_bytes(a_bytes).unwrap();
    let g = Context::for_graph(4, 4).unwrap();
    let row = (c.ld0 * if c.src0 == F16 { 2 } else { 4 }) as usize;
    let (m, b0) = (c.m as usize, c.b0 as usize);
    let share = rows.end - rows.start;
    let w = g.view(w_store, [c.k, share, c.b0, 1], [row, row * m, row * m * b0], row * rows.start as usize);
    let y = g.mul_mat(w, a);
    y.set_output();
    let graph = g.new_graph(4);
    graph.expand(y);
    let mut alloc = GraphAllocator::new(buft);
    // SAFETY: `alloc` lives to the end of the function, past every use of the graph's data.
    unsafe { alloc.alloc_graph(&graph) }.unwrap();
    backend.set_threads(threads);
    backend.compute(&graph).unwrap();
    (y.shape(), y.get_f32().unwrap())
}

fn check(backend: &Backend, c: &Case, rng: &mut Rng) {
    let (s0, s1) = (0.05 + rng.int(0, 40) as f32 * 0.1, 0.1 + rng.int(0, 30) as f32 * 0.1);
    // src0 stored with rows ld0 apart, viewed as [k, m, b0]
    let (w_vals, w_bytes) = values((c.ld0 * c.m * c.b0) as usize, c.src0, s0, rng);
    let (a_vals, a_bytes) = values((c.k * c.n * c.b0 * c.r2) as usize, c.src1, s1, rng);
    let (shape, got) = product(backend, c, &w_bytes, &a_bytes, 0..c.m, c.threads);
    assert_eq!(shape, [c.m, c.n, c.b0 * c.r2, 1], "{c:?}");

    // ggml rounds an f32 src1 to f16 for an f16 src0
    let round_a = c.src0 == F16 && c.src1 == F32;
    // f32 accumulation over k terms, and the kernel's dropped products: below 2^-18 of each
    // term for f16 operands (two bf16 parts), 2^-24 for f32 ones (three parts)
    let rel = if c.src0 == F16 { 8e-6 } else { 2e-6 } + c.k as f64 * 6e-8;
    for b in 0..c.b0 * c.r2 {
        let wb = b / c.r2;
        for n in 0..c.n {
            for m in 0..c.m {
                let (mut sum, mut mag) = (0.0f64, 0.0f64);
                for k in 0..c.k {
                    let wv = w_vals[((wb * c.m + m) * c.ld0 + k) as usize];
                    let mut av = a_vals[((b * c.n + n) * c.k + k) as usize];
                    if round_a {
                        av = f16_to_f32(f32_to_f16(av as f32)) as f64;
                    }
                    sum += wv * av;
                    mag += (wv * av).abs();
                }
                let v = got[((b * c.n + n) * c.m + m) as usize] as f64;
                assert!(
                    (v - sum).abs() <= rel * mag + 1e-30,
                    "{c:?}: batch {b}, row {n}, column {m}: {v}, want {sum} (sum of |terms| {mag})"
                );
            }
        }
    }
}

fn random_case(rng: &mut Rng) -> Case {
    let (src0, src1) = [(F16, F32), (F16, F16), (F32, F32), (F32, F16)][rng.int(0, 3) as usize];
    // near the tile edges (16, 32) and the kernel's thresholds, or anywhere
    let dim = |rng: &mut Rng, hi: i64| match rng.int(0, 2) {
        0 => 16 * rng.int(1, 6) + rng.int(-1, 1),
        _ => rng.int(1, hi),
    };
    let k = match rng.int(0, 3) {
        0 => 32 * rng.int(1, 20) + rng.int(-1, 1), // a k block is 512: some cross it
        1 => 40,                                   // a UNet attention head
        _ => rng.int(1, 200),
    };
    let k = k.max(1);
    let b0 = rng.int(1, 3);
    Case {
        m: dim(rng, 160).max(1),
        n: dim(rng, 300).max(1),
        k,
        b0,
        r2: rng.int(1, 2),
        src0,
        src1,
        ld0: k + if rng.int(0, 3) == 0 { rng.int(1, 9) } else { 0 },
        threads: rng.int(1, 4) as usize,
    }
}

#[test]
fn f16_and_f32_products_match_an_f64_product_on_random_shapes() {
    let backend = cpu();
    let mut rng = Rng(0x00a3_1f16);
    for _ in 0..120 {
        let c = random_case(&mut rng);
        check(&backend, &c, &mut rng);
    }
}

#[test]
fn large_products_of_the_models_shapes_match() {
    // a UNet conv as ggml lays it out (im2col as src0), a linear layer, attention's q.k, ...
    let backend = cpu();
    let mut rng = Rng(0x0bad_cafe);
    for (m, n, k, src0, src1, b0) in [
        (2048, 320, 2880, F16, F16, 1),
        (320, 1024, 1280, F16, F32, 1),
        (300, 77, 40, F32, F32, 4),
        (600, 530, 1100, F16, F32, 1),
        // a VAE conv at 128x128 (many pixels, few output channels), cross-attention's kq.v
        (16384, 130, 1152, F16, F16, 1),
        (40, 1024, 77, F32, F32, 2),
    ] {
        let c = Case { m, n, k, b0, r2: 1, src0, src1, ld0: k, threads: 2 };
        check(&backend, &c, &mut rng);
    }
}

/// Whether this CPU runs one of the project's matrix-product kernels: the AMX one (it reports
/// AMX-BF16, Linux's flag, and `SD_CPU_AMX_F16` does not turn it off) or the AVX-512 one (it
/// reports AVX-512 F, BW and VL, and `SD_CPU_F16_GEMM` does not turn it off).
fn our_kernel_runs() -> bool {
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |f: &str| flags.lines().any(|l| l.starts_with("flags") && l.split_whitespace().any(|x| x == f));
    let on = |var: &str| std::env::var(var).map_or(true, |v| v != "off");
    (has("amx_bf16") && on("SD_CPU_AMX_F16"))
        || (has("avx512f") && has("avx512bw") && has("avx512vl") && on("SD_CPU_F16_GEMM"))
}

#[test]
fn a_row_split_and_any_thread_count_give_the_same_bits() {
    // A row split over devices computes shares of src0's rows apart; the placement tests
    // compare images bit for bit. Shares of 100 rows by 160 activations, and of 400 (over
    // twice src1's rows: the AMX kernel then packs the other side as VNNI tiles), and the small
    // shares the tile edges. 160 activations: the AVX-512 kernel takes f16 products of 128 and
    // more.
    let backend = cpu();
    let mut rng = Rng(0x5eed_5eed);
    let bits = |b: &Backend, c: &Case, w: &[u8], a: &[u8], rows, threads| -> Vec<u32> {
        product(b, c, w, a, rows, threads).1.iter().map(|v| v.to_bits()).collect()
    };
    // ggml's own kernels (a CPU without either of ours) promise no such thing for every shape:
    // on a Zen 4 part the f16 product of rows 0..50 differs from the same rows of the whole in
    // the last bits (the FLUX split tests' shapes do agree there). Their results must still not
    // depend on the thread count.
    let ours = our_kernel_runs();
    for m in [100, 400] {
        for (src0, src1) in [(F16, F32), (F16, F16), (F32, F32)] {
            let c = Case { m, n: 160, k: 600, b0: 1, r2: 1, src0, src1, ld0: 600, threads: 2 };
            let (_, w_bytes) = values((c.k * c.m) as usize, src0, 0.5, &mut rng);
            let (_, a_bytes) = values((c.k * c.n) as usize, src1, 2.0, &mut rng);
            let whole = bits(&backend, &c, &w_bytes, &a_bytes, 0..c.m, 2);
            for threads in [1, 3] {
                assert_eq!(
                    bits(&backend, &c, &w_bytes, &a_bytes, 0..c.m, threads),
                    whole,
                    "{src0:?}: {threads} threads"
                );
            }
            if !ours {
                continue;
            }
            for cut in [50, 7, 93] {
                let (top, bottom) = (
                    bits(&backend, &c, &w_bytes, &a_bytes, 0..cut, 2),
                    bits(&backend, &c, &w_bytes, &a_bytes, cut..c.m, 1),
                );
                for n in 0..c.n as usize {
                    let row = &whole[n * c.m as usize..(n + 1) * c.m as usize];
                    let cut = cut as usize;
                    assert_eq!(&row[..cut], &top[n * cut..(n + 1) * cut], "{src0:?}: rows below {cut}, activation {n}");
                    let rest = c.m as usize - cut;
                    assert_eq!(
                        &row[cut..],
                        &bottom[n * rest..(n + 1) * rest],
                        "{src0:?}: rows from {cut}, activation {n}"
                    );
                }
            }
        }
    }
}
