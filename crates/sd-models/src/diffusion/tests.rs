//! Tests of the UNet: parameter tables, storage types, file validation, and every block against plain f64 Rust on the CPU backend.
//!
//! The f64 reference (module `reference`) is written from the LDM PyTorch code, not from
//! the graph code. It reproduces the two roundings ggml's CPU backend applies by design,
//! so that the tolerances can stay tight: an activation entering a product with an f16
//! weight (every convolution, linear layers stored as f16) is rounded to f16, and GELU is
//! looked up in ggml's f16 table (f16 in, f16 out). What remains is f32 accumulation
//! error, about 1e-6 relative per op, far below the 1e-3 tolerances used; a dropped bias
//! (std 0.1 here), a swapped half of the GEGLU or a transposed head layout changes outputs
//! by 10% or more.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use sd_backends::{Backend, Context, GgmlType, PluginRegistry, PluginSearch};
use sd_sched::{Runner, SourceError, TensorSource, TensorSpec, Weights};

use super::blocks::{self, AttnKernel, SpecSink, TransformerShape};
use super::unet::{self, Heads, UNetConfig, UNetModel, PREFIX};
use super::{run_graph, DiffusionError, TensorProblem};
use crate::fixture::{self, Architecture, Component};

const F32: GgmlType = GgmlType::GGML_TYPE_F32;
const F16: GgmlType = GgmlType::GGML_TYPE_F16;
const Q8_0: GgmlType = GgmlType::GGML_TYPE_Q8_0;
const Q4_K: GgmlType = GgmlType::GGML_TYPE_Q4_K;

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

fn backend() -> Arc<Backend> {
    static B: OnceLock<(PluginRegistry, Arc<Backend>)> = OnceLock::new();
    let (_, b) = B.get_or_init(|| {
        let reg = PluginRegistry::discover(&PluginSearch::only(vec![PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)]));
        let dev = reg.device("cpu").expect("the CPU plugin is built");
        let b = Arc::new(Backend::new(dev).expect("CPU backend"));
        b.set_threads(2);
        (reg, b)
    });
    b.clone()
}

fn runner() -> Runner {
    Runner::new("test", backend())
}

/// Serialises the tests that hold a full-size UNet (about 1.7 GB each).
fn big_model_lock() -> std::sync::MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

/// splitmix64.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// `n` uniform values in [-1, 1) from `seed`.
fn uniform(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64).map(|i| ((mix(seed ^ mix(i)) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect()
}

/// Values for a parameter: weights uniform with std 1/sqrt(fan_in), norm gains 1 +- 0.1,
/// biases and norm shifts +- 0.17 (std 0.1).
fn param_values(spec: &TensorSpec) -> Vec<f32> {
    let n: i64 = spec.ne.iter().product();
    let u = uniform(name_seed(&spec.name), n as usize);
    // Norm gains are the only 1-D parameters that are not biases.
    let is_norm = spec.ne.len() == 1 && !spec.name.ends_with(".bias");
    if spec.name.ends_with(".bias") {
        u.iter().map(|v| v * 0.17).collect()
    } else if is_norm {
        u.iter().map(|v| 1.0 + v * 0.17).collect()
    } else {
        let fan_in: i64 = spec.ne[..spec.ne.len() - 1].iter().product();
        let a = (3.0 / fan_in as f32).sqrt();
        u.iter().map(|v| v * a).collect()
    }
}

/// A source holding f32 values by name, converted to the requested type on load.
struct MapSource(HashMap<String, Vec<f32>>);

impl TensorSource for MapSource {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let v = self.0.get(name).ok_or_else(|| SourceError::new(format!("no values for {name}")))?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        sd_backends::convert::convert(F32, ty, &bytes, ne).map(Cow::Owned).map_err(SourceError::new)
    }
}

/// Weights for `specs` with [`param_values`], plus the values as stored (f16-rounded where
/// the storage is f16), in f64 for the reference.
fn make_weights(specs: Vec<TensorSpec>) -> (Weights, Ref) {
    let mut vals = HashMap::new();
    let mut stored = HashMap::new();
    let mut types = HashMap::new();
    for s in &specs {
        let v = param_values(s);
        let st: Vec<f64> = match s.ty {
            F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f64()).collect(),
            F32 => v.iter().map(|&x| x as f64).collect(),
            other => panic!("test weights are f32 or f16, not {other:?}"),
        };
        stored.insert(s.name.clone(), st);
        types.insert(s.name.clone(), s.ty);
        vals.insert(s.name.clone(), v);
    }
    let mut w = Weights::new(specs).unwrap();
    w.allocate(backend().device().buffer_type()).unwrap();
    w.load_from(&MapSource(vals)).unwrap();
    (w, Ref { vals: stored, types })
}

fn input(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    uniform(seed, n).into_iter().map(|v| v * amp).collect()
}

fn rms(v: &[f64]) -> f64 {
    (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt()
}

/// Asserts rms(got - want) <= tol * rms(want) and max |got - want| <= 10 * tol * rms(want).
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(got.iter().all(|g| g.is_finite()), "{what}: non-finite output");
    let scale = rms(want).max(1e-6);
    let err: Vec<f64> = got.iter().zip(want).map(|(&g, &w)| g as f64 - w).collect();
    let (i, max) = err.iter().map(|e| e.abs()).enumerate().fold((0, 0.0), |m, (i, e)| if e > m.1 { (i, e) } else { m });
    let rms_err = rms(&err);
    eprintln!("{what}: rms error {:.2e}, max error {:.2e} (relative to rms {scale:.3e})", rms_err / scale, max / scale);
    assert!(rms_err <= tol * scale, "{what}: rms error {rms_err:.3e} > {tol:e} x rms {scale:.3e}");
    assert!(
        max <= 10.0 * tol * scale,
        "{what}: element {i}: got {}, want {} (error {max:.3e} > 10 x {tol:e} x rms {scale:.3e})",
        got[i],
        want[i]
    );
}

// ---------------------------------------------------------------------------------------
// Plain f64 reference (from the LDM PyTorch modules)
// ---------------------------------------------------------------------------------------

/// A tensor in ggml order: ne = [W, H, C, N] (or [C, L, N, 1] for token rows).
#[derive(Clone, Debug)]
struct T {
    ne: [usize; 4],
    v: Vec<f64>,
}

impl T {
    fn new(ne: [usize; 4], v: Vec<f64>) -> Self {
        assert_eq!(ne.iter().product::<usize>(), v.len());
        T { ne, v }
    }
    fn from_f32(ne: [usize; 4], v: &[f32]) -> Self {
        T::new(ne, v.iter().map(|&x| x as f64).collect())
    }
    fn at(&self, i0: usize, i1: usize, i2: usize, i3: usize) -> f64 {
        self.v[i0 + self.ne[0] * (i1 + self.ne[1] * (i2 + self.ne[2] * i3))]
    }
    fn add(&self, o: &T) -> T {
        assert_eq!(self.ne, o.ne);
        T::new(self.ne, self.v.iter().zip(&o.v).map(|(a, b)| a + b).collect())
    }
    fn map(&self, f: impl Fn(f64) -> f64) -> T {
        T::new(self.ne, self.v.iter().map(|&x| f(x)).collect())
    }
}

fn round16(x: f64) -> f64 {
    half::f16::from_f64(x).to_f64()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// ggml's GELU on the CPU: tanh approximation looked up in an f16 table.
fn gelu_table(x: f64) -> f64 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let x = round16(x);
        round16(0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * x * (1.0 + 0.044715 * x * x)).tanh()))
    }
}

