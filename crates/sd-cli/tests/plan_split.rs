//! `sd-cli plan` for a layer split sized by speed with pipeline copies (issue 13): the flags and
//! `SD_PIPELINE_COPIES` reach the planner, a device profile's speeds give the ranges and the
//! predicted times, in the text and the JSON.

mod common;

use std::path::{Path, PathBuf};

use common::{sd15_fixture, sd_cli};
use sd_placement::{Plan, SplitBy};

/// Two RPC devices with 8 GiB each; RPC1 three times as fast as RPC0.
fn profile() -> PathBuf {
    let path = std::env::temp_dir().join(format!("sd-cli-plan-split-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "ram_available_mib = 16384\n\
         [[device]]\nname = \"RPC0\"\ntype = \"gpu\"\nfree_mib = 8192\ntotal_mib = 8192\nspeed_mib_s = 1000\n\
         [[device]]\nname = \"RPC1\"\ntype = \"gpu\"\nfree_mib = 8192\ntotal_mib = 8192\nspeed_mib_s = 3000\n",
    )
    .unwrap();
    path
}

/// `sd-cli plan` with `args` (and `SD_PIPELINE_COPIES` when `env` is given): stdout.
fn plan(profile: &Path, args: &[&str], env: Option<&str>) -> String {
    let mut c = sd_cli();
    c.arg("plan").arg("-m").arg(sd15_fixture()).arg("--devices").arg(profile).args(args);
    c.env_remove("SD_PIPELINE_COPIES");
    if let Some(v) = env {
        c.env("SD_PIPELINE_COPIES", v);
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn json(profile: &Path, args: &[&str], env: Option<&str>) -> Plan {
    let mut a = args.to_vec();
    a.push("--json");
    serde_json::from_str(&plan(profile, &a, env)).unwrap()
}

#[test]
fn speed_split_and_pipeline_copies_reach_the_plan() {
    let profile = profile();
    let split = ["--backend", "diffusion=rpc0&rpc1"];
    let speed = [&split[..], &["--split-by", "speed", "--pipeline-copies", "2"]].concat();
    let p = json(&profile, &speed, Some("3"));
    assert_eq!((p.split_by, p.pipeline_copies), (SplitBy::Speed, 2), "the flag wins over SD_PIPELINE_COPIES");
    let d = p.modules.iter().find(|m| m.module.name() == "diffusion").unwrap();
    assert_eq!(d.sized_by, Some(SplitBy::Speed));
    let reserve_2 = d.compute_reserve_bytes;
    // The UNet's 25 blocks (input 0..=11, middle 12, output 13..=24), contiguous, RPC0 first.
    let ranges: Vec<(&str, u32, u32)> =
        d.split.iter().map(|r| (r.device.as_str(), r.first_block, r.last_block)).collect();
    assert_eq!((ranges[0].0, ranges[0].1, ranges[1].0, ranges[1].2), ("RPC0", 0, "RPC1", 24), "{ranges:?}");
    assert_eq!(ranges[0].2 + 1, ranges[1].1, "{ranges:?}");
    // Times are bytes / speed; one pass is their sum, a pipelined micro-batch their maximum.
    let mib_s = |x: f64| x * (1u64 << 20) as f64;
    let t: Vec<f64> =
        d.split.iter().zip([mib_s(1000.0), mib_s(3000.0)]).map(|(r, s)| r.param_bytes as f64 / s).collect();
    let pred = d.predicted.clone().expect("speeds known");
    assert!((pred.single_pass_s - (t[0] + t[1])).abs() < 1e-9 && (pred.pipelined_s - t[0].max(t[1])).abs() < 1e-9);
    // By memory (equal devices: about half each) the slowest range takes longer.
    let m = json(&profile, &split, None);
    assert_eq!((m.split_by, m.pipeline_copies), (SplitBy::Memory, 1));
    let dm = m.modules.iter().find(|m| m.module.name() == "diffusion").unwrap();
    assert_eq!(dm.sized_by, Some(SplitBy::Memory));
    // The reserve is the compute buffer estimated for the model at 512x512 (issue 39), not
    // the fixed 2 GiB; two copies keep twice it; a larger image needs more.
    assert_eq!(reserve_2, 2 * dm.compute_reserve_bytes, "2 copies: twice the reserve");
    assert!(dm.compute_reserve_bytes > 256 << 20 && dm.compute_reserve_bytes < 2 << 30, "{dm:?}");
    let big = json(&profile, &[&split[..], &["-W", "768", "-H", "768"]].concat(), None);
    let db = big.modules.iter().find(|m| m.module.name() == "diffusion").unwrap();
    assert!(db.compute_reserve_bytes > 2 * dm.compute_reserve_bytes, "{db:?} vs {dm:?}");
    // `--json` opens with the schema version.
    let text = plan(&profile, &["--json"], None);
    assert!(text.trim_start().starts_with("{\n  \"schema_version\": 1,"), "{text}");
    assert_eq!(m.schema_version, sd_placement::PLAN_SCHEMA_VERSION);
    assert!(dm.predicted.clone().unwrap().pipelined_s > pred.pipelined_s, "{:?} vs {pred:?}", dm.predicted);
    assert!(d.split[1].param_bytes > 2 * d.split[0].param_bytes, "the fast device holds most of the weights");
    // SD_PIPELINE_COPIES without the flag.
    assert_eq!(json(&profile, &split, Some("3")).pipeline_copies, 3);
    // The text shows the ranges, the sizing and the predicted times.
    let text = plan(&profile, &speed, None);
    for part in [
        "layer split: RPC0 blocks 0..=",
        "layer split: RPC1 blocks ",
        "sized by speed, pipeline copies 2; predicted per evaluation: ",
        "in one pass (ranges in sequence)",
        "per micro-batch pipelined (slowest range",
        "--split-by speed --pipeline-copies 2",
    ] {
        assert!(text.contains(part), "{part:?} missing from:\n{text}");
    }
    std::fs::remove_file(&profile).ok();
}
