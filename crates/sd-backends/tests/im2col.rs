//! The CPU plugin's im2col (sd-rs's kernel, `crates/ggml-sys/patches/cpu-speed.toml`) is
//! bit-identical to a scalar im2col written here: random shapes (channels, odd sizes, stride
//! 1/2, padding 0/1/2, dilation 1/2, batch 1/2, 1-D and 2-D), f32 and f16 inputs, f32 and f16
//! destinations, 1 to 4 threads, each output compared bit for bit through the real plugin.

use sd_backends::{Backend, Context, GgmlType, GraphAllocator};

mod common;
use common::{cpu, f16_to_f32, f32_to_f16, Rng};

const F32: GgmlType = GgmlType::GGML_TYPE_F32;
const F16: GgmlType = GgmlType::GGML_TYPE_F16;

#[derive(Clone, Copy, Debug)]
struct Case {
    is_2d: bool,
    iw: i64,
    ih: i64,
    ic: i64,
    n: i64,
    kw: i64,
    kh: i64,
    s0: i64,
    s1: i64,
    p0: i64,
    p1: i64,
    d0: i64,
    d1: i64,
    src: GgmlType,
    dst: GgmlType,
    threads: usize,
}

impl Case {
    fn ow(&self) -> i64 {
        (self.iw + 2 * self.p0 - self.d0 * (self.kw - 1) - 1) / self.s0 + 1
    }

    fn oh(&self) -> i64 {
        if self.is_2d {
            (self.ih + 2 * self.p1 - self.d1 * (self.kh - 1) - 1) / self.s1 + 1
        } else {
            1
        }
    }
}

/// Input values as the bits of the source type: f32 mixes ordinary values, f16 rounding
/// ties, f16 subnormals and values that overflow f16; f16 is any bit pattern.
fn input_bits(c: &Case, rng: &mut Rng) -> Vec<u32> {
    let len = (c.iw * c.ih * c.ic * c.n) as usize;
    (0..len)
        .map(|_| {
            let r = rng.next();
            if c.src == F16 {
                return (r & 0xffff) as u32;
            }
            let h = (r >> 16) as u16 & 0x7bff | (r as u16 & 0x8000); // a finite f16
            let v = match r % 8 {
                0 => f32::from_bits(f16_to_f32(h).to_bits() | 0x1000), // exactly between two f16s
                1 => ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e-5, // f16 subnormals
                2 => ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0e5, // beyond f16's range
                3 => f32::INFINITY * if r & 1 == 0 { 1.0 } else { -1.0 },
                _ => ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0,
            };
            v.to_bits()
        })
        .collect()
}

/// The scalar im2col: dst `[N, OH, OW, IC*KH*KW]` from src `[N, IC, IH, IW]`, zeros where
/// the kernel reads padding, f32 converted to f16 with `f32_to_f16`.
fn reference(c: &Case, src: &[u32]) -> Vec<u32> {
    let (ow, oh) = (c.ow(), c.oh());
    let k = c.ic * c.kh * c.kw;
    let mut out = vec![0u32; (c.n * oh * ow * k) as usize];
    for n in 0..c.n {
        for y in 0..oh {
            for x in 0..ow {
                for ic in 0..c.ic {
                    for ky in 0..c.kh {
                        for kx in 0..c.kw {
                            let iy = y * c.s1 + ky * c.d1 - c.p1;
                            let ix = x * c.s0 + kx * c.d0 - c.p0;
                            let v = if iy < 0 || iy >= c.ih || ix < 0 || ix >= c.iw {
                                0
                            } else {
                                let s = src[(((n * c.ic + ic) * c.ih + iy) * c.iw + ix) as usize];
                                if c.src == F32 && c.dst == F16 {
                                    f32_to_f16(f32::from_bits(s)) as u32
                                } else {
                                    s
                                }
                            };
                            out[((((n * oh + y) * ow + x) * c.ic + ic) * c.kh * c.kw + ky * c.kw + kx) as usize] = v;
                        }
                    }
                }
            }
        }
    }
    out
}

fn to_bytes(bits: &[u32], ty: GgmlType) -> Vec<u8> {
    if ty == F16 {
        bits.iter().flat_map(|b| (*b as u16).to_le_bytes()).collect()
    } else {
        bits.iter().flat_map(|b| b.to_le_bytes()).collect()
    }
}

