//! SDXL end to end on the Segmind Vega layout fixture (SDXL's two text encoders and VAE, a
//! smaller UNet; seed 42, f16, 3.3 GB, written once into the fixture cache): the images against
//! stable-diffusion.cpp's (`tests/data`, produced as `tests/data/README.md` says) with and
//! without guidance and with a tiny autoencoder, and the placement harness of placement.rs on
//! SDXL: the UNet segmented on an RPC server under a budget below its weights (params in RAM
//! and on disk), layer splits of the UNet and of both text encoders over two servers, each the
//! all-CPU image bit for bit (every device runs the same CPU kernels). One process shares the
//! fixture's pages, so CI pays the 3.3 GB once.

mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{level_diff, pixels, run_checked, Server};
use sd_models::fixture::{self, taesd, FileFormat, FixtureModel, WeightType};
use sd_models::report::{HomeReport, Residency, RunReport};

const MEAN_TOL: f64 = 1.0;
const MAX_TOL: u8 = 8;

fn model() -> &'static Path {
    static M: OnceLock<PathBuf> = OnceLock::new();
    M.get_or_init(|| fixture::ensure_cached(FixtureModel::Vega, 42, WeightType::F16).unwrap().0)
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-sdxl-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A 64x64 generation of "a cat" (2 euler steps, seed 42, cfg 7 with the negative prompt
/// "blurry", unless `extra` says otherwise) into `dir/name.png`: its pixels and run report.
fn generate(dir: &Path, name: &str, extra: &[&str]) -> (Vec<u8>, RunReport) {
    let out = dir.join(format!("{name}.png"));
    let guided = !extra.contains(&"--cfg-scale");
    let args = ["-p", "a cat", "-W", "64", "-H", "64", "--sampling-method", "euler", "-s", "42", "-t", "2"];
    let defaults: &[&str] = if guided { &["-n", "blurry", "--steps", "2"] } else { &[] };
    let report = run_checked(model(), &out, &[&args[..], defaults].concat(), extra);
    (pixels(&out), report)
}

fn reference(name: &str) -> Vec<u8> {
    pixels(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data").join(name))
}

/// The all-CPU image of the default generation and its run report, once per process.
fn cpu_run() -> &'static (Vec<u8>, RunReport) {
    static RUN: OnceLock<(Vec<u8>, RunReport)> = OnceLock::new();
    RUN.get_or_init(|| {
        let d = dir("cpu");
        let run = generate(&d, "cpu", &["--backend", "cpu"]);
        let _ = std::fs::remove_dir_all(&d);
        run
    })
}

fn cpu_image() -> &'static [u8] {
    &cpu_run().0
}

