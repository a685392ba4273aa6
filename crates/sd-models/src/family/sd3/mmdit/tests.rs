//! MMDiT tests: config inference from tensor names (SD3.5 Large, Medium's MMDiT-X, the q/k
//! norms, and the errors), the groups and row splits, the position table's centre crop and the
//! patch order, and the whole graph on a tiny random model.

use sd_backends::GgmlType;
use sd_sched::Runner;

use super::*;
use crate::diffusion::run_graph;
use crate::text::clip::test_support::{backend, random_weights, seeded_uniform};

const F16: GgmlType = GgmlType::GGML_TYPE_F16;

/// 3 blocks of width 48 (3 heads of 16), MMDiT-X on the first 2, a table of side 6, a pooled
/// vector of 20 and a context of 24.
fn tiny() -> MmditConfig {
    MmditConfig {
        hidden_size: 48,
        depth: 3,
        adm_in_channels: 20,
        context_size: 24,
        pos_embed_max_size: 6,
        self_attn_blocks: 2,
        ..MmditConfig::sd35_large()
    }
}

fn file(cfg: &MmditConfig) -> Vec<(String, Vec<u64>)> {
    mmdit_specs(cfg, &|_| Some(F16), None)
        .into_iter()
        .map(|s| (s.name, s.ne.iter().map(|&d| d as u64).collect()))
        .collect()
}

/// Norm weights 1 +- 0.2, biases and the position table of scale 0.1 and 0.5, linear weights of
/// variance ~1/fan_in.
fn values(name: &str, ne: &[i64]) -> Vec<f32> {
    let n = ne.iter().product::<i64>() as usize;
    let u = seeded_uniform(0x5d3_0001, name, n);
    let (scale, offset) = if name.contains(".ln_") && name.ends_with(".weight") {
        (0.2, 1.0)
    } else if name.ends_with("pos_embed") {
        (0.5, 0.0)
    } else if ne.len() == 1 {
        (0.1, 0.0)
    } else {
        let fan_in = if ne.len() == 4 { ne[0] * ne[1] * ne[2] } else { ne[0] };
        ((3.0 / fan_in as f32).sqrt(), 0.0)
    };
    u.into_iter().map(|x| x * scale + offset).collect()
}