fn group_norm(x: &T, groups: usize, eps: f64, gamma: &[f64], beta: &[f64]) -> T {
    let [w, h, c, n] = x.ne;
    let cg = c / groups;
    let mut out = x.clone();
    for b in 0..n {
        for g in 0..groups {
            let idx: Vec<usize> =
                (g * cg..(g + 1) * cg).flat_map(|ch| (0..w * h).map(move |p| p + w * h * (ch + c * b))).collect();
            let mean = idx.iter().map(|&i| x.v[i]).sum::<f64>() / idx.len() as f64;
            let var = idx.iter().map(|&i| (x.v[i] - mean).powi(2)).sum::<f64>() / idx.len() as f64;
            for &i in &idx {
                let ch = (i / (w * h)) % c;
                out.v[i] = (x.v[i] - mean) / (var + eps).sqrt() * gamma[ch] + beta[ch];
            }
        }
    }
    out
}

fn layer_norm(x: &T, eps: f64, gamma: &[f64], beta: &[f64]) -> T {
    let c = x.ne[0];
    let mut out = x.clone();
    for row in 0..x.v.len() / c {
        let r = &x.v[row * c..(row + 1) * c];
        let mean = r.iter().sum::<f64>() / c as f64;
        let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
        for i in 0..c {
            out.v[row * c + i] = (r[i] - mean) / (var + eps).sqrt() * gamma[i] + beta[i];
        }
    }
    out
}

/// Multi-head attention over token rows: q [C, Lq, N], k/v [C, Lk, N]; head h owns channels h*d..(h+1)*d.
fn attention(q: &T, k: &T, v: &T, heads: usize) -> T {
    let [c, lq, n, _] = q.ne;
    let lk = k.ne[1];
    let d = c / heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; c * lq * n];
    for b in 0..n {
        for h in 0..heads {
            for i in 0..lq {
                let logits: Vec<f64> = (0..lk)
                    .map(|j| (0..d).map(|e| q.at(h * d + e, i, b, 0) * k.at(h * d + e, j, b, 0)).sum::<f64>() * scale)
                    .collect();
                let m = logits.iter().cloned().fold(f64::MIN, f64::max);
                let p: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                let s: f64 = p.iter().sum();
                for e in 0..d {
                    out[(h * d + e) + c * (i + lq * b)] = (0..lk).map(|j| p[j] / s * v.at(h * d + e, j, b, 0)).sum();
                }
            }
        }
    }
    T::new([c, lq, n, 1], out)
}

fn timestep_embedding(t: &[f64], dim: usize) -> T {
    let half = dim / 2;
    let mut out = vec![0.0; dim * t.len()];
    for (b, &ts) in t.iter().enumerate() {
        for j in 0..half {
            let freq = (-(10000f64).ln() * j as f64 / half as f64).exp();
            out[b * dim + j] = (ts * freq).cos();
            out[b * dim + j + half] = (ts * freq).sin();
        }
    }
    T::new([dim, t.len(), 1, 1], out)
}

/// Parameters as stored, and their storage types (an f16 weight rounds its input).
struct Ref {
    vals: HashMap<String, Vec<f64>>,
    types: HashMap<String, GgmlType>,
}

impl Ref {
    fn p(&self, name: &str) -> &[f64] {
        self.vals.get(name).unwrap_or_else(|| panic!("reference: no parameter {name}"))
    }

    fn rounds_input(&self, weight: &str) -> bool {
        self.types[weight] != F32
    }

    /// Linear over ne[0] of token rows.
    fn linear(&self, p: &str, x: &T, bias: bool) -> T {
        let wn = format!("{p}.weight");
        let w = self.p(&wn);
        let inp = x.ne[0];
        let out = w.len() / inp;
        let r16 = self.rounds_input(&wn);
        let rows = x.v.len() / inp;
        let b = bias.then(|| self.p(&format!("{p}.bias")));
        let mut y = vec![0.0; out * rows];
        for r in 0..rows {
            let xr: Vec<f64> = x.v[r * inp..(r + 1) * inp].iter().map(|&v| if r16 { round16(v) } else { v }).collect();
            for o in 0..out {
                y[r * out + o] = (0..inp).map(|i| w[i + inp * o] * xr[i]).sum::<f64>() + b.map_or(0.0, |b| b[o]);
            }
        }
        let mut ne = x.ne;
        ne[0] = out;
        T::new(ne, y)
    }

