//! FLUX tests: parameter inventory, config inference from tensor names, and RoPE, one double
//! block, one single block and the whole graph against an f64 implementation written from
//! the math (random weights, tiny config: width 256, 2 heads of 128).

use sd_backends::GgmlType;
use sd_sched::{Runner, Weights};

use super::*;
use crate::diffusion::run_graph;
use crate::text::clip::test_support::{activation, backend, diff, random_weights, seeded_uniform, ValuesSource};
use crate::text::clip::Activation;

const F32: GgmlType = GgmlType::GGML_TYPE_F32;
const F16: GgmlType = GgmlType::GGML_TYPE_F16;

fn tiny() -> FluxConfig {
    FluxConfig {
        hidden_size: 256,
        num_heads: 2,
        depth: 1,
        depth_single_blocks: 1,
        context_in_dim: 48,
        vec_in_dim: 32,
        ..FluxConfig::dev()
    }
}

/// Deterministic values uniform in [-1, 1), seeded by the tensor's name.
fn uniform(name: &str, n: usize) -> Vec<f32> {
    seeded_uniform(0x9e37_79b9_7f4a_7c15, name, n)
}

/// RMSNorm scales 1 +- 0.2, biases of scale 0.1, linear weights of variance ~1/fan_in.
fn values(name: &str, ne: &[i64]) -> Vec<f32> {
    let n = ne.iter().product::<i64>() as usize;
    let (scale, offset) = if name.ends_with(".scale") {
        (0.2, 1.0)
    } else if name.ends_with(".bias") {
        (0.1, 0.0)
    } else {
        ((3.0 / ne[0] as f32).sqrt(), 0.0)
    };
    uniform(name, n).into_iter().map(|x| x * scale + offset).collect()
}

/// Serves [`values`] in whatever type the weight set asks for.
const RANDOM: ValuesSource = ValuesSource(values);

fn weights(cfg: &FluxConfig, file_type: GgmlType) -> Weights {
    random_weights(flux_specs(cfg, &|_| Some(file_type), None), values)
}

// --- the f64 reference -----------------------------------------------------------------

type Rows = Vec<Vec<f64>>;

fn param(cfg: &FluxConfig, rel: &str) -> Vec<f64> {
    let specs = flux_specs(cfg, &|_| None, None);
    let n = format!("{PREFIX}.{rel}");
    let spec = specs.iter().find(|s| s.name == n).unwrap_or_else(|| panic!("no {n}"));
    values(&n, &spec.ne).into_iter().map(f64::from).collect()
}

/// `p.weight` stored as PyTorch [out][in], plus `p.bias`.
fn linear(cfg: &FluxConfig, p: &str, x: &Rows, bias: bool) -> Rows {
    let w = param(cfg, &format!("{p}.weight"));
    let inp = x[0].len();
    let out = w.len() / inp;
    let b = if bias { param(cfg, &format!("{p}.bias")) } else { vec![0.0; out] };
    x.iter().map(|r| (0..out).map(|o| b[o] + (0..inp).map(|i| w[o * inp + i] * r[i]).sum::<f64>()).collect()).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn layer_norm(x: &Rows) -> Rows {
    x.iter()
        .map(|r| {
            let m = r.iter().sum::<f64>() / r.len() as f64;
            let v = r.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / r.len() as f64;
            r.iter().map(|a| (a - m) / (v + 1e-6).sqrt()).collect()
        })
        .collect()
}

fn rms(x: &[f64], s: &[f64]) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + 1e-6).sqrt();
    x.iter().zip(s).map(|(v, g)| v * inv * g).collect()
}

fn modulate(x: &Rows, shift: &[f64], scale: &[f64]) -> Rows {
    x.iter().map(|r| r.iter().enumerate().map(|(i, v)| v * (1.0 + scale[i]) + shift[i]).collect()).collect()
}

fn add_gated(x: &Rows, y: &Rows, gate: &[f64]) -> Rows {
    x.iter().zip(y).map(|(a, b)| a.iter().zip(b).zip(gate).map(|((a, b), g)| a + b * g).collect()).collect()
}

/// `k` chunks of `lin(silu(vec))`.
fn modulation(cfg: &FluxConfig, p: &str, vec: &[f64], k: usize) -> Vec<Vec<f64>> {
    let v: Rows = vec![vec.iter().map(|&x| silu(x)).collect()];
    let m = linear(cfg, p, &v, true).remove(0);
    m.chunks(m.len() / k).map(|c| c.to_vec()).collect()
}

/// Position ids of the tokens: text zero, image (0, row, col).
fn ids(txt: usize, (w, h): (usize, usize)) -> Vec<[f64; 3]> {
    let mut v = vec![[0.0; 3]; txt];
    for r in 0..h / 2 {
        for c in 0..w / 2 {
            v.push([0.0, r as f64, c as f64]);
        }
    }
    v
}

