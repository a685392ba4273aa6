//! `sd-cli plan --explain` (issue 40): the predicted time of the chosen plan and of the ladder's, the top alternatives, auto-fit by time from a profile's `[device.cost]`, and `--auto-fit ladder`.

mod common;

use std::path::PathBuf;
use std::process::Output;

use common::{sd15_fixture, sd_cli};
use sd_placement::{Explain, Plan};

/// Two GPUs: GPU0 with the larger memory (the ladder's main GPU), GPU1 ten times faster and
/// large enough for the whole SD 1.x model. `cost` replaces GPU1's `[device.cost]` table.
fn profile(tag: &str, gpu1_cost: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("sd-cli-plan-explain-{tag}-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "ram_available_mib = 16384\n\
             [[device]]\nname = \"GPU0\"\ntype = \"gpu\"\nfree_mib = 16384\ntotal_mib = 16384\n\
             [device.cost]\nmatmul_f16 = 2e12\nmemory_bytes_per_s = 2e11\nlink_bytes_per_s = 1e10\nlink_latency_s = 1e-5\n\
             [[device]]\nname = \"GPU1\"\ntype = \"gpu\"\nfree_mib = 8192\ntotal_mib = 8192\n\
             [device.cost]\n{gpu1_cost}\n\
             [[device]]\nname = \"CPU\"\ntype = \"cpu\"\n\
             [device.cost]\nmatmul_f16 = 1e11\nmemory_bytes_per_s = 2e10\n"
        ),
    )
    .unwrap();
    path
}

const FAST: &str = "matmul_f16 = 2e13\nmemory_bytes_per_s = 5e11\nlink_bytes_per_s = 1e10\nlink_latency_s = 1e-5";

fn plan(profile: &PathBuf, args: &[&str]) -> Output {
    sd_cli().arg("plan").arg("-m").arg(sd15_fixture()).arg("--devices").arg(profile).args(args).output().unwrap()
}

fn explained(profile: &PathBuf, args: &[&str]) -> (Plan, Explain) {
    let o = plan(profile, &[args, &["--explain", "--json"]].concat());
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (serde_json::from_value(v["plan"].clone()).unwrap(), serde_json::from_value(v["explain"].clone()).unwrap())
}