fn from_bytes(bytes: &[u8], ty: GgmlType) -> Vec<u32> {
    if ty == F16 {
        bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect()
    } else {
        bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
}

/// Runs `c` through ggml's im2col on `backend` and compares with [`reference`].
fn check(backend: &Backend, c: &Case, rng: &mut Rng) {
    let src = input_bits(c, rng);
    let want = reference(c, &src);
    let params = Context::for_tensors(2).unwrap();
    // im2col reads only the kernel's shape: [KW, KH, IC, OC] (2-D) or [KW, IC, OC] (1-D)
    let (kernel_ne, data_ne) = if c.is_2d {
        (vec![c.kw, c.kh, c.ic, 3], vec![c.iw, c.ih, c.ic, c.n])
    } else {
        (vec![c.kw, c.ic, 3], vec![c.iw, c.ic, c.n])
    };
    let kernel = params.new_tensor(F16, &kernel_ne);
    let data = params.new_tensor(c.src, &data_ne);
    let buft = backend.device().buffer_type();
    // SAFETY: `_buf` lives to the end of the function, past every use of the tensors.
    let _buf = unsafe { buft.alloc_ctx_tensors(&params) }.unwrap().unwrap();
    data.set_bytes(&to_bytes(&src, c.src)).unwrap();

    let g = Context::for_graph(4, 4).unwrap();
    let y = g.im2col(
        kernel,
        data,
        c.s0 as i32,
        c.s1 as i32,
        c.p0 as i32,
        c.p1 as i32,
        c.d0 as i32,
        c.d1 as i32,
        c.is_2d,
        c.dst,
    );
    y.set_output();
    let graph = g.new_graph(4);
    graph.expand(y);
    let mut alloc = GraphAllocator::new(buft);
    // SAFETY: `alloc` lives to the end of the function, past every use of the graph's data.
    unsafe { alloc.alloc_graph(&graph) }.unwrap();
    backend.set_threads(c.threads);
    backend.compute(&graph).unwrap();
    let k = c.ic * c.kh * c.kw;
    let shape = if c.is_2d { [k, c.ow(), c.oh(), c.n] } else { [k, c.ow(), c.n, 1] };
    assert_eq!(y.shape(), shape, "{c:?}");
    let got = from_bytes(&y.read_range(0, y.nbytes()).unwrap(), c.dst);
    assert_eq!(got.len(), want.len(), "{c:?}");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let (pix, col) = (i as i64 / k, i as i64 % k);
        panic!(
            "{c:?}: value {i} (pixel {pix}, column {col}: channel {}, kernel row {}, kernel column {}) is {:#x}, want {:#x}",
            col / (c.kh * c.kw),
            col / c.kw % c.kh,
            col % c.kw,
            got[i],
            want[i]
        );
    }
}

fn random_case(rng: &mut Rng) -> Case {
    loop {
        let is_2d = rng.int(0, 3) != 0;
        let (src, dst) = [(F32, F16), (F16, F16), (F32, F32)][rng.int(0, 2) as usize];
        let mut c = Case {
            is_2d,
            iw: rng.int(1, 37),
            ih: if is_2d { rng.int(1, 19) } else { 1 },
            ic: rng.int(1, 9),
            n: rng.int(1, 2),
            kw: rng.int(1, 4),
            kh: if is_2d { rng.int(1, 3) } else { 1 },
            s0: rng.int(1, 2),
            s1: if is_2d { rng.int(1, 2) } else { 1 },
            p0: rng.int(0, 2),
            p1: if is_2d { rng.int(0, 1) } else { 0 },
            d0: rng.int(1, 2),
            d1: if is_2d { rng.int(1, 2) } else { 1 },
            src,
            dst,
            threads: rng.int(1, 4) as usize,
        };
        if rng.int(0, 2) == 0 {
            // the shape of most of a VAE's and a UNet's convolutions
            let d2 = is_2d as i64;
            (c.kw, c.kh, c.s0, c.s1, c.p0, c.p1, c.d0, c.d1) = (3, 1 + 2 * d2, 1, 1, 1, d2, 1, 1);
        }
        if c.ow() > 0 && c.oh() > 0 {
            return c;
        }
    }
}

#[test]
fn im2col_matches_a_scalar_im2col_bit_for_bit_on_random_shapes() {
    let backend = cpu();
    let mut rng = Rng(0x0012_c001);
    for _ in 0..150 {
        let c = random_case(&mut rng);
        check(&backend, &c, &mut rng);
    }
}

#[test]
fn im2col_matches_on_runs_longer_than_the_kernels_staging_and_on_wide_rows() {
    // Many channels (a run of pixels is cut short by the staging buffer, inside a row) and
    // rows wider than a run: thread ranges and runs start in the middle of rows.
    let backend = cpu();
    let mut rng = Rng(7);
    let base = Case {
        is_2d: true,
        iw: 9,
        ih: 5,
        ic: 700,
        n: 2,
        kw: 3,
        kh: 3,
        s0: 1,
        s1: 1,
        p0: 1,
        p1: 1,
        d0: 1,
        d1: 1,
        src: F32,
        dst: F16,
        threads: 3,
    };
    for c in [
        base,
        Case { iw: 300, ih: 3, ic: 5, threads: 2, ..base },
        Case { iw: 301, ih: 2, ic: 3, s0: 2, d0: 2, p0: 2, threads: 4, ..base },
        Case { ic: 420, src: F32, dst: F32, ..base },
        Case { ic: 520, src: F16, dst: F16, threads: 1, ..base },
    ] {
        check(&backend, &c, &mut rng);
    }
}
