//! FLUX.1 end to end from the component files the reference takes (`--diffusion-model`,
//! `--clip_l`, `--t5xxl`, `--vae`), on fixtures: a reduced DiT (width 256, 2 double and 2 single
//! blocks), T5-XXL cut to 2 blocks (the reference needs all 24, 4.8 GB at q8_0, so the parity
//! with it is a manual check: docs/models.md), the full-size FLUX VAE, a TAEF1 fixture and the
//! SD 1.5 fixture's CLIP-L; and a schnell DiT at q8_0 in GGUF, with BFL's and ComfyUI's names.
//! What is asserted here is behaviour: determinism, the prompt, `--guidance`, `--flow-shift`,
//! `--cfg-scale`, the sampler, `--taesd` and the init image reaching the image, the placements
//! (params in RAM or on disk, segmented under budgets, layer and row splits) giving the all-CPU
//! image, `plan` from the headers, clear errors.
//!
//! Z-Image (the other 16-channel DiT family, on FLUX's VAE) at the end: a reduced DiT and a
//! 2-layer Qwen3 `--llm` generate deterministically, read the prompt, plan from the headers, run
//! segmented on an RPC server under a budget, and refuse to run without `--llm` or `--vae`
//! (the parity with the reference on these files: `cargo xtask parity zimage`).
//!
//! SD3 (the MMDiT, here without its CLIPs) at the very end: it generates deterministically,
//! reads the prompt, the negative prompt, `--flow-shift` and LoRAs in three layouts, plans, refuses files without text
//! encoders or VAE, and runs segmented under a budget and layer-split with the all-CPU image.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{png_pixels as pixels, sd15_fixture, sd_cli, write_init_png};
use sd_models::fixture::{self, flux, flux_vae, t5, taesd, FileFormat, WeightType};
use sd_models::report::{HomeReport, Residency, RunReport};
use sd_models::text::t5::T5Config;

/// The component files, written once per process into the fixture cache.
struct Files {
    dit: PathBuf,
    t5: PathBuf,
    vae: PathBuf,
    clip_l: PathBuf,
}

fn files() -> &'static Files {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let cfg = flux::reduced(256, 2, 2, false);
        let dit = flux::cached_flux_path(&cfg, 42, WeightType::F16);
        if !dit.exists() {
            flux::write_flux(&dit, &cfg, 42, WeightType::F16, FileFormat::Safetensors).unwrap();
        }
        let t5_cfg = T5Config { n_layers: 2, ..T5Config::xxl() };
        let t5_path = t5::cached_t5xxl_path(2, 42, WeightType::Q8_0);
        if !t5_path.exists() {
            t5::write_t5xxl(&t5_path, &t5_cfg, 42, WeightType::Q8_0, FileFormat::Gguf).unwrap();
        }
        let vae = flux_vae::cached_flux_vae_path(42, WeightType::F16);
        if !vae.exists() {
            flux_vae::write_flux_vae(&vae, 42, WeightType::F16, FileFormat::Safetensors).unwrap();
        }
        Files { dit, t5: t5_path, vae, clip_l: sd15_fixture() }
    })
}

/// The tiny-autoencoder fixture of `z_channels` latent channels (16: TAEF1), written once.
fn taesd_file(z_channels: usize) -> PathBuf {
    let path = taesd::cached_taesd_path(z_channels, 42, WeightType::F16);
    if !path.exists() {
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        taesd::write_taesd(&path, z_channels, 42, WeightType::F16, FileFormat::Safetensors).unwrap();
    }
    path
}

/// Runs a 64x64 FLUX generation (2 steps unless `extra` says) into `dir/name.png` (`extra` gives
/// the prompt and the cfg scale); returns the image's pixels (None on failure; pixels, not the
/// PNG's bytes, whose parameters differ with the prompt), the run report and stderr.
fn run(dir: &Path, name: &str, extra: &[&str]) -> (Option<Vec<u8>>, Option<RunReport>, String) {
    run_dit(&files().dit, dir, name, extra)
}

/// [`run`] with another diffusion model.
fn run_dit(dit: &Path, dir: &Path, name: &str, extra: &[&str]) -> (Option<Vec<u8>>, Option<RunReport>, String) {
    run_with(dit, &files().t5, dir, name, extra)
}

/// [`run`] with another diffusion model and T5-XXL file.
fn run_with(
    dit: &Path,
    t5: &Path,
    dir: &Path,
    name: &str,
    extra: &[&str],
) -> (Option<Vec<u8>>, Option<RunReport>, String) {
    let f = files();
    let out = dir.join(format!("{name}.png"));
    let report = dir.join(format!("{name}.json"));
    // The CPU's extra buffer types off unless a test asks (the flag wins over the variable):
    // on a CPU with AMX the q8_0 T5 on the CPU would go through ggml's AMX kernels, whose
    // sums round otherwise than the plain kernels every RPC device and staged placement uses,
    // and the placement tests compare images bit for bit.
    let o = sd_cli()
        .env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off")
        .arg("--diffusion-model")
        .arg(dit)
        .arg("--clip_l")
        .arg(&f.clip_l)
        .arg("--t5xxl")
        .arg(t5)
        .arg("--vae")
        .arg(&f.vae)
        .args(["-W", "64", "-H", "64", "-s", "7"])
        .args(if extra.contains(&"--steps") { &[][..] } else { &["--steps", "2"][..] })
        .args(extra)
        .arg("-o")
        .arg(&out)
        .arg("--report-json")
        .arg(&report)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    // A batch writes `name_0.png`, ...: its caller reads them (empty here).
    let png = o.status.success().then(|| std::fs::read(&out).map(|b| pixels(&b)).unwrap_or_default());
    let report = std::fs::read_to_string(&report).ok().and_then(|s| RunReport::from_json(&s).ok());
    (png, report, stderr)
}

/// A schnell DiT (no guidance input; width 256, 2 double and 2 single blocks) at q8_0 in GGUF,
/// twice from one seed: with BFL's bare names, and behind ComfyUI's `model.diffusion_model.`
/// prefix (the common GGUF conversions' layout). Written once per process.
fn schnell() -> &'static (PathBuf, PathBuf) {
    static FILES: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    FILES.get_or_init(|| {
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let cfg = flux::reduced(256, 2, 2, true);
        let bare = flux::cached_flux_path(&cfg, 42, WeightType::Q8_0);
        let name = bare.file_name().unwrap().to_string_lossy();
        let comfy = bare.with_file_name(format!("comfyui-{name}"));
        for (path, prefix) in [(&bare, ""), (&comfy, "model.diffusion_model.")] {
            if !path.exists() {
                flux::write_flux_named(path, &cfg, 42, WeightType::Q8_0, FileFormat::Gguf, prefix).unwrap();
            }
        }
        (bare, comfy)
    })
}

/// The prompt and cfg scale of the placement tests.
const PLACED: [&str; 4] = ["-p", "a photo of a cat", "--cfg-scale", "1"];