    /// Conv2d with bias, square kernel, kernel stored [KW, KH, IC, OC]; input rounded to f16.
    fn conv(&self, p: &str, x: &T, stride: usize, pad: usize) -> T {
        let w = self.p(&format!("{p}.weight"));
        let b = self.p(&format!("{p}.bias"));
        let [iw, ih, ic, n] = x.ne;
        let oc = b.len();
        let k = ((w.len() / (ic * oc)) as f64).sqrt() as usize;
        let ow = (iw + 2 * pad - k) / stride + 1;
        let oh = (ih + 2 * pad - k) / stride + 1;
        let xr = x.map(round16);
        let mut y = vec![0.0; ow * oh * oc * n];
        for bn in 0..n {
            for o in 0..oc {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut s = b[o];
                        for i in 0..ic {
                            for ky in 0..k {
                                for kx in 0..k {
                                    let ix = (ox * stride + kx) as isize - pad as isize;
                                    let iy = (oy * stride + ky) as isize - pad as isize;
                                    if ix >= 0 && iy >= 0 && (ix as usize) < iw && (iy as usize) < ih {
                                        s += w[kx + k * (ky + k * (i + ic * o))]
                                            * xr.at(ix as usize, iy as usize, i, bn);
                                    }
                                }
                            }
                        }
                        y[ox + ow * (oy + oh * (o + oc * bn))] = s;
                    }
                }
            }
        }
        T::new([ow, oh, oc, n], y)
    }

    fn gn(&self, p: &str, x: &T) -> T {
        group_norm(x, 32, 1e-6, self.p(&format!("{p}.weight")), self.p(&format!("{p}.bias")))
    }

    fn ln(&self, p: &str, x: &T) -> T {
        layer_norm(x, 1e-5, self.p(&format!("{p}.weight")), self.p(&format!("{p}.bias")))
    }

    fn res_block(&self, p: &str, x: &T, emb: &T) -> T {
        let h = self.gn(&format!("{p}.in_layers.0"), x).map(silu);
        let mut h = self.conv(&format!("{p}.in_layers.2"), &h, 1, 1);
        let e = self.linear(&format!("{p}.emb_layers.1"), &emb.map(silu), true); // [OC, N]
        let [w, hh, oc, n] = h.ne;
        for b in 0..n {
            for c in 0..oc {
                for i in 0..w * hh {
                    h.v[i + w * hh * (c + oc * b)] += e.v[c + oc * b];
                }
            }
        }
        let h = self.gn(&format!("{p}.out_layers.0"), &h).map(silu);
        let h = self.conv(&format!("{p}.out_layers.3"), &h, 1, 1);
        let skip = if self.vals.contains_key(&format!("{p}.skip_connection.weight")) {
            self.conv(&format!("{p}.skip_connection"), x, 1, 0)
        } else {
            x.clone()
        };
        h.add(&skip)
    }

    fn cross_attention(&self, p: &str, x: &T, ctx: &T, heads: usize, flash: bool) -> T {
        let q = self.linear(&format!("{p}.to_q"), x, false);
        let k = self.linear(&format!("{p}.to_k"), ctx, false);
        let v = self.linear(&format!("{p}.to_v"), ctx, false);
        // Flash attention on the CPU takes q, k, v in f16.
        let (q, k, v) = if flash { (q.map(round16), k.map(round16), v.map(round16)) } else { (q, k, v) };
        self.linear(&format!("{p}.to_out.0"), &attention(&q, &k, &v, heads), true)
    }

    fn feed_forward(&self, p: &str, x: &T) -> T {
        let h = self.linear(&format!("{p}.net.0.proj"), x, true);
        let inner = h.ne[0] / 2;
        let rows = h.v.len() / h.ne[0];
        let mut g = Vec::with_capacity(inner * rows);
        for r in 0..rows {
            let row = &h.v[r * 2 * inner..(r + 1) * 2 * inner];
            g.extend((0..inner).map(|i| row[i] * gelu_table(row[inner + i])));
        }
        let mut ne = h.ne;
        ne[0] = inner;
        self.linear(&format!("{p}.net.2"), &T::new(ne, g), true)
    }

    fn transformer_block(&self, p: &str, x: &T, ctx: &T, heads: usize, flash: bool) -> T {
        let h = self.ln(&format!("{p}.norm1"), x);
        let x = self.cross_attention(&format!("{p}.attn1"), &h, &h, heads, flash).add(x);
        let h = self.ln(&format!("{p}.norm2"), &x);
        let x = self.cross_attention(&format!("{p}.attn2"), &h, ctx, heads, flash).add(&x);
        let h = self.ln(&format!("{p}.norm3"), &x);
        self.feed_forward(&format!("{p}.ff"), &h).add(&x)
    }

    /// SpatialTransformer; tokens are pixels in row-major (y, x) order.
    #[allow(clippy::too_many_arguments)]
    fn spatial_transformer(&self, p: &str, x: &T, ctx: &T, heads: usize, depth: usize, linear: bool, flash: bool) -> T {
        let [w, h, c, n] = x.ne;
        let to_tokens = |t: &T| {
            let mut v = vec![0.0; c * w * h * n];
            for b in 0..n {
                for ch in 0..c {
                    for y in 0..h {
                        for xx in 0..w {
                            v[ch + c * ((xx + w * y) + w * h * b)] = t.at(xx, y, ch, b);
                        }
                    }
                }
            }
            T::new([c, w * h, n, 1], v)
        };
        let from_tokens = |t: &T| {
            let mut v = vec![0.0; c * w * h * n];
            for b in 0..n {
                for ch in 0..c {
                    for tok in 0..w * h {
                        v[tok + w * h * (ch + c * b)] = t.at(ch, tok, b, 0);
                    }
                }
            }
            T::new([w, h, c, n], v)
        };
        let hn = self.gn(&format!("{p}.norm"), x);
        let mut tok = if linear {
            self.linear(&format!("{p}.proj_in"), &to_tokens(&hn), true)
        } else {
            to_tokens(&self.conv(&format!("{p}.proj_in"), &hn, 1, 0))
        };
        for d in 0..depth {
            tok = self.transformer_block(&format!("{p}.transformer_blocks.{d}"), &tok, ctx, heads, flash);
        }
        let out = if linear {
            from_tokens(&self.linear(&format!("{p}.proj_out"), &tok, true))
        } else {
            self.conv(&format!("{p}.proj_out"), &from_tokens(&tok), 1, 0)
        };
        out.add(x)
    }

    fn upsample(&self, p: &str, x: &T) -> T {
        let [w, h, c, n] = x.ne;
        let mut v = vec![0.0; 4 * w * h * c * n];
        for b in 0..n {
            for ch in 0..c {
                for y in 0..2 * h {
                    for xx in 0..2 * w {
                        v[xx + 2 * w * (y + 2 * h * (ch + c * b))] = x.at(xx / 2, y / 2, ch, b);
                    }
                }
            }
        }
        self.conv(&format!("{p}.conv"), &T::new([2 * w, 2 * h, c, n], v), 1, 1)
    }

    /// `openaimodel.UNetModel.forward`, written from the PyTorch code (hs stack, cat on channels).
    fn unet(&self, cfg: &UNetConfig, x: &T, t: &[f64], ctx: &T, flash: bool) -> T {
        self.unet_adm(cfg, x, t, ctx, None, flash)
    }

    /// [`Self::unet`] with SDXL's class embedding of `y` ([adm, N]) added to the time
    /// embedding, per-level transformer depths and an optional middle transformer.
    fn unet_adm(&self, cfg: &UNetConfig, x: &T, t: &[f64], ctx: &T, y: Option<&T>, flash: bool) -> T {
        let pre = |s: String| format!("{PREFIX}.{s}");
        let heads = |ch: usize| match cfg.heads {
            Heads::Count(n) => n as usize,
            Heads::Width(d) => ch / d as usize,
        };
        let mc = cfg.model_channels as usize;
        let emb = self.linear(&pre("time_embed.0".into()), &timestep_embedding(t, mc), true).map(silu);
        let mut emb = self.linear(&pre("time_embed.2".into()), &emb, true);
        if let Some(y) = y {
            let label = self.linear(&pre("label_emb.0.0".into()), y, true).map(silu);
            emb = self.linear(&pre("label_emb.0.2".into()), &label, true).add(&emb);
        }
        let st = |p: String, h: &T, ch: usize, level: usize| {
            let rel = p.strip_prefix(&format!("{PREFIX}.")).unwrap().to_string();
            let depth = cfg.depth_overrides.get(&rel).copied().unwrap_or(cfg.transformer_depth[level]);
            self.spatial_transformer(&p, h, ctx, heads(ch), depth, cfg.use_linear_projection, flash)
        };

        let mut hs = Vec::new();
        let mut h = self.conv(&pre("input_blocks.0.0".into()), x, 1, 1);
        hs.push(h.clone());
        let mut ds = 1;
        let mut block = 1;
        for (level, &mult) in cfg.channel_mult.iter().enumerate() {
            for _ in 0..cfg.num_res_blocks {
                h = self.res_block(&pre(format!("input_blocks.{block}.0")), &h, &emb);
                if cfg.attention_resolutions.contains(&ds) {
                    h = st(pre(format!("input_blocks.{block}.1")), &h, mult as usize * mc, level);
                }
                hs.push(h.clone());
                block += 1;
            }
            if level + 1 != cfg.channel_mult.len() {
                h = self.conv(&pre(format!("input_blocks.{block}.0.op")), &h, 2, 1);
                hs.push(h.clone());
                block += 1;
                ds *= 2;
            }
        }
        let top = *cfg.channel_mult.last().unwrap() as usize * mc;
        h = self.res_block(&pre("middle_block.0".into()), &h, &emb);
        if cfg.middle_transformer {
            h = st(pre("middle_block.1".into()), &h, top, cfg.channel_mult.len() - 1);
            h = self.res_block(&pre("middle_block.2".into()), &h, &emb);
        }
        let mut block = 0;
        for (level, &mult) in cfg.channel_mult.iter().enumerate().rev() {
            for i in 0..=cfg.num_res_blocks {
                let skip = hs.pop().unwrap();
                let [w, hh, c1, n] = h.ne;
                let c2 = skip.ne[2];
                let mut cat = vec![0.0; w * hh * (c1 + c2) * n];
                for b in 0..n {
                    let dst = &mut cat[w * hh * (c1 + c2) * b..w * hh * (c1 + c2) * (b + 1)];
                    dst[..w * hh * c1].copy_from_slice(&h.v[w * hh * c1 * b..w * hh * c1 * (b + 1)]);
                    dst[w * hh * c1..].copy_from_slice(&skip.v[w * hh * c2 * b..w * hh * c2 * (b + 1)]);
                }
                h = self.res_block(&pre(format!("output_blocks.{block}.0")), &T::new([w, hh, c1 + c2, n], cat), &emb);
                let mut sub = 1;
                if cfg.attention_resolutions.contains(&ds) {
                    h = st(pre(format!("output_blocks.{block}.1")), &h, mult as usize * mc, level);
                    sub = 2;
                }
                if level > 0 && i == cfg.num_res_blocks {
                    h = self.upsample(&pre(format!("output_blocks.{block}.{sub}")), &h);
                    ds /= 2;
                }
                block += 1;
            }
        }
        let h = self.gn(&pre("out.0".into()), &h).map(silu);
        self.conv(&pre("out.2".into()), &h, 1, 1)
    }
}

