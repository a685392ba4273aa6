//! Compiling and linking the default ggml libraries with the C/C++ compiler that
//! the `cc` crate finds (CC/CXX/CFLAGS/CXXFLAGS honoured), following
//! `ggml-build.toml`: no CMake, no generator, one job pool over every object.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::spec::{CpuTarget, Spec};

/// One object file to compile.
struct Job {
    src: PathBuf,
    obj: PathBuf,
    cpp: bool,
    args: Vec<String>,
}

/// One shared library: its objects and how to link them.
pub struct Library {
    /// File name of the output (`libggml-cpu-x64.so`).
    pub file: String,
    /// `-Wl,-soname` value, for the core library.
    soname: Option<String>,
    jobs: Vec<Job>,
    /// Links libggml-base.
    links_base: bool,
    /// What else the objects depend on (the hash of a patch applied to the sources).
    extra_key: String,
}

/// What the build needs to know about the toolchain and the tree.
pub struct Toolchain {
    c: cc::Tool,
    cxx: cc::Tool,
    openmp: bool,
    jobs: usize,
    linux: bool,
}

impl Toolchain {
    pub fn detect(out_dir: &Path) -> Result<Self, String> {
        let base = || {
            let mut b = cc::Build::new();
            b.opt_level(3).debug(false).pic(true).warnings(false).cargo_metadata(false);
            b
        };
        let c = base().try_get_compiler().map_err(|e| format!("no C compiler found: {e}"))?;
        let cxx = base()
            .cpp(true)
            .try_get_compiler()
            .map_err(|e| format!("no C++ compiler found (ggml needs one, e.g. g++ or clang++): {e}"))?;
        let linux = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux");
        let jobs = std::env::var("NUM_JOBS").ok().and_then(|j| j.parse().ok()).unwrap_or(2).max(1);
        let mut tc = Toolchain { c, cxx, openmp: false, jobs, linux };
        tc.openmp = tc.probe_openmp(out_dir);
        if !tc.openmp {
            println!("cargo:warning=OpenMP not usable with this compiler: the CPU backend uses ggml's own thread pool");
        }
        Ok(tc)
    }

    /// ggml's CMake uses OpenMP when `find_package(OpenMP)` succeeds; we ask the
    /// compiler to build and link a program with `-fopenmp`.
    fn probe_openmp(&self, out_dir: &Path) -> bool {
        let dir = out_dir.join("probe");
        if fs::create_dir_all(&dir).is_err() {
            return false;
        }
        let src = dir.join("omp.c");
        let prog = "#include <omp.h>\nint main(void) { int n = 0;\n#pragma omp parallel\n{ n = omp_get_num_threads(); }\nreturn n > 0 ? 0 : 1; }\n";
        if fs::write(&src, prog).is_err() {
            return false;
        }
        let mut cmd = self.c.to_command();
        cmd.arg("-fopenmp").arg(&src).arg("-o").arg(dir.join("omp"));
        cmd.output().map(|o| o.status.success()).unwrap_or(false)
    }

    /// Whether the C++ compiler accepts `flag`, decided as CMake's `check_cxx_compiler_flag`
    /// does: a program builds with it, and the compiler says nothing of an option it did not
    /// recognise or ignored (the gist of CMake's CheckCompilerFlagCommonPatterns).
    pub fn accepts_cxx_flag(&self, flag: &str, out_dir: &Path) -> bool {
        let dir = out_dir.join("probe");
        let src = dir.join("flag.cpp");
        if fs::create_dir_all(&dir).is_err() || fs::write(&src, "int main() { return 0; }\n").is_err() {
            return false;
        }
        let mut cmd = self.cxx.to_command();
        cmd.env("LC_ALL", "C").arg(flag).arg(&src).arg("-o").arg(dir.join("flag"));
        let Ok(out) = cmd.output() else { return false };
        let said = String::from_utf8_lossy(&out.stderr).to_lowercase();
        let refused = ["unrecogni", "unknown", "not supported", "ignored", "ignoring", "argument unused", "invalid"];
        out.status.success() && !refused.iter().any(|r| said.contains(r))
    }

