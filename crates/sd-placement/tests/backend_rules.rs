//! The rules of stable-diffusion.cpp's `docs/backend.md` for the placement language (explicit placement), one table per section; each
//! case quotes the sentence it checks.

mod common;

use common::*;
use sd_placement::*;

/// CPU, CUDA0, CUDA1 (CUDA registry, row split), Vulkan0 (Vulkan registry): 24 GiB each, so no
/// case here is about memory.
fn devices() -> Vec<Device> {
    vec![
        Device::cpu(),
        gpu("CUDA0", 24.0).with_row_split(true),
        gpu("CUDA1", 24.0).with_row_split(true),
        gpu("Vulkan0", 24.0),
    ]
}

enum Expect {
    /// (module, runtime devices joined by '&', params)
    Places(&'static [(&'static str, &'static str, &'static str)]),
    /// Substrings of the error message.
    Fails(&'static [&'static str]),
}

struct Case {
    rule: &'static str,
    backend: Option<&'static str>,
    params: Option<&'static str>,
    compat: Compat,
    expect: Expect,
}

#[derive(Default, Clone, Copy)]
struct Compat {
    clip: bool,
    vae: bool,
    control: bool,
    offload: bool,
}

const NONE: Compat = Compat { clip: false, vae: false, control: false, offload: false };

fn run(cases: &[Case]) {
    for c in cases {
        let mut f = flags(c.backend, c.params);
        f.clip_on_cpu = c.compat.clip;
        f.vae_on_cpu = c.compat.vae;
        f.control_net_cpu = c.compat.control;
        f.offload_to_cpu = c.compat.offload;
        let req = request(devices(), Some(64 * GIB), all_modules_model(), f);
        let got = plan(&req);
        match (&c.expect, got) {
            (Expect::Places(want), Ok(p)) => {
                assert!(!p.auto_fit, "[{}] explicit flags must disable auto-fit", c.rule);
                for (m, rt, params) in want.iter() {
                    let m = Module::parse(m).expect("test module name");
                    let mp = module(&p, m);
                    assert_eq!(
                        mp.runtime.join("&"),
                        *rt,
                        "[{}] runtime of {m} for {:?}/{:?}",
                        c.rule,
                        c.backend,
                        c.params
                    );
                    assert_eq!(mp.params, *params, "[{}] params of {m} for {:?}/{:?}", c.rule, c.backend, c.params);
                }
            }
            (Expect::Fails(parts), Err(e)) => {
                let msg = e.to_string();
                for part in parts.iter() {
                    assert!(msg.contains(part), "[{}] error {msg:?} lacks {part:?}", c.rule);
                }
            }
            (Expect::Places(_), Err(e)) => panic!("[{}] {:?}/{:?}: unexpected error {e}", c.rule, c.backend, c.params),
            (Expect::Fails(_), Ok(p)) => {
                panic!("[{}] {:?}/{:?}: expected an error, got {}", c.rule, c.backend, c.params, p.render())
            }
        }
    }
}

use Expect::*;

