//! `cargo xtask install --prefix DIR` and `cargo xtask dist`: an `sd-cli` that runs wherever it is moved.
//!
//! The layout (the same under a prefix and inside the release archive):
//!
//! ```text
//! bin/sd-cli                      run path $ORIGIN:$ORIGIN/../lib (the build tree's is removed)
//! lib/libggml-base.so.X.Y.Z       the core library, under its soname and link name too
//! lib/sd-rs/plugins/libggml-*.so  the default plugins: CPU variants, RPC
//! share/doc/sd-rs/                licenses (sd-rs, ggml) and README
//! ```
//!
//! `sd-cli` looks for plugins beside itself first (its directory, then
//! `../lib/sd-rs/plugins`: `sd_backends::registry::INSTALL_PLUGIN_DIR`), so a plugin built
//! later (`cargo xtask plugins --backend vulkan --out PREFIX/lib/sd-rs/plugins`) is picked
//! up. `cargo install --path crates/sd-cli` alone cannot place the core library (cargo
//! installs binaries only, and removes its build directory): use `cargo xtask install`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};
use ggml_sys::names::{self, TargetOs};

/// Options of `install`.
#[derive(clap::Args, Debug)]
pub struct InstallArgs {
    /// Install under DIR: DIR/bin/sd-cli, DIR/lib, DIR/lib/sd-rs/plugins.
    #[arg(long = "prefix", value_name = "DIR")]
    pub prefix: PathBuf,
    #[command(flatten)]
    build: BuildArgs,
}

/// Options of `dist`.
#[derive(clap::Args, Debug)]
pub struct DistArgs {
    /// Where the archive is written (default target/dist).
    #[arg(long = "out", value_name = "DIR")]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    build: BuildArgs,
}

/// Which `sd-cli` is installed.
#[derive(clap::Args, Debug)]
pub(crate) struct BuildArgs {
    /// Cargo profile to build sd-cli with (default release).
    #[arg(long = "profile", default_value = "release")]
    pub profile: String,
    /// Install this already built sd-cli instead of building one (it must come from this
    /// checkout's build: the core library and plugins are this build's).
    #[arg(long = "bin", value_name = "PATH")]
    pub bin: Option<PathBuf>,
}

/// Runs `install`.
pub fn install(a: &InstallArgs) -> Result<()> {
    let bin = built_sd_cli(&a.build)?;
    lay_out(&bin, &a.prefix)?;
    println!("installed sd-cli into {}", a.prefix.join("bin").display());
    Ok(())
}

/// Runs `dist`: the installed layout in `sd-rs-<version>-<arch>-<os>/`, archived as a gzipped tar.
pub fn dist(a: &DistArgs) -> Result<()> {
    let bin = built_sd_cli(&a.build)?;
    let out = a.out.clone().unwrap_or_else(|| crate::workspace_root().join("target/dist"));
    let name = format!("sd-rs-{}-{}-{}", env!("CARGO_PKG_VERSION"), std::env::consts::ARCH, std::env::consts::OS);
    let root = out.join(&name);
    if root.exists() {
        fs::remove_dir_all(&root).with_context(|| format!("removing the old {}", root.display()))?;
    }
    lay_out(&bin, &root)?;
    let archive = out.join(format!("{name}.tar.gz"));
    let st =
        Command::new("tar").arg("-czf").arg(&archive).arg("-C").arg(&out).arg(&name).status().context("running tar")?;
    if !st.success() {
        bail!("tar failed ({st}) writing {}", archive.display());
    }
    println!("{}", archive.display());
    Ok(())
}

/// The sd-cli to install: `--bin`, or one built now with `--profile`.
fn built_sd_cli(a: &BuildArgs) -> Result<PathBuf> {
    if let Some(b) = &a.bin {
        return Ok(b.clone());
    }
    let root = crate::workspace_root();
    let st = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["build", "-p", "sd-cli", "--profile", &a.profile])
        .current_dir(&root)
        .status()
        .context("running cargo build")?;
    if !st.success() {
        bail!("cargo build -p sd-cli --profile {} failed ({st})", a.profile);
    }
    let dir = if a.profile == "dev" { "debug" } else { a.profile.as_str() };
    Ok(root.join("target").join(dir).join(format!("sd-cli{}", std::env::consts::EXE_SUFFIX)))
}