#[test]
fn config_is_inferred_from_the_file_as_the_reference_does() {
    for cfg in [MmditConfig::sd35_large(), MmditConfig::sd35_medium(), tiny()] {
        assert_eq!(MmditConfig::from_file(&file(&cfg)).unwrap(), cfg);
    }
    let large = MmditConfig::sd35_large();
    assert_eq!((large.num_heads(), large.head_dim(), large.mlp_hidden()), (38, 64, 9728));
    // SD3 Medium: no q/k norm; a LayerNorm q/k norm has biases.
    for qk in [QkNorm::None, QkNorm::Ln] {
        let cfg = MmditConfig { qk_norm: qk, ..tiny() };
        assert_eq!(MmditConfig::from_file(&file(&cfg)).unwrap().qk_norm, qk);
    }
    // The last block's context stream ends with the attention: no projection, MLP or norm2, 2 chunks.
    let names: Vec<String> = file(&tiny()).into_iter().map(|(n, _)| n).collect();
    assert!(!names.iter().any(|n| n.contains("joint_blocks.2.context_block.mlp.")));
    assert!(!names.iter().any(|n| n.contains("joint_blocks.2.context_block.attn.proj.")));
    assert!(names.iter().any(|n| n.contains("joint_blocks.1.context_block.attn.proj.weight")));
    assert!(names.iter().any(|n| n.contains("joint_blocks.1.x_block.attn2.qkv.weight")));
    assert!(!names.iter().any(|n| n.contains("joint_blocks.2.x_block.attn2.")));
    let specs = mmdit_specs(&tiny(), &|_| Some(F16), None);
    let spec = |n: &str| specs.iter().find(|s| s.name == format!("{PREFIX}.{n}")).unwrap().clone();
    assert_eq!(spec("joint_blocks.2.context_block.adaLN_modulation.1.weight").ne, [48, 2 * 48]);
    assert_eq!(spec("joint_blocks.0.x_block.adaLN_modulation.1.weight").ne, [48, 9 * 48]);
    assert_eq!(spec("joint_blocks.2.x_block.adaLN_modulation.1.weight").ne, [48, 6 * 48]);
    // The reference keeps the embedders and the final projection in f32, the rest in the file's type.
    assert_eq!(spec("context_embedder.weight").ty, GgmlType::GGML_TYPE_F32);
    assert_eq!(spec("final_layer.linear.weight").ty, GgmlType::GGML_TYPE_F32);
    assert_eq!(spec("x_embedder.proj.weight").ty, F16);
    assert_eq!(spec("joint_blocks.0.x_block.attn.qkv.weight").ty, F16);

    let mut no_embedder = file(&tiny());
    no_embedder.retain(|(n, _)| !n.ends_with("x_embedder.proj.weight"));
    let err = MmditConfig::from_file(&no_embedder).unwrap_err().to_string();
    assert!(err.contains("x_embedder.proj.weight"), "{err}");
    let mut odd_table = file(&tiny());
    for (n, ne) in &mut odd_table {
        if n.ends_with("pos_embed") {
            ne[1] = 35;
        }
    }
    let err = MmditConfig::from_file(&odd_table).unwrap_err().to_string();
    assert!(err.contains("35 positions") && err.contains("pos_embed"), "{err}");
    let mut heads = file(&tiny());
    heads.retain(|(n, _)| !n.contains("joint_blocks.2."));
    heads.push((format!("{PREFIX}.joint_blocks.4.x_block.attn.qkv.bias"), vec![144]));
    let err = MmditConfig::from_file(&heads).unwrap_err().to_string();
    assert!(err.contains("not a multiple of the 5 heads"), "{err}");
    let mut bad_index = file(&tiny());
    bad_index.push((format!("{PREFIX}.joint_blocks.x.x_block.attn.qkv.bias"), vec![144]));
    let err = MmditConfig::from_file(&bad_index).unwrap_err().to_string();
    assert!(err.contains("joint_blocks.x.x_block"), "{err}");
}

#[test]
fn groups_and_row_splits_follow_the_graph() {
    assert_eq!(group_of("model.diffusion_model.joint_blocks.7.x_block.attn.qkv.weight"), "joint_blocks.7");
    assert_eq!(group_of("model.diffusion_model.final_layer.linear.bias"), "final_layer");
    assert_eq!(group_of("model.diffusion_model.pos_embed"), "prelude");
    assert_eq!(group_of("model.diffusion_model.context_embedder.weight"), "prelude");
    let specs = mmdit_specs(&tiny(), &|_| Some(F16), None);
    let split: Vec<&str> = specs.iter().filter(|s| row_splittable(s)).map(|s| s.name.as_str()).collect();
    assert!(split.contains(&"model.diffusion_model.joint_blocks.0.x_block.attn2.proj.weight"));
    assert!(split.contains(&"model.diffusion_model.joint_blocks.2.context_block.adaLN_modulation.1.weight"));
    assert!(split.iter().all(|n| n.contains("joint_blocks.") && n.ends_with(".weight")));
    assert!(!split.iter().any(|n| n.contains(".ln_")));
    assert_eq!(layout(&tiny()), [Block::Prelude, Block::Joint(0), Block::Joint(1), Block::Joint(2), Block::Final]);
}

#[test]
fn the_position_table_is_cropped_at_its_centre() {
    let cfg = tiny();
    let mut runner = Runner::new("mmdit", backend());
    let weights = random_weights(mmdit_specs(&cfg, &|_| Some(F16), None), values);
    let table = values(&format!("{PREFIX}.pos_embed"), &[48, 36, 1]);
    for (h, w) in [(2i64, 4i64), (6, 6), (3, 1)] {
        let (out, shape) =
            run_graph(&mut runner, &[(&[1], &[0.0])], 64, |g, _| cropped_pos_embed(g, &weights, &cfg, h, w)).unwrap();
        assert_eq!(shape[..2], [48, h * w]);
        let (top, left) = ((6 - h) / 2, (6 - w) / 2);
        for r in 0..h {
            for c in 0..w {
                let at = ((top + r) * 6 + left + c) as usize * 48;
                let tok = (r * w + c) as usize * 48;
                assert_eq!(out[tok..tok + 48], table[at..at + 48], "patch ({r}, {c}) of {h}x{w}");
            }
        }
    }
}

