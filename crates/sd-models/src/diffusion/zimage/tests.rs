//! Z-Image tests: config inference from tensor names (and its errors), the positional
//! embedding's ids, the patch order, and the whole graph on a tiny random model (width 256,
//! 2 heads of 128, one refiner of each kind, one layer).

use sd_backends::GgmlType;
use sd_sched::Runner;

use super::*;
use crate::diffusion::run_graph;
use crate::text::clip::test_support::{backend, random_weights, seeded_uniform};

const F16: GgmlType = GgmlType::GGML_TYPE_F16;

fn tiny() -> ZImageConfig {
    ZImageConfig::reduced(256, 1, 1, 64)
}

fn file(cfg: &ZImageConfig) -> Vec<(String, Vec<u64>)> {
    zimage_specs(cfg, &|_| Some(F16), None)
        .into_iter()
        .map(|s| (s.name, s.ne.iter().map(|&d| d as u64).collect()))
        .collect()
}

/// RMSNorm weights 1 +- 0.2, pad tokens and biases of scale 0.1, linear weights of variance ~1/fan_in.
fn values(name: &str, ne: &[i64]) -> Vec<f32> {
    let n = ne.iter().product::<i64>() as usize;
    let u = seeded_uniform(0x2545_f491_4f6c_dd1d, name, n);
    let norm = name.contains("norm") || name.contains("cap_embedder.0");
    let (scale, offset) = if norm && ne.len() == 1 {
        (0.2, 1.0)
    } else if ne.len() == 1 {
        (0.1, 0.0)
    } else {
        ((3.0 / ne[0] as f32).sqrt(), 0.0)
    };
    u.into_iter().map(|x| x * scale + offset).collect()
}

#[test]
fn config_is_inferred_from_the_file_as_the_reference_does() {
    let turbo = ZImageConfig::turbo();
    assert_eq!(ZImageConfig::from_file(&file(&turbo)).unwrap(), turbo);
    assert_eq!(turbo.ffn_dim(), 10240, "Z-Image's published SwiGLU width");
    let small = ZImageConfig::reduced(384, 3, 2, 320);
    assert_eq!(small.ffn_dim(), 1024);
    assert_eq!(ZImageConfig::from_file(&file(&small)).unwrap(), small);

    let mut no_cap = file(&small);
    no_cap.retain(|(n, _)| !n.ends_with("cap_embedder.1.weight"));
    let err = ZImageConfig::from_file(&no_cap).unwrap_err().to_string();
    assert!(err.contains("model.diffusion_model.cap_embedder.1.weight"), "{err}");
    let mut bad_heads = file(&small);
    for (n, ne) in &mut bad_heads {
        if n.ends_with("layers.0.attention.q_norm.weight") {
            ne[0] = 64;
        }
    }
    let err = ZImageConfig::from_file(&bad_heads).unwrap_err().to_string();
    assert!(err.contains("RoPE axes"), "{err}");
    let mut bad_index = file(&small);
    bad_index.push((format!("{PREFIX}.noise_refiner.x.ffn_norm1.weight"), vec![384]));
    let err = ZImageConfig::from_file(&bad_index).unwrap_err().to_string();
    assert!(err.contains("noise_refiner.x.ffn_norm1.weight"), "{err}");
    // A missing middle layer is a missing tensor, not a shorter model.
    let mut gap = file(&small);
    gap.retain(|(n, _)| !n.contains(".layers.1."));
    let cfg = ZImageConfig::from_file(&gap).unwrap();
    assert_eq!(cfg.num_layers, 3);
    let err = validate_against_file(&zimage_specs(&cfg, &|_| Some(F16), None), &gap).unwrap_err().to_string();
    assert!(err.contains("layers.1.attention.qkv.weight"), "{err}");
}

#[test]
fn groups_and_blocks_follow_the_graph() {
    assert_eq!(group_of("model.diffusion_model.layers.7.attention.qkv.weight"), "layers.7");
    assert_eq!(group_of("model.diffusion_model.noise_refiner.1.ffn_norm1.weight"), "noise_refiner.1");
    assert_eq!(group_of("model.diffusion_model.final_layer.linear.bias"), "final_layer");
    assert_eq!(group_of("model.diffusion_model.x_pad_token"), "prelude");
    let l = layout(&ZImageConfig::reduced(256, 2, 2, 64));
    assert_eq!(
        l[1..5],
        [Block::ContextRefiner(0), Block::ContextRefiner(1), Block::NoiseRefiner(0), Block::NoiseRefiner(1)]
    );
}

