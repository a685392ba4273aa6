//! Build script: fetch the pinned ggml source and compile it without CMake.
//!
//! 1. `ggml-source.toml` names one crates.io package and its sha256. We ask cargo
//!    to download it (`cargo metadata` on a manifest generated in OUT_DIR), then
//!    compare the checksum cargo recorded in that lockfile with the pin.
//! 2. The C/C++ compiler that the `cc` crate finds compiles `libggml-base` (linked
//!    by us) and the default plugins (the RPC module and the CPU variants named in
//!    `plugins/cpu/plugin.toml` for the target's architecture) as shared libraries, with
//!    the definitions and ISA flags of ggml's own CMake files as recorded in
//!    `ggml-build.toml` (its CPU branch chosen by the TARGET's architecture and OS,
//!    `build/spec.rs`, never the host's: x86-64, or AArch64 Linux), into a
//!    directory shared by every profile: `<target>/ggml/`. A file lock serialises
//!    concurrent builds of that directory; a cache key per library skips work
//!    already done.
//!    The RPC module is compiled from a copy of its directory with
//!    `patches/rpc-faults.toml` applied, and every CPU variant from a copy of
//!    `src/ggml-cpu` with `patches/cpu-speed.toml` applied (`build/patch.rs`: exact
//!    find/replace hunks, each anchor required exactly once, so a moved pin stops the
//!    build with the hunk's name instead of compiling a half-patched file; the patch's
//!    hash is part of the cache key of the libraries built from it).
//! 3. The bindings are committed (`src/bindings.rs`, made by `cargo xtask
//!    bindings`, which needs libclang); this script only hashes the headers they
//!    came from, so a test can tell when they are stale.
//!
//! Overrides: `SD_GGML_SOURCE_DIR` (use a local ggml tree; the pin is then not
//! checked and a warning says so), `SD_GGML_BUILD_DIR` (where to build),
//! `SD_GGML_CPU_VARIANTS` (`all`, or a comma-separated list of the variants of the
//! target's branch in `ggml-build.toml`, instead of the defaults),
//! `SD_GGML_CPU_LLAMAFILE=off` (the CPU plugins without ggml's LLAMAFILE GEMM, the
//! reference's kernel order, for parity work; built into `target/ggml-nollamafile` unless
//! `SD_GGML_BUILD_DIR` says where, so it never replaces the default plugins).

#[path = "build/compile.rs"]
mod compile;
#[path = "../../plugins/manifest.rs"]
mod manifest;
#[path = "src/names.rs"]
#[allow(dead_code)] // the build uses the naming half; the loader the parsing half
mod names;
#[path = "build/patch.rs"]
mod patch;
#[path = "build/spec.rs"]
mod spec;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

#[derive(serde::Deserialize)]
struct Pin {
    package: String,
    version: String,
    sha256: String,
    subdir: String,
    ggml_version: String,
}

/// The public headers the bindings are generated from (besides `wrapper.h`), in
/// hashing order. `cargo xtask bindings` records their hash in `src/bindings.rs`.
const BOUND_HEADERS: &[&str] = &["ggml.h", "ggml-alloc.h", "ggml-backend.h", "gguf.h"];

fn main() {
    if let Err(e) = run() {
        // A build script reports failure by panicking; make the message the whole story.
        panic!("\n\nggml-sys: {e}\n\n");
    }
}

