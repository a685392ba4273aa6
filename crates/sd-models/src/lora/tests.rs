//! Tests of LoRA key mapping, shapes and the merge rule.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::*;
use crate::family::sd::configs;

#[test]
fn kohya_flat_names_become_dotted() {
    assert_eq!(
        dotted("down_blocks_0_attentions_1_transformer_blocks_0_attn1_to_out_0"),
        "down_blocks.0.attentions.1.transformer_blocks.0.attn1.to_out.0"
    );
    assert_eq!(dotted("text_model_encoder_layers_11_mlp_fc2"), "text_model.encoder.layers.11.mlp.fc2");
    assert_eq!(dotted("text_model_final_layer_norm"), "text_model.final_layer_norm");
}

fn sd15_targets() -> Vec<TensorSpec> {
    let (clip, unet) = configs("sd1").unwrap();
    let dtype = |_: &str| Some(GgmlType::GGML_TYPE_F16);
    let mut t = crate::text::clip::clip_specs(&clip, &dtype, None);
    t.extend(crate::diffusion::unet::unet_specs(&unet, &dtype, None));
    t
}

fn sd_table() -> &'static [LoraPrefix] {
    &crate::family::sd::LORA_PREFIXES
}

/// A file path in a directory of its own, removed with the value (a run of these tests
/// writes about 200 MB of fixtures).
struct Temp {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Temp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Temp {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

fn temp(name: &str) -> Temp {
    let dir = tempfile::Builder::new().prefix("sd-lora-").tempdir().unwrap();
    Temp { path: dir.path().join(name), _dir: dir }
}

fn write_fixture(layout: crate::fixture::lora::LoraLayout, rank: u64, name: &str) -> Temp {
    let path = temp(name);
    let req = crate::fixture::lora::LoraFixture { layout, rank, seed: 7, scale: 0.05, text_encoder: true };
    crate::fixture::lora::write_lora(&path, &req).unwrap();
    path
}

fn write_raw(name: &str, tensors: &[(&str, Vec<u64>)]) -> Temp {
    use crate::files::safetensors::{to_bytes, HeaderEntry};
    let data: Vec<Vec<u8>> = tensors.iter().map(|(_, s)| vec![0u8; 4 * s.iter().product::<u64>() as usize]).collect();
    let entries: Vec<(HeaderEntry<'_>, &[u8])> = tensors
        .iter()
        .zip(&data)
        .map(|((n, s), d)| (HeaderEntry { name: n, dtype: crate::files::DType::F32, shape: s }, d.as_slice()))
        .collect();
    let path = temp(name);
    std::fs::write(&path, to_bytes(&entries, &BTreeMap::new()).unwrap()).unwrap();
    path
}

fn load(paths: &[(&Path, f32)]) -> Result<LoraSet, LoraError> {
    let req: Vec<LoraRequest> =
        paths.iter().map(|(p, m)| LoraRequest { path: p.to_path_buf(), multiplier: *m }).collect();
    LoraSet::load(&req, "sd1", sd_table(), &sd15_targets())
}

#[test]
fn kohya_and_peft_fixtures_adapt_every_module_they_name() {
    use crate::fixture::lora::LoraLayout;
    let kohya = write_fixture(LoraLayout::Kohya, 4, "kohya.safetensors");
    let peft = write_fixture(LoraLayout::Peft, 8, "peft.safetensors");
    let k = load(&[(&kohya, 1.0)]).unwrap();
    let p = load(&[(&peft, 1.0)]).unwrap();
    // 3 transformers x 12 modules, 5 resnet modules, 3 text layers x 6.
    assert_eq!(k.targets(), 59);
    assert_eq!(p.targets(), 59);
    let both = load(&[(&kohya, 0.5), (&peft, -1.0)]).unwrap();
    assert_eq!(both.deltas["model.diffusion_model.input_blocks.1.0.in_layers.2.weight"].len(), 2);
    // Kohya: alpha = rank / 2, so scale = 0.5 x multiplier; PEFT has no alpha: the multiplier.
    assert_eq!(both.deltas["model.diffusion_model.input_blocks.1.0.in_layers.2.weight"][0].scale, 0.25);
    assert_eq!(both.deltas["model.diffusion_model.input_blocks.1.0.in_layers.2.weight"][1].scale, -1.0);
}

#[test]
fn the_merge_adds_scale_up_down_and_multiplier_zero_changes_no_bit() {
    use crate::fixture::lora::LoraLayout;
    let kohya = write_fixture(LoraLayout::Kohya, 4, "kohya-merge.safetensors");
    let name = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight"; // 3x3 conv, 320 -> 320
    let ne = [3i64, 3, 320, 320];
    let n = ne.iter().product::<i64>() as usize;
    let w: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
    let bytes = convert::pack_f32(GgmlType::GGML_TYPE_F16, &w, 3).unwrap();
    let zero = load(&[(&kohya, 0.0)]).unwrap();
    assert_eq!(zero.merge(name, GgmlType::GGML_TYPE_F16, &ne, &bytes).unwrap().unwrap(), bytes);
    let one = load(&[(&kohya, 1.0)]).unwrap();
    let merged = one.merge(name, GgmlType::GGML_TYPE_F16, &ne, &bytes).unwrap().unwrap();
    let merged = convert::to_f32(GgmlType::GGML_TYPE_F16, &merged, n as i64).unwrap();
    // Independently: the file's up [320, 4, 1, 1] and down [4, 320, 3, 3], in f64.
    let files = ModelFiles::open_model(&*kohya).unwrap();
    let key = "lora_unet_down_blocks_0_resnets_0_conv1";
    let (_, up) = matrix(&files, &format!("{key}.lora_up.weight"), &kohya).unwrap();
    let (_, down) = matrix(&files, &format!("{key}.lora_down.weight"), &kohya).unwrap();
    let base = convert::to_f32(GgmlType::GGML_TYPE_F16, &bytes, n as i64).unwrap();
    let inner = 320 * 9;
    let mut worst = 0f64;
    for o in 0..320 {
        for i in 0..inner {
            let d: f64 = (0..4).map(|r| up[o * 4 + r] as f64 * down[r * inner + i] as f64).sum();
            let want = base[o * inner + i] as f64 + 0.5 * d;
            worst = worst.max((merged[o * inner + i] as f64 - want).abs());
        }
    }
    assert!(worst < 1e-3, "merge differs from base + 0.5 up@down by {worst}");
    assert_ne!(merged, base);
}

#[test]
fn a_lora_for_another_family_matches_nothing_and_says_so() {
    // SDXL-only names: a second transformer block at level 1, the second text encoder.
    let path = write_raw(
        "sdxl-names.safetensors",
        &[
            ("lora_unet_down_blocks_1_attentions_0_transformer_blocks_1_attn1_to_q.lora_down.weight", vec![4, 640]),
            ("lora_unet_down_blocks_1_attentions_0_transformer_blocks_1_attn1_to_q.lora_up.weight", vec![640, 4]),
            ("lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight", vec![4, 1280]),
            ("lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight", vec![1280, 4]),
        ],
    );
    let e = load(&[(&path, 1.0)]).unwrap_err().to_string();
    assert!(e.contains("sdxl-names.safetensors") && e.contains("none of its 2 adapters") && e.contains("sd1"), "{e}");
}

#[test]
fn rank_and_shape_mismatches_name_the_file_and_tensor() {
    let key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q";
    let path = write_raw(
        "rank.safetensors",
        &[(&format!("{key}.lora_down.weight"), vec![4, 320]), (&format!("{key}.lora_up.weight"), vec![320, 8])],
    );
    let e = load(&[(&path, 1.0)]).unwrap_err().to_string();
    assert!(e.contains("rank.safetensors") && e.contains(key) && e.contains("rank mismatch"), "{e}");
    let path = write_raw(
        "shape.safetensors",
        &[(&format!("{key}.lora_down.weight"), vec![4, 768]), (&format!("{key}.lora_up.weight"), vec![320, 4])],
    );
    let e = load(&[(&path, 1.0)]).unwrap_err().to_string();
    assert!(e.contains("shape.safetensors") && e.contains(key) && e.contains("[320, 320]"), "{e}");
}

#[test]
fn a_malformed_file_is_an_error_naming_it() {
    let path = temp("garbage.safetensors");
    std::fs::write(&path, b"\xff\xff\xff\xff not a safetensors file").unwrap();
    let e = load(&[(&path, 1.0)]).unwrap_err();
    let chain = format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
    assert!(chain.contains("garbage.safetensors"), "{chain}");
}

#[test]
fn apply_modes_parse_as_the_reference_names_them() {
    assert_eq!("auto".parse::<ApplyMode>(), Ok(ApplyMode::Auto));
    assert_eq!("immediately".parse::<ApplyMode>(), Ok(ApplyMode::Immediately));
    assert_eq!("at_runtime".parse::<ApplyMode>(), Ok(ApplyMode::AtRuntime));
    assert!("runtime".parse::<ApplyMode>().is_err());
}

#[test]
fn runtime_adapters_are_the_files_matrices_shaped_for_their_layers() {
    use super::runtime::{adapted_weight, AdapterSource};
    use crate::fixture::lora::LoraLayout;
    let kohya = write_fixture(LoraLayout::Kohya, 4, "kohya-rt.safetensors");
    let set = Arc::new(load(&[(&kohya, 0.5), (&kohya, 1.0)]).unwrap());
    let targets = sd15_targets();
    let rt = set.runtime(&targets);
    assert_eq!(rt.weights(), 59);
    // Two adapters per weight, two tensors each.
    assert_eq!(rt.specs().len(), 59 * 4);
    let spec = |name: &str| rt.specs().iter().find(|s| s.name == name).unwrap_or_else(|| panic!("{name}")).clone();
    // A 3x3 convolution 320 -> 320: a 3x3 down kernel of rank 4, a 1x1 up kernel, f16.
    let conv = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight";
    let down = spec(&format!("{conv}#lora1.down"));
    assert_eq!((down.ty, down.ne.clone()), (GgmlType::GGML_TYPE_F16, vec![3, 3, 320, 4]));
    assert_eq!(spec(&format!("{conv}#lora1.up")).ne, vec![1, 1, 4, 320]);
    assert_eq!(adapted_weight(&down.name), conv);
    // A linear layer of the text encoder: [in, rank] and [rank, out], in the file's f16.
    let fc1 = "cond_stage_model.transformer.text_model.encoder.layers.5.mlp.fc1.weight";
    let up = spec(&format!("{fc1}#lora0.up"));
    assert_eq!((up.ty, up.ne.clone()), (GgmlType::GGML_TYPE_F16, vec![4, 3072]));
    assert_eq!(spec(&format!("{fc1}#lora0.down")).ne, vec![768, 4]);
    // The bytes served are the file's own f16 matrices; other names go to the model's source.
    struct Model;
    impl TensorSource for Model {
        fn load(&self, name: &str, _: GgmlType, _: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
            Ok(Cow::Owned(name.as_bytes().to_vec()))
        }
    }
    let src = AdapterSource::new(Arc::new(Model), set.clone());
    let files = ModelFiles::open_model(&*kohya).unwrap();
    let key = "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight";
    let (e, _) = files.tensor(&files.index().entries().iter().find(|e| e.original_name == key).unwrap().name).unwrap();
    let ne: Vec<i64> = e.ne().iter().map(|&v| v as i64).collect();
    let want = FileSource::new(&files).load_tensor(&e.name, GgmlType::GGML_TYPE_F16, &ne).unwrap();
    assert_eq!(src.load(&down.name, down.ty, &down.ne).unwrap(), want);
    assert_eq!(&*src.load(conv, GgmlType::GGML_TYPE_F16, &[1]).unwrap(), conv.as_bytes());
    assert!(src.load(&format!("{conv}#lora2.down"), down.ty, &down.ne).is_err(), "no third adapter");
    // The planner counts the bytes the module declares.
    let planned: u64 = set.runtime_tensor_bytes().iter().map(|(_, _, b)| b).sum();
    assert_eq!(planned, rt.bytes());
}

#[test]
fn auto_applies_at_run_time_where_a_merge_would_cost_and_merges_elsewhere() {
    use super::runtime::{resolve, ModuleWeights};
    let on_device = ModuleWeights::default();
    let cases = [
        // The reference's rule: a quantized weight or parameters off the computing device.
        (ModuleWeights { quantized: true, ..on_device }, ApplyMode::AtRuntime),
        (ModuleWeights { off_device: true, ..on_device }, ApplyMode::AtRuntime),
        // backend.md: row-split tensors take runtime application.
        (ModuleWeights { row_split: true, ..on_device }, ApplyMode::AtRuntime),
        // f16/f32 weights on their device: merged once.
        (on_device, ApplyMode::Immediately),
    ];
    for (m, want) in cases {
        assert_eq!(resolve(ApplyMode::Auto, &m).0, want, "{m:?}");
        // An explicit mode is kept.
        assert_eq!(resolve(ApplyMode::Immediately, &m).0, ApplyMode::Immediately, "{m:?}");
        assert_eq!(resolve(ApplyMode::AtRuntime, &m).0, ApplyMode::AtRuntime, "{m:?}");
    }
}

fn flux_table() -> &'static [LoraPrefix] {
    &crate::family::flux::lora::LORA_PREFIXES
}

#[test]
fn flux_keys_of_every_layout_reach_bfl_names_and_row_blocks() {
    let dit = |s: &str| (format!("model.diffusion_model.{s}.weight"), None);
    let part = |s: &str, k: usize| (format!("model.diffusion_model.{s}.weight"), Some(k));
    let t = flux_table();
    for (key, want) in [
        ("lora_unet_double_blocks_0_img_attn_qkv", dit("double_blocks.0.img_attn.qkv")),
        ("lora_unet_double_blocks_18_txt_mlp_2", dit("double_blocks.18.txt_mlp.2")),
        ("lora_unet_single_blocks_37_modulation_lin", dit("single_blocks.37.modulation.lin")),
        ("lora_unet_final_layer_adaLN_modulation_1", dit("final_layer.adaLN_modulation.1")),
        ("lora_unet_time_in_in_layer", dit("time_in.in_layer")),
        ("diffusion_model.single_blocks.3.linear1", dit("single_blocks.3.linear1")),
        ("model.diffusion_model.double_blocks.1.img_mod.lin", dit("double_blocks.1.img_mod.lin")),
        ("lora.transformer.transformer_blocks.2.attn.to_k", part("double_blocks.2.img_attn.qkv", 1)),
        ("transformer.transformer_blocks.2.attn.add_v_proj", part("double_blocks.2.txt_attn.qkv", 2)),
        ("transformer.transformer_blocks.2.ff_context.net.0.proj", dit("double_blocks.2.txt_mlp.0")),
        ("transformer.single_transformer_blocks.5.proj_mlp", part("single_blocks.5.linear1", 3)),
        ("transformer.single_transformer_blocks.5.proj_out", dit("single_blocks.5.linear2")),
        ("transformer.time_text_embed.guidance_embedder.linear_2", dit("guidance_in.out_layer")),
        ("transformer.norm_out.linear", dit("final_layer.adaLN_modulation.1")),
    ] {
        assert_eq!(target_of(key, t), Some(want), "{key}");
    }
    // CLIP-L (kohya's te1) and T5-XXL (te3).
    assert_eq!(
        target_of("lora_te1_text_model_encoder_layers_3_self_attn_out_proj", t).unwrap().0,
        "cond_stage_model.transformer.text_model.encoder.layers.3.self_attn.out_proj.weight"
    );
    assert_eq!(
        target_of("lora_te3_encoder_block_1_layer_1_DenseReluDense_wi_0", t).unwrap().0,
        "text_encoders.t5xxl.transformer.encoder.block.1.layer.1.DenseReluDense.wi_0.weight"
    );
    assert_eq!(target_of("transformer.transformer_blocks.0.attn.norm_q", t), None);
}

/// A safetensors file of f32 tensors with the given values.
fn write_values(name: &str, tensors: &[(String, Vec<u64>, Vec<f32>)]) -> Temp {
    use crate::files::safetensors::{to_bytes, HeaderEntry};
    let data: Vec<Vec<u8>> = tensors.iter().map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let entries: Vec<(HeaderEntry<'_>, &[u8])> = tensors
        .iter()
        .zip(&data)
        .map(|((n, s, _), d)| (HeaderEntry { name: n, dtype: crate::files::DType::F32, shape: s }, d.as_slice()))
        .collect();
    let path = temp(name);
    std::fs::write(&path, to_bytes(&entries, &BTreeMap::new()).unwrap()).unwrap();
    path
}

#[test]
fn split_qkv_adapters_merge_as_one_fused_adapter_and_a_gap_stops_them() {
    // A fused qkv of width 8 (rows 24): diffusers' to_q, to_k, to_v of rank 2 each, against
    // one adapter of rank 6 whose down stacks theirs and whose up is block-diagonal.
    let (h, r) = (8usize, 2usize);
    let target = "model.diffusion_model.double_blocks.0.img_attn.qkv.weight";
    let targets =
        vec![TensorSpec { name: target.into(), ty: GgmlType::GGML_TYPE_F32, ne: vec![h as i64, 3 * h as i64] }];
    let val = |seed: usize, n: usize| -> Vec<f32> {
        (0..n).map(|i| (((i * 37 + seed * 11) % 23) as f32 - 11.0) / 16.0).collect()
    };
    let (mut split, mut stacked_down, mut fused_up) = (Vec::new(), Vec::new(), vec![0f32; 3 * h * 3 * r]);
    for (k, leaf) in ["to_q", "to_k", "to_v"].iter().enumerate() {
        let (down, up) = (val(2 * k, r * h), val(2 * k + 1, h * r));
        let key = format!("transformer.transformer_blocks.0.attn.{leaf}");
        split.push((format!("{key}.lora_A.weight"), vec![r as u64, h as u64], down.clone()));
        split.push((format!("{key}.lora_B.weight"), vec![h as u64, r as u64], up.clone()));
        stacked_down.extend(down);
        for o in 0..h {
            for j in 0..r {
                fused_up[(k * h + o) * 3 * r + k * r + j] = up[o * r + j];
            }
        }
    }
    let fused = vec![
        (
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight".to_owned(),
            vec![3 * r as u64, h as u64],
            stacked_down,
        ),
        (
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight".to_owned(),
            vec![3 * h as u64, 3 * r as u64],
            fused_up,
        ),
    ];
    let load_one = |path: &Path| {
        let req = [LoraRequest { path: path.to_path_buf(), multiplier: 0.75 }];
        LoraSet::load(&req, "flux", flux_table(), &targets)
    };
    let a = load_one(&write_values("split-qkv.safetensors", &split)).unwrap();
    let b = load_one(&write_values("fused-qkv.safetensors", &fused)).unwrap();
    assert_eq!(a.deltas[target].iter().map(|d| (d.offset, d.out)).collect::<Vec<_>>(), [(0, 8), (8, 8), (16, 8)]);
    let w: Vec<f32> = val(9, 3 * h * h);
    let bytes = convert::pack_f32(GgmlType::GGML_TYPE_F32, &w, h as i64).unwrap();
    let ne = [h as i64, 3 * h as i64];
    let (ma, mb) = (
        a.merge(target, GgmlType::GGML_TYPE_F32, &ne, &bytes).unwrap().unwrap(),
        b.merge(target, GgmlType::GGML_TYPE_F32, &ne, &bytes).unwrap().unwrap(),
    );
    assert_eq!(ma, mb, "the split adapters are not the fused one");
    assert_ne!(ma, bytes);
    // At run time a part's up covers all 24 rows, zero outside its own.
    let rt = a.runtime(&targets);
    let up1 = rt.specs().iter().find(|s| s.name.ends_with("#lora1.up")).unwrap().clone();
    assert_eq!(up1.ne, vec![r as i64, 3 * h as i64]);
    struct Nothing;
    impl TensorSource for Nothing {
        fn load(&self, name: &str, _: GgmlType, _: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
            Err(SourceError::new(format!("no {name}")))
        }
    }
    let src = super::runtime::AdapterSource::new(Arc::new(Nothing), Arc::new(a));
    let up = src.load(&up1.name, GgmlType::GGML_TYPE_F32, &up1.ne).unwrap();
    let up: Vec<f32> = up.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert!(up[..h * r].iter().chain(&up[2 * h * r..]).all(|&v| v == 0.0) && up[h * r..2 * h * r] == val(3, h * r)[..]);
    // Without to_q, to_k and to_v adapt nothing (the reference stops at the first part
    // missing): a file of nothing else matches nothing.
    let gap: Vec<_> = split.iter().filter(|(n, _, _)| !n.contains(".to_q.")).cloned().collect();
    let e = load_one(&write_values("gap-qkv.safetensors", &gap)).unwrap_err().to_string();
    assert!(e.contains("gap-qkv.safetensors") && e.contains("none of its 2 adapters"), "{e}");
}

#[test]
fn an_sdxl_kohya_lora_adapts_the_unet_and_both_text_encoders() {
    use crate::fixture::lora::{write_sdxl_lora, LoraFixture, LoraLayout};
    use crate::fixture::{tensor_table, Architecture, UnetLayout};
    let unet = UnetLayout::vega();
    let path = temp("vega-kohya.safetensors");
    let req = LoraFixture { layout: LoraLayout::Kohya, rank: 4, seed: 3, scale: 0.05, text_encoder: true };
    let written = write_sdxl_lora(&path, &unet, &req).unwrap();
    let f16 = |_: &str| Some(GgmlType::GGML_TYPE_F16);
    let mut targets: Vec<TensorSpec> = tensor_table(&Architecture::sdxl_with(unet))
        .unwrap()
        .into_iter()
        .filter(|t| t.name.starts_with("model.diffusion_model."))
        .map(|t| TensorSpec {
            ne: t.shape.iter().rev().map(|&d| d as i64).collect(),
            name: t.name,
            ty: GgmlType::GGML_TYPE_F16,
        })
        .collect();
    for cfg in [crate::text::clip::ClipConfig::vit_l14_sdxl(), crate::text::clip::ClipConfig::vit_bigg14()] {
        targets.extend(crate::text::clip::clip_specs(&cfg, &f16, None));
    }
    let req = [LoraRequest { path: path.to_path_buf(), multiplier: 1.0 }];
    let set = LoraSet::load(&req, "sdxl", &crate::family::sdxl::LORA_PREFIXES, &targets).unwrap();
    // Every adapter written applies: 2 transformers x 12 modules (Vega's middle block has
    // none), 3 resnet modules, 2 encoders x 2 layers x 6.
    assert_eq!((written, set.targets()), (51, 51));
    for name in [
        "cond_stage_model.1.transformer.text_model.encoder.layers.5.self_attn.v_proj.weight",
        "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc2.weight",
        "model.diffusion_model.input_blocks.1.0.in_layers.2.weight",
    ] {
        assert!(set.adapts(name), "{name}");
    }
}

#[test]
fn two_keys_of_one_file_for_one_weight_apply_once() {
    // kohya's flat name and diffusers' dotted name of the same module.
    let k = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q";
    let d = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q";
    let path = write_raw(
        "twice.safetensors",
        &[
            (&format!("{k}.lora_down.weight"), vec![4, 320]),
            (&format!("{k}.lora_up.weight"), vec![320, 4]),
            (&format!("{d}.lora_A.weight"), vec![4, 320]),
            (&format!("{d}.lora_B.weight"), vec![320, 4]),
        ],
    );
    let set = load(&[(&path, 1.0)]).unwrap();
    assert_eq!(set.targets(), 1);
    let target = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight";
    assert_eq!(set.deltas[target].len(), 1);
}

#[test]
fn loha_and_lokr_fixtures_adapt_their_modules_with_the_references_scales() {
    use crate::fixture::lora::LoraLayout;
    let loha = write_fixture(LoraLayout::Loha, 4, "loha.safetensors");
    let lokr = write_fixture(LoraLayout::Lokr, 4, "lokr.safetensors");
    let h = load(&[(&loha, 1.0)]).unwrap();
    assert_eq!(h.targets(), 59);
    // alpha = rank / 2 over hada_w1_b's rank.
    let conv = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight";
    assert_eq!(h.deltas[conv][0].scale, 0.5);
    assert_eq!((h.deltas[conv][0].out, h.deltas[conv][0].inner, h.deltas[conv][0].rank()), (320, 320 * 9, 16));
    // LoKr leaves the convolutions out: 3 transformers x 10 linear modules, a time projection,
    // 3 text layers x 6.
    let k = load(&[(&lokr, -1.0)]).unwrap();
    assert_eq!(k.targets(), 49);
    assert!(!k.adapts(conv));
    // The forms take turns: whole w1 and w2 (rank 1: scale 1 whatever the alpha), whole w1 and
    // a rank-4 w2 with alpha 2 (scale 0.5), both factors as products and no alpha (scale 1).
    let mut scales: Vec<f32> = k.deltas.values().map(|d| d[0].scale).collect();
    scales.sort_by(f32::total_cmp);
    scales.dedup();
    assert_eq!(scales, [-1.0, -0.5]);
}

#[test]
fn loha_and_lokr_merges_equal_their_runtime_factors() {
    use crate::fixture::lora::LoraLayout;
    let loha = write_fixture(LoraLayout::Loha, 3, "loha-rt.safetensors");
    let lokr = write_fixture(LoraLayout::Lokr, 3, "lokr-rt.safetensors");
    let set = load(&[(&loha, 0.7), (&lokr, 1.3)]).unwrap();
    let q = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"; // 320 x 320
    let ne = [320i64, 320];
    let zero = vec![0f32; 320 * 320];
    let bytes = convert::pack_f32(GgmlType::GGML_TYPE_F32, &zero, 320).unwrap();
    let merged = set.merge(q, GgmlType::GGML_TYPE_F32, &ne, &bytes).unwrap().unwrap();
    let merged = convert::to_f32(GgmlType::GGML_TYPE_F32, &merged, 320 * 320).unwrap();
    // What at_runtime adds: the sum of scale * up @ down over both adapters, in f64.
    let mut want = vec![0f64; 320 * 320];
    for d in &set.deltas[q] {
        let (up, down) = (d.form.up(d.out), d.form.down(d.inner));
        let r = d.rank();
        for o in 0..320 {
            for i in 0..320 {
                let s: f64 = (0..r).map(|k| up[o * r + k] as f64 * down[k * 320 + i] as f64).sum();
                want[o * 320 + i] += d.scale as f64 * s;
            }
        }
    }
    let worst = merged.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
    let size = want.iter().map(|v| v.abs()).fold(0f64, f64::max);
    assert!(size > 1e-3 && worst < 1e-5 * size.max(1.0), "merge vs runtime factors: {worst} (delta up to {size})");
}

/// The values of a file's tensor `name` as f32 (outermost first).
fn values_of(path: &Path, name: &str) -> Vec<f32> {
    let files = ModelFiles::open_model(path).unwrap();
    let e = files.index().entries().iter().find(|e| e.original_name == name).unwrap().name.clone();
    matrix(&files, &e, path).unwrap().1
}

/// `W` (zeros) of `target` (`[out, inner]`) with `set` merged, as f32.
fn merged_zero(set: &LoraSet, target: &str, out: usize, inner: usize) -> Vec<f32> {
    let ne = [inner as i64, out as i64];
    let bytes = convert::pack_f32(GgmlType::GGML_TYPE_F32, &vec![0f32; out * inner], inner as i64).unwrap();
    let merged = set.merge(target, GgmlType::GGML_TYPE_F32, &ne, &bytes).unwrap().unwrap();
    convert::to_f32(GgmlType::GGML_TYPE_F32, &merged, (out * inner) as i64).unwrap()
}

/// Checks `got` against `want` (f64) to f32 summation accuracy.
fn assert_close(got: &[f32], want: &[f64], what: &str) {
    let worst = got.iter().zip(want).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
    let size = want.iter().map(|v| v.abs()).fold(0f64, f64::max);
    assert!(size > 1e-12 && worst < 1e-5 * size, "{what}: off by {worst} (delta up to {size})");
}

#[test]
fn tucker_convolutions_rebuild_as_lycoris_does_and_their_runtime_factors_agree() {
    // The tucker-loha fixture: 3x3 convolutions as a LoCon with lora_mid (first and third) and a
    // LoHa with hada_t1/t2 (second); everything else kohya pairs.
    use crate::fixture::lora::LoraLayout;
    let path = write_fixture(LoraLayout::TuckerLoha, 3, "tucker.safetensors");
    let set = load(&[(&path, 0.8)]).unwrap();
    assert_eq!(set.targets(), 59, "every module of the fixture adapted");
    let (out, cin, kk) = (320usize, 320usize, 9usize);
    let inner = cin * kk;
    // W[o, i, t] = sum_a sum_b up[o, a] mid[a, b, t] down[b, i], in f64 (LyCORIS's rebuild).
    let rebuild = |up: &[f32], mid: &[f32], down: &[f32], r: usize| -> Vec<f64> {
        let mut w = vec![0f64; out * inner];
        for o in 0..out {
            for i in 0..cin {
                for t in 0..kk {
                    let mut sum = 0f64;
                    for a in 0..r {
                        for b in 0..r {
                            sum += up[o * r + a] as f64 * mid[(a * r + b) * kk + t] as f64 * down[b * cin + i] as f64;
                        }
                    }
                    w[o * inner + i * kk + t] = sum;
                }
            }
        }
        w
    };
    let r = 3;
    // alpha = rank / 2 and the multiplier.
    let scale = 0.5 * 0.8;
    let conv1 = "model.diffusion_model.input_blocks.1.0.in_layers.2.weight";
    let key = "lora_unet_down_blocks_0_resnets_0_conv1";
    let v = |suffix: &str| values_of(&path, &format!("{key}.{suffix}"));
    let want: Vec<f64> = rebuild(&v("lora_up.weight"), &v("lora_mid.weight"), &v("lora_down.weight"), r)
        .into_iter()
        .map(|x| x * scale)
        .collect();
    assert_close(&merged_zero(&set, conv1, out, inner), &want, "LoCon with lora_mid");
    // The LoHa: each product rebuilt with its core (hada_w*_a stored [rank, out]), multiplied.
    let conv2 = "model.diffusion_model.input_blocks.1.0.out_layers.3.weight";
    let key = "lora_unet_down_blocks_0_resnets_0_conv2";
    let v = |suffix: &str| values_of(&path, &format!("{key}.{suffix}"));
    let t = |a: Vec<f32>| transpose(&a, r, out);
    let p1 = rebuild(&t(v("hada_w1_a")), &v("hada_t1"), &v("hada_w1_b"), r);
    let p2 = rebuild(&t(v("hada_w2_a")), &v("hada_t2"), &v("hada_w2_b"), r);
    let want: Vec<f64> = p1.iter().zip(&p2).map(|(a, b)| a * b * scale).collect();
    assert_close(&merged_zero(&set, conv2, out, inner), &want, "LoHa with hada_t1/t2");
    // At run time: up @ down of each form gives the same delta.
    for target in [conv1, conv2] {
        let d = &set.deltas[target][0];
        let (up, down, r) = (d.form.up(d.out), d.form.down(d.inner), d.rank());
        let rt: Vec<f32> = (0..out * inner)
            .map(|k| d.scale * (0..r).map(|a| up[(k / inner) * r + a] * down[a * inner + k % inner]).sum::<f32>())
            .collect();
        let merged: Vec<f64> = merged_zero(&set, target, out, inner).iter().map(|&x| x as f64).collect();
        assert_close(&rt, &merged, "runtime factors vs merge");
    }
}

#[test]
fn a_core_that_does_not_fit_and_a_lokr_core_are_reported() {
    let key = "lora_unet_down_blocks_0_resnets_0_conv1";
    // A core of rank 2 between factors of rank 3.
    let path = write_raw(
        "tucker-bad.safetensors",
        &[
            (&format!("{key}.lora_down.weight"), vec![3, 320, 1, 1]),
            (&format!("{key}.lora_mid.weight"), vec![2, 2, 3, 3]),
            (&format!("{key}.lora_up.weight"), vec![320, 3, 1, 1]),
        ],
    );
    let e = load(&[(&path, 1.0)]).unwrap_err().to_string();
    assert!(e.contains("tucker-bad.safetensors") && e.contains(key) && e.contains("Tucker core [2, 2, 3, 3]"), "{e}");
    // The reference reads no lokr_t2: such a key is reported, not misapplied.
    let q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q";
    let path = write_raw(
        "lokr-t2.safetensors",
        &[
            (&format!("{q}.lokr_w1"), vec![4, 4]),
            (&format!("{q}.lokr_w2_a"), vec![80, 2]),
            (&format!("{q}.lokr_w2_b"), vec![2, 80]),
            (&format!("{q}.lokr_t2"), vec![2, 2, 1, 1]),
        ],
    );
    let e = load(&[(&path, 1.0)]).unwrap_err().to_string();
    assert!(e.contains("lokr-t2.safetensors") && e.contains("none of its 1 adapters"), "{e}");
}

#[test]
fn a_diff_file_adds_its_delta_times_the_multiplier() {
    use crate::fixture::lora::LoraLayout;
    let path = write_fixture(LoraLayout::Diff, 1, "diff.safetensors");
    let set = load(&[(&path, -0.6)]).unwrap();
    assert_eq!(set.targets(), 59);
    let q = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight";
    let key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.diff";
    let want: Vec<f64> = values_of(&path, key).iter().map(|&x| -0.6 * x as f64).collect();
    let got = merged_zero(&set, q, 320, 320);
    assert_close(&got, &want, "diff");
    // At run time, a whole delta as a product of the delta and an identity.
    let d = &set.deltas[q][0];
    assert_eq!(d.rank(), 320);
    let (up, down) = (d.form.up(320), d.form.down(320));
    let rt: Vec<f32> = (0..320 * 320)
        .map(|k| d.scale * (0..320).map(|a| up[(k / 320) * 320 + a] * down[a * 320 + k % 320]).sum::<f32>())
        .collect();
    assert_close(&rt, &want, "diff at run time");
}

#[test]
fn loha_and_lokr_factor_shape_mismatches_name_the_file_and_key() {
    let key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q";
    let path = write_raw(
        "loha-bad.safetensors",
        &[
            (&format!("{key}.hada_w1_a"), vec![320, 4]),
            (&format!("{key}.hada_w1_b"), vec![4, 320]),
            (&format!("{key}.hada_w2_a"), vec![320, 4]),
            (&format!("{key}.hada_w2_b"), vec![2, 320]),
        ],
    );
    let e = load(&[(&path, 1.0)]).unwrap_err().to_string();
    assert!(e.contains("loha-bad.safetensors") && e.contains(key) && e.contains("LoHa factors do not fit"), "{e}");
    // kron([4, 4], [80, 80]) is [320, 320]; [4, 4] x [80, 40] is not the weight's shape.
    let path = write_raw(
        "lokr-bad.safetensors",
        &[(&format!("{key}.lokr_w1"), vec![4, 4]), (&format!("{key}.lokr_w2"), vec![80, 40])],
    );
    let e = load(&[(&path, 1.0)]).unwrap_err().to_string();
    assert!(e.contains("lokr-bad.safetensors") && e.contains(key) && e.contains("[320, 160]"), "{e}");
}

#[test]
fn flux_fixtures_adapt_the_dit_clip_l_and_t5_in_kohya_and_dotted_names() {
    use crate::fixture::lora::{write_flux_lora, LoraFixture, LoraLayout};
    let cfg = crate::fixture::flux::reduced(256, 2, 2, false);
    let f16 = |_: &str| Some(GgmlType::GGML_TYPE_F16);
    let mut targets = crate::diffusion::flux::flux_specs(&cfg, &f16, None);
    targets.extend(crate::text::clip::clip_specs(&crate::text::clip::ClipConfig::vit_l14(), &f16, None));
    let t5 = crate::text::t5::T5Config { n_layers: 2, ..crate::text::t5::T5Config::xxl() };
    targets.extend(crate::text::t5::t5_specs(&t5, &f16, None));
    let mut sets = Vec::new();
    for (layout, name) in [(LoraLayout::Kohya, "flux-kohya.safetensors"), (LoraLayout::Peft, "flux-dotted.safetensors")]
    {
        let path = temp(name);
        let req = LoraFixture { layout, rank: 4, seed: 1, scale: 0.05, text_encoder: true };
        let n = write_flux_lora(&path, &cfg, &req).unwrap();
        let req = [LoraRequest { path: path.to_path_buf(), multiplier: 1.0 }];
        let set = LoraSet::load(&req, "flux", flux_table(), &targets).unwrap();
        // 13 DiT weights, CLIP-L's layers 0 and 11 x 6, T5's block 0 x 7: every adapter applies.
        assert_eq!((n, set.targets()), (32, 32), "{layout:?}");
        let t5_names: Vec<&String> = set.deltas.keys().filter(|k| k.starts_with("text_encoders.t5xxl.")).collect();
        assert_eq!(t5_names.len(), 7, "{layout:?}: {t5_names:?}");
        assert!(set.adapts("text_encoders.t5xxl.transformer.encoder.block.0.layer.1.DenseReluDense.wi_1.weight"));
        sets.push(set);
    }
    // The same values under both names (kohya's alpha halves the scale).
    let w = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.o.weight";
    assert_eq!(sets[0].deltas[w][0].scale * 2.0, sets[1].deltas[w][0].scale);
}

/// Issue 32, row 15: an adapter with fewer rows than the (unfused) weight it names, or its
/// rows and columns swapped, is refused with the file, key and both shapes; before, it was
/// added to the weight's first rows.
#[test]
fn an_adapter_with_the_wrong_rows_or_columns_for_its_weight_is_refused() {
    // ff.net.0.proj of the first transformer: [2560, 320].
    let key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_ff_net_0_proj";
    let weight = "[2560, 320]";
    type Tensors = Vec<(String, Vec<u64>)>;
    let cases: Vec<(&str, Tensors, &str)> = vec![
        (
            "few-rows",
            vec![(format!("{key}.lora_up.weight"), vec![320, 4]), (format!("{key}.lora_down.weight"), vec![4, 320])],
            "[320, 4]",
        ),
        (
            "swapped",
            vec![(format!("{key}.lora_up.weight"), vec![320, 4]), (format!("{key}.lora_down.weight"), vec![4, 2560])],
            "[4, 2560]",
        ),
        ("diff", vec![(format!("{key}.diff"), vec![320, 320])], "[320, 320]"),
        (
            "loha",
            vec![
                (format!("{key}.hada_w1_a"), vec![320, 2]),
                (format!("{key}.hada_w1_b"), vec![2, 320]),
                (format!("{key}.hada_w2_a"), vec![320, 2]),
                (format!("{key}.hada_w2_b"), vec![2, 320]),
            ],
            "hada_w2_b [2, 320]",
        ),
        ("lokr", vec![(format!("{key}.lokr_w1"), vec![4, 4]), (format!("{key}.lokr_w2"), vec![80, 80])], "[80, 80]"),
    ];
    for (name, tensors, factor) in cases {
        let file = format!("rows-{name}.safetensors");
        let refs: Vec<(&str, Vec<u64>)> = tensors.iter().map(|(n, s)| (n.as_str(), s.clone())).collect();
        let path = write_raw(&file, &refs);
        let e = load(&[(&path, 1.0)]).unwrap_err();
        assert!(matches!(e, LoraError::Shape { .. }), "{name}: {e}");
        let e = e.to_string();
        for needle in [file.as_str(), key, factor, weight, "ff.net.0.proj"] {
            assert!(e.contains(needle), "{name}: no {needle:?} in {e}");
        }
    }
    // The same adapter with the weight's rows applies.
    let path = write_raw(
        "rows-right.safetensors",
        &[(&format!("{key}.lora_up.weight"), vec![2560, 4]), (&format!("{key}.lora_down.weight"), vec![4, 320])],
    );
    assert_eq!(load(&[(&path, 1.0)]).unwrap().targets(), 1);
}

/// Issue 32, row 16: alpha 1e30, a multiplier of 1e38, a NaN alpha or factor element are
/// refused naming the file, key and value; a scale within the bound that still overflows a
/// merged f16 weight fails the merge, never storing an infinity.
#[test]
fn absurd_scales_and_non_finite_values_are_refused_with_file_key_and_value() {
    let key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q";
    let file = |name: &str, alpha: f32, up0: f32| {
        let mut up = vec![0.01f32; 320 * 4];
        up[0] = up0;
        write_values(
            name,
            &[
                (format!("{key}.lora_up.weight"), vec![320, 4], up),
                (format!("{key}.lora_down.weight"), vec![4, 320], vec![0.01; 4 * 320]),
                (format!("{key}.alpha"), vec![], vec![alpha]),
            ],
        )
    };
    let value_err = |path: &Path, m: f32| match load(&[(path, m)]) {
        Err(e @ LoraError::Value { .. }) => e.to_string(),
        other => panic!("{}: expected a value error, got {other:?}", path.display()),
    };
    let alpha = file("alpha-1e30.safetensors", 1e30, 0.01);
    let e = value_err(&alpha, 1.0);
    assert!(e.contains("alpha-1e30.safetensors") && e.contains(key) && e.contains("alpha 1e30"), "{e}");
    assert!(e.contains("2.5e29") && e.contains("65504"), "{e}");
    let sane = file("alpha-4.safetensors", 4.0, 0.01);
    let e = value_err(&sane, 1e38);
    assert!(e.contains("alpha-4.safetensors") && e.contains(key) && e.contains("1e38"), "{e}");
    // Infinite in f32 (-3e38 x 4), still refused with its value.
    let e = value_err(&file("alpha-16.safetensors", 16.0, 0.01), -3e38);
    assert!(e.contains("-3e38") && e.contains("-1.200e39"), "{e}");
    assert!(load(&[(&sane, 65504.0)]).is_ok(), "the bound itself is accepted");
    // Non-finite values are refused as the file's tensors are read (the loader's check),
    // naming the tensor and the file.
    for (name, alpha, up0, tensor) in [
        ("alpha-nan.safetensors", f32::NAN, 0.01, "alpha"),
        ("up-inf.safetensors", 4.0, f32::INFINITY, "lora_up.weight"),
    ] {
        let path = file(name, alpha, up0);
        let e = load(&[(&path, 1.0)]).unwrap_err();
        let chain = format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
        assert!(chain.contains(name) && chain.contains(&format!("{key}.{tensor}")), "{chain}");
    }

    // Scale 65504 x (4 x 0.01 x 0.01) = 26 is added to weights of 65500: beyond f16.
    let set = load(&[(&sane, 65504.0)]).unwrap();
    let name = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight";
    let ne = [320i64, 320];
    let w = convert::pack_f32(GgmlType::GGML_TYPE_F16, &vec![65500f32; 320 * 320], 320).unwrap();
    let e = set.merge(name, GgmlType::GGML_TYPE_F16, &ne, &w).unwrap().unwrap_err();
    assert!(e.contains("beyond what f16 holds") && e.contains("element 0"), "{e}");
    // In f32 the same sum is finite and stored.
    let w = convert::pack_f32(GgmlType::GGML_TYPE_F32, &vec![65500f32; 320 * 320], 320).unwrap();
    assert!(set.merge(name, GgmlType::GGML_TYPE_F32, &ne, &w).unwrap().is_ok());
}

/// Issue 32, row 18: a file that is no LoRA is described, none of its bytes echoed.
#[test]
fn a_text_file_given_as_a_lora_is_described_not_echoed() {
    for (name, what) in [("passwd", "it is text"), ("passwd.safetensors", "header length")] {
        let path = temp(name);
        std::fs::write(&path, "root:x:0:0:root:/root:/bin/bash\n").unwrap();
        let e = load(&[(&path, 1.0)]).unwrap_err();
        let chain = format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
        assert!(chain.contains(&path.display().to_string()) && chain.contains(what), "{chain}");
        assert!(!chain.contains("root:") && !chain.contains("72, 6f"), "{chain}");
    }
}