#[test]
fn the_output_patches_hold_their_channels_innermost() {
    let mut runner = Runner::new("mmdit", backend());
    let (w, h, c) = (4i64, 6i64, 3i64);
    let tokens = (w / 2) * (h / 2);
    let x: Vec<f32> = (0..4 * c * tokens).map(|i| i as f32).collect();
    let (out, shape) =
        run_graph(&mut runner, &[(&[4 * c, tokens, 1], &x)], 64, |g, ins| Ok(unpatchify(g, ins[0], 2, w, h))).unwrap();
    assert_eq!(shape, [w, h, c, 1]);
    for ch in 0..c {
        for y in 0..h {
            for xx in 0..w {
                let tok = (y / 2) * (w / 2) + xx / 2;
                let k = ((y % 2) * 2 + xx % 2) * c + ch;
                assert_eq!(out[(ch * h * w + y * w + xx) as usize], x[(tok * 4 * c + k) as usize], "({ch}, {y}, {xx})");
            }
        }
    }
}

#[test]
fn the_graph_runs_and_reads_every_input() {
    let cfg = tiny();
    let mut model = MmditModel::new(cfg.clone(), &|_| Some(F16), None).unwrap();
    model.weights = random_weights(mmdit_specs(&cfg, &|_| Some(F16), None), values);
    let mut runner = Runner::new("mmdit", backend());
    let (w, h) = (8, 6);
    let x = seeded_uniform(1, "x", 16 * w * h);
    let ctx = seeded_uniform(2, "ctx", 5 * 24);
    let y = seeded_uniform(3, "y", 20);
    let out = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx, 5, &y).unwrap();
    assert_eq!(out.len(), x.len());
    assert!(out.iter().all(|v| v.is_finite()));
    assert_eq!(out, model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx, 5, &y).unwrap(), "deterministic");
    let other_t = model.eval_one(&mut runner, &x, (w, h), 900.0, &ctx, 5, &y).unwrap();
    let other_ctx = model.eval_one(&mut runner, &x, (w, h), 500.0, &seeded_uniform(4, "ctx", 5 * 24), 5, &y).unwrap();
    let other_y = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx, 5, &seeded_uniform(5, "y", 20)).unwrap();
    let fewer = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx[..4 * 24], 4, &y).unwrap();
    // Skip-layer guidance's pass: a block left out changes the prediction; a block the model
    // does not have is no block (as in the reference).
    let skipped = model.eval_skipping(&mut runner, &x, (w, h), 500.0, (&ctx, 5), &y, &[0]).unwrap();
    let none = model.eval_skipping(&mut runner, &x, (w, h), 500.0, (&ctx, 5), &y, &[99]).unwrap();
    assert_eq!(none, out, "skipping a block the model lacks");
    for (what, o) in [
        ("timestep", &other_t),
        ("context", &other_ctx),
        ("pooled vector", &other_y),
        ("text length", &fewer),
        ("skipped block", &skipped),
    ] {
        let d = o.iter().zip(&out).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(d > 1e-3, "the {what} changes nothing ({d})");
    }
    let err = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx[..10], 1, &y).unwrap_err().to_string();
    assert!(err.contains("context has 10 values"), "{err}");
    let err = model.eval_one(&mut runner, &x, (w, h), 500.0, &ctx, 5, &y[..3]).unwrap_err().to_string();
    assert!(err.contains("pooled vector has 3 values"), "{err}");
    // A latent beyond the position table (6x6 patches) is refused, naming both sizes.
    let big = seeded_uniform(1, "x", 16 * 14 * 14);
    let err = model.eval_one(&mut runner, &big, (14, 14), 500.0, &ctx, 5, &y).unwrap_err().to_string();
    assert!(err.contains("7x7 patches") && err.contains("6x6"), "{err}");
}
