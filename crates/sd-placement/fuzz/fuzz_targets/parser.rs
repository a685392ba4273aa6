//! Fuzz target: every parser entry point of sd-placement, and `plan` on the parsed flags, must
//! return (a plan or an error) and never panic.
//!
//! Input: up to six fields separated by newlines: --backend, --params-backend, --split-mode,
//! --max-vram, --auto-fit, and a device profile (the rest of the input, TOML).

#![no_main]

use libfuzzer_sys::fuzz_target;
use sd_placement::*;

fn devices() -> Vec<Device> {
    vec![
        Device::cpu(),
        Device::gpu("CUDA0", 8 << 30, 8 << 30).with_row_split(true),
        Device::gpu("CUDA1", 4 << 30, 12 << 30).with_row_split(true),
        Device::gpu("Vulkan0", 6 << 30, 6 << 30),
        Device::new("Intel0", DeviceType::Igpu),
    ]
}

fn model() -> ModelDescription {
    let mut components = Vec::new();
    for (k, m) in Module::ALL.into_iter().enumerate() {
        let tensors = (0..6u32)
            .map(|i| Tensor {
                name: format!("{m}.{i}"),
                bytes: (k as u64 + 1) << 28,
                block: (i > 0).then_some(i),
            })
            .collect();
        components.push(Component { module: m, tensors });
    }
    ModelDescription { compute_bytes: Default::default(),
        components,
        files: vec![SourceFile {
            role: "<file>".into(),
            bytes: 9 << 30,
        }],
    }
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut fields = text.splitn(9, '\n');
    let mut next = || fields.next().map(str::to_string);
    let flags = Flags {
        backend: next(),
        params_backend: next(),
        split_mode: next(),
        max_vram: next(),
        auto_fit: next(),
        split_by: next(),
        pipeline_copies: next(),
        pipeline_copies_env: next(),
        clip_on_cpu: data.first().is_some_and(|b| b & 1 == 1),
        vae_on_cpu: data.first().is_some_and(|b| b & 2 == 2),
        control_net_cpu: data.first().is_some_and(|b| b & 4 == 4),
        offload_to_cpu: data.first().is_some_and(|b| b & 8 == 8),
        no_memory_check: data.first().is_some_and(|b| b & 16 == 16),
    };
    let profile = next().unwrap_or_default();

    let _ = parse_backend(&text);
    let _ = parse_params_backend(&text);
    let _ = parse_split_mode(&text);
    let _ = parse_max_vram(&text);
    let _ = parse_auto_fit(Some(&text));
    let _ = parse_split_by(Some(&text));
    let _ = parse_pipeline_copies(Some(&text), Some(&text));
    let _ = Module::parse(&text);
    let _ = resolve_device(&devices(), &text, Flag::Backend, &text);

    let req = PlanRequest {
        flags: flags.clone(),
        devices: devices(),
        ram_available_bytes: Some(16 << 30),
        model: model(),
        device_speeds: Default::default(),
    };
    if let Ok(p) = plan(&req) {
        let _ = p.render();
        let _ = p.to_json();
        let _ = p.ensure_loadable();
    }
    if let Ok(profile) = DeviceProfile::from_toml_str(&profile) {
        let req = PlanRequest {
            flags,
            devices: profile.devices(),
            ram_available_bytes: profile.ram_available_bytes(),
            model: model(),
            device_speeds: Default::default(),
        };
        if let Ok(p) = plan(&req) {
            let _ = p.render();
        }
    }
});
