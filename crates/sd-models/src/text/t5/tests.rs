//! T5 encoder tests: parameter inventory, storage types, buckets, and the graph against an f64
//! implementation written from the math (random weights, tiny config).

use sd_backends::GgmlType;
use sd_sched::{Runner, Weights};

use super::*;
use crate::text::clip::test_support::{activation, backend, diff, random_weights, seeded_uniform};
use crate::text::clip::Activation;

const F32: GgmlType = GgmlType::GGML_TYPE_F32;
const F16: GgmlType = GgmlType::GGML_TYPE_F16;
const Q8_0: GgmlType = GgmlType::GGML_TYPE_Q8_0;

fn tiny() -> T5Config {
    T5Config { d_model: 32, n_heads: 4, d_kv: 8, d_ff: 48, n_layers: 3, ..T5Config::xxl() }
}

/// Deterministic values uniform in [-1, 1), seeded by the tensor's name.
fn uniform(name: &str, n: usize) -> Vec<f32> {
    seeded_uniform(0x9e37_79b9_7f4a_7c15, name, n)
}

/// Norm gains 1 +- 0.2, embeddings of scale 1, relative biases of scale 2 (so they matter),
/// linear weights of variance ~1/fan_in.
fn values(name: &str, ne: &[i64]) -> Vec<f32> {
    let n = ne.iter().product::<i64>() as usize;
    let (scale, offset) = if name.ends_with("layer_norm.weight") {
        (0.2, 1.0)
    } else if name.ends_with("shared.weight") {
        (1.0, 0.0)
    } else if name.ends_with("relative_attention_bias.weight") {
        (2.0, 0.0)
    } else {
        ((3.0 / ne[0] as f32).sqrt(), 0.0)
    };
    uniform(name, n).into_iter().map(|x| x * scale + offset).collect()
}

fn weights(cfg: &T5Config, file_type: GgmlType) -> Weights {
    random_weights(t5_specs(cfg, &|_| Some(file_type), None), values)
}

// --- the f64 reference -----------------------------------------------------------------

type Rows = Vec<Vec<f64>>;

fn rms(x: &Rows, w: &[f64], eps: f64) -> Rows {
    x.iter()
        .map(|r| {
            let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64 + eps).sqrt();
            r.iter().zip(w).map(|(v, g)| v * inv * g).collect()
        })
        .collect()
}

/// `w` stored as PyTorch [out][in].
fn linear(x: &Rows, w: &[f64], out: usize) -> Rows {
    x.iter().map(|r| (0..out).map(|o| (0..r.len()).map(|i| w[o * r.len() + i] * r[i]).sum()).collect()).collect()
}

/// The bucket of relative position `rel` (key minus query), from the definition in f64.
fn bucket_f64(cfg: &T5Config, rel: i64) -> usize {
    let half = cfg.num_buckets / 2;
    let max_exact = half / 2;
    let dist = rel.unsigned_abs() as usize;
    let dir = if rel > 0 { half } else { 0 };
    if dist < max_exact {
        return dir + dist;
    }
    let large = max_exact
        + ((dist as f64 / max_exact as f64).ln() / (cfg.max_distance as f64 / max_exact as f64).ln()
            * (half - max_exact) as f64) as usize;
    dir + large.min(half - 1)
}

fn reference(cfg: &T5Config, seq: &[u32]) -> Vec<f64> {
    reference_with(cfg, seq, &values)
}

