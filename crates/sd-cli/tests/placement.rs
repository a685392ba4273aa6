//! Placement at run time, end to end: the same fixture generation (fixed seed) under many
//! placements must give the same image. The remote device is a real RPC server (`sd-cli
//! rpc-server`) on loopback running the same CPU kernels, so every placement is required to
//! be bit-identical to the all-CPU run; the run report (`--report-json`) is checked for what
//! the runtime says it did (residency, segments, prefetches, each device's high-water mark
//! within its budget).

mod common;

use std::path::Path;

use common::{level_diff as diff, pixels, run_checked, sd15_fixture as fixture, sd_cli, Server};
use sd_models::report::{HomeReport, Residency, RunReport};

const MIB: u64 = 1 << 20;

/// Generates with `extra` flags; returns the pixels and the run report.
fn generate(model: &Path, out: &Path, extra: &[&str]) -> (Vec<u8>, RunReport) {
    generate_cfg(model, out, "1", extra)
}

/// [`generate`] at `--cfg-scale cfg` (above 1: a batch of two per UNet evaluation).
fn generate_cfg(model: &Path, out: &Path, cfg: &str, extra: &[&str]) -> (Vec<u8>, RunReport) {
    let args = ["-p", "a cat", "-W", "64", "-H", "64", "--steps", "2", "--sampling-method", "euler"];
    let report = run_checked(model, out, &[&args[..], &["-s", "42", "--cfg-scale", cfg, "-t", "2"]].concat(), extra);
    assert_eq!(report.steps.len(), 2, "{extra:?}: one time per sampling step");
    (pixels(out), report)
}

