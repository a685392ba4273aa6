//! Detection, block numbering and the planner's description of model files written here from
//! their headers alone (sparse safetensors files), with no ggml in the build: what a tool that
//! plans a model needs from `sd-formats` and `sd-arch`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use sd_arch::describe::{loaded_bytes, ExtraFile};
use sd_formats::safetensors::{expected_bytes, header_bytes};
use sd_formats::{DType, HeaderEntry, ModelFiles, ModelSources};
use sd_placement::{plan, Device, Flags, ModelDescription, Module, PlanRequest, GIB};

/// Writes a safetensors file of f16 `tensors` (name, row-major shape): the header, then a
/// data section of the right length that is never written (a sparse file of zeros).
fn write(path: &Path, tensors: &[(&str, &[u64])]) -> PathBuf {
    let specs: Vec<HeaderEntry<'_>> =
        tensors.iter().map(|&(name, shape)| HeaderEntry { name, dtype: DType::F16, shape }).collect();
    let header = header_bytes(&specs, &BTreeMap::new()).unwrap();
    let data: u64 = specs.iter().map(|s| expected_bytes(s.name, s.dtype, s.shape).unwrap()).sum();
    let mut file = std::fs::File::create(path).unwrap();
    file.write_all(&header).unwrap();
    file.set_len(header.len() as u64 + data).unwrap();
    path.to_path_buf()
}

const HIDDEN: u64 = 64;

/// A FLUX.1 DiT (two double blocks, three single blocks) in BFL's names under the checkpoint
/// prefix, with `guidance_in` (dev) when `dev`, and its VAE's first convolution.
fn flux_tensors(dev: bool) -> Vec<(&'static str, &'static [u64])> {
    const H: u64 = HIDDEN;
    let mut t: Vec<(&str, &[u64])> = vec![
        ("model.diffusion_model.img_in.weight", &[H, 64]),
        ("model.diffusion_model.txt_in.weight", &[H, 4096]),
        ("model.diffusion_model.double_blocks.0.img_attn.qkv.weight", &[3 * H, H]),
        ("model.diffusion_model.double_blocks.1.img_attn.qkv.weight", &[3 * H, H]),
        ("model.diffusion_model.single_blocks.0.linear1.weight", &[7 * H, H]),
        ("model.diffusion_model.single_blocks.1.linear1.weight", &[7 * H, H]),
        ("model.diffusion_model.single_blocks.2.linear1.weight", &[7 * H, H]),
        ("model.diffusion_model.final_layer.linear.weight", &[64, H]),
        ("first_stage_model.decoder.conv_in.weight", &[512, 16, 3, 3]),
    ];
    if dev {
        t.push(("model.diffusion_model.guidance_in.in_layer.weight", &[H, 256]));
    }
    t
}

/// T5-XXL's first two blocks and its embedding, as a `--t5xxl` file stores them.
const T5: [(&str, &[u64]); 3] = [
    ("shared.weight", &[32, 4096]),
    ("encoder.block.0.layer.0.SelfAttention.q.weight", &[4096, 4096]),
    ("encoder.block.1.layer.0.SelfAttention.q.weight", &[4096, 4096]),
];

/// An SD 1.x checkpoint: a UNet with 12 input blocks, a middle block and 12 output blocks
/// (the first and last of each written), CLIP ViT-L/14's first and last layers, and the VAE.
const SD1: [(&str, &[u64]); 10] = [
    ("model.diffusion_model.input_blocks.0.0.weight", &[320, 4, 3, 3]),
    ("model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight", &[320, 768]),
    ("model.diffusion_model.input_blocks.11.0.out_layers.3.weight", &[1280, 1280, 3, 3]),
    ("model.diffusion_model.middle_block.1.norm.weight", &[1280]),
    ("model.diffusion_model.output_blocks.0.0.out_layers.3.weight", &[1280, 1280, 3, 3]),
    ("model.diffusion_model.output_blocks.11.1.transformer_blocks.0.attn2.to_k.weight", &[320, 768]),
    ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight", &[49408, 768]),
    ("cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight", &[3072, 768]),
    ("cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc1.weight", &[3072, 768]),
    ("first_stage_model.decoder.conv_in.weight", &[512, 4, 3, 3]),
];

