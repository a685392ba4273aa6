//! The pre-load memory check of `memory-check.md` (the guide "Image generation memory, logs and limits"): one table; each case quotes the sentence it checks.

mod common;

use common::*;
use sd_placement::*;

/// A model whose files add up to `file_mib` (tensors tiny so that placement always fits).
fn files(file_mib: &[u64]) -> ModelDescription {
    let mut m = simple_model(64 * MIB, 16 * MIB, 8 * MIB);
    m.files =
        file_mib.iter().enumerate().map(|(i, b)| SourceFile { role: format!("<file {i}>"), bytes: b * MIB }).collect();
    m
}

struct Case {
    rule: &'static str,
    devices: Vec<Device>,
    ram_mib: Option<u64>,
    file_mib: &'static [u64],
    backend: Option<&'static str>,
    verdict: Verdict,
    device: &'static str,
}

fn gpu_mem(name: &str, free_mib: Option<u64>, total_mib: Option<u64>) -> Device {
    Device::new(name, DeviceType::Gpu).with_memory(free_mib.map(|m| m * MIB), total_mib.map(|m| m * MIB))
}

#[test]
fn estimate_formula() {
    // "estimates the model's peak memory as its file sizes plus a quarter, plus 512 MiB"
    assert_eq!(memory_estimate(0), 512 * MIB);
    assert_eq!(memory_estimate(2 * GIB), 3 * GIB);
    assert_eq!(memory_estimate(4000 * MIB), 5512 * MIB);
    assert_eq!(memory_estimate(u64::MAX), u64::MAX);
    // The sum of every file.
    let p = plan(&request(
        vec![Device::cpu(), gpu("CUDA0", 64.0)],
        Some(64 * GIB),
        files(&[1000, 2000, 1000]),
        Flags::default(),
    ))
    .unwrap();
    assert_eq!(p.memory_check.estimate_bytes, 5512 * MIB);
    // No files: the tensor sizes stand in, with a warning.
    let mut m = files(&[]);
    m.files.clear();
    let p = plan(&request(vec![Device::cpu()], Some(64 * GIB), m, Flags::default())).unwrap();
    assert_eq!(p.memory_check.estimate_bytes, memory_estimate(88 * MIB));
    assert!(p.warnings.iter().any(|w| w.contains("no source file sizes")));
}

