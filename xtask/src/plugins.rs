//! `cargo xtask plugins`: build vendor backend plugins from the pinned ggml and install them.
//!
//! ```text
//! cargo xtask plugins [--backend cpu,rpc,cuda,vulkan,metal] [--cpu-variants default|all] [--out DIR]
//! cargo xtask plugins --parity
//! ```
//!
//! `--parity` builds one CPU plugin with the reference's kernels into
//! `target/ggml-parity/plugins` (see ARCHITECTURE.md, "Parity").
//!
//! The default plugins (cpu, rpc: `build = "ggml-sys"` in their plugin.toml) are
//! compiled by `ggml-sys`'s build script without CMake; `--cpu-variants all`
//! asks it for every CPU variant (`SD_GGML_CPU_VARIANTS=all`). The vendor
//! backends list CMake options and module targets in their plugin.toml and are
//! configured with CMake (their toolkits need it anyway) in their own build
//! directory (`target/ggml/build-<name>`). A backend whose toolkit is missing
//! fails with one message naming it, before anything is built; a build that fails
//! installs nothing.
//!
//! A toolkit with an SDK layout (`sdk_env` in plugin.toml, e.g. `VULKAN_SDK`) is taken
//! from that variable, else from `target/toolkits/<name>` where `--fetch-toolkit`
//! (the plugin folder's `fetch` script) unpacked one. `--cache DIR` keeps each built
//! vendor plugin in `DIR/<name>-<key>`, the key hashing what the build depends on (the
//! ggml pin, plugin.toml, the CMake parent, the toolkit's versions, the compiler's),
//! and installs from there when the key matches.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

#[path = "../../plugins/manifest.rs"]
mod manifest;
use manifest::Manifest;

fn which(p: &str) -> bool {
    std::env::var_os("PATH").map(|ps| std::env::split_paths(&ps).any(|d| d.join(p).is_file())).unwrap_or(false)
}

/// Where a backend's toolkit lies when it has an SDK layout: the directory its `sdk_env`
/// variable names, else the one `--fetch-toolkit` fills (when it was filled).
fn sdk_root(m: &Manifest) -> Option<(PathBuf, String)> {
    let var = m.sdk_env.as_deref()?;
    if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
        return Some((PathBuf::from(v), format!("{var} (from the environment)")));
    }
    let fetched = fetched_toolkit(m);
    fetched.join("VERSIONS").is_file().then(|| (fetched.clone(), format!("{var}={} (fetched)", fetched.display())))
}

/// The folder `--fetch-toolkit` fills for `m`.
fn fetched_toolkit(m: &Manifest) -> PathBuf {
    crate::workspace_root().join("target/toolkits").join(&m.name)
}

/// Whether program `p` is in the SDK's `bin/` or on `PATH`.
fn has_program(sdk: Option<&std::path::Path>, p: &str) -> bool {
    sdk.is_some_and(|s| s.join("bin").join(p).is_file()) || which(p)
}

/// The version `#define`d in the manifest's required header (first of the SDK's `include/`
/// and the system's include directories that has it), or why there is none to use.
fn header_version(m: &Manifest, sdk: Option<&std::path::Path>) -> Result<(), String> {
    let Some(h): Option<&manifest::RequiredHeader> = m.requires_header.as_ref() else { return Ok(()) };
    let dirs =
        sdk.map(|s| s.join("include")).into_iter().chain(["/usr/local/include", "/usr/include"].map(PathBuf::from));
    let Some(file) = dirs.map(|d| d.join(&h.path)).find(|f| f.is_file()) else {
        return Err(format!("{} not found", h.path));
    };
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    let found = text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("#define") && w.next() == Some(h.define.as_str())).then(|| w.next()?.parse::<u64>().ok())?
    });
    match found {
        Some(v) if v >= h.min => Ok(()),
        Some(v) => Err(format!("{} has {} {v}, older than the {} it needs", file.display(), h.define, h.min)),
        None => Err(format!("{} defines no numeric {}", file.display(), h.define)),
    }
}