#[test]
fn syntax() {
    run(&[
        Case {
            rule: "backend.md: \"--backend selects the runtime backend used to execute model graphs\"; a single name \"applies to every module that does not have a more specific assignment\"",
            backend: Some("cpu"), params: None, compat: NONE,
            expect: Places(&[("diffusion", "CPU", "CPU"), ("te", "CPU", "CPU"), ("vae", "CPU", "CPU"), ("detector", "CPU", "CPU")]),
        },
        Case {
            rule: "backend.md: \"If --params-backend is not set, parameters use the same backend as their module runtime backend.\"",
            backend: Some("te=cpu,vae=cuda0,diffusion=vulkan0"), params: None, compat: NONE,
            expect: Places(&[("te", "CPU", "CPU"), ("vae", "CUDA0", "CUDA0"), ("diffusion", "Vulkan0", "Vulkan0")]),
        },
        Case {
            rule: "backend.md: \"Assignments can also target individual modules: --backend te=cpu,vae=cuda0,diffusion=vulkan0\" (modules without an entry use the default device)",
            backend: Some("te=cpu,vae=cuda0,diffusion=vulkan0"), params: None, compat: NONE,
            expect: Places(&[("controlnet", "CUDA0", "CUDA0"), ("upscaler", "CUDA0", "CUDA0")]),
        },
        Case {
            rule: "backend.md: \"The same syntax is used for parameter placement: --backend cuda0 --params-backend te=cpu,vae=cpu\"",
            backend: Some("cuda0"), params: Some("te=cpu,vae=cpu"), compat: NONE,
            expect: Places(&[("diffusion", "CUDA0", "CUDA0"), ("te", "CUDA0", "CPU"), ("vae", "CUDA0", "CPU")]),
        },
        Case {
            rule: "backend.md: \"--params-backend also accepts the special value disk\"",
            backend: Some("cuda0"), params: Some("disk"), compat: NONE,
            expect: Places(&[("diffusion", "CUDA0", "disk"), ("te", "CUDA0", "disk"), ("vae", "CUDA0", "disk")]),
        },
        Case {
            rule: "backend.md: \"Module names are case-insensitive.\"",
            backend: Some("DIFFUSION=cuda1,Te=cpu,VAE=vulkan0"), params: None, compat: NONE,
            expect: Places(&[("diffusion", "CUDA1", "CUDA1"), ("te", "CPU", "CPU"), ("vae", "Vulkan0", "Vulkan0")]),
        },
        Case {
            rule: "backend.md: \"Hyphens and underscores in module names are ignored, so clip_vision, clip-vision, and clipvision are equivalent.\"",
            backend: Some("clip_vision=cpu"), params: Some("clip-vision=cuda1"), compat: NONE,
            expect: Places(&[("clipvision", "CPU", "CUDA1")]),
        },
        Case {
            rule: "backend.md: \"Hyphens and underscores in module names are ignored\" (text-encoder, first_stage)",
            backend: Some("text-encoder=cpu,first_stage=cuda1,t_5_x_x_l=cpu"), params: None, compat: NONE,
            expect: Places(&[("te", "CPU", "CPU"), ("vae", "CUDA1", "CUDA1")]),
        },
        Case {
            rule: "backend.md: \"all=, default=, and *= can be used to set the default backend inside a mixed assignment: --backend all=cuda0,te=cpu\"",
            backend: Some("all=cuda1,te=cpu"), params: None, compat: NONE,
            expect: Places(&[("diffusion", "CUDA1", "CUDA1"), ("te", "CPU", "CPU"), ("vae", "CUDA1", "CUDA1")]),
        },
        Case {
            rule: "backend.md: \"all=, default=, and *=\" (default= and *=, in any position: a module entry is more specific)",
            backend: Some("te=cpu,default=cuda1"), params: Some("*=cpu,vae=disk"), compat: NONE,
            expect: Places(&[("diffusion", "CUDA1", "CPU"), ("te", "CPU", "CPU"), ("vae", "CUDA1", "disk")]),
        },
        Case {
            rule: "backend.md: \"Per-module assignments can be mixed: --backend diffusion=cuda0,te=cpu,vae=cpu --params-backend diffusion=cuda0,te=cpu,vae=cpu\"",
            backend: Some("diffusion=cuda0,te=cpu,vae=cpu"), params: Some("diffusion=cuda0,te=cpu,vae=cpu"), compat: NONE,
            expect: Places(&[("diffusion", "CUDA0", "CUDA0"), ("te", "CPU", "CPU"), ("vae", "CPU", "CPU")]),
        },
        Case {
            rule: "backend.md: \"--backend cuda0 --params-backend cpu: This runs all modules on cuda0, but stores parameters in CPU RAM.\"",
            backend: Some("cuda0"), params: Some("cpu"), compat: NONE,
            expect: Places(&[("diffusion", "CUDA0", "CPU"), ("te", "CUDA0", "CPU"), ("vae", "CUDA0", "CPU"), ("photomaker", "CUDA0", "CPU")]),
        },
        Case {
            rule: "backend.md: \"--backend cuda0 --params-backend disk: This runs all modules on cuda0, reloads parameters from the model file as needed\"",
            backend: Some("cuda0"), params: Some("disk"), compat: NONE,
            expect: Places(&[("upscaler", "CUDA0", "disk"), ("detector", "CUDA0", "disk")]),
        },
        Case {
            rule: "backend.md: \"Outside --auto-fit, disk is never selected implicitly. If --params-backend is not set, parameters use the runtime backend.\"",
            backend: Some("cuda0"), params: None, compat: NONE,
            expect: Places(&[("diffusion", "CUDA0", "CUDA0"), ("te", "CUDA0", "CUDA0"), ("vae", "CUDA0", "CUDA0")]),
        },
        Case {
            rule: "performance.md: \"Per-module assignments can target only the largest modules: --backend cuda0 --params-backend diffusion=disk,te=cpu,vae=cpu\"",
            backend: Some("cuda0"), params: Some("diffusion=disk,te=cpu,vae=cpu"), compat: NONE,
            expect: Places(&[("diffusion", "CUDA0", "disk"), ("te", "CUDA0", "CPU"), ("vae", "CUDA0", "CPU"), ("controlnet", "CUDA0", "CUDA0")]),
        },
        Case {
            rule: "issue 11: a module given twice in one string is an error naming both entries (only prepended compatibility entries are overridden)",
            backend: Some("te=disk,te=cpu"), params: None, compat: NONE,
            expect: Fails(&["--backend", "'te=cpu'", "already assigned by 'te=disk'"]),
        },
        Case {
            rule: "issue 11: two defaults in one string are an error",
            backend: Some("cuda0,vulkan0"), params: None, compat: NONE,
            expect: Fails(&["--backend", "'vulkan0'", "the default", "'cuda0'"]),
        },
        Case {
            rule: "issue 11: an empty entry between commas is an error, not skipped",
            backend: Some(" , te = cpu ,, "), params: None, compat: NONE,
            expect: Fails(&["--backend", "empty entry"]),
        },
        Case {
            rule: "issue 11: an empty device in an & list is an error",
            backend: Some("diffusion=cpu&"), params: None, compat: NONE,
            expect: Fails(&["--backend", "'cpu&'", "empty device name"]),
        },
        Case {
            rule: "issue 11: the same checks in --params-backend",
            backend: None, params: Some("te=disk,,vae=cpu"), compat: NONE,
            expect: Fails(&["--params-backend", "empty entry"]),
        },
        Case {
            rule: "an entry with an empty module name is an error naming the entry",
            backend: Some("=cpu"), params: None, compat: NONE,
            expect: Fails(&["--backend", "'=cpu'", "missing module name"]),
        },
        Case {
            rule: "an entry with an empty value is an error naming the entry",
            backend: Some("te="), params: None, compat: NONE,
            expect: Fails(&["--backend", "'te='", "missing value", "te=auto"]),
        },
        Case {
            rule: "backend.md Modules table: a name outside the accepted names is an error listing what is accepted",
            backend: Some("unet2=cpu"), params: None, compat: NONE,
            expect: Fails(&["--backend", "unknown module 'unet2'", "'unet2=cpu'", "diffusion (diffusion, model, unet, dit)", "te (te, clip,", "all=, default=, *="]),
        },
        Case {
            rule: "unknown module in --params-backend names that flag",
            backend: None, params: Some("lora=cpu"), compat: NONE,
            expect: Fails(&["--params-backend", "unknown module 'lora'"]),
        },
    ]);
}

