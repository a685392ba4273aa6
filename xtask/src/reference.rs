//! Builds and drives `sdref`, the stable-diffusion.cpp reference executable (xtask/reference).
//!
//! The reference is a standalone cargo project, outside the workspace: it
//! compiles sd.cpp and a second ggml from the crates.io package
//! `diffusion-rs-sys` (pinned) without CMake, with the C/C++ compiler the `cc`
//! crate finds, natively and with OpenMP, as `xtask/reference/sdref-build.toml`
//! says (the flags of sd.cpp's own CMake build, entry by entry). That takes many
//! minutes on two cores the first time and nothing afterwards (the objects are
//! cached in `target/reference/sdref-cc`). Its build never runs as part of the
//! workspace's; CI runs it for a few seeded harness cases. It runs as its own
//! process; we compare through files and read its machine-readable stderr lines
//! (`SDREF_TIMING ...`, `SDREF_RSS ...`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};

/// The crates.io package whose bundled sd.cpp source we build.
pub const SYS_PACKAGE: &str = "diffusion-rs-sys";

/// The reference project's directory, xtask/reference.
fn project_dir() -> PathBuf {
    crate::workspace_root().join("xtask/reference")
}

/// Where the reference builds: its own target dir, so neither build blocks the other.
pub fn target_dir() -> PathBuf {
    crate::workspace_root().join("target/reference")
}

/// Which build of the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// As a user builds it: sd.cpp's default CPU build (`-march=native`).
    Native,
    /// `-march=native` without AVX512-FP16 (`--f32-accumulation`): on a CPU with that
    /// extension, ggml 0.12 accumulates f16 dot products in f16 (see `parity ops`); this
    /// build accumulates in f32, as ours does, so that both run the same kernels.
    F32Accumulation,
}

impl Kernels {
    fn dir(self) -> PathBuf {
        match self {
            Kernels::Native => target_dir(),
            Kernels::F32Accumulation => crate::workspace_root().join("target/reference-f32acc"),
        }
    }

    /// The object and archive cache of this build (`SDREF_CC_DIR` for the native one, as
    /// `.ci/run` sets it).
    fn cc_dir(self) -> PathBuf {
        match (self, std::env::var_os("SDREF_CC_DIR")) {
            (Kernels::Native, Some(d)) => PathBuf::from(d),
            _ => self.dir().join("sdref-cc"),
        }
    }

    /// The executable this build produces.
    pub fn exe(self) -> PathBuf {
        self.dir().join("release/sdref")
    }

    /// Where this build leaves its static libraries (ggml's among them), for `parity ops`.
    pub fn static_lib_dir(self) -> PathBuf {
        self.cc_dir().join("lib")
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

/// Finds sd.cpp's source inside the pinned `diffusion-rs-sys` package,
/// downloading the package through cargo if needed.
pub(crate) fn sdcpp_source_dir() -> anyhow::Result<PathBuf> {
    let manifest = project_dir().join("Cargo.toml");
    let output = Command::new(cargo())
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(&manifest)
        .output()
        .context("running cargo metadata for the reference project")?;
    if !output.status.success() {
        bail!("cargo metadata on {} failed:\n{}", manifest.display(), String::from_utf8_lossy(&output.stderr));
    }
    let meta: serde_json::Value = serde_json::from_slice(&output.stdout).context("parsing cargo metadata")?;
    let manifest_path = meta["packages"]
        .as_array()
        .and_then(|pkgs| pkgs.iter().find(|p| p["name"] == SYS_PACKAGE))
        .and_then(|p| p["manifest_path"].as_str())
        .with_context(|| format!("{SYS_PACKAGE} is not among the packages of {}", manifest.display()))?;
    let dir = Path::new(manifest_path).parent().context("manifest_path has no parent")?.join("stable-diffusion.cpp");
    if !dir.join("src/stable-diffusion.cpp").is_file() {
        bail!("{} does not hold sd.cpp's source (no src/stable-diffusion.cpp)", dir.display());
    }
    Ok(dir)
}

/// Builds the reference executable (release, native, OpenMP) and returns its path.
///
/// The first build compiles sd.cpp and its ggml (many minutes on two cores);
/// later ones compile nothing unless `xtask/reference/driver` changed.
pub fn build() -> anyhow::Result<PathBuf> {
    build_kernels(Kernels::Native)
}

/// Builds one of the reference's builds and returns its executable.
pub fn build_kernels(kernels: Kernels) -> anyhow::Result<PathBuf> {
    let sdcpp = sdcpp_source_dir()?;
    let mut c = Command::new(cargo());
    c.args(["build", "--release", "--manifest-path"])
        .arg(project_dir().join("Cargo.toml"))
        .arg("--target-dir")
        .arg(kernels.dir())
        .env("SDREF_SDCPP_DIR", &sdcpp)
        .env("SDREF_CC_DIR", kernels.cc_dir());
    if kernels == Kernels::F32Accumulation {
        c.env("SDREF_LAST_FLAGS", "-mno-avx512fp16");
    }
    let status = c.status().context("running cargo build for the reference")?;
    if !status.success() {
        bail!("building the reference (xtask/reference) failed: {status}");
    }
    let exe = kernels.exe();
    if !exe.is_file() {
        bail!("the reference build succeeded but {} is missing", exe.display());
    }
    Ok(exe)
}

/// The `key=value` fields of the last stderr line starting with `tag`
/// (e.g. "SDREF_TIMING" or "SDREF_RSS"); `None` when no such line exists.
pub fn parse_tagged_line(stderr: &str, tag: &str) -> Option<BTreeMap<String, String>> {
    let line = stderr.lines().rev().find(|l| l.split_whitespace().next() == Some(tag))?;
    Some(
        line.split_whitespace()
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    )
}

/// One field of a tagged line as milliseconds/MiB/etc.; `None` if absent or "unknown".
pub fn field_f64(fields: &BTreeMap<String, String>, key: &str) -> Option<f64> {
    fields.get(key)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_lines_parse_into_fields_and_the_last_one_wins() {
        let stderr = "[sd.cpp INFO] loading\n\
                      SDREF_TIMING load_ms=1 total_ms=2\n\
                      noise SDREF_TIMING load_ms=9\n\
                      SDREF_TIMING load_ms=1200 text_encode_ms=650 step_ms=8000,8100 decode_ms=unknown\n\
                      SDREF_RSS peak_rss_kib=2492416 peak_rss_mib=2434\n";
        let t = parse_tagged_line(stderr, "SDREF_TIMING").unwrap();
        assert_eq!(field_f64(&t, "load_ms"), Some(1200.0));
        assert_eq!(t["step_ms"], "8000,8100");
        assert_eq!(field_f64(&t, "decode_ms"), None);
        assert!(!t.contains_key("total_ms"));
        let r = parse_tagged_line(stderr, "SDREF_RSS").unwrap();
        assert_eq!(field_f64(&r, "peak_rss_mib"), Some(2434.0));
        assert!(parse_tagged_line(stderr, "SDREF_OTHER").is_none());
    }
}
