//! stable-diffusion.cpp's `docs/backend.md` "Multiple devices per module (layer split)" and "Row split (--split-mode row)":
//! each case quotes the sentence it checks; expected ranges are derived by hand next to them.

mod common;

use common::*;
use sd_placement::*;

/// A diffusion model of `nb` blocks of 100 MiB (4 tensors of 25 MiB each) plus 50 MiB of
/// non-block tensors (largest 30 MiB), and a small te and vae.
fn blocky(nb: u32) -> ModelDescription {
    let mut d = vec![Tensor::new("img_in.weight", 30 * MIB), Tensor::new("final.weight", 20 * MIB)];
    for b in 0..nb {
        for i in 0..4 {
            d.push(Tensor::in_block(format!("blocks.{b}.w{i}"), 25 * MIB, b));
        }
    }
    ModelDescription {
        compute_bytes: Default::default(),
        components: vec![
            Component { module: Module::Diffusion, tensors: d },
            comp(Module::Te, 200 * MIB, 20 * MIB, Some(4)),
            comp(Module::Vae, 100 * MIB, 10 * MIB, None),
        ],
        files: vec![],
    }
}

fn run(
    devs: Vec<Device>,
    model: ModelDescription,
    backend: &str,
    params: Option<&str>,
    split: Option<&str>,
    max_vram: Option<&str>,
) -> Plan {
    plan(&request(
        devs,
        Some(64 * GIB),
        model,
        Flags {
            backend: Some(backend.into()),
            params_backend: params.map(Into::into),
            split_mode: split.map(Into::into),
            max_vram: max_vram.map(Into::into),
            no_memory_check: true,
            ..Flags::default()
        },
    ))
    .unwrap()
}

fn ranges(p: &Plan, m: Module) -> Vec<(String, u32, u32)> {
    module(p, m).split.iter().map(|r| (r.device.clone(), r.first_block, r.last_block)).collect()
}

fn r(d: &str, a: u32, b: u32) -> (String, u32, u32) {
    (d.to_string(), a, b)
}

#[test]
fn layer_split_ranges() {
    // "The module's transformer blocks are then distributed across the listed devices in
    // contiguous ranges sized proportionally to each device's free memory (minus a
    // compute-buffer headroom of about 2 GiB per device)". Weight = max(free - 2 GiB, free / 8).
    #[allow(clippy::type_complexity)]
    let table: Vec<(&str, Vec<Device>, &str, Option<&str>, Vec<(String, u32, u32)>)> = vec![
        (
            "equal devices split evenly: 24-2 : 24-2 -> 16 | 16 of 32 blocks",
            vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)],
            "diffusion=cuda0&cuda1", None,
            vec![r("CUDA0", 0, 15), r("CUDA1", 16, 31)],
        ),
        (
            "24 GiB + 12 GiB: 22 : 10 of 32 blocks -> boundary 22",
            vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 12.0)],
            "diffusion=cuda0&cuda1", None,
            vec![r("CUDA0", 0, 21), r("CUDA1", 22, 31)],
        ),
        (
            "order of the list, not of the devices: the first listed is main",
            vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 12.0)],
            "diffusion=cuda1&cuda0", None,
            vec![r("CUDA1", 0, 9), r("CUDA0", 10, 31)],
        ),
        (
            "the headroom never takes more than 7/8: 17 GiB and 3 GiB weigh 15 : 1 -> 30 | 2",
            vec![Device::cpu(), gpu("CUDA0", 17.0), gpu("CUDA1", 3.0)],
            "diffusion=cuda0&cuda1", None,
            vec![r("CUDA0", 0, 29), r("CUDA1", 30, 31)],
        ),
        (
            "three devices 10, 18, 10 GiB weigh 8 : 16 : 8 -> 8 | 16 | 8",
            vec![Device::cpu(), gpu("CUDA0", 10.0), gpu("CUDA1", 18.0), gpu("CUDA2", 10.0)],
            "diffusion=cuda0&cuda1&cuda2", None,
            vec![r("CUDA0", 0, 7), r("CUDA1", 8, 23), r("CUDA2", 24, 31)],
        ),
        (
            "\"--max-vram can still provide the per-device limits used by layer split\": budgets 10 and 6 GiB weigh 8 : 4 -> 21.3 -> boundary 21",
            vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)],
            "diffusion=cuda0&cuda1", Some("cuda0=10,cuda1=6"),
            vec![r("CUDA0", 0, 20), r("CUDA1", 21, 31)],
        ),
    ];
    for (why, devs, backend, max_vram, want) in table {
        let p = run(devs, blocky(32), backend, None, None, max_vram);
        let m = module(&p, Module::Diffusion);
        assert_eq!(m.split_mode, SplitKind::Layer, "{why}");
        assert_eq!(ranges(&p, Module::Diffusion), want, "{why}\n{}", p.render());
        // "The first device in the list is the module's main device: it also holds the
        // non-block tensors": its range carries the 50 MiB of non-block tensors.
        let first = &m.split[0];
        let nblocks = (first.last_block - first.first_block + 1) as u64;
        assert_eq!(first.param_bytes, nblocks * 100 * MIB + 50 * MIB, "{why}");
        for s in &m.split[1..] {
            assert_eq!(s.param_bytes, (s.last_block - s.first_block + 1) as u64 * 100 * MIB, "{why}");
        }
        assert_eq!(m.runtime[0], want[0].0, "{why}: main device first");
    }
}

