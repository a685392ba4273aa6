//! The `plugins/*/plugin.toml` manifest: one reader for ggml-sys's build script and for `cargo xtask plugins`.
//!
//! Both include this file with `#[path]` (a build script cannot depend on a workspace
//! crate), so the fields a manifest may have are declared once.

use std::path::Path;

/// One vendor backend's `plugin.toml`.
// Each includer reads the fields it needs (the build script only the CPU variants).
#[allow(dead_code)]
#[derive(serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The backend's name (`cpu`, `rpc`, `cuda`, ...), as in its folder's name.
    pub name: String,
    /// Built and installed by default.
    #[serde(default)]
    pub default: bool,
    /// `ggml-sys`: compiled by ggml-sys's build script (no CMake); otherwise by CMake.
    pub build: Option<String>,
    /// The CPU backend's default variants on x86-64 (names of `crates/ggml-sys/ggml-build.toml`).
    #[serde(default)]
    pub variants: Vec<String>,
    /// The CPU backend's default variants on AArch64.
    #[serde(default)]
    pub variants_aarch64: Vec<String>,
    /// CMake options for `cargo xtask plugins`.
    #[serde(default)]
    pub cmake: Vec<String>,
    /// The CMake module targets to build.
    #[serde(default)]
    pub targets: Vec<String>,
    /// Programs the toolkit puts on PATH (e.g. `nvcc`).
    #[serde(default)]
    pub requires_programs: Vec<String>,
    /// The only OS it builds on.
    pub requires_os: Option<String>,
    /// What to install when a required program is missing.
    pub toolkit: Option<String>,
    /// The environment variable naming the toolkit's root (an SDK layout: `bin/`,
    /// `include/`, `lib/`), e.g. `VULKAN_SDK`; its `bin/` is searched before `PATH`.
    pub sdk_env: Option<String>,
    /// A script in the plugin's folder that fetches the toolkit into the folder it is
    /// given (an SDK layout), for `cargo xtask plugins --fetch-toolkit`.
    pub fetch: Option<String>,
    /// A header the toolkit must have, with a version it must reach.
    pub requires_header: Option<RequiredHeader>,
}

/// A toolkit header checked before building: `#define <define> <number>` in `path`.
// Read by xtask only (the build script builds no vendor plugin).
#[allow(dead_code)]
#[derive(serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RequiredHeader {
    /// Under the toolkit's `include/` (or the system's include directories).
    pub path: String,
    /// The macro that holds the version number.
    pub define: String,
    /// The lowest version that builds.
    pub min: u64,
}

impl Manifest {
    /// The CPU backend's default variants for a target architecture (`CARGO_CFG_TARGET_ARCH`):
    /// `variants` on x86_64, `variants_aarch64` on aarch64, none elsewhere.
    #[allow(dead_code)] // the build script's (xtask asks it for `all` or the defaults)
    pub fn cpu_variants(&self, target_arch: &str) -> &[String] {
        match target_arch {
            "x86_64" => &self.variants,
            "aarch64" => &self.variants_aarch64,
            _ => &[],
        }
    }

    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Manifest, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}