#[test]
fn every_placement_gives_the_all_cpu_image() {
    let model = fixture();
    let dir = std::env::temp_dir().join(format!("sd-cli-placement-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (base, report) = generate(&model, &dir.join("cpu.png"), &["--backend", "cpu"]);
    let unet = report.runner("unet").expect("a unet runner");
    assert_eq!(unet.stats.segmented_runs, 0, "{unet:?}");
    assert_eq!(report.module("unet").map(|m| m.residency), Some(Residency::Resident));

    // The base run's CPU weights are used in place from the file's map; copies compute alike.
    let (copied, _) = generate(&model, &dir.join("copied.png"), &["--backend", "cpu", "--no-mmap"]);
    assert!(copied == base, "weights copied out of the map (--no-mmap) give another image");

    let server = Server::start();
    let rpc = ["--rpc", server.endpoint.as_str()];
    let budget = "RPC0=0.5"; // 512 MiB: less than a third of the 1.6 GiB UNet
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("params on the device", vec!["--backend", "RPC0"]),
        ("params in RAM", vec!["--backend", "RPC0", "--params-backend", "cpu"]),
        ("params on disk", vec!["--backend", "RPC0", "--params-backend", "disk"]),
        ("params on another device", vec!["--backend", "cpu", "--params-backend", "RPC0"]),
        ("segmented", vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", budget]),
        (
            "segmented, no prefetch",
            vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", budget, "--disable-prefetch"],
        ),
        // performance.md: "0 uses the device's current free memory without an explicit budget".
        ("--max-vram 0", vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", "RPC0=0"]),
        (
            "monolithic forced with room",
            vec!["--backend", "RPC0", "--params-backend", "cpu", "--max-vram", "RPC0=4", "--disable-segmented-compute"],
        ),
    ];
    for (i, (what, flags)) in cases.iter().enumerate() {
        let args: Vec<&str> = rpc.iter().copied().chain(flags.iter().copied()).collect();
        let (px, report) = generate(&model, &dir.join(format!("{i}.png")), &args);
        assert!(px == base, "{what}: the image differs from the all-CPU one");
        let unet = report.runner("unet").unwrap_or_else(|| panic!("{what}: no unet runner"));
        let s = &unet.stats;
        let module = report.module("unet").unwrap_or_else(|| panic!("{what}: no unet module"));
        let rpc0 = report.device("RPC0").unwrap_or_else(|| panic!("{what}: no RPC0 ledger: {:?}", report.devices));
        let hw = rpc0.high_water_bytes;
        match *what {
            "segmented" => {
                assert!(s.segmented_runs == 2 && s.max_segments > 1, "{what}: {s:?}");
                assert!(s.prefetched_groups > 0, "{what}: prefetch is on by default: {s:?}");
                assert_eq!(s.prefetches_used, s.prefetched_groups, "{what}: every prefetch is used: {s:?}");
                assert_eq!(module.residency, Residency::Segmented, "{what}");
            }
            "segmented, no prefetch" => {
                assert_eq!(s.segmented_runs, 2, "{what}: {s:?}");
                assert!(s.prefetched_bytes == 0 && s.prefetched_groups == 0, "{what}: {s:?}");
                assert_eq!(module.residency, Residency::Segmented, "{what}");
            }
            "params on the device" => {
                assert_eq!(s.segmented_runs, 0, "{s:?}");
                assert_eq!(module.params, HomeReport::Compute, "{what}");
                assert_eq!(module.residency, Residency::Resident, "{what}");
                assert!(hw > 1600 * MIB, "the UNet's weights are managed on RPC0: {hw} bytes");
            }
            _ => assert_eq!(s.segmented_runs, 0, "{what}: {s:?}"),
        }
        if *what == "--max-vram 0" {
            assert_eq!(rpc0.budget_bytes, None, "{what}: RPC0 must have no managed budget");
        }
        if *what == "params in RAM" {
            assert_eq!((&module.params, module.residency), (&HomeReport::Host, Residency::Staged), "{what}");
        }
        if *what == "params on disk" {
            assert_eq!(module.params, HomeReport::Disk, "{what}");
        }
        if *what == "params on another device" {
            assert_eq!(module.params, HomeReport::Device { device: "RPC0".into() }, "{what}");
            assert_eq!(unet.device, "CPU", "{what}: {unet:?}");
            assert!(hw > 1600 * MIB, "the UNet's home copy is managed on RPC0: {hw} bytes");
        }
    }
}

#[test]
fn a_budget_too_small_for_one_block_fails_cleanly() {
    let model = fixture();
    let server = Server::start();
    let out = std::env::temp_dir().join(format!("sd-cli-placement-small-{}.png", std::process::id()));
    let o = sd_cli()
        .arg("-m")
        .arg(&model)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "--cfg-scale", "1"])
        .args(["--rpc", &server.endpoint, "--backend", "RPC0", "--params-backend", "cpu", "--max-vram", "RPC0=0.01"])
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a 10 MiB budget cannot hold a UNet block");
    assert!(err.contains("RPC0"), "the error names the device: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.exists(), "no output file left behind");
}

#[test]
fn plan_writes_the_plan_part_of_the_report() {
    let model = fixture();
    let report = std::env::temp_dir().join(format!("sd-cli-plan-report-{}.json", std::process::id()));
    let o = sd_cli()
        .arg("plan")
        .arg("-m")
        .arg(&model)
        .args(["--backend", "cpu", "--params-backend", "te=disk", "--report-json"])
        .arg(&report)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
    std::fs::remove_file(&report).unwrap();
    assert_eq!(r.command, "plan");
    assert!(r.settings.is_none() && r.modules.is_empty() && r.runners.is_empty(), "nothing ran: {r:?}");
    let plan = r.plan.expect("the plan");
    let te = plan.modules.iter().find(|m| m.module.name() == "te").expect("a te module");
    assert_eq!((te.runtime.as_slice(), &te.params), (&["CPU".to_string()][..], &sd_placement::ParamsHome::Disk));
    assert!(r.args.iter().any(|a| a == "--report-json"), "{:?}", r.args);
}

/// The block index the planner gives a segment (cut) name of the UNet or the text encoder,
/// or `None` for a non-block segment (SD 1.x: 12 input blocks, the middle block is 12).
fn block_of_segment(name: &str) -> Option<u32> {
    let num = |s: &str| s.parse::<u32>().ok();
    if let Some(n) = name.strip_prefix("input_blocks.") {
        num(n)
    } else if name == "middle_block" {
        Some(12)
    } else if let Some(n) = name.strip_prefix("output_blocks.") {
        num(n).map(|n| 13 + n)
    } else {
        name.strip_prefix("clip_text.layers.").and_then(num)
    }
}

/// Checks that `module`'s runner ran each block on the device the plan's range gave it, the
/// non-block parts on the main device, and copied activations between them.
fn assert_ran_as_planned(report: &RunReport, module: &str, runner: &str, what: &str) {
    let plan = report.plan.as_ref().expect("the plan");
    let m = plan.modules.iter().find(|m| m.module.name() == module).unwrap_or_else(|| panic!("{what}: {module}"));
    assert!(m.split.len() >= 2, "{what}: the plan splits {module}: {m:?}");
    let r = report.runner(runner).unwrap_or_else(|| panic!("{what}: no {runner} runner"));
    assert!(r.stages.len() >= 2, "{what}: {runner} ran in stages: {r:?}");
    let mut seen = std::collections::BTreeSet::new();
    for st in &r.stages {
        for seg in &st.segments {
            match block_of_segment(seg) {
                Some(b) => {
                    let range = m.split.iter().find(|s| s.first_block <= b && b <= s.last_block);
                    let range = range.unwrap_or_else(|| panic!("{what}: block {b} ({seg}) is in no range: {m:?}"));
                    assert_eq!(st.device, range.device, "{what}: {seg} ran on the device of its range");
                    seen.insert(st.device.clone());
                }
                None => assert_eq!(st.device, m.runtime[0], "{what}: {seg} runs on the main device"),
            }
        }
    }
    assert_eq!(seen.len(), m.split.len(), "{what}: every listed device ran blocks: {:?}", r.stages);
    assert!(r.stats.cross_device_copies > 0 && r.stats.cross_device_bytes > 0, "{what}: {:?}", r.stats);
    let module_report = report.module(runner).unwrap_or_else(|| panic!("{what}: no {runner} module"));
    let listed: Vec<&str> = m.split.iter().map(|s| s.device.as_str()).collect();
    assert_eq!(module_report.devices, listed, "{what}");
}

#[test]
fn layer_splits_give_the_all_cpu_image() {
    let model = fixture();
    let dir = std::env::temp_dir().join(format!("sd-cli-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (base, _) = generate(&model, &dir.join("cpu.png"), &["--backend", "cpu"]);
    let (a, b) = (Server::start(), Server::start());
    let rpc = format!("{},{}", a.endpoint, b.endpoint);
    // Each budget is below the 1.6 GiB UNet: only a split fits it with its weights on the devices.
    let budgets = "RPC0=1.25,RPC1=1.25";
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("unet and te split, weights on the devices", vec!["--backend", "diffusion=RPC0&RPC1,te=RPC1&RPC0,vae=cpu"]),
        (
            "unet split, params in RAM",
            vec!["--backend", "diffusion=RPC1&RPC0,te=cpu,vae=cpu", "--params-backend", "diffusion=cpu"],
        ),
        (
            "unet split under budgets, params on disk",
            vec![
                "--backend",
                "diffusion=RPC0&RPC1,te=cpu,vae=cpu",
                "--params-backend",
                "diffusion=disk",
                "--max-vram",
                budgets,
            ],
        ),
        ("unet split under budgets", vec!["--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--max-vram", budgets]),
        ("the CPU and a remote device", vec!["--backend", "diffusion=CPU&RPC0,te=RPC1&CPU,vae=cpu"]),
        ("three devices", vec!["--backend", "diffusion=RPC1&CPU&RPC0,te=cpu,vae=cpu"]),
    ];
    for (i, (what, flags)) in cases.iter().enumerate() {
        let args: Vec<&str> = ["--rpc", rpc.as_str()].into_iter().chain(flags.iter().copied()).collect();
        let (px, report) = generate(&model, &dir.join(format!("{i}.png")), &args);
        assert!(px == base, "{what}: the image differs from the all-CPU one");
        assert_ran_as_planned(&report, "diffusion", "unet", what);
        let unet = report.module("unet").unwrap();
        let stats = &report.runner("unet").unwrap().stats;
        match i {
            0 => {
                assert_ran_as_planned(&report, "te", "te", what);
                assert_eq!(unet.params, HomeReport::Compute, "{what}");
                assert_eq!(stats.loaded_bytes, 0, "{what}: pinned on their devices: {stats:?}");
            }
            1 => {
                assert_eq!(unet.params, HomeReport::Host, "{what}");
                assert!(stats.loaded_bytes > 1500 * MIB, "{what}: staged once: {stats:?}");
                assert_eq!(stats.evictions, 0, "{what}: kept while they fit: {stats:?}");
            }
            2 => {
                assert_eq!(unet.params, HomeReport::Disk, "{what}");
                assert!(stats.loaded_bytes > 3000 * MIB, "{what}: staged at every step: {stats:?}");
            }
            _ => assert_eq!(unet.params, HomeReport::Compute, "{what}"),
        }
        if i == 4 {
            assert_ran_as_planned(&report, "te", "te", what);
        }
        if i == 5 {
            assert_eq!(report.runner("unet").unwrap().stages.len(), 4, "{what}: RPC1, CPU, RPC0, RPC1 (the head)");
        }
        for dev in ["RPC0", "RPC1"] {
            let d = report.device(dev).unwrap_or_else(|| panic!("{what}: no {dev} ledger"));
            assert!(d.high_water_bytes > 0, "{what}: {dev} held part of the split: {d:?}");
        }
    }

    // With classifier-free guidance every evaluation is a batch of two: one pass of it
    // (copies 1) is bit-identical; two micro-batches overlapped across the devices run other
    // matrix shapes (a batch of one), so they are within the parity bound.
    let (base7, _) = generate_cfg(&model, &dir.join("cpu7.png"), "7", &["--backend", "cpu"]);
    let split = ["--rpc", rpc.as_str(), "--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu"];
    let one: Vec<&str> = split.iter().copied().chain(["--pipeline-copies", "1"]).collect();
    let (px, report) = generate_cfg(&model, &dir.join("copies1.png"), "7", &one);
    assert!(px == base7, "copies 1: the image differs from the all-CPU one");
    assert_eq!(report.runner("unet").unwrap().stats.pipelined_runs, 0);
    let two: Vec<&str> = split.iter().copied().chain(["--pipeline-copies", "2"]).collect();
    let (px, report) = generate_cfg(&model, &dir.join("copies2.png"), "7", &two);
    let (mean, max) = diff(&px, &base7);
    assert!(mean <= 1.0 && max <= 8, "copies 2: mean {mean:.3}, max {max} levels from the all-CPU image");
    let s = &report.runner("unet").unwrap().stats;
    assert_eq!(s.pipelined_runs, 2, "both steps pipelined: {s:?}");
    assert!(s.pipeline_busy_secs > 0.0 && s.pipeline_wall_secs > 0.0, "{s:?}");
    assert_eq!(s.runs, 4, "two micro-batches per step: {s:?}");
    assert_ran_as_planned(&report, "diffusion", "unet", "copies 2");

    // Without guidance the micro-batches are a batch's images, sampled in lockstep; a
    // micro-batch of one image runs the graph an image sampled alone runs, so each image is
    // the one the CPU gives, bit for bit.
    let batch = |name: &str, extra: &[&str]| -> (Vec<Vec<u8>>, RunReport) {
        let args = ["-p", "a cat", "-W", "64", "-H", "64", "--steps", "2", "--sampling-method", "euler_a"];
        let args = [&args[..], &["-s", "42", "--cfg-scale", "1", "-t", "2", "-b", "2"]].concat();
        let report = run_checked(&model, &dir.join(format!("{name}.png")), &args, extra);
        (vec![pixels(&dir.join(format!("{name}_0.png"))), pixels(&dir.join(format!("{name}_1.png")))], report)
    };
    let (alone, _) = batch("cpu-b2", &["--backend", "cpu"]);
    assert!(alone[0] != alone[1], "two seeds, two images");
    let piped: Vec<&str> = split.iter().copied().chain(["--pipeline-copies", "2"]).collect();
    let (px, report) = batch("copies2-b2", &piped);
    // euler_a draws noise at every step: each image's from its own generator.
    assert!(px == alone, "copies 2 over a batch of two: the images differ from those sampled alone");
    let s = &report.runner("unet").unwrap().stats;
    assert_eq!((s.pipelined_runs, s.runs), (2, 4), "both steps pipelined, one image per micro-batch: {s:?}");
    assert_eq!(report.steps.len(), 4, "every image reported at every step: {:?}", report.steps);

    // Sized by speed: each device of the split is measured once (into the cache), the plan says how the
    // ranges were sized, and the image is the all-CPU one.
    let cache = dir.join("device-speeds.toml");
    let speed: Vec<&str> = split.iter().copied().chain(["--split-by", "speed"]).collect();
    let (px, report) = generate(&model, &dir.join("speed.png"), &speed);
    assert!(px == base, "--split-by speed: the image differs from the all-CPU one");
    let plan = report.plan.as_ref().unwrap();
    let unet = plan.modules.iter().find(|m| m.module.name() == "diffusion").unwrap();
    assert_eq!(unet.sized_by, Some(sd_placement::SplitBy::Speed), "{unet:?}");
    assert!(unet.predicted.is_some(), "speeds known: a predicted time: {unet:?}");
    let text = std::fs::read_to_string(&cache).unwrap_or_else(|e| panic!("{}: {e}", cache.display()));
    for dev in ["RPC0", "RPC1"] {
        assert!(text.contains(&format!("device = \"{dev}\"")), "{dev} measured and cached:\n{text}");
    }
    // Only the devices the split uses are probed.
    assert!(!text.contains("device = \"CPU\""), "the CPU is in no split, yet it was measured:\n{text}");
    assert_ran_as_planned(&report, "diffusion", "unet", "--split-by speed");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn graph_level_row_splits_give_the_all_cpu_image() {
    // Over two RPC servers (no split buffer type) `--split-mode row` is a graph-level row split
    // (sd-sched's rowsplit): every block matmul's rows are cut across the devices, each chunk's
    // product computed on its device and gathered on the main one. Each output element is the same
    // dot product with the same kernels, so the image is the all-CPU one bit for bit: at cfg 7
    // (a batch of two) over two steps, with the CPU as the last device, and for the text encoder.
    let model = fixture();
    let dir = std::env::temp_dir().join(format!("sd-cli-rows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (base7, _) = generate_cfg(&model, &dir.join("cpu7.png"), "7", &["--backend", "cpu"]);
    let (base1, _) = generate(&model, &dir.join("cpu1.png"), &["--backend", "cpu"]);
    let (a, b) = (Server::start(), Server::start());
    let rpc = format!("{},{}", a.endpoint, b.endpoint);
    let cases = [("RPC0&RPC1", "7", &base7, "RPC1"), ("RPC0&CPU", "1", &base1, "CPU")];
    for (list, cfg, base, second) in cases {
        let backend = format!("diffusion={list},te=cpu,vae=cpu");
        let args = ["--rpc", rpc.as_str(), "--split-mode", "row", "--backend", backend.as_str()];
        let (px, report) = generate_cfg(&model, &dir.join(format!("row-{second}.png")), cfg, &args);
        assert!(px == *base, "{list} at cfg {cfg}: the image differs from the all-CPU one");
        let plan = report.plan.as_ref().unwrap();
        let m = plan.modules.iter().find(|m| m.module.name() == "diffusion").unwrap();
        assert_eq!(m.split_mode, sd_placement::SplitKind::Row, "{list}: {m:?}");
        let shares: Vec<f64> = m.split.iter().map(|r| r.row_share.expect("a graph-level share")).collect();
        assert!(shares.len() == 2 && shares.iter().all(|&s| s > 0.2), "{list}: {shares:?}");
        assert!(plan.warnings.iter().any(|w| w.contains("row split at graph level")), "{:?}", plan.warnings);
        let unet = report.runner("unet").unwrap();
        assert!(unet.stats.cross_device_copies > 0 && unet.stats.cross_device_bytes > 0, "{list}: {:?}", unet.stats);
        assert_eq!(report.module("unet").unwrap().devices, vec!["RPC0".to_string(), second.to_string()], "{list}");
        if second == "RPC1" {
            // RPC1 holds only its chunks of the matmul weights: far less than the main device,
            // which keeps every other UNet tensor.
            let (main, other) = (report.device("RPC0").unwrap(), report.device("RPC1").unwrap());
            assert!(other.high_water_bytes > 64 << 20, "RPC1 holds its chunks: {other:?}");
            assert!(other.high_water_bytes * 3 < main.high_water_bytes, "{main:?} {other:?}");
        }
    }
    // The text encoder's layer matmuls too: the same conditioning, so the same image.
    let backend = "te=RPC0&RPC1,diffusion=cpu,vae=cpu";
    let args = ["--rpc", rpc.as_str(), "--split-mode", "te=row", "--backend", backend];
    let (px, report) = generate(&model, &dir.join("row-te.png"), &args);
    assert!(px == base1, "te=RPC0&RPC1: the image differs from the all-CPU one");
    let plan = report.plan.as_ref().unwrap();
    let m = plan.modules.iter().find(|m| m.module.name() == "te").unwrap();
    assert_eq!(m.split_mode, sd_placement::SplitKind::Row, "te: {m:?}");
    let te = report.runner("te").unwrap();
    assert!(te.stats.cross_device_copies > 0 && te.stats.cross_device_bytes > 0, "te: {:?}", te.stats);
    assert_eq!(report.module("te").unwrap().devices, vec!["RPC0".to_string(), "RPC1".to_string()]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn auto_fit_over_two_remote_devices_that_cannot_hold_the_unet_runs_the_all_cpu_image() {
    let model = fixture();
    let dir = std::env::temp_dir().join(format!("sd-cli-autofit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (base, _) = generate(&model, &dir.join("cpu.png"), &["--backend", "cpu"]);
    let (a, b) = (Server::start(), Server::start());
    let rpc = format!("{},{}", a.endpoint, b.endpoint);
    // 1 GiB each: the 1.6 GiB UNet fits on neither; no placement flag, so auto-fit plans.
    let (px, report) = generate(&model, &dir.join("auto.png"), &["--rpc", &rpc, "--max-vram", "RPC0=1,RPC1=1"]);
    assert!(px == base, "auto-fit: the image differs from the all-CPU one");
    let plan = report.plan.as_ref().expect("the plan");
    let unet = plan.modules.iter().find(|m| m.module.name() == "diffusion").unwrap();
    assert_eq!(unet.runtime, vec!["RPC0".to_string()], "auto-fit computes on one GPU: {unet:?}");
    assert_eq!(unet.params, sd_placement::ParamsHome::Device("CPU".into()), "offloaded to RAM: {unet:?}");
    let rpc0 = report.device("RPC0").unwrap();
    assert!(rpc0.high_water_bytes <= 1 << 30, "{rpc0:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 39: a layer-split module's log names the split, never "runs on" its main device
/// alone (the CPU was named after "layer split over CPU&RPC0"); and a random seed (`-s -1`)
/// is printed, so that the image can be made again.
#[test]
fn a_split_is_logged_as_a_split_and_a_random_seed_is_printed() {
    let model = fixture();
    let dir = std::env::temp_dir().join(format!("sd-cli-split-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let server = Server::start();
    let out = sd_cli()
        .arg("-m")
        .arg(&model)
        .args(["-W", "64", "-H", "64", "--steps", "1", "-t", "2", "-s", "-1", "--cfg-scale", "1"])
        .args(["--rpc", server.endpoint.as_str(), "--backend", "diffusion=CPU&RPC0,te=cpu,vae=cpu", "-o"])
        .arg(dir.join("split.png"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("diffusion: layer split over CPU&RPC0"), "{err}");
    assert!(err.contains("diffusion: split over CPU&RPC0"), "{err}");
    assert!(!err.contains("diffusion: runs on"), "{err}");
    let seed = err.split("random seed ").nth(1).and_then(|s| s.split_whitespace().next()).expect("the seed printed");
    assert!(seed.parse::<u64>().is_ok(), "{err}");
    assert!(err.contains(&format!("-s {seed} repeats this image")), "{err}");
}
