//! stable-diffusion.cpp's `docs/backend.md` "Automatic placement (--auto-fit on|off)": one table of hand-computed cases, each
//! quoting the sentence it checks. Sizes are in MiB; a GPU's budget is free - 512 MiB unless
//! --max-vram says otherwise. The derivation of each expectation is written next to it, using
//! the accounting of src/autofit.rs: a component goes to the main GPU when
//! resident + its params + room <= budget, room = max(compute reserves; full weights + reserve
//! of a higher-priority offloaded component) + largest tensor of every other component that is
//! offloaded or not yet decided.

mod common;

use common::*;
use sd_placement::*;

struct Case {
    rule: &'static str,
    devices: Vec<Device>,
    ram_mib: Option<u64>,
    model: ModelDescription,
    max_vram: Option<&'static str>,
    /// Main device, then params of diffusion, te, vae ("-" = absent).
    main: &'static str,
    params: [&'static str; 3],
    fits: bool,
}

fn check(c: &Case) -> Plan {
    // The memory check has its own tests (memory_check.rs); here `fits` is about placement.
    let f = Flags { max_vram: c.max_vram.map(Into::into), no_memory_check: true, ..Flags::default() };
    let p = plan(&request(c.devices.clone(), c.ram_mib.map(|r| r * MIB), c.model.clone(), f)).unwrap();
    assert!(p.auto_fit, "[{}]", c.rule);
    assert_eq!(p.main_device, c.main, "[{}] main device\n{}", c.rule, p.render());
    for (m, want) in [Module::Diffusion, Module::Te, Module::Vae].iter().zip(c.params) {
        if want == "-" {
            continue;
        }
        let mp = module(&p, *m);
        assert_eq!(mp.params, want, "[{}] params of {m}\n{}", c.rule, p.render());
        // "auto-fit uses one GPU for diffusion / te / vae computation"
        assert_eq!(mp.runtime, [c.main], "[{}] runtime of {m}", c.rule);
    }
    assert_eq!(p.fits, c.fits, "[{}] fits\n{}", c.rule, p.render());
    p
}

fn cpu_gpus(gpus: &[(&str, u64)]) -> Vec<Device> {
    let mut d = vec![Device::cpu()];
    d.extend(gpus.iter().map(|(n, b)| gpu_budget(n, *b)));
    d
}

#[test]
fn placement_order() {
    let cases = vec![
        Case {
            rule: "\"Each component's weights use the first storage location with enough remaining budget: 1. The main GPU, leaving estimated space for computation and weight staging.\" \
                   diffusion 4096+2048+(100+10)=6254 <= 10240; te 4096+1024+2048+10=7178; vae 5120+200+2048=7368",
            devices: cpu_gpus(&[("CUDA0", 10240)]),
            ram_mib: Some(32768),
            model: mib_model((4096, 100), (1024, 100), (200, 10)),
            max_vram: None,
            main: "CUDA0",
            params: ["CUDA0", "CUDA0", "CUDA0"],
            fits: true,
        },
        Case {
            rule: "\"2. CPU RAM\" and \"If offloaded diffusion already needs the entire main GPU budget, TE and VAE also use offloaded parameters.\" \
                   diffusion 7168+2048+110=9326 > 8192 -> RAM; te 1024+(2048+7168-100)+(100+10)=10250 > 8192 -> RAM; vae likewise",
            devices: cpu_gpus(&[("CUDA0", 8192)]),
            ram_mib: Some(32768),
            model: mib_model((7168, 100), (1024, 100), (200, 10)),
            max_vram: None,
            main: "CUDA0",
            params: ["CPU", "CPU", "CPU"],
            fits: true,
        },
        Case {
            rule: "\"Before a lower-priority component can become permanently resident, the planner leaves room for the full weights and estimated compute space of higher-priority offloaded components.\" \
                   diffusion 3000+2048+400+10=5458 -> GPU; te 3000+4000+2048+10=9058 > 8192 -> RAM; vae alone would fit (3000+200+2048+400=5648) but \
                   3000+200+(2048+4000-400)+400=9248 > 8192 -> RAM",
            devices: cpu_gpus(&[("CUDA0", 8192)]),
            ram_mib: Some(32768),
            model: mib_model((3000, 50), (4000, 400), (200, 10)),
            max_vram: None,
            main: "CUDA0",
            params: ["CUDA0", "CPU", "CPU"],
            fits: true,
        },
        Case {
            rule: "\"3. Another GPU, choosing the one with the largest remaining budget that fits.\" (after RAM: cap 8192-2048=6144 < 7500) \
                   diffusion 7500+2048+800+10=10358 > 10240, RAM too small, CUDA1 6144 < 7500, CUDA2 8192 -> CUDA2; \
                   te 1000+(2048+7500-100)+(100+10)=10558 > 10240 -> RAM (1000 <= 6144); vae -> RAM",
            devices: cpu_gpus(&[("CUDA0", 10240), ("CUDA1", 6144), ("CUDA2", 8192)]),
            ram_mib: Some(8192),
            model: mib_model((7500, 100), (1000, 800), (200, 10)),
            max_vram: None,
            main: "CUDA0",
            params: ["CUDA2", "CPU", "CPU"],
            fits: true,
        },
        Case {
            rule: "\"If available RAM cannot be queried, RAM residency is skipped.\" + \"the one with the largest remaining budget\" + \"RAM and GPU budgets are shared across components\": \
                   diffusion -> CUDA1 (9216 > 8192, both fit 7500); te: CUDA1 has 1716 left, CUDA2 8192 -> CUDA2; vae: CUDA1 1716, CUDA2 7192 -> CUDA2",
            devices: cpu_gpus(&[("CUDA0", 10240), ("CUDA1", 9216), ("CUDA2", 8192)]),
            ram_mib: None,
            model: mib_model((7500, 100), (1000, 800), (200, 10)),
            max_vram: None,
            main: "CUDA0",
            params: ["CUDA1", "CUDA2", "CUDA2"],
            fits: true,
        },
        Case {
            rule: "\"Each component uses a single parameter backend; several other GPUs' capacities are not combined to store one component.\" + \"4. Disk, reloading weights on demand.\" \
                   diffusion 9000: main 9000+2048+.. > 10240, RAM cap 6144, CUDA1/CUDA2 5120 each (10240 together) -> disk",
            devices: cpu_gpus(&[("CUDA0", 10240), ("CUDA1", 5120), ("CUDA2", 5120)]),
            ram_mib: Some(8192),
            model: mib_model((9000, 100), (500, 50), (100, 10)),
            max_vram: None,
            main: "CUDA0",
            params: ["disk", "CPU", "CPU"],
            fits: true,
        },
        Case {
            rule: "\"auto-fit does not change a component to CPU computation solely because its full weights exceed VRAM\": a 1 GiB budget cannot even hold the 2 GiB compute reserve; \
                   the runtime stays on the GPU and the plan does not fit",
            devices: cpu_gpus(&[("CUDA0", 1024)]),
            ram_mib: Some(32768),
            model: mib_model((1500, 50), (200, 20), (100, 10)),
            max_vram: None,
            main: "CUDA0",
            params: ["CPU", "CPU", "CPU"],
            fits: false,
        },
    ];
    for c in &cases {
        check(c);
    }
}

#[test]
fn main_gpu_choice() {
    // "It chooses the GPU with the largest available memory budget (the first device on a tie)"
    let devs = cpu_gpus(&[("CUDA0", 8192), ("CUDA1", 12288), ("CUDA2", 12288)]);
    let m = mib_model((1000, 10), (100, 10), (100, 10));
    let p = check(&Case {
        rule: "largest budget, first on a tie",
        devices: devs.clone(),
        ram_mib: Some(16384),
        model: m.clone(),
        max_vram: None,
        main: "CUDA1",
        params: ["CUDA1", "CUDA1", "CUDA1"],
        fits: true,
    });
    assert_eq!(p.backend, "diffusion=CUDA1,te=CUDA1,vae=CUDA1", "\"The chosen backend specifications are printed.\"");
    assert_eq!(p.params_backend, "");
    // "--auto-fit on --max-vram cuda0=8,cuda1=14": budgets decide, not free memory.
    check(&Case {
        rule: "--max-vram lowers CUDA1's budget: CUDA2 is now largest",
        devices: devs.clone(),
        ram_mib: Some(16384),
        model: m.clone(),
        max_vram: Some("cuda1=4"),
        main: "CUDA2",
        params: ["CUDA2", "CUDA2", "CUDA2"],
        fits: true,
    });
    // Listing order, not name: the GPU listed first wins a tie.
    let devs2 = cpu_gpus(&[("CUDA1", 8192), ("CUDA0", 8192)]);
    check(&Case {
        rule: "tie: first listed",
        devices: devs2,
        ram_mib: Some(16384),
        model: m.clone(),
        max_vram: None,
        main: "CUDA1",
        params: ["CUDA1", "CUDA1", "CUDA1"],
        fits: true,
    });
    // Only discrete GPUs are candidates.
    let devs3 = vec![Device::cpu(), igpu("Intel0", 30.0), gpu_budget("Vulkan0", 4096)];
    check(&Case {
        rule: "integrated GPU is never main when a GPU exists",
        devices: devs3,
        ram_mib: Some(16384),
        model: m,
        max_vram: None,
        main: "Vulkan0",
        params: ["Vulkan0", "Vulkan0", "Vulkan0"],
        fits: true,
    });
}

#[test]
fn reserves_and_staging() {
    // "Initial compute reserves are estimates (2 GiB for diffusion and text encoders, 1 GiB for
    // VAE); higher-priority placements also leave staging space for the largest weight tensor of
    // each lower-priority offloaded component." Budgets set exactly with --max-vram (n/1024 GiB).
    #[allow(clippy::type_complexity)]
    let table: &[(&str, (u64, u64), (u64, u64), (u64, u64), u64, [&str; 3])] = &[
        ("VAE alone: 1000 + 1024 = 2024 > 2023", (0, 0), (0, 0), (1000, 10), 2023, ["-", "-", "CPU"]),
        ("VAE alone: 1000 + 1024 = 2024 fits 2024", (0, 0), (0, 0), (1000, 10), 2024, ["-", "-", "CUDA0"]),
        ("diffusion alone: 1000 + 2048 = 3048 > 3047", (1000, 10), (0, 0), (0, 0), 3047, ["CPU", "-", "-"]),
        ("diffusion alone: 3048 fits 3048", (1000, 10), (0, 0), (0, 0), 3048, ["CUDA0", "-", "-"]),
        ("te alone: 2 GiB reserve", (0, 0), (1000, 10), (0, 0), 3048, ["-", "CUDA0", "-"]),
        (
            "diffusion leaves staging for te's and vae's largest tensors: 1000+2048+60+50 = 3158 > 3157",
            (1000, 10),
            (600, 60),
            (100, 50),
            3157,
            ["CPU", "CPU", "CPU"],
        ),
        (
            "... and fits 3158; then te 1000+600+2048+50 = 3698 > 3158, vae needs te's full weights room",
            (1000, 10),
            (600, 60),
            (100, 50),
            3158,
            ["CUDA0", "CPU", "CPU"],
        ),
        ("everything: 1700 + 2048 = 3748", (1000, 10), (600, 60), (100, 50), 3748, ["CUDA0", "CUDA0", "CUDA0"]),
    ];
    for (why, d, t, v, budget, want) in table {
        let spec: &'static str = Box::leak(format!("cuda0={}", *budget as f64 / 1024.0).into_boxed_str());
        check(&Case {
            rule: why,
            devices: cpu_gpus(&[("CUDA0", 100_000)]),
            ram_mib: Some(65536),
            model: mib_model(*d, *t, *v),
            max_vram: Some(spec),
            main: "CUDA0",
            params: *want,
            fits: true,
        });
    }
}

#[test]
fn ram_reserve_rule() {
    // "CPU RAM, reserving the larger of 2 GiB or 10% of available RAM for other work."
    assert_eq!(ram_reserve(8 * GIB), 2 * GIB);
    assert_eq!(ram_reserve(20 * GIB), 2 * GIB);
    assert_eq!(ram_reserve(40 * GIB), 4 * GIB);
    // 40 GiB RAM: 36 GiB for params. A 36 GiB diffusion model goes to RAM, one MiB more to disk.
    for (extra, want) in [(0u64, "CPU"), (1, "disk")] {
        let m = mib_model((36 * 1024 + extra, 100), (0, 0), (0, 0));
        check(&Case {
            rule: "RAM reserve max(2 GiB, 10%)",
            devices: cpu_gpus(&[("CUDA0", 4096)]),
            ram_mib: Some(40 * 1024),
            model: m,
            max_vram: None,
            main: "CUDA0",
            params: [want, "-", "-"],
            fits: true,
        });
    }
    // 10 GiB RAM: the 2 GiB floor applies (10% would be 1 GiB): 8 GiB for params.
    for (extra, want) in [(0u64, "CPU"), (1, "disk")] {
        let m = mib_model((8 * 1024 + extra, 100), (0, 0), (0, 0));
        check(&Case {
            rule: "RAM reserve floor 2 GiB",
            devices: cpu_gpus(&[("CUDA0", 4096)]),
            ram_mib: Some(10 * 1024),
            model: m,
            max_vram: None,
            main: "CUDA0",
            params: [want, "-", "-"],
            fits: true,
        });
    }
}

#[test]
fn no_gpu() {
    // Issue: "No GPU at all: everything computes on the CPU with params in RAM, or on disk when
    // RAM cannot hold them." RAM 8192: cap 6144; diffusion 4096 (4096+2048+110 <= 8192) -> RAM;
    // te 4096+2500 > 6144 -> disk; vae 4296 <= 6144, 4296+2048+100 <= 8192 -> RAM.
    let m = mib_model((4096, 100), (2500, 100), (200, 10));
    let p = check(&Case {
        rule: "CPU only",
        devices: vec![Device::cpu()],
        ram_mib: Some(8192),
        model: m.clone(),
        max_vram: None,
        main: "CPU",
        params: ["CPU", "disk", "CPU"],
        fits: true,
    });
    assert_eq!(device(&p, "CPU").used_bytes, (4296 + 2048 + 100) * MIB);
    // An integrated GPU alone does not make auto-fit compute on it.
    let p = check(&Case {
        rule: "iGPU only",
        devices: vec![Device::cpu(), igpu("Intel0", 8.0)],
        ram_mib: Some(8192),
        model: m.clone(),
        max_vram: None,
        main: "CPU",
        params: ["CPU", "disk", "CPU"],
        fits: true,
    });
    assert!(p.warnings.iter().any(|w| w.contains("integrated GPU")));
    // RAM unknown: params stay with the CPU runtime (disk is never chosen blindly), with a warning.
    let p = check(&Case {
        rule: "CPU only, RAM unknown",
        devices: vec![Device::cpu()],
        ram_mib: None,
        model: m,
        max_vram: None,
        main: "CPU",
        params: ["CPU", "CPU", "CPU"],
        fits: true,
    });
    assert!(p.warnings.iter().any(|w| w.contains("RAM is unknown")));
}

#[test]
fn split_mode_does_not_change_auto_fit() {
    // "Auto-fit does not select multi-GPU layer/row computation, so --split-mode does not change
    // its placements."
    let devs = vec![Device::cpu(), gpu("CUDA0", 12.0).with_row_split(true), gpu("CUDA1", 12.0).with_row_split(true)];
    let m = flux_dev_q8();
    let base = plan(&request(devs.clone(), Some(32 * GIB), m.clone(), Flags::default())).unwrap();
    let row =
        plan(&request(devs, Some(32 * GIB), m, Flags { split_mode: Some("row".into()), ..Flags::default() })).unwrap();
    assert_eq!(base.modules, row.modules);
    assert!(base.modules.iter().all(|m| m.split_mode == SplitKind::None && m.runtime.len() == 1));
    assert!(row.warnings.iter().any(|w| w.contains("--split-mode does not change auto-fit")));
}

#[test]
fn other_gpus_store_weights_only() {
    // "Other GPUs store weights only: weights are copied to the main GPU for execution." The
    // other GPU's usage is params only; staging for the offloaded component is on the main GPU.
    // diffusion 7500+2048+(800+10) > 10240 -> CUDA1; te 1000+(2048+7400)+110 > 10240 -> CUDA1
    // (1716 left); vae 200+9448+900 > 10240 -> CUDA1 (716 left).
    let c = Case {
        rule: "other GPUs store weights only",
        devices: cpu_gpus(&[("CUDA0", 10240), ("CUDA1", 9216)]),
        ram_mib: None,
        model: mib_model((7500, 100), (1000, 800), (200, 10)),
        max_vram: None,
        main: "CUDA0",
        params: ["CUDA1", "CUDA1", "CUDA1"],
        fits: true,
    };
    let p = check(&c);
    let other = device(&p, "CUDA1");
    assert_eq!((other.param_bytes, other.compute_bytes, other.staging_bytes), (8700 * MIB, 0, 0));
    let main = device(&p, "CUDA0");
    assert_eq!((main.param_bytes, main.compute_bytes, main.staging_bytes), (0, 2048 * MIB, 910 * MIB));
}

/// Issue 39: a module's estimated compute buffer (`ModelDescription::compute_bytes`, from the
/// model and the image size) replaces backend.md's fixed reserve, so a small budget plans as
/// it runs: an SD 1.5-sized model computing on a 512 MiB device with its params in RAM does
/// not fit with the fixed 2 GiB reserve and fits with a 300 MiB estimate; the estimate is
/// what the plan reports and counts.
#[test]
fn compute_estimates_replace_the_fixed_reserve() {
    let devices = vec![Device::gpu("RPC0", 8 * GIB, 8 * GIB).with_registry("RPC"), Device::cpu()];
    let flags = Flags {
        backend: Some("RPC0".into()),
        params_backend: Some("cpu".into()),
        max_vram: Some("RPC0=0.5".into()),
        ..Flags::default()
    };
    let model = mib_model((1640, 56), (235, 72), (160, 4));
    let fixed = plan(&request(devices.clone(), Some(16 * GIB), model.clone(), flags.clone())).unwrap();
    assert!(!fixed.fits, "the fixed 2 GiB reserve does not fit a 512 MiB budget");
    assert_eq!(module(&fixed, Module::Diffusion).compute_reserve_bytes, 2 * GIB);

    let mut estimated = model;
    estimated.compute_bytes =
        [(Module::Diffusion, 300 * MIB), (Module::Te, 20 * MIB), (Module::Vae, 200 * MIB)].into_iter().collect();
    let p = plan(&request(devices, Some(16 * GIB), estimated, flags)).unwrap();
    assert!(p.fits, "{}", p.render());
    assert_eq!(module(&p, Module::Diffusion).compute_reserve_bytes, 300 * MIB);
    assert_eq!(module(&p, Module::Vae).compute_reserve_bytes, 200 * MIB);
    let rpc = p.devices.iter().find(|d| d.device == "RPC0").unwrap();
    // the largest reserve of the modules computing there, plus the staged largest tensors
    assert_eq!(rpc.compute_bytes, 300 * MIB, "{}", p.render());
    assert!(rpc.used_bytes <= 512 * MIB, "{}", p.render());
}

/// Issue 39: with only a remote device as GPU, auto-fit computes te and vae there too (as
/// stable-diffusion.cpp's default device, the first GPU, does), and the plan says so with
/// the flag that keeps them local; a local GPU's plan has no such note, nor one with
/// explicit --backend.
#[test]
fn auto_fit_on_an_rpc_device_says_te_and_vae_moved() {
    let model = mib_model((1640, 56), (235, 72), (160, 4));
    let rpc = vec![Device::gpu("RPC0", 8 * GIB, 8 * GIB).with_registry("RPC"), Device::cpu()];
    let p = plan(&request(rpc.clone(), Some(16 * GIB), model.clone(), Flags::default())).unwrap();
    assert_eq!(module(&p, Module::Te).runtime, ["RPC0"]);
    let note = p.warnings.iter().find(|w| w.contains("RPC devices as GPUs")).expect("the note");
    assert!(note.starts_with("te on RPC0, vae on RPC0:") && note.contains("--backend \"te=cpu,vae=cpu\""), "{note}");

    let local = vec![gpu("CUDA0", 8.0), Device::cpu()];
    let p = plan(&request(local, Some(16 * GIB), model.clone(), Flags::default())).unwrap();
    assert!(!p.warnings.iter().any(|w| w.contains("RPC devices")), "{:?}", p.warnings);
    let p = plan(&request(rpc, Some(16 * GIB), model, flags(Some("diffusion=RPC0,te=RPC0,vae=RPC0"), None))).unwrap();
    assert!(!p.warnings.iter().any(|w| w.contains("RPC devices")), "{:?}", p.warnings);
}