#[test]
fn layer_split_params() {
    let devs = || vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)];
    // "If the module has no explicit params assignment, each block range's parameters are loaded
    // directly to ... its own device"
    let p = run(devs(), blocky(32), "diffusion=cuda0&cuda1,te=cpu,vae=cpu", None, None, None);
    assert_eq!(module(&p, Module::Diffusion).params, "CUDA0&CUDA1");
    assert_eq!(device(&p, "CUDA0").param_bytes, 16 * 100 * MIB + 50 * MIB);
    assert_eq!(device(&p, "CUDA1").param_bytes, 16 * 100 * MIB);
    // compute headroom on every participating device
    assert_eq!(device(&p, "CUDA1").compute_bytes, 2 * GIB);
    // "an explicit assignment such as te=cpu keeps the parameters on that backend and stages
    // each range to its device on demand"
    let p = run(devs(), blocky(32), "diffusion=cuda0&cuda1,te=cpu,vae=cpu", Some("diffusion=cpu"), None, None);
    let m = module(&p, Module::Diffusion);
    assert_eq!((m.params.to_string().as_str(), m.runtime.join("&").as_str()), ("CPU", "CUDA0&CUDA1"));
    assert_eq!(device(&p, "CPU").param_bytes, (3200 + 50 + 200 + 100) * MIB);
    assert_eq!(device(&p, "CUDA0").param_bytes, 0);
    assert_eq!(device(&p, "CUDA1").staging_bytes, 25 * MIB, "staging for the range's largest tensor");
    assert_eq!(device(&p, "CUDA0").staging_bytes, 30 * MIB, "main range includes the non-block tensors");
    // "with --params-backend diffusion=disk, released directly from its own device"
    let p = run(devs(), blocky(32), "diffusion=cuda0&cuda1", Some("diffusion=disk"), None, None);
    assert_eq!(module(&p, Module::Diffusion).params, "disk");
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA0", 0, 15), r("CUDA1", 16, 31)]);
    assert_eq!(device(&p, "CUDA1").param_bytes, 0);
}

#[test]
fn layer_split_fallbacks() {
    let devs = || vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)];
    // "If the module has no recognizable transformer blocks, the assignment falls back to the
    // first listed device."
    let p = run(devs(), sd15_f16(), "diffusion=cuda1&cuda0", None, None, None);
    let m = module(&p, Module::Diffusion);
    assert_eq!((m.runtime.clone(), m.split_mode), (vec!["CUDA1".to_string()], SplitKind::None));
    assert!(p.warnings.iter().any(|w| w.contains("no recognizable transformer blocks") && w.contains("CUDA1")));
    // "For te it applies to the dominant text encoder (t5xxl or the LLM)": only T5 tensors carry
    // blocks; CLIP-L and the shared embedding are non-block tensors on the main device.
    let p = run(
        vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)],
        flux_dev_q8(),
        "te=cuda0&cuda1,diffusion=cuda0",
        None,
        None,
        None,
    );
    let te = module(&p, Module::Te);
    assert_eq!(ranges(&p, Module::Te), vec![r("CUDA0", 0, 11), r("CUDA1", 12, 23)]);
    assert_eq!(te.split[0].param_bytes, 12 * 385_875_968 + 246_144_000 + 263_192_576);
}

