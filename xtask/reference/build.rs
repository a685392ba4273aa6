//! Builds stable-diffusion.cpp, its ggml and our C++ driver without CMake, and links them.
//!
//! The sd.cpp source is the copy inside the crates.io package
//! `diffusion-rs-sys` (pinned in Cargo.toml, never compiled as a crate). It is
//! found through `SDREF_SDCPP_DIR` when set (xtask sets it), else through
//! `cargo metadata`.
//!
//! `sdref-build.toml` is the one place that says how: for each static library
//! its sources, definitions, include directories and flags, each entry citing
//! the lines of the CMake build it reproduces (sd.cpp's default CPU build:
//! Release, GGML_NATIVE=ON, OpenMP). The compiler is the one the `cc` crate
//! finds (CC/CXX and CFLAGS/CXXFLAGS honoured, with no flags of cargo's, as the
//! `cmake` crate passed them to CMake before); every object is compiled with
//! the command line CMake's Makefile generator wrote, from a pool of NUM_JOBS
//! workers, the driver first (it compiles all of sd.cpp's main file), then the
//! largest sources. `SDREF_VARIANT` selects a build variant the spec names (the
//! `last_flags` and `variant_sources` of its targets; `cargo xtask reference
//! --f32-accumulation` sets `f32acc`, `--llamafile` sets `llamafile`); unset, the
//! build is sd.cpp's default one.
//!
//! Objects and archives live in `<target-dir>/sdref-cc` (or `SDREF_CC_DIR`),
//! not in OUT_DIR: every variant of this build script (release, debug, test,
//! clippy) gets its own OUT_DIR, and each would otherwise recompile sd.cpp,
//! which takes many minutes on two cores. Each object keeps the hash of its
//! command line, compiler and inputs beside it, so a second build compiles
//! nothing and a change to `driver/` recompiles only the driver; the hash does
//! not depend on where the checkout is, so clones on one machine sharing
//! `SDREF_CC_DIR` share the objects (a fresh machine compiles them all). A file
//! lock keeps two builds from using the directory at once. `SDREF_PLAN_ONLY=1`
//! (with `cargo check`) compiles nothing: it says how many objects would compile
//! and writes every command line to `OUT_DIR/plan.txt`.

use std::collections::BTreeMap;
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use sha2::{Digest, Sha256};

#[path = "build/spec.rs"]
mod spec;
use spec::{expand, Spec};

const SYS_PACKAGE: &str = "diffusion-rs-sys";
const SPEC: &str = "sdref-build.toml";

/// One object file: the compiler command that makes it, and its cache key.
struct Job {
    src: PathBuf,
    obj: PathBuf,
    cpp: bool,
    first: bool,
    args: Vec<String>,
    key: String,
}

/// The compilers, as the `cc` crate finds them.
struct Toolchain {
    c: cc::Tool,
    cxx: cc::Tool,
    identity: String,
}