// ---------------------------------------------------------------------------------------
// Parameter tables and storage types
// ---------------------------------------------------------------------------------------

fn f16_file(_: &str) -> Option<GgmlType> {
    Some(F16)
}

fn param_count(specs: &[TensorSpec]) -> i64 {
    specs.iter().map(|s| s.ne.iter().product::<i64>()).sum()
}

#[test]
fn parameter_counts_match_the_published_figures() {
    // Published UNet sizes: SD 1.5 859,520,964 and SD 2.1 865,910,724 parameters.
    assert_eq!(param_count(&unet::unet_specs(&UNetConfig::sd15(), &f16_file, None)), 859_520_964);
    assert_eq!(param_count(&unet::unet_specs(&UNetConfig::sd21(), &f16_file, None)), 865_910_724);
    // SDXL base 1.0's UNet: 2,567,463,684.
    assert_eq!(param_count(&unet::unet_specs(&UNetConfig::sdxl(), &f16_file, None)), 2_567_463_684);
}

#[test]
fn specs_match_the_fixture_tables_name_for_name() {
    // The fixture walks the PyTorch module tree independently (PyTorch order shapes).
    for (arch, cfg) in
        [(Architecture::sd15(), UNetConfig::sd15()), (Architecture::sd2(fixture::Prediction::V), UNetConfig::sd21())]
    {
        let table = fixture::tensor_table(&arch.only(&[Component::Diffusion])).unwrap();
        let mut want: Vec<(String, Vec<i64>)> =
            table.iter().map(|t| (t.name.clone(), t.shape.iter().rev().map(|&d| d as i64).collect())).collect();
        let mut got: Vec<(String, Vec<i64>)> =
            unet::unet_specs(&cfg, &f16_file, None).into_iter().map(|s| (s.name, s.ne)).collect();
        want.sort();
        got.sort();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g, w);
        }
    }
}

fn ty_of(specs: &[TensorSpec], name: &str) -> GgmlType {
    specs.iter().find(|s| s.name == format!("{PREFIX}.{name}")).unwrap_or_else(|| panic!("no {name}")).ty
}

#[test]
fn storage_types_follow_the_reference_rules() {
    let attn = "input_blocks.1.1.transformer_blocks.0.attn1";
    // (file type, --type, tensor, expected storage)
    let cases: &[(GgmlType, Option<GgmlType>, &str, GgmlType)] = &[
        // Convolution kernels are f16 whatever the file or --type says.
        (F32, None, "input_blocks.0.0.weight", F16),
        (F16, Some(Q8_0), "input_blocks.1.0.in_layers.2.weight", F16),
        (F16, Some(F32), "input_blocks.1.1.proj_in.weight", F16),
        // Biases and norms are f32.
        (F16, None, "input_blocks.1.0.in_layers.2.bias", F32),
        (F16, Some(Q8_0), &format!("{attn}.to_out.0.bias"), F32),
        (F16, Some(Q8_0), "input_blocks.1.1.transformer_blocks.0.norm1.weight", F32),
        (F16, None, "out.0.weight", F32),
        // Linear weights: the file's type, or --type where it applies.
        (F16, None, &format!("{attn}.to_q.weight"), F16),
        (F32, None, &format!("{attn}.to_q.weight"), F32),
        (F16, Some(Q8_0), &format!("{attn}.to_q.weight"), Q8_0),
        (F16, Some(F32), &format!("{attn}.to_q.weight"), F32),
        (Q8_0, None, "input_blocks.1.0.emb_layers.1.weight", Q8_0),
        // --type leaves time_embed alone.
        (F16, Some(Q8_0), "time_embed.0.weight", F16),
        (F32, Some(F16), "time_embed.2.weight", F32),
        // q4_K blocks are 256 wide: 320-wide rows stay as in the file, 1280-wide rows convert.
        (F16, Some(Q4_K), &format!("{attn}.to_q.weight"), F16),
        (F16, Some(Q4_K), "input_blocks.1.0.emb_layers.1.weight", Q4_K),
    ];
    for (file, wtype, name, want) in cases {
        let file = *file;
        let specs = unet::unet_specs(&UNetConfig::sd15(), &move |_| Some(file), *wtype);
        assert_eq!(ty_of(&specs, name), *want, "{name} with file {file:?} and --type {wtype:?}");
    }
    // SD 2.x projections are linear layers and follow the linear rule.
    let specs = unet::unet_specs(&UNetConfig::sd21(), &f16_file, Some(Q8_0));
    assert_eq!(ty_of(&specs, "input_blocks.1.1.proj_in.weight"), Q8_0);
    // A tensor the file lacks is f32 and not overridden.
    assert_eq!(crate::wtype::linear_weight_type("x.weight", 320, None, Some(Q8_0)), F32);
}

#[test]
fn config_adapts_to_the_file_like_the_reference() {
    let specs = unet::unet_specs(&UNetConfig::sd21(), &f16_file, None);
    let shapes: HashMap<String, Vec<u64>> =
        specs.iter().map(|s| (s.name.clone(), s.ne.iter().map(|&d| d as u64).collect())).collect();
    // Starting from the SD 1.x preset, an SD 2.x file's shapes give the SD 2.x widths.
    let cfg = UNetConfig::sd15().adapted_to_file(&|n| shapes.get(n).cloned());
    assert_eq!(cfg.context_dim, 1024);
    assert!(cfg.use_linear_projection);
    // An inpainting-style stem with 9 input channels.
    let mut shapes9 = shapes.clone();
    shapes9.insert(format!("{PREFIX}.input_blocks.0.0.weight"), vec![3, 3, 9, 320]);
    assert_eq!(UNetConfig::sd21().adapted_to_file(&|n| shapes9.get(n).cloned()).in_channels, 9);
}