/// Lays out `bin`, this build's core library and default plugins, and the licenses under
/// `prefix` (see the module's documentation).
fn lay_out(bin: &Path, prefix: &Path) -> Result<()> {
    let os = TargetOs::current();
    let (bin_dir, lib_dir) = (prefix.join("bin"), prefix.join("lib"));
    let plugin_dir = prefix.join(sd_backends::registry::INSTALL_PLUGIN_DIR);
    let doc_dir = prefix.join("share/doc/sd-rs");
    for d in [&bin_dir, &lib_dir, &plugin_dir, &doc_dir] {
        fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    // the binary, its run path without the build tree
    let mut exe = fs::read(bin).with_context(|| format!("reading {}", bin.display()))?;
    if !keep_relative_run_path(&mut exe) && os == TargetOs::Elf {
        bail!("{}: no run path {RELATIVE_RUN_PATH}:<build tree> (not built by this checkout?)", bin.display());
    }
    let build_lib = crate::ggml::lib_dir();
    let dest = bin_dir.join(bin.file_name().context("--bin names no file")?);
    write_executable(&dest, &exe)?;
    // the core library under each of its names (copies: an archive keeps no symlink for
    // every unpacker)
    let core = names::core_names(os, ggml_sys::GGML_VERSION);
    let core_src = build_lib.join(&core.file);
    for n in std::iter::once(&core.file).chain(&core.aliases) {
        copy(&core_src, &lib_dir.join(n))?;
    }
    // the default plugins
    let mut plugins = 0;
    let from = crate::ggml::plugin_dir();
    for e in fs::read_dir(&from).with_context(|| format!("reading {}", from.display()))? {
        let p = e?.path();
        let Some(file) = p.file_name().and_then(|n| n.to_str()) else { continue };
        if names::plugin_target(os, file).is_some() {
            copy(&p, &plugin_dir.join(file))?;
            plugins += 1;
        }
    }
    if plugins == 0 {
        bail!("no plugin in {}: build sd-cli first", from.display());
    }
    // licenses
    let root = crate::workspace_root();
    fs::write(
        doc_dir.join("LICENSES.md"),
        "sd-rs: MIT (Cargo.toml `license`).\nggml: MIT, its LICENSE file beside this one (ggml-LICENSE).\n",
    )?;
    if let Some(l) = ggml_license() {
        copy(&l, &doc_dir.join("ggml-LICENSE"))?;
    }
    copy(&root.join("README.md"), &doc_dir.join("README.md"))?;
    Ok(())
}

/// ggml's LICENSE: in its source tree or the directory above (a llama.cpp checkout).
fn ggml_license() -> Option<PathBuf> {
    let src = crate::ggml::source_dir();
    [src.join("LICENSE"), src.join("../LICENSE")].into_iter().find(|p| p.is_file())
}

/// The run path sd-cli's build script writes before the build tree's directory.
const RELATIVE_RUN_PATH: &str = "$ORIGIN:$ORIGIN/../lib";

/// Cuts the ELF run path string in `exe` after its relative entries ([`RELATIVE_RUN_PATH`]),
/// overwriting the build tree's absolute directory with NUL bytes (the dynamic string table
/// keeps its size; the string just ends earlier): what `chrpath -r` does. Whether an entry
/// was removed.
fn keep_relative_run_path(exe: &mut [u8]) -> bool {
    let needle = format!("{RELATIVE_RUN_PATH}:");
    let Some(at) = exe.windows(needle.len()).position(|w| w == needle.as_bytes()) else { return false };
    let colon = at + needle.len() - 1;
    let end = exe[colon..].iter().position(|&c| c == 0).map_or(exe.len(), |e| colon + e);
    exe[colon..end].fill(0);
    true
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn write_executable(to: &Path, bytes: &[u8]) -> Result<()> {
    let _ = fs::remove_file(to);
    fs::write(to, bytes).with_context(|| format!("writing {}", to.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(to, fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::keep_relative_run_path;

    #[test]
    fn the_build_tree_leaves_the_run_path_and_the_rest_stays() {
        let mut b = b"xx\0$ORIGIN:$ORIGIN/../lib:/t/debug/ggml-lib\0libc.so.6\0".to_vec();
        let len = b.len();
        assert!(keep_relative_run_path(&mut b));
        assert_eq!(b.len(), len);
        let s: Vec<&[u8]> = b.split(|&c| c == 0).filter(|s| !s.is_empty()).collect();
        assert_eq!(s, [&b"xx"[..], b"$ORIGIN:$ORIGIN/../lib", b"libc.so.6"]);
        assert!(!keep_relative_run_path(&mut b), "already relative");
        assert!(!keep_relative_run_path(&mut b"$ORIGIN\0/abs\0".to_vec()), "another run path");
    }
}