#[test]
fn cpu_in_layer_split() {
    // Issue 13 (beyond the reference, whose scheduler refuses it): the CPU takes part in a layer
    // split; its basis is the available RAM (64 GiB here, weight 62) against CUDA0's 24 GiB
    // (weight 22): 3200 MiB x 62/84 = 2361.9 MiB -> boundary 24 (2400, 38 MiB off; 23 is 62 off).
    let devs = || vec![Device::cpu(), gpu("CUDA0", 24.0)];
    let p = run(devs(), blocky(32), "diffusion=cpu&cuda0", None, None, None);
    let m = module(&p, Module::Diffusion);
    assert_eq!((m.split_mode, m.sized_by), (SplitKind::Layer, Some(SplitBy::Memory)));
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CPU", 0, 23), r("CUDA0", 24, 31)]);
    assert_eq!(m.params, "CPU&CUDA0");
    assert_eq!(device(&p, "CUDA0").param_bytes, (800 + 200 + 100) * MIB, "its range, te and vae");
    assert_eq!(device(&p, "CPU").compute_bytes, 2 * GIB, "the CPU range computes there");
    assert!(!p.warnings.iter().any(|w| w.contains("CPU")), "no CPU warning: {:?}", p.warnings);
    // An RPC device after the CPU, as the executor runs `diffusion=CPU&RPC0`.
    let rpc = Device::gpu("RPC0", 8 * GIB, 8 * GIB).with_registry("RPC");
    let p = run(vec![Device::cpu(), rpc], blocky(32), "diffusion=CPU&RPC0", None, None, None);
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CPU", 0, 28), r("RPC0", 29, 31)]);
    // Issue 13: the host exports no split buffer type, so a row split with the CPU is a
    // graph-level one, where the CPU may only be the last device (ggml's scheduler runs it last);
    // listed first, a layer split, saying why.
    let p = run(devs(), blocky(32), "diffusion=cuda0&cpu", None, Some("row"), None);
    let m = module(&p, Module::Diffusion);
    assert_eq!(m.split_mode, SplitKind::Row);
    assert!(m.split.iter().all(|r| r.row_share.is_some()), "graph-level shares: {m:?}");
    assert!(p.warnings.iter().any(|w| w.contains("row split at graph level")), "{:?}", p.warnings);
    let p = run(devs(), blocky(32), "diffusion=cpu&cuda0", None, Some("row"), None);
    let m = module(&p, Module::Diffusion);
    assert_eq!(m.split_mode, SplitKind::Layer);
    assert!(
        p.warnings.iter().any(|w| w.contains("row split unavailable") && w.contains("only as the last listed device")),
        "{:?}",
        p.warnings
    );
}

fn plan_err(devs: Vec<Device>, model: ModelDescription, f: Flags) -> String {
    match plan(&request(devs, Some(64 * GIB), model, f)) {
        Ok(p) => panic!("expected an error, got\n{}", p.render()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn split_input_errors() {
    let f = |backend: &str, max_vram: Option<&str>| Flags {
        backend: Some(backend.into()),
        max_vram: max_vram.map(Into::into),
        no_memory_check: true,
        ..Flags::default()
    };
    // Issue 13: a device that would receive no block is an error naming the module, the device
    // and why (the reference drops it with a warning). 80 GiB and 0.5 GiB weigh 78 : 1/16 GiB,
    // so CUDA1's share of the 400 MiB of blocks is 0.3 MiB.
    let e = plan_err(
        vec![Device::cpu(), gpu("CUDA0", 80.0), gpu("CUDA1", 0.5)],
        blocky(4),
        f("diffusion=cuda0&cuda1", None),
    );
    for part in [
        "--backend",
        "'diffusion=cuda0&cuda1'",
        "CUDA1 would receive no block of diffusion",
        "too little memory",
        "its share by memory is 0.3 MiB of diffusion's 400.0 MiB of block weights",
        "the smallest is 100.0 MiB",
        "list fewer devices",
        "CUDA1 a larger --max-vram",
    ] {
        assert!(e.contains(part), "{e:?} lacks {part:?}");
    }
    // Budgets can starve a device as well: --max-vram cuda1=0.01 (weight 1.25 MiB).
    let e = plan_err(
        vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)],
        blocky(8),
        f("diffusion=cuda0&cuda1", Some("cuda1=0.01")),
    );
    assert!(e.contains("CUDA1 would receive no block") && e.contains("too little memory"), "{e}");
    // Fewer blocks than devices.
    let devs3 = || vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0), gpu("CUDA2", 24.0)];
    let e = plan_err(devs3(), blocky(2), f("diffusion=cuda0&cuda1&cuda2", None));
    for part in [
        "CUDA2 would receive no block of diffusion",
        "too few blocks: diffusion has 2 blocks for 3 devices",
        "list at most 2 devices",
    ] {
        assert!(e.contains(part), "{e:?} lacks {part:?}");
    }
    // A device listed twice.
    let e = plan_err(devs3(), blocky(8), f("diffusion=cuda0&cuda1&CUDA0", None));
    assert!(e.contains("lists CUDA0 twice for diffusion"), "{e}");
}

