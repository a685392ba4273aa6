//! The Vulkan plugin on a real Vulkan device (Mesa's lavapipe in CI): listed with the memory
//! its driver reports, an SD 1.5 image within the cross-kernel bound of the CPU's, and
//! placements that move only the weights giving one image bit for bit.
//!
//! The plugin is optional (`cargo xtask plugins --backend vulkan`), so these tests run where
//! sd-cli lists a `Vulkan0`. `SD_TEST_VULKAN=1` (`.ci/run` sets it after building the plugin)
//! makes the device required: without it each test fails, naming what is missing; without
//! the variable and without the device, each test says on stderr that it did not run.
//!
//! ggml lists a CPU-type Vulkan device (lavapipe) only when `GGML_VK_VISIBLE_DEVICES` names
//! it; lavapipe also needs f16 arithmetic and cooperative matrices off (llama.cpp's CI runs it
//! so): every sd-cli here runs with [`VK_ENV`].

mod common;

use std::path::Path;

use common::{level_diff, pixels, run_checked_env, sd15_fixture, sd_cli, Server};
use sd_models::report::{HomeReport, Residency, RunReport};
use sd_placement::BudgetRule;

/// The environment of every sd-cli run here.
const VK_ENV: [(&str, &str); 3] =
    [("GGML_VK_VISIBLE_DEVICES", "0"), ("GGML_VK_DISABLE_F16", "1"), ("GGML_VK_DISABLE_COOPMAT", "1")];

/// The cross-kernel bound: another device's kernels (other reduction orders, f32 where the CPU
/// takes f16 products) give an image within a mean of 2 and a largest difference of 24 levels
/// of the CPU's (the bound of the issue that brought the Vulkan plugin into CI).
const MEAN_BOUND: f64 = 2.0;
const MAX_BOUND: u8 = 24;