#[test]
fn module_alias_table() {
    // backend.md "Modules": every accepted name of the table, checked through --backend.
    let table: &[(&str, &[&str])] = &[
        ("diffusion", &["diffusion", "model", "unet", "dit"]),
        ("te", &["te", "clip", "text", "textencoder", "textencoders", "conditioner", "cond", "llm", "t5", "t5xxl"]),
        ("clip_vision", &["clip_vision", "clipvision", "clip-vision", "vision"]),
        ("vae", &["vae", "firststage", "autoencoder", "tae"]),
        ("controlnet", &["controlnet", "control"]),
        ("photomaker", &["photomaker", "photomakerid", "pmid", "photo"]),
        ("upscaler", &["upscaler", "esrgan", "hires"]),
        ("detector", &["detector", "adetailer", "yolo"]),
    ];
    for (canonical, aliases) in table {
        for alias in aliases.iter() {
            for spelled in [alias.to_string(), alias.to_uppercase(), format!("-{alias}_")] {
                let spec = format!("{spelled}=cuda1");
                let p = plan(&request(devices(), Some(64 * GIB), all_modules_model(), flags(Some(&spec), None)))
                    .unwrap_or_else(|e| panic!("alias {spelled}: {e}"));
                for m in &p.modules {
                    let want = if m.module.name() == *canonical { "CUDA1" } else { "CUDA0" };
                    assert_eq!(m.runtime, [want], "--backend {spec}: module {}", m.module);
                }
            }
        }
    }
    // "te is the preferred module name for text encoders": plans print te.
    assert_eq!(Module::parse("clip"), Some(Module::Te));
    assert_eq!(Module::Te.name(), "te");
}

