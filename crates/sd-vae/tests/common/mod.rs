//! Test support: a CPU backend, deterministic random weights, and plain-Rust f64 reference blocks.

#![allow(dead_code)]

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

use half::f16;
use sd_backends::{Backend, GgmlType, PluginRegistry, PluginSearch};
use sd_sched::{Runner, SourceError, TensorSource};

/// A CPU backend with two threads.
fn cpu_backend() -> Arc<Backend> {
    let reg = PluginRegistry::discover(&PluginSearch::only(vec![PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)]));
    let dev = reg.device("cpu").expect("the CPU plugin is built with ggml-sys");
    let b = Backend::new(dev).expect("CPU backend");
    b.set_threads(2);
    Arc::new(b)
}

/// A runner on a fresh CPU backend.
pub fn cpu_runner(name: &str) -> Runner {
    Runner::new(name, cpu_backend())
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn seed_of(name: &str, seed: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// `n` uniform values in [-1, 1) from `seed`.
pub fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed);
    (0..n).map(|_| r.uniform()).collect()
}

/// Deterministic weights from tensor names: norm scales near 1, biases small, matrices
/// scaled by `sqrt(3 / fan_in)` so activations keep their magnitude.
#[derive(Clone, Copy, Debug)]
pub struct RandomSource {
    pub seed: u64,
}

impl RandomSource {
    /// The values of `name` as the model sees them (rounded through `ty`).
    pub fn values(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Vec<f32> {
        let n: i64 = ne.iter().product();
        let mut r = Rng(seed_of(name, self.seed));
        let is_norm = name.contains("norm") && name.ends_with(".weight");
        let fan_in: i64 = if ne.len() >= 2 { ne[..ne.len() - 1].iter().product() } else { 1 };
        let gain = (3.0 / fan_in as f32).sqrt();
        (0..n)
            .map(|_| {
                let u = r.uniform();
                let v = if is_norm {
                    1.0 + 0.2 * u
                } else if name.ends_with(".bias") {
                    0.1 * u
                } else {
                    gain * u
                };
                if ty == GgmlType::GGML_TYPE_F16 {
                    f16::from_f32(v).to_f32()
                } else {
                    v
                }
            })
            .collect()
    }
}

impl TensorSource for RandomSource {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let v = self.values(name, ty, ne);
        let bytes = match ty {
            GgmlType::GGML_TYPE_F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            GgmlType::GGML_TYPE_F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
            other => return Err(SourceError::new(format!("{name}: test source has no type {}", other.0))),
        };
        Ok(Cow::Owned(bytes))
    }
}

/// Max |a - b| and max |b|.
pub fn max_diff(a: &[f32], b: &[f64]) -> (f64, f64) {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let d = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max);
    let m = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    (d, m)
}

/// Plain-Rust f64 versions of the blocks, on planar `[c][h][w]` buffers.
pub mod reference {
    use super::*;

    /// A planar activation.
    #[derive(Clone, Debug)]
    pub struct Act {
        pub w: usize,
        pub h: usize,
        pub c: usize,
        pub data: Vec<f64>,
    }

    impl Act {
        pub fn new(w: usize, h: usize, c: usize, data: Vec<f64>) -> Self {
            assert_eq!(data.len(), w * h * c);
            Self { w, h, c, data }
        }

        pub fn from_f32(w: usize, h: usize, c: usize, data: &[f32]) -> Self {
            Self::new(w, h, c, data.iter().map(|&v| v as f64).collect())
        }

        fn at(&self, c: usize, y: usize, x: usize) -> f64 {
            self.data[(c * self.h + y) * self.w + x]
        }

        fn map(&self, f: impl Fn(f64) -> f64) -> Self {
            Self::new(self.w, self.h, self.c, self.data.iter().map(|&v| f(v)).collect())
        }

        pub fn add(&self, o: &Act) -> Self {
            Self::new(self.w, self.h, self.c, self.data.iter().zip(&o.data).map(|(a, b)| a + b).collect())
        }
    }

