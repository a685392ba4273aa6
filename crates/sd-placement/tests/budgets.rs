//! `--max-vram` budget semantics (stable-diffusion.cpp's `docs/performance.md` and `docs/backend.md`), one table; each case quotes
//! the sentence it checks.

mod common;

use common::*;
use sd_placement::*;

struct Case {
    rule: &'static str,
    max_vram: Option<&'static str>,
    /// (free, total) of CUDA0 in MiB.
    cuda0: (Option<u64>, Option<u64>),
    /// Expected budget of CUDA0 in MiB (None = unknown) and of CUDA1 (free = total = 8192).
    want: (Option<u64>, Option<u64>),
}

#[test]
fn budget_semantics() {
    let cases = [
        Case {
            rule: "backend.md: \"with no budget set each device's free memory minus a 512 MiB margin is used\"",
            max_vram: None, cuda0: (Some(8192), Some(12288)), want: (Some(7680), Some(7680)),
        },
        Case {
            rule: "performance.md: \"A positive value is a managed per-device budget\" (a bare value applies to every device)",
            max_vram: Some("6"), cuda0: (Some(8192), Some(8192)), want: (Some(6144), Some(6144)),
        },
        Case {
            rule: "performance.md: positive budget, fractional GiB",
            max_vram: Some("2.5"), cuda0: (Some(8192), Some(8192)), want: (Some(2560), Some(2560)),
        },
        Case {
            rule: "backend.md: \"Live free memory can lower the effective limit\": a positive budget above free memory plans with free memory",
            max_vram: Some("cuda0=16"), cuda0: (Some(8192), Some(24576)), want: (Some(8192), Some(7680)),
        },
        Case {
            rule: "performance.md: \"0 uses the device's current free memory without an explicit budget\"",
            max_vram: Some("0"), cuda0: (Some(5000), Some(8192)), want: (Some(5000), Some(8192)),
        },
        Case {
            rule: "performance.md: \"a negative value snapshots free memory at startup while reserving that many GiB (--max-vram -1 reserves about 1 GiB)\"",
            max_vram: Some("-1"), cuda0: (Some(8192), Some(8192)), want: (Some(7168), Some(7168)),
        },
        Case {
            rule: "backend.md: \"a negative value means free memory minus that many GiB\" (fraction; more than free gives 0)",
            max_vram: Some("cuda0=-0.5,cuda1=-9"), cuda0: (Some(8192), Some(8192)), want: (Some(7680), Some(0)),
        },
        Case {
            rule: "backend.md: \"--max-vram cuda0=6,vulkan0=2\": per-device values; others keep the default rule",
            max_vram: Some("cuda0=6"), cuda0: (Some(8192), Some(8192)), want: (Some(6144), Some(7680)),
        },
        Case {
            rule: "all=/default=/*= set the default like a bare value; a device entry is more specific",
            max_vram: Some("cuda0=3,all=5"), cuda0: (Some(8192), Some(8192)), want: (Some(3072), Some(5120)),
        },
        Case {
            rule: "*= and default= set the default; the same value twice is redundant (issue 11: different values are an error)",
            max_vram: Some("*=2,default=2"), cuda0: (Some(8192), Some(8192)), want: (Some(2048), Some(2048)),
        },
        Case {
            rule: "device keys resolve like --backend names (case-insensitive, unique prefix)",
            max_vram: Some("CUDA0=4,cuda1=4.5"), cuda0: (Some(8192), Some(8192)), want: (Some(4096), Some(4608)),
        },
        Case {
            rule: "memory-check.md: \"Without a budget the runtime reports the total as free, so the engine uses the total\" (no free figure: total minus 512 MiB)",
            max_vram: None, cuda0: (None, Some(8192)), want: (Some(7680), Some(7680)),
        },
        Case {
            rule: "a device reporting no memory has no budget unless a positive --max-vram names it",
            max_vram: None, cuda0: (None, None), want: (None, Some(7680)),
        },
        Case {
            rule: "a device reporting no memory: a positive --max-vram is its budget",
            max_vram: Some("cuda0=6"), cuda0: (None, None), want: (Some(6144), Some(7680)),
        },
        Case {
            rule: "0 free against a positive total: budget 0 (over its budget)",
            max_vram: None, cuda0: (Some(0), Some(8192)), want: (Some(0), Some(7680)),
        },
    ];
    for c in &cases {
        let devs = vec![
            Device::cpu(),
            Device::new("CUDA0", DeviceType::Gpu).with_memory(c.cuda0.0.map(|m| m * MIB), c.cuda0.1.map(|m| m * MIB)),
            Device::gpu("CUDA1", 8 * GIB, 8 * GIB),
        ];
        let f = Flags { max_vram: c.max_vram.map(Into::into), ..Flags::default() };
        let p = plan(&request(devs, Some(16 * GIB), simple_model(GIB, GIB / 4, 100 * MIB), f)).unwrap();
        assert_eq!(device(&p, "CUDA0").budget_bytes, c.want.0.map(|m| m * MIB), "[{}] CUDA0", c.rule);
        assert_eq!(device(&p, "CUDA1").budget_bytes, c.want.1.map(|m| m * MIB), "[{}] CUDA1", c.rule);
        // The CPU's budget is available RAM whatever --max-vram says.
        assert_eq!(device(&p, "CPU").budget_bytes, Some(16 * GIB), "[{}] CPU", c.rule);
    }
}