fn main() {
    if let Err(msg) = run() {
        eprintln!("sdref build: {msg}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    for v in [
        "SDREF_SDCPP_DIR",
        "SDREF_CC_DIR",
        "SDREF_VARIANT",
        "SDREF_PLAN_ONLY",
        "CC",
        "CXX",
        "CFLAGS",
        "CXXFLAGS",
        "AR",
        "RANLIB",
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo:rerun-if-changed=driver");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build/spec.rs");
    println!("cargo:rerun-if-changed={SPEC}");

    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?);
    let sdcpp = locate_sdcpp(&manifest_dir)?;
    let driver = manifest_dir.join("driver");
    let spec_path = manifest_dir.join(SPEC);
    let text = fs::read_to_string(&spec_path).map_err(|e| format!("{}: {e}", spec_path.display()))?;
    let spec: Spec = toml::from_str(&text).map_err(|e| format!("{}: {e}", spec_path.display()))?;

    let root = cc_dir()?;
    fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
    let lock_path = root.join(".lock");
    let lock = fs::File::create(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("locking {}: {e}", lock_path.display()))?;

    let tc = toolchain()?;
    let plan_only = env::var_os("SDREF_PLAN_ONLY").is_some_and(|v| !v.is_empty());
    if !plan_only {
        probe_openmp(&tc, &spec, &root)?;
    }
    let dirs = [("{sdcpp}", sdcpp.as_path()), ("{driver}", driver.as_path())];
    let driver_key = tree_hash(&driver)?;
    let (jobs, archives) = plan(&spec, &tc, &dirs, &driver_key, &root.join("obj"))?;

    let stale: Vec<&Job> = jobs.iter().filter(|j| !fresh(&j.obj, &j.key)).collect();
    if plan_only {
        let listing = write_plan(&tc, &jobs)?;
        println!(
            "cargo:warning=sdref: SDREF_PLAN_ONLY: {} of {} objects in {} would compile; nothing compiled or linked; command lines in {}",
            stale.len(),
            jobs.len(),
            root.display(),
            listing.display()
        );
        println!("cargo:rustc-env=SDREF_SDCPP_DIR={}", sdcpp.display());
        return Ok(());
    }
    if !stale.is_empty() {
        let t = Instant::now();
        compile_all(&tc, &stale)?;
        println!("cargo:warning=sdref: compiled {} objects in {:.0} s", stale.len(), t.elapsed().as_secs_f64());
    }
    let lib_dir = root.join("lib");
    fs::create_dir_all(&lib_dir).map_err(|e| format!("{}: {e}", lib_dir.display()))?;
    for (name, members) in &archives {
        let objs: Vec<&Job> = members.iter().map(|&i| &jobs[i]).collect();
        archive(&lib_dir, name, &objs)?;
    }
    drop(lock);

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    for lib in &spec.link.static_libs {
        if !archives.contains_key(lib) {
            return Err(format!("{SPEC}: [link] names `{lib}`, which no target archives"));
        }
        println!("cargo:rustc-link-lib=static={lib}");
    }
    for lib in &spec.link.dylib {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:rustc-env=SDREF_SDCPP_DIR={}", sdcpp.display());
    Ok(())
}

/// `SDREF_PLAN_ONLY`: each object's state (`fresh` in the cache, or `compile`) and the
/// command line that makes it, one per line, in `OUT_DIR/plan.txt`.
fn write_plan(tc: &Toolchain, jobs: &[Job]) -> Result<PathBuf, String> {
    let mut text = String::new();
    for j in jobs {
        let compiler = if j.cpp { &tc.cxx } else { &tc.c };
        text.push_str(&format!(
            "{} {} -o {} -c {}\n",
            if fresh(&j.obj, &j.key) { "fresh  " } else { "compile" },
            std::iter::once(compiler.path().display().to_string())
                .chain(j.args.iter().cloned())
                .collect::<Vec<_>>()
                .join(" "),
            j.obj.display(),
            j.src.display()
        ));
    }
    let path = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?).join("plan.txt");
    fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// `<target-dir>/sdref-cc`, shared by every profile (or `SDREF_CC_DIR`).
fn cc_dir() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("SDREF_CC_DIR") {
        return Ok(PathBuf::from(dir));
    }
    // OUT_DIR is <target-dir>[/<triple>]/<profile>/build/<pkg>-<hash>/out.
    let out = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let target_dir = out.ancestors().nth(4).ok_or("unexpected OUT_DIR layout")?;
    Ok(target_dir.join("sdref-cc"))
}

fn toolchain() -> Result<Toolchain, String> {
    // What the `cmake` crate gave CMake as CMAKE_<LANG>_FLAGS: a cc::Build with no
    // default flags and warnings off, i.e. `-w` plus CFLAGS/CXXFLAGS.
    let build = |cpp: bool| {
        let mut b = cc::Build::new();
        b.cargo_metadata(false).no_default_flags(true).warnings(false).cpp(cpp);
        b.try_get_compiler()
    };
    let c = build(false).map_err(|e| format!("no C compiler found: {e}"))?;
    let cxx = build(true).map_err(|e| format!("no C++ compiler found (sd.cpp needs one, e.g. g++): {e}"))?;
    let version = |t: &cc::Tool| {
        Command::new(t.path())
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").to_owned())
            .map_err(|e| format!("cannot run {}: {e}", t.path().display()))
    };
    let identity = format!(
        "{:?} {:?} {} | {:?} {:?} {}",
        c.path(),
        c.args(),
        version(&c)?,
        cxx.path(),
        cxx.args(),
        version(&cxx)?
    );
    Ok(Toolchain { c, cxx, identity })
}