#[test]
fn row_split() {
    let cuda = || vec![Device::cpu(), gpu("CUDA0", 24.0).with_row_split(true), gpu("CUDA1", 24.0).with_row_split(true)];
    // "In row mode the module keeps executing on its main (first listed) device, but its
    // transformer-block matmul weights are allocated in the backend's row-split buffer type";
    // "Embeddings, normalization weights, biases and other non-block tensors stay in regular
    // buffers on the main device."; "the managed budget currently counts a split buffer's full
    // size on each participating device".
    let p = run(cuda(), blocky(32), "diffusion=cuda0&cuda1", None, Some("row"), None);
    let m = module(&p, Module::Diffusion);
    assert_eq!(m.split_mode, SplitKind::Row);
    assert_eq!(m.runtime, ["CUDA0", "CUDA1"]);
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA0", 0, 31), r("CUDA1", 0, 31)]);
    assert_eq!(device(&p, "CUDA0").param_bytes, 3200 * MIB + 50 * MIB + 200 * MIB + 100 * MIB);
    assert_eq!(device(&p, "CUDA1").param_bytes, 3200 * MIB);
    assert_eq!(p.split_mode, "diffusion=row");
    // "--split-mode diffusion=row,te=layer"
    let p = run(cuda(), blocky(32), "diffusion=cuda0&cuda1,te=cuda0&cuda1", None, Some("diffusion=row,te=layer"), None);
    assert_eq!(module(&p, Module::Diffusion).split_mode, SplitKind::Row);
    assert_eq!(module(&p, Module::Te).split_mode, SplitKind::Layer);
    // "Row split requires a compatible split-buffer export from the linked GGML backend. If it is
    // unavailable (or the listed devices belong to different backend registries), the module
    // falls back to a layer split." Issue 13 goes beyond: such devices get a graph-level row
    // split, each device's share of every block matmul's rows by memory (24 : 8 GiB here).
    let table: Vec<(&str, Vec<Device>)> = vec![
        ("a device without row split", vec![Device::cpu(), gpu("CUDA0", 24.0).with_row_split(true), gpu("CUDA1", 8.0)]),
        (
            "different registries",
            vec![Device::cpu(), gpu("CUDA0", 24.0).with_row_split(true), gpu("Vulkan0", 8.0).with_row_split(true)],
        ),
    ];
    for (why, devs) in table {
        let second = devs[2].name.clone();
        let p = run(devs, blocky(32), &format!("diffusion=cuda0&{second}"), None, Some("row"), None);
        let m = module(&p, Module::Diffusion);
        assert_eq!(m.split_mode, SplitKind::Row, "{why}");
        let shares: Vec<f64> = m.split.iter().map(|r| r.row_share.expect("a graph-level share")).collect();
        assert_eq!(shares.len(), 2, "{why}: {m:?}");
        assert!((shares[0] + shares[1] - 1.0).abs() < 1e-6 && shares[0] > 0.6 && shares[0] < 0.8, "{why}: {shares:?}");
        assert!(p.warnings.iter().any(|w| w.contains("row split at graph level")), "{why}: {:?}", p.warnings);
        assert!(!p.warnings.iter().any(|w| w.contains("falling back to layer split")), "{why}: {:?}", p.warnings);
    }
    // The text encoder too: a graph-level row split, even share on equal devices.
    let devs = vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)];
    let p = run(devs, blocky(32), "te=cuda0&cuda1", None, Some("te=row"), None);
    let m = module(&p, Module::Te);
    assert_eq!(m.split_mode, SplitKind::Row);
    let shares: Vec<f64> = m.split.iter().map(|r| r.row_share.expect("a graph-level share")).collect();
    assert_eq!(shares, [0.5, 0.5], "{m:?}");
    assert!(!p.warnings.iter().any(|w| w.contains("falling back to layer split")), "{:?}", p.warnings);
    // Where a graph-level row split cannot run, a layer split, with the reason.
    for (module_name, m) in [("diffusion", Module::Diffusion), ("te", Module::Te)] {
        let devs = vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)];
        let backend = format!("{module_name}=cuda0&cuda1");
        let params = format!("{module_name}=cpu");
        let p = run(devs, blocky(32), &backend, Some(&params), Some("row"), None);
        assert_eq!(module(&p, m).split_mode, SplitKind::Layer, "{module_name}");
        assert!(
            p.warnings.iter().any(|w| w.contains("falling back to layer split") && w.contains("--params-backend")),
            "{module_name}: {:?}",
            p.warnings
        );
    }
}

#[test]
fn row_split_conservative_bound() {
    // "This is a conservative bound and can reject otherwise feasible layouts.": 2 x 8 GiB GPUs,
    // 10 GiB of block weights: a layer split holds ~5 GiB per device and fits, a row split counts
    // 10 GiB on each and does not.
    let devs = || vec![Device::cpu(), gpu("CUDA0", 8.5).with_row_split(true), gpu("CUDA1", 8.5).with_row_split(true)];
    let model = || {
        let mut d = vec![Tensor::new("in.weight", 10 * MIB)];
        for b in 0..40 {
            d.push(Tensor::in_block(format!("blocks.{b}.w"), 256 * MIB, b));
        }
        ModelDescription {
            compute_bytes: Default::default(),
            components: vec![Component { module: Module::Diffusion, tensors: d }],
            files: vec![],
        }
    };
    let layer = run(devs(), model(), "diffusion=cuda0&cuda1", None, Some("layer"), None);
    assert!(layer.fits, "{}", layer.render());
    let row = run(devs(), model(), "diffusion=cuda0&cuda1", None, Some("row"), None);
    assert!(!row.fits, "{}", row.render());
    assert_eq!(device(&row, "CUDA1").param_bytes, 10 * GIB);
}

