//! Arbitrary strings into every parser entry point and into `plan`: never a panic, and every
//! error renders a message naming a flag or the profile. Complements the cargo-fuzz target in
//! fuzz/ (which needs nightly), so stable CI exercises the same entry points.

use proptest::prelude::*;
use sd_placement::*;

fn devices() -> Vec<Device> {
    vec![
        Device::cpu(),
        Device::gpu("CUDA0", 8 * GIB, 8 * GIB).with_row_split(true),
        Device::gpu("CUDA1", 4 * GIB, 12 * GIB).with_row_split(true),
        Device::gpu("Vulkan0", 6 * GIB, 6 * GIB),
        Device::new("Intel0", DeviceType::Igpu),
    ]
}

fn model() -> ModelDescription {
    let components = Module::ALL
        .into_iter()
        .enumerate()
        .map(|(k, m)| Component {
            module: m,
            tensors: (0..6u32)
                .map(|i| Tensor { name: format!("{m}.{i}"), bytes: (k as u64 + 1) << 28, block: (i > 0).then_some(i) })
                .collect(),
        })
        .collect();
    ModelDescription {
        compute_bytes: Default::default(),
        components,
        files: vec![SourceFile { role: "<file>".into(), bytes: 9 * GIB }],
    }
}

/// Strings made of the placement language's own characters and words, plus anything.
fn spec() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        Just("diffusion".to_string()),
        Just("te".to_string()),
        Just("vae".to_string()),
        Just("clip-vision".to_string()),
        Just("all".to_string()),
        Just("*".to_string()),
        Just("cuda0".to_string()),
        Just("cu".to_string()),
        Just("CUDA1".to_string()),
        Just("cpu".to_string()),
        Just("disk".to_string()),
        Just("auto".to_string()),
        Just("gpu".to_string()),
        Just("row".to_string()),
        Just("layer".to_string()),
        Just("-1.5".to_string()),
        Just("1e400".to_string()),
        Just("nan".to_string()),
        Just(",".to_string()),
        Just("=".to_string()),
        Just("&".to_string()),
        Just(" ".to_string()),
        Just("\u{0}".to_string()),
        Just("é".to_string()),
        ".{0,6}",
    ];
    prop_oneof![prop::collection::vec(word, 0..12).prop_map(|w| w.concat()), any::<String>()]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn parsers_never_panic(s in spec()) {
        let check = |r: Result<(), PlanError>| {
            if let Err(e) = r {
                let msg = e.to_string();
                assert!(msg.starts_with("--") || msg.starts_with("device"), "{msg}");
            }
        };
        check(parse_backend(&s).map(|_| ()));
        check(parse_params_backend(&s).map(|_| ()));
        check(parse_split_mode(&s).map(|_| ()));
        check(parse_max_vram(&s).map(|_| ()));
        check(parse_auto_fit(Some(&s)).map(|_| ()));
        check(parse_split_by(Some(&s)).map(|_| ()));
        check(parse_pipeline_copies(Some(&s), None).map(|_| ()));
        if let Err(e) = parse_pipeline_copies(None, Some(&s)) {
            assert!(e.to_string().starts_with(PIPELINE_COPIES_ENV), "{e}");
        }
        check(resolve_device(&devices(), &s, Flag::Backend, &s).map(|_| ()));
        check(DeviceProfile::from_toml_str(&s).map(|_| ()));
        let _ = Module::parse(&s);
    }

    #[test]
    fn plan_never_panics(
        b in spec(), p in spec(), sm in spec(), mv in spec(), af in prop::option::of(spec()), bits in any::<u8>(),
        sb in prop::option::of(spec()), pc in prop::option::of(spec()), speed in any::<f64>(),
    ) {
        let flags = Flags {
            backend: Some(b), params_backend: Some(p), split_mode: Some(sm), max_vram: Some(mv), auto_fit: af,
            split_by: sb, pipeline_copies: pc, pipeline_copies_env: None,
            clip_on_cpu: bits & 1 != 0, vae_on_cpu: bits & 2 != 0, control_net_cpu: bits & 4 != 0,
            offload_to_cpu: bits & 8 != 0, no_memory_check: bits & 16 != 0,
        };
        // Speeds: an arbitrary one for CUDA0, a sane one for CPU when bit 5 is set.
        let mut device_speeds = std::collections::BTreeMap::from([("CUDA0".to_string(), speed)]);
        if bits & 32 != 0 {
            device_speeds.insert("cpu".into(), 1e9);
        }
        let req = PlanRequest { flags, devices: devices(), ram_available_bytes: Some(16 * GIB), model: model(), device_speeds };
        match plan(&req) {
            Ok(plan) => { let _ = (plan.render(), plan.to_json(), plan.ensure_loadable()); }
            Err(e) => prop_assert!(e.to_string().starts_with("--") || e.to_string().starts_with("device speeds"), "{}", e),
        }
    }
}