#[test]
fn backend_names() {
    run(&[
        Case {
            rule: "backend.md: \"Matching is case-insensitive and accepts exact names or unique prefixes\" (exact, any case)",
            backend: Some("te=Cuda1,vae=VULKAN0,diffusion=cPu"), params: None, compat: NONE,
            expect: Places(&[("te", "CUDA1", "CUDA1"), ("vae", "Vulkan0", "Vulkan0"), ("diffusion", "CPU", "CPU")]),
        },
        Case {
            rule: "backend.md: \"accepts exact names or unique prefixes\" (unique prefix)",
            backend: Some("te=vulk,vae=cuda1"), params: Some("te=cp"), compat: NONE,
            expect: Places(&[("te", "Vulkan0", "CPU"), ("vae", "CUDA1", "CUDA1")]),
        },
        Case {
            rule: "backend.md: \"accepts exact names or unique prefixes\": a prefix of several devices is ambiguous; the error lists the candidates",
            backend: Some("te=cuda"), params: None, compat: NONE,
            expect: Fails(&["--backend", "'cuda'", "'te=cuda'", "ambiguous", "CUDA0, CUDA1"]),
        },
        Case {
            rule: "backend.md: \"Backend names are resolved against the GGML backend device list\": an unknown name is an error listing the devices",
            backend: Some("diffusion=rocm0"), params: None, compat: NONE,
            expect: Fails(&["--backend", "unknown device 'rocm0'", "'diffusion=rocm0'", "CPU (cpu), CUDA0 (gpu), CUDA1 (gpu), Vulkan0 (gpu)", "auto, default, gpu"]),
        },
        Case {
            rule: "unknown device in --params-backend names that flag",
            backend: None, params: Some("vae=hip0"), compat: NONE,
            expect: Fails(&["--params-backend", "unknown device 'hip0'"]),
        },
        Case {
            rule: "backend.md: \"The special values auto, default, and an empty backend name select the default backend. The default preference is GPU, then integrated GPU, then CPU.\"",
            backend: Some("te=auto,vae=DEFAULT,diffusion=cpu"), params: Some("diffusion=auto"), compat: NONE,
            expect: Places(&[("te", "CUDA0", "CUDA0"), ("vae", "CUDA0", "CUDA0"), ("diffusion", "CPU", "CUDA0")]),
        },
        Case {
            rule: "backend.md: \"The special value gpu selects the first GPU backend\"",
            backend: Some("gpu"), params: None, compat: NONE,
            expect: Places(&[("diffusion", "CUDA0", "CUDA0")]),
        },
        Case {
            rule: "backend.md: \"--backend disk is invalid because disk is a parameter residency mode, not a runtime compute backend.\"",
            backend: Some("vae=disk"), params: None, compat: NONE,
            expect: Fails(&["--backend", "'vae=disk'", "not a runtime backend", "--params-backend"]),
        },
        Case {
            rule: "backend.md: \"The special value disk is accepted only by --params-backend.\" (bare disk)",
            backend: Some("DISK"), params: None, compat: NONE,
            expect: Fails(&["'DISK'", "not a runtime backend"]),
        },
    ]);
}