/// `sd-cli --list-devices --json` with [`VK_ENV`].
fn devices() -> Vec<serde_json::Value> {
    let out = sd_cli().args(["--list-devices", "--json"]).envs(VK_ENV).output().unwrap();
    assert!(out.status.success(), "--list-devices failed:\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap().as_array().unwrap().clone()
}

/// `Vulkan0` as `--list-devices` shows it, or `None` (said on stderr) where it is absent and
/// not required.
fn vulkan0(test: &str) -> Option<serde_json::Value> {
    let required = std::env::var("SD_TEST_VULKAN").is_ok_and(|v| v == "1");
    let list = devices();
    match list.iter().find(|d| d["name"] == "Vulkan0") {
        Some(d) => Some(d.clone()),
        None if required => panic!(
            "SD_TEST_VULKAN=1 but sd-cli lists no Vulkan0 (is libggml-vulkan.so in target/ggml/plugins, \
             from `cargo xtask plugins --backend vulkan`, and a Vulkan driver installed, e.g. Mesa's \
             lavapipe, mesa-vulkan-drivers?); devices: {list:?}"
        ),
        None => {
            eprintln!(
                "{test}: NOT RUN: no Vulkan0 (build the plugin with `cargo xtask plugins --backend vulkan`; \
                 SD_TEST_VULKAN=1 makes this a failure)"
            );
            None
        }
    }
}

/// One SD 1.5 fixture generation (64x64, one euler step, no guidance, seed 42) with `extra`
/// flags into `dir/name.png`; its pixels and run report (budgets checked).
fn generate(model: &Path, dir: &Path, name: &str, extra: &[&str]) -> (Vec<u8>, RunReport) {
    let (mut images, report) = generate_batch(model, dir, name, 42, 1, extra);
    (images.remove(0), report)
}

/// [`generate`] of `batch` images from `seed`: each image's pixels (`name.png`, or
/// `name_0.png`, `name_1.png`, ... for a batch) and the run report.
fn generate_batch(
    model: &Path,
    dir: &Path,
    name: &str,
    seed: u64,
    batch: usize,
    extra: &[&str],
) -> (Vec<Vec<u8>>, RunReport) {
    let (seed, batch_s) = (seed.to_string(), batch.to_string());
    let args = ["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "--sampling-method", "euler"];
    let args = [&args[..], &["-s", &seed, "-b", &batch_s, "--cfg-scale", "1", "-t", "2"]].concat();
    let out = dir.join(format!("{name}.png"));
    let report = run_checked_env(model, &out, &args, extra, &VK_ENV);
    let images = if batch == 1 {
        vec![pixels(&out)]
    } else {
        (0..batch).map(|i| pixels(&dir.join(format!("{name}_{i}.png")))).collect()
    };
    (images, report)
}

fn scratch(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sd-cli-vulkan-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn vulkan0_is_listed_with_the_memory_its_driver_reports() {
    let Some(d) = vulkan0("vulkan0_is_listed_with_the_memory_its_driver_reports") else { return };
    assert_eq!(d["type"], "gpu", "{d}");
    assert!(d["plugin"].as_str().unwrap().contains("libggml-vulkan"), "{d}");
    let (free, total) = (d["memory_free"].as_u64().unwrap(), d["memory_total"].as_u64().unwrap());
    assert!(total > 0 && free > 0 && free <= total, "free {free} of {total}: {d}");
    if d["description"].as_str().unwrap().contains("llvmpipe") {
        // lavapipe's one heap is the machine's memory (Mesa reads the same figure as
        // /proc/meminfo), and it reports VK_EXT_memory_budget: free is the budget less the
        // usage it measures, below the total.
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kb: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .unwrap()
            .trim()
            .trim_end_matches(" kB")
            .parse()
            .unwrap();
        assert_eq!(total, kb * 1024, "lavapipe's heap is the machine's memory: {d}");
        assert!(free < total, "free memory from VK_EXT_memory_budget, not the heap's size: {d}");
    }
}

#[test]
fn sd15_on_vulkan0_is_within_the_cross_kernel_bound_of_the_cpu_image() {
    let Some(_) = vulkan0("sd15_on_vulkan0_is_within_the_cross_kernel_bound_of_the_cpu_image") else { return };
    let model = sd15_fixture();
    let dir = scratch("image");
    let (cpu, _) = generate(&model, &dir, "cpu", &["--backend", "cpu"]);
    let (vk, report) = generate(&model, &dir, "vulkan", &["--backend", "Vulkan0"]);
    for runner in ["te", "unet", "vae"] {
        let r = report.runner(runner).unwrap_or_else(|| panic!("no {runner} runner: {:?}", report.runners));
        assert_eq!(r.device, "Vulkan0", "{runner} ran on Vulkan0: {r:?}");
    }
    let (mean, max) = level_diff(&vk, &cpu);
    eprintln!("Vulkan0 against the CPU: mean {mean:.3}, max {max} levels");
    assert!(mean <= MEAN_BOUND && max <= MAX_BOUND, "Vulkan0: mean {mean:.3}, max {max} levels from the CPU image");
    assert!(vk != cpu, "Vulkan0 gave the CPU's image bit for bit: did it run the CPU's kernels?");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn placements_that_move_only_weights_give_one_image_on_vulkan0() {
    let Some(_) = vulkan0("placements_that_move_only_weights_give_one_image_on_vulkan0") else { return };
    let model = sd15_fixture();
    let dir = scratch("placements");
    let (base, report) = generate(&model, &dir, "device", &["--backend", "Vulkan0"]);
    let unet = report.module("unet").expect("a unet module");
    assert_eq!((&unet.params, unet.residency), (&HomeReport::Compute, Residency::Resident));
    let budget = "Vulkan0=0.5"; // 512 MiB: under a third of the 1.6 GiB UNet
    let cases: [(&str, &[&str]); 4] = [
        ("params in RAM", &["--params-backend", "cpu"]),
        ("params on disk", &["--params-backend", "disk"]),
        ("segmented", &["--params-backend", "cpu", "--max-vram", budget]),
        ("segmented, no prefetch", &["--params-backend", "cpu", "--max-vram", budget, "--disable-prefetch"]),
    ];
    for (i, (what, flags)) in cases.into_iter().enumerate() {
        let args: Vec<&str> = ["--backend", "Vulkan0"].into_iter().chain(flags.iter().copied()).collect();
        let (px, report) = generate(&model, &dir, &i.to_string(), &args);
        assert!(px == base, "{what}: the image differs from Vulkan0's with its params on the device");
        let unet = report.module("unet").unwrap_or_else(|| panic!("{what}: no unet module"));
        let stats = &report.runner("unet").unwrap_or_else(|| panic!("{what}: no unet runner")).stats;
        match what {
            "params in RAM" => assert_eq!((&unet.params, unet.residency), (&HomeReport::Host, Residency::Staged)),
            "params on disk" => assert_eq!(unet.params, HomeReport::Disk, "{what}"),
            _ => {
                assert_eq!(unet.residency, Residency::Segmented, "{what}");
                assert!(stats.max_segments > 1, "{what}: {stats:?}");
                let vk = report.device("Vulkan0").unwrap_or_else(|| panic!("{what}: no Vulkan0 ledger"));
                assert_eq!(vk.budget_bytes, Some(512 << 20), "{what}: {vk:?}");
                if what == "segmented" {
                    assert!(stats.prefetched_groups > 0, "{what}: prefetch is on by default: {stats:?}");
                } else {
                    assert_eq!(stats.prefetched_groups, 0, "{what}: {stats:?}");
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `what`'s image within the cross-kernel bound of the CPU's.
fn assert_within_bound(what: &str, px: &[u8], cpu: &[u8]) {
    let (mean, max) = level_diff(px, cpu);
    eprintln!("{what}: mean {mean:.3}, max {max} levels from the CPU image");
    assert!(mean <= MEAN_BOUND && max <= MAX_BOUND, "{what}: mean {mean:.3}, max {max} levels from the CPU image");
}

/// The devices a runner's stages ran on.
fn stage_devices(report: &RunReport, runner: &str, what: &str) -> std::collections::BTreeSet<String> {
    let r = report.runner(runner).unwrap_or_else(|| panic!("{what}: no {runner} runner: {:?}", report.runners));
    r.stages.iter().map(|s| s.device.clone()).collect()
}

#[test]
fn placements_that_move_computation_to_another_kind_of_device_stay_within_the_bound() {
    let test = "placements_that_move_computation_to_another_kind_of_device_stay_within_the_bound";
    let Some(_) = vulkan0(test) else { return };
    let model = sd15_fixture();
    let dir = scratch("cross");
    let (cpu, _) = generate(&model, &dir, "cpu", &["--backend", "cpu"]);
    // The server's own process has no GGML_VK_VISIBLE_DEVICES: it serves its CPU.
    let server = Server::start();
    let rpc = server.endpoint.as_str();
    let cases: [(&str, Vec<&str>); 3] = [
        ("te and vae on the CPU", vec!["--backend", "diffusion=Vulkan0,te=cpu,vae=cpu"]),
        ("layer split Vulkan0&CPU", vec!["--backend", "diffusion=Vulkan0&CPU,te=cpu,vae=Vulkan0"]),
        ("Vulkan0 with an RPC server", vec!["--rpc", rpc, "--backend", "diffusion=Vulkan0&RPC0,te=RPC0,vae=Vulkan0"]),
    ];
    for (i, (what, flags)) in cases.into_iter().enumerate() {
        let (px, report) = generate(&model, &dir, &format!("cross{i}"), &flags);
        assert_within_bound(what, &px, &cpu);
        let device =
            |runner: &str| report.runner(runner).unwrap_or_else(|| panic!("{what}: no {runner}")).device.clone();
        match i {
            0 => assert_eq!([device("te"), device("unet"), device("vae")], ["CPU", "Vulkan0", "CPU"], "{what}"),
            _ => {
                let other = if i == 1 { "CPU" } else { "RPC0" };
                let ran = stage_devices(&report, "unet", what);
                assert!(ran.contains("Vulkan0") && ran.contains(other), "{what}: the UNet ran on {ran:?}");
                let unet = report.module("unet").unwrap_or_else(|| panic!("{what}: no unet module"));
                assert_eq!(unet.devices, ["Vulkan0", other], "{what}");
                assert_eq!(device("vae"), "Vulkan0", "{what}");
                let stats = &report.runner("unet").unwrap().stats;
                assert!(stats.cross_device_copies > 0, "{what}: {stats:?}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn pipeline_copies_give_each_image_of_a_batch_bit_for_bit_on_vulkan0() {
    let Some(_) = vulkan0("pipeline_copies_give_each_image_of_a_batch_bit_for_bit_on_vulkan0") else { return };
    let model = sd15_fixture();
    let dir = scratch("pipeline");
    // Without guidance the micro-batches are the batch's images, sampled in lockstep: a
    // micro-batch of one image runs the graph an image sampled alone runs (seed 42 + b).
    let split = ["--backend", "diffusion=Vulkan0&CPU,te=cpu,vae=cpu"];
    let alone: Vec<Vec<u8>> = [42, 43]
        .into_iter()
        .map(|seed| generate_batch(&model, &dir, &format!("alone{seed}"), seed, 1, &split).0.remove(0))
        .collect();
    assert!(alone[0] != alone[1], "two seeds, two images");
    let piped: Vec<&str> = split.iter().copied().chain(["--pipeline-copies", "2"]).collect();
    let (images, report) = generate_batch(&model, &dir, "piped", 42, 2, &piped);
    for (b, (px, want)) in images.iter().zip(&alone).enumerate() {
        assert!(px == want, "pipeline copies 2, image {b}: differs from the image sampled alone");
    }
    let s = &report.runner("unet").expect("a unet runner").stats;
    assert_eq!((s.pipelined_runs, s.runs), (1, 2), "the step pipelined, one image per micro-batch: {s:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn without_a_vulkan_driver_the_cpu_still_works_and_the_log_names_the_plugin() {
    let test = "without_a_vulkan_driver_the_cpu_still_works_and_the_log_names_the_plugin";
    let Some(vk) = vulkan0(test) else { return };
    let plugin = vk["plugin"].as_str().unwrap().to_string();
    let file = Path::new(&plugin).file_name().unwrap().to_string_lossy().into_owned();
    // The Vulkan loader finds no driver (both the old and the new variable's name).
    let missing = std::env::temp_dir().join(format!("sd-rs-no-such-icd-{}.json", std::process::id()));
    let missing = missing.to_str().unwrap();
    let no_driver = [("VK_ICD_FILENAMES", missing), ("VK_DRIVER_FILES", missing), ("NO_COLOR", "1")];
    let out = sd_cli().args(["--list-devices", "--json"]).envs(VK_ENV).envs(no_driver).output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "--list-devices without a driver failed:\n{log}");
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = list.as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"CPU") && !names.contains(&"Vulkan0"), "{names:?}");
    assert!(log.contains(&file), "the log names the plugin that gave no device ({file}):\n{log}");
    // Asking for Vulkan0 is an error naming the plugin that could not start, not a crash.
    let model = sd15_fixture();
    let dir = scratch("no-driver");
    let out = sd_cli()
        .arg("-m")
        .arg(&model)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "--backend", "Vulkan0", "-o"])
        .arg(dir.join("vk.png"))
        .envs(VK_ENV)
        .envs(no_driver)
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "bad input (exit status 2), not a crash:\n{log}");
    assert!(log.contains("Vulkan0") && log.contains(&file), "the error names the device and the plugin:\n{log}");
    // The CPU still runs.
    let args = ["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "--sampling-method", "euler", "-s", "42"];
    let env: Vec<(&str, &str)> = VK_ENV.iter().chain(&no_driver).copied().collect();
    let extra = ["--backend", "cpu", "--cfg-scale", "1", "-t", "2"];
    let report = run_checked_env(&model, &dir.join("cpu.png"), &args, &extra, &env);
    assert_eq!(report.runner("unet").map(|r| r.device.as_str()), Some("CPU"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_planner_budgets_vulkan0_from_the_free_memory_its_driver_reports() {
    let Some(vk) = vulkan0("the_planner_budgets_vulkan0_from_the_free_memory_its_driver_reports") else { return };
    let model = sd15_fixture();
    let dir = scratch("plan");
    let plan = |name: &str, extra: &[&str]| {
        let report = dir.join(format!("{name}.json"));
        let o = sd_cli()
            .arg("plan")
            .arg("-m")
            .arg(&model)
            .args(["--backend", "Vulkan0"])
            .args(extra)
            .arg("--report-json")
            .arg(&report)
            .envs(VK_ENV)
            .output()
            .unwrap();
        assert!(o.status.success(), "plan {extra:?}:\n{}", String::from_utf8_lossy(&o.stderr));
        let r = RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
        let plan = r.plan.expect("the plan");
        plan.devices.into_iter().find(|d| d.device == "Vulkan0").expect("Vulkan0 in the plan")
    };
    // No --max-vram: free memory less 512 MiB, free as the driver reports it now.
    let d = plan("default", &[]);
    let (free, total) = (d.free_bytes.expect("a free figure"), d.total_bytes.expect("a total"));
    assert_eq!(Some(total), vk["memory_total"].as_u64(), "{d:?}");
    assert!(0 < free && free <= total, "{d:?}");
    assert_eq!((d.budget_rule, d.budget_bytes), (BudgetRule::FreeMinusMargin, Some(free - (512 << 20))), "{d:?}");
    assert!(d.fits && d.used_bytes > 0, "the SD 1.5 fixture fits lavapipe's memory: {d:?}");
    // --max-vram 0: the free memory itself.
    let d = plan("free", &["--max-vram", "Vulkan0=0"]);
    assert_eq!((d.budget_rule, d.budget_bytes), (BudgetRule::Free, d.free_bytes), "{d:?}");
    std::fs::remove_dir_all(&dir).ok();
}