/// ggml's CMake uses OpenMP when `find_package(OpenMP)` succeeds, and the old
/// driver/CMakeLists.txt refused to build without it: compile and link a program.
fn probe_openmp(tc: &Toolchain, spec: &Spec, root: &Path) -> Result<(), String> {
    let dir = root.join("probe");
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let src = dir.join("omp.c");
    // compiled and linked, never run
    let prog = "#include <omp.h>\nint main(void) {\n    int threads = 0;\n#pragma omp parallel reduction(+ : threads)\n    threads += 1;\n    return threads > 0 && omp_get_max_threads() > 0 ? 0 : 1;\n}\n";
    fs::write(&src, prog).map_err(|e| format!("{}: {e}", src.display()))?;
    let out =
        command(&tc.c).args(tc.c.args()).args(&spec.openmp_probe).arg(&src).arg("-o").arg(dir.join("omp")).output();
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "OpenMP is not usable with {} ({}): the reference must be built as sd.cpp's CPU build is (install libgomp / a compiler with -fopenmp)\n{}",
            tc.c.path().display(),
            spec.openmp_probe.join(" "),
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(format!("cannot run {}: {e}", tc.c.path().display())),
    }
}

/// A compiler command with the cc crate's environment (no wrapper, no arguments yet).
fn command(tool: &cc::Tool) -> Command {
    let mut cmd = Command::new(tool.path());
    cmd.envs(tool.get_envs());
    cmd
}

/// For each archive, the indexes of its objects (in `Job`s) in archive order.
type Archives = BTreeMap<String, Vec<usize>>;

/// Every object to compile, and for each archive the indexes of its objects in link order.
fn plan(
    spec: &Spec,
    tc: &Toolchain,
    dirs: &[(&str, &Path)],
    driver_key: &str,
    obj_root: &Path,
) -> Result<(Vec<Job>, Archives), String> {
    // SDREF_VARIANT: a build variant named in the spec's `last_flags` or `variant_sources`
    // (`cargo xtask reference --f32-accumulation` sets `f32acc`, `--llamafile` `llamafile`);
    // only the targets that list it compile otherwise.
    let variant = env::var("SDREF_VARIANT").ok().filter(|v| !v.is_empty());
    let variant = variant.as_deref();
    spec.check_variant(variant).map_err(|e| format!("{SPEC}: {e}"))?;
    let driver_dir = expand("{driver}", dirs);
    let mut jobs = Vec::new();
    let mut archives = Archives::new();
    let mut pending: Vec<(String, Vec<usize>)> = Vec::new();
    for t in &spec.target {
        let root = PathBuf::from(expand(&t.root, dirs));
        // `sources` in their order (CMake keeps a target's list as written), then the
        // union of the `glob` patterns sorted (as CMake's file(GLOB) returns it)
        let mut files = Vec::new();
        let extra = variant.and_then(|v| t.variant_sources.get(v)).into_iter().flatten();
        for file in t.sources.iter().chain(extra) {
            if !root.join(file).is_file() {
                return Err(format!("{SPEC}: target {}: `{file}` is not a file in {}", t.name, root.display()));
            }
            files.push(file.clone());
        }
        let mut globbed = Vec::new();
        for pattern in &t.glob {
            globbed.extend(glob(&root, pattern)?);
        }
        globbed.sort();
        globbed.dedup();
        files.extend(globbed);
        files.retain(|f| !t.exclude.contains(f));
        let mut members = Vec::new();
        for file in files {
            let cpp = file.ends_with(".cpp");
            let src = root.join(&file);
            // CMAKE_<LANG>_FLAGS: the cc crate's flags for this compiler
            let tool = if cpp { &tc.cxx } else { &tc.c };
            let tool_args: Vec<String> = tool.args().iter().map(|a| a.to_string_lossy().into_owned()).collect();
            let args = spec.object_args(t, &file, &tool_args, dirs, variant).map_err(|e| format!("{SPEC}: {e}"))?;
            let obj = obj_root.join(&t.name).join(format!("{file}.o"));
            // The key names the driver's directory by its placeholder, so that checkouts
            // sharing SDREF_CC_DIR share the objects: its path reaches the
            // compiler only as an include directory, and its files are hashed below.
            let checkout = |a: &str| a.replace(&driver_dir, "{driver}");
            let mut h = Sha256::new();
            h.update(tc.identity.as_bytes());
            h.update(checkout(&src.display().to_string()).as_bytes());
            for a in &args {
                h.update([0]);
                h.update(checkout(a).as_bytes());
            }
            h.update(fs::read(&src).map_err(|e| format!("{}: {e}", src.display()))?);
            if t.root == "{driver}" {
                h.update(driver_key.as_bytes());
            }
            members.push(jobs.len());
            jobs.push(Job { src, obj, cpp, first: t.compile_first, args, key: format!("{:x}", h.finalize()) });
        }
        match (&t.archive, &t.objects_into) {
            (Some(a), None) => {
                archives.insert(a.clone(), members);
            }
            (None, Some(into)) => pending.push((into.clone(), members)),
            _ => return Err(format!("{SPEC}: target {} needs exactly one of `archive` and `objects_into`", t.name)),
        }
    }
    // An OBJECT library's objects follow the target's own in its archive.
    for (into, members) in pending {
        archives
            .get_mut(&into)
            .ok_or_else(|| format!("{SPEC}: `objects_into = \"{into}\"` names no archive"))?
            .extend(members);
    }
    Ok((jobs, archives))
}