/// The encoder in f64 on the weights `value_of(internal name, ne)` gives.
fn reference_with(cfg: &T5Config, seq: &[u32], value_of: &dyn Fn(&str, &[i64]) -> Vec<f32>) -> Vec<f64> {
    let specs = t5_specs(cfg, &|_| None, None);
    let p = |name: String| -> Vec<f64> {
        let spec = specs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name}"));
        value_of(&name, &spec.ne).into_iter().map(f64::from).collect()
    };
    let (d, h, dk, l) = (cfg.d_model, cfg.n_heads, cfg.d_kv, seq.len());
    let eps = cfg.eps as f64;
    let shared = p(cfg.name("shared.weight"));
    let rel = p(cfg.relative_bias_name()); // torch [buckets][heads]
    let mut x: Rows = seq.iter().map(|&id| shared[id as usize * d..(id as usize + 1) * d].to_vec()).collect();
    for i in 0..cfg.n_layers {
        let b = |s: &str| p(cfg.block(i, s));
        let a = rms(&x, &b("layer.0.layer_norm.weight"), eps);
        let proj = |n: &str, t: &Rows, out: usize| linear(t, &b(&format!("layer.0.SelfAttention.{n}.weight")), out);
        let (q, k, v) = (proj("q", &a, h * dk), proj("k", &a, h * dk), proj("v", &a, h * dk));
        let mut att = vec![vec![0.0; h * dk]; l];
        for head in 0..h {
            let r = head * dk..(head + 1) * dk;
            for tq in 0..l {
                let s: Vec<f64> = (0..l)
                    .map(|tk| {
                        let dot: f64 = q[tq][r.clone()].iter().zip(&k[tk][r.clone()]).map(|(a, b)| a * b).sum();
                        dot + rel[bucket_f64(cfg, tk as i64 - tq as i64) * h + head]
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (tk, pr) in e.iter().enumerate() {
                    for j in r.clone() {
                        att[tq][j] += pr / z * v[tk][j];
                    }
                }
            }
        }
        let o = linear(&att, &b("layer.0.SelfAttention.o.weight"), d);
        x = x.iter().zip(&o).map(|(a, b)| a.iter().zip(b).map(|(p, q)| p + q).collect()).collect();
        let f = rms(&x, &b("layer.1.layer_norm.weight"), eps);
        let gate = linear(&f, &b("layer.1.DenseReluDense.wi_0.weight"), cfg.d_ff);
        let up = linear(&f, &b("layer.1.DenseReluDense.wi_1.weight"), cfg.d_ff);
        let hid: Rows = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g.iter().zip(u).map(|(g, u)| activation(Activation::GeluTanh, *g) * u).collect())
            .collect();
        let o = linear(&hid, &b("layer.1.DenseReluDense.wo.weight"), d);
        x = x.iter().zip(&o).map(|(a, b)| a.iter().zip(b).map(|(p, q)| p + q).collect()).collect();
    }
    rms(&x, &p(cfg.name("encoder.final_layer_norm.weight")), eps).into_iter().flatten().collect()
}

// --- tests -----------------------------------------------------------------------------

#[test]
fn xxl_has_the_published_parameter_count_and_names() {
    let cfg = T5Config::xxl();
    cfg.validate().unwrap();
    let specs = t5_specs(&cfg, &|_| Some(F16), None);
    let total: i64 = specs.iter().map(|s| s.ne.iter().product::<i64>()).sum();
    // google/t5-v1_1-xxl's encoder (T5EncoderModel): 4,762,310,656 parameters.
    assert_eq!(total, 4_762_310_656);
    assert_eq!(specs.len(), 1 + 24 * 9 + 1 + 1);
    let find =
        |n: &str| specs.iter().find(|s| s.name == format!("{T5XXL_PREFIX}.{n}")).unwrap_or_else(|| panic!("{n}"));
    assert_eq!(find("shared.weight").ne, [4096, 32128]);
    assert_eq!(find("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight").ne, [64, 32]);
    assert_eq!(find("encoder.block.23.layer.1.DenseReluDense.wo.weight").ne, [10240, 4096]);
    assert_eq!(find("encoder.block.23.layer.1.DenseReluDense.wi_0.weight").ne, [4096, 10240]);
    assert_eq!(find("encoder.final_layer_norm.weight").ne, [4096]);
    assert!(!specs.iter().any(|s| s.name.contains("block.1.layer.0.SelfAttention.relative_attention_bias")));
    // f16 file: 9.5 GB of weights (the figure), norms f32.
    let bytes: i64 = specs.iter().map(|s| s.ne.iter().product::<i64>() * if s.ty == F16 { 2 } else { 4 }).sum();
    assert_eq!(bytes, 2 * 4_762_310_656 + 2 * (24 * 2 + 1) * 4096);
}