#[test]
fn partition_properties() {
    // Contiguous, ordered, covering, proportional to weights within one block.
    let blocks = vec![100u64; 57];
    let parts = layer_partition(&blocks, &[3.0, 1.0]);
    assert_eq!(parts, vec![(0, 43), (43, 57)]); // 57 * 3/4 = 42.75 -> 43
    let parts = layer_partition(&blocks, &[1.0, 1.0, 1.0]);
    assert_eq!(parts, vec![(0, 19), (19, 38), (38, 57)]);
    // Uneven block sizes are sized by bytes, not by count: one heavy block of 900 vs 9 of 100.
    let parts = layer_partition(&[900, 100, 100, 100, 100, 100, 100, 100, 100, 100], &[1.0, 1.0]);
    assert_eq!(parts, vec![(0, 1), (1, 10)]);
}

/// MiB of block weights per second, as bytes per second.
fn mib_s(x: f64) -> f64 {
    x * MIB as f64
}

fn run_speeds(
    devs: Vec<Device>,
    backend: &str,
    split_by: Option<&str>,
    max_vram: Option<&str>,
    speeds: &[(&str, f64)],
) -> Plan {
    let mut req = request(
        devs,
        Some(64 * GIB),
        blocky(30),
        Flags {
            backend: Some(backend.into()),
            split_by: split_by.map(Into::into),
            max_vram: max_vram.map(Into::into),
            no_memory_check: true,
            ..Flags::default()
        },
    );
    req.device_speeds = speeds.iter().map(|(d, s)| (d.to_string(), *s)).collect();
    plan(&req).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * b.abs().max(1.0)
}

#[test]
fn speed_split() {
    let devs = || vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)];
    let speeds = [("CUDA0", mib_s(1000.0)), ("cuda1", mib_s(2000.0))];
    // Issue 13, --split-by speed: ranges sized so that the devices finish together. 30 blocks
    // of 100 MiB, 50 MiB of non-block tensors on the main device CUDA0 (1000 MiB/s), CUDA1 twice
    // as fast. CUDA0 with a blocks takes (50 + 100a)/1000 s, CUDA1 100(30 - a)/2000 s: equal at
    // a = 9.67; a = 9 gives 0.95 | 1.05 s, a = 10 gives 1.05 | 1.00 s: the same slowest range,
    // so the smaller sum (2.00 s against 2.05 s) decides: a = 9, 70% of the block bytes on the
    // fast device (about 2/3).
    let p = run_speeds(devs(), "diffusion=cuda0&cuda1", Some("speed"), None, &speeds);
    let m = module(&p, Module::Diffusion);
    assert_eq!(p.split_by, SplitBy::Speed);
    assert_eq!(m.sized_by, Some(SplitBy::Speed));
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA0", 0, 8), r("CUDA1", 9, 29)]);
    let t = m.predicted.clone().expect("speeds known: a predicted time");
    // A layer split runs its ranges in sequence: one pass is the sum; pipelined, the slowest.
    assert!(close(t.single_pass_s, 0.95 + 1.05) && close(t.pipelined_s, 1.05), "{t:?}");
    assert!(close(m.split[0].predicted_s.unwrap(), 0.95) && close(m.split[1].predicted_s.unwrap(), 1.05));
    let text = p.render();
    assert!(text.contains("CUDA1 blocks 9..=29 (2.05 GiB)  ~1.05 s"), "{text}");
    assert!(text.contains("sized by speed, pipeline copies 1; predicted per evaluation: 2.00 s in one pass"), "{text}");
    assert!(text.contains("1.05 s per micro-batch pipelined"), "{text}");
    assert!(text.contains("--split-by speed"), "{text}");
    // By memory (the default) the equal devices split 15 | 15; the prediction is still shown:
    // 1.55 | 0.75 s, one pass 2.30 s, pipelined 1.55 s, both worse than by speed.
    let p = run_speeds(devs(), "diffusion=cuda0&cuda1", None, None, &speeds);
    let m = module(&p, Module::Diffusion);
    assert_eq!((p.split_by, m.sized_by), (SplitBy::Memory, Some(SplitBy::Memory)));
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA0", 0, 14), r("CUDA1", 15, 29)]);
    let t = m.predicted.clone().unwrap();
    assert!(close(t.single_pass_s, 2.30) && close(t.pipelined_s, 1.55), "{t:?}");
    // The list order decides the main device: CUDA1 first (fast, with the non-block tensors):
    // (50 + 100a)/2000 = 100(30 - a)/1000 -> a = 19.8; a = 20: 1.025 | 1.0 s; a = 19: 0.975 | 1.1.
    let p = run_speeds(devs(), "diffusion=cuda1&cuda0", Some("speed"), None, &speeds);
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA1", 0, 19), r("CUDA0", 20, 29)]);
    // Speed is not asked for: no speeds, no prediction.
    let p = run_speeds(devs(), "diffusion=cuda0&cuda1", None, None, &[]);
    assert_eq!(module(&p, Module::Diffusion).predicted, None);
    assert!(p.render().contains("no predicted time (device speeds unknown)"));
}