    /// The weights as the model holds them.
    pub struct Params<'a> {
        pub src: &'a RandomSource,
    }

    impl Params<'_> {
        fn get(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Vec<f64> {
            self.src.values(name, ty, ne).into_iter().map(|v| v as f64).collect()
        }

        /// A convolution as ggml's im2col path computes it: input rounded to f16, f16 kernel.
        #[allow(clippy::too_many_arguments)]
        pub fn conv(&self, name: &str, x: &Act, out_ch: usize, k: usize, stride: usize, pad: usize, bias: bool) -> Act {
            let kernel = self.get(
                &format!("{name}.weight"),
                GgmlType::GGML_TYPE_F16,
                &[k as i64, k as i64, x.c as i64, out_ch as i64],
            );
            let b = if bias {
                self.get(&format!("{name}.bias"), GgmlType::GGML_TYPE_F32, &[out_ch as i64])
            } else {
                vec![0.0; out_ch]
            };
            let xr = x.map(|v| f16::from_f64(v).to_f64());
            let ow = (x.w + 2 * pad - k) / stride + 1;
            let oh = (x.h + 2 * pad - k) / stride + 1;
            let mut out = vec![0.0; ow * oh * out_ch];
            for oc in 0..out_ch {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut s = 0.0;
                        for ic in 0..x.c {
                            for ky in 0..k {
                                for kx in 0..k {
                                    let iy = (oy * stride + ky) as i64 - pad as i64;
                                    let ix = (ox * stride + kx) as i64 - pad as i64;
                                    if iy < 0 || ix < 0 || iy >= x.h as i64 || ix >= x.w as i64 {
                                        continue;
                                    }
                                    s += xr.at(ic, iy as usize, ix as usize)
                                        * kernel[((oc * x.c + ic) * k + ky) * k + kx];
                                }
                            }
                        }
                        out[(oc * oh + oy) * ow + ox] = s + b[oc];
                    }
                }
            }
            Act::new(ow, oh, out_ch, out)
        }

        /// Group norm with affine parameters.
        pub fn group_norm(&self, name: &str, x: &Act, groups: usize, eps: f64) -> Act {
            let w = self.get(&format!("{name}.weight"), GgmlType::GGML_TYPE_F32, &[x.c as i64]);
            let b = self.get(&format!("{name}.bias"), GgmlType::GGML_TYPE_F32, &[x.c as i64]);
            let cpg = x.c / groups;
            let plane = x.w * x.h;
            let mut out = x.data.clone();
            for g in 0..groups {
                let range = g * cpg * plane..(g + 1) * cpg * plane;
                let n = range.len() as f64;
                let mean = x.data[range.clone()].iter().sum::<f64>() / n;
                let var = x.data[range.clone()].iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
                let inv = 1.0 / (var + eps).sqrt();
                for i in range {
                    let c = i / plane;
                    out[i] = (x.data[i] - mean) * inv * w[c] + b[c];
                }
            }
            Act::new(x.w, x.h, x.c, out)
        }

        /// ResnetBlock without time embedding.
        pub fn resnet(&self, name: &str, x: &Act, out_ch: usize) -> Act {
            let h = self.group_norm(&format!("{name}.norm1"), x, 32, 1e-6).map(silu);
            let h = self.conv(&format!("{name}.conv1"), &h, out_ch, 3, 1, 1, true);
            let h = self.group_norm(&format!("{name}.norm2"), &h, 32, 1e-6).map(silu);
            let h = self.conv(&format!("{name}.conv2"), &h, out_ch, 3, 1, 1, true);
            let skip = if out_ch != x.c {
                self.conv(&format!("{name}.nin_shortcut"), x, out_ch, 1, 1, 0, true)
            } else {
                x.clone()
            };
            h.add(&skip)
        }

        /// AttnBlock with 1x1-convolution projections.
        pub fn attn(&self, name: &str, x: &Act) -> Act {
            let hn = self.group_norm(&format!("{name}.norm"), x, 32, 1e-6);
            let q = self.conv(&format!("{name}.q"), &hn, x.c, 1, 1, 0, true);
            let k = self.conv(&format!("{name}.k"), &hn, x.c, 1, 1, 0, true);
            let v = self.conv(&format!("{name}.v"), &hn, x.c, 1, 1, 0, true);
            let l = x.w * x.h;
            let scale = 1.0 / (x.c as f64).sqrt();
            let mut a = vec![0.0; l * x.c];
            for i in 0..l {
                let logits: Vec<f64> = (0..l)
                    .map(|j| (0..x.c).map(|c| q.data[c * l + i] * k.data[c * l + j]).sum::<f64>() * scale)
                    .collect();
                let m = logits.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = logits.iter().map(|z| (z - m).exp()).collect();
                let s: f64 = e.iter().sum();
                for c in 0..x.c {
                    a[c * l + i] = (0..l).map(|j| e[j] / s * v.data[c * l + j]).sum();
                }
            }
            let a = Act::new(x.w, x.h, x.c, a);
            self.conv(&format!("{name}.proj_out"), &a, x.c, 1, 1, 0, true).add(x)
        }

        /// Nearest x2 then a 3x3 convolution.
        pub fn upsample(&self, name: &str, x: &Act) -> Act {
            let (w, h) = (x.w * 2, x.h * 2);
            let mut d = vec![0.0; w * h * x.c];
            for c in 0..x.c {
                for y in 0..h {
                    for xx in 0..w {
                        d[(c * h + y) * w + xx] = x.at(c, y / 2, xx / 2);
                    }
                }
            }
            self.conv(&format!("{name}.conv"), &Act::new(w, h, x.c, d), x.c, 3, 1, 1, true)
        }

        /// Pad one column and row at the end, 3x3 stride-2 convolution.
        pub fn downsample(&self, name: &str, x: &Act) -> Act {
            let (w, h) = (x.w + 1, x.h + 1);
            let mut d = vec![0.0; w * h * x.c];
            for c in 0..x.c {
                for y in 0..x.h {
                    for xx in 0..x.w {
                        d[(c * h + y) * w + xx] = x.at(c, y, xx);
                    }
                }
            }
            self.conv(&format!("{name}.conv"), &Act::new(w, h, x.c, d), x.c, 3, 2, 0, true)
        }

        /// TAESD block (no skip conv): relu(conv4(relu(conv2(relu(conv0(x))))) + x).
        pub fn tae_block(&self, name: &str, x: &Act) -> Act {
            let h = self.conv(&format!("{name}.conv.0"), x, x.c, 3, 1, 1, true).map(relu);
            let h = self.conv(&format!("{name}.conv.2"), &h, x.c, 3, 1, 1, true).map(relu);
            let h = self.conv(&format!("{name}.conv.4"), &h, x.c, 3, 1, 1, true);
            h.add(x).map(relu)
        }
    }

    pub fn silu(v: f64) -> f64 {
        v / (1.0 + (-v).exp())
    }

    pub fn relu(v: f64) -> f64 {
        v.max(0.0)
    }
}