#[test]
fn default_and_gpu_special_values() {
    // backend.md: "The default preference is GPU, then integrated GPU, then CPU." and "The special
    // value gpu selects the first GPU backend, falling back to the first integrated GPU backend."
    // (device lists in listing order; expected device for auto/default/""/gpu)
    let table: &[(&str, Vec<Device>, &str, Option<&str>)] = &[
        (
            "GPU preferred over an earlier-listed iGPU and CPU",
            vec![Device::cpu(), igpu("Intel0", 8.0), gpu("CUDA0", 8.0)],
            "CUDA0",
            Some("CUDA0"),
        ),
        (
            "first GPU when there are two",
            vec![Device::cpu(), gpu("Vulkan0", 8.0), gpu("Vulkan1", 16.0)],
            "Vulkan0",
            Some("Vulkan0"),
        ),
        ("integrated GPU when no GPU", vec![Device::cpu(), igpu("Intel0", 8.0)], "Intel0", Some("Intel0")),
        ("CPU when neither; gpu is an error", vec![Device::cpu()], "CPU", None),
    ];
    for (why, devs, want_default, want_gpu) in table {
        // `te=auto`, `te=DEFAULT`, and an empty backend name (the whole flag empty, --auto-fit off
        // so that the default device is what remains).
        for spec in ["te=auto", "te=DEFAULT", "", "  "] {
            let p = plan(&request(
                devs.clone(),
                Some(64 * GIB),
                simple_model(GIB, GIB, 100 * MIB),
                Flags { backend: Some(spec.to_string()), auto_fit: Some("off".into()), ..Flags::default() },
            ))
            .unwrap();
            assert_eq!(module(&p, Module::Te).runtime, [*want_default], "{why}: --backend {spec:?}");
        }
        let r =
            plan(&request(devs.clone(), Some(64 * GIB), simple_model(GIB, GIB, 100 * MIB), flags(Some("gpu"), None)));
        match want_gpu {
            Some(g) => assert_eq!(module(&r.unwrap(), Module::Vae).runtime, [*g], "{why}"),
            None => {
                let e = r.unwrap_err().to_string();
                assert!(e.contains("'gpu'") && e.contains("no") && e.contains("CPU (cpu)"), "{why}: {e}");
            }
        }
    }
}

