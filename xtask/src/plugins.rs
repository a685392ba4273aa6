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
//! fails with one message naming it.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

#[path = "../../plugins/manifest.rs"]
mod manifest;
use manifest::Manifest;

fn which(p: &str) -> bool {
    std::env::var_os("PATH").map(|ps| std::env::split_paths(&ps).any(|d| d.join(p).is_file())).unwrap_or(false)
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
    /// Build only the parity CPU plugin (the reference's kernels: -march=native without
    /// AVX512-FP16, no LLAMAFILE) into target/ggml-parity/plugins, for `SD_PLUGIN_PATH`.
    #[arg(long = "parity", conflicts_with_all = ["backends", "cpu_variants", "out"])]
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
    // Check toolkits before building anything.
    for m in all.iter().filter(|m| backends.contains(&m.name)) {
        let missing_os = m.requires_os.as_deref().is_some_and(|os| os != std::env::consts::OS);
        let missing: Vec<&String> = m.requires_programs.iter().filter(|p| !which(p)).collect();
        if missing_os || !missing.is_empty() {
            bail!(
                "cannot build the {} plugin{}: it needs {}",
                m.name,
                if missing.is_empty() {
                    format!(" on {}", std::env::consts::OS)
                } else {
                    format!(
                        " (not found on PATH: {})",
                        missing.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                    )
                },
                m.toolkit.as_deref().unwrap_or("its toolkit"),
            );
        }
    }
    // The default build (ggml-base, cpu, rpc) comes from ggml-sys's build script.
    let t = std::time::Instant::now();
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo.args(["build", "--release", "-p", "ggml-sys"]).current_dir(crate::workspace_root());
    if all_variants && backends.iter().any(|b| b == "cpu") {
        cargo.env("SD_GGML_CPU_VARIANTS", "all");
    }
    run_cmd(&mut cargo)?;
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
        if !which("cmake") {
            bail!("the {} plugin is built with CMake (its toolkit's build needs it): install cmake", m.name);
        }
        let build = root.join(format!("build-{}", m.name));
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
        ]);
        cfg.args(&m.cmake);
        run_cmd(&mut cfg)?;
        let mut b = Command::new("cmake");
        b.arg("--build").arg(&build).args(["--parallel", &jobs, "--target"]).args(&m.targets);
        run_cmd(&mut b)?;
        for t in &m.targets {
            let name = format!("lib{t}.so");
            let to = dest.join(&name);
            install(&build.join("bin").join(&name), &to)?;
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
    std::fs::copy(from, &tmp).with_context(|| from.display().to_string())?;
    std::fs::rename(&tmp, to).with_context(|| to.display().to_string())?;
    Ok(())
}