#[test]
fn speed_split_limits_and_fallbacks() {
    let devs = || vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)];
    // "within their memory limits": CUDA1 is 100x faster but --max-vram cuda1=3 less the 2 GiB
    // compute reserve leaves it 1 GiB, room for 10 blocks of 100 MiB (1000 <= 1024 MiB).
    let fast = [("CUDA0", mib_s(100.0)), ("CUDA1", mib_s(10_000.0))];
    let p = run_speeds(devs(), "diffusion=cuda0&cuda1", Some("speed"), Some("cuda1=3"), &fast);
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA0", 0, 19), r("CUDA1", 20, 29)]);
    assert!(module(&p, Module::Diffusion).split[1].param_bytes <= GIB);
    // Without the limit it takes all but one block (the main device keeps at least one).
    let p = run_speeds(devs(), "diffusion=cuda0&cuda1", Some("speed"), None, &fast);
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA0", 0, 0), r("CUDA1", 1, 29)]);
    // A speed unknown for a listed device: sized by memory, with a warning naming the device.
    let p = run_speeds(devs(), "diffusion=cuda0&cuda1", Some("speed"), None, &[("CUDA0", mib_s(1.0))]);
    let m = module(&p, Module::Diffusion);
    assert_eq!((m.sized_by, m.predicted.clone()), (Some(SplitBy::Memory), None));
    assert_eq!(ranges(&p, Module::Diffusion), vec![r("CUDA0", 0, 14), r("CUDA1", 15, 29)]);
    assert!(
        p.warnings.iter().any(|w| w.contains("--split-by speed: no speed known for CUDA1") && w.contains("by memory")),
        "{:?}",
        p.warnings
    );
    // The reserve a range leaves grows with the pipeline copies: --max-vram cuda1=5 leaves
    // 3 GiB with one copy (CUDA1 takes 29 blocks), 1 GiB with two (10 blocks).
    for (copies, want) in
        [("1", vec![r("CUDA0", 0, 0), r("CUDA1", 1, 29)]), ("2", vec![r("CUDA0", 0, 19), r("CUDA1", 20, 29)])]
    {
        let f = Flags {
            backend: Some("diffusion=cuda0&cuda1".into()),
            split_by: Some("speed".into()),
            max_vram: Some("cuda1=5".into()),
            pipeline_copies: Some(copies.into()),
            no_memory_check: true,
            ..Flags::default()
        };
        let mut req = request(devs(), Some(64 * GIB), blocky(30), f);
        req.device_speeds = fast.iter().map(|(d, s)| (d.to_string(), *s)).collect();
        let p = plan(&req).unwrap();
        assert_eq!(ranges(&p, Module::Diffusion), want, "copies {copies}");
        assert!(p.fits, "copies {copies}: {}", p.render());
    }
    // No speed-sized split fits: budgets of 2.5 GiB less 2 GiB of reserve leave 0.5 GiB each,
    // 1 GiB for 3000 MiB of blocks: sized by memory with a warning (and the plan does not fit).
    let both = [("CUDA0", mib_s(1.0)), ("CUDA1", mib_s(2.0))];
    let p = run_speeds(devs(), "diffusion=cuda0&cuda1", Some("speed"), Some("2.5"), &both);
    assert_eq!(module(&p, Module::Diffusion).sized_by, Some(SplitBy::Memory));
    assert!(p.warnings.iter().any(|w| w.contains("no speed-sized layer split")), "{:?}", p.warnings);
    assert!(!p.fits);
    // --split-by speed without any layer split: a warning that it has no effect.
    let p = run_speeds(devs(), "cuda0", Some("speed"), None, &both);
    assert!(p.warnings.iter().any(|w| w.contains("--split-by speed has no effect")), "{:?}", p.warnings);
    // A listed device's speed must be positive and finite; an absent device's is ignored.
    let mut req = request(devs(), Some(64 * GIB), blocky(30), flags(Some("diffusion=cuda0&cuda1"), None));
    req.device_speeds = [("CUDA1".to_string(), f64::NAN), ("RPC7".to_string(), -1.0)].into();
    let e = plan(&req).unwrap_err().to_string();
    assert!(e.contains("device speeds: CUDA1 has speed NaN") && e.contains("positive finite"), "{e}");
    req.device_speeds = [("RPC7".to_string(), -1.0)].into();
    assert!(plan(&req).is_ok());
}

