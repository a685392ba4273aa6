//! Build script: fetch the pinned ggml source, build it with CMake, generate bindings.
//!
//! 1. `ggml-source.toml` names one crates.io package and its sha256. We ask cargo
//!    to download it (`cargo metadata` on a manifest generated in OUT_DIR), then
//!    compare the checksum cargo recorded in that lockfile with the pin.
//! 2. CMake builds `libggml-base` (linked by us) and the default plugins
//!    (`plugins/*/plugin.toml` with `default = true`) as module libraries into a
//!    build directory shared by every profile: `<target>/ggml/`. A file lock
//!    serialises concurrent builds of that directory.
//! 3. bindgen turns the public headers into `bindings.rs`; nothing generated is
//!    committed.
//!
//! Overrides: `SD_GGML_SOURCE_DIR` (use a local ggml tree; the pin is then not
//! checked and a warning says so), `SD_GGML_BUILD_DIR` (where to build).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(serde::Deserialize)]
struct Pin {
    package: String,
    version: String,
    sha256: String,
    subdir: String,
    ggml_version: String,
}

#[derive(serde::Deserialize)]
struct PluginManifest {
    name: String,
    #[serde(default)]
    default: bool,
    #[serde(default)]
    cmake: Vec<String>,
    #[serde(default)]
    targets: Vec<String>,
}

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
    println!("cargo:rerun-if-changed={}", pin_path.display());
    println!("cargo:rerun-if-changed=cmake/CMakeLists.txt");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=SD_GGML_SOURCE_DIR");
    println!("cargo:rerun-if-env-changed=SD_GGML_BUILD_DIR");
    let pin: Pin = toml::from_str(&fs::read_to_string(&pin_path).map_err(|e| format!("{}: {e}", pin_path.display()))?)
        .map_err(|e| format!("{}: {e}", pin_path.display()))?;

    let ggml_src = match std::env::var_os("SD_GGML_SOURCE_DIR") {
        Some(dir) => {
            println!(
                "cargo:warning=SD_GGML_SOURCE_DIR is set: building ggml from {} (the pin in ggml-source.toml is not checked)",
                PathBuf::from(&dir).display()
            );
            PathBuf::from(dir)
        }
        None => fetch_pinned(&pin, &out_dir)?,
    };
    check_version(&ggml_src, &pin)?;

    let build_root = match std::env::var_os("SD_GGML_BUILD_DIR") {
        Some(d) => PathBuf::from(d),
        None => target_dir(&out_dir)?.join("ggml"),
    };
    fs::create_dir_all(&build_root).map_err(|e| format!("{}: {e}", build_root.display()))?;

    let plugins = default_plugins(&workspace.join("plugins"))?;
    let lock_path = build_root.join(".lock");
    let lock = fs::File::create(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    let (lib_dir, plugin_dir) = cmake_build(&workspace, &ggml_src, &build_root, &plugins)?;
    drop(lock);

    // Cargo puts link-search directories on the library path of `cargo run` and
    // `cargo test` only when they lie inside the profile's output directory, so
    // the core library is copied there (the build itself is shared by profiles).
    let profile_dir = out_dir.ancestors().nth(3).ok_or("unexpected OUT_DIR layout")?;
    let lib_dir = copy_core_libs(&lib_dir, &profile_dir.join("ggml-lib"))?;

    let api_version = backend_api_version(&ggml_src)?;
    generate_bindings(&manifest_dir, &ggml_src, &out_dir)?;

    fs::write(
        out_dir.join("build_info.rs"),
        format!(
            "/// ggml version of the pinned source.\npub const GGML_VERSION: &str = {:?};\n\
             /// `GGML_BACKEND_API_VERSION` of the pinned source (from its private ggml-backend-impl.h).\npub const GGML_BACKEND_API_VERSION: i32 = {api_version};\n\
             /// The registry package the source comes from, as `name version`.\npub const GGML_SOURCE_PACKAGE: &str = {:?};\n\
             /// Where the build placed the default plugins (the compile-time install directory).\npub const BUILD_PLUGIN_DIR: &str = {:?};\n\
             /// Where `libggml-base` was built.\npub const BUILD_LIB_DIR: &str = {:?};\n\
             /// The ggml source tree the bindings were generated from.\npub const GGML_SOURCE_DIR: &str = {:?};\n",
            pin.ggml_version,
            format!("{} {}", pin.package, pin.version),
            plugin_dir.display().to_string(),
            lib_dir.display().to_string(),
            ggml_src.display().to_string(),
        ),
    )
    .map_err(|e| e.to_string())?;

    // Facts for xtask (which builds optional plugins against the same source).
    let info = serde_json::json!({
        "ggml_version": pin.ggml_version,
        "source_dir": ggml_src,
        "lib_dir": lib_dir,
        "plugin_dir": plugin_dir,
        "package": format!("{} {}", pin.package, pin.version),
    });
    fs::write(build_root.join("build-info.json"), info.to_string()).map_err(|e| e.to_string())?;

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=ggml-base");
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:plugin_dir={}", plugin_dir.display());
    Ok(())
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

/// The cargo target directory: the nearest ancestor of OUT_DIR holding CACHEDIR.TAG.
fn target_dir(out_dir: &Path) -> Result<PathBuf, String> {
    out_dir
        .ancestors()
        .find(|p| p.join("CACHEDIR.TAG").exists())
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("cannot find the target directory above {}", out_dir.display()))
}