#[test]
fn sdxl_matches_the_reference_with_and_without_guidance_and_with_a_tiny_autoencoder() {
    let d = dir("reference");
    let (mean, max) = level_diff(cpu_image(), &reference("ref-vega-f16-seed42-64x64-euler2-cfg7.png"));
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "cfg 7 vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    // cfg 1 (SDXL-Turbo's setting): one UNet evaluation per step, no negative pass.
    let (px, report) = generate(&d, "cfg1", &["--cfg-scale", "1", "--steps", "1"]);
    let (mean, max) = level_diff(&px, &reference("ref-vega-f16-seed42-64x64-euler1-cfg1.png"));
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "cfg 1 vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    assert_eq!(report.runner("unet").unwrap().stats.runs, 1, "cfg 1: one evaluation, a batch of one");
    // Against the guided run: the text encoder ran for the prompt alone, and the UNet's
    // workspace is that of a batch of one (the guided run's is a batch of two).
    let guided = &cpu_run().1;
    let runs = |r: &RunReport, name: &str| r.runner(name).unwrap().stats.runs;
    assert_eq!(2 * runs(&report, "te"), runs(guided, "te"), "cfg 1 encoded the negative prompt too");
    let workspace = |r: &RunReport| r.runner("unet").unwrap().stats.peak_workspace;
    assert!(workspace(&report) < workspace(guided), "cfg 1: the UNet ran a batch of two");
    // TAESDXL (the tiny autoencoder's SD layout, 4 latent channels) in place of the VAE.
    let tiny = taesd::cached_taesd_path(4, 42, WeightType::F16);
    if !tiny.exists() {
        taesd::write_taesd(&tiny, 4, 42, WeightType::F16, FileFormat::Safetensors).unwrap();
    }
    let (px, _) = generate(&d, "taesd", &["--taesd", tiny.to_str().unwrap()]);
    let (mean, max) = level_diff(&px, &reference("ref-vega-f16-seed42-64x64-euler2-cfg7-taesd.png"));
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "--taesd vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn sdxl_placements_give_the_all_cpu_image() {
    let d = dir("placements");
    let base = cpu_image();
    let (a, b) = (Server::start(), Server::start());
    let rpc = format!("{},{}", a.endpoint, b.endpoint);
    // 1 GiB for the UNet's 1.5 GB of weights: it runs in segments, its blocks staged with
    // prefetch; the text encoders' 1.6 GB likewise on the other server under 0.75 GiB.
    let budgets = "RPC0=1,RPC1=0.75";
    let cases: [(&str, &[&str]); 4] = [
        (
            "unet params in RAM, te params on disk, under budgets",
            &[
                "--backend",
                "diffusion=RPC0,te=RPC1,vae=cpu",
                "--params-backend",
                "diffusion=cpu,te=disk",
                "--max-vram",
                budgets,
            ],
        ),
        (
            "unet params on disk under a budget",
            &[
                "--backend",
                "diffusion=RPC0,te=cpu,vae=cpu",
                "--params-backend",
                "diffusion=disk",
                "--max-vram",
                budgets,
            ],
        ),
        ("unet and te layer splits", &["--backend", "diffusion=RPC0&RPC1,te=RPC1&RPC0,vae=cpu"]),
        ("unet split with the CPU", &["--backend", "diffusion=CPU&RPC0,te=cpu,vae=cpu"]),
    ];
    for (i, (name, placement)) in cases.iter().enumerate() {
        let args: Vec<&str> = ["--rpc", rpc.as_str()].into_iter().chain(placement.iter().copied()).collect();
        let (px, report) = generate(&d, &format!("case{i}"), &args);
        assert!(px == base, "{name}: the image differs from the all-CPU one");
        let unet = report.module("unet").unwrap();
        let s = &report.runner("unet").unwrap().stats;
        match i {
            0 | 1 => {
                assert_eq!(unet.residency, Residency::Segmented, "{name}: {s:?}");
                assert!(s.segmented_runs == 2 && s.max_segments > 1, "{name}: both steps in segments: {s:?}");
                assert!(s.prefetched_groups > 0 && s.prefetches_used == s.prefetched_groups, "{name}: {s:?}");
                assert_eq!(unet.params, if i == 0 { HomeReport::Host } else { HomeReport::Disk }, "{name}");
            }
            _ => {
                assert!(unet.devices.len() == 2 && s.cross_device_bytes > 0, "{name}: {unet:?} {s:?}");
            }
        }
        if i == 0 {
            let te = report.module("te").unwrap();
            assert_eq!((te.devices.as_slice(), &te.params), (&["RPC1".to_string()][..], &HomeReport::Disk), "{te:?}");
            assert_eq!(te.residency, Residency::Segmented, "{name}: both encoders a layer at a time");
        }
        if i == 2 {
            assert_eq!(report.module("te").unwrap().devices, ["RPC1", "RPC0"], "bigG's layers are split");
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// Issue 32's placement under pressure: both text encoders, the UNet and the VAE on one RPC
/// server under a 1 GiB budget, every module's parameters in RAM. The encoders are one module
/// run as two graphs (CLIP-L, then bigG) per prompt: the replicas one graph staged are evicted
/// when the next graph's cut buffers, compute buffer or weights need the room, as
/// stable-diffusion.cpp's `docs/performance.md` says of unpinned replicas. The run stays
/// within the budget, the report counts the evictions, and the image is the all-CPU one.
#[test]
fn sdxl_on_one_device_under_a_budget_evicts_replicas_under_pressure() {
    let d = dir("pressure");
    let server = Server::start();
    let args = ["--rpc", &server.endpoint, "--backend", "RPC0", "--params-backend", "cpu", "--max-vram", "RPC0=1"];
    let (px, report) = generate(&d, "pressure", &args);
    let rpc0 = report.device("RPC0").expect("an RPC0 ledger");
    assert_eq!(rpc0.budget_bytes, Some(1 << 30), "{rpc0:?}");
    assert!(rpc0.pressure_evictions > 0 && rpc0.pressure_evicted_bytes > 0, "no eviction under pressure: {rpc0:?}");
    for module in ["te", "unet", "vae"] {
        let m = report.module(module).unwrap_or_else(|| panic!("no {module} in {:?}", report.modules));
        assert_eq!((m.devices.as_slice(), &m.params), (&["RPC0".to_string()][..], &HomeReport::Host), "{m:?}");
    }
    assert!(px == cpu_image(), "the image differs from the all-CPU one");
    let _ = std::fs::remove_dir_all(&d);
}
