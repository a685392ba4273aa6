//! Shared test helpers: devices, requests and synthesized model descriptions with realistic
//! tensor counts and sizes (derived from the architectures' shapes, documented per model).
#![allow(dead_code)]

use sd_placement::*;

pub fn gib(x: f64) -> u64 {
    (x * GIB as f64) as u64
}

pub fn gpu(name: &str, free_gib: f64) -> Device {
    Device::gpu(name, gib(free_gib), gib(free_gib)).with_registry(registry_of(name))
}

pub fn igpu(name: &str, free_gib: f64) -> Device {
    Device::new(name, DeviceType::Igpu).with_memory(Some(gib(free_gib)), Some(gib(free_gib)))
}

fn registry_of(name: &str) -> String {
    name.trim_end_matches(|c: char| c.is_ascii_digit()).to_string()
}

/// `n` tensors of a module adding up to `total` bytes, the first one `largest` bytes.
/// `blocks`: when `Some(nb)`, tensors 1.. are spread over blocks 0..nb in order.
pub fn tensors(prefix: &str, n: usize, total: u64, largest: u64, blocks: Option<u32>) -> Vec<Tensor> {
    assert!(n >= 2 && total > largest);
    let rest = total - largest;
    let each = rest / (n as u64 - 1);
    let mut out = vec![Tensor::new(format!("{prefix}.largest.weight"), largest)];
    for i in 1..n {
        let bytes = if i == n - 1 { rest - each * (n as u64 - 2) } else { each };
        let block = blocks.map(|nb| ((i - 1) as u64 * nb as u64 / (n as u64 - 1)) as u32);
        out.push(Tensor { name: format!("{prefix}.t{i}.weight"), bytes, block });
    }
    out
}

/// A small model with every module present, blocks on diffusion and te: for parser tests.
pub fn all_modules_model() -> ModelDescription {
    let mut components = Vec::new();
    for m in Module::ALL {
        let blocks = if matches!(m, Module::Diffusion | Module::Te) { Some(8) } else { None };
        components.push(Component { module: m, tensors: tensors(m.name(), 17, 64 * MIB, 8 * MIB, blocks) });
    }
    ModelDescription { compute_bytes: Default::default(), components, files: vec![] }
}

pub fn simple_model(diffusion: u64, te: u64, vae: u64) -> ModelDescription {
    let mut components = vec![];
    if diffusion > 0 {
        components.push(Component {
            module: Module::Diffusion,
            tensors: tensors("unet", 40, diffusion, diffusion / 20, Some(12)),
        });
    }
    if te > 0 {
        components.push(Component { module: Module::Te, tensors: tensors("te", 20, te, te / 10, Some(6)) });
    }
    if vae > 0 {
        components.push(Component { module: Module::Vae, tensors: tensors("vae", 20, vae, vae / 20, None) });
    }
    let total = diffusion + te + vae;
    ModelDescription {
        compute_bytes: Default::default(),
        components,
        files: vec![SourceFile { role: "<checkpoint file>".into(), bytes: total }],
    }
}

pub fn request(devices: Vec<Device>, ram: Option<u64>, model: ModelDescription, flags: Flags) -> PlanRequest {
    PlanRequest { flags, devices, ram_available_bytes: ram, model, device_speeds: Default::default() }
}

pub fn flags(backend: Option<&str>, params: Option<&str>) -> Flags {
    Flags { backend: backend.map(Into::into), params_backend: params.map(Into::into), ..Flags::default() }
}

pub fn module(p: &Plan, m: Module) -> &ModulePlan {
    p.modules.iter().find(|x| x.module == m).unwrap_or_else(|| panic!("module {m} missing from plan"))
}

pub fn device<'a>(p: &'a Plan, name: &str) -> &'a DeviceUsage {
    p.devices.iter().find(|x| x.device == name).unwrap_or_else(|| panic!("device {name} missing"))
}