#[test]
fn file_validation_names_missing_and_misshapen_tensors() {
    let specs = unet::unet_specs(&UNetConfig::sd15(), &f16_file, None);
    let mut file: Vec<(String, Vec<u64>)> =
        specs.iter().map(|s| (s.name.clone(), s.ne.iter().map(|&d| d as u64).collect())).collect();
    // A bias stored as [320, 1] still matches; an unknown tensor is reported as extra.
    let bias = file.iter_mut().find(|(n, _)| n.ends_with("input_blocks.1.0.in_layers.2.bias")).unwrap();
    bias.1.push(1);
    file.push((format!("{PREFIX}.some.buffer"), vec![4]));
    assert_eq!(unet::validate_against_file(&specs, &file).unwrap(), vec![format!("{PREFIX}.some.buffer")]);

    let missing = format!("{PREFIX}.middle_block.1.proj_out.weight");
    let wrong = format!("{PREFIX}.output_blocks.2.1.conv.weight");
    file.retain(|(n, _)| *n != missing);
    file.iter_mut().find(|(n, _)| *n == wrong).unwrap().1 = vec![3, 3, 1280, 640];
    match unet::validate_against_file(&specs, &file) {
        Err(DiffusionError::WeightsMismatch { problems, .. }) => {
            assert_eq!(problems.len(), 2);
            assert!(
                problems.contains(&TensorProblem::Missing { name: missing.clone(), expected: vec![1, 1, 1280, 1280] })
            );
            assert!(problems.contains(&TensorProblem::Shape {
                name: wrong.clone(),
                expected: vec![3, 3, 1280, 1280],
                found: vec![3, 3, 1280, 640]
            }));
            let msg = DiffusionError::WeightsMismatch { model: "UNet", problems }.to_string();
            assert!(msg.contains(&missing) && msg.contains(&wrong), "{msg}");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn invalid_configs_are_errors() {
    let cfg = UNetConfig { model_channels: 48, ..UNetConfig::sd15() };
    assert!(matches!(cfg.validate(), Err(DiffusionError::Config { .. })));
    let cfg = UNetConfig { heads: Heads::Width(48), ..UNetConfig::sd15() };
    assert!(cfg.validate().unwrap_err().to_string().contains("does not divide"));
}

// ---------------------------------------------------------------------------------------
// Blocks against the f64 reference
// ---------------------------------------------------------------------------------------

#[test]
fn timestep_embedding_matches() {
    let t = [999.0f32, 1.0, 500.5];
    let (got, shape) =
        run_graph(&mut runner(), &[(&[3], &t)], 64, |g, i| Ok(g.timestep_embedding(i[0], 320, 10000))).unwrap();
    assert_eq!(shape, [320, 3, 1, 1]);
    let want = timestep_embedding(&t.map(|v| v as f64), 320);
    // f32 arguments of up to ~1000 radians carry ~6e-5 absolute error into cos/sin.
    assert_close("timestep embedding", &got, &want.v, 2e-4);
}

/// Specs and weights for one block declared by `declare` under `p`.
fn block_weights(declare: impl FnOnce(&mut SpecSink<'_>), file: GgmlType) -> (Weights, Ref) {
    let dtype = move |_: &str| Some(file);
    let mut s = SpecSink::new(&dtype, None);
    declare(&mut s);
    make_weights(s.specs)
}

#[test]
fn linear_conv_and_group_norm_match() {
    for file in [F32, F16] {
        let (w, r) = block_weights(
            |s| {
                s.linear("lin", 64, 48, true);
                s.conv2d("conv", 32, 64, 3);
                s.norm("gn", 64);
            },
            file,
        );
        // Linear: rows of 64, 5 rows.
        let x = input(1, 64 * 5, 1.0);
        let (got, _) =
            run_graph(&mut runner(), &[(&[64, 5], &x)], 64, |g, i| blocks::linear(g, &w, "lin", i[0], true)).unwrap();
        assert_close(
            &format!("linear ({file:?} weights)"),
            &got,
            &r.linear("lin", &T::from_f32([64, 5, 1, 1], &x), true).v,
            1e-5,
        );

        // Conv 3x3 on a non-square 7x5 image, stride 1 and 2, then GroupNorm.
        let x = input(2, 7 * 5 * 32 * 2, 1.0);
        let xt = T::from_f32([7, 5, 32, 2], &x);
        for (stride, pad) in [(1, 1), (2, 1)] {
            let (got, shape) = run_graph(&mut runner(), &[(&[7, 5, 32, 2], &x)], 64, |g, i| {
                let y = blocks::conv2d(g, &w, "conv", i[0], stride, pad)?;
                blocks::group_norm32(g, &w, "gn", y)
            })
            .unwrap();
            let want = r.gn("gn", &r.conv("conv", &xt, stride as usize, pad as usize));
            assert_eq!(shape, [want.ne[0] as i64, want.ne[1] as i64, 64, 2]);
            assert_close(&format!("conv s{stride} + group norm"), &got, &want.v, 1e-4);
        }
    }
}

#[test]
fn attention_matches_plain_and_flash() {
    // 2 samples, 4 heads of width 16, 6 queries, 5 keys.
    let (c, lq, lk, n, heads) = (64usize, 6usize, 5usize, 2usize, 4i64);
    let q = input(3, c * lq * n, 1.5);
    let k = input(4, c * lk * n, 1.5);
    let v = input(5, c * lk * n, 1.0);
    let to_t = |ne: [usize; 4], d: &[f32]| T::from_f32(ne, d);
    let want = attention(&to_t([c, lq, n, 1], &q), &to_t([c, lk, n, 1], &k), &to_t([c, lk, n, 1], &v), heads as usize);
    let want16 = attention(
        &to_t([c, lq, n, 1], &q).map(round16),
        &to_t([c, lk, n, 1], &k).map(round16),
        &to_t([c, lk, n, 1], &v).map(round16),
        heads as usize,
    );
    let (ci, lqi, lki, ni) = (c as i64, lq as i64, lk as i64, n as i64);
    for (kernel, want, tol) in [
        (AttnKernel::Plain, &want, 1e-5),
        (AttnKernel::Flash, &want16, 3e-3),
        (AttnKernel::FlashWhereSupported(backend().device()), &want16, 3e-3),
    ] {
        let (got, shape) = run_graph(
            &mut runner(),
            &[(&[ci, lqi, ni], &q), (&[ci, lki, ni], &k), (&[ci, lki, ni], &v)],
            64,
            |g, i| Ok(blocks::attention(g, i[0], i[1], i[2], heads, kernel)),
        )
        .unwrap();
        assert_eq!(shape, [ci, lqi, ni, 1]);
        // Flash attention accumulates V in f16 on the CPU: ~1e-3 relative.
        assert_close(&format!("attention {kernel:?}"), &got, &want.v, tol);
    }
}

#[test]
fn res_block_matches_with_and_without_skip_conv() {
    for (inp, out) in [(32i64, 64i64), (64, 64)] {
        let (w, r) = block_weights(|s| blocks::res_block_specs(s, "rb", inp, out, 96), F16);
        let x = input(6, 6 * 4 * inp as usize * 2, 1.0);
        let emb = input(7, 96 * 2, 1.0);
        let (got, shape) = run_graph(&mut runner(), &[(&[6, 4, inp, 2], &x), (&[96, 2], &emb)], 256, |g, i| {
            blocks::res_block(g, &w, "rb", i[0], i[1])
        })
        .unwrap();
        assert_eq!(shape, [6, 4, out, 2]);
        let want = r.res_block("rb", &T::from_f32([6, 4, inp as usize, 2], &x), &T::from_f32([96, 2, 1, 1], &emb));
        assert_close(&format!("ResBlock {inp}->{out}"), &got, &want.v, 1e-4);
    }
}

#[test]
fn spatial_transformer_matches_conv_and_linear_projections() {
    let ctx_dim = 24i64;
    for (file, linear_proj, kernel, tol) in [
        (F32, true, AttnKernel::Plain, 5e-5),
        (F16, false, AttnKernel::Plain, 1e-3),
        (F16, true, AttnKernel::Plain, 1e-3),
        (F16, false, AttnKernel::Flash, 2e-3),
    ] {
        let shape = TransformerShape { channels: 64, n_head: 2, depth: 2, context_dim: ctx_dim, linear_proj };
        let (w, r) = block_weights(|s| blocks::spatial_transformer_specs(s, "st", &shape), file);
        let x = input(8, 5 * 3 * 64 * 2, 1.0);
        let ctx = input(9, ctx_dim as usize * 7 * 2, 1.0);
        let (got, out_shape) =
            run_graph(&mut runner(), &[(&[5, 3, 64, 2], &x), (&[ctx_dim, 7, 2], &ctx)], 1024, |g, i| {
                blocks::spatial_transformer(g, &w, "st", i[0], i[1], &shape, kernel)
            })
            .unwrap();
        assert_eq!(out_shape, [5, 3, 64, 2]);
        let want = r.spatial_transformer(
            "st",
            &T::from_f32([5, 3, 64, 2], &x),
            &T::from_f32([ctx_dim as usize, 7, 2, 1], &ctx),
            2,
            2,
            linear_proj,
            kernel == AttnKernel::Flash,
        );
        assert_close(&format!("SpatialTransformer {file:?} linear={linear_proj} {kernel:?}"), &got, &want.v, tol);
    }
}

#[test]
fn up_and_down_sampling_match() {
    let (w, r) = block_weights(
        |s| {
            blocks::upsample_specs(s, "up", 32);
            blocks::downsample_specs(s, "down", 32);
        },
        F16,
    );
    let x = input(10, 3 * 2 * 32, 1.0);
    let xt = T::from_f32([3, 2, 32, 1], &x);
    let (got, shape) =
        run_graph(&mut runner(), &[(&[3, 2, 32, 1], &x)], 64, |g, i| blocks::upsample(g, &w, "up", i[0])).unwrap();
    assert_eq!(shape, [6, 4, 32, 1]);
    assert_close("upsample", &got, &r.upsample("up", &xt).v, 1e-4);
    let (got, shape) =
        run_graph(&mut runner(), &[(&[3, 2, 32, 1], &x)], 64, |g, i| blocks::downsample(g, &w, "down", i[0])).unwrap();
    assert_eq!(shape, [2, 1, 32, 1]);
    assert_close("downsample", &got, &r.conv("down.op", &xt, 2, 1).v, 1e-4);
}

/// A small UNet with every kind of block: two levels, attention at both, 2 heads.
fn tiny(linear: bool) -> UNetConfig {
    UNetConfig {
        model_channels: 32,
        time_embed_dim: 128,
        channel_mult: vec![1, 2],
        num_res_blocks: 1,
        attention_resolutions: vec![1, 2],
        transformer_depth: vec![1, 1],
        heads: Heads::Count(2),
        context_dim: 24,
        use_linear_projection: linear,
        ..UNetConfig::sd15()
    }
}

#[test]
fn tiny_unet_matches_the_reference_end_to_end() {
    for (linear, flash) in [(false, false), (true, false), (true, true)] {
        let cfg = tiny(linear);
        let (w, r) = make_weights(unet::unet_specs(&cfg, &f16_file, None));
        let model = UNetModel { cfg: cfg.clone(), weights: w, flash_attn: flash };
        let (wd, ht, n, l) = (6usize, 4usize, 2usize, 5usize);
        let x = input(11, wd * ht * 4 * n, 1.0);
        let t = [999.0f32, 17.0];
        // One context for the whole batch: repeated per sample inside the graph.
        let ctx = input(12, 24 * l, 1.0);
        let got = model.eval(&mut runner(), &x, (wd, ht), &t, &ctx, l, n).unwrap();
        let ctx_t = T::from_f32([24, l, 1, 1], &ctx);
        let ctx2 = T::new([24, l, n, 1], [ctx_t.v.clone(), ctx_t.v.clone()].concat());
        let want = r.unet(&cfg, &T::from_f32([wd, ht, 4, n], &x), &t.map(|v| v as f64), &ctx2, flash);

        // The noise floor: f16 rounding inside the network amplifies tiny differences (an
        // activation on the other side of an f16 rounding boundary moves by one f16 ulp,
        // and that difference crosses more boundaries downstream). Moving the input by one
        // part in a million changes ggml's own output by about 1e-3 of its rms; the f64
        // reference, whose activations differ from ggml's f32 ones by such amounts, cannot
        // agree better. A real error (a dropped bias, a misordered skip or head) is 1e-2
        // or more.
        let x2: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * (1.0 + 1e-6 * ((i % 7) as f32 - 3.0))).collect();
        let moved = model.eval(&mut runner(), &x2, (wd, ht), &t, &ctx, l, n).unwrap();
        let noise = rms(&got.iter().zip(&moved).map(|(a, b)| (a - b) as f64).collect::<Vec<_>>()) / rms(&want.v);
        let what = format!("tiny UNet linear={linear} flash={flash} (noise floor {noise:.2e})");
        assert_close(&what, &got, &want.v, 3e-3);
        let err = rms(&got.iter().zip(&want.v).map(|(&a, b)| a as f64 - b).collect::<Vec<_>>()) / rms(&want.v);
        assert!(err <= 3.0 * noise.max(1e-4), "{what}: error {err:.2e} is more than 3x the noise floor");
    }
}

/// A small SDXL-shaped UNet: class embedding, no attention at the first level, depths 1 and 2
/// per level, a distilled-style depth override, with and without the middle transformer.
fn tiny_sdxl(middle_transformer: bool) -> UNetConfig {
    let mut cfg = UNetConfig {
        transformer_depth: vec![1, 2],
        attention_resolutions: vec![2],
        adm_in_channels: Some(10),
        middle_transformer,
        use_linear_projection: true,
        ..tiny(true)
    };
    // output_blocks.0.1 at the deepest level: depth 1 instead of 2, as SSD-1B drops blocks.
    cfg.depth_overrides.insert("output_blocks.0.1".into(), 1);
    cfg
}

#[test]
fn tiny_sdxl_unet_matches_the_reference_end_to_end() {
    for middle in [true, false] {
        let cfg = tiny_sdxl(middle);
        let (w, r) = make_weights(unet::unet_specs(&cfg, &f16_file, None));
        let model = UNetModel { cfg: cfg.clone(), weights: w, flash_attn: false };
        let (wd, ht, n, l) = (6usize, 4usize, 2usize, 5usize);
        let x = input(21, wd * ht * 4 * n, 1.0);
        let t = [999.0f32, 17.0];
        let ctx = input(22, 24 * l * n, 1.0);
        let y = input(23, 10 * n, 1.0);
        let got = model.eval_adm(&mut runner(), &x, (wd, ht), &t, &ctx, l, n, &y).unwrap();
        let want = r.unet_adm(
            &cfg,
            &T::from_f32([wd, ht, 4, n], &x),
            &t.map(|v| v as f64),
            &T::from_f32([24, l, n, 1], &ctx),
            Some(&T::from_f32([10, n, 1, 1], &y)),
            false,
        );
        assert_close(&format!("tiny SDXL UNet (middle transformer {middle})"), &got, &want.v, 3e-3);
        // The class embedding is used: another vector gives another output.
        let y2: Vec<f32> = y.iter().map(|v| -v).collect();
        let other = model.eval_adm(&mut runner(), &x, (wd, ht), &t, &ctx, l, n, &y2).unwrap();
        assert!(got.iter().zip(&other).any(|(a, b)| (a - b).abs() > 1e-3), "the ADM vector changed nothing");
        // A wrong vector length is an input error, not a crash.
        let e = model.eval_adm(&mut runner(), &x, (wd, ht), &t, &ctx, l, n, &y[..10]).unwrap_err().to_string();
        assert!(e.contains("ADM vector has 10 values"), "{e}");
    }
}

#[test]
fn depths_come_from_the_file_names() {
    // A file whose transformers are shallower than the config (a distilled SDXL): the
    // adapted config follows the file, and its specs are exactly the file's tensors.
    let want = tiny_sdxl(false);
    let file: std::collections::HashMap<String, Vec<u64>> = unet::unet_specs(&want, &f16_file, None)
        .into_iter()
        .map(|s| (s.name, s.ne.iter().map(|&d| d as u64).collect()))
        .collect();
    let start = UNetConfig { depth_overrides: Default::default(), middle_transformer: true, ..want.clone() };
    let got = start.adapted_to_file(&|n| file.get(n).cloned());
    assert_eq!(got.depth_overrides, want.depth_overrides);
    assert!(!got.middle_transformer);
    assert_eq!(got.adm_in_channels, Some(10));
    let names = |c: &UNetConfig| {
        let mut v: Vec<String> = unet::unet_specs(c, &f16_file, None).into_iter().map(|s| s.name).collect();
        v.sort();
        v
    };
    assert_eq!(names(&got), names(&want));
}

#[test]
fn deep_transformer_stacks_are_cut_per_block_and_staged_per_block() {
    // Depth 2 at the second level: one cut inside each of its transformers, and the second
    // transformer block is a parameter group of its own (SD's depth-1 stacks are unchanged).
    let cfg = tiny_sdxl(true);
    let g = Context::for_graph(unet::GRAPH_SIZE, unet::GRAPH_SIZE).unwrap();
    let names: Vec<String> = unet::layout(&cfg)
        .blocks()
        .flat_map(|b| b.layers.iter())
        .filter_map(|(p, l)| match l {
            unet::Layer::Transformer(t) if t.depth > 1 => {
                Some(p.strip_prefix("model.diffusion_model.").unwrap().to_string())
            }
            _ => None,
        })
        .collect();
    assert!(!names.is_empty());
    let x = g.new_f32(&[4, 4, 4, 1]);
    let t = g.new_f32(&[1]);
    let c = g.new_f32(&[24, 3, 1]);
    let y = g.new_f32(&[10, 1]);
    let (w2, _) = make_weights(unet::unet_specs(&cfg, &f16_file, None));
    let mut cuts = Vec::new();
    unet::forward_adm(&g, &w2, &cfg, x, t, c, y, false, &mut cuts).unwrap();
    let cut_names: Vec<&str> = cuts.iter().map(|(n, _)| n.as_str()).collect();
    for n in &names {
        let inner = format!("{n}.transformer_blocks.0");
        let at =
            cut_names.iter().position(|c| *c == inner).unwrap_or_else(|| panic!("no cut {inner} in {cut_names:?}"));
        // ... and it comes before the cut closing its block.
        let block: String = n.rsplit_once('.').unwrap().0.to_string();
        assert!(cut_names[at + 1..].contains(&block.as_str()), "{inner} after {block}");
        assert_eq!(
            unet::group_of(&format!("model.diffusion_model.{n}.transformer_blocks.1.attn1.to_q.weight")),
            format!("{n}.transformer_blocks.1")
        );
        assert_eq!(unet::group_of(&format!("model.diffusion_model.{n}.transformer_blocks.0.attn1.to_q.weight")), block);
        assert_eq!(unet::group_of(&format!("model.diffusion_model.{n}.proj_out.weight")), block);
    }
    assert!(
        !cut_names.iter().any(|c| c.ends_with(".transformer_blocks.1")),
        "no cut after the last block: {cut_names:?}"
    );
}

#[test]
fn graph_cuts_name_every_block_in_order() {
    let cfg = tiny(false);
    let (w, _) = make_weights(unet::unet_specs(&cfg, &f16_file, None));
    let g = Context::for_graph(unet::GRAPH_SIZE, unet::GRAPH_SIZE).unwrap();
    let x = g.new_f32(&[4, 4, 4, 1]);
    let t = g.new_f32(&[1]);
    let c = g.new_f32(&[24, 3, 1]);
    let mut cuts = Vec::new();
    let out = unet::forward(&g, &w, &cfg, x, t, c, false, &mut cuts).unwrap();
    let names: Vec<&str> = cuts.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "time_embed",
            "input_blocks.0",
            "input_blocks.1",
            "input_blocks.2",
            "input_blocks.3",
            "middle_block",
            "output_blocks.0",
            "output_blocks.1",
            "output_blocks.2",
            "output_blocks.3",
            "out"
        ]
    );
    assert_eq!(cuts.last().unwrap().1, out);
    assert_eq!(cuts[4].1.shape(), [2, 2, 64, 1], "input_blocks.3 runs at half resolution");
}

#[test]
fn bad_inputs_are_errors_not_aborts() {
    let cfg = tiny(false);
    let (w, _) = make_weights(unet::unet_specs(&cfg, &f16_file, None));
    let model = UNetModel { cfg, weights: w, flash_attn: false };
    let mut r = runner();
    let ctx = vec![0.0; 24 * 3];
    let cases: Vec<(&str, Result<Vec<f32>, DiffusionError>)> = vec![
        ("odd latent size", model.eval(&mut r, &vec![0.0; 5 * 4 * 4], (5, 4), &[1.0], &ctx, 3, 1)),
        ("short latent", model.eval(&mut r, &[0.0; 10], (4, 4), &[1.0], &ctx, 3, 1)),
        ("timesteps", model.eval(&mut r, &vec![0.0; 64], (4, 4), &[1.0, 2.0], &ctx, 3, 1)),
        ("context width", model.eval(&mut r, &vec![0.0; 64], (4, 4), &[1.0], &vec![0.0; 25 * 3], 3, 1)),
        ("context batch", model.eval(&mut r, &vec![0.0; 128], (4, 4), &[1.0, 2.0], &vec![0.0; 24 * 3 * 3], 3, 2)),
        ("empty", model.eval(&mut r, &[], (4, 4), &[], &ctx, 3, 0)),
    ];
    for (what, res) in cases {
        match res {
            Err(DiffusionError::Input { .. }) => {}
            other => panic!("{what}: expected an input error, got {other:?}"),
        }
    }
    // Through the graph function directly, with a wrong channel count.
    let g = Context::for_graph(64, 64).unwrap();
    let mut cuts = Vec::new();
    let res = unet::forward(
        &g,
        &model.weights,
        &model.cfg,
        g.new_f32(&[4, 4, 3, 1]),
        g.new_f32(&[1]),
        g.new_f32(&[24, 3, 1]),
        false,
        &mut cuts,
    );
    assert!(res.unwrap_err().to_string().contains("channels"));
}

// ---------------------------------------------------------------------------------------
// The real configurations
// ---------------------------------------------------------------------------------------

/// Fills full-size models quickly: a per-(fan-in, type) pool of random values, sliced at a
/// name-dependent offset (periodic weights are fine for a finiteness and shape check).
/// (fan-in or -1 for norm gains, is a bias, ggml type id) -> converted values.
type Pools = HashMap<(i64, bool, i32), Arc<Vec<u8>>>;

struct PoolSource {
    pools: Mutex<Pools>,
}

const POOL: usize = (1 << 20) + 7;

impl TensorSource for PoolSource {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let n: i64 = ne.iter().product();
        let is_bias = name.ends_with(".bias");
        let is_norm = !is_bias && ne.len() == 1;
        let fan_in: i64 = if ne.len() > 1 { ne[..ne.len() - 1].iter().product() } else { 0 };
        let key = (if is_norm { -1 } else { fan_in }, is_bias, ty.0 as i32);
        let pool = {
            let mut pools = self.pools.lock().unwrap();
            pools
                .entry(key)
                .or_insert_with(|| {
                    let u = uniform(key.0 as u64 ^ ((key.1 as u64) << 40), POOL);
                    let v: Vec<f32> = if is_bias {
                        u.iter().map(|x| x * 0.03).collect()
                    } else if is_norm {
                        u.iter().map(|x| 1.0 + x * 0.1).collect()
                    } else {
                        let a = (3.0 / fan_in as f32).sqrt();
                        u.iter().map(|x| x * a).collect()
                    };
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Arc::new(sd_backends::convert::convert(F32, ty, &bytes, &[POOL as i64]).unwrap())
                })
                .clone()
        };
        let es = pool.len() / POOL;
        let mut out = Vec::with_capacity(n as usize * es);
        let mut pos = (name_seed(name) as usize) % POOL;
        let mut left = n as usize;
        while left > 0 {
            let take = left.min(POOL - pos);
            out.extend_from_slice(&pool[pos * es..(pos + take) * es]);
            left -= take;
            pos = 0;
        }
        Ok(Cow::Owned(out))
    }
}

