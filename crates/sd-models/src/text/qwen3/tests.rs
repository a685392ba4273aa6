//! Qwen3 encoder tests: parameter inventory, and the graph against an f64 implementation
//! written from the math (random weights, tiny config), for the final norm and a middle layer.

use sd_backends::GgmlType;
use sd_sched::{Runner, Weights};

use super::*;
use crate::text::clip::test_support::{backend, diff, random_weights, seeded_uniform};

const F32: GgmlType = GgmlType::GGML_TYPE_F32;
const F16: GgmlType = GgmlType::GGML_TYPE_F16;

/// Real head layout ratio (4 query heads per key/value head), tiny widths.
fn tiny() -> Qwen3Config {
    Qwen3Config {
        vocab_size: 1000,
        hidden: 48,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 16,
        intermediate: 80,
        n_layers: 3,
        ..Qwen3Config::qwen3_4b()
    }
}

/// Norm gains 1 +- 0.2, embeddings of scale 1, linear weights of variance ~1/fan_in.
fn values(name: &str, ne: &[i64]) -> Vec<f32> {
    let n = ne.iter().product::<i64>() as usize;
    let (scale, offset) = if name.ends_with("norm.weight") {
        (0.2, 1.0)
    } else if name.ends_with("embed_tokens.weight") {
        (1.0, 0.0)
    } else {
        ((3.0 / ne[0] as f32).sqrt(), 0.0)
    };
    seeded_uniform(0x51e5_3c0d_7a2b_9911, name, n).into_iter().map(|x| x * scale + offset).collect()
}

type Rows = Vec<Vec<f64>>;

fn rms(r: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64 + eps).sqrt();
    r.iter().zip(w).map(|(v, g)| v * inv * g).collect()
}

/// `w` stored as PyTorch [out][in].
fn linear(x: &Rows, w: &[f64], out: usize) -> Rows {
    x.iter().map(|r| (0..out).map(|o| (0..r.len()).map(|i| w[o * r.len() + i] * r[i]).sum()).collect()).collect()
}

/// Rotation of one head at position `pos`, angle pos * base^(-2i/d) for pair i: NeoX pairs
/// (i, i + d/2), or with `pairwise` (Mistral's original layout) pairs (2i, 2i + 1).
fn rope(x: &[f64], pos: usize, base: f64, pairwise: bool) -> Vec<f64> {
    let d = x.len();
    let mut out = x.to_vec();
    for i in 0..d / 2 {
        let theta = pos as f64 * base.powf(-2.0 * i as f64 / d as f64);
        let (c, s) = (theta.cos(), theta.sin());
        let (a, b) = if pairwise { (2 * i, 2 * i + 1) } else { (i, i + d / 2) };
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[a] * s + x[b] * c;
    }
    out
}

fn reference(cfg: &Qwen3Config, ids: &[u32], out_layer: usize) -> Vec<f64> {
    reference_with(cfg, ids, out_layer, &values)
}