#[test]
fn device_lists() {
    run(&[
        Case {
            rule: "backend.md: \"A --backend module assignment can list several devices separated by &\"",
            backend: Some("diffusion=cuda0&cuda1"),
            params: None,
            compat: NONE,
            expect: Places(&[("diffusion", "CUDA0&CUDA1", "CUDA0&CUDA1"), ("te", "CUDA0", "CUDA0")]),
        },
        Case {
            rule: "backend.md: \"Layer split is supported for the diffusion and te modules.\" (te, via an alias)",
            backend: Some("t5xxl=cuda1&vulkan0"),
            params: None,
            compat: NONE,
            expect: Places(&[("te", "CUDA1&Vulkan0", "CUDA1&Vulkan0")]),
        },
        Case {
            rule: "backend.md: \"other modules accept only a single device\"",
            backend: Some("vae=cuda0&cuda1"),
            params: None,
            compat: NONE,
            expect: Fails(&[
                "--backend",
                "device list 'cuda0&cuda1'",
                "'vae=cuda0&cuda1'",
                "module vae accepts only a single device",
                "only diffusion and te",
            ]),
        },
        Case {
            rule: "backend.md: \"other modules accept only a single device\" (a default applies to every module)",
            backend: Some("all=cuda0&cuda1"),
            params: None,
            compat: NONE,
            expect: Fails(&["device list 'cuda0&cuda1'", "diffusion=A&B"]),
        },
        Case {
            rule: "backend.md: \"--params-backend accepts no device lists.\"",
            backend: Some("diffusion=cuda0&cuda1"),
            params: Some("diffusion=cuda0&cuda1"),
            compat: NONE,
            expect: Fails(&["--params-backend", "device list 'cuda0&cuda1'", "accepts no device lists"]),
        },
        Case {
            rule: "a list naming disk is rejected as disk is no runtime backend",
            backend: Some("diffusion=cuda0&disk"),
            params: None,
            compat: NONE,
            expect: Fails(&["'diffusion=cuda0&disk'", "not a runtime backend"]),
        },
        Case {
            rule: "a list cannot hold the default device token (reference behaviour)",
            backend: Some("diffusion=cuda0&auto"),
            params: None,
            compat: NONE,
            expect: Fails(&["invalid device list", "'auto'"]),
        },
        Case {
            rule: "a list naming no device is an error",
            backend: Some("diffusion=&&"),
            params: None,
            compat: NONE,
            expect: Fails(&["invalid device list '&&'", "empty device name"]),
        },
        Case {
            rule: "issue 13: a device listed twice is an error naming the module and the device (names resolve case-insensitively)",
            backend: Some("diffusion=cuda1&CUDA1"),
            params: None,
            compat: NONE,
            expect: Fails(&["--backend", "'diffusion=cuda1&CUDA1'", "lists CUDA1 twice for diffusion"]),
        },
        Case {
            rule: "issue 13: a device listed twice (the CPU, by case, in a te list)",
            backend: Some("te=cpu&cuda0&CPU"),
            params: None,
            compat: NONE,
            expect: Fails(&["'te=cpu&cuda0&CPU'", "lists CPU twice for te"]),
        },
        Case {
            rule: "issue 13: a device listed twice through a unique prefix and its full name",
            backend: Some("diffusion=vulkan&Vulkan0"),
            params: None,
            compat: NONE,
            expect: Fails(&["lists Vulkan0 twice for diffusion"]),
        },
        Case {
            rule: "issue 13: the CPU takes part in a layer split (a range runs on the host)",
            backend: Some("diffusion=cpu&cuda0"),
            params: None,
            compat: NONE,
            expect: Places(&[("diffusion", "CPU&CUDA0", "CPU&CUDA0")]),
        },
        Case {
            rule: "list members resolve like single names (unknown member is named)",
            backend: Some("diffusion=cuda0&cuda7"),
            params: None,
            compat: NONE,
            expect: Fails(&["unknown device 'cuda7'", "'diffusion=cuda0&cuda7'"]),
        },
    ]);
}