/// Rotates adjacent pairs of `x` (one head) by the angles of position `id`.
fn rope(cfg: &FluxConfig, x: &[f64], id: &[f64; 3]) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    let mut at = 0;
    for (a, &d) in cfg.axes_dim.iter().enumerate() {
        for j in 0..d as usize / 2 {
            let angle = id[a] * (cfg.theta as f64).powf(-((2 * j) as f64) / d as f64);
            let (x0, x1) = (x[at], x[at + 1]);
            out.push(x0 * angle.cos() - x1 * angle.sin());
            out.push(x0 * angle.sin() + x1 * angle.cos());
            at += 2;
        }
    }
    out
}

/// Joint attention with RoPE over the rows of q, k, v (`hidden` wide each).
fn attention(cfg: &FluxConfig, q: &Rows, k: &Rows, v: &Rows, pos: &[[f64; 3]]) -> Rows {
    let (hd, heads, l) = (cfg.head_dim() as usize, cfg.num_heads as usize, q.len());
    let mut out = vec![vec![0.0; hd * heads]; l];
    for h in 0..heads {
        let r = h * hd..(h + 1) * hd;
        let qh: Rows = (0..l).map(|t| rope(cfg, &q[t][r.clone()], &pos[t])).collect();
        let kh: Rows = (0..l).map(|t| rope(cfg, &k[t][r.clone()], &pos[t])).collect();
        for tq in 0..l {
            let s: Vec<f64> = (0..l)
                .map(|tk| qh[tq].iter().zip(&kh[tk]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
                .collect();
            let max = s.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for (tk, p) in e.iter().enumerate() {
                for j in r.clone() {
                    out[tq][j] += p / z * v[tk][j];
                }
            }
        }
    }
    out
}

/// q, k (RMS-normed per head) and v from a fused projection's rows.
fn qkv(cfg: &FluxConfig, p: &str, fused: &Rows) -> (Rows, Rows, Rows) {
    let (h, hd) = (cfg.hidden_size as usize, cfg.head_dim() as usize);
    let (qs, ks) = (param(cfg, &format!("{p}.norm.query_norm.scale")), param(cfg, &format!("{p}.norm.key_norm.scale")));
    let norm = |r: &[f64], s: &[f64]| -> Vec<f64> { r.chunks(hd).flat_map(|c| rms(c, s)).collect() };
    let q = fused.iter().map(|r| norm(&r[..h], &qs)).collect();
    let k = fused.iter().map(|r| norm(&r[h..2 * h], &ks)).collect();
    let v = fused.iter().map(|r| r[2 * h..3 * h].to_vec()).collect();
    (q, k, v)
}

fn gelu(x: &Rows) -> Rows {
    x.iter().map(|r| r.iter().map(|&v| activation(Activation::GeluTanh, v)).collect()).collect()
}

fn double_ref(cfg: &FluxConfig, i: usize, img: &Rows, txt: &Rows, vec: &[f64], pos: &[[f64; 3]]) -> (Rows, Rows) {
    let p = |s: &str| format!("double_blocks.{i}.{s}");
    let im = modulation(cfg, &p("img_mod.lin"), vec, 6);
    let tm = modulation(cfg, &p("txt_mod.lin"), vec, 6);
    let pre = |x: &Rows, m: &[Vec<f64>], s: &str| {
        let fused = linear(cfg, &p(&format!("{s}_attn.qkv")), &modulate(&layer_norm(x), &m[0], &m[1]), true);
        qkv(cfg, &p(&format!("{s}_attn")), &fused)
    };
    let (iq, ik, iv) = pre(img, &im, "img");
    let (tq, tk, tv) = pre(txt, &tm, "txt");
    let cat = |a: Rows, b: Rows| a.into_iter().chain(b).collect::<Rows>();
    let a = attention(cfg, &cat(tq, iq), &cat(tk, ik), &cat(tv, iv), pos);
    let (ta, ia) = a.split_at(txt.len());
    let post = |x: &Rows, att: &[Vec<f64>], m: &[Vec<f64>], s: &str| {
        let x = add_gated(x, &linear(cfg, &p(&format!("{s}_attn.proj")), &att.to_vec(), true), &m[2]);
        let h = linear(cfg, &p(&format!("{s}_mlp.0")), &modulate(&layer_norm(&x), &m[3], &m[4]), true);
        let y = linear(cfg, &p(&format!("{s}_mlp.2")), &gelu(&h), true);
        add_gated(&x, &y, &m[5])
    };
    (post(img, ia, &im, "img"), post(txt, ta, &tm, "txt"))
}

fn single_ref(cfg: &FluxConfig, i: usize, x: &Rows, vec: &[f64], pos: &[[f64; 3]]) -> Rows {
    let p = |s: &str| format!("single_blocks.{i}.{s}");
    let h = cfg.hidden_size as usize;
    let m = modulation(cfg, &p("modulation.lin"), vec, 3);
    let fused = linear(cfg, &p("linear1"), &modulate(&layer_norm(x), &m[0], &m[1]), true);
    let (q, k, v) = qkv(cfg, &format!("single_blocks.{i}"), &fused);
    let a = attention(cfg, &q, &k, &v, pos);
    let mlp = gelu(&fused.iter().map(|r| r[3 * h..].to_vec()).collect());
    let joint: Rows = a.into_iter().zip(mlp).map(|(a, m)| a.into_iter().chain(m).collect()).collect();
    add_gated(x, &linear(cfg, &p("linear2"), &joint, true), &m[2])
}

fn rows(v: &[f32], width: usize) -> Rows {
    v.chunks(width).map(|c| c.iter().map(|&x| x as f64).collect()).collect()
}

fn flat(r: &Rows) -> Vec<f64> {
    r.iter().flatten().copied().collect()
}

/// The sinusoidal embedding of `t` (cos half first, as ggml's `timestep_embedding`).
fn timestep_embedding(t: f64) -> Vec<f64> {
    let half = 128;
    let freqs: Vec<f64> = (0..half).map(|i| (-(10000f64.ln()) * i as f64 / half as f64).exp()).collect();
    freqs.iter().map(|f| (t * f).cos()).chain(freqs.iter().map(|f| (t * f).sin())).collect()
}

fn embedder(cfg: &FluxConfig, p: &str, x: Vec<f64>) -> Vec<f64> {
    let h = linear(cfg, &format!("{p}.in_layer"), &vec![x], true);
    let h: Rows = vec![h[0].iter().map(|&v| silu(v)).collect()];
    linear(cfg, &format!("{p}.out_layer"), &h, true).remove(0)
}

/// The whole model on a `w` x `h` latent (`[C][H][W]`).
fn model_ref(cfg: &FluxConfig, x: &[f32], (w, h): (usize, usize), t: f64, ctx: &Rows, y: &[f64], gd: f64) -> Vec<f64> {
    let c = cfg.latent_channels() as usize;
    // Patchify: token (r, col) holds channel-major 2x2 patches.
    let mut img = Vec::new();
    for r in 0..h / 2 {
        for col in 0..w / 2 {
            let mut tok = Vec::new();
            for ch in 0..c {
                for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    tok.push(x[ch * w * h + (2 * r + dy) * w + 2 * col + dx] as f64);
                }
            }
            img.push(tok);
        }
    }
    let img = linear(cfg, "img_in", &img, true);
    let mut vec = embedder(cfg, "time_in", timestep_embedding(1000.0 * t));
    let g = embedder(cfg, "guidance_in", timestep_embedding(1000.0 * gd));
    let yv = embedder(cfg, "vector_in", y.to_vec());
    for i in 0..vec.len() {
        vec[i] += g[i] + yv[i];
    }
    let txt = linear(cfg, "txt_in", ctx, true);
    let pos = ids(ctx.len(), (w, h));
    let (img, txt) = double_ref(cfg, 0, &img, &txt, &vec, &pos);
    let joint: Rows = txt.iter().chain(&img).cloned().collect();
    let joint = single_ref(cfg, 0, &joint, &vec, &pos);
    let img: Rows = joint[ctx.len()..].to_vec();
    let m = linear(cfg, "final_layer.adaLN_modulation.1", &vec![vec.iter().map(|&v| silu(v)).collect()], true);
    let hs = cfg.hidden_size as usize;
    let out = linear(cfg, "final_layer.linear", &modulate(&layer_norm(&img), &m[0][..hs], &m[0][hs..]), true);
    // Unpatchify to [C][H][W].
    let mut o = vec![0.0; c * w * h];
    for r in 0..h / 2 {
        for col in 0..w / 2 {
            let tok = &out[r * (w / 2) + col];
            for ch in 0..c {
                for (k, (dy, dx)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
                    o[ch * w * h + (2 * r + dy) * w + 2 * col + dx] = tok[ch * 4 + k];
                }
            }
        }
    }
    o
}

fn inputs(n: usize, seed: &str, scale: f32) -> Vec<f32> {
    uniform(seed, n).into_iter().map(|v| v * scale).collect()
}

// --- tests -----------------------------------------------------------------------------

#[test]
fn dev_and_schnell_have_the_published_parameter_counts() {
    let count = |cfg: &FluxConfig| {
        flux_specs(cfg, &|_| Some(F16), None).iter().map(|s| s.ne.iter().product::<i64>()).sum::<i64>()
    };
    // 11,901,408,320 parameters, counted by hand from the module tree (BFL's "12B"); schnell lacks guidance_in
    // (256 x 3072 + 3072 + 3072 x 3072 + 3072 = 10,229,760 of them).
    assert_eq!(count(&FluxConfig::dev()), 11_901_408_320);
    assert_eq!(count(&FluxConfig::dev()) - count(&FluxConfig::schnell()), 10_229_760);
    let specs = flux_specs(&FluxConfig::dev(), &|_| Some(F16), None);
    let find = |n: &str| specs.iter().find(|s| s.name == format!("{PREFIX}.{n}")).unwrap_or_else(|| panic!("{n}"));
    assert_eq!(find("double_blocks.18.img_attn.qkv.weight").ne, [3072, 9216]);
    assert_eq!(find("single_blocks.37.linear1.weight").ne, [3072, 21504]);
    assert_eq!(find("single_blocks.37.linear2.weight").ne, [15360, 3072]);
    assert_eq!(find("single_blocks.0.norm.key_norm.scale").ty, F32);
    assert_eq!(find("txt_in.weight").ne, [4096, 3072]);
    assert_eq!(find("final_layer.linear.weight").ne, [3072, 64]);
    assert_eq!(find("img_in.bias").ty, F32);
}

#[test]
fn config_is_inferred_from_the_file_as_the_reference_does() {
    let file = |cfg: &FluxConfig| -> Vec<(String, Vec<u64>)> {
        flux_specs(cfg, &|_| Some(F16), None)
            .into_iter()
            .map(|s| (s.name, s.ne.iter().map(|&d| d as u64).collect()))
            .collect()
    };
    let dev = FluxConfig::dev();
    assert_eq!(FluxConfig::from_file(&file(&dev)).unwrap(), dev);
    assert_eq!(FluxConfig::from_file(&file(&FluxConfig::schnell())).unwrap(), FluxConfig::schnell());
    let small = FluxConfig { depth: 2, depth_single_blocks: 3, context_in_dim: 48, ..tiny() };
    let got = FluxConfig::from_file(&file(&small)).unwrap();
    // vec_in_dim is not read from the file (768 as in the reference); the rest is.
    assert_eq!(got, FluxConfig { vec_in_dim: 768, ..small.clone() });
    let specs = flux_specs(&got, &|_| Some(F16), None);
    let err = validate_against_file(&specs, &file(&small)).unwrap_err().to_string();
    assert!(err.contains("vector_in.in_layer.weight"), "{err}");

    // Errors name the tensor.
    let mut no_txt = file(&small);
    no_txt.retain(|(n, _)| !n.ends_with("txt_in.weight"));
    let err = FluxConfig::from_file(&no_txt).unwrap_err().to_string();
    assert!(err.contains("model.diffusion_model.txt_in.weight"), "{err}");
    let mut bad_heads = file(&small);
    for (n, ne) in &mut bad_heads {
        if n.ends_with("key_norm.scale") {
            ne[0] = 64;
        }
    }
    let err = FluxConfig::from_file(&bad_heads).unwrap_err().to_string();
    assert!(err.contains("RoPE axes"), "{err}");
    let mut bad_index = file(&small);
    bad_index.push((format!("{PREFIX}.double_blocks.x.img_mod.lin.weight"), vec![256]));
    let err = FluxConfig::from_file(&bad_index).unwrap_err().to_string();
    assert!(err.contains("double_blocks.x.img_mod.lin.weight"), "{err}");
    // A missing middle block is a missing tensor, not a shorter model.
    let mut gap = file(&FluxConfig { depth: 3, ..small.clone() });
    gap.retain(|(n, _)| !n.contains("double_blocks.1."));
    let cfg = FluxConfig::from_file(&gap).unwrap();
    assert_eq!(cfg.depth, 3);
    let err = validate_against_file(&flux_specs(&cfg, &|_| Some(F16), None), &gap).unwrap_err().to_string();
    assert!(err.contains("double_blocks.1.img_mod.lin.weight"), "{err}");
}

#[test]
fn groups_follow_the_blocks() {
    assert_eq!(group_of("model.diffusion_model.double_blocks.7.img_attn.qkv.weight"), "double_blocks.7");
    assert_eq!(group_of("model.diffusion_model.single_blocks.12.linear1.bias"), "single_blocks.12");
    assert_eq!(group_of("model.diffusion_model.final_layer.linear.weight"), "final_layer");
    assert_eq!(group_of("model.diffusion_model.txt_in.weight"), "prelude");
}

#[test]
fn rope_pe_is_the_rotation_of_each_axis() {
    let cfg = FluxConfig::dev();
    let (txt, w, h) = (3, 6, 4);
    let pe = rope_pe(&cfg, txt, (w, h));
    let half = cfg.head_dim() as usize / 2;
    let pos = ids(txt, (w, h));
    assert_eq!(pe.len(), pos.len() * half * 4);
    let mut worst: f64 = 0.0;
    for (t, id) in pos.iter().enumerate() {
        let mut j = 0;
        for (a, &d) in cfg.axes_dim.iter().enumerate() {
            for i in 0..d as usize / 2 {
                let angle = id[a] * 10000f64.powf(-((2 * i) as f64) / d as f64);
                let want = [angle.cos(), -angle.sin(), angle.sin(), angle.cos()];
                for (k, wv) in want.iter().enumerate() {
                    worst = worst.max((pe[(t * half + j) * 4 + k] as f64 - wv).abs());
                }
                j += 1;
            }
        }
    }
    // f32 angles of positions below 3 radians per unit: a few ulps.
    assert!(worst < 2e-6, "{worst:e}");
}

/// Runs one block's graph on random streams and returns (ours, f64 reference).
fn block_case(double: bool) -> (Vec<f32>, Vec<f64>) {
    let cfg = tiny();
    let w = weights(&cfg, F32);
    let mut runner = Runner::new("flux", backend());
    let (hs, lt, (lw, lh)) = (cfg.hidden_size as usize, 5, (4usize, 6usize));
    let li = image_tokens(lw, lh, 2);
    let img = inputs(hs * li, "img", 1.0);
    let txt = inputs(hs * lt, "txt", 1.0);
    let vec = inputs(hs, "vec", 1.0);
    let pe = rope_pe(&cfg, lt, (lw, lh));
    let half = cfg.head_dim() / 2;
    let n = (lt + li) as i64;
    let (hs_, lt_, li_) = (hs as i64, lt as i64, li as i64);
    let shapes: Vec<(Vec<i64>, &[f32])> = vec![
        (vec![hs_, li_], &img),
        (vec![hs_, lt_], &txt),
        (vec![hs_, 1], &vec),
        (vec![2, 2, half, n], &pe),
        (vec![1], &[1e-6]),
    ];
    let ins: Vec<(&[i64], &[f32])> = shapes.iter().map(|(s, d)| (s.as_slice(), *d)).collect();
    let (got, _) = run_graph(&mut runner, &ins, 4096, |g, t| {
        let s = Shared { vec: t[2], pe: t[3], eps: t[4], kernel: AttnKernel::Plain, mask: None, shared_mods: None };
        if double {
            let (i, x) = double_block(g, &w, &cfg, 0, t[0], t[1], &s)?;
            // txt then img, one output.
            Ok(g.concat(x, i, 1))
        } else {
            single_block(g, &w, &cfg, 0, g.concat(t[1], t[0], 1), &s)
        }
    })
    .unwrap();
    let pos = ids(lt, (lw, lh));
    let vecd: Vec<f64> = vec.iter().map(|&v| v as f64).collect();
    let want = if double {
        let (i, x) = double_ref(&cfg, 0, &rows(&img, hs), &rows(&txt, hs), &vecd, &pos);
        flat(&x.into_iter().chain(i).collect())
    } else {
        let joint: Rows = rows(&txt, hs).into_iter().chain(rows(&img, hs)).collect();
        flat(&single_ref(&cfg, 0, &joint, &vecd, &pos))
    };
    (got, want)
}

#[test]
fn double_block_matches_an_f64_block() {
    let (got, want) = block_case(true);
    let (max, mean) = diff(&got, &want);
    let scale = want.iter().map(|v| v.abs()).sum::<f64>() / want.len() as f64;
    // f32 graph against f64 (GELU's f16 table emulated): rounding only; measured 4.6e-5 /
    // 1.1e-6 (max / mean), a wrong rotation or modulation order gives differences of order 1.
    assert!(scale > 0.3 && max < 5e-4 && mean < 1e-5, "max {max:e}, mean {mean:e}, scale {scale}");
}

#[test]
fn single_block_matches_an_f64_block() {
    let (got, want) = block_case(false);
    let (max, mean) = diff(&got, &want);
    let scale = want.iter().map(|v| v.abs()).sum::<f64>() / want.len() as f64;
    // Measured 9.3e-6 / 2.8e-7.
    assert!(scale > 0.3 && max < 5e-4 && mean < 1e-5, "max {max:e}, mean {mean:e}, scale {scale}");
}

#[test]
fn whole_graph_matches_an_f64_model_and_refuses_bad_inputs() {
    let cfg = tiny();
    let w = weights(&cfg, F32);
    let mut runner = Runner::new("flux", backend());
    let (lw, lh, lt) = (6usize, 4usize, 3usize);
    let c = cfg.latent_channels() as usize;
    let x = inputs(c * lw * lh, "x", 1.0);
    let ctx = inputs(cfg.context_in_dim as usize * lt, "ctx", 1.0);
    let y = inputs(cfg.vec_in_dim as usize, "y", 1.0);
    let (t, gd) = (0.75f32, 3.5f32);
    let pe = rope_pe(&cfg, lt, (lw, lh));
    let half = cfg.head_dim() / 2;
    let n = (lt + image_tokens(lw, lh, 2)) as i64;
    let shapes: Vec<(Vec<i64>, Vec<f32>)> = vec![
        (vec![lw as i64, lh as i64, c as i64, 1], x.clone()),
        (vec![1], vec![t]),
        (vec![cfg.context_in_dim, lt as i64, 1], ctx.clone()),
        (vec![cfg.vec_in_dim, 1], y.clone()),
        (vec![1], vec![gd]),
        (vec![2, 2, half, n], pe),
        (vec![1], vec![1e-6]),
    ];
    let ins: Vec<(&[i64], &[f32])> = shapes.iter().map(|(s, d)| (s.as_slice(), d.as_slice())).collect();
    let mut ncuts = 0;
    let (got, shape) = run_graph(&mut runner, &ins, graph_size(&cfg), |g, t| {
        let fi = FluxInputs {
            x: t[0],
            timestep: t[1],
            context: t[2],
            y: t[3],
            guidance: Some(t[4]),
            pe: t[5],
            eps: t[6],
            mod_index: None,
            mask: None,
            refs: Vec::new(),
            dct: None,
        };
        let mut cuts = Vec::new();
        let out = forward(g, &w, &cfg, &fi, AttnKernel::Plain, &mut cuts)?;
        ncuts = cuts.len();
        Ok(out)
    })
    .unwrap();
    assert_eq!(shape, [lw as i64, lh as i64, c as i64, 1]);
    assert_eq!(ncuts, 3 + 2 + 1, "prelude (3), a double block (2), a single block (1)");
    let want = model_ref(
        &cfg,
        &x,
        (lw, lh),
        t as f64,
        &rows(&ctx, cfg.context_in_dim as usize),
        &y.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        gd as f64,
    );
    let (max, mean) = diff(&got, &want);
    let scale = want.iter().map(|v| v.abs()).sum::<f64>() / want.len() as f64;
    // The timestep embedding's arguments reach 1000: its f32 cos/sin lose ~1e-4 there.
    // Measured 2.7e-4 / 4.7e-5.
    assert!(scale > 0.1 && max < 2e-3 && mean < 3e-4, "max {max:e}, mean {mean:e}, scale {scale}");

    // Bad inputs are errors naming what is wrong.
    let err = run_graph(&mut runner, &ins, graph_size(&cfg), |g, t| {
        let fi = FluxInputs {
            x: t[0],
            timestep: t[1],
            context: t[2],
            y: t[3],
            guidance: None,
            pe: t[5],
            eps: t[6],
            mod_index: None,
            mask: None,
            refs: Vec::new(),
            dct: None,
        };
        forward(g, &w, &cfg, &fi, AttnKernel::Plain, &mut Vec::new())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("guidance"), "{err}");
    let odd: Vec<(Vec<i64>, Vec<f32>)> = vec![(vec![5, 4, c as i64, 1], vec![0.0; 5 * 4 * c])];
    let ins_odd: Vec<(&[i64], &[f32])> = odd.iter().map(|(s, d)| (s.as_slice(), d.as_slice())).collect();
    let err = run_graph(&mut runner, &ins_odd, 64, |g, t| {
        let fi = FluxInputs {
            x: t[0],
            timestep: t[0],
            context: t[0],
            y: t[0],
            guidance: None,
            pe: t[0],
            eps: t[0],
            mod_index: None,
            mask: None,
            refs: Vec::new(),
            dct: None,
        };
        forward(g, &w, &FluxConfig::schnell(), &fi, AttnKernel::Plain, &mut Vec::new())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("5x4"), "{err}");
}

#[test]
fn flash_attention_stays_close_to_plain() {
    let cfg = tiny();
    let w = weights(&cfg, F32);
    let mut runner = Runner::new("flux", backend());
    let (hs, n) = (cfg.hidden_size, 5 + image_tokens(4, 4, 2) as i64);
    let x = inputs((hs * n) as usize, "joint", 1.0);
    let vec = inputs(hs as usize, "vec", 1.0);
    let pe = rope_pe(&cfg, 5, (4, 4));
    let run = |runner: &mut Runner, kernel: AttnKernel| {
        let shapes: Vec<(Vec<i64>, &[f32])> =
            vec![(vec![hs, n], &x), (vec![hs, 1], &vec), (vec![2, 2, cfg.head_dim() / 2, n], &pe), (vec![1], &[1e-6])];
        let ins: Vec<(&[i64], &[f32])> = shapes.iter().map(|(s, d)| (s.as_slice(), *d)).collect();
        run_graph(runner, &ins, 4096, |g, t| {
            single_block(
                g,
                &w,
                &cfg,
                0,
                t[0],
                &Shared { vec: t[1], pe: t[2], eps: t[3], kernel, mask: None, shared_mods: None },
            )
        })
        .unwrap()
        .0
    };
    let plain = run(&mut runner, AttnKernel::Plain);
    let flash = run(&mut runner, AttnKernel::Flash);
    let want: Vec<f64> = plain.iter().map(|&v| v as f64).collect();
    let (max, _) = diff(&flash, &want);
    // k and v in f16: 11 significant bits.
    assert!(max > 0.0 && max < 2e-2, "{max:e}");
}

#[test]
fn the_pipeline_interface_evaluates_each_sample_alone() {
    use crate::family::DiffusionModel;
    use crate::text::conditioning::Conditioning;
    let cfg = tiny();
    let mut m = FluxModel::new(cfg.clone(), &|_| Some(F32), None).unwrap();
    m.weights.allocate(backend().device().buffer_type()).unwrap();
    m.weights.load_from(&RANDOM).unwrap();
    m.guidance = 2.0;
    let mut runner = Runner::new("flux", backend());
    let (w, h, l) = (4usize, 6usize, 3usize);
    let per = cfg.latent_channels() as usize * w * h;
    let x = inputs(2 * per, "batch", 1.0);
    let cond = |seed: &str| {
        Conditioning::tokens(
            inputs(l * cfg.context_in_dim as usize, seed, 1.0),
            cfg.context_in_dim as usize,
            l,
            inputs(cfg.vec_in_dim as usize, &format!("{seed}-y"), 1.0),
        )
    };
    let (a, b) = (cond("a"), cond("b"));
    let both = DiffusionModel::eval(&m, &mut runner, &x, (w, h), &[0.9, 0.2], &[&a, &b]).unwrap();
    let one = m.eval(&mut runner, &x[per..], (w, h), 0.2, &b.data, l, &b.vector, Some(2.0)).unwrap();
    assert_eq!(both[per..], one[..], "the second sample alone");
    let other_guidance = m.eval(&mut runner, &x[per..], (w, h), 0.2, &b.data, l, &b.vector, Some(3.5)).unwrap();
    assert_ne!(one, other_guidance, "the guidance reaches the output");
    let narrow = Conditioning { hidden_size: 24, data: vec![0.0; 24 * l], ..a.clone() };
    let err = DiffusionModel::eval(&m, &mut runner, &x[..per], (w, h), &[0.5], &[&narrow]).unwrap_err();
    let source = std::error::Error::source(&err).map(|s| s.to_string()).unwrap_or_default();
    assert!(source.contains("txt_in"), "{err}: {source}");
}

/// One evaluation of a model of `cfg` (random f32 weights) with its parameters in `home` under
/// an optional device `budget`: the output, the runner's statistics and the ledger's high-water
/// mark. The segmented-execution tests compare these across placements.
#[allow(clippy::too_many_arguments)]
fn eval_placed(
    cfg: &FluxConfig,
    home: sd_sched::ParamHome,
    budget: Option<u64>,
    x: &[f32],
    (w, h): (usize, usize),
    (ctx, l): (&[f32], usize),
    y: &[f32],
    guidance: f32,
) -> (Vec<f32>, sd_sched::RunStats, u64) {
    use std::collections::HashMap;
    use std::sync::Arc;
    let b = backend();
    let dev = b.device().name();
    let ledgers =
        sd_sched::Ledgers::with_budgets(budget.map(|v| HashMap::from([(dev.clone(), v)])).unwrap_or_default());
    let mut m = FluxModel::new(cfg.clone(), &|_| Some(F32), None).unwrap();
    m.weights.place("flux", home, b.clone(), &ledgers, &group_of, Arc::new(RANDOM)).unwrap();
    let mut runner = Runner::with_ledger("flux", b, ledgers.get(&dev), Default::default());
    let out = m.eval(&mut runner, x, (w, h), 0.6, ctx, l, y, Some(guidance)).unwrap();
    let high = ledgers.get(&dev).high_water();
    (out, runner.stats().clone(), high)
}

#[test]
fn segmented_under_a_budget_equals_the_whole_graph() {
    use sd_sched::ParamHome;
    // Two double blocks (9.4 MB each in f32) and two single blocks (3.9 MB): 28 MB in all.
    let cfg = FluxConfig { depth: 2, depth_single_blocks: 2, ..tiny() };
    let (w, h, l) = (4usize, 6usize, 3usize);
    let x = inputs(cfg.latent_channels() as usize * w * h, "seg-x", 1.0);
    let ctx = inputs(l * cfg.context_in_dim as usize, "seg-c", 1.0);
    let y = inputs(cfg.vec_in_dim as usize, "seg-y", 1.0);
    let run = |home: ParamHome, budget: Option<u64>| eval_placed(&cfg, home, budget, &x, (w, h), (&ctx, l), &y, 3.5);
    let (whole, stats, _) = run(ParamHome::Compute, None);
    assert_eq!(stats.segmented_runs, 0);
    // One double block and a little more: every block runs in a segment of its own.
    let budget = 14 << 20;
    let (seg, stats, high) = run(ParamHome::Disk, Some(budget));
    assert_eq!(seg, whole, "segmented = whole (same kernels)");
    assert_eq!(stats.segmented_runs, 1, "{stats:?}");
    assert!(stats.max_segments >= 4, "{stats:?}");
    assert!(high <= budget, "high-water {high} above the budget {budget}");
}

// --- Chroma ------------------------------------------------------------------------------

/// [`tiny`] as Chroma: no guidance or vector embedders, an approximator 64 wide with 2 layers.
fn tiny_chroma() -> FluxConfig {
    let approx = chroma::ChromaConfig { inner: 64, layers: 2, dit_mask: true };
    FluxConfig {
        vec_in_dim: 0,
        guidance_embed: false,
        chroma: Some(approx),
        depth: 2,
        depth_single_blocks: 2,
        ..tiny()
    }
}

#[test]
fn chroma_masked_tokens_act_as_absent_and_the_timestep_reaches_the_output() {
    let cfg = tiny_chroma();
    let specs = flux_specs(&cfg, &|_| None, None);
    assert!(specs.iter().all(|s| !s.name.contains("_mod.lin") && !s.name.contains("modulation.lin")));
    assert!(specs.iter().any(|s| s.name.ends_with("distilled_guidance_layer.norms.1.scale")));
    let mut m = FluxModel::new(cfg.clone(), &|_| Some(F32), None).unwrap();
    m.weights.allocate(backend().device().buffer_type()).unwrap();
    m.weights.load_from(&RANDOM).unwrap();
    let mut runner = Runner::new("chroma", backend());
    let (w, h, l, masked) = (4usize, 6usize, 5usize, 2usize);
    let x = inputs(cfg.latent_channels() as usize * w * h, "chroma-x", 1.0);
    let ctx = inputs(l * cfg.context_in_dim as usize, "chroma-c", 1.0);
    let mask: Vec<f32> = (0..l).map(|i| if i + masked >= l { f32::NEG_INFINITY } else { 0.0 }).collect();
    let with_mask = m.eval(&mut runner, &x, (w, h), 0.6, &ctx, l, &mask, Some(0.0)).unwrap();
    // Text ids are all zero for RoPE, so tokens no query may read are tokens that are not there.
    let kept = (l - masked) * cfg.context_in_dim as usize;
    let absent = m.eval(&mut runner, &x, (w, h), 0.6, &ctx[..kept], l - masked, &[], Some(0.0)).unwrap();
    let (max, _) = diff(&with_mask, &absent.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(max < 1e-4, "masked tokens changed the output by {max:e}");
    let unmasked = m.eval(&mut runner, &x, (w, h), 0.6, &ctx, l, &[], Some(0.0)).unwrap();
    assert_ne!(unmasked, with_mask, "the mask reaches the output");
    let zeros = m.eval(&mut runner, &x, (w, h), 0.6, &ctx, l, &vec![0.0; l], Some(0.0)).unwrap();
    assert_eq!(zeros, unmasked, "an all-open mask is no mask");
    let later = m.eval(&mut runner, &x, (w, h), 0.3, &ctx, l, &[], Some(0.0)).unwrap();
    assert_ne!(later, unmasked, "the timestep reaches the approximator");
    // Without the DiT mask option the conditioner's mask is not read.
    m.cfg.chroma.as_mut().unwrap().dit_mask = false;
    let off = m.eval(&mut runner, &x, (w, h), 0.6, &ctx, l, &mask, Some(0.0)).unwrap();
    assert_eq!(off, unmasked);
    // Bad inputs are errors naming what is wrong.
    let e = m.eval(&mut runner, &x, (w, h), 0.6, &ctx, l, &mask[..2], Some(0.0)).unwrap_err().to_string();
    assert!(e.contains("mask"), "{e}");
}

#[test]
fn chroma_segmented_under_a_budget_equals_the_whole_graph() {
    use sd_sched::ParamHome;
    let cfg = tiny_chroma();
    let (w, h, l) = (4usize, 6usize, 3usize);
    let x = inputs(cfg.latent_channels() as usize * w * h, "cseg-x", 1.0);
    let ctx = inputs(l * cfg.context_in_dim as usize, "cseg-c", 1.0);
    let mask = [0.0, 0.0, f32::NEG_INFINITY];
    let run = |home: ParamHome, budget: Option<u64>| {
        let (out, stats, _) = eval_placed(&cfg, home, budget, &x, (w, h), (&ctx, l), &mask, 0.0);
        (out, stats)
    };
    let (whole, stats) = run(ParamHome::Compute, None);
    assert_eq!(stats.segmented_runs, 0);
    let (seg, stats) = run(ParamHome::Disk, Some(10 << 20));
    assert_eq!(seg, whole, "segmented = whole (same kernels)");
    assert!(stats.segmented_runs == 1 && stats.max_segments >= 4, "{stats:?}");
}

/// `--increase-ref-index`: one reference is read the same way either way (index 1, no
/// offset); a second one moves from index 1 beside the first to index 2 at the origin, where it
/// lies exactly as a lone reference on index 2 would; FLUX.2 always numbers them.
#[test]
fn increase_ref_index_numbers_the_references() {
    let cfg = tiny();
    let pe = |refs: &[(usize, usize)], inc| rope_pe_with_refs(&cfg, 3, (4, 4), refs, inc);
    let (a, b) = ((4, 4), (4, 2));
    assert_eq!(pe(&[a], true), pe(&[a], false));
    let (side, numbered) = (pe(&[a, b], false), pe(&[a, b], true));
    assert_eq!(side.len(), numbered.len());
    assert_ne!(side, numbered);
    // Tokens: 3 text, 4 image, 4 of `a`, 2 of `b` (2x2 patches); each token's pe is
    // head_dim / 2 rotation matrices of 4 values.
    let per = cfg.head_dim() as usize * 2;
    let b_start = (3 + 4 + 4) * per;
    assert_eq!(side[..b_start], numbered[..b_start], "the image's and the first reference's tokens");
    // `b` numbered: the tokens of `b` alone on index 2 match an index-2 grid at the origin,
    // which is what the first reference's grid is on index 1 with the same rows and columns.
    let alone = rope_pe_with_refs(&cfg, 3, (4, 4), &[(4, 2), (4, 2)], true);
    assert_eq!(numbered[b_start..], alone[b_start - 2 * per..b_start], "b on index 2, no offset");
    let flux2 = FluxConfig::flux2_klein_4b();
    let pe2 = |inc| rope_pe_with_refs(&flux2, 3, (4, 4), &[a, b], inc);
    assert_eq!(pe2(true), pe2(false));
}
