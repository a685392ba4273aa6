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

use common::{level_diff, pixels, run_checked_env, sd15_fixture, sd_cli};
use sd_models::report::{HomeReport, Residency, RunReport};

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
    let args = ["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "--sampling-method", "euler"];
    let args = [&args[..], &["-s", "42", "--cfg-scale", "1", "-t", "2"]].concat();
    let out = dir.join(format!("{name}.png"));
    let report = run_checked_env(model, &out, &args, extra, &VK_ENV);
    (pixels(&out), report)
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