#[test]
fn compatibility_flags() {
    let clip = Compat { clip: true, ..NONE };
    let all3 = Compat { clip: true, vae: true, control: true, offload: false };
    let offload = Compat { offload: true, ..NONE };
    run(&[
        Case {
            rule: "backend.md: \"The example argument layer prepends te=cpu, vae=cpu, and controlnet=cpu to --backend\"",
            backend: Some("cuda1"), params: None, compat: all3,
            expect: Places(&[("te", "CPU", "CPU"), ("vae", "CPU", "CPU"), ("controlnet", "CPU", "CPU"), ("diffusion", "CUDA1", "CUDA1"), ("photomaker", "CUDA1", "CUDA1")]),
        },
        Case {
            rule: "backend.md: --clip-on-cpu \"prepends te=cpu\": the rest uses the default device",
            backend: None, params: None, compat: clip,
            expect: Places(&[("te", "CPU", "CPU"), ("diffusion", "CUDA0", "CUDA0")]),
        },
        Case {
            rule: "prepended entries come first, so a later explicit entry overrides them",
            backend: Some("te=cuda1"), params: None, compat: clip,
            expect: Places(&[("te", "CUDA1", "CUDA1")]),
        },
        Case {
            rule: "backend.md: \"--offload-to-cpu prepends a CPU default to the parameter assignment ... --params-backend '*=cpu'\"",
            backend: None, params: None, compat: offload,
            expect: Places(&[("diffusion", "CUDA0", "CPU"), ("te", "CUDA0", "CPU"), ("vae", "CUDA0", "CPU")]),
        },
        Case {
            rule: "backend.md: \"--offload-to-cpu --params-backend te=disk keeps non-TE parameters on CPU and reloads TE parameters from disk.\"",
            backend: None, params: Some("te=disk"), compat: offload,
            expect: Places(&[("diffusion", "CUDA0", "CPU"), ("te", "CUDA0", "disk"), ("vae", "CUDA0", "CPU")]),
        },
        Case {
            rule: "performance.md: \"--offload-to-cpu ... prepends *=cpu to --params-backend ..., so explicit module assignments can still override it\" (a later default too)",
            backend: None, params: Some("cuda1"), compat: offload,
            expect: Places(&[("diffusion", "CUDA0", "CUDA1")]),
        },
    ]);
    // The composed strings themselves.
    let f = Flags {
        backend: Some("cuda0".into()),
        clip_on_cpu: true,
        vae_on_cpu: true,
        control_net_cpu: true,
        offload_to_cpu: true,
        params_backend: Some("te=disk".into()),
        ..Flags::default()
    };
    assert_eq!(f.effective_backend(), "te=cpu,vae=cpu,controlnet=cpu,cuda0");
    assert_eq!(f.effective_params_backend(), "*=cpu,te=disk");
}

#[test]
fn explicit_assignments_disable_auto_fit() {
    // backend.md: "Explicit --backend or --params-backend assignments disable auto-fit,
    // regardless of argument order, even with --auto-fit on."
    let m = simple_model(GIB, GIB, 100 * MIB);
    let table: &[(&str, Flags, bool)] = &[
        ("no flags: auto-fit defaults to on", Flags::default(), true),
        ("--auto-fit on", Flags { auto_fit: Some("on".into()), ..Flags::default() }, true),
        ("--auto-fit OFF (case-insensitive)", Flags { auto_fit: Some("OFF".into()), ..Flags::default() }, false),
        (
            "--backend with --auto-fit on",
            Flags { backend: Some("cuda0".into()), auto_fit: Some("on".into()), ..Flags::default() },
            false,
        ),
        ("--params-backend alone", Flags { params_backend: Some("cpu".into()), ..Flags::default() }, false),
        ("--clip-on-cpu prepends to --backend", Flags { clip_on_cpu: true, ..Flags::default() }, false),
        (
            "--offload-to-cpu prepends to --params-backend",
            Flags { offload_to_cpu: true, auto_fit: Some("on".into()), ..Flags::default() },
            false,
        ),
        (
            "empty --backend is no assignment (sd_ctx_params: nonempty assignments disable it)",
            Flags { backend: Some("  ".into()), ..Flags::default() },
            true,
        ),
    ];
    for (why, f, want) in table {
        let p = plan(&request(devices(), Some(64 * GIB), m.clone(), f.clone())).unwrap();
        assert_eq!(p.auto_fit, *want, "{why}");
        if f.auto_fit.as_deref() == Some("on") && !want {
            assert!(p.warnings.iter().any(|w| w.contains("--auto-fit on is ignored")), "{why}: {:?}", p.warnings);
        }
    }
    // "--auto-fit requires on or off"
    for bad in ["yes", "1", "", "onn"] {
        let e = plan(&request(devices(), None, m.clone(), Flags { auto_fit: Some(bad.into()), ..Flags::default() }))
            .unwrap_err();
        assert_eq!(e, PlanError::InvalidAutoFit { token: bad.into() });
        assert!(e.to_string().contains("accepted: on, off"));
    }
}