#[test]
fn rope_ids_are_the_references() {
    let (txt, w, h) = (3, 4, 6); // 3 text tokens padded to 32; 2x3 image tokens padded to 32
    let pe = rope_pe(txt, (w, h));
    assert_eq!(pe.len(), 64 * 64 * 4);
    // The first pair of each axis rotates by the position itself (omega 1).
    let first = |t: usize, axis_offset: usize| pe[(t * 64 + axis_offset) * 4 + 2].asin();
    let (a0, a1, a2) = (0, 16, 40);
    for t in 0..32 {
        assert!((first(t, a0) - ((t + 1) as f32).sin().asin()).abs() < 1e-6, "text token {t}");
        assert_eq!((first(t, a1), first(t, a2)), (0.0, 0.0));
    }
    // Image token (row 1, col 1): index 33 (its sine), row 1, col 1.
    let t = 32 + 2 + 1;
    assert!((pe[(t * 64) * 4 + 2] - 33f32.sin()).abs() < 1e-6);
    assert!((first(t, a1) - 1.0).abs() < 1e-6 && (first(t, a2) - 1.0).abs() < 1e-6);
    // Pad image tokens: position zero (identity rotations).
    let pad = 32 + 6;
    assert!(pe[pad * 256..].chunks(4).all(|c| c == [1.0, -0.0, 0.0, 1.0]));
}

#[test]
fn patches_hold_their_channels_innermost_and_invert() {
    let mut runner = Runner::new("zimage", backend());
    let (w, h, c) = (4i64, 6i64, 3i64);
    let x: Vec<f32> = (0..w * h * c).map(|i| i as f32).collect();
    let (p, shape) = run_graph(&mut runner, &[(&[w, h, c, 1], &x)], 64, |g, ins| Ok(patchify(g, ins[0]))).unwrap();
    assert_eq!(shape[..2], [4 * c, (w / 2) * (h / 2)]);
    for (tok, vals) in p.chunks(4 * c as usize).enumerate() {
        let (row, col) = (tok as i64 / (w / 2), tok as i64 % (w / 2));
        for (k, &v) in vals.iter().enumerate() {
            let (ch, py, px) = (k as i64 % c, (k as i64 / c) / 2, (k as i64 / c) % 2);
            assert_eq!(v, x[(ch * h * w + (2 * row + py) * w + 2 * col + px) as usize], "token {tok} value {k}");
        }
    }
    let (back, _) =
        run_graph(&mut runner, &[(&[w, h, c, 1], &x)], 64, |g, ins| Ok(unpatchify(g, patchify(g, ins[0]), w, h)))
            .unwrap();
    assert_eq!(back, x);
}

#[test]
fn the_graph_runs_and_reads_every_input() {
    let cfg = tiny();
    let mut model = ZImageModel::new(cfg.clone(), &|_| Some(F16), None).unwrap();
    model.weights = random_weights(zimage_specs(&cfg, &|_| Some(F16), None), values);
    let mut runner = Runner::new("zimage", backend());
    let (w, h) = (8, 6);
    let x = seeded_uniform(1, "x", 16 * w * h);
    let ctx = seeded_uniform(2, "ctx", 5 * 64);
    let out = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx, 5).unwrap();
    assert_eq!(out.len(), x.len());
    assert!(out.iter().all(|v| v.is_finite()));
    let again = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx, 5).unwrap();
    assert_eq!(out, again, "deterministic");
    let other_t = model.eval_one(&mut runner, &x, (w, h), 900.0, &ctx, 5).unwrap();
    let ctx2 = seeded_uniform(3, "ctx", 5 * 64);
    let other_ctx = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx2, 5).unwrap();
    let fewer = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx[..4 * 64], 4).unwrap();
    for (what, o) in [("timestep", &other_t), ("context", &other_ctx), ("text length", &fewer)] {
        let d = o.iter().zip(&out).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d > 1e-3, "the {what} changes nothing ({d})");
    }
    let err = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx[..10], 1).unwrap_err().to_string();
    assert!(err.contains("context has 10 values"), "{err}");
}