#[test]
fn split_by_flag() {
    assert_eq!(parse_split_by(None), Ok(SplitBy::Memory));
    assert_eq!(parse_split_by(Some("memory")), Ok(SplitBy::Memory));
    assert_eq!(parse_split_by(Some(" SPEED ")), Ok(SplitBy::Speed));
    let e = parse_split_by(Some("fast")).unwrap_err().to_string();
    assert!(e.contains("--split-by") && e.contains("'fast'") && e.contains("memory") && e.contains("speed"), "{e}");
    // Through plan: before anything is placed.
    let f = Flags { split_by: Some("fast".into()), ..Flags::default() };
    let e = plan(&request(vec![Device::cpu()], Some(GIB), blocky(2), f)).unwrap_err().to_string();
    assert!(e.starts_with("--split-by: invalid value 'fast'"), "{e}");
}

/// A partition's slowest range, or None when it breaks a cap.
fn slowest(blocks: &[u64], lead: u64, speeds: &[f64], caps: &[Option<u64>], parts: &[(usize, usize)]) -> Option<f64> {
    let mut worst = 0.0f64;
    for (k, &(a, b)) in parts.iter().enumerate() {
        let bytes: u64 = blocks[a..b].iter().sum::<u64>() + if k == 0 { lead } else { 0 };
        if caps[k].is_some_and(|c| bytes > c) {
            return None;
        }
        worst = worst.max(bytes as f64 / speeds[k]);
    }
    Some(worst)
}

/// Every partition of `n` blocks into `k` non-empty contiguous ranges.
fn all_partitions(n: usize, k: usize) -> Vec<Vec<(usize, usize)>> {
    if k == 1 {
        return vec![vec![(0, n)]];
    }
    let mut out = Vec::new();
    for cut in (k - 1)..n {
        for mut head in all_partitions(cut, k - 1) {
            head.push((cut, n));
            out.push(head);
        }
    }
    out
}

#[test]
fn speed_partition_is_the_best_contiguous_split() {
    // Against brute force on small random cases: covering, ordered, non-empty, within the
    // caps, and its slowest range is the least any partition achieves (None iff none fits).
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    };
    for case in 0..400 {
        let k = 1 + next(3) as usize;
        let n = k + next(6) as usize;
        let blocks: Vec<u64> = (0..n).map(|_| 1 + next(100)).collect();
        let lead = next(50);
        let speeds: Vec<f64> = (0..k).map(|_| 0.5 + next(8) as f64).collect();
        let caps: Vec<Option<u64>> = (0..k).map(|_| (next(3) == 0).then(|| 40 + next(300))).collect();
        let got = layer_partition_by_speed(&blocks, lead, &speeds, &caps);
        let best = all_partitions(n, k)
            .iter()
            .filter_map(|p| slowest(&blocks, lead, &speeds, &caps, p))
            .fold(None, |a: Option<f64>, t| Some(a.map_or(t, |a| a.min(t))));
        match (got, best) {
            (None, None) => {}
            (Some(p), Some(best)) => {
                assert_eq!(p.len(), k, "case {case}");
                assert_eq!((p[0].0, p[k - 1].1), (0, n), "case {case}: covers");
                assert!(p.windows(2).all(|w| w[0].1 == w[1].0) && p.iter().all(|(a, b)| a < b), "case {case}: {p:?}");
                let t = slowest(&blocks, lead, &speeds, &caps, &p).expect("within the caps");
                assert!(t <= best * (1.0 + 1e-9), "case {case}: {t} > best {best} ({p:?})");
            }
            (got, best) => panic!("case {case}: got {got:?}, brute force {best:?}"),
        }
    }
    // Fewer blocks than devices, or a non-positive speed: no partition.
    assert_eq!(layer_partition_by_speed(&[1, 2], 0, &[1.0, 1.0, 1.0], &[None; 3]), None);
    assert_eq!(layer_partition_by_speed(&[1, 2], 0, &[1.0, 0.0], &[None; 2]), None);
    // Speeds 1 and 2, no lead: 1/3 | 2/3 of the bytes.
    assert_eq!(layer_partition_by_speed(&[100; 30], 0, &[1.0, 2.0], &[None; 2]), Some(vec![(0, 10), (10, 30)]));
}