fn default_plugins(dir: &Path) -> Result<Vec<PluginManifest>, String> {
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut found = BTreeMap::new();
    for entry in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path().join("plugin.toml");
        if !path.exists() {
            continue;
        }
        println!("cargo:rerun-if-changed={}", path.display());
        let m: PluginManifest = toml::from_str(&fs::read_to_string(&path).map_err(|e| e.to_string())?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if m.default {
            found.insert(m.name.clone(), m);
        }
    }
    Ok(found.into_values().collect())
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|p| p.join(program).is_file()))
        .unwrap_or(false)
}

/// Configures and builds ggml; returns (lib dir, plugin dir).
fn cmake_build(
    workspace: &Path,
    src: &Path,
    root: &Path,
    plugins: &[PluginManifest],
) -> Result<(PathBuf, PathBuf), String> {
    if !which("cmake") {
        return Err("cmake not found on PATH. Install the prerequisites: \
             `apt-get install cmake ninja-build g++ libclang-dev` (see README.md)"
            .into());
    }
    let build = root.join("build");
    let mut args: Vec<String> = vec![
        "-S".into(),
        workspace.join("crates/ggml-sys/cmake").display().to_string(),
        "-B".into(),
        build.display().to_string(),
        format!("-DGGML_SOURCE_DIR={}", src.display()),
        "-DCMAKE_BUILD_TYPE=Release".into(),
        "-DBUILD_SHARED_LIBS=ON".into(),
        "-DGGML_BACKEND_DL=ON".into(),
        "-DGGML_BUILD_TESTS=OFF".into(),
        "-DGGML_BUILD_EXAMPLES=OFF".into(),
        "-DGGML_CCACHE=OFF".into(),
    ];
    if which("ninja") && !build.join("CMakeCache.txt").exists() {
        args.push("-GNinja".into());
    }
    let mut targets = vec!["ggml-base".to_string()];
    for p in plugins {
        args.extend(p.cmake.iter().cloned());
        targets.extend(p.targets.iter().cloned());
    }
    run_cmd(Command::new("cmake").args(&args), "configuring ggml")?;
    let jobs = std::env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
    let mut cmd = Command::new("cmake");
    cmd.arg("--build").arg(&build).args(["--parallel", &jobs, "--target"]).args(&targets);
    run_cmd(&mut cmd, "building ggml")?;

    let lib_dir = build.join("ggml/src");
    let bin_dir = build.join("bin");
    let plugin_dir = root.join("plugins");
    fs::create_dir_all(&plugin_dir).map_err(|e| e.to_string())?;
    for t in targets.iter().filter(|t| *t != "ggml-base") {
        let name = format!("lib{t}.so");
        install(&bin_dir.join(&name), &plugin_dir.join(&name))?;
    }
    Ok((lib_dir, plugin_dir))
}

/// Copies `libggml-base.so*` (keeping the soname link) into `dest`.
fn copy_core_libs(from: &Path, dest: &Path) -> Result<PathBuf, String> {
    fs::create_dir_all(dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    for entry in fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        if name.starts_with("libggml-base.so") {
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

fn run_cmd(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({:?}):\n{}\n{}",
            cmd,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

fn backend_api_version(src: &Path) -> Result<i32, String> {
    let path = src.join("src/ggml-backend-impl.h");
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .find_map(|l| l.trim().strip_prefix("#define GGML_BACKEND_API_VERSION"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no GGML_BACKEND_API_VERSION in {}", path.display()))
}

/// Functions declared in ggml-backend.h but defined in libggml (the upstream
/// loader/registry), which we do not link: our registry is sd-backends.
const LOADER_FUNCTIONS: &[&str] = &[
    "ggml_backend_register",
    "ggml_backend_device_register",
    "ggml_backend_reg_count",
    "ggml_backend_reg_get",
    "ggml_backend_reg_by_name",
    "ggml_backend_dev_count",
    "ggml_backend_dev_get",
    "ggml_backend_dev_by_name",
    "ggml_backend_dev_by_type",
    "ggml_backend_init_by_name",
    "ggml_backend_init_by_type",
    "ggml_backend_init_best",
    "ggml_backend_load",
    "ggml_backend_unload",
    "ggml_backend_load_all",
    "ggml_backend_load_all_from_path",
    // clashes with the enum of the same name in Rust's value namespace; the
    // device type is read from `ggml_backend_dev_get_props` instead
    "ggml_backend_dev_type",
];

fn generate_bindings(manifest_dir: &Path, src: &Path, out_dir: &Path) -> Result<(), String> {
    let mut b = bindgen::Builder::default()
        .header(manifest_dir.join("wrapper.h").display().to_string())
        .clang_arg(format!("-I{}", src.join("include").display()))
        .allowlist_function("ggml_.*|gguf_.*")
        .allowlist_type("ggml_.*|gguf_.*")
        .allowlist_var("GGML_.*|GGUF_.*")
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .derive_default(true)
        .layout_tests(true)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for f in LOADER_FUNCTIONS {
        b = b.blocklist_function(f);
    }
    let bindings = b
        .generate()
        .map_err(|e| format!("bindgen failed: {e} (is libclang installed? apt-get install libclang-dev)"))?;
    bindings.write_to_file(out_dir.join("bindings.rs")).map_err(|e| e.to_string())
}