#[test]
fn max_vram_targets_devices() {
    // backend.md: "--max-vram can target resolved backend/device names: --backend
    // diffusion=cuda0,vae=vulkan0 --max-vram cuda0=6,vulkan0=2"
    let p = plan(&request(
        devices(),
        Some(64 * GIB),
        simple_model(GIB, GIB, 100 * MIB),
        Flags {
            backend: Some("diffusion=cuda0,vae=vulkan0".into()),
            max_vram: Some("cuda0=6,vulkan0=2".into()),
            ..Flags::default()
        },
    ))
    .unwrap();
    assert_eq!(device(&p, "CUDA0").budget_bytes, Some(6 * GIB));
    assert_eq!(device(&p, "Vulkan0").budget_bytes, Some(2 * GIB));
    // CUDA1 has no entry: free minus 512 MiB.
    assert_eq!(device(&p, "CUDA1").budget_bytes, Some(24 * GIB - 512 * MIB));
    let table: &[(&str, &str, &[&str])] = &[
        ("unknown device key", "cuda9=4", &["--max-vram", "unknown device 'cuda9'", "'cuda9=4'"]),
        ("ambiguous key", "cu=4", &["--max-vram", "ambiguous", "CUDA0, CUDA1"]),
        ("malformed number", "cuda0=6GB", &["--max-vram", "malformed number '6GB'", "'cuda0=6GB'", "decimal number"]),
        ("malformed bare number", "six", &["malformed number 'six'"]),
        ("non-finite", "inf", &["malformed number 'inf'"]),
        ("NaN", "cuda0=NaN", &["malformed number 'NaN'"]),
        ("empty value", "cuda0=", &["invalid assignment 'cuda0='"]),
    ];
    for (why, spec, parts) in table {
        let e = plan(&request(
            devices(),
            None,
            simple_model(GIB, GIB, MIB * 100),
            Flags { max_vram: Some((*spec).into()), ..Flags::default() },
        ))
        .unwrap_err()
        .to_string();
        for part in parts.iter() {
            assert!(e.contains(part), "{why}: {e:?} lacks {part:?}");
        }
    }
}

#[test]
fn split_mode_syntax() {
    // backend.md: "--split-mode selects how a multi-device module distributes its weights: layer
    // (the default, described above) or row. It accepts a single mode or per-module assignments"
    let ok: &[(&str, Option<SplitMode>, Option<SplitMode>)] = &[
        ("row", Some(SplitMode::Row), Some(SplitMode::Row)),
        ("LAYER", Some(SplitMode::Layer), Some(SplitMode::Layer)),
        ("diffusion=row,te=layer", Some(SplitMode::Row), Some(SplitMode::Layer)),
        ("all=row,text_encoder=layer", Some(SplitMode::Row), Some(SplitMode::Layer)),
        ("", None, None),
    ];
    for (spec, d, t) in ok {
        let a = parse_split_mode(spec).unwrap();
        assert_eq!(a.get(Module::Diffusion).map(|e| e.value), *d, "{spec}");
        assert_eq!(a.get(Module::Te).map(|e| e.value), *t, "{spec}");
    }
    let e = parse_split_mode("diffusion=rows").unwrap_err().to_string();
    assert!(e.contains("invalid mode 'rows'") && e.contains("layer, row"), "{e}");
    let e = parse_split_mode("unet3=row").unwrap_err().to_string();
    assert!(e.contains("--split-mode") && e.contains("unknown module 'unet3'"), "{e}");
}

#[test]
fn registry_name_resolves_first_device() {
    // Extension (reference behaviour, backend.md lists `metal` among common values): a token
    // equal to a registry name selects that registry's first device when no name or prefix
    // matches.
    let devs = vec![Device::cpu(), Device::gpu("MTL0", 8 * GIB, 8 * GIB).with_registry("MTL")];
    let p = plan(&request(devs, None, simple_model(GIB, GIB, MIB), flags(Some("metal"), None))).unwrap();
    assert_eq!(module(&p, Module::Diffusion).runtime, ["MTL0"]);
}