/// The all-CPU image of [`PLACED`] every placement must give, generated once per process.
fn cpu_image() -> &'static [u8] {
    static PNG: OnceLock<Vec<u8>> = OnceLock::new();
    PNG.get_or_init(|| {
        let d = dir("cpu");
        let (png, _, err) = run(&d, "cpu", &[&PLACED[..], &["--backend", "cpu"]].concat());
        let _ = std::fs::remove_dir_all(&d);
        png.unwrap_or_else(|| panic!("{err}"))
    })
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-flux-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn flux_is_deterministic_and_reads_the_prompt_and_the_guidance() {
    let d = dir("gen");
    const CAT: [&str; 4] = ["-p", "a photo of a cat", "--cfg-scale", "1"];
    let with = |more: &[&'static str]| [&CAT[..], more].concat();
    let (a, report, err) = run(&d, "a", &CAT);
    let a = a.unwrap_or_else(|| panic!("FLUX generation failed:\n{err}"));
    assert!(err.contains("model: flux") && err.contains("flow matching"), "{err}");
    let report = report.expect("a run report");
    // One step time per sampling step.
    assert_eq!(report.steps.len(), 2, "{:?}", report.steps);
    // The same seed gives the same image, and FLUX's default cfg scale is 1 (its guidance is
    // distilled): no `--cfg-scale` runs as `--cfg-scale 1`.
    let (again, again_report, err) = run(&d, "again", &["-p", "a photo of a cat"]);
    assert!(again.as_ref() == Some(&a), "without --cfg-scale: another image than with 1:\n{err}");
    assert_eq!(again_report.and_then(|r| r.settings).map(|s| s.cfg_scale), Some(1.0));
    let (dog, _, err) = run(&d, "dog", &["-p", "a photo of a dog", "--cfg-scale", "1"]);
    assert!(dog.is_some_and(|p| p != a), "the prompt reaches the image (through T5 and CLIP-L): {err}");
    let (g1, _, err) = run(&d, "g1", &with(&["--guidance", "1.0"]));
    assert!(g1.is_some_and(|p| p != a), "--guidance reaches the image: {err}");
    // cfg above 1 runs the negative prompt too: two evaluations per step, another image.
    let (cfg, _, err) = run(&d, "cfg", &["-p", "a photo of a cat", "--cfg-scale", "2"]);
    assert!(cfg.is_some_and(|p| p != a), "{err}");
    // TAEF1 decodes instead of the VAE: another image.
    let taef1 = taesd_file(16).display().to_string();
    let (tae, _, err) = run(&d, "taef1", &[&CAT[..], &["--taesd", taef1.as_str()]].concat());
    assert!(tae.is_some_and(|p| p != a), "{err}");
    // A sampler with a flow variant of its own (er_sde's flow lambdas) runs on FLUX.
    let (er, _, err) = run(&d, "er_sde", &with(&["--sampling-method", "er_sde"]));
    assert!(er.is_some_and(|p| p != a), "{err}");
    // The CPU's extra buffer types (AMX for the q8_0 T5 on a CPU that has it, else nothing
    // takes that type here) give the same image within the parity bound.
    let (on, _, err) = run(&d, "extra-on", &with(&["--cpu-extra-bufts", "on"]));
    let (mean, max) = level_diff(&on.unwrap_or_else(|| panic!("{err}")), &a);
    assert!(mean <= 1.0 && max <= 8, "--cpu-extra-bufts on vs off: mean {mean:.3}, max {max}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux_bad_inputs_are_clear_errors() {
    let d = dir("bad");
    // SD's 4-channel TAESD given for FLUX's 16 channels: named, before any text encoding.
    let taesd = taesd_file(4).display().to_string();
    let (png, _, err) = run(&d, "taesd", &["-p", "a cat", "--taesd", &taesd]);
    assert!(png.is_none() && err.contains("decoder.layers.0.weight"), "{err}");
    assert!(!err.contains("text encode took"), "validated first: {err}");
    // Without T5 the prompt would be ignored: refused, naming the flag.
    let f = files();
    let o = sd_cli()
        .arg("--diffusion-model")
        .arg(&f.dit)
        .arg("--clip_l")
        .arg(&f.clip_l)
        .arg("--vae")
        .arg(&f.vae)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "-o"])
        .arg(d.join("no-t5.png"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(2) && err.contains("T5-XXL") && err.contains("--t5xxl"), "{err}");
    assert!(!d.join("no-t5.png").exists());
    // Without CLIP-L it runs (the pooled vector is zeros, as in the reference), saying so and
    // naming the flag that gives the encoder.
    let o = sd_cli()
        .arg("--diffusion-model")
        .arg(&f.dit)
        .arg("--t5xxl")
        .arg(&f.t5)
        .arg("--vae")
        .arg(&f.vae)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "-o"])
        .arg(d.join("no-clip.png"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && d.join("no-clip.png").exists(), "{err}");
    assert!(err.contains("no CLIP-L text encoder") && err.contains("give it with --clip_l"), "{err}");
    // A guidance that is not a number is named.
    let (png, _, err) = run(&d, "nan", &["-p", "a cat", "--guidance", "nan"]);
    assert!(png.is_none() && err.contains("guidance"), "{err}");
    let (png, _, err) = run(&d, "shift-nan", &["-p", "a cat", "--flow-shift", "nan"]);
    assert!(png.is_none() && err.contains("--flow-shift"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux_splits_over_two_rpc_servers_give_the_cpu_image() {
    // The DiT's blocks (double then single) and T5's layers are the blocks a layer split cuts;
    // the DiT's block matmuls are what a row split cuts, and for te CLIP-L's and T5's layer
    // matmuls. Same kernels on every device, so the same image bit for bit.
    let d = dir("split");
    let base = cpu_image();
    let (a, b) = (common::Server::start(), common::Server::start());
    let rpc = format!("{},{}", a.endpoint, b.endpoint);
    let cases: [(&str, &[&str]); 3] = [
        ("layer", &["--backend", "diffusion=RPC0&RPC1,te=RPC0&RPC1,vae=cpu"]),
        ("row", &["--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--split-mode", "row"]),
        ("te row", &["--backend", "te=RPC0&RPC1,diffusion=cpu,vae=cpu", "--split-mode", "te=row"]),
    ];
    for (name, placement) in cases {
        let args = [&PLACED[..], &["--rpc", rpc.as_str()], placement].concat();
        let (png, report, err) = run(&d, name, &args);
        assert!(png.as_deref() == Some(base), "{name} split: the image differs from the CPU one:\n{err}");
        let report = report.unwrap();
        let split = if name == "te row" { "te" } else { "unet" };
        let module = report.module(split).unwrap();
        assert_eq!(module.devices, ["RPC0", "RPC1"], "{name}: {module:?}");
        let runner = report.runner(split).unwrap();
        assert!(runner.stats.cross_device_bytes > 0, "{name}: {:?}", runner.stats);
        if name == "layer" {
            assert_eq!(report.module("te").unwrap().devices, ["RPC0", "RPC1"], "T5's layers are split too");
        }
        if name == "te row" {
            // Both encoders' layer matmuls are cut: CLIP-L's 12 layers of 6, T5's 2 blocks of 7.
            let cut = &module.row_split_weights;
            let t5 = cut.iter().filter(|n| n.starts_with("text_encoders.t5xxl.")).count();
            let clip = cut.iter().filter(|n| n.starts_with("cond_stage_model.")).count();
            assert_eq!((clip, t5, cut.len()), (12 * 6, 2 * 7, 12 * 6 + 2 * 7), "{cut:?}");
            assert!(cut.iter().any(|n| n.ends_with("block.1.layer.1.DenseReluDense.wo.weight")), "{cut:?}");
        }
    }

    // Pipeline copies over a batch's images: FLUX runs at cfg 1 (one pass per step), so the
    // micro-batches a split overlaps are the images, sampled in lockstep; each sample is still a
    // graph of its own, so every image is the one sampled alone on the CPU, bit for bit.
    let batch = |name: &str, extra: &[&str]| -> (Vec<Vec<u8>>, RunReport) {
        let args = [&PLACED[..], &["-b", "2"], extra].concat();
        let (_, report, err) = run(&d, name, &args);
        let report = report.unwrap_or_else(|| panic!("{name}: {err}"));
        let png = |i: usize| {
            pixels(&std::fs::read(d.join(format!("{name}_{i}.png"))).unwrap_or_else(|e| panic!("{name}: {e}\n{err}")))
        };
        (vec![png(0), png(1)], report)
    };
    let (alone, _) = batch("cpu-b2", &["--backend", "cpu"]);
    assert!(alone[0] != alone[1], "two seeds, two images");
    let split = ["--rpc", rpc.as_str(), "--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--pipeline-copies", "2"];
    let (piped, report) = batch("copies2-b2", &split);
    assert!(piped == alone, "copies 2 over a batch of two: the images differ from those sampled alone");
    let s = &report.runner("unet").unwrap().stats;
    assert_eq!((s.pipelined_runs, s.runs), (2, 4), "both steps pipelined, one sample per micro-batch: {s:?}");
    assert!(s.pipeline_busy_secs > 0.0 && s.pipeline_wall_secs > 0.0, "{s:?}");
    let steps: Vec<(usize, usize)> = report.steps.iter().map(|t| (t.image, t.step)).collect();
    assert_eq!(steps.len(), 4, "every image reported at every step: {steps:?}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux_params_in_ram_or_on_disk_segmented_under_budgets_give_the_cpu_image() {
    // The placement harness on FLUX (placement.rs runs it on SD 1.5): the DiT computes on one
    // RPC server under a budget below its 16.9 MB of weights, so it runs in segments (its
    // block cuts, with prefetch), its params in RAM or re-read from disk; T5 and CLIP-L compute
    // on the other server from disk under a budget below T5's two blocks, one layer at a time.
    let d = dir("homes");
    let base = cpu_image();
    let (a, b) = (common::Server::start(), common::Server::start());
    let rpc = format!("{},{}", a.endpoint, b.endpoint);
    // 16 MiB for the DiT; 352 MiB for the text encoders (T5's blocks are 205 MB each at q8_0).
    let budgets = "RPC0=0.015625,RPC1=0.34375";
    let cases: [(&str, &[&str]); 2] = [
        (
            "dit params in RAM, te params on disk",
            &["--backend", "diffusion=RPC0,te=RPC1,vae=cpu", "--params-backend", "diffusion=cpu,te=disk,vae=cpu"],
        ),
        ("dit params on disk", &["--backend", "diffusion=RPC0,te=cpu,vae=cpu", "--params-backend", "diffusion=disk"]),
    ];
    for (name, placement) in cases {
        let args = [&PLACED[..], &["--rpc", rpc.as_str(), "--max-vram", budgets], placement].concat();
        let (png, report, err) = run(&d, name, &args);
        assert!(png.as_deref() == Some(base), "{name}: the image differs from the CPU one:\n{err}");
        let report = report.unwrap();
        for dev in &report.devices {
            if let Some(budget) = dev.budget_bytes {
                assert!(dev.high_water_bytes <= budget, "{name}: {dev:?} above its budget");
            }
        }
        let unet = report.module("unet").unwrap();
        let s = &report.runner("unet").unwrap().stats;
        assert_eq!((unet.devices.as_slice(), unet.residency), (&["RPC0".to_string()][..], Residency::Segmented));
        assert!(s.segmented_runs == 2 && s.max_segments > 1, "{name}: both steps in segments: {s:?}");
        assert!(s.prefetched_groups > 0 && s.prefetches_used == s.prefetched_groups, "{name}: {s:?}");
        assert!(report.device("RPC0").unwrap().high_water_bytes > 0, "{name}");
        if name == "dit params on disk" {
            assert_eq!(unet.params, HomeReport::Disk, "{name}");
            continue;
        }
        assert_eq!(unet.params, HomeReport::Host, "{name}");
        let te = report.module("te").unwrap();
        let ts = &report.runner("te").unwrap().stats;
        assert_eq!((te.devices.as_slice(), &te.params), (&["RPC1".to_string()][..], &HomeReport::Disk), "{te:?}");
        assert_eq!(te.residency, Residency::Segmented, "{name}: {ts:?}");
        // T5's prelude, its two blocks and the final norm: more than two segments per encode.
        assert!(ts.max_segments > 2 && ts.evictions > 0, "{name}: {ts:?}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux_schnell_gguf_runs_without_guidance_and_reads_comfyui_names() {
    let d = dir("schnell");
    let (bfl, comfy) = schnell();
    const CAT: [&str; 4] = ["-p", "a photo of a cat", "--cfg-scale", "1"];
    let (a, report, err) = run_dit(bfl, &d, "a", &CAT);
    let a = a.unwrap_or_else(|| panic!("FLUX schnell generation failed:\n{err}"));
    let report = report.expect("a run report");
    assert_eq!(report.steps.len(), 2, "{:?}", report.steps);
    let (dog, _, err) = run_dit(bfl, &d, "dog", &["-p", "a photo of a dog", "--cfg-scale", "1"]);
    assert!(dog.is_some_and(|p| p != a), "the prompt reaches the image: {err}");
    // --flow-shift replaces schnell's mu of 1.0.
    let (shift, _, err) = run_dit(bfl, &d, "shift", &[&CAT[..], &["--flow-shift", "3"]].concat());
    assert!(shift.is_some_and(|p| p != a), "--flow-shift reaches the schedule: {err}");
    // The same weights behind ComfyUI's prefix load as the same model, and schnell has no
    // guidance input, so --guidance changes nothing (the reference ignores it too): another
    // process, the same image bit for bit.
    let (c, _, err) = run_dit(comfy, &d, "comfy", &[&CAT[..], &["--guidance", "1.0"]].concat());
    let c = c.unwrap_or_else(|| panic!("{err}"));
    assert!(c == a, "ComfyUI's names with --guidance 1 give BFL's image at 3.5: {err}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux_plan_sizes_every_module_from_the_headers_and_checks_memory() {
    // `sd-cli plan` reads headers only: the DiT, T5-XXL, CLIP-L and the VAE are each sized from
    // their files, T5's layers are te's blocks (a te layer split gets ranges over them), and
    // the memory check's estimate is the four files' sizes x 1.25 + 512 MiB.
    let f = files();
    let d = dir("plan");
    let size = |p: &Path| std::fs::metadata(p).unwrap().len();
    let (dit, t5, vae, clip) = (size(&f.dit), size(&f.t5), size(&f.vae), size(&f.clip_l));
    let plan = |name: &str, gpu_mib: u64, ram_mib: u64| {
        let profile = d.join(format!("{name}.toml"));
        let gpu = format!("type = \"gpu\"\nfree_mib = {gpu_mib}\ntotal_mib = {gpu_mib}\n");
        let toml = format!(
            "ram_available_mib = {ram_mib}\n[[device]]\nname = \"CUDA0\"\n{gpu}[[device]]\nname = \"CUDA1\"\n{gpu}"
        );
        std::fs::write(&profile, toml).unwrap();
        let report = d.join(format!("{name}.json"));
        let o = sd_cli()
            .arg("plan")
            .arg("--diffusion-model")
            .arg(&f.dit)
            .arg("--clip_l")
            .arg(&f.clip_l)
            .arg("--t5xxl")
            .arg(&f.t5)
            .arg("--vae")
            .arg(&f.vae)
            .args(["--backend", "diffusion=CUDA0,te=CUDA0&CUDA1,vae=CUDA0", "--devices"])
            .arg(&profile)
            .arg("--report-json")
            .arg(&report)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        let text = std::fs::read_to_string(&report).unwrap_or_else(|e| panic!("{name}: {e}:\n{err}"));
        (o.status.code(), RunReport::from_json(&text).unwrap().plan.expect("the plan"), err)
    };
    let (code, p, err) = plan("roomy", 8192, 65536);
    assert_eq!(code, Some(0), "{err}");
    let module = |m: &str| p.modules.iter().find(|x| x.module.name() == m).unwrap_or_else(|| panic!("{m}: {p:?}"));
    // Tensor bytes are the files less their headers (a few KiB here).
    let near = |bytes: u64, file: u64| bytes <= file && bytes + (1 << 20) > file;
    assert!(near(module("diffusion").param_bytes, dit), "{:?} vs {dit}", module("diffusion"));
    assert!(near(module("vae").param_bytes, vae), "{:?} vs {vae}", module("vae"));
    // te: all of T5 and CLIP-L's share of the SD 1.5 checkpoint it comes from.
    let te = module("te");
    assert!(te.param_bytes > t5 && te.param_bytes < t5 + clip, "{te:?}: T5 {t5}, the CLIP-L file {clip}");
    let ranges: Vec<(u32, u32)> = te.split.iter().map(|r| (r.first_block, r.last_block)).collect();
    assert_eq!(ranges, [(0, 0), (1, 1)], "T5's two layers over the two devices: {te:?}");
    let total = dit + t5 + vae + clip;
    assert_eq!(p.memory_check.estimate_bytes, total * 5 / 4 + (512 << 20), "{:?}", p.memory_check);
    assert_eq!(p.memory_check.verdict, sd_placement::Verdict::Ok, "{:?}", p.memory_check);
    // Below the estimate in GPUs and RAM together: refused before anything loads.
    let (code, p, err) = plan("tight", 512, 256);
    assert_eq!((code, p.fits), (Some(1), false), "{err}");
    assert_eq!(p.memory_check.verdict, sd_placement::Verdict::Refuse, "{:?}", p.memory_check);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn flux_img2img_is_deterministic_and_reads_its_init_image_and_references() {
    // The init image is encoded by the FLUX VAE and noised the flow way (`(1 - sigma) x +
    // sigma noise`) at the first sigma the strength keeps: of 3 steps, strength 0.5 keeps the last
    // 2, from the schedule's second sigma. (With 2 steps it would keep both, from sigma 1, where
    // the init image has no weight: the reference's rule, so that run ignores the image there too.)
    let d = dir("img2img");
    let (init_a, init_b) = (d.join("init-a.png"), d.join("init-b.png"));
    write_init_png(&init_a, false);
    write_init_png(&init_b, true);
    let args = |init: &Path| {
        let init = init.to_str().unwrap().to_string();
        ["-p", "a cat", "--cfg-scale", "1", "--steps", "3", "-i", init.as_str(), "--strength", "0.5"].map(String::from)
    };
    let run_i2i = |name: &str, init: &Path| {
        let a = args(init);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        run(&d, name, &a)
    };
    let (a, report, err) = run_i2i("a", &init_a);
    let a = a.unwrap_or_else(|| panic!("FLUX img2img failed:\n{err}"));
    let report = report.unwrap();
    assert_eq!(report.settings.as_ref().and_then(|s| s.strength), Some(0.5), "{:?}", report.settings);
    assert_eq!(report.steps.len(), 2, "{:?}", report.steps);
    let (again, _, _) = run_i2i("again", &init_a);
    assert!(again.as_ref() == Some(&a), "the same seed and init give the same image");
    let (b, _, err) = run_i2i("b", &init_b);
    assert!(b.is_some_and(|p| p != a), "the init image reaches the result: {err}");
    // A reference image (FLUX.1 Kontext's edits, -r): it reaches the image, the same each time,
    // and its order beside a second one counts.
    let with_flags = |name: &str, refs: &[&Path], flags: &[&str]| {
        let mut a: Vec<String> = args(&init_a).into();
        for r in refs {
            a.extend(["-r".to_string(), r.to_str().unwrap().to_string()]);
        }
        a.extend(flags.iter().map(|f| f.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let (png, _, err) = run(&d, name, &a);
        png.unwrap_or_else(|| panic!("{name}: {err}"))
    };
    let with = |name: &str, refs: &[&Path]| with_flags(name, refs, &[]);
    let r = with("ref-b", &[&init_b]);
    assert!(r != a && with("ref-b-again", &[&init_b]) == r, "a reference reaches the image, the same each time");
    let ab = with("refs-ab", &[&init_a, &init_b]);
    assert!(ab != with("refs-ba", &[&init_b, &init_a]), "their order counts");
    // --increase-ref-index: one reference is read as before (index 1, no offset); a second
    // moves from beside the first to an index of its own.
    let increase = ["--increase-ref-index"];
    assert!(with_flags("ref-b-inc", &[&init_b], &increase) == r, "one reference, the same image");
    assert!(with_flags("refs-ab-inc", &[&init_a, &init_b], &increase) != ab, "--increase-ref-index ignored");
    let _ = std::fs::remove_dir_all(&d);
}

use common::level_diff;

#[test]
fn flux_loras_apply_in_every_layout_and_mode() {
    use sd_models::fixture::lora::{write_flux_lora, LoraFixture, LoraLayout};
    let d = dir("lora");
    let cfg = flux::reduced(256, 2, 2, false);
    let lora = |layout, seed, text_encoder| LoraFixture { layout, rank: 4, seed, scale: 0.05, text_encoder };
    // One set of values in kohya's and BFL's dotted layouts (kohya's alpha = rank / 2 halves
    // the scale), another in diffusers' (fused weights adapted per row block).
    write_flux_lora(&d.join("kohya.safetensors"), &cfg, &lora(LoraLayout::Kohya, 1, true)).unwrap();
    write_flux_lora(&d.join("peft.safetensors"), &cfg, &lora(LoraLayout::Peft, 1, true)).unwrap();
    write_flux_lora(&d.join("diffusers.safetensors"), &cfg, &lora(LoraLayout::Diffusers, 2, false)).unwrap();
    let base = cpu_image();
    let dir_arg = d.display().to_string();
    let gen = |name: &str, prompt: &str, more: &[&str]| -> Vec<u8> {
        let args = [&["-p", prompt, "--cfg-scale", "1", "--backend", "cpu", "--lora-model-dir", &dir_arg][..], more];
        let (png, _, err) = run(&d, name, &args.concat());
        png.unwrap_or_else(|| panic!("{name}: {err}"))
    };
    // diffusers' split q/k/v (and a single block's proj_mlp) adapt row blocks of the fused
    // weights, merged or in the graph (an `up` padded with zeros), with params on disk too.
    let diffusers = check_lora_layouts(&gen, base);
    // Params on disk, merged at each staging (auto would add them in the graph there): the
    // same image as on the device, bit for bit.
    let disk = ["--params-backend", "disk", "--lora-apply-mode", "immediately"];
    assert!(gen("diffusers-disk", "a photo of a cat<lora:diffusers:1>", &disk) == diffusers, "params on disk");
    // T5's adapters alone (the kohya file's `lora_te3_` keys) reach the image merged (the q8_0
    // weights dequantized, merged and requantized) and in the graph (T5's linear layers).
    subset(&d.join("kohya.safetensors"), &d.join("t5only.safetensors"), "lora_te3_");
    let merged = gen("t5-merged", "a photo of a cat<lora:t5only:1>", &["--lora-apply-mode", "immediately"]);
    let graph = gen("t5-rt", "a photo of a cat<lora:t5only:1>", &["--lora-apply-mode", "at_runtime"]);
    assert!(merged != base && graph != base, "T5's adapters reach the image");
    let (mean, max) = level_diff(&graph, &merged);
    assert!(mean <= 1.0 && max <= 8, "T5 adapters at_runtime vs immediately: mean {mean:.3}, max {max}");
    eprintln!(
        "T5 LoRA: {:.3} mean level change merged; at_runtime vs merged mean {mean:.3}, max {max}",
        level_diff(&merged, base).0
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// The LoRA files `kohya`, `peft` (the same values, dotted names, no alpha) and `diffusers`
/// (other values, split projections) in the lora directory `gen` (name, prompt, extra flags →
/// pixels) generates with: each reaches the image, kohya's at 1 is the dotted one's at 0.5
/// (kohya's alpha = rank / 2) bit for bit, multiplier 0 is no LoRA, and in the graph
/// (`at_runtime`) equals merged within rounding. Returns the merged diffusers image.
fn check_lora_layouts(gen: &impl Fn(&str, &str, &[&str]) -> Vec<u8>, base: &[u8]) -> Vec<u8> {
    let kohya = gen("kohya", "a photo of a cat<lora:kohya:1>", &[]);
    assert!(kohya != base, "the kohya LoRA reaches the image");
    assert!(gen("zero", "a photo of a cat<lora:kohya:0>", &[]) == base, "multiplier 0 changed the image");
    assert!(gen("peft", "a photo of a cat<lora:peft:0.5>", &[]) == kohya, "kohya and dotted layouts differ");
    let rt = gen("kohya-rt", "a photo of a cat<lora:kohya:1>", &["--lora-apply-mode", "at_runtime"]);
    let (mean, max) = level_diff(&rt, &kohya);
    assert!(mean <= 1.0 && max <= 8, "at_runtime vs immediately: mean {mean:.3}, max {max}");
    let diffusers = gen("diffusers", "a photo of a cat<lora:diffusers:1>", &[]);
    assert!(diffusers != base && diffusers != kohya, "the diffusers LoRA reaches the image");
    let drt = gen("diffusers-rt", "a photo of a cat<lora:diffusers:1>", &["--lora-apply-mode", "at_runtime"]);
    let (mean, max) = level_diff(&drt, &diffusers);
    assert!(mean <= 1.0 && max <= 8, "diffusers at_runtime vs immediately: mean {mean:.3}, max {max}");
    diffusers
}

/// Writes the tensors of the safetensors file `from` whose names start with `prefix` to `to`.
fn subset(from: &Path, to: &Path, prefix: &str) {
    use sd_models::files::safetensors::{parse, to_bytes, HeaderEntry};
    let bytes = std::fs::read(from).unwrap();
    let header = parse(&bytes).unwrap();
    let kept: Vec<(HeaderEntry<'_>, &[u8])> = header
        .tensors
        .iter()
        .filter(|t| t.name.starts_with(prefix))
        .map(|t| {
            let entry = HeaderEntry { name: &t.name, dtype: t.dtype, shape: &t.shape };
            (entry, &bytes[t.offset as usize..(t.offset + t.len) as usize])
        })
        .collect();
    assert!(!kept.is_empty(), "no tensor of {} starts with {prefix}", from.display());
    std::fs::write(to, to_bytes(&kept, &header.metadata).unwrap()).unwrap();
}

#[test]
fn flux_reads_an_fp8_e4m3_t5_as_its_f16_values() {
    // The fp8 T5-XXL files people download store F8_E4M3; the reference widens them to f16 at
    // load. A one-block e4m3 T5 and the same values stored as f16 give the same image bit for
    // bit, and the plan counts the widened bytes (f16), not the file's.
    std::fs::create_dir_all(fixture::cache_dir()).unwrap();
    let cfg = T5Config { n_layers: 1, ..T5Config::xxl() };
    let e4m3 = t5::cached_t5xxl_path(1, 42, WeightType::F8E4M3);
    if !e4m3.exists() {
        t5::write_t5xxl(&e4m3, &cfg, 42, WeightType::F8E4M3, FileFormat::Safetensors).unwrap();
    }
    let d = dir("fp8");
    let widened = d.join("t5-widened-f16.safetensors");
    {
        use sd_models::files::safetensors::{parse, to_bytes, HeaderEntry};
        use sd_models::files::DType;
        let bytes = std::fs::read(&e4m3).unwrap();
        let header = parse(&bytes).unwrap();
        assert!(header.tensors.iter().all(|t| t.dtype == DType::F8_E4M3), "the fixture stores every tensor as e4m3");
        let data: Vec<Vec<u8>> = header
            .tensors
            .iter()
            .map(|t| {
                let stored = &bytes[t.offset as usize..(t.offset + t.len) as usize];
                sd_models::files::f8::widen_to_f16(DType::F8_E4M3, stored).unwrap()
            })
            .collect();
        let kept: Vec<(HeaderEntry<'_>, &[u8])> = header
            .tensors
            .iter()
            .zip(&data)
            .map(|(t, v)| (HeaderEntry { name: &t.name, dtype: DType::F16, shape: &t.shape }, &v[..]))
            .collect();
        std::fs::write(&widened, to_bytes(&kept, &header.metadata).unwrap()).unwrap();
    }
    let dit = &files().dit;
    let (a, ra, err) = run_with(dit, &e4m3, &d, "e4m3", &PLACED);
    let a = a.unwrap_or_else(|| panic!("{err}"));
    let (b, rb, err) = run_with(dit, &widened, &d, "f16", &PLACED);
    let b = b.unwrap_or_else(|| panic!("{err}"));
    assert!(a == b, "the e4m3 T5 and its f16 values give different images");
    let te = |r: Option<RunReport>| {
        let plan = r.expect("report").plan.expect("plan");
        plan.modules.iter().find(|m| m.module.name() == "te").unwrap().param_bytes
    };
    let (te_a, te_b) = (te(ra), te(rb));
    assert_eq!(te_a, te_b, "te's bytes: e4m3 file {te_a}, f16 file {te_b}");
    let file = std::fs::metadata(&e4m3).unwrap().len();
    assert!(te_a > 2 * file - (1 << 20), "te {te_a} should count T5's e4m3 file ({file} bytes) widened to f16");
    let _ = std::fs::remove_dir_all(&d);
}

// --- Z-Image: the other 16-channel DiT family, on FLUX's VAE --------------------------------

/// Z-Image's component files: a reduced DiT (width 256, one refiner of each kind, two layers,
/// captions 256 wide) and a Qwen3 `--llm` cut to 2 layers of width 256 (the reference takes
/// both: `cargo xtask parity zimage`). Written once per process into the fixture cache.
fn zimage_files() -> &'static (PathBuf, PathBuf) {
    static FILES: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    FILES.get_or_init(|| {
        use sd_models::diffusion::zimage::ZImageConfig;
        use sd_models::fixture::{qwen3, zimage};
        use sd_models::text::qwen3::Qwen3Config;
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let cfg = ZImageConfig::reduced(256, 2, 1, 256);
        let dit = zimage::cached_zimage_path(&cfg, 42, WeightType::F16);
        if !dit.exists() {
            zimage::write_zimage(&dit, &cfg, 42, None, WeightType::F16, FileFormat::Safetensors).unwrap();
        }
        let llm_cfg = Qwen3Config { n_layers: 2, hidden: 256, intermediate: 512, ..Qwen3Config::qwen3_4b() };
        let llm = fixture::cache_dir().join("qwen3-fixture-seed42-f16-2l-h256-i512.safetensors");
        if !llm.exists() {
            qwen3::write_qwen3(&llm, &llm_cfg, 42, None, WeightType::F16, FileFormat::Safetensors).unwrap();
        }
        (dit, llm)
    })
}

/// `sd-cli` with `pre` (a subcommand), Z-Image's files (`--llm`, `--vae` left out when
/// `false`) and `extra`.
fn zimage_cli(pre: &[&str], llm: bool, vae: bool, extra: &[&str]) -> std::process::Output {
    let (dit, llm_path) = zimage_files();
    let mut c = sd_cli();
    c.env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off").args(pre).arg("--diffusion-model").arg(dit);
    if llm {
        c.arg("--llm").arg(llm_path);
    }
    if vae {
        c.arg("--vae").arg(&files().vae);
    }
    c.args(extra).output().unwrap()
}

#[test]
fn zimage_generates_reads_the_prompt_and_plans() {
    let d = dir("zimage");
    let gen = |name: &str, prompt: &str| {
        let out = d.join(format!("{name}.png"));
        let o = zimage_cli(
            &[],
            true,
            true,
            &["-p", prompt, "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "-o", out.to_str().unwrap()],
        );
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "Z-Image generation failed:\n{err}");
        (pixels(&std::fs::read(&out).unwrap()), err)
    };
    let (cat, err) = gen("cat", "a photo of a cat");
    assert!(err.contains("model: zimage") && err.contains("flow matching"), "{err}");
    let px = &cat;
    assert_eq!(px.len(), 64 * 64 * 3);
    assert!(px.iter().any(|&v| v != px[0]), "a flat image");
    let (again, _) = gen("again", "a photo of a cat");
    assert!(again == cat, "the same seed gives the same image");
    let (dog, _) = gen("dog", "a photo of a dog");
    assert!(dog != cat, "the prompt reaches the image (through Qwen3)");
    // `plan` from the headers: every module sized, the LLM's layers te's blocks.
    let o = zimage_cli(&["plan"], true, true, &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && out.contains("zimage"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn zimage_loras_apply_in_every_layout_and_mode() {
    use sd_models::diffusion::zimage::ZImageConfig;
    use sd_models::fixture::lora::{write_zimage_lora, LoraFixture, LoraLayout};
    let d = dir("zimage-lora");
    let cfg = ZImageConfig::reduced(256, 2, 1, 256);
    let lora = |layout, seed| LoraFixture { layout, rank: 4, seed, scale: 0.05, text_encoder: false };
    // One set of values in kohya's and the original dotted names (kohya's alpha = rank / 2
    // halves the scale), another in diffusers' (qkv adapted per row block).
    write_zimage_lora(&d.join("kohya.safetensors"), &cfg, &lora(LoraLayout::Kohya, 1)).unwrap();
    write_zimage_lora(&d.join("peft.safetensors"), &cfg, &lora(LoraLayout::Peft, 1)).unwrap();
    write_zimage_lora(&d.join("diffusers.safetensors"), &cfg, &lora(LoraLayout::Diffusers, 2)).unwrap();
    let dir_arg = d.display().to_string();
    let gen = |name: &str, prompt: &str, more: &[&str]| -> Vec<u8> {
        let out = d.join(format!("{name}.png"));
        let base = ["-p", prompt, "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "--lora-model-dir", &dir_arg];
        let o = zimage_cli(&[], true, true, &[&base[..], &["-o", out.to_str().unwrap()], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        assert!(!err.contains("name no tensor"), "{name}: an adapter was not used:\n{err}");
        pixels(&std::fs::read(&out).unwrap())
    };
    let base = gen("base", "a photo of a cat", &[]);
    check_lora_layouts(&gen, &base);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn zimage_without_its_llm_or_vae_is_a_clear_error() {
    let d = dir("zimage-bad");
    for (llm, vae, needle) in [(false, true, "--llm"), (true, false, "--vae")] {
        let out = d.join("x.png");
        let o = zimage_cli(&[], llm, vae, &["-p", "a cat", "-W", "64", "-H", "64", "-o", out.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.code() == Some(2) && err.contains("Z-Image needs") && err.contains(needle), "{err}");
        assert!(!out.exists());
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn zimage_segmented_under_a_budget_gives_the_cpu_image() {
    // The DiT (8.6 MiB of weights) computes on an RPC server under a 4 MiB budget, params in
    // RAM: it runs in segments at its block cuts, and the image is the all-CPU one.
    let d = dir("zimage-seg");
    let gen = |name: &str, more: &[&str]| {
        let (out, report) = (d.join(format!("{name}.png")), d.join(format!("{name}.json")));
        let base =
            ["-p", "a photo of a cat", "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "-o", out.to_str().unwrap()];
        let o = zimage_cli(&[], true, true, &[&base[..], &["--report-json", report.to_str().unwrap()], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        let report = RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
        (pixels(&std::fs::read(&out).unwrap()), report, err)
    };
    let (cpu, _, _) = gen("cpu", &["--backend", "cpu"]);
    let server = common::Server::start();
    let placed = [
        "--rpc",
        server.endpoint.as_str(),
        "--max-vram",
        "RPC0=0.00390625",
        "--backend",
        "diffusion=RPC0,te=cpu,vae=cpu",
        "--params-backend",
        "diffusion=cpu",
    ];
    let (png, report, err) = gen("rpc", &placed);
    assert!(png == cpu, "the segmented image differs from the CPU one:\n{err}");
    let unet = report.module("unet").unwrap();
    let s = &report.runner("unet").unwrap().stats;
    assert_eq!((unet.devices.as_slice(), unet.residency), (&["RPC0".to_string()][..], Residency::Segmented));
    assert!(s.segmented_runs == 2 && s.max_segments > 1, "both steps in segments: {s:?}");
    let _ = std::fs::remove_dir_all(&d);
}

// --- Chroma: FLUX.1-schnell's blocks with the distilled-guidance approximator, T5 only --------

/// Chroma's DiT: width 256, 2 double and 1 single block, an approximator 256 wide with 2
/// layers (ours reads its size from the file; the reference's parity fixture has the released
/// 5120 x 5: `cargo xtask parity chroma`). Written once per process into the fixture cache.
fn chroma_dit() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        use sd_models::diffusion::flux::chroma::ChromaConfig;
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let approx = ChromaConfig { inner: 256, layers: 2, ..ChromaConfig::released() };
        let cfg = sd_models::diffusion::flux::FluxConfig { chroma: Some(approx), ..flux::reduced_chroma(256, 2, 1) };
        let path = flux::cached_chroma_path(&cfg, 42, WeightType::F16);
        if !path.exists() {
            flux::write_chroma(&path, &cfg, 42, None, WeightType::F16, FileFormat::Safetensors).unwrap();
        }
        path
    })
}

/// Chroma's T5: one block (its 512-token chunks make T5 the costly stage), the fp8 fixture
/// that `flux_reads_an_fp8_e4m3_t5_as_its_f16_values` shares.
fn chroma_t5() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let path = t5::cached_t5xxl_path(1, 42, WeightType::F8E4M3);
        if !path.exists() {
            let cfg = T5Config { n_layers: 1, ..T5Config::xxl() };
            t5::write_t5xxl(&path, &cfg, 42, WeightType::F8E4M3, FileFormat::Safetensors).unwrap();
        }
        path
    })
}

/// `sd-cli` with `pre` (a subcommand), Chroma's DiT, `--t5xxl` and `--vae` (each left out when
/// `false`) and `extra`.
fn chroma_cli(pre: &[&str], t5: bool, vae: bool, extra: &[&str]) -> std::process::Output {
    let mut c = sd_cli();
    c.env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off").args(pre).arg("--diffusion-model").arg(chroma_dit());
    if t5 {
        c.arg("--t5xxl").arg(chroma_t5());
    }
    if vae {
        c.arg("--vae").arg(&files().vae);
    }
    c.args(extra).output().unwrap()
}

#[test]
fn chroma_generates_with_its_negative_prompt_and_plans() {
    let d = dir("chroma");
    let gen = |name: &str, prompt: &str, negative: &str, more: &[&str]| {
        let out = d.join(format!("{name}.png"));
        let base = ["-p", prompt, "-n", negative, "-W", "64", "-H", "64", "--steps", "1", "-s", "7"];
        let o = chroma_cli(&[], true, true, &[&base[..], more, &["-o", out.to_str().unwrap()]].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "Chroma generation failed:\n{err}");
        (pixels(&std::fs::read(&out).unwrap()), err)
    };
    let (cat, err) = gen("cat", "a photo of a cat", "blurry", &[]);
    assert!(err.contains("model: chroma") && err.contains("flow matching"), "{err}");
    let px = &cat;
    assert_eq!(px.len(), 64 * 64 * 3);
    assert!(px.iter().any(|&v| v != px[0]), "a flat image");
    // The same seed gives the same image; the approximator's guidance input is 0 whatever
    // --guidance says, and a --clip_l is ignored with a warning, as in the reference.
    let clip = files().clip_l.to_str().unwrap();
    let (again, err) = gen("again", "a photo of a cat", "blurry", &["--guidance", "5", "--clip_l", clip]);
    assert!(again == cat && err.contains("CLIP-L text encoder (--clip_l) is ignored"), "{err}");
    let (dog, _) = gen("dog", "a photo of a dog", "blurry", &[]);
    assert!(dog != cat, "the prompt reaches the image (through T5)");
    let (neg, _) = gen("neg", "a photo of a cat", "a dark room", &[]);
    assert!(neg != cat, "the negative prompt reaches the image (real CFG)");
    // The reference's --model-args keys: without the DiT mask the padding is attended to.
    let (unmasked, _) = gen("unmasked", "a photo of a cat", "blurry", &["--model-args", "chroma_use_dit_mask=false"]);
    assert!(unmasked != cat, "chroma_use_dit_mask=false reaches the image");
    for (args, needle) in [
        ("chroma_use_t5_mask=true", "not supported"),
        ("chroma_t5_mask_pad=x", "chroma_t5_mask_pad=x"),
        ("flux_thing=1", "'flux_thing'"),
    ] {
        let o = chroma_cli(
            &[],
            true,
            true,
            &["-p", "a cat", "--model-args", args, "-o", d.join("bad.png").to_str().unwrap()],
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle), "{args}: {err}");
    }
    // `plan` from the headers.
    let o = chroma_cli(&["plan"], true, true, &["--steps", "2"]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && out.contains("chroma"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Chroma1-Radiance's DiT: [`chroma_dit`]'s sizes in pixel space (a 16x16 patch convolution in,
/// the NeRF head out), written once per process into the fixture cache.
fn radiance_dit() -> &'static PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        use sd_models::diffusion::flux::chroma::ChromaConfig;
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let approx = ChromaConfig { inner: 256, layers: 2, ..ChromaConfig::released() };
        let cfg =
            sd_models::diffusion::flux::FluxConfig { chroma: Some(approx), ..flux::reduced_chroma_radiance(256, 1, 1) };
        let path = flux::cached_chroma_path(&cfg, 5, WeightType::F16);
        if !path.exists() {
            flux::write_chroma(&path, &cfg, 5, Some(0.03), WeightType::F16, FileFormat::Safetensors).unwrap();
        }
        path
    })
}

/// Chroma1-Radiance generates in pixel space with no VAE: txt2img and img2img, the same
/// image with a VAE given (ignored, with a warning) or with VAE tiling (nothing to tile), and
/// `plan` names it.
#[test]
fn chroma_radiance_generates_in_pixel_space_without_a_vae() {
    let d = dir("chroma-radiance");
    let gen = |name: &str, pre: &[&str], more: &[&str]| {
        let out = d.join(format!("{name}.png"));
        let mut c = sd_cli();
        c.env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off").args(pre);
        c.arg("--diffusion-model").arg(radiance_dit()).arg("--t5xxl").arg(chroma_t5());
        let base = ["-p", "a red (cat:1.2)", "-n", "blurry", "-W", "64", "-H", "48", "--steps", "2", "-s", "9"];
        let o = c.args(base).args(more).arg("-o").arg(&out).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "Chroma1-Radiance ({name}) failed:\n{err}");
        (pixels(&std::fs::read(&out).unwrap()), err)
    };
    let (img, err) = gen("txt2img", &[], &[]);
    assert!(err.contains("model: chroma-radiance"), "{err}");
    assert_eq!(img.len(), 64 * 48 * 3);
    assert!(img.iter().any(|&v| v != img[0]), "a flat image");
    let (with_vae, err) = gen("vae", &[], &["--vae", files().vae.to_str().unwrap()]);
    assert!(with_vae == img && err.contains("has no VAE"), "{err}");
    let (tiled, _) = gen("tiled", &[], &["--vae-tiling"]);
    assert!(tiled == img, "VAE tiling changes nothing in pixel space");
    let init = d.join("init.png");
    write_init_png(&init, false);
    // Two steps at strength 0.3 start at the schedule's second sigma (0.5), as the reference
    // slices it; at 0.5 it would start from pure noise, where the init image has no weight.
    let (edit, _) = gen("img2img", &[], &["-i", init.to_str().unwrap(), "--strength", "0.3"]);
    assert!(edit != img, "img2img starts from the init image");
    let mut c = sd_cli();
    c.args(["plan", "--diffusion-model"]).arg(radiance_dit()).arg("--t5xxl").arg(chroma_t5());
    let o = c.args(["-W", "64", "-H", "64"]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && out.contains("chroma-radiance"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn chroma_without_t5_or_vae_is_a_clear_error_and_never_runs_as_flux() {
    let d = dir("chroma-bad");
    for (t5, vae, needle) in [(false, true, "--t5xxl"), (true, false, "--vae")] {
        let out = d.join("x.png");
        let o = chroma_cli(&[], t5, vae, &["-p", "a cat", "-W", "64", "-H", "64", "-o", out.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.code() == Some(2) && err.contains("Chroma needs") && err.contains(needle), "{err}");
        assert!(!out.exists());
    }
    // The FLUX.1 DiT with Chroma's flags (no --clip_l) is still FLUX.1.
    let out = d.join("flux.png");
    let o = sd_cli()
        .env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off")
        .args(["plan", "--diffusion-model"])
        .arg(&files().dit)
        .arg("--t5xxl")
        .arg(&files().t5)
        .arg("--vae")
        .arg(&files().vae)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && text.contains("flux") && !text.contains("chroma"), "{text}");
    // FLUX.1 takes no --model-args: Chroma's keys are refused by name, before any weight loads.
    let o = sd_cli()
        .env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off")
        .arg("--diffusion-model")
        .arg(&files().dit)
        .arg("--t5xxl")
        .arg(&files().t5)
        .arg("--vae")
        .arg(&files().vae)
        .args(["-p", "a cat", "--model-args", "chroma_use_dit_mask=false", "-o", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("'chroma_use_dit_mask'") && err.contains("flux"), "{err}");
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&d);
}

// --- SD3 / SD3.5: the MMDiT with CLIP-L, CLIP-G and T5-XXL -----------------------------------

/// An SD3.5 Medium-layout checkpoint (MMDiT-X: 2 joint blocks with `attn2`, width 256, a
/// position table of side 16) with its VAE and no text encoders, and the same file without its
/// VAE. T5 is FLUX's 2-block fixture; the CLIPs are left out (full-size CLIP-L and CLIP-G are
/// 1.7 GB: the parity with the reference, which needs 24 blocks too, is `cargo xtask parity
/// sd3`). Written once per process into the fixture cache.
fn sd3_files() -> &'static (PathBuf, PathBuf) {
    static FILES: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    FILES.get_or_init(|| {
        use sd_models::family::sd3::mmdit::MmditConfig;
        use sd_models::fixture::sd3;
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let cfg = sd3::reduced(MmditConfig::sd35_medium(), 256, 2, 16);
        let ckpt = sd3::cached_sd3_path(&cfg, 42, WeightType::F16, false);
        if !ckpt.exists() {
            sd3::write_sd3(&ckpt, &cfg, 42, Some(0.05), WeightType::F16, FileFormat::Safetensors, false).unwrap();
        }
        let name = ckpt.file_name().unwrap().to_string_lossy();
        let no_vae = ckpt.with_file_name(format!("no-vae-{name}"));
        if !no_vae.exists() {
            subset(&ckpt, &no_vae, "model.diffusion_model.");
        }
        (ckpt, no_vae)
    })
}

/// `sd-cli` with `pre` (a subcommand), the SD3 checkpoint (`vae`: the one with its VAE), FLUX's
/// T5 fixture when `t5`, and `extra`.
fn sd3_cli(pre: &[&str], t5: bool, vae: bool, extra: &[&str]) -> std::process::Output {
    let (ckpt, no_vae) = sd3_files();
    let mut c = sd_cli();
    c.env(sd_backends::backend::CPU_EXTRA_BUFTS_ENV, "off").args(pre).arg("-m").arg(if vae { ckpt } else { no_vae });
    if t5 {
        c.arg("--t5xxl").arg(&files().t5);
    }
    c.args(extra).output().unwrap()
}

#[test]
fn sd3_generates_reads_the_prompt_and_plans() {
    let d = dir("sd3");
    let gen = |name: &str, prompt: &str, more: &[&str]| {
        let out = d.join(format!("{name}.png"));
        let base = ["-p", prompt, "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "-o", out.to_str().unwrap()];
        let o = sd3_cli(&[], true, true, &[&base[..], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "SD3 generation failed:\n{err}");
        (pixels(&std::fs::read(&out).unwrap()), err)
    };
    let (cat, err) = gen("cat", "a photo of a cat", &[]);
    assert!(err.contains("model: sd3") && err.contains("flow matching"), "{err}");
    assert!(err.contains("no CLIP-L text encoder") && err.contains("no CLIP-G text encoder"), "{err}");
    let px = &cat;
    assert_eq!(px.len(), 64 * 64 * 3);
    assert!(px.iter().any(|&v| v != px[0]), "a flat image");
    let (again, _) = gen("again", "a photo of a cat", &[]);
    assert!(again == cat, "the same seed gives the same image");
    let (dog, _) = gen("dog", "a photo of a dog", &[]);
    assert!(dog != cat, "the prompt reaches the image (through T5)");
    let (neg, _) = gen("neg", "a photo of a cat", &["-n", "blurry"]);
    assert!(neg != cat, "the negative prompt reaches the image (cfg 7 by default)");
    let (shifted, _) = gen("shift", "a photo of a cat", &["--flow-shift", "1.5"]);
    assert!(shifted != cat, "--flow-shift reaches the schedule");
    let taesd = taesd_file(16).display().to_string();
    let (tiny, _) = gen("taesd", "a photo of a cat", &["--taesd", &taesd]);
    assert!(tiny != cat && tiny.len() == 64 * 64 * 3, "TAESD3 decodes in place of the VAE");
    // `plan` from the headers: the MMDiT's joint blocks and T5's layers are the blocks.
    let o = sd3_cli(&["plan"], true, true, &[]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && out.contains("sd3"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn sd3_loras_apply_in_every_layout_and_mode() {
    use sd_models::family::sd3::mmdit::MmditConfig;
    use sd_models::fixture::lora::{write_sd3_lora, LoraFixture, LoraLayout};
    use sd_models::fixture::sd3;
    let d = dir("sd3-lora");
    let cfg = sd3::reduced(MmditConfig::sd35_medium(), 256, 2, 16);
    let lora = |layout, seed| LoraFixture { layout, rank: 4, seed, scale: 0.05, text_encoder: false };
    // One set of values in kohya's and the original dotted names (kohya's alpha = rank / 2
    // halves the scale), another in diffusers' (qkv adapted per row block).
    write_sd3_lora(&d.join("kohya.safetensors"), &cfg, &lora(LoraLayout::Kohya, 1)).unwrap();
    write_sd3_lora(&d.join("peft.safetensors"), &cfg, &lora(LoraLayout::Peft, 1)).unwrap();
    write_sd3_lora(&d.join("diffusers.safetensors"), &cfg, &lora(LoraLayout::Diffusers, 2)).unwrap();
    let dir_arg = d.display().to_string();
    let gen = |name: &str, prompt: &str, more: &[&str]| -> Vec<u8> {
        let out = d.join(format!("{name}.png"));
        let base = ["-p", prompt, "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "--lora-model-dir", &dir_arg];
        let o = sd3_cli(&[], true, true, &[&base[..], &["-o", out.to_str().unwrap()], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        assert!(!err.contains("name no tensor"), "{name}: an adapter was not used:\n{err}");
        pixels(&std::fs::read(&out).unwrap())
    };
    let base = gen("base", "a photo of a cat", &[]);
    check_lora_layouts(&gen, &base);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn sd3_without_its_encoders_or_vae_is_a_clear_error() {
    let d = dir("sd3-bad");
    for (t5, vae, needle) in [(false, true, "text encoders"), (true, false, "--vae")] {
        let out = d.join("x.png");
        let o = sd3_cli(&[], t5, vae, &["-p", "a cat", "-W", "64", "-H", "64", "-o", out.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.code() == Some(2) && err.contains("SD3 needs") && err.contains(needle), "{err}");
        assert!(!out.exists());
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn sd3_segmented_under_a_budget_and_split_give_the_cpu_image() {
    // The MMDiT (about 17 MiB of weights: the prelude's f32 embedders 6.5 MiB, each block 5.5 MiB)
    // computes on an RPC server under a 12 MiB budget, params in RAM: it runs in segments at its
    // block cuts; then layer-split over the server and the CPU. Both give the all-CPU image.
    let d = dir("sd3-seg");
    let gen = |name: &str, more: &[&str]| {
        let (out, report) = (d.join(format!("{name}.png")), d.join(format!("{name}.json")));
        let base =
            ["-p", "a photo of a cat", "-W", "64", "-H", "64", "--steps", "2", "-s", "7", "-o", out.to_str().unwrap()];
        let o = sd3_cli(&[], true, true, &[&base[..], &["--report-json", report.to_str().unwrap()], more].concat());
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{name}:\n{err}");
        let report = RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
        (pixels(&std::fs::read(&out).unwrap()), report, err)
    };
    let (cpu, _, _) = gen("cpu", &["--backend", "cpu"]);
    let server = common::Server::start();
    let placed = [
        "--rpc",
        server.endpoint.as_str(),
        "--max-vram",
        "RPC0=0.01171875",
        "--backend",
        "diffusion=RPC0,te=cpu,vae=cpu",
        "--params-backend",
        "diffusion=cpu",
    ];
    let (png, report, err) = gen("rpc", &placed);
    assert!(png == cpu, "the segmented image differs from the CPU one:\n{err}");
    let unet = report.module("unet").unwrap();
    let s = &report.runner("unet").unwrap().stats;
    assert_eq!((unet.devices.as_slice(), unet.residency), (&["RPC0".to_string()][..], Residency::Segmented));
    assert!(s.segmented_runs > 1 && s.max_segments > 1, "the steps in segments: {s:?}");
    let split = ["--rpc", server.endpoint.as_str(), "--backend", "diffusion=RPC0&CPU,te=cpu,vae=cpu"];
    let (png, report, err) = gen("split", &split);
    assert!(png == cpu, "the layer-split image differs from the CPU one:\n{err}");
    assert_eq!(report.module("unet").unwrap().devices.len(), 2, "{err}");
    let _ = std::fs::remove_dir_all(&d);
}