    /// A description of the compilers, part of every library's cache key.
    fn identity(&self) -> String {
        let version = |t: &cc::Tool| {
            Command::new(t.path())
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").to_string())
                .unwrap_or_default()
        };
        format!(
            "{:?} {:?} {} | {:?} {:?} {} | omp={}",
            self.c.path(),
            self.c.args(),
            version(&self.c),
            self.cxx.path(),
            self.cxx.args(),
            version(&self.cxx),
            self.openmp
        )
    }
}

fn is_cpp(src: &str) -> bool {
    src.ends_with(".cpp")
}

fn defines(list: &[String]) -> impl Iterator<Item = String> + '_ {
    list.iter().map(|d| format!("-D{d}"))
}

fn includes<'a>(src: &'a Path, list: &'a [String]) -> impl Iterator<Item = String> + 'a {
    list.iter().map(move |i| format!("-I{}", src.join(i).display()))
}

/// A directory of the pinned tree that is compiled from a patched copy.
pub struct PatchedDir {
    /// The directory in the tree, relative to its root (`src/ggml-cpu`).
    pub prefix: &'static str,
    /// Where the patched copy lies.
    pub dir: PathBuf,
    /// The identity of the patch (part of the cache key of every library built from it).
    pub key: String,
    /// Sources the patch adds (paths relative to the tree's root, under `prefix`).
    pub added: Vec<String>,
}

impl PatchedDir {
    /// `rel` (a path relative to the tree's root) in the patched copy, when it lies under
    /// the patched directory.
    fn map(&self, rel: &str) -> Option<PathBuf> {
        let rest = rel.strip_prefix(self.prefix)?;
        if rest.is_empty() {
            return Some(self.dir.clone());
        }
        rest.strip_prefix('/').map(|r| self.dir.join(r))
    }
}

/// `-I` flags for `list`, with the directories under `patched` taken from its copy.
fn includes_patched(src: &Path, patched: &PatchedDir, list: &[String]) -> Vec<String> {
    list.iter().map(|i| format!("-I{}", patched.map(i).unwrap_or_else(|| src.join(i)).display())).collect()
}