#[test]
fn pipeline_copies() {
    let devs = || vec![Device::cpu(), gpu("CUDA0", 24.0), gpu("CUDA1", 24.0)];
    let go = |backend: &str, copies: Option<&str>, env: Option<&str>| {
        plan(&request(
            devs(),
            Some(64 * GIB),
            blocky(32),
            Flags {
                backend: Some(backend.into()),
                pipeline_copies: copies.map(Into::into),
                pipeline_copies_env: env.map(Into::into),
                no_memory_check: true,
                ..Flags::default()
            },
        ))
    };
    // Default 1: no copies, today's memory.
    let p = go("diffusion=cuda0&cuda1", None, None).unwrap();
    assert_eq!(p.pipeline_copies, 1);
    assert_eq!(device(&p, "CUDA1").compute_bytes, 2 * GIB);
    // N copies: each device of a layer split keeps N micro-batches' cross-device inputs and
    // compute buffers: its reserve is N x 2 GiB. te runs on CUDA0 alone: its 2 GiB are not scaled.
    let p = go("diffusion=cuda0&cuda1", Some("3"), None).unwrap();
    assert_eq!(p.pipeline_copies, 3);
    assert_eq!(module(&p, Module::Diffusion).compute_reserve_bytes, 6 * GIB);
    assert_eq!(module(&p, Module::Te).compute_reserve_bytes, 2 * GIB);
    assert_eq!((device(&p, "CUDA0").compute_bytes, device(&p, "CUDA1").compute_bytes), (6 * GIB, 6 * GIB));
    assert!(p.render().contains("sized by memory, pipeline copies 3") && p.render().contains("--pipeline-copies 3"));
    // The environment variable when the flag is absent; the flag wins.
    assert_eq!(go("diffusion=cuda0&cuda1", None, Some("2")).unwrap().pipeline_copies, 2);
    assert_eq!(go("diffusion=cuda0&cuda1", Some("4"), Some("2")).unwrap().pipeline_copies, 4);
    assert_eq!(go("diffusion=cuda0&cuda1", Some("4"), Some("junk")).unwrap().pipeline_copies, 4);
    assert_eq!(go("diffusion=cuda0&cuda1", None, Some("")).unwrap().pipeline_copies, 1);
    // More copies than memory allows: an error naming the setting, the device and the bytes.
    // CUDA0 holds 1650 + 300 MiB of params: 1.90 GiB + 2N GiB <= 23.5 GiB for N <= 10.
    let e = go("diffusion=cuda0&cuda1", Some("12"), None).unwrap_err().to_string();
    for part in [
        "--pipeline-copies 12: CUDA0 would need 25.90 GiB",
        "24.00 GiB of it compute reserve for 12 copies",
        "budget is 23.50 GiB",
        "at most 10 copies fit",
    ] {
        assert!(e.contains(part), "{e:?} lacks {part:?}");
    }
    let e = go("diffusion=cuda0&cuda1", None, Some("11")).unwrap_err().to_string();
    assert!(e.starts_with("SD_PIPELINE_COPIES=11: CUDA0") && e.contains("at most 10 copies fit"), "{e}");
    assert!(go("diffusion=cuda0&cuda1", Some("10"), None).unwrap().fits);
    // A plan over budget whatever the copies is an ordinary plan that does not fit.
    let f = Flags {
        backend: Some("diffusion=cuda0&cuda1".into()),
        pipeline_copies: Some("2".into()),
        max_vram: Some("2".into()),
        no_memory_check: true,
        ..Flags::default()
    };
    let p = plan(&request(devs(), Some(64 * GIB), blocky(32), f)).unwrap();
    assert!(!p.fits && p.warnings.iter().any(|w| w.starts_with("CUDA1 needs")), "{:?}", p.warnings);
    // Without a layer split the copies mean nothing: a warning, and no reserve change.
    let p = go("cuda0", Some("2"), None).unwrap();
    assert!(p.warnings.iter().any(|w| w.contains("--pipeline-copies 2 has no effect")), "{:?}", p.warnings);
    assert_eq!(device(&p, "CUDA0").compute_bytes, 2 * GIB);
    // Bad values name the flag or the variable and the value.
    for (flag, env, want) in [
        (Some("0"), None, "--pipeline-copies: invalid value '0'"),
        (Some("abc"), None, "--pipeline-copies: invalid value 'abc'"),
        (Some("-1"), None, "--pipeline-copies: invalid value '-1'"),
        (Some("+2"), None, "--pipeline-copies: invalid value '+2'"),
        (Some(""), Some("2"), "--pipeline-copies: invalid value ''"),
        (None, Some("0"), "SD_PIPELINE_COPIES: invalid value '0'"),
        (None, Some("two"), "SD_PIPELINE_COPIES: invalid value 'two'"),
    ] {
        let e = go("diffusion=cuda0&cuda1", flag, env).unwrap_err().to_string();
        assert!(e.starts_with(want) && e.contains("positive integer"), "{flag:?}/{env:?}: {e}");
    }
}