/// The modules of a description, in the planner's order.
fn modules(desc: &ModelDescription) -> Vec<Module> {
    let mut m: Vec<Module> = desc.components.iter().map(|c| c.module).collect();
    m.sort();
    m
}

fn component(desc: &ModelDescription, module: Module) -> &sd_placement::Component {
    desc.components.iter().find(|c| c.module == module).unwrap_or_else(|| panic!("no {module:?} in {desc:?}"))
}

/// The block of tensor `name` in the description's `module`.
fn block_in(desc: &ModelDescription, module: Module, name: &str) -> Option<u32> {
    component(desc, module).tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no {name}")).block
}

/// The ranges of a layer split of diffusion over two GPUs planned for `model`.
fn layer_split(model: ModelDescription) -> Vec<(String, u32, u32)> {
    let request = PlanRequest {
        flags: Flags { backend: Some("diffusion=cuda0&cuda1".into()), ..Flags::default() },
        devices: vec![Device::gpu("CUDA0", 8 * GIB, 8 * GIB), Device::gpu("CUDA1", 8 * GIB, 8 * GIB), Device::cpu()],
        ram_available_bytes: Some(32 * GIB),
        model,
        device_speeds: Default::default(),
    };
    let p = plan(&request).unwrap();
    assert!(p.fits, "{}", p.render());
    let m = p.modules.iter().find(|m| m.module == Module::Diffusion).unwrap();
    m.split.iter().map(|r| (r.device.clone(), r.first_block, r.last_block)).collect()
}

#[test]
fn flux_files_are_detected_numbered_and_planned() {
    let dir = tempfile::tempdir().unwrap();
    let dit = write(&dir.path().join("flux1-dev.safetensors"), &flux_tensors(true));
    let t5 = write(&dir.path().join("t5xxl.safetensors"), &T5);
    let files =
        ModelFiles::open(&ModelSources { model: Some(dit), t5xxl: Some(t5), ..ModelSources::default() }).unwrap();
    assert_eq!(files.detect(None).unwrap().arch, "flux");
    assert_eq!(files.detect(None).unwrap().context_dim, 4096);
    let index = files.index();
    // Double blocks first, then single blocks; T5's blocks are the text encoder's.
    let block = |name: &str| index.block_of(name);
    assert_eq!(block("model.diffusion_model.double_blocks.1.img_attn.qkv.weight"), Some(1));
    assert_eq!(block("model.diffusion_model.single_blocks.0.linear1.weight"), Some(2));
    assert_eq!(block("model.diffusion_model.single_blocks.2.linear1.weight"), Some(4));
    assert_eq!(block("model.diffusion_model.txt_in.weight"), None);
    assert_eq!(block("text_encoders.t5xxl.transformer.encoder.block.1.layer.0.SelfAttention.q.weight"), Some(1));
    assert_eq!(block("text_encoders.t5xxl.transformer.shared.weight"), None);

    let desc = sd_arch::describe(&files, &[], &loaded_bytes).unwrap();
    assert_eq!(modules(&desc), [Module::Diffusion, Module::Te, Module::Vae]);
    assert_eq!(block_in(&desc, Module::Diffusion, "model.diffusion_model.single_blocks.1.linear1.weight"), Some(3));
    let txt_in = component(&desc, Module::Diffusion).tensors.iter().find(|t| t.name.ends_with("txt_in.weight"));
    assert_eq!(txt_in.map(|t| t.bytes), Some(HIDDEN * 4096 * 2));
    assert_eq!(desc.files.len(), 2);
    assert!(desc.files.iter().all(|f| f.role.starts_with('<') && f.bytes > 0), "{:?}", desc.files);

    // The planner splits the DiT's five blocks over two GPUs, each range a run of blocks.
    let ranges = layer_split(desc);
    assert_eq!(ranges.len(), 2, "{ranges:?}");
    assert_eq!((ranges[0].0.as_str(), ranges[0].1), ("CUDA0", 0));
    assert_eq!((ranges[1].0.as_str(), ranges[1].2), ("CUDA1", 4));
    assert_eq!(ranges[1].1, ranges[0].2 + 1);
}