/// The encoder in f64, as the module doc defines it, on the weights `value_of(internal name,
/// ne)` gives.
fn reference_with(
    cfg: &Qwen3Config,
    ids: &[u32],
    out_layer: usize,
    value_of: &dyn Fn(&str, &[i64]) -> Vec<f32>,
) -> Vec<f64> {
    let specs = qwen3_specs(cfg, &|_| None, None);
    let p = |name: String| -> Vec<f64> {
        let spec = specs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name}"));
        value_of(&name, &spec.ne).into_iter().map(f64::from).collect()
    };
    let (dm, h, kvh, hd, l) = (cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ids.len());
    let eps = cfg.eps as f64;
    let embed = p(cfg.name("embed_tokens.weight"));
    let mut x: Rows = ids.iter().map(|&id| embed[id as usize * dm..(id as usize + 1) * dm].to_vec()).collect();
    let layers = if (1..=cfg.n_layers).contains(&out_layer) { out_layer } else { cfg.n_layers };
    for i in 0..layers {
        let b = |s: &str| p(cfg.layer(i, s));
        let a: Rows = x.iter().map(|r| rms(r, &b("input_layernorm.weight"), eps)).collect();
        let biased = |p: &str, out: usize| {
            let y = linear(&a, &b(&format!("self_attn.{p}_proj.weight")), out);
            if !cfg.arch.qkv_bias() {
                return y;
            }
            let bias = b(&format!("self_attn.{p}_proj.bias"));
            y.into_iter().map(|r| r.iter().zip(&bias).map(|(v, c)| v + c).collect()).collect::<Rows>()
        };
        let q = biased("q", h * hd);
        let k = biased("k", kvh * hd);
        let v = biased("v", kvh * hd);
        let mistral = cfg.arch == LlmArch::Mistral;
        let (qn, kn) = if !cfg.arch.qk_norm() {
            (Vec::new(), Vec::new())
        } else {
            (b("self_attn.q_norm.weight"), b("self_attn.k_norm.weight"))
        };
        let head = |t: &[f64], n: usize, w: &[f64], pos: usize| {
            let t = &t[n * hd..(n + 1) * hd];
            let t = if cfg.arch.qk_norm() { rms(t, w, eps) } else { t.to_vec() };
            rope(&t, pos, cfg.rope_base as f64, mistral)
        };
        let mut att = vec![vec![0.0; h * hd]; l];
        for hq in 0..h {
            let hk = hq / (h / kvh);
            for tq in 0..l {
                let qv = head(&q[tq], hq, &qn, tq);
                // Causal: keys 0..=tq.
                let s: Vec<f64> = (0..=tq)
                    .map(|tk| {
                        qv.iter().zip(head(&k[tk], hk, &kn, tk)).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (tk, pr) in e.iter().enumerate() {
                    for j in 0..hd {
                        att[tq][hq * hd + j] += pr / z * v[tk][hk * hd + j];
                    }
                }
            }
        }
        let o = linear(&att, &b("self_attn.o_proj.weight"), dm);
        x = x.iter().zip(&o).map(|(a, b)| a.iter().zip(b).map(|(p, q)| p + q).collect()).collect();
        let f: Rows = x.iter().map(|r| rms(r, &b("post_attention_layernorm.weight"), eps)).collect();
        let gate = linear(&f, &b("mlp.gate_proj.weight"), cfg.intermediate);
        let up = linear(&f, &b("mlp.up_proj.weight"), cfg.intermediate);
        let hid: Rows = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g.iter().zip(u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect())
            .collect();
        let o = linear(&hid, &b("mlp.down_proj.weight"), dm);
        x = x.iter().zip(&o).map(|(a, b)| a.iter().zip(b).map(|(p, q)| p + q).collect()).collect();
    }
    if layers == out_layer {
        return x.into_iter().flatten().collect();
    }
    let norm = p(cfg.name("norm.weight"));
    x.iter().flat_map(|r| rms(r, &norm, eps)).collect()
}

#[test]
fn qwen3_4b_has_the_published_parameter_count_and_names() {
    let cfg = Qwen3Config::qwen3_4b();
    cfg.validate().unwrap();
    let specs = qwen3_specs(&cfg, &|_| Some(F16), None);
    let total: i64 = specs.iter().map(|s| s.ne.iter().product::<i64>()).sum();
    // Qwen/Qwen3-4B without its (tied) lm_head: 4,022,468,096 parameters.
    assert_eq!(total, 4_022_468_096);
    assert_eq!(specs.len(), 1 + 36 * 11 + 1);
    let find =
        |n: &str| specs.iter().find(|s| s.name == format!("{LLM_PREFIX}.model.{n}")).unwrap_or_else(|| panic!("{n}"));
    assert_eq!(find("embed_tokens.weight").ne, [2560, 151_936]);
    assert_eq!(find("layers.35.self_attn.q_proj.weight").ne, [2560, 4096]);
    assert_eq!(find("layers.35.self_attn.k_proj.weight").ne, [2560, 1024]);
    assert_eq!(find("layers.35.self_attn.o_proj.weight").ne, [4096, 2560]);
    assert_eq!(find("layers.0.self_attn.q_norm.weight").ne, [128]);
    assert_eq!(find("layers.0.mlp.down_proj.weight").ne, [9728, 2560]);
    assert_eq!(find("norm.weight").ty, F32);
    assert_eq!(qwen3_block_of(&find("layers.17.mlp.up_proj.weight").name), Some(17));
}

/// Mistral (FLUX.2 dev's encoder): no q/k norms, pairwise RoPE of base 1e9, eps 1e-5, against
/// the f64 encoder; and the published size of Mistral-Small-3.2's text model.
#[test]
fn mistral_graph_matches_an_f64_encoder() {
    let full = qwen3_specs(&Qwen3Config::mistral_small_3_2(), &|_| Some(F16), None);
    let total: i64 = full.iter().map(|s| s.ne.iter().product::<i64>()).sum();
    // Mistral-Small-3.2-24B's language model without its lm_head (0.67B) and vision tower: 40
    // layers of 555,755,520 (q and o 5120x4096, k and v 5120x1024, SwiGLU 3x5120x32768, two
    // norms) plus the 131072x5120 embedding and the final norm.
    assert_eq!(total, 40 * 555_755_520 + 131_072 * 5120 + 5120);
    assert!(full.iter().all(|s| !s.name.contains("_norm.weight") || !s.name.contains("self_attn")));
    let cfg = Qwen3Config { arch: LlmArch::Mistral, eps: 1e-5, rope_base: 1e9, ..tiny() };
    let w = random_weights(qwen3_specs(&cfg, &|_| Some(F32), None), values);
    let enc = Qwen3Encoder::new(&cfg, &w).unwrap();
    let mut runner = Runner::new("llm", backend());
    let ids: Vec<u32> = (0..19u32).map(|i| (i * 6151 + 29) % 1000).collect();
    for out_layer in [3, 1] {
        let got = enc.encode_ids(&mut runner, &ids, out_layer).unwrap();
        let want = reference(&cfg, &ids, out_layer);
        let (max, mean) = diff(&got, &want);
        assert!(max < 2e-3 && mean < 2e-5, "out layer {out_layer}: max {max:e}, mean {mean:e}");
        // The same weights read as Qwen3's NeoX layout give other states: the layout matters.
        let neox = reference(&Qwen3Config { arch: LlmArch::Qwen3, ..cfg.clone() }, &ids, out_layer);
        assert!(neox.len() != want.len() || diff(&got, &neox).0 > 1e-2);
    }
}

/// Qwen2.5-VL's text model (Qwen-Image's encoder): q/k/v biases, no q/k norms, NeoX RoPE,
/// against the f64 encoder; and the published size of Qwen2.5-VL-7B's language model.
#[test]
fn qwen25_vl_graph_matches_an_f64_encoder() {
    let full = qwen3_specs(&Qwen3Config::qwen25_vl_7b(), &|_| Some(F16), None);
    let total: i64 = full.iter().map(|s| s.ne.iter().product::<i64>()).sum();
    // Qwen2.5-VL-7B's language model without its lm_head (545M) and vision tower: 7.07B.
    assert_eq!(total, 7_070_619_136);
    let bias = full.iter().find(|s| s.name.ends_with("layers.27.self_attn.k_proj.bias")).unwrap();
    assert_eq!((bias.ne.as_slice(), bias.ty), (&[512i64][..], F32));
    let cfg = Qwen3Config { arch: LlmArch::Qwen25Vl, ..tiny() };
    let w = random_weights(qwen3_specs(&cfg, &|_| Some(F32), None), values);
    let enc = Qwen3Encoder::new(&cfg, &w).unwrap();
    let mut runner = Runner::new("llm", backend());
    let ids: Vec<u32> = (0..17u32).map(|i| (i * 4099 + 7) % 1000).collect();
    for out_layer in [35, 2] {
        let got = enc.encode_ids(&mut runner, &ids, out_layer).unwrap();
        let want = reference(&cfg, &ids, out_layer);
        let (max, mean) = diff(&got, &want);
        assert!(max < 2e-3 && mean < 2e-5, "out layer {out_layer}: max {max:e}, mean {mean:e}");
    }
}

#[test]
fn graph_matches_an_f64_encoder() {
    let cfg = tiny();
    let w = random_weights(qwen3_specs(&cfg, &|_| Some(F32), None), values);
    let enc = Qwen3Encoder::new(&cfg, &w).unwrap();
    let mut runner = Runner::new("llm", backend());
    let ids: Vec<u32> = (0..21u32).map(|i| (i * 7919 + 13) % 1000).collect();
    // Final norm (layer past the depth, as Z-Image's 35 on a 3-layer file), the last layer
    // raw, and a middle one.
    for out_layer in [35, 3, 2] {
        let got = enc.encode_ids(&mut runner, &ids, out_layer).unwrap();
        let want = reference(&cfg, &ids, out_layer);
        assert_eq!(got.len(), ids.len() * cfg.hidden);
        let (max, mean) = diff(&got, &want);
        assert!(max < 2e-3 && mean < 2e-5, "out layer {out_layer}: max {max:e}, mean {mean:e}");
    }
    // Causal: a prefix of the sequence gives the prefix of the hidden states.
    let all = enc.encode_ids(&mut runner, &ids, 35).unwrap();
    let head = enc.encode_ids(&mut runner, &ids[..7], 35).unwrap();
    let (max, _) = diff(&head, &all[..head.len()].iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(max < 1e-4, "prefix differs by {max:e}");
}

/// FLUX.2 klein's reading: several layers' states side by side per token (each equal to its
/// own single-layer run), the final norm for `n_layers + 1`; and a padding mask that hides a
/// key from every other query (changing a masked token's id moves only its own row).
#[test]
fn several_layers_and_a_padding_mask() {
    let cfg = tiny();
    let w = random_weights(qwen3_specs(&cfg, &|_| Some(F32), None), values);
    let enc = Qwen3Encoder::new(&cfg, &w).unwrap();
    let mut runner = Runner::new("llm", backend());
    let ids: Vec<u32> = (0..9u32).map(|i| (i * 131 + 7) % 1000).collect();
    let d = cfg.hidden;
    let both = enc.encode(&mut runner, &ids, None, &[1, 3, cfg.n_layers + 1]).unwrap();
    assert_eq!(both.len(), ids.len() * 3 * d);
    let one = enc.encode_ids(&mut runner, &ids, 1).unwrap();
    let three = enc.encode_ids(&mut runner, &ids, 3).unwrap();
    let norm = enc.encode_ids(&mut runner, &ids, 99).unwrap();
    for t in 0..ids.len() {
        let row = &both[t * 3 * d..(t + 1) * 3 * d];
        assert_eq!(&row[..d], &one[t * d..(t + 1) * d], "token {t}, layer 1");
        assert_eq!(&row[d..2 * d], &three[t * d..(t + 1) * d], "token {t}, layer 3");
        assert_eq!(&row[2 * d..], &norm[t * d..(t + 1) * d], "token {t}, final norm");
    }
    // Layers the model lacks are left out; none at all gives the final norm.
    assert_eq!(enc.encode(&mut runner, &ids, None, &[2, 27]).unwrap(), enc.encode_ids(&mut runner, &ids, 2).unwrap());
    assert_eq!(enc.encode(&mut runner, &ids, None, &[9, 18, 27]).unwrap(), norm);

    let mut real = vec![1.0; ids.len()];
    real[3] = 0.0;
    let a = enc.encode(&mut runner, &ids, Some(&real), &[3]).unwrap();
    let mut other = ids.clone();
    other[3] = 999;
    let b = enc.encode(&mut runner, &other, Some(&real), &[3]).unwrap();
    for t in 0..ids.len() {
        let (ra, rb) = (&a[t * d..(t + 1) * d], &b[t * d..(t + 1) * d]);
        if t == 3 {
            assert_ne!(ra, rb, "the masked token's own row reads its id");
        } else {
            assert_eq!(ra, rb, "token {t} saw the masked key");
        }
    }
    // Unmasked, the later tokens do see it.
    let c = enc.encode(&mut runner, &other, None, &[3]).unwrap();
    assert_ne!(&c[5 * d..6 * d], &a[5 * d..6 * d]);
    assert!(enc.encode(&mut runner, &ids, Some(&real[..4]), &[3]).is_err());
    let m = padded_causal_mask(&[1.0, 0.0]);
    let q = -f32::MAX / 4.0;
    assert_eq!(m, vec![0.0, q + q, 0.0, q]);
}

#[test]
fn bad_input_is_an_error_not_a_crash() {
    let cfg = tiny();
    let w = random_weights(qwen3_specs(&cfg, &|_| Some(F32), None), values);
    let enc = Qwen3Encoder::new(&cfg, &w).unwrap();
    let mut runner = Runner::new("llm", backend());
    let err = enc.encode_ids(&mut runner, &[5, 1000, 1], 35).unwrap_err();
    assert!(matches!(err, Qwen3Error::TokenId { id: 1000, position: 1, .. }), "{err}");
    assert!(matches!(enc.encode_ids(&mut runner, &[], 35), Err(Qwen3Error::NoTokens)));

    let mut specs = qwen3_specs(&cfg, &|_| Some(F32), None);
    let knorm = cfg.layer(1, "self_attn.k_norm.weight");
    specs.retain(|s| s.name != knorm);
    let mut partial = Weights::new(specs).unwrap();
    partial.allocate(backend().device().buffer_type()).unwrap();
    match Qwen3Encoder::new(&cfg, &partial) {
        Err(Qwen3Error::MissingWeight(n)) => assert_eq!(n, knorm),
        other => panic!("expected MissingWeight, got {other:?}"),
    }
    let wider = Qwen3Config { intermediate: 96, ..cfg.clone() };
    match Qwen3Encoder::new(&wider, &w) {
        Err(Qwen3Error::WeightShape { name, .. }) => assert!(name.contains("mlp."), "{name}"),
        other => panic!("expected WeightShape, got {other:?}"),
    }
    for bad in [
        Qwen3Config { n_kv_heads: 3, ..cfg.clone() },
        Qwen3Config { head_dim: 15, ..cfg.clone() },
        Qwen3Config { n_layers: 0, ..cfg },
    ] {
        assert!(matches!(bad.validate(), Err(Qwen3Error::Config(_))), "{bad:?}");
    }
}

#[test]
fn row_splits_cut_the_seven_layer_matmuls_only() {
    let cfg = tiny();
    let specs = qwen3_specs(&cfg, &|_| Some(F16), None);
    let cut: Vec<&str> = specs.iter().filter(|s| row_splittable(s)).map(|s| s.name.as_str()).collect();
    assert_eq!(cut.len(), 7 * cfg.n_layers, "{cut:?}");
    for name in [cfg.name("embed_tokens.weight"), cfg.layer(1, "self_attn.q_norm.weight"), cfg.name("norm.weight")] {
        assert!(!cut.contains(&name.as_str()), "{name}");
    }
}

#[test]
fn causal_mask_hides_later_keys() {
    let m = causal_mask(3);
    let masked = -f32::MAX / 4.0;
    assert_eq!(m, [0.0, masked, masked, 0.0, 0.0, masked, 0.0, 0.0, 0.0]);
}

/// Fixture files (Hugging Face names in safetensors, llama.cpp's in GGUF) load through the file
/// readers under `--llm` and give the f64 encoder's output on the fixture's values.
#[test]
fn fixture_files_load_through_the_file_readers() {
    use crate::files::{ModelFiles, ModelSources};
    use crate::fixture::{self, qwen3, FileFormat, WeightType};
    use crate::loader::{dtype_of, FileSource};

    let cfg = Qwen3Config { hidden: 64, intermediate: 96, ..tiny() };
    let seed = 11;
    let table = qwen3::qwen3_tensor_table(&cfg, None);
    let value_of = |name: &str, _: &[i64]| -> Vec<f32> {
        let file_name = name.strip_prefix(&format!("{LLM_PREFIX}.")).unwrap();
        fixture::tensor_values(table.iter().find(|t| t.name == file_name).unwrap(), seed)
    };
    let ids: Vec<u32> = (0..12u32).map(|i| (i * 613 + 2) % 1000).collect();
    let want = reference_with(&cfg, &ids, 35, &value_of);
    let dir = tempfile::tempdir().unwrap();
    let mut runner = Runner::new("llm", backend());
    for (wtype, format, max_bound, mean_bound) in [
        (WeightType::F32, FileFormat::Safetensors, 2e-3, 2e-5),
        (WeightType::F16, FileFormat::Gguf, 3e-2, 4e-3),
        (WeightType::Q8_0, FileFormat::Gguf, 3e-1, 5e-2),
    ] {
        let path = dir.path().join(format!("qwen3-{wtype}.{}", format.extension()));
        let report = qwen3::write_qwen3(&path, &cfg, seed, None, wtype, format).unwrap();
        assert_eq!(report.tensors, table.len());
        let files = ModelFiles::open(&ModelSources { llm: Some(path.clone()), ..Default::default() }).unwrap();
        if format == FileFormat::Gguf {
            let stored = &files.index().get(&cfg.layer(1, "self_attn.k_norm.weight")).unwrap().original_name;
            assert_eq!(stored, "blk.1.attn_k_norm.weight", "GGUF fixtures carry llama.cpp's names");
        }
        let mut w = Weights::new(qwen3_specs(&cfg, &dtype_of(&files), None)).unwrap();
        w.allocate(backend().device().buffer_type()).unwrap();
        w.load_from(&FileSource::new(&files)).unwrap();
        let got = Qwen3Encoder::new(&cfg, &w).unwrap().encode_ids(&mut runner, &ids, 35).unwrap();
        let (max, mean) = diff(&got, &want);
        assert!(max < max_bound && mean < mean_bound, "{wtype}: max {max:e}, mean {mean:e}");
    }
}

#[test]
fn llama_cpp_names_map_onto_the_encoder_names() {
    use crate::files::names::llm_name;
    use crate::fixture::qwen3::{llama_cpp_name, qwen3_tensor_table};
    // Every tensor of the fixture, under its Hugging Face name and under llama.cpp's, is one
    // the encoder declares, with the shape it declares.
    let cfg = tiny();
    let specs = qwen3_specs(&cfg, &|_| None, None);
    let table = qwen3_tensor_table(&cfg, None);
    assert_eq!(table.len(), specs.len());
    for t in &table {
        for stored in [t.name.clone(), llama_cpp_name(&t.name)] {
            let name = llm_name(&stored);
            let spec = specs.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("{stored} -> {name}"));
            let torch: Vec<i64> = spec.ne.iter().rev().copied().collect();
            assert_eq!(torch, t.shape.iter().map(|&v| v as i64).collect::<Vec<_>>(), "{name}");
        }
    }
    // The names of downloaded GGUF files (llama.cpp's convert_hf_to_gguf for Qwen3).
    for (file, internal) in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.12.attn_norm.weight", "model.layers.12.input_layernorm.weight"),
        ("blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
        ("blk.35.ffn_gate.weight", "model.layers.35.mlp.gate_proj.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("text_encoders.llm.model.norm.weight", "model.norm.weight"),
    ] {
        assert_eq!(llm_name(file), format!("{LLM_PREFIX}.{internal}"), "{file}");
    }
}
