//! `cargo xtask install` and `cargo xtask dist` give an sd-cli that runs from wherever it is moved: no build tree in its run path, its core library and plugins found beside it.
//!
//! The sd-cli installed is the one this `cargo test` built beside xtask (`cargo test
//! --workspace` builds it; alone: `cargo build -p sd-cli` first). Nothing of the build tree
//! is moved: the installed copy proves where it loads from (the dynamic loader's trace, the
//! plugin paths `--list-devices --json` reports).

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::run;

fn xtask() -> Command {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
}

/// The sd-cli of this build (same target directory and profile as xtask).
fn built_sd_cli() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_xtask")).with_file_name(format!("sd-cli{}", std::env::consts::EXE_SUFFIX));
    assert!(p.is_file(), "{} is missing: build it first (cargo build -p sd-cli)", p.display());
    p
}

/// `sd-cli` under `root` with nothing of the environment pointing at the build tree.
fn installed(root: &Path) -> Command {
    let mut c = Command::new(root.join("bin/sd-cli"));
    c.env_remove("SD_PLUGIN_PATH").env_remove("LD_LIBRARY_PATH").current_dir(root);
    c
}

/// Every device's plugin lies under `root`, and the core library resolves there.
fn assert_runs_from(root: &Path) {
    let out = run(installed(root).args(["--list-devices", "--json"]));
    let devices: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plugins: Vec<&str> = devices.as_array().unwrap().iter().filter_map(|d| d["plugin"].as_str()).collect();
    assert!(!plugins.is_empty(), "no device: {devices}");
    for p in &plugins {
        assert!(Path::new(p).starts_with(root.join("lib/sd-rs/plugins")), "{p} is not the installed plugin");
    }
    // glibc's loader prints what it would load, and loads nothing
    let trace = run(installed(root).env("LD_TRACE_LOADED_OBJECTS", "1"));
    let trace = String::from_utf8_lossy(&trace.stdout);
    let core = trace.lines().find(|l| l.contains("libggml-base")).unwrap_or_else(|| panic!("{trace}"));
    let path = core.split("=> ").nth(1).and_then(|r| r.split(" (").next()).unwrap_or_else(|| panic!("{core}"));
    let path = Path::new(path).canonicalize().unwrap();
    assert!(path.starts_with(root.join("lib").canonicalize().unwrap()), "{core}");
}

#[test]
fn an_installed_and_an_unpacked_sd_cli_run_where_they_are_moved() {
    let bin = built_sd_cli();
    let tmp = std::env::temp_dir().join(format!("sd-rs-install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let prefix = tmp.join("prefix");
    run(xtask().arg("install").arg("--prefix").arg(&prefix).arg("--bin").arg(&bin));

    // the run path keeps only the relative entries
    let exe = std::fs::read(prefix.join("bin/sd-cli")).unwrap();
    let build_lib = Path::new(ggml_sys::BUILD_LIB_DIR).display().to_string();
    assert!(!exe.windows(build_lib.len()).any(|w| w == build_lib.as_bytes()), "the build tree is in the run path");
    assert!(exe.windows(22).any(|w| w == b"$ORIGIN:$ORIGIN/../lib"));

    // moved (renamed) elsewhere, it lists its devices and generates
    let moved = tmp.join("moved");
    std::fs::rename(&prefix, &moved).unwrap();
    assert_runs_from(&moved);
    let model = sd_models::fixture::ensure_cached(
        sd_models::fixture::FixtureModel::Sd15,
        42,
        sd_models::fixture::WeightType::F16,
    )
    .unwrap()
    .0;
    let png = tmp.join("out.png");
    run(installed(&moved)
        .arg("-m")
        .arg(&model)
        .args(["-W", "64", "-H", "64", "--steps", "1", "-t", "2", "-p", "a cat", "-o"])
        .arg(&png));
    assert!(std::fs::metadata(&png).unwrap().len() > 100, "an image was written");

    // the release archive, unpacked into a fresh directory, does the same
    let dist = tmp.join("dist");
    let out = run(xtask().arg("dist").arg("--out").arg(&dist).arg("--bin").arg(&bin));
    let archive = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(archive.is_file() && archive.to_string_lossy().ends_with(".tar.gz"), "{}", archive.display());
    let unpacked = tmp.join("unpacked");
    std::fs::create_dir_all(&unpacked).unwrap();
    run(Command::new("tar").arg("-xzf").arg(&archive).arg("-C").arg(&unpacked));
    let root = std::fs::read_dir(&unpacked).unwrap().next().unwrap().unwrap().path();
    assert_runs_from(&root);
    assert!(root.join("share/doc/sd-rs/LICENSES.md").is_file());
    let _ = std::fs::remove_dir_all(&tmp);
}
