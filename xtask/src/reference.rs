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
    /// `-march=native` with ggml's llamafile GEMM kernels (`--llamafile`, what
    /// `cmake -DGGML_LLAMAFILE=ON` builds): the fastest build of the reference a user can
    /// make from its own options, the one `cargo xtask bench` measures us against too.
    Llamafile,
}

impl Kernels {
    /// The build variant of `xtask/reference/sdref-build.toml` this build selects
    /// (`SDREF_VARIANT`: the flags its targets list under `last_flags`); `None` for
    /// sd.cpp's default build.
    fn variant(self) -> Option<&'static str> {
        match self {
            Kernels::Native => None,
            Kernels::F32Accumulation => Some("f32acc"),
            Kernels::Llamafile => Some("llamafile"),
        }
    }

    /// `-<variant>`, or nothing for the default build: what this build's directories add to
    /// the default build's names.
    fn suffix(self) -> String {
        self.variant().map(|v| format!("-{v}")).unwrap_or_default()
    }

    /// Its cargo target directory: `target/reference[-<variant>]`.
    fn dir(self) -> PathBuf {
        let mut d = target_dir().into_os_string();
        d.push(self.suffix());
        PathBuf::from(d)
    }

    /// The object and archive cache of this build: `SDREF_CC_DIR[-<variant>]` when
    /// `SDREF_CC_DIR` is set (as `.ci/run` sets it), else `sdref-cc` in its target
    /// directory. Never one cache for two builds: their `ggml-cpu` objects and archive
    /// differ, so each would replace the other's (recompiling it at every switch), and
    /// `parity ops` links a build's archives from its cache.
    fn cc_dir(self) -> PathBuf {
        match std::env::var_os("SDREF_CC_DIR") {
            Some(mut d) => {
                d.push(self.suffix());
                PathBuf::from(d)
            }
            None => self.dir().join("sdref-cc"),
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
    match kernels.variant() {
        Some(v) => c.env("SDREF_VARIANT", v),
        None => c.env_remove("SDREF_VARIANT"),
    };
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
    use crate::sdref_spec::Spec;

    fn spec() -> Spec {
        let path = project_dir().join("sdref-build.toml");
        toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    /// Each object's flags in the default build and in `variant`, for a C and a C++ file of
    /// every target.
    fn flags_of_every_target(spec: &Spec, variant: Option<&str>) -> Vec<(String, Vec<String>)> {
        let dirs = [("{sdcpp}", Path::new("/sdcpp")), ("{driver}", Path::new("/driver"))];
        let mut out = Vec::new();
        for t in &spec.target {
            for file in ["x.c", "x.cpp"] {
                let args = spec.object_args(t, file, &["-w".to_owned()], &dirs, variant).unwrap();
                out.push((format!("{} {file}", t.name), args));
            }
        }
        out
    }

    /// `--f32-accumulation` selects its flags through sdref-build.toml: ggml-cpu adds
    /// `-mno-avx512fp16` after its own options (`-march=native -fopenmp`) and before the
    /// language standard; every other object's command line is the default build's.
    #[test]
    fn the_f32_accumulation_build_changes_the_cpu_kernels_only() {
        let spec = spec();
        let variant = Kernels::F32Accumulation.variant();
        spec.check_variant(variant).unwrap();
        let native = flags_of_every_target(&spec, Kernels::Native.variant());
        let f32acc = flags_of_every_target(&spec, variant);
        let mut changed = Vec::new();
        for ((name, n), (_, f)) in native.iter().zip(&f32acc) {
            if n != f {
                changed.push(name.as_str());
                let std = n.last().unwrap();
                assert_eq!(&n[n.len() - 3..], ["-march=native", "-fopenmp", std.as_str()], "{name}");
                let mut expected = n.clone();
                expected.insert(n.len() - 1, "-mno-avx512fp16".to_owned());
                assert_eq!(f, &expected, "{name}");
            }
        }
        assert_eq!(changed, ["ggml-cpu x.c", "ggml-cpu x.cpp"]);
        // the default build adds no variant's flags anywhere
        assert!(native.iter().all(|(_, a)| !a.iter().any(|f| f == "-mno-avx512fp16")));
    }

    /// `--llamafile` is `cmake -DGGML_LLAMAFILE=ON`: the CPU target defines
    /// GGML_USE_LLAMAFILE and compiles ggml's llamafile GEMM source too; nothing else changes.
    #[test]
    fn the_llamafile_build_adds_its_definition_and_source_to_the_cpu_target_only() {
        let spec = spec();
        let variant = Kernels::Llamafile.variant();
        spec.check_variant(variant).unwrap();
        let native = flags_of_every_target(&spec, Kernels::Native.variant());
        let llamafile = flags_of_every_target(&spec, variant);
        let changed: Vec<&str> =
            native.iter().zip(&llamafile).filter(|(n, l)| n.1 != l.1).map(|(n, _)| n.0.as_str()).collect();
        assert_eq!(changed, ["ggml-cpu x.c", "ggml-cpu x.cpp"]);
        for (name, args) in llamafile.iter().filter(|(n, _)| n.starts_with("ggml-cpu ")) {
            assert!(args.iter().any(|a| a == "-DGGML_USE_LLAMAFILE"), "{name}: {args:?}");
        }
        let with_sources: Vec<(&str, &Vec<String>)> = spec
            .target
            .iter()
            .filter_map(|t| variant.and_then(|v| t.variant_sources.get(v)).map(|s| (t.name.as_str(), s)))
            .collect();
        assert_eq!(with_sources, [("ggml-cpu", &vec!["ggml/src/ggml-cpu/llamafile/sgemm.cpp".to_owned()])]);
        assert_eq!(Kernels::Llamafile.dir(), crate::workspace_root().join("target/reference-llamafile"));
    }

    #[test]
    fn an_unknown_build_variant_is_refused_with_the_known_ones() {
        let e = spec().check_variant(Some("f16acc")).unwrap_err();
        assert!(e.contains("SDREF_VARIANT=f16acc") && e.contains("known: f32acc, llamafile"), "{e}");
        spec().check_variant(None).unwrap();
    }

    #[test]
    fn each_build_has_its_own_target_directory() {
        assert_eq!(Kernels::Native.dir(), target_dir());
        assert_eq!(Kernels::F32Accumulation.dir(), crate::workspace_root().join("target/reference-f32acc"));
    }

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
