//! Device profiles: hypothetical devices from TOML text (the issue's `--devices PROFILE.toml`).

use sd_placement::*;

const EXAMPLE: &str = r#"
ram_available_mib = 32768
[[device]]
name = "CUDA0"
type = "gpu"        # cpu | gpu | igpu | accel
free_mib = 8192
total_mib = 8192
row_split = true    # optional, default false

[[device]]
name = "Vulkan0"
type = "igpu"
"#;

#[test]
fn example_profile() {
    let p = DeviceProfile::from_toml_str(EXAMPLE).unwrap();
    assert_eq!(p.ram_available_bytes(), Some(32 * GIB));
    let d = p.devices();
    assert_eq!(d.len(), 3, "a CPU device is added when the profile lists none");
    assert_eq!(d[0], Device::gpu("CUDA0", 8 * GIB, 8 * GIB).with_row_split(true));
    assert_eq!(d[0].registry_name(), "CUDA");
    assert_eq!((d[1].kind, d[1].free_bytes, d[1].row_split), (DeviceType::Igpu, None, false));
    assert_eq!((d[2].name.as_str(), d[2].kind), ("CPU", DeviceType::Cpu));
    // A profile plans like real devices.
    let req = PlanRequest {
        flags: Flags::default(),
        devices: d,
        ram_available_bytes: p.ram_available_bytes(),
        model: ModelDescription {
            compute_bytes: Default::default(),
            components: vec![Component { module: Module::Vae, tensors: vec![Tensor::new("v", MIB)] }],
            files: vec![],
        },
        device_speeds: Default::default(),
    };
    assert_eq!(plan(&req).unwrap().main_device, "CUDA0");
}

#[test]
fn explicit_cpu_and_registry() {
    let p = DeviceProfile::from_toml_str(
        "[[device]]\nname = \"Host\"\ntype = \"cpu\"\n[[device]]\nname = \"GPU-A\"\ntype = \"gpu\"\nregistry = \"Vulkan\"\nfree_mib = 1\n",
    )
    .unwrap();
    let d = p.devices();
    assert_eq!(d.len(), 2);
    assert_eq!(d[1].registry_name(), "Vulkan");
    assert_eq!(p.ram_available_bytes(), None);
}

#[test]
fn profile_speeds_feed_the_plan() {
    // Issue 13: a profile may give measured speeds (MiB of block weights per second), so that
    // `sd-cli plan --devices` sizes a speed split and predicts times for hypothetical devices.
    let p = DeviceProfile::from_toml_str(
        "[[device]]\nname = \"RPC0\"\ntype = \"gpu\"\nfree_mib = 8192\nspeed_mib_s = 1000\n\
         [[device]]\nname = \"RPC1\"\ntype = \"gpu\"\nfree_mib = 8192\nspeed_mib_s = 3000.5\n\
         [[device]]\nname = \"RPC2\"\ntype = \"gpu\"\nfree_mib = 8192\n",
    )
    .unwrap();
    let speeds = p.device_speeds();
    assert_eq!(speeds.len(), 2, "RPC2 gives none: {speeds:?}");
    assert_eq!((speeds["RPC0"], speeds["RPC1"]), (1000.0 * MIB as f64, 3000.5 * MIB as f64));
    let model = ModelDescription {
        compute_bytes: Default::default(),
        components: vec![Component {
            module: Module::Diffusion,
            tensors: (0..8).map(|b| Tensor::in_block(format!("blocks.{b}.w"), 100 * MIB, b)).collect(),
        }],
        files: vec![],
    };
    let flags =
        Flags { backend: Some("diffusion=rpc0&rpc1".into()), split_by: Some("speed".into()), ..Flags::default() };
    let req = PlanRequest { flags, devices: p.devices(), ram_available_bytes: None, model, device_speeds: speeds };
    let plan = plan(&req).unwrap();
    // 800 MiB at 1000 : 3000.5 MiB/s: 2 | 6 blocks (0.2 s | 0.19997 s).
    let d = &plan.modules[0];
    assert_eq!(d.split.iter().map(|r| (r.first_block, r.last_block)).collect::<Vec<_>>(), vec![(0, 1), (2, 7)]);
    assert!(d.predicted.is_some());
}

#[test]
fn invalid_profiles_are_errors() {
    let table: &[(&str, &str, &[&str])] = &[
        ("unknown device type", "[[device]]\nname = \"X\"\ntype = \"tpu\"\n", &["device profile", "tpu"]),
        ("unknown key", "[[device]]\nname = \"X\"\ntype = \"gpu\"\nvram = 3\n", &["device profile", "vram"]),
        ("negative MiB", "ram_available_mib = -5\n", &["device profile"]),
        ("missing type", "[[device]]\nname = \"X\"\n", &["device profile", "type"]),
        ("not TOML", "[[device]\n", &["device profile"]),
        (
            "duplicate names",
            "[[device]]\nname = \"A\"\ntype = \"gpu\"\n[[device]]\nname = \"a\"\ntype = \"gpu\"\n",
            &["'a' is listed twice"],
        ),
        ("empty name", "[[device]]\nname = \"  \"\ntype = \"gpu\"\n", &["empty name"]),
        ("reserved characters", "[[device]]\nname = \"a&b\"\ntype = \"gpu\"\n", &["'a&b'", "reserves"]),
        (
            "a speed that is not positive",
            "[[device]]\nname = \"R\"\ntype = \"gpu\"\nspeed_mib_s = -2\n",
            &["device 'R'", "speed_mib_s = -2", "positive"],
        ),
        (
            "a speed that is not a number",
            "[[device]]\nname = \"R\"\ntype = \"gpu\"\nspeed_mib_s = \"fast\"\n",
            &["speed_mib_s"],
        ),
    ];
    for (why, text, parts) in table {
        let e = DeviceProfile::from_toml_str(text).unwrap_err().to_string();
        for part in parts.iter() {
            assert!(e.contains(part), "{why}: {e:?} lacks {part:?}");
        }
    }
}