#[test]
fn verdicts() {
    let cases = vec![
        Case {
            rule: "estimate within the computing GPU's free memory: ok",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(8192), Some(8192))],
            ram_mib: Some(16384), file_mib: &[4000], backend: None, verdict: Verdict::Ok, device: "Vulkan0",
        },
        Case {
            rule: "\"A model whose estimate exceeds this figure loads, and the engine logs one warning ... with both numbers and the device\"",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(8192), Some(8192))],
            ram_mib: Some(16384), file_mib: &[7000], backend: None, verdict: Verdict::Warn, device: "Vulkan0",
        },
        Case {
            rule: "\"The memory of every discrete GPU plus system memory (MemAvailable...). On Linux a model whose estimate exceeds this sum is refused.\" 8 GiB + 8 GiB RAM < 16.5 GiB",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(8192), Some(8192))],
            ram_mib: Some(8192), file_mib: &[12800], backend: None, verdict: Verdict::Refuse, device: "Vulkan0",
        },
        Case {
            rule: "\"Windows does not read system memory, so nothing is refused there and only the warning applies.\" (RAM unknown)",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(8192), Some(8192))],
            ram_mib: None, file_mib: &[128_000], backend: None, verdict: Verdict::Warn, device: "Vulkan0",
        },
        Case {
            rule: "\"A GPU's figure is its free memory when the driver reports a budget\": free 4 GiB of 16: 5 GiB estimate warns",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(4096), Some(16384))],
            ram_mib: Some(32768), file_mib: &[3700], backend: None, verdict: Verdict::Warn, device: "Vulkan0",
        },
        Case {
            rule: "\"Without a budget the runtime reports the total as free, so the engine uses the total.\" (no free figure: total 16 GiB)",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", None, Some(16384))],
            ram_mib: Some(32768), file_mib: &[3700], backend: None, verdict: Verdict::Ok, device: "Vulkan0",
        },
        Case {
            rule: "\"A free figure of 0 against a positive total ... counts as no free memory: every model gets the warning below\"",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(0), Some(16384))],
            ram_mib: Some(32768), file_mib: &[10], backend: None, verdict: Verdict::Warn, device: "Vulkan0",
        },
        Case {
            rule: "\"... and that GPU adds nothing to the sum that refuses a load on Linux, so with one GPU a model above MemAvailable is refused\"",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(0), Some(16384))],
            ram_mib: Some(8192), file_mib: &[6600], backend: None, verdict: Verdict::Refuse, device: "Vulkan0",
        },
        Case {
            rule: "\"Nothing is checked or warned about when a GPU does not report its memory\"",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", None, None)],
            ram_mib: Some(8192), file_mib: &[128_000], backend: None, verdict: Verdict::Skipped, device: "Vulkan0",
        },
        Case {
            rule: "\"Nothing is checked ... when a GPU does not report its memory\" (0 free, 0 total)",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(0), Some(0))],
            ram_mib: Some(8192), file_mib: &[128_000], backend: None, verdict: Verdict::Skipped, device: "Vulkan0",
        },
        Case {
            rule: "\"With several discrete GPUs, the one that computes is ... for ComputeDevice.auto the discrete GPU with the most free memory, wherever it is listed\": warn against Vulkan1 (12 GiB), sum 4+12+8 GiB",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(4096), Some(4096)), gpu_mem("Vulkan1", Some(12288), Some(12288))],
            ram_mib: Some(8192), file_mib: &[12000], backend: None, verdict: Verdict::Warn, device: "Vulkan1",
        },
        Case {
            rule: "\"every discrete GPU plus system memory\" (two GPUs: 4 + 12 + 8 = 24 GiB < 24.9 GiB estimate)",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(4096), Some(4096)), gpu_mem("Vulkan1", Some(12288), Some(12288))],
            ram_mib: Some(8192), file_mib: &[19500], backend: None, verdict: Verdict::Refuse, device: "Vulkan1",
        },
        Case {
            rule: "\"for ComputeDevice.gpu the first one. The engine follows that for the warning.\" (--backend gpu: Vulkan0, 4 GiB)",
            devices: vec![Device::cpu(), gpu_mem("Vulkan0", Some(4096), Some(4096)), gpu_mem("Vulkan1", Some(12288), Some(12288))],
            ram_mib: Some(8192), file_mib: &[3700], backend: Some("gpu"), verdict: Verdict::Warn, device: "Vulkan0",
        },
        Case {
            rule: "\"beside a discrete GPU an integrated one adds nothing to the sum\": 8 GiB GPU + 16 GiB iGPU + 16 GiB RAM; 30 GiB estimate refused",
            devices: vec![Device::cpu(), igpu("Intel0", 16.0), gpu_mem("Vulkan0", Some(8192), Some(8192))],
            ram_mib: Some(16384), file_mib: &[24000], backend: None, verdict: Verdict::Refuse, device: "Vulkan0",
        },
        Case {
            rule: "\"with integrated GPUs only it compares with MemAvailable on Linux, as for the CPU\" (estimate below RAM, above the iGPU's own 2 GiB figure)",
            devices: vec![Device::cpu(), igpu("Intel0", 2.0)],
            ram_mib: Some(16384), file_mib: &[8000], backend: Some("intel0"), verdict: Verdict::Ok, device: "Intel0",
        },
        Case {
            rule: "\"with integrated GPUs only it compares with MemAvailable\" (estimate above RAM: refused)",
            devices: vec![Device::cpu(), igpu("Intel0", 64.0)],
            ram_mib: Some(8192), file_mib: &[8000], backend: Some("intel0"), verdict: Verdict::Refuse, device: "Intel0",
        },
        Case {
            rule: "\"(MemAvailable, as for the CPU)\": a CPU-only model is compared with RAM",
            devices: vec![Device::cpu()],
            ram_mib: Some(8192), file_mib: &[6000], backend: None, verdict: Verdict::Ok, device: "CPU",
        },
        Case {
            rule: "CPU-only, estimate above RAM: refused",
            devices: vec![Device::cpu()],
            ram_mib: Some(8192), file_mib: &[6200], backend: None, verdict: Verdict::Refuse, device: "CPU",
        },
        Case {
            rule: "CPU-only with RAM unknown: no memory figures, skipped",
            devices: vec![Device::cpu()],
            ram_mib: None, file_mib: &[6200], backend: None, verdict: Verdict::Skipped, device: "CPU",
        },
    ];
    for c in &cases {
        let f = Flags { backend: c.backend.map(Into::into), ..Flags::default() };
        let p = plan(&request(c.devices.clone(), c.ram_mib.map(|r| r * MIB), files(c.file_mib), f)).unwrap();
        let mc = &p.memory_check;
        assert_eq!(mc.verdict, c.verdict, "[{}] {}", c.rule, mc.message);
        assert_eq!(mc.device.as_deref(), Some(c.device), "[{}]", c.rule);
        let warned = p.warnings.iter().any(|w| w.starts_with("memory check:"));
        assert_eq!(warned, matches!(c.verdict, Verdict::Warn | Verdict::Refuse), "[{}] {:?}", c.rule, p.warnings);
        if c.verdict == Verdict::Warn {
            // "with both numbers and the device"
            assert!(
                mc.message.contains(c.device) && mc.message.contains(&fmt_bytes(mc.estimate_bytes)),
                "[{}] {}",
                c.rule,
                mc.message
            );
            assert!(mc.message.contains("system memory") && mc.message.contains("slower"), "[{}]", c.rule);
        }
        // A refusal makes the plan not fit, and only a refusal stops a load.
        assert_eq!(p.ensure_loadable().is_err(), c.verdict == Verdict::Refuse, "[{}]", c.rule);
        if c.verdict == Verdict::Refuse {
            assert!(!p.fits, "[{}]", c.rule);
        }
    }
}