// ---------------------------------------------------------------------------------------------
// Realistic models. Sizes follow the architectures' parameter counts; the largest tensor is the
// largest weight of the architecture in the given storage type.

/// SD 1.5 in f16 (v1-5-pruned-emaonly-fp16: one 2,132,625,894-byte file).
/// UNet 859.5M params (686 tensors; largest output_blocks.*.in_layers conv [1280,2560,3,3] =
/// 58,982,400 B); CLIP-L text 123.06M params (196 tensors; token embedding 49408x768 =
/// 75,890,688 B); VAE 83.65M params (248 tensors; largest conv [512,512,3,3] = 4,718,592 B).
/// The UNet has no transformer blocks a layer split recognizes (upstream excludes UNet blocks).
pub fn sd15_f16() -> ModelDescription {
    ModelDescription {
        compute_bytes: Default::default(),
        components: vec![
            Component {
                module: Module::Diffusion,
                tensors: tensors("model.diffusion_model", 686, 1_719_042_560, 58_982_400, None),
            },
            Component {
                module: Module::Te,
                tensors: tensors("cond_stage_model.transformer", 196, 246_144_000, 75_890_688, None),
            },
            Component { module: Module::Vae, tensors: tensors("first_stage_model", 248, 167_300_000, 4_718_592, None) },
        ],
        files: vec![SourceFile { role: "<checkpoint file>".into(), bytes: 2_132_625_894 }],
    }
}

/// SDXL base 1.0 in f16 (one 6,938,040,682-byte file). UNet 2.567B params (1680 tensors;
/// largest conv [1280,2560,3,3] = 58,982,400 B); CLIP-L + OpenCLIP-G text 817.7M params (713
/// tensors; largest the G token embedding 49408x1280 = 126,484,480 B); VAE as SD 1.5.
pub fn sdxl_f16() -> ModelDescription {
    ModelDescription {
        compute_bytes: Default::default(),
        components: vec![
            Component {
                module: Module::Diffusion,
                tensors: tensors("model.diffusion_model", 1680, 5_135_000_000, 58_982_400, None),
            },
            Component {
                module: Module::Te,
                tensors: tensors("conditioner.embedders", 713, 1_635_400_000, 126_484_480, None),
            },
            Component { module: Module::Vae, tensors: tensors("first_stage_model", 248, 167_300_000, 4_718_592, None) },
        ],
        files: vec![SourceFile { role: "<checkpoint file>".into(), bytes: 6_938_040_682 }],
    }
}