/// Runs the backend's `fetch` script into `target/toolkits/<name>`.
fn fetch_toolkit(m: &Manifest) -> Result<()> {
    let Some(script) = &m.fetch else {
        bail!("the {} plugin has no toolkit fetcher (plugins/{}/plugin.toml has no `fetch`)", m.name, m.name);
    };
    let script = crate::workspace_root().join("plugins").join(&m.name).join(script);
    let dest = fetched_toolkit(m);
    // A toolkit this same script fetched is kept (the script pins every package version, so
    // its text names the toolkit): a second build skips the package lists' download.
    let stamp = dest.join(".fetched-by-sha256");
    let script_hash = {
        use sha2::{Digest, Sha256};
        let text = std::fs::read(&script).with_context(|| script.display().to_string())?;
        Sha256::digest(&text).iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    if dest.join("VERSIONS").is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == script_hash) {
        println!("the {} toolkit: already fetched into {} by this {}", m.name, dest.display(), script.display());
        return Ok(());
    }
    let st = Command::new("bash").arg(&script).arg(&dest).status().with_context(|| script.display().to_string())?;
    if !st.success() {
        bail!("fetching the {} toolkit failed ({}, {st}); nothing was built", m.name, script.display());
    }
    std::fs::write(&stamp, script_hash).with_context(|| stamp.display().to_string())?;
    Ok(())
}

fn manifests() -> Result<Vec<Manifest>> {
    let dir = crate::workspace_root().join("plugins");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| dir.display().to_string())? {
        let p = e?.path().join("plugin.toml");
        if p.exists() {
            out.push(Manifest::read(&p).map_err(anyhow::Error::msg)?);
        }
    }
    out.sort_by(|a: &Manifest, b| a.name.cmp(&b.name));
    Ok(out)
}

fn run_cmd(cmd: &mut Command) -> Result<()> {
    let st = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed with {st}");
    }
    Ok(())
}

/// `cargo xtask plugins` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// Backends to build (the names of plugins/*/plugin.toml).
    #[arg(
        long = "backend",
        value_name = "cpu,rpc,cuda,vulkan,metal",
        value_delimiter = ',',
        default_value = "cpu,rpc"
    )]
    backends: Vec<String>,
    /// CPU variants: the default list of plugins/cpu/plugin.toml, or every one.
    #[arg(long = "cpu-variants", value_enum, default_value_t = CpuVariants::Default)]
    cpu_variants: CpuVariants,
    /// Install into DIR instead of target/ggml/plugins.
    #[arg(long = "out", value_name = "DIR")]
    out: Option<PathBuf>,
    /// First fetch the toolkit of each vendor backend that has a fetcher (plugin.toml's
    /// `fetch`) into target/toolkits/<name>.
    #[arg(long = "fetch-toolkit")]
    fetch_toolkit: bool,
    /// The CUDA plugin's GPU architectures (CMAKE_CUDA_ARCHITECTURES, e.g. `90` for Hopper);
    /// ggml's default list otherwise.
    #[arg(long = "cuda-arch", value_name = "ARCHS")]
    cuda_arch: Option<String>,
    /// Keep built vendor plugins in DIR/<name>-<key> and reuse them when the key (ggml pin,
    /// manifest, toolkit and compiler versions) matches.
    #[arg(long = "cache", value_name = "DIR")]
    cache: Option<PathBuf>,
    /// Build only the parity CPU plugin (the reference's kernels: -march=native without
    /// AVX512-FP16, no LLAMAFILE) into target/ggml-parity/plugins, for `SD_PLUGIN_PATH`.
    #[arg(long = "parity", conflicts_with_all = ["backends", "cpu_variants", "out", "fetch_toolkit", "cache", "cuda_arch"])]
    parity: bool,
}

/// `--parity`: ggml-sys built once more, with the parity variant only, in its own target
/// directory (so that the workspace's build keeps its environment and is not redone).
fn build_parity_plugin() -> Result<()> {
    let root = crate::workspace_root();
    let dir = root.join("target/ggml-parity");
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo
        .args(["build", "--release", "-p", "ggml-sys", "--target-dir"])
        .arg(root.join("target/parity-build"))
        .current_dir(&root)
        .env("SD_GGML_CPU_VARIANTS", "native-f32acc")
        .env("SD_GGML_CPU_LLAMAFILE", "off")
        .env("SD_GGML_BUILD_DIR", &dir);
    run_cmd(&mut cargo)?;
    println!("{}", dir.join("plugins").display());
    Ok(())
}

/// `--cpu-variants`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum CpuVariants {
    Default,
    All,
}

