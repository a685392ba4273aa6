//! Parity tooling: the fixtures and the release `sd-cli` both sides run.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::fixture::{self, FixtureModel, WeightType};

/// The fixture of `family` (seed 42, f16, safetensors) from the fixture cache, written
/// first if missing.
pub fn ensure_fixture(family: FixtureModel) -> Result<PathBuf> {
    let path = fixture::cached_path(family, 42, WeightType::F16);
    if !path.is_file() {
        eprintln!("parity: writing the {} fixture to {} (full size, takes a while)", family.name(), path.display());
    }
    let t = Instant::now();
    let (path, written) = fixture::ensure_cached(family, 42, WeightType::F16)?;
    if written {
        eprintln!("parity: fixture written in {:.0} s", t.elapsed().as_secs_f64());
    }
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
