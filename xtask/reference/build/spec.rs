//! `sdref-build.toml` as data, and the compiler flags of one object that it implies.
//!
//! Included with `#[path]` by the build script (which compiles with these flags) and by
//! xtask's tests (which check the mapping on the real file without compiling anything),
//! so both read the same rules.

use std::collections::BTreeMap;
use std::path::Path;

/// The whole of `sdref-build.toml`.
#[derive(serde::Deserialize)]
pub(crate) struct Spec {
    pub(crate) release: Vec<String>,
    pub(crate) pic: Vec<String>,
    pub(crate) c_std: String,
    pub(crate) cxx_std: String,
    pub(crate) openmp_probe: Vec<String>,
    pub(crate) warnings: BTreeMap<String, Vec<String>>,
    pub(crate) target: Vec<Target>,
    pub(crate) link: Link,
}

/// One `[[target]]`: a static library or a CMake OBJECT library.
#[derive(serde::Deserialize)]
pub(crate) struct Target {
    pub(crate) name: String,
    pub(crate) archive: Option<String>,
    pub(crate) objects_into: Option<String>,
    #[serde(default = "sdcpp_root")]
    pub(crate) root: String,
    #[serde(default)]
    pub(crate) sources: Vec<String>,
    #[serde(default)]
    pub(crate) glob: Vec<String>,
    #[serde(default)]
    pub(crate) exclude: Vec<String>,
    pub(crate) defines: Vec<String>,
    pub(crate) includes: Vec<String>,
    pub(crate) c_flags: Option<String>,
    pub(crate) cxx_flags: Option<String>,
    #[serde(default)]
    pub(crate) options: Vec<String>,
    /// Per build variant (`SDREF_VARIANT`), the flags this target adds after its
    /// `options` when that variant is built.
    #[serde(default)]
    pub(crate) last_flags: BTreeMap<String, Vec<String>>,
    /// Per build variant, the sources this target compiles after its `sources` when that
    /// variant is built (ggml's `GGML_LLAMAFILE` adds `llamafile/sgemm.cpp` to ggml-cpu).
    #[serde(default)]
    pub(crate) variant_sources: BTreeMap<String, Vec<String>>,
    #[serde(default)]
    pub(crate) source_defines: BTreeMap<String, Vec<String>>,
    /// Start these objects before all others (their source's size understates them).
    #[serde(default)]
    pub(crate) compile_first: bool,
}

/// `[link]`: what the Rust binary links, in order.
#[derive(serde::Deserialize)]
pub(crate) struct Link {
    #[serde(rename = "static")]
    pub(crate) static_libs: Vec<String>,
    pub(crate) dylib: Vec<String>,
}

fn sdcpp_root() -> String {
    "{sdcpp}".to_owned()
}

/// `s` with each placeholder (`{sdcpp}`, `{driver}`) replaced by its directory.
pub(crate) fn expand(s: &str, dirs: &[(&str, &Path)]) -> String {
    let mut out = s.to_owned();
    for (k, v) in dirs {
        out = out.replace(k, &v.display().to_string());
    }
    out
}

impl Spec {
    /// Checks that `variant` (the value of `SDREF_VARIANT`; `None` for the default build)
    /// is named by some target's `last_flags` or `variant_sources`.
    pub(crate) fn check_variant(&self, variant: Option<&str>) -> Result<(), String> {
        let Some(v) = variant else { return Ok(()) };
        if self.target.iter().any(|t| t.last_flags.contains_key(v) || t.variant_sources.contains_key(v)) {
            return Ok(());
        }
        let mut known: Vec<&str> = self
            .target
            .iter()
            .flat_map(|t| t.last_flags.keys().chain(t.variant_sources.keys()).map(String::as_str))
            .collect();
        known.sort_unstable();
        known.dedup();
        Err(format!(
            "SDREF_VARIANT={v}: no target of the spec has flags for that build variant (known: {})",
            if known.is_empty() { "none".to_owned() } else { known.join(", ") }
        ))
    }

    /// The arguments that compile `file` of target `t`, before `-o OBJ -c SRC`:
    /// `<defines> <includes> <flags>`, as CMake's flags.make lists them. `compiler_flags`
    /// are CMAKE_<LANG>_FLAGS (the cc crate's flags for this compiler).
    pub(crate) fn object_args(
        &self,
        t: &Target,
        file: &str,
        compiler_flags: &[String],
        dirs: &[(&str, &Path)],
        variant: Option<&str>,
    ) -> Result<Vec<String>, String> {
        let cpp = file.ends_with(".cpp");
        let warnings = match if cpp { &t.cxx_flags } else { &t.c_flags } {
            None => Vec::new(),
            Some(n) => self
                .warnings
                .get(n)
                .cloned()
                .ok_or_else(|| format!("target {} names unknown warning set `{n}`", t.name))?,
        };
        let mut args: Vec<String> = t.defines.iter().map(|d| format!("-D{d}")).collect();
        if let Some(extra) = t.source_defines.get(file) {
            args.extend(extra.iter().map(|d| format!("-D{d}")));
        }
        args.extend(t.includes.iter().map(|i| format!("-I{}", expand(i, dirs))));
        args.extend(compiler_flags.iter().cloned());
        args.extend(self.release.iter().cloned());
        args.extend(self.pic.iter().cloned());
        args.extend(warnings);
        args.extend(t.options.iter().cloned());
        if let Some(last) = variant.and_then(|v| t.last_flags.get(v)) {
            args.extend(last.iter().cloned());
        }
        args.push(if cpp { self.cxx_std.clone() } else { self.c_std.clone() });
        Ok(args)
    }
}