/// Entry point.
pub fn run(args: Args) -> Result<()> {
    if args.parity {
        return build_parity_plugin();
    }
    let backends: Vec<String> = args.backends.iter().map(|s| s.trim().to_ascii_lowercase()).collect();
    let all_variants = args.cpu_variants == CpuVariants::All;
    let out = args.out;
    let all = manifests()?;
    for b in &backends {
        if !all.iter().any(|m| &m.name == b) {
            bail!(
                "unknown backend `{b}`; plugins/ has: {}",
                all.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", ")
            );
        }
    }
    let selected: Vec<&Manifest> = all.iter().filter(|m| backends.contains(&m.name)).collect();
    if args.fetch_toolkit {
        for m in selected.iter().filter(|m| m.fetch.is_some()) {
            fetch_toolkit(m)?;
        }
    }
    // Check toolkits before building anything.
    let mut sdks = std::collections::BTreeMap::new();
    for m in &selected {
        let missing_os = m.requires_os.as_deref().is_some_and(|os| os != std::env::consts::OS);
        let sdk = sdk_root(m);
        let sdk_dir = sdk.as_ref().map(|(d, _)| d.as_path());
        let missing: Vec<&String> = m.requires_programs.iter().filter(|p| !has_program(sdk_dir, p)).collect();
        let what = if missing_os {
            Some(format!(" on {}", std::env::consts::OS))
        } else if !missing.is_empty() {
            let names = missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
            Some(match &sdk {
                Some((d, from)) => format!(" (not found in {} nor on PATH: {names}; {from})", d.join("bin").display()),
                None => format!(" (not found on PATH: {names})"),
            })
        } else {
            header_version(m, sdk_dir).err().map(|e| format!(" ({e})"))
        };
        if let Some(what) = what {
            bail!(
                "cannot build the {} plugin{what}: it needs {}",
                m.name,
                m.toolkit.as_deref().unwrap_or("its toolkit"),
            );
        }
        if let Some((dir, from)) = sdk {
            println!("the {} toolkit: {from}", m.name);
            sdks.insert(m.name.clone(), dir);
        }
    }
    if selected.iter().any(|m| m.build.as_deref() != Some("ggml-sys")) && !which("cmake") {
        let names: Vec<&str> = selected.iter().filter(|m| m.build.is_none()).map(|m| m.name.as_str()).collect();
        bail!("the {} plugin is built with CMake (its toolkit's build needs it): install cmake", names.join(", "));
    }
    // The default build (ggml-base, cpu, rpc) comes from ggml-sys's build script.
    let t = std::time::Instant::now();
    // (Vendor plugins alone need only the source tree, which this xtask's ggml-sys names.)
    if selected.iter().any(|m| m.build.as_deref() == Some("ggml-sys")) {
        let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cargo.args(["build", "--release", "-p", "ggml-sys"]).current_dir(crate::workspace_root());
        if all_variants && backends.iter().any(|b| b == "cpu") {
            cargo.env("SD_GGML_CPU_VARIANTS", "all");
        }
        run_cmd(&mut cargo)?;
    }
    let root = crate::workspace_root().join("target/ggml");
    let src = crate::ggml::source_dir();
    let default_plugins = crate::ggml::plugin_dir();
    let dest = out.unwrap_or_else(|| default_plugins.clone());
    std::fs::create_dir_all(&dest)?;
    let jobs = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).to_string();
    let mut installed = Vec::new();
    for m in all.iter().filter(|m| backends.contains(&m.name)) {
        if m.build.as_deref() == Some("ggml-sys") {
            // already compiled above; copy them when --out names another directory
            let prefix = format!("libggml-{}", m.name);
            for e in std::fs::read_dir(&default_plugins)? {
                let from = e?.path();
                let name = from.file_name().unwrap_or_default().to_string_lossy().into_owned();
                if name.starts_with(&prefix) && name.ends_with(".so") {
                    let to = dest.join(&name);
                    if to != from {
                        install(&from, &to)?;
                    }
                    installed.push(to);
                }
            }
            continue;
        }
        let sdk = sdks.get(&m.name);
        let extra_cmake: Vec<String> = match (&args.cuda_arch, m.name.as_str()) {
            (Some(arch), "cuda") => vec![format!("-DCMAKE_CUDA_ARCHITECTURES={arch}")],
            _ => Vec::new(),
        };
        let cached = match &args.cache {
            Some(dir) => {
                Some(dir.join(format!("{}-{}", m.name, cache_key(m, sdk.map(PathBuf::as_path), &extra_cmake)?)))
            }
            None => None,
        };
        if let Some(c) = cached.as_ref().filter(|c| m.targets.iter().all(|t| c.join(format!("lib{t}.so")).is_file())) {
            println!("the {} plugin from the cache: {}", m.name, c.display());
            for t in &m.targets {
                let name = format!("lib{t}.so");
                install(&c.join(&name), &dest.join(&name))?;
                installed.push(dest.join(name));
            }
            continue;
        }
        let build = root.join(format!("build-{}", m.name));
        // A toolkit other than the one this build directory was configured with: configure
        // afresh (CMake keeps the paths it found in its cache).
        let stamp = build.join("sd-toolkit.txt");
        let toolkit_id = sdk.map(|d| d.display().to_string()).unwrap_or_default();
        if std::fs::read_to_string(&stamp).is_ok_and(|s| s != toolkit_id) {
            std::fs::remove_file(build.join("CMakeCache.txt")).ok();
        }
        std::fs::create_dir_all(&build)?;
        std::fs::write(&stamp, &toolkit_id)?;
        let mut cfg = Command::new("cmake");
        cfg.arg("-S").arg(crate::workspace_root().join("plugins/cmake")).arg("-B").arg(&build);
        cfg.arg(format!("-DGGML_SOURCE_DIR={}", src.display()));
        cfg.args([
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=ON",
            "-DGGML_BACKEND_DL=ON",
            "-DGGML_CPU=OFF",
            "-DGGML_BUILD_TESTS=OFF",
            "-DGGML_BUILD_EXAMPLES=OFF",
            // no RUNPATH into the build tree or the toolkit: at run time the plugin takes the
            // libggml-base sd-cli loaded and the system's driver loader
            "-DCMAKE_SKIP_BUILD_RPATH=ON",
        ]);
        cfg.args(&m.cmake).args(&extra_cmake);
        let mut b = Command::new("cmake");
        b.arg("--build").arg(&build).args(["--parallel", &jobs, "--target"]).args(&m.targets);
        if let (Some(var), Some(dir)) = (&m.sdk_env, sdk) {
            // the toolkit's programs first on PATH (CMake finds nvcc there, ggml glslc)
            let path = std::env::var_os("PATH").unwrap_or_default();
            let path = std::env::join_paths(std::iter::once(dir.join("bin")).chain(std::env::split_paths(&path)))?;
            for c in [&mut cfg, &mut b] {
                c.env(var, dir).env("PATH", &path);
            }
        }
        let t = std::time::Instant::now();
        run_cmd(&mut cfg).with_context(|| format!("configuring the {} plugin; nothing was installed", m.name))?;
        run_cmd(&mut b).with_context(|| format!("building the {} plugin; nothing was installed", m.name))?;
        println!("the {} plugin built in {:.0} s", m.name, t.elapsed().as_secs_f64());
        for t in &m.targets {
            let name = format!("lib{t}.so");
            let to = dest.join(&name);
            let from = build.join("bin").join(&name);
            if let Some(c) = &cached {
                std::fs::create_dir_all(c)?;
                install(&from, &c.join(&name))?;
            }
            install(&from, &to)?;
            installed.push(to);
        }
    }
    println!("built in {:.0} s; installed into {}:", t.elapsed().as_secs_f64(), dest.display());
    for p in installed {
        println!("  {}", p.file_name().unwrap().to_string_lossy());
    }
    Ok(())
}