/// Flux.1-dev in q8_0 (34 bytes per 32 weights) with CLIP-L f16, T5-XXL f16 and the f32 AE.
///
/// Diffusion: 19 double blocks (blocks 0..=18) of 12 weights: per stream modulation
/// 3072x18432 (60,162,048 B), qkv 3072x9216 (30,081,024 B), proj 3072x3072 (10,027,008 B), two
/// MLP 3072x12288 (40,108,032 B each): 360,972,288 B per block; 38 single blocks (19..=56):
/// linear1 3072x21504 (70,189,056 B), linear2 15360x3072 (50,135,040 B), modulation 3072x9216
/// (30,081,024 B): 150,405,120 B per block; 8 non-block tensors (img_in, txt_in, time_in,
/// vector_in, guidance_in, final_layer) of 68,000,000 B in all. Total 12,641,868,032 B
/// (~11.77 GiB); largest tensor 70,189,056 B.
///
/// Text encoders: CLIP-L 246,144,000 B (196 non-block tensors; token embedding 75,890,688 B) and
/// T5-XXL encoder: shared embedding 32128x4096 (263,192,576 B, non-block) and 24 blocks of
/// q,k,v,o 4096x4096 + wi_0, wi_1 4096x10240 + wo 10240x4096 in f16 = 385,875,968 B per block;
/// the T5 blocks are te's blocks (the dominant encoder).
///
/// VAE (AE, f32): 83.65M params = 335,304,388 B, 244 tensors, largest conv 9,437,184 B.
pub fn flux_dev_q8() -> ModelDescription {
    let mut diff = Vec::new();
    let double = [60_162_048u64, 30_081_024, 10_027_008, 40_108_032, 40_108_032];
    for b in 0..19u32 {
        for stream in ["img", "txt"] {
            for (i, bytes) in double.iter().enumerate() {
                diff.push(Tensor::in_block(format!("double_blocks.{b}.{stream}.w{i}"), *bytes, b));
            }
        }
    }
    for s in 0..38u32 {
        for (i, bytes) in [70_189_056u64, 50_135_040, 30_081_024].iter().enumerate() {
            diff.push(Tensor::in_block(format!("single_blocks.{s}.w{i}"), *bytes, 19 + s));
        }
    }
    for name in
        ["img_in", "txt_in", "time_in", "vector_in", "guidance_in", "final_layer.adaLN", "final_layer.linear", "norm"]
    {
        diff.push(Tensor::new(format!("{name}.weight"), 8_500_000));
    }
    let mut te = tensors("text_encoders.clip_l", 196, 246_144_000, 75_890_688, None);
    te.push(Tensor::new("text_encoders.t5xxl.shared.weight", 263_192_576));
    for b in 0..24u32 {
        for (i, bytes) in
            [33_554_432u64, 33_554_432, 33_554_432, 33_554_432, 83_886_080, 83_886_080, 83_886_080].iter().enumerate()
        {
            te.push(Tensor::in_block(format!("text_encoders.t5xxl.encoder.block.{b}.w{i}"), *bytes, b));
        }
    }
    let vae = tensors("vae", 244, 335_304_388, 9_437_184, None);
    let diff_bytes: u64 = diff.iter().map(|t| t.bytes).sum();
    ModelDescription {
        compute_bytes: Default::default(),
        components: vec![
            Component { module: Module::Diffusion, tensors: diff },
            Component { module: Module::Te, tensors: te },
            Component { module: Module::Vae, tensors: vae },
        ],
        files: vec![
            SourceFile { role: "<diffusion model file>".into(), bytes: diff_bytes + 1_200_000 },
            SourceFile { role: "<clip_l file>".into(), bytes: 246_144_352 },
            SourceFile { role: "<t5xxl file>".into(), bytes: 9_787_841_024 },
            SourceFile { role: "<vae file>".into(), bytes: 335_304_388 },
        ],
    }
}

/// A component of `total` bytes whose largest tensor is exactly `largest` bytes (the other
/// tensors are smaller), optionally spread over `blocks` blocks.
pub fn comp(module: Module, total: u64, largest: u64, blocks: Option<u32>) -> Component {
    let rest = total - largest;
    let n = (rest.div_ceil(largest) + 2) as usize;
    let t = tensors(module.name(), n, total, largest, blocks);
    assert!(t.iter().all(|x| x.bytes <= largest), "test helper: largest tensor must be {largest}");
    Component { module, tensors: t }
}

/// diffusion, te, vae as (total MiB, largest tensor MiB); 0 total = absent. No blocks.
pub fn mib_model(d: (u64, u64), t: (u64, u64), v: (u64, u64)) -> ModelDescription {
    let mut components = vec![];
    for (m, (p, l)) in [(Module::Diffusion, d), (Module::Te, t), (Module::Vae, v)] {
        if p > 0 {
            components.push(comp(m, p * MIB, l * MIB, None));
        }
    }
    let total = (d.0 + t.0 + v.0) * MIB;
    ModelDescription {
        compute_bytes: Default::default(),
        components,
        files: vec![SourceFile { role: "<model file>".into(), bytes: total }],
    }
}

/// A GPU whose default budget (free - 512 MiB) is `budget_mib`.
pub fn gpu_budget(name: &str, budget_mib: u64) -> Device {
    let free = budget_mib * MIB + 512 * MIB;
    Device::gpu(name, free, free)
}