#[test]
fn flux_schnell_has_no_guidance_embedder() {
    let dir = tempfile::tempdir().unwrap();
    let dit = write(&dir.path().join("flux1-schnell.safetensors"), &flux_tensors(false));
    assert_eq!(ModelFiles::open_model(dit).unwrap().detect(None).unwrap().arch, "flux-schnell");
}

#[test]
fn sd_checkpoint_is_detected_numbered_and_described() {
    let dir = tempfile::tempdir().unwrap();
    let files = ModelFiles::open_model(write(&dir.path().join("sd15.safetensors"), &SD1)).unwrap();
    let detected = files.detect(None).unwrap();
    assert_eq!((detected.arch, detected.context_dim), ("sd1", 768));
    let block = |name: &str| files.index().block_of(name);
    // 12 input blocks (0-11), the middle block (12), the output blocks from 13.
    assert_eq!(block("model.diffusion_model.input_blocks.11.0.out_layers.3.weight"), Some(11));
    assert_eq!(block("model.diffusion_model.middle_block.1.norm.weight"), Some(12));
    assert_eq!(block("model.diffusion_model.output_blocks.11.1.transformer_blocks.0.attn2.to_k.weight"), Some(24));
    assert_eq!(block("cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc1.weight"), Some(11));
    assert_eq!(block("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"), None);
    assert_eq!(block("first_stage_model.decoder.conv_in.weight"), None);

    // An extra file read by header: a ControlNet, planned as its own module.
    let control = write(&dir.path().join("control.safetensors"), &[("input_hint_block.0.weight", &[16, 3, 3, 3])]);
    let extra =
        [ExtraFile { flag: "--control-net".into(), path: control, dominant: false, module: Module::ControlNet }];
    let desc = sd_arch::describe(&files, &extra, &loaded_bytes).unwrap();
    assert_eq!(modules(&desc), [Module::Diffusion, Module::Te, Module::Vae, Module::ControlNet]);
    assert_eq!(
        block_in(&desc, Module::Te, "cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight"),
        Some(0)
    );
    assert_eq!(component(&desc, Module::ControlNet).tensors[0].bytes, 16 * 3 * 3 * 3 * 2);
    assert_eq!(
        desc.files.iter().map(|f| f.role.as_str()).collect::<Vec<_>>(),
        ["<checkpoint file>", "<control-net file>"]
    );
    // A `--type`-like rule the caller gives sizes every tensor of the model.
    let quarter = sd_arch::describe(&files, &[], &|e| loaded_bytes(e) / 4).unwrap();
    let conv_in = |d: &ModelDescription| block_bytes(d, "model.diffusion_model.input_blocks.0.0.weight");
    assert_eq!(conv_in(&quarter) * 4, conv_in(&desc));

    let ranges = layer_split(desc);
    assert_eq!((ranges[0].1, ranges.last().unwrap().2), (0, 24), "{ranges:?}");
}

fn block_bytes(desc: &ModelDescription, name: &str) -> u64 {
    component(desc, Module::Diffusion).tensors.iter().find(|t| t.name == name).unwrap().bytes
}

/// The registry of this binary holds every architecture of `sd-arch`, without ggml.
#[test]
fn every_architecture_is_registered() {
    let names: Vec<&str> = sd_formats::arch::registered().iter().map(|a| a.name).collect();
    assert_eq!(
        names,
        [
            "chroma",
            "chroma-radiance",
            "flux",
            "flux-schnell",
            "flux2",
            "flux2-klein",
            "sd1",
            "sd2",
            "sd3",
            "sdxl",
            "zimage"
        ]
    );
}