fn run() -> Result<(), String> {
    let manifest_dir = PathBuf::from(env("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(env("OUT_DIR")?);
    let workspace = manifest_dir.parent().and_then(Path::parent).ok_or("cannot find the workspace root")?.to_path_buf();
    let pin_path = manifest_dir.join("ggml-source.toml");
    let rpc_patch = manifest_dir.join("patches/rpc-faults.toml");
    let cpu_patch = manifest_dir.join("patches/cpu-speed.toml");
    let spec_path = manifest_dir.join("ggml-build.toml");
    let cpu_path = workspace.join("plugins/cpu/plugin.toml");
    let manifest_rs = workspace.join("plugins/manifest.rs");
    for p in [&pin_path, &spec_path, &cpu_path, &rpc_patch, &cpu_patch, &manifest_rs] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build/compile.rs");
    println!("cargo:rerun-if-changed=build/patch.rs");
    println!("cargo:rerun-if-changed=build/spec.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    for v in ["SD_GGML_SOURCE_DIR", "SD_GGML_BUILD_DIR", "SD_GGML_CPU_VARIANTS", "SD_GGML_CPU_LLAMAFILE"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let pin: Pin = read_toml(&pin_path)?;
    let spec: spec::Spec = read_toml(&spec_path)?;
    let llamafile = match std::env::var("SD_GGML_CPU_LLAMAFILE").as_deref() {
        Err(_) | Ok("on") | Ok("1") => true,
        Ok("off") | Ok("0") => false,
        Ok(v) => return Err(format!("SD_GGML_CPU_LLAMAFILE={v}: expected on or off")),
    };
    // The CPU backend's branch follows the target, never the host running this script.
    let target_arch = env("CARGO_CFG_TARGET_ARCH")?;
    let mut cpu_target =
        spec.cpu.for_target(&target_arch, &std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default(), llamafile)?;
    let cpu_variants = cpu_target.choose_variants(
        std::env::var("SD_GGML_CPU_VARIANTS").ok().as_deref(),
        manifest::Manifest::read(&cpu_path)?.cpu_variants(&target_arch),
    )?;

    let local = std::env::var_os("SD_GGML_SOURCE_DIR");
    let ggml_src = match &local {
        Some(dir) => {
            println!(
                "cargo:warning=SD_GGML_SOURCE_DIR is set: building ggml from {} (the pin in ggml-source.toml is not checked)",
                PathBuf::from(dir).display()
            );
            PathBuf::from(dir)
        }
        None => fetch_pinned(&pin, &out_dir)?,
    };
    check_version(&ggml_src, &pin)?;

    let build_root = match std::env::var_os("SD_GGML_BUILD_DIR") {
        Some(d) => PathBuf::from(d),
        None => target_dir(&out_dir)?.join(if llamafile { "ggml" } else { "ggml-nollamafile" }),
    };
    fs::create_dir_all(&build_root).map_err(|e| format!("{}: {e}", build_root.display()))?;
    // One name for one directory, so that checkouts sharing it (a symlink) share its cache keys.
    let build_root = build_root.canonicalize().map_err(|e| format!("{}: {e}", build_root.display()))?;
    let cc_root = build_root.join("cc");
    let built_lib_dir = cc_root.join("lib");
    let gen_include = cc_root.join("include");
    for d in [&built_lib_dir, &gen_include] {
        fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    write_if_changed(
        &gen_include.join("ggml-version.h"),
        &format!("#pragma once\n\n#define GGML_VERSION \"{}\"\n#define GGML_COMMIT  \"unknown\"\n", pin.ggml_version),
    )?;

    let lock_path = build_root.join(".lock");
    let lock = fs::File::create(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    let tc = compile::Toolchain::detect(&out_dir)?;
    cpu_target.flags_if_accepted.retain(|f| tc.accepts_cxx_flag(f, &out_dir));
    // The RPC module is compiled from a patched copy (patches/rpc-faults.toml: deadlines,
    // no abort on a lost server, no assert on a malformed message).
    // Every CPU variant is compiled from a patched copy of src/ggml-cpu (patches/cpu-speed.toml:
    // kernels that write the same bytes faster).
    let patched = |prefix: &'static str, patch_file: &Path| -> Result<compile::PatchedDir, String> {
        let name = Path::new(prefix).file_name().ok_or("bad patched directory")?;
        let applied = patch::apply(patch_file, &ggml_src.join(prefix), &cc_root.join("patched").join(name))?;
        let mut text = fs::read(patch_file).map_err(|e| format!("{}: {e}", patch_file.display()))?;
        text.extend_from_slice(&applied.added_text);
        for a in &applied.added {
            println!("cargo:rerun-if-changed={}", patch_file.with_extension("").join(a).display());
        }
        let added = applied.added.iter().map(|a| format!("{prefix}/{a}")).collect();
        Ok(compile::PatchedDir { prefix, dir: applied.dir, key: format!("{:x}", Sha256::digest(text)), added })
    };
    let rpc = patched("src/ggml-rpc", &rpc_patch)?;
    let cpu = patched("src/ggml-cpu", &cpu_patch)?;
    let libs = compile::plan(
        &spec,
        &cpu_target,
        &tc,
        &ggml_src,
        &gen_include,
        &cc_root.join("obj"),
        &cpu_variants,
        &pin.ggml_version,
        &rpc,
        &cpu,
    )?;
    let os = names::TargetOs::from_target_os(&std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default());
    let plugin_files: Vec<String> =
        libs.iter().map(|l| l.file.clone()).filter(|f| !names::is_core_file(os, f)).collect();
    // The registry package is immutable; a local tree is identified by its files' times.
    let salt = match &local {
        Some(_) => tree_stamp(&ggml_src),
        None => format!("{} {} {}", pin.package, pin.version, pin.sha256),
    };
    let t = std::time::Instant::now();
    // the names the plugins link by (-lggml-base) and load by (the soname)
    let aliases = || -> Result<(), String> {
        let core = names::core_names(os, &pin.ggml_version);
        for alias in core.aliases {
            install(&built_lib_dir.join(&core.file), &built_lib_dir.join(alias))?;
        }
        Ok(())
    };
    let built = compile::build(&tc, libs, &built_lib_dir, &salt, &aliases)?;
    if !built.is_empty() {
        println!("cargo:warning=ggml-sys: compiled {} in {:.0} s", built.join(", "), t.elapsed().as_secs_f64());
    }
    let plugin_dir = build_root.join("plugins");
    fs::create_dir_all(&plugin_dir).map_err(|e| e.to_string())?;
    for f in &plugin_files {
        install(&built_lib_dir.join(f), &plugin_dir.join(f))?;
    }
    drop(lock);

    // Cargo puts link-search directories on the library path of `cargo run` and
    // `cargo test` only when they lie inside the profile's output directory, so
    // the core library is copied there (the build itself is shared by profiles).
    let profile_dir = out_dir.ancestors().nth(3).ok_or("unexpected OUT_DIR layout")?;
    let lib_dir = copy_core_libs(os, &built_lib_dir, &profile_dir.join("ggml-lib"))?;

    let api_version = backend_api_version(&ggml_src)?;
    let headers_sha256 = headers_sha256(&manifest_dir, &ggml_src)?;

    write_if_changed(
        &out_dir.join("build_info.rs"),
        &format!(
            "/// ggml version of the pinned source.\npub const GGML_VERSION: &str = {:?};\n\
             /// `GGML_BACKEND_API_VERSION` of the pinned source (from its private ggml-backend-impl.h).\npub const GGML_BACKEND_API_VERSION: i32 = {api_version};\n\
             /// The registry package the source comes from, as `name version`.\npub const GGML_SOURCE_PACKAGE: &str = {:?};\n\
             /// Where the build placed the default plugins (the compile-time install directory).\npub const BUILD_PLUGIN_DIR: &str = {:?};\n\
             /// Where `libggml-base` was built.\npub const BUILD_LIB_DIR: &str = {:?};\n\
             /// The ggml source tree the library was compiled from.\npub const GGML_SOURCE_DIR: &str = {:?};\n\
             /// sha256 of `wrapper.h` and the public headers it includes, in the source compiled.\npub const SOURCE_HEADERS_SHA256: &str = {:?};\n\
             /// The CPU variants this build compiled.\npub const BUILD_CPU_VARIANTS: &[&str] = &{:?};\n",
            pin.ggml_version,
            format!("{} {}", pin.package, pin.version),
            plugin_dir.display().to_string(),
            lib_dir.display().to_string(),
            ggml_src.display().to_string(),
            headers_sha256,
            cpu_variants,
        ),
    )?;

    // Facts for xtask (which builds optional plugins against the same source and
    // regenerates the bindings).
    let info = serde_json::json!({
        "ggml_version": pin.ggml_version,
        "source_dir": ggml_src,
        "lib_dir": lib_dir,
        "plugin_dir": plugin_dir,
        "package": format!("{} {}", pin.package, pin.version),
        "headers_sha256": headers_sha256,
        "cpu_variants": cpu_variants,
    });
    write_if_changed(&build_root.join("build-info.json"), &info.to_string())?;

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=ggml-base");
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:plugin_dir={}", plugin_dir.display());
    Ok(())
}

fn read_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn write_if_changed(path: &Path, text: &str) -> Result<(), String> {
    if fs::read_to_string(path).map(|old| old == text).unwrap_or(false) {
        return Ok(());
    }
    fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// sha256 over `wrapper.h` and [`BOUND_HEADERS`] (name, NUL, length, NUL, bytes each).
fn headers_sha256(manifest_dir: &Path, src: &Path) -> Result<String, String> {
    let mut h = Sha256::new();
    let mut files = vec![("wrapper.h".to_string(), manifest_dir.join("wrapper.h"))];
    files.extend(BOUND_HEADERS.iter().map(|n| (n.to_string(), src.join("include").join(n))));
    for (name, path) in files {
        println!("cargo:rerun-if-changed={}", path.display());
        let bytes = fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        h.update(name.as_bytes());
        h.update([0]);
        h.update(bytes.len().to_string().as_bytes());
        h.update([0]);
        h.update(&bytes);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Identity of a local source tree: every file's path, size and modification time.
fn tree_stamp(root: &Path) -> String {
    let mut h = Sha256::new();
    let mut stack = vec![root.join("src"), root.join("include")];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        let mut entries: Vec<_> = rd.flatten().collect();
        entries.sort_by_key(|e| e.path());
        for e in entries {
            let p = e.path();
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(p);
            } else {
                let mtime = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                h.update(format!("{}|{}|{:?}\n", p.display(), m.len(), mtime).as_bytes());
            }
        }
    }
    format!("{:x}", h.finalize())
}

fn env(key: &str) -> Result<String, String> {
    std::env::var(key).map_err(|_| format!("environment variable {key} is not set"))
}

/// Downloads the pinned package through cargo and checks its checksum.
fn fetch_pinned(pin: &Pin, out_dir: &Path) -> Result<PathBuf, String> {
    let fetch = out_dir.join("fetch");
    fs::create_dir_all(&fetch).map_err(|e| e.to_string())?;
    fs::write(
        fetch.join("Cargo.toml"),
        format!(
            "[package]\nname = \"ggml-source-fetch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
             [lib]\npath = \"lib.rs\"\n[dependencies]\n{} = \"={}\"\n[workspace]\n",
            pin.package, pin.version
        ),
    )
    .map_err(|e| e.to_string())?;
    fs::write(fetch.join("lib.rs"), "").map_err(|e| e.to_string())?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(fetch.join("Cargo.toml"))
        .env_remove("CARGO_TARGET_DIR")
        .env("CARGO_TARGET_DIR", fetch.join("target"));
    if std::env::var_os("CARGO_NET_OFFLINE").is_some() {
        cmd.arg("--offline");
    }
    let out = cmd.output().map_err(|e| format!("running `{cargo} metadata` to fetch {}: {e}", pin.package))?;
    if !out.status.success() {
        return Err(format!(
            "could not download the pinned ggml source ({} {}) from the registry:\n{}",
            pin.package,
            pin.version,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata output: {e}"))?;
    let manifest = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == pin.package.as_str() && p["version"] == pin.version.as_str())
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or_else(|| format!("cargo metadata did not list {} {}", pin.package, pin.version))?;

    // cargo verified the download against the registry index; the lockfile holds
    // that checksum. It must be the one we pinned.
    let lock = fs::read_to_string(fetch.join("Cargo.lock")).map_err(|e| e.to_string())?;
    let lock: toml::Value = toml::from_str(&lock).map_err(|e| e.to_string())?;
    let checksum = lock["package"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| {
            p["name"].as_str() == Some(pin.package.as_str()) && p["version"].as_str() == Some(pin.version.as_str())
        })
        .and_then(|p| p.get("checksum"))
        .and_then(|c| c.as_str())
        .ok_or("no checksum for the pinned package in the fetch lockfile")?;
    if checksum != pin.sha256 {
        return Err(format!(
            "checksum mismatch for {} {}: registry says {checksum}, ggml-source.toml pins {}",
            pin.package, pin.version, pin.sha256
        ));
    }
    let src = Path::new(manifest).parent().ok_or("bad manifest path")?.join(&pin.subdir);
    if !src.join("CMakeLists.txt").exists() {
        return Err(format!("{} has no ggml tree at {}", pin.package, src.display()));
    }
    Ok(src)
}

fn check_version(src: &Path, pin: &Pin) -> Result<(), String> {
    let text = fs::read_to_string(src.join("CMakeLists.txt"))
        .map_err(|e| format!("{}: {e}", src.join("CMakeLists.txt").display()))?;
    let part = |key: &str| -> Option<String> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("set({key} ")))
            .map(|v| v.trim_end_matches(')').trim().to_string())
    };
    let found = format!(
        "{}.{}.{}",
        part("GGML_VERSION_MAJOR").unwrap_or_default(),
        part("GGML_VERSION_MINOR").unwrap_or_default(),
        part("GGML_VERSION_PATCH").unwrap_or_default()
    );
    if found != pin.ggml_version {
        return Err(format!(
            "the ggml tree at {} declares version {found}, ggml-source.toml expects {}",
            src.display(),
            pin.ggml_version
        ));
    }
    Ok(())
}

/// The cargo target directory: the nearest ancestor of OUT_DIR holding CACHEDIR.TAG, else
/// the directory above the profile's.
fn target_dir(out_dir: &Path) -> Result<PathBuf, String> {
    // Cargo writes CACHEDIR.TAG only into a target directory it created itself; in one that
    // existed before, OUT_DIR's layout (<target>[/<triple>]/<profile>/build/<pkg>/out) tells.
    if let Some(p) = out_dir.ancestors().find(|p| p.join("CACHEDIR.TAG").exists()) {
        return Ok(p.to_path_buf());
    }
    let profile = out_dir.ancestors().nth(3).ok_or_else(|| format!("unexpected OUT_DIR {}", out_dir.display()))?;
    let above = profile.parent().ok_or_else(|| format!("unexpected OUT_DIR {}", out_dir.display()))?;
    let triple = std::env::var("TARGET").unwrap_or_default();
    Ok(if above.file_name().is_some_and(|n| n == triple.as_str()) {
        above.parent().unwrap_or(above).to_path_buf()
    } else {
        above.to_path_buf()
    })
}

/// Copies the core library under each of its names (`libggml-base.so*`) into `dest`.
fn copy_core_libs(os: names::TargetOs, from: &Path, dest: &Path) -> Result<PathBuf, String> {
    fs::create_dir_all(dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    for entry in fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if names::is_core_file(os, name) && !name.ends_with(".tmp") {
            // Copy the real file under each name: symlinks are resolved by fs::read.
            install(&path, &dest.join(name))?;
        }
    }
    Ok(dest.to_path_buf())
}

/// Copies a file unless the destination already has the same bytes; replaces
/// atomically so that a process that has the old library mapped is unaffected.
fn install(from: &Path, to: &Path) -> Result<(), String> {
    let new = fs::read(from).map_err(|e| format!("{}: {e}", from.display()))?;
    if fs::read(to).map(|old| old == new).unwrap_or(false) {
        return Ok(());
    }
    let tmp = to.with_file_name(format!("{}.tmp", to.file_name().and_then(|n| n.to_str()).unwrap_or("lib")));
    fs::write(&tmp, &new).map_err(|e| format!("{}: {e}", tmp.display()))?;
    fs::rename(&tmp, to).map_err(|e| format!("{}: {e}", to.display()))
}

fn backend_api_version(src: &Path) -> Result<i32, String> {
    let path = src.join("src/ggml-backend-impl.h");
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .find_map(|l| l.trim().strip_prefix("#define GGML_BACKEND_API_VERSION"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no GGML_BACKEND_API_VERSION in {}", path.display()))
}