/// Files under `root` matching `pattern` (relative, `/`-separated, `*` within a
/// component), as relative paths.
fn glob(root: &Path, pattern: &str) -> Result<Vec<String>, String> {
    let mut found = vec![String::new()];
    for part in pattern.split('/') {
        let mut next = Vec::new();
        for prefix in &found {
            let dir = root.join(prefix);
            let join = |name: &str| if prefix.is_empty() { name.to_owned() } else { format!("{prefix}/{name}") };
            match part.split_once('*') {
                None => {
                    if dir.join(part).exists() {
                        next.push(join(part));
                    }
                }
                Some((head, tail)) => {
                    let entries = fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                    for entry in entries {
                        let name = entry.map_err(|e| e.to_string())?.file_name().to_string_lossy().into_owned();
                        if name.len() >= head.len() + tail.len() && name.starts_with(head) && name.ends_with(tail) {
                            next.push(join(&name));
                        }
                    }
                }
            }
        }
        found = next;
    }
    found.retain(|f| root.join(f).is_file());
    Ok(found)
}

/// The hash of every file directly in `dir` (the driver's sources and header), by name
/// and contents.
fn tree_hash(dir: &Path) -> Result<String, String> {
    let mut names: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    let mut h = Sha256::new();
    for p in names {
        h.update(p.file_name().unwrap_or_default().to_string_lossy().as_bytes());
        h.update(fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    Ok(format!("{:x}", h.finalize()))
}

fn stamp(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".key");
    PathBuf::from(s)
}

fn fresh(path: &Path, key: &str) -> bool {
    path.is_file() && fs::read_to_string(stamp(path)).is_ok_and(|k| k == key)
}

fn compile_all(tc: &Toolchain, jobs: &[&Job]) -> Result<(), String> {
    let mut order: Vec<&Job> = jobs.to_vec();
    order.sort_by_key(|j| std::cmp::Reverse((j.first, fs::metadata(&j.src).map(|m| m.len()).unwrap_or(0))));
    let workers = env::var("NUM_JOBS").ok().and_then(|n| n.parse::<usize>().ok()).unwrap_or(2).clamp(1, order.len());
    let next = AtomicUsize::new(0);
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                while errors.lock().unwrap().is_empty() {
                    let Some(job) = order.get(next.fetch_add(1, Ordering::SeqCst)) else { break };
                    if let Err(e) = compile(tc, job) {
                        errors.lock().unwrap().push(e);
                    }
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

fn compile(tc: &Toolchain, job: &Job) -> Result<(), String> {
    let dir = job.obj.parent().ok_or("object path has no parent")?;
    fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let _ = fs::remove_file(stamp(&job.obj));
    let mut cmd = command(if job.cpp { &tc.cxx } else { &tc.c });
    cmd.args(&job.args).arg("-o").arg(&job.obj).arg("-c").arg(&job.src);
    let out = cmd.output().map_err(|e| format!("compiling {}: cannot run the compiler: {e}", job.src.display()))?;
    if !out.status.success() {
        let argv: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        return Err(format!(
            "compiling {} failed ({}):\n{} {}\n{}{}",
            job.src.display(),
            out.status,
            cmd.get_program().to_string_lossy(),
            argv.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    fs::write(stamp(&job.obj), &job.key).map_err(|e| format!("{}: {e}", job.obj.display()))
}

/// `ar qc` + `ranlib`, as the archive rules CMake generated for sd.cpp's build did, unless the archive already holds these objects.
fn archive(lib_dir: &Path, name: &str, objs: &[&Job]) -> Result<(), String> {
    let lib = lib_dir.join(format!("lib{name}.a"));
    let mut h = Sha256::new();
    for j in objs {
        h.update(j.obj.display().to_string().as_bytes());
        h.update(j.key.as_bytes());
    }
    let key = format!("{:x}", h.finalize());
    if fresh(&lib, &key) {
        return Ok(());
    }
    let tmp = lib_dir.join(format!("lib{name}.a.tmp"));
    let _ = fs::remove_file(&tmp);
    let _ = fs::remove_file(stamp(&lib));
    let build = cc::Build::new();
    let mut ar = build.try_get_archiver().map_err(|e| format!("no archiver (ar) found: {e}"))?;
    ar.arg("qc").arg(&tmp).args(objs.iter().map(|j| &j.obj));
    let mut ranlib = build.try_get_ranlib().map_err(|e| format!("no ranlib found: {e}"))?;
    ranlib.arg(&tmp);
    for (what, mut cmd) in [("ar", ar), ("ranlib", ranlib)] {
        let out = cmd.output().map_err(|e| format!("{what} for {}: {e}", lib.display()))?;
        if !out.status.success() {
            return Err(format!("{what} for {} failed: {}", lib.display(), String::from_utf8_lossy(&out.stderr)));
        }
    }
    fs::rename(&tmp, &lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    fs::write(stamp(&lib), key).map_err(|e| format!("{}: {e}", lib.display()))
}

fn locate_sdcpp(manifest_dir: &Path) -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("SDREF_SDCPP_DIR") {
        return check_sdcpp(PathBuf::from(dir));
    }
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(manifest_dir.join("Cargo.toml"))
        .output()
        .map_err(|e| format!("cannot run `cargo metadata`: {e}; set SDREF_SDCPP_DIR to sd.cpp's source"))?;
    if !output.status.success() {
        return Err(format!(
            "`cargo metadata` failed: {}; set SDREF_SDCPP_DIR to sd.cpp's source",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| format!("`cargo metadata` output is not JSON: {e}"))?;
    let packages = meta["packages"].as_array().ok_or("`cargo metadata` output has no packages")?;
    let manifest_path = packages
        .iter()
        .find(|p| p["name"] == SYS_PACKAGE)
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or_else(|| format!("package {SYS_PACKAGE} is not in `cargo metadata`; is Cargo.toml intact?"))?;
    let root = Path::new(manifest_path).parent().ok_or("manifest_path has no parent")?;
    check_sdcpp(root.join("stable-diffusion.cpp"))
}

fn check_sdcpp(dir: PathBuf) -> Result<PathBuf, String> {
    if dir.join("src/stable-diffusion.cpp").is_file() && dir.join("ggml/src/ggml.c").is_file() {
        Ok(dir)
    } else {
        Err(format!(
            "{} is not a stable-diffusion.cpp source tree (no src/stable-diffusion.cpp or ggml/)",
            dir.display()
        ))
    }
}