/// Builds the job lists of the core library, the RPC plugin and the chosen CPU variants of
/// `cpu_target` (the target's branch, `spec.rs`). `rpc` and `cpu` are the patched copies of
/// `src/ggml-rpc` and `src/ggml-cpu` (every source and include directory under them is
/// taken from the copy).
#[allow(clippy::too_many_arguments)]
pub fn plan(
    spec: &Spec,
    cpu_target: &CpuTarget,
    tc: &Toolchain,
    src: &Path,
    gen_include: &Path,
    obj_root: &Path,
    cpu_variants: &[String],
    version: &str,
    rpc: &PatchedDir,
    cpu: &PatchedDir,
) -> Result<Vec<Library>, String> {
    let mut global: Vec<String> = defines(&spec.defines).collect();
    if tc.linux {
        global.extend(defines(&spec.linux_defines));
    }
    global.push("-DNDEBUG".into());
    let omp: Vec<String> = if tc.openmp { vec!["-fopenmp".into(), "-DGGML_USE_OPENMP".into()] } else { vec![] };
    let std_flag = |cpp: bool| if cpp { "-std=gnu++17" } else { "-std=gnu11" }.to_string();
    let job = |lib: &str, file: &str, extra: &[String]| -> Job {
        let cpp = is_cpp(file);
        let mut args = vec![std_flag(cpp)];
        args.extend(global.iter().cloned());
        args.extend(extra.iter().cloned());
        let stem = file.replace('/', "_");
        Job { src: src.join(file), obj: obj_root.join(lib).join(format!("{stem}.o")), cpp, args }
    };
    let mut libs = Vec::new();

    // libggml-base
    let mut extra: Vec<String> = defines(&spec.base.public_defines).collect();
    extra.extend(defines(&spec.base.private_defines));
    extra.extend(omp.iter().cloned());
    extra.extend(includes(src, &spec.base.includes));
    extra.push(format!("-I{}", gen_include.display()));
    // every file name from the one naming function for the target (src/names.rs)
    let os = crate::names::TargetOs::from_target_os(&std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default());
    let core = crate::names::core_names(os, version);
    libs.push(Library {
        file: core.file,
        soname: Some(core.soname),
        jobs: spec.base.sources.iter().map(|s| job("ggml-base", s, &extra)).collect(),
        links_base: false,
        extra_key: String::new(),
    });

    // what every backend module gets from ggml-base (PUBLIC) and ggml_add_backend_library
    let mut backend: Vec<String> = defines(&spec.base.public_defines).collect();
    backend.extend(defines(&spec.backend.defines));
    backend.extend(includes(src, &spec.backend.includes));

    // a job whose source is taken from a patched copy
    let patched_job = |p: &PatchedDir, lib: &str, file: &str, extra: &[String]| -> Result<Job, String> {
        let mut j = job(lib, file, extra);
        j.src = p.map(file).ok_or_else(|| format!("source `{file}` is not under {} (ggml-build.toml)", p.prefix))?;
        Ok(j)
    };

    // libggml-rpc, compiled from the patched copy of its directory
    let rpc_jobs =
        spec.rpc.sources.iter().map(|s| patched_job(rpc, &spec.rpc.target, s, &backend)).collect::<Result<_, _>>()?;
    libs.push(Library {
        file: crate::names::plugin_file(os, &spec.rpc.target),
        soname: None,
        jobs: rpc_jobs,
        links_base: true,
        extra_key: rpc.key.clone(),
    });

    // libggml-cpu-<variant>
    for v in cpu_variants {
        let variant = cpu_target.variants.get(v).ok_or_else(|| {
            format!(
                "unknown CPU variant `{v}`; ggml-build.toml's {} branch has: {}",
                cpu_target.arch,
                cpu_target.variants.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })?;
        let target = format!("ggml-cpu-{v}");
        let mut extra = backend.clone();
        extra.extend(defines(&cpu_target.defines));
        extra.extend(omp.iter().cloned());
        extra.extend(defines(&variant.defines));
        extra.extend(includes_patched(src, cpu, &cpu_target.includes));
        extra.extend(cpu_target.flags_if_accepted.iter().cloned());
        extra.extend(variant.flags.iter().cloned());
        // every source from the patched copy of src/ggml-cpu (patches/cpu-speed.toml)
        let mut jobs: Vec<Job> = cpu_target
            .sources
            .iter()
            .chain(cpu.added.iter().filter(|a| is_cpp(a) || a.ends_with(".c")))
            .map(|s| patched_job(cpu, &target, s, &extra))
            .collect::<Result<_, _>>()?;
        // the feature-check object: definitions, no ISA flags
        let mut fe: Vec<String> = defines(&spec.backend.defines).collect();
        fe.extend(defines(&variant.defines));
        fe.extend(includes_patched(src, cpu, &cpu_target.feats_includes));
        jobs.push(patched_job(cpu, &target, &cpu_target.feats_source, &fe)?);
        libs.push(Library {
            file: crate::names::plugin_file(os, &target),
            soname: None,
            jobs,
            links_base: true,
            extra_key: cpu.key.clone(),
        });
    }
    Ok(libs)
}

fn key(tc_id: &str, salt: &str, lib: &Library) -> String {
    let mut h = Sha256::new();
    h.update(tc_id.as_bytes());
    h.update(salt.as_bytes());
    h.update(lib.file.as_bytes());
    h.update(lib.extra_key.as_bytes());
    for j in &lib.jobs {
        h.update(j.src.display().to_string().as_bytes());
        for a in &j.args {
            h.update(a.as_bytes());
            h.update([0]);
        }
    }
    format!("{:x}", h.finalize())
}

/// Compiles and links every library whose output or cache key is out of date.
/// `salt` covers what the compile commands do not show (the source tree's identity).
/// Returns the libraries that were (re)built.
/// `after_core` runs once the core library exists (it makes the names the others link by).
pub fn build(
    tc: &Toolchain,
    libs: Vec<Library>,
    lib_dir: &Path,
    salt: &str,
    after_core: &dyn Fn() -> Result<(), String>,
) -> Result<Vec<String>, String> {
    let tc_id = tc.identity();
    let stamp_dir = lib_dir.join(".stamps");
    fs::create_dir_all(&stamp_dir).map_err(|e| format!("{}: {e}", stamp_dir.display()))?;
    let mut todo = Vec::new();
    for lib in libs {
        let k = key(&tc_id, salt, &lib);
        let stamp = stamp_dir.join(&lib.file);
        let fresh = lib_dir.join(&lib.file).exists() && fs::read_to_string(&stamp).map(|s| s == k).unwrap_or(false);
        if !fresh {
            todo.push((lib, k));
        }
    }
    if todo.is_empty() {
        after_core()?;
        return Ok(Vec::new());
    }
    // The core library first (the others link it), then everything else; within a
    // pass the largest sources start first so the two cores finish together.
    let (base, rest): (Vec<_>, Vec<_>) = todo.into_iter().partition(|(l, _)| !l.links_base);
    let mut built = Vec::new();
    for (i, pass) in [base, rest].into_iter().enumerate() {
        if i == 1 {
            after_core()?;
        }
        if pass.is_empty() {
            continue;
        }
        let mut jobs: Vec<&Job> = pass.iter().flat_map(|(l, _)| l.jobs.iter()).collect();
        jobs.sort_by_key(|j| std::cmp::Reverse(fs::metadata(&j.src).map(|m| m.len()).unwrap_or(0)));
        compile_all(tc, &jobs)?;
        for (lib, k) in &pass {
            link(tc, lib, lib_dir)?;
            fs::write(stamp_dir.join(&lib.file), k).map_err(|e| e.to_string())?;
            built.push(lib.file.clone());
        }
    }
    Ok(built)
}

fn compile_all(tc: &Toolchain, jobs: &[&Job]) -> Result<(), String> {
    let next = Mutex::new(0usize);
    let failures = Mutex::new(Vec::<String>::new());
    std::thread::scope(|s| {
        for _ in 0..tc.jobs.min(jobs.len()) {
            s.spawn(|| loop {
                let i = {
                    let mut n = next.lock().unwrap();
                    if *n >= jobs.len() || !failures.lock().unwrap().is_empty() {
                        return;
                    }
                    *n += 1;
                    *n - 1
                };
                if let Err(e) = compile_one(tc, jobs[i]) {
                    failures.lock().unwrap().push(e);
                }
            });
        }
    });
    let f = failures.into_inner().unwrap();
    if f.is_empty() {
        Ok(())
    } else {
        Err(f.join("\n"))
    }
}

fn compile_one(tc: &Toolchain, job: &Job) -> Result<(), String> {
    if let Some(dir) = job.obj.parent() {
        fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let mut cmd = if job.cpp { tc.cxx.to_command() } else { tc.c.to_command() };
    cmd.args(&job.args).arg("-c").arg(&job.src).arg("-o").arg(&job.obj);
    run(&mut cmd, &format!("compiling {}", job.src.display()))
}

fn link(tc: &Toolchain, lib: &Library, lib_dir: &Path) -> Result<(), String> {
    let out = lib_dir.join(&lib.file);
    let tmp = lib_dir.join(format!("{}.tmp", lib.file));
    let mut cmd = tc.cxx.to_command();
    cmd.arg(if tc.linux { "-shared" } else { "-dynamiclib" });
    cmd.arg("-o").arg(&tmp);
    for j in &lib.jobs {
        cmd.arg(&j.obj);
    }
    if let Some(so) = &lib.soname {
        if tc.linux {
            cmd.arg(format!("-Wl,-soname,{so}"));
        } else {
            cmd.arg(format!("-Wl,-install_name,@rpath/{so}"));
        }
    }
    if lib.links_base {
        cmd.arg(format!("-L{}", lib_dir.display())).arg("-lggml-base");
        if !tc.linux {
            // MODULE libraries on macOS resolve ggml-base from the host process.
            cmd.arg("-Wl,-undefined,dynamic_lookup");
        }
    }
    if tc.openmp {
        cmd.arg("-fopenmp");
    }
    cmd.arg("-pthread").arg("-lm");
    run(&mut cmd, &format!("linking {}", lib.file))?;
    fs::rename(&tmp, &out).map_err(|e| format!("{}: {e}", out.display()))
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: cannot run the compiler: {e}"))?;
    if !out.status.success() {
        let mut msg = Vec::new();
        let argv: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        let _ = writeln!(
            msg,
            "{what} failed ({}):\n{} {}",
            out.status,
            cmd.get_program().to_string_lossy(),
            argv.join(" ")
        );
        msg.extend_from_slice(&out.stdout);
        msg.extend_from_slice(&out.stderr);
        return Err(String::from_utf8_lossy(&msg).into_owned());
    }
    Ok(())
}