#[test]
fn storage_types_follow_the_reference_rules() {
    let cfg = T5Config::xxl();
    let ty = |specs: &[TensorSpec], n: &str| specs.iter().find(|s| s.name == format!("{T5XXL_PREFIX}.{n}")).unwrap().ty;
    let names = [
        "shared.weight",
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "encoder.block.0.layer.0.SelfAttention.q.weight",
        "encoder.block.0.layer.0.layer_norm.weight",
        "encoder.final_layer_norm.weight",
    ];
    let q4k = GgmlType::GGML_TYPE_Q4_K;
    for (file, wtype, want, why) in [
        (F16, None, [F16, F16, F16, F32, F32], "f16 file: kept, norms f32"),
        (Q8_0, None, [Q8_0, Q8_0, Q8_0, F32, F32], "q8_0 file: gathers rows of q8_0"),
        (q4k, None, [F32, F32, q4k, F32, F32], "k-quant file: tables get_rows cannot read become f32"),
        (
            F16,
            Some(Q8_0),
            [Q8_0, Q8_0, Q8_0, F32, F32],
            "--type q8_0 converts the tables too (no `embedding` in their names)",
        ),
    ] {
        let specs = t5_specs(&cfg, &|_| Some(file), wtype);
        let got = names.map(|n| ty(&specs, n));
        assert_eq!(got, want, "{why}");
    }
}

#[test]
fn buckets_match_the_definition() {
    // Rule: bidirectional buckets, 16 per direction, 8 exact, log-spaced up to distance 128.
    let cfg = T5Config::xxl();
    let len = 300;
    let b = relative_position_buckets(&cfg, len);
    assert_eq!(b.len(), len * len);
    let at = |q: usize, k: usize| b[q * len + k];
    assert_eq!([at(0, 0), at(1, 0), at(0, 1), at(8, 0), at(0, 8)], [0, 1, 17, 8, 24]);
    assert_eq!([at(16, 0), at(0, 16), at(127, 0), at(128, 0), at(0, 299)], [10, 26, 15, 15, 31]);
    for q in 0..len {
        for k in 0..len {
            assert_eq!(at(q, k) as usize, bucket_f64(&cfg, k as i64 - q as i64), "query {q} key {k}");
        }
    }
}

#[test]
fn graph_matches_an_f64_encoder() {
    let cfg = tiny();
    let w = weights(&cfg, F32);
    let enc = T5Encoder::new(&cfg, &w).unwrap();
    let mut runner = Runner::new("t5", backend());
    // 40 tokens: distances up to 39 reach the logarithmic buckets.
    let ids: Vec<u32> = (0..80u32).map(|i| (i * 7919 + 13) % 32128).collect();
    let got = enc.encode_ids(&mut runner, &ids, 40).unwrap();
    let want: Vec<f64> = ids.chunks(40).flat_map(|s| reference(&cfg, s)).collect();
    let (max, mean) = diff(&got, &want);
    // f32 graph against f64; GELU's f16 table is emulated in the reference.
    assert!(max < 2e-3 && mean < 2e-5, "max {max:e}, mean {mean:e}");
    // Batched (2 sequences in one graph) and one-by-one agree.
    let first = enc.encode_ids(&mut runner, &ids[..40], 40).unwrap();
    assert_eq!(first[..], got[..first.len()]);
}

#[test]
fn quantized_and_half_weights_stay_close() {
    let cfg = tiny();
    let mut runner = Runner::new("t5", backend());
    let ids: Vec<u32> = (0..24u32).map(|i| (i * 104_729 + 5) % 32100).collect();
    let want = reference(&cfg, &ids);
    // Bounds: the weights' own rounding (f16 keeps 11 significant bits, bf16 8, q8_0 about
    // 7 per block of 32, and ggml's q8_0 product quantizes the activations to q8_0 too)
    // through 3 blocks of unit-scale activations, with margin over the figures measured
    // here (f16 7.8e-3 / 1.5e-3, bf16 6.5e-2 / 1.1e-2, q8_0 1.2e-1 / 2.6e-2, max / mean); a
    // wrong dequantization or layout gives differences of order 1.
    for (ty, max_bound, mean_bound) in [(F16, 3e-2, 4e-3), (GgmlType::GGML_TYPE_BF16, 2e-1, 2.5e-2), (Q8_0, 3e-1, 5e-2)]
    {
        let w = weights(&cfg, ty);
        let got = T5Encoder::new(&cfg, &w).unwrap().encode_ids(&mut runner, &ids, 24).unwrap();
        let (max, mean) = diff(&got, &want);
        eprintln!("{ty:?}: max {max:e}, mean {mean:e}");
        assert!(got.iter().all(|v| v.is_finite()), "{ty:?}");
        assert!(mean < mean_bound && max < max_bound, "{ty:?}: max {max:e}, mean {mean:e}");
    }
}

