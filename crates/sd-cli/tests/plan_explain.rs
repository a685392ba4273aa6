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
    // GPU1 as slow as GPU0: nothing is 5% faster than the ladder's plan.
    let p =
        profile("even", "matmul_f16 = 2e12\nmemory_bytes_per_s = 2e11\nlink_bytes_per_s = 1e10\nlink_latency_s = 1e-5");
    let (chosen, e) = explained(&p, &[]);
    assert_eq!(chosen.main_device, "GPU0", "{}", e.render());
    assert!(e.reason.contains("ladder's plan kept"), "{}", e.reason);
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