#[test]
fn runtime_budgets_are_managed_only_for_positive_and_negative_values() {
    // performance.md: "A positive value is a managed per-device budget, `0` uses the device's
    // current free memory without an explicit budget, and a negative value snapshots free
    // memory at startup while reserving that many GiB". No --max-vram: no managed budget.
    type Case = (Option<&'static str>, &'static [(&'static str, u64)]);
    let cases: [Case; 5] = [
        (None, &[]),
        (Some("0"), &[]),
        (Some("6"), &[("CUDA0", 6 * GIB), ("CUDA1", 6 * GIB)]),
        (Some("-1"), &[("CUDA0", 7 * GIB), ("CUDA1", 7 * GIB)]),
        (Some("cuda0=0,cuda1=2"), &[("CUDA1", 2 * GIB)]),
    ];
    for (spec, want) in cases {
        let devs = vec![Device::cpu(), gpu("CUDA0", 8.0), gpu("CUDA1", 8.0)];
        let f = Flags { max_vram: spec.map(Into::into), ..Flags::default() };
        let p = plan(&request(devs, Some(16 * GIB), simple_model(GIB, GIB / 4, 100 * MIB), f)).unwrap();
        let want: Vec<(String, u64)> = want.iter().map(|(d, b)| (d.to_string(), *b)).collect();
        assert_eq!(p.runtime_budgets(), want, "--max-vram {spec:?}");
    }
}

#[test]
fn max_vram_on_cpu_is_ignored_with_warning() {
    let p = plan(&request(
        vec![Device::cpu(), gpu("CUDA0", 8.0)],
        Some(16 * GIB),
        simple_model(GIB, GIB, MIB * 100),
        Flags { max_vram: Some("cpu=4".into()), ..Flags::default() },
    ))
    .unwrap();
    assert_eq!(device(&p, "CPU").budget_bytes, Some(16 * GIB));
    assert!(p.warnings.iter().any(|w| w.contains("'cpu=4'") && w.contains("RAM")), "{:?}", p.warnings);
}

#[test]
fn budgets_drive_explicit_fit() {
    // backend.md: "The value is a shared per-device budget for managed weights and registered
    // runner compute/cache buffers." Two modules on one device share its budget: 3 GiB + 1 GiB
    // params + 2 GiB compute = 6 GiB fits --max-vram 6, not 5.9.
    let m = mib_model((3072, 100), (1024, 100), (0, 0));
    for (spec, fits) in [("cuda0=6", true), ("cuda0=5.9", false)] {
        let p = plan(&request(
            vec![Device::cpu(), gpu("CUDA0", 24.0)],
            Some(64 * GIB),
            m.clone(),
            Flags { backend: Some("cuda0".into()), max_vram: Some(spec.into()), ..Flags::default() },
        ))
        .unwrap();
        let u = device(&p, "CUDA0");
        assert_eq!(u.used_bytes, 6 * GIB);
        assert_eq!(p.fits, fits, "{spec}");
        assert_eq!(u.fits, fits, "{spec}");
        if !fits {
            assert!(p.warnings.iter().any(|w| w.starts_with("CUDA0 needs 6.00 GiB")), "{:?}", p.warnings);
        }
    }
}

#[test]
fn recommended_biggest_model_shape() {
    // performance.md: "--offload-to-cpu --max-vram -1": params in RAM, staged as needed;
    // "--max-vram -1: reserve about 1 GiB from the startup free-memory snapshot".
    let p = plan(&request(
        vec![Device::cpu(), gpu("CUDA0", 12.0)],
        Some(64 * GIB),
        flux_dev_q8(),
        Flags { offload_to_cpu: true, max_vram: Some("-1".into()), ..Flags::default() },
    ))
    .unwrap();
    assert!(!p.auto_fit);
    assert_eq!(device(&p, "CUDA0").budget_bytes, Some(11 * GIB));
    for m in &p.modules {
        assert_eq!((m.runtime.join("&").as_str(), m.params.to_string().as_str()), ("CUDA0", "CPU"), "{}", m.module);
    }
    assert!(p.fits, "{}", p.render());
}

#[test]
fn params_follow_runtime_with_auto_fit_off() {
    // performance.md: "With --auto-fit off, parameters use the same backend as --backend, so a
    // GPU runtime backend also keeps parameters in VRAM." A 12 GiB model on an 8 GiB card then
    // does not fit (no implicit offload).
    let p = plan(&request(
        vec![Device::cpu(), gpu("CUDA0", 8.0)],
        Some(64 * GIB),
        flux_dev_q8(),
        Flags { auto_fit: Some("off".into()), ..Flags::default() },
    ))
    .unwrap();
    assert!(!p.auto_fit);
    assert!(p.modules.iter().all(|m| m.params == "CUDA0"));
    assert!(!p.fits);
}