#[test]
fn bad_input_is_an_error_not_a_crash() {
    let cfg = tiny();
    let w = weights(&cfg, F32);
    let enc = T5Encoder::new(&cfg, &w).unwrap();
    let mut runner = Runner::new("t5", backend());
    let err = enc.encode_ids(&mut runner, &[5, 32128, 1], 3).unwrap_err();
    assert!(matches!(err, T5Error::TokenId { id: 32128, position: 1, .. }), "{err}");
    assert!(err.to_string().contains("32128"));
    assert!(matches!(enc.encode_ids(&mut runner, &[1, 2, 3], 2), Err(T5Error::IdsLength { got: 3, len: 2 })));
    assert!(matches!(enc.encode_ids(&mut runner, &[], 2), Err(T5Error::IdsLength { .. })));
    assert!(matches!(enc.encode_ids(&mut runner, &[1], 0), Err(T5Error::IdsLength { .. })));

    // A weight set lacking a tensor, or with a wrong shape, is refused by name.
    let mut specs = t5_specs(&cfg, &|_| Some(F32), None);
    let rel = cfg.relative_bias_name();
    specs.retain(|s| s.name != rel);
    let mut partial = Weights::new(specs.clone()).unwrap();
    partial.allocate(backend().device().buffer_type()).unwrap();
    match T5Encoder::new(&cfg, &partial) {
        Err(T5Error::MissingWeight(n)) => assert_eq!(n, rel),
        other => panic!("expected MissingWeight, got {other:?}"),
    }
    let bigger = T5Config { d_ff: 64, ..cfg.clone() };
    match T5Encoder::new(&bigger, &w) {
        Err(T5Error::WeightShape { name, .. }) => assert!(name.contains("DenseReluDense"), "{name}"),
        other => panic!("expected WeightShape, got {other:?}"),
    }
    let unallocated = Weights::new(t5_specs(&cfg, &|_| Some(F32), None)).unwrap();
    assert!(matches!(T5Encoder::new(&cfg, &unallocated), Err(T5Error::NotAllocated)));
    for bad in [T5Config { n_layers: 0, ..cfg.clone() }, T5Config { num_buckets: 6, ..cfg.clone() }] {
        assert!(matches!(bad.validate(), Err(T5Error::Config(_))), "{bad:?}");
    }
}

#[test]
fn fixture_files_load_through_the_file_readers() {
    use crate::files::{ModelFiles, ModelSources};
    use crate::fixture::{self, t5, FileFormat, WeightType};
    use crate::loader::{dtype_of, FileSource};

    let cfg = tiny();
    let seed = 7;
    let table = t5::t5xxl_tensor_table(&cfg);
    let value_of = |name: &str, _: &[i64]| -> Vec<f32> {
        let file_name = name.strip_prefix(&format!("{T5XXL_PREFIX}.")).unwrap();
        fixture::tensor_values(table.iter().find(|t| t.name == file_name).unwrap(), seed)
    };
    let ids: Vec<u32> = (0..16u32).map(|i| (i * 613 + 2) % 32100).collect();
    let want = reference_with(&cfg, &ids, &value_of);
    let dir = tempfile::tempdir().unwrap();
    let mut runner = Runner::new("t5", backend());
    for (wtype, format, max_bound, mean_bound) in [
        (WeightType::F32, FileFormat::Safetensors, 2e-3, 2e-5),
        (WeightType::F16, FileFormat::Safetensors, 3e-2, 4e-3),
        (WeightType::Q8_0, FileFormat::Gguf, 3e-1, 5e-2),
    ] {
        let path = dir.path().join(format!("t5xxl-{wtype}.{}", format.extension()));
        let report = t5::write_t5xxl(&path, &cfg, seed, wtype, format).unwrap();
        assert_eq!(report.tensors, table.len());
        let files = ModelFiles::open(&ModelSources { t5xxl: Some(path.clone()), ..Default::default() }).unwrap();
        let mut w = Weights::new(t5_specs(&cfg, &dtype_of(&files), None)).unwrap();
        w.allocate(backend().device().buffer_type()).unwrap();
        w.load_from(&FileSource::new(&files)).unwrap();
        let got = T5Encoder::new(&cfg, &w).unwrap().encode_ids(&mut runner, &ids, ids.len()).unwrap();
        let (max, mean) = diff(&got, &want);
        assert!(max < max_bound && mean < mean_bound, "{wtype}: max {max:e}, mean {mean:e}");
    }
}