fn real_model(cfg: UNetConfig) -> UNetModel {
    UNetModel::load(
        cfg,
        &f16_file,
        None,
        backend().device().buffer_type(),
        &PoolSource { pools: Mutex::new(HashMap::new()) },
    )
    .unwrap()
}

/// Runs the model on an 8x8 latent: batch 2 with separate contexts, then each sample alone.
fn check_real(mut model: UNetModel) {
    let (wd, ht, l) = (8usize, 8usize, 77usize);
    let cd = model.cfg.context_dim as usize;
    let x = input(13, wd * ht * 4 * 2, 1.0);
    let ctx = input(14, cd * l * 2, 1.0);
    let t = [981.0f32, 981.0];
    let mut r = runner();
    let both = model.eval(&mut r, &x, (wd, ht), &t, &ctx, l, 2).unwrap();
    assert_eq!(both.len(), wd * ht * 4 * 2);
    assert!(both.iter().all(|v| v.is_finite()), "finite outputs");
    let spread = rms(&both.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(spread > 1e-3 && spread < 1e3, "output rms {spread}");
    // Batching agrees with the reference's separate cond / uncond calls to a few f16 ulps:
    // the CPU plugin's LLAMAFILE GEMM tiles by the batch's column count, so a batch of 2
    // sums in another order than a batch of 1 (observed rms 8.3e-4 relative, u = 4.9e-4).
    let per = wd * ht * 4;
    for b in 0..2 {
        let one = model
            .eval(&mut r, &x[b * per..(b + 1) * per], (wd, ht), &t[b..b + 1], &ctx[b * cd * l..(b + 1) * cd * l], l, 1)
            .unwrap();
        let want: Vec<f64> = both[b * per..(b + 1) * per].iter().map(|&v| v as f64).collect();
        assert_close(&format!("sample {b} alone vs in a batch"), &one, &want, 4e-3);
    }
    // Flash attention agrees within its f16 accumulation.
    model.flash_attn = true;
    let fa = model.eval(&mut r, &x, (wd, ht), &t, &ctx, l, 2).unwrap();
    assert_close("flash vs plain attention", &fa, &both.iter().map(|&v| v as f64).collect::<Vec<_>>(), 5e-2);
}

#[test]
fn sd15_runs_at_a_tiny_size() {
    let _l = big_model_lock();
    check_real(real_model(UNetConfig::sd15()));
}

#[test]
fn sd21_runs_at_a_tiny_size() {
    let _l = big_model_lock();
    check_real(real_model(UNetConfig::sd21()));
}

#[test]
fn the_graph_fits_its_declared_size() {
    // SD 1.5 at batch 2 must leave headroom under GRAPH_SIZE (ggml aborts past it).
    let cfg = UNetConfig::sd15();
    let w = Weights::new(unet::unet_specs(&cfg, &f16_file, None)).unwrap();
    for flash in [false, true] {
        let g = Context::for_graph(unet::GRAPH_SIZE, unet::GRAPH_SIZE).unwrap();
        let mut cuts = Vec::new();
        let out = unet::forward(
            &g,
            &w,
            &cfg,
            g.new_f32(&[8, 8, 4, 2]),
            g.new_f32(&[2]),
            g.new_f32(&[768, 77, 2]),
            flash,
            &mut cuts,
        )
        .unwrap();
        let graph = g.new_graph(unet::GRAPH_SIZE);
        graph.expand(out);
        let tensors = g.tensors().len();
        eprintln!("SD 1.5 graph (flash {flash}): {} nodes, {tensors} tensors", graph.n_nodes());
        assert!(graph.n_nodes() * 2 < unet::GRAPH_SIZE, "{} nodes", graph.n_nodes());
        assert!(tensors * 3 / 2 < unet::GRAPH_SIZE, "{tensors} tensors");
    }
}

#[test]
fn dit_input_checks_name_the_model_and_the_shape() {
    let ok = super::check_dit_inputs("Z-Image", [8, 6, 16, 1], [32, 5, 1, 1], 2, 16, 32).unwrap();
    assert_eq!(ok, (8, 6, 5));
    let cases = [
        ("a batch of 2: Z-Image", [8, 6, 16, 2], [32, 5, 1, 1]),
        ("latent size 7x6", [7, 6, 16, 1], [32, 5, 1, 1]),
        ("latent size 0x6", [0, 6, 16, 1], [32, 5, 1, 1]),
        ("latent has 4 channels, the model takes 16", [8, 6, 4, 1], [32, 5, 1, 1]),
        ("context shape [31, 5, 1]", [8, 6, 16, 1], [31, 5, 1, 1]),
        ("context shape [32, 0, 1]", [8, 6, 16, 1], [32, 0, 1, 1]),
        ("context shape [32, 5, 2]", [8, 6, 16, 1], [32, 5, 2, 1]),
    ];
    for (needle, x, context) in cases {
        match super::check_dit_inputs("Z-Image", x, context, 2, 16, 32) {
            Err(e @ DiffusionError::Input { model: "Z-Image", .. }) => {
                assert!(e.to_string().contains(needle), "{needle}: {e}")
            }
            other => panic!("{needle}: expected an input error, got {other:?}"),
        }
    }
}

#[test]
fn dit_batches_hold_one_latent_and_one_timestep_per_conditioning() {
    assert!(super::check_batch("FLUX", 4, 8, 2, 2).is_ok());
    for (x, t, c) in [(8, 2, 0), (7, 2, 2), (8, 1, 2), (0, 0, 0)] {
        match super::check_batch("FLUX", 4, x, t, c) {
            Err(e @ DiffusionError::Input { model: "FLUX", .. }) => {
                assert!(e.to_string().contains(&format!("{x} latent values and {t} timesteps for {c}")), "{e}")
            }
            other => panic!("{x}/{t}/{c}: expected an input error, got {other:?}"),
        }
    }
}