/// Copies a plugin into place through a temporary name, so a running process
/// that has the old file mapped is unaffected.
fn install(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    let tmp = to.with_extension("so.tmp");
    let done = std::fs::copy(from, &tmp)
        .with_context(|| from.display().to_string())
        .and_then(|_| std::fs::rename(&tmp, to).with_context(|| to.display().to_string()));
    if done.is_err() {
        std::fs::remove_file(&tmp).ok();
    }
    done
}

/// The `--cache` key of a vendor plugin: a hash of the extra CMake options (`--cuda-arch`),
/// the ggml pin, the backend's manifest, the CMake parent project, the toolkit's `VERSIONS` (or its path when it has none) and
/// the C++ compiler's version.
fn cache_key(m: &Manifest, sdk: Option<&std::path::Path>, extra_cmake: &[String]) -> Result<String> {
    use sha2::{Digest, Sha256};
    let root = crate::workspace_root();
    let mut h = Sha256::new();
    for a in extra_cmake {
        h.update(a.as_bytes());
    }
    for f in ["crates/ggml-sys/ggml-source.toml", "plugins/cmake/CMakeLists.txt"]
        .iter()
        .map(|f| root.join(f))
        .chain([root.join("plugins").join(&m.name).join("plugin.toml")])
    {
        h.update(std::fs::read(&f).with_context(|| f.display().to_string())?);
    }
    if let Some(d) = sdk {
        h.update(std::fs::read(d.join("VERSIONS")).unwrap_or_else(|_| d.display().to_string().into_bytes()));
    }
    // the compiler's and each required program's version (e.g. glslc's)
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let programs =
        m.requires_programs.iter().map(|p| match sdk.map(|d| d.join("bin").join(p)).filter(|b| b.is_file()) {
            Some(b) => b.into_os_string(),
            None => p.into(),
        });
    for p in std::iter::once(cxx.into()).chain(programs) {
        let out = Command::new(&p).arg("--version").output().with_context(|| format!("running {p:?} --version"))?;
        h.update(&out.stdout);
    }
    Ok(h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect())
}