#[test]
fn file_names_normalize_to_the_encoder_names() {
    use crate::files::names::t5xxl_name;
    // Every tensor of the fixture (the downloaded files' names) is one the encoder declares.
    let cfg = T5Config { n_layers: 2, ..T5Config::xxl() };
    let specs = t5_specs(&cfg, &|_| None, None);
    let table = crate::fixture::t5::t5xxl_tensor_table(&cfg);
    assert_eq!(table.len(), specs.len());
    for t in &table {
        let name = t5xxl_name(&t.name);
        let spec = specs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("{} -> {name}", t.name));
        let torch: Vec<i64> = spec.ne.iter().rev().copied().collect();
        assert_eq!(torch, t.shape.iter().map(|&v| v as i64).collect::<Vec<_>>(), "{name}");
    }
    // llama.cpp's GGUF names (the reference's t5_name_map) and prefixed names.
    for (file, internal) in [
        ("enc.blk.3.attn_q.weight", "encoder.block.3.layer.0.SelfAttention.q.weight"),
        ("enc.blk.0.attn_rel_b.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        ("enc.blk.11.ffn_gate.weight", "encoder.block.11.layer.1.DenseReluDense.wi_0.weight"),
        ("enc.blk.11.ffn_up.weight", "encoder.block.11.layer.1.DenseReluDense.wi_1.weight"),
        ("enc.blk.11.ffn_down.weight", "encoder.block.11.layer.1.DenseReluDense.wo.weight"),
        ("enc.blk.2.attn_norm.weight", "encoder.block.2.layer.0.layer_norm.weight"),
        ("enc.blk.2.ffn_norm.weight", "encoder.block.2.layer.1.layer_norm.weight"),
        ("enc.output_norm.weight", "encoder.final_layer_norm.weight"),
        ("token_embd.weight", "shared.weight"),
        ("text_encoders.t5xxl.transformer.shared.weight", "shared.weight"),
        ("encoder.block.5.layer.0.SelfAttention.o.weight", "encoder.block.5.layer.0.SelfAttention.o.weight"),
    ] {
        assert_eq!(t5xxl_name(file), format!("{T5XXL_PREFIX}.{internal}"), "{file}");
    }
}

#[test]
fn row_splits_cut_the_seven_block_matmuls_only() {
    let cfg = tiny();
    let specs = t5_specs(&cfg, &|_| Some(F16), None);
    let cut: Vec<&str> = specs.iter().filter(|s| row_splittable(s)).map(|s| s.name.as_str()).collect();
    assert_eq!(cut.len(), 7 * cfg.n_layers, "{cut:?}");
    for leaf in ["q", "k", "v", "o"] {
        assert!(cut.contains(&cfg.block(2, &format!("layer.0.SelfAttention.{leaf}.weight")).as_str()), "{leaf}");
    }
    for leaf in ["wi_0", "wi_1", "wo"] {
        assert!(cut.contains(&cfg.block(0, &format!("layer.1.DenseReluDense.{leaf}.weight")).as_str()), "{leaf}");
    }
    // Gathered tables and norms stay whole.
    for name in [cfg.name("shared.weight"), cfg.relative_bias_name(), cfg.block(1, "layer.0.layer_norm.weight")] {
        assert!(!cut.contains(&name.as_str()), "{name}");
    }
}
