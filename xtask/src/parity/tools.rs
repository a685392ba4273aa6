//! Parity tooling: the fixtures and the release `sd-cli` both sides run.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::fixture::{self, Family, FileFormat, FixtureRequest, WeightType};

/// Where the fixture of `family` lives: `target/fixtures/<family>-f16.safetensors`.
pub fn fixture_path(family: Family) -> PathBuf {
    crate::fixture::default_path(family, WeightType::F16, FileFormat::Safetensors)
}

/// The fixture of `family` (seed 42, f16, safetensors), written first if missing.
pub fn ensure_fixture(family: Family) -> Result<PathBuf> {
    let path = fixture_path(family);
    if path.is_file() {
        return Ok(path);
    }
    let dir = path.parent().context("fixture path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    eprintln!("parity: writing the {} fixture to {} (full size, takes a while)", family.name(), path.display());
    let t = Instant::now();
    // Write under a temporary name so that an interrupted run leaves no truncated fixture.
    let tmp = path.with_extension("safetensors.partial");
    let req = FixtureRequest::family(family, 42, WeightType::F16, FileFormat::Safetensors);
    fixture::write_fixture(&tmp, &req).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    eprintln!("parity: fixture written in {:.0} s", t.elapsed().as_secs_f64());
    Ok(path)
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Builds `sd-cli` in release mode and returns the executable's path (from cargo's
/// JSON messages, so that `CARGO_TARGET_DIR` is honoured).
pub fn build_sd_cli() -> Result<PathBuf> {
    let out = Command::new(cargo())
        .args(["build", "--release", "-p", "sd-cli", "--bin", "sd-cli", "--message-format=json-render-diagnostics"])
        .current_dir(crate::workspace_root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo build for sd-cli")?;
    if !out.status.success() {
        bail!("building sd-cli failed: {}", out.status);
    }
    let exe = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "sd-cli")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo did not report the sd-cli executable")?;
    Ok(exe)
}