#[test]
fn explain_predicts_and_auto_fit_chooses_the_faster_gpu() {
    let p = profile("fast", FAST);
    let (chosen, e) = explained(&p, &[]);
    assert!(chosen.auto_fit && chosen.fits);
    assert_eq!(chosen.main_device, "GPU1", "{}", e.render());
    let ladder = e.ladder.as_ref().expect("the ladder's prediction");
    assert!(e.chosen.step_s > 0.0 && e.chosen.step_s < ladder.step_s, "{}", e.render());
    assert!(e.chosen.modules.iter().any(|m| m.module.name() == "diffusion" && m.runs == 20));
    // --steps, as a generation's: the diffusion model runs once per step
    let (_, e8) = explained(&p, &["--steps", "8"]);
    assert!(e8.chosen.modules.iter().any(|m| m.module.name() == "diffusion" && m.runs == 8), "{}", e8.render());
    assert!(e8.chosen.total_s < e.chosen.total_s);
    let o = plan(&p, &["--explain", "--steps", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--steps"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!e.alternatives.is_empty() && e.alternatives[0].total_s <= e.chosen.total_s * 1.000001);
    assert!(chosen.choice.as_deref().unwrap_or("").contains("against the ladder's"), "{:?}", chosen.choice);
    // The table says the same.
    let o = plan(&p, &["--explain"]);
    let text = String::from_utf8_lossy(&o.stdout);
    for needle in ["chosen plan:", "ladder plan:", "top alternatives:", "per step", "auto-fit by time"] {
        assert!(text.contains(needle), "{needle}: {text}");
    }
    // `--auto-fit ladder`: the seeds' plan, the same as without figures at all.
    let (kept, e2) = explained(&p, &["--auto-fit", "ladder"]);
    assert_eq!(kept.main_device, "GPU0");
    assert!(e2.alternatives.is_empty() && e2.reason.contains("--auto-fit ladder"));
    let seeds = sd_cli()
        .arg("plan")
        .arg("-m")
        .arg(sd15_fixture())
        .arg("--devices")
        .arg(&p)
        .args(["--auto-fit", "ladder", "--json"])
        .output()
        .unwrap();
    let seeds: Plan = serde_json::from_slice(&seeds.stdout).unwrap();
    assert_eq!(Plan { choice: kept.choice.clone(), ..seeds }, kept);
    std::fs::remove_file(&p).ok();
}

#[test]
fn a_slower_alternative_never_replaces_the_ladder() {
    // GPU1 as slow as GPU0, and one image's two guidance passes in one micro-batch
    // (`--pipeline-copies 1`, which auto-fit then keeps): nothing is 5% faster than the
    // ladder's plan.
    let p =
        profile("even", "matmul_f16 = 2e12\nmemory_bytes_per_s = 2e11\nlink_bytes_per_s = 1e10\nlink_latency_s = 1e-5");
    let (chosen, e) = explained(&p, &["--pipeline-copies", "1"]);
    assert_eq!(chosen.main_device, "GPU0", "{}", e.render());
    assert!(e.reason.contains("ladder's plan kept"), "{}", e.reason);
    assert!(e.alternatives.iter().all(|a| a.pipeline_copies == 1), "{}", e.render());
    // Left to auto-fit, the copies are an alternative too: the two GPUs split the UNet and
    // overlap the guidance passes, and the reason gives the flags that reproduce it.
    let (split, e) = explained(&p, &[]);
    assert_eq!(split.pipeline_copies, 2, "{}", e.render());
    assert!(split.modules.iter().any(|m| m.module.name() == "diffusion" && m.split.len() == 2), "{}", e.render());
    assert!(e.reason.contains("--pipeline-copies 2"), "{}", e.reason);
    std::fs::remove_file(&p).ok();
}

#[test]
fn bad_figures_in_a_profile_are_refused_naming_the_device_and_field() {
    let p = profile("bad", "matmul_f16 = -1");
    let o = plan(&p, &["--explain"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("GPU1") && err.contains("matmul_f16"), "{err}");
    std::fs::remove_file(&p).ok();
}

#[test]
fn calibrate_stores_figures_that_plan_explain_uses() {
    let cache = std::env::temp_dir().join(format!("sd-cli-calibrate-{}", std::process::id()));
    let o = sd_cli().env("SD_CACHE_DIR", &cache).args(["calibrate", "-t", "1", "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cpu = v.as_array().unwrap().iter().find(|e| e["device"] == "CPU").expect("the CPU calibrated");
    for k in ["matmul_f16", "conv", "memory_bytes_per_s"] {
        let x = cpu["figures"][k].as_f64().unwrap();
        assert!(x.is_finite() && x > 0.0, "{k} = {x}");
    }
    assert!(cache.join("device-figures.json").is_file());
    // This machine's plan now predicts from the calibrated CPU figures.
    let o = sd_cli()
        .env("SD_CACHE_DIR", &cache)
        .arg("plan")
        .arg("-m")
        .arg(sd15_fixture())
        .args(["--backend", "cpu", "--explain", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let e: Explain = serde_json::from_value(v["explain"].clone()).unwrap();
    assert!(e.figures.contains("CPU calibrated"), "{}", e.figures);
    assert!(e.chosen.complete() && e.chosen.step_s > 0.0, "{}", e.render());
    // Fitting needs a generation's report with a prediction: a plan's report has none.
    let report = cache.join("plan.json");
    let o = sd_cli()
        .env("SD_CACHE_DIR", &cache)
        .arg("plan")
        .arg("-m")
        .arg(sd15_fixture())
        .args(["--backend", "cpu", "--report-json"])
        .arg(&report)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = sd_cli().env("SD_CACHE_DIR", &cache).args(["calibrate", "--from-report"]).arg(&report).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no prediction") && err.contains("plan.json"), "{err}");
    std::fs::remove_dir_all(&cache).ok();
}

/// A generation's command line with `plan` in front plans that generation: every flag of a
/// generation is accepted (those a plan does not use are ignored), the ones it uses are read
/// as the generation reads them (-W/-H, the init image's size, --steps, the prompt's LoRA
/// tags, --type), and a mode that does not run is refused as generation refuses it.
#[test]
fn plan_takes_a_generations_flags_and_counts_type_as_loaded() {
    let dir = std::env::temp_dir().join(format!("sd-cli-plan-generation-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = sd15_fixture();
    let plan_json = |args: &[&str]| -> Plan {
        let o = sd_cli().arg("plan").arg("-m").arg(&model).args(args).arg("--json").output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let out = dir.join("never-written.png");
    let generation = [
        "-p",
        "a cat",
        "-n",
        "blurry",
        "--cfg-scale",
        "5",
        "--sampling-method",
        "euler_a",
        "--scheduler",
        "karras",
        "-s",
        "7",
        "-b",
        "2",
        "-t",
        "1",
        "--rng",
        "std_default",
        "--vae-tiling",
        "--clip-skip",
        "2",
        "--strength",
        "0.5",
        "-o",
        out.to_str().unwrap(),
        "-W",
        "320",
        "-H",
        "256",
        "--steps",
        "3",
    ];
    let p = plan_json(&generation);
    assert!(p.fits && !out.exists(), "a plan writes no image");
    let base = plan_json(&[]);
    let diffusion = |p: &Plan| p.modules.iter().find(|m| m.module.name() == "diffusion").unwrap().clone();
    // The size is used: a 320x256 image reserves less compute than the default 512x512.
    assert!(diffusion(&p).compute_reserve_bytes < diffusion(&base).compute_reserve_bytes, "{p:?}");
    // --type: linear weights as the loader converts them. Checked against a real load of the
    // same weights (ggml's CPU extra buffer types off: on the CPU they may take more room).
    let q8 = plan_json(&["--type", "q8_0"]);
    assert!(diffusion(&q8).param_bytes < diffusion(&base).param_bytes * 9 / 10, "{q8:?}");
    let report = dir.join("run.json");
    let o = sd_cli()
        .arg("-m")
        .arg(&model)
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "--type", "q8_0", "--cpu-extra-bufts", "off"])
        .arg("-o")
        .arg(dir.join("q8.png"))
        .arg("--report-json")
        .arg(&report)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let loaded = |name: &str| {
        r["modules"].as_array().unwrap().iter().find(|m| m["module"] == name).unwrap()["param_bytes"].as_u64().unwrap()
    };
    for (planned, name) in [
        (diffusion(&q8).param_bytes, "unet"),
        (q8.modules.iter().find(|m| m.module.name() == "te").unwrap().param_bytes, "te"),
    ] {
        let got = loaded(name);
        assert!(planned.abs_diff(got) * 100 < got, "{name}: planned {planned} bytes, loaded {got}");
    }
    // Refusals name the flag.
    for (args, needle) in [
        (&["--steps", "0"][..], "--steps 0"),
        (&["-M", "vid_gen"][..], "-M vid_gen"),
        (&["-W", "0"][..], "-W 0"),
        (&["-i", "/nonexistent/init.png"][..], "/nonexistent/init.png"),
    ] {
        let o = sd_cli().arg("plan").arg("-m").arg(&model).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `plan --preset NAME[:TYPE]` plans a family without its files, from sd-placement's measured
/// sizes; `--type` picks the type when the name has none; what a preset cannot answer is
/// refused naming the flag.
#[test]
fn plan_presets_a_family_without_files() {
    let p = profile("preset", FAST);
    let preset = |args: &[&str]| sd_cli().arg("plan").arg("--devices").arg(&p).args(args).output().unwrap();
    let planned = |args: &[&str]| -> Plan {
        let o = preset(&[args, &["--json"]].concat());
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let diffusion = |p: &Plan| p.modules.iter().find(|m| m.module.name() == "diffusion").unwrap().param_bytes;
    for (args, name, wtype) in [
        (&["--preset", "flux-dev:q4_K"][..], "flux-dev", "q4_K"),
        (&["--preset", "flux-dev", "--type", "q8_0"], "flux-dev", "q8_0"),
        (&["--preset", "sdxl"], "sdxl", "f16"),
    ] {
        let plan = planned(args);
        let want = sd_placement::presets::find(name, wtype).unwrap();
        let sizes = want.modules.iter().find(|m| m.module.name() == "diffusion").unwrap();
        assert_eq!(diffusion(&plan), sizes.other_bytes + sizes.blocks.iter().map(|b| b.bytes).sum::<u64>(), "{args:?}");
        assert_eq!(plan.modules.len(), 3, "{args:?}");
    }
    // FLUX.1-dev at q8_0 (17 GiB) does not fit a 16 GiB GPU whole: auto-fit streams or splits.
    assert!(diffusion(&planned(&["--preset", "flux-dev:q8_0"])) > 11 << 30);
    for (args, says) in [
        (&["--preset", "sd3"][..], "no preset 'sd3'"),
        (&["--preset", "sdxl:q5_1"], "sd15 (f16, q8_0, q4_K)"),
        (&["--preset", "sdxl", "--explain"], "--explain"),
        (&["--preset", "sd15", "-p", "a cat <lora:style:1>"], "<lora:"),
    ] {
        let o = preset(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("--preset") && err.contains(says), "{args:?}: {err}");
    }
    let o = sd_cli()
        .arg("plan")
        .arg("--preset")
        .arg("sd15")
        .arg("-m")
        .arg(sd15_fixture())
        .arg("--devices")
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("drop the model file flags"));
}