#[test]
fn refusal_error_names_estimate_figures_and_device() {
    // "A model that does not fit throws LlamaModelException naming the estimate and the figures"
    let devs = vec![Device::cpu(), gpu_mem("Vulkan0", Some(8192), Some(8192))];
    let p = plan(&request(devs, Some(8 * GIB), files(&[12800]), Flags::default())).unwrap();
    let e = p.ensure_loadable().unwrap_err();
    let msg = e.to_string();
    for part in ["16.12 GiB", "Vulkan0 8.00 GiB + RAM 8.00 GiB", "16.00 GiB", "on Vulkan0", "--no-memory-check"] {
        assert!(msg.contains(part), "{msg:?} lacks {part:?}");
    }
    assert!(
        matches!(e, PlanError::MemoryRefused { estimate_bytes, .. } if estimate_bytes == memory_estimate(12800 * MIB))
    );
}

#[test]
fn disabled_check() {
    // "Set ImageModelParams(checkMemory: false) to load anyway, without a check or a warning."
    let devs = vec![Device::cpu(), gpu_mem("Vulkan0", Some(8192), Some(8192))];
    let f = Flags { no_memory_check: true, ..Flags::default() };
    let p = plan(&request(devs, Some(8 * GIB), files(&[128_000]), f)).unwrap();
    assert_eq!(p.memory_check.verdict, Verdict::Skipped);
    assert!(p.memory_check.message.contains("--no-memory-check"));
    assert!(!p.warnings.iter().any(|w| w.starts_with("memory check")));
    assert!(p.fits && p.ensure_loadable().is_ok());
}

#[test]
fn figure_rules() {
    // The GPU figure on its own (memory-check.md's three cases and "does not report").
    let g = |f: Option<u64>, t: Option<u64>| gpu_figure(&Device::new("G", DeviceType::Gpu).with_memory(f, t));
    assert_eq!(g(Some(5), Some(10)), Some(5));
    assert_eq!(g(None, Some(10)), Some(10));
    assert_eq!(g(Some(0), Some(10)), Some(0));
    assert_eq!(g(Some(0), Some(0)), None);
    assert_eq!(g(None, None), None);
    assert_eq!(g(Some(0), None), None);
}
