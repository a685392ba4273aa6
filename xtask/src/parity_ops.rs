//! `cargo xtask parity ops`: each ggml op our SD models use, on the same inputs, in our ggml and in the reference's.
//!
//! ```text
//! cargo xtask parity ops [--ref-lib DIR] [--plugin FILE] [--out DIR]
//! ```
//!
//! The stage comparisons of `parity --fuzz` say how far a whole module drifts; this says
//! which kernel makes the drift. `xtask/opprobe/probe.c` runs the ops on seeded inputs
//! and writes each output; it is compiled twice with the C compiler (`$CC`, else `cc`):
//!
//! - against the reference's ggml: the headers of stable-diffusion.cpp's copy and the
//!   static libraries its build produced (`--ref-lib`, default: the reference build's
//!   library directory), with `GGML_MAX_NAME=128` as that build has it;
//! - against ours: the pinned ggml's headers, our `libggml-base` and the CPU plugin our
//!   registry picks on this machine (`--plugin` names another, e.g. one built with
//!   `SD_GGML_CPU_LLAMAFILE=off`).
//!
//! Each op's two outputs are compared (bit-identical, or the relative error); the f16
//! matrix products are also compared with their product in double precision, which says
//! which side is the more accurate. Bound: one f16 rounding point per op (`rel_rms <= 4u`,
//! `rel_max <= 8u`, `u = 2^-11`); a kernel that computes something else than the other
//! version's (another formula, a lost precision beyond one rounding) exceeds it.
//!
//! Found with it (docs/parity.md): on a CPU with AVX512-FP16 the
//! reference's ggml (0.12, built with `-march=native`) accumulates f16 dot products in
//! f16, 3.5-4.6x further from the exact product than ours (0.26 accumulates in f32); with
//! that ISA extension off in the reference's build, every op here is bit-identical to our
//! plugin built without LLAMAFILE.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};
use sd_backends::{PluginRegistry, PluginSearch};

use crate::parity::{Diff, Tolerance};
use crate::{reference, workspace_root};

/// `cargo xtask parity ops` flags.
#[derive(clap::Args, Debug, PartialEq)]
pub struct Args {
    /// The reference's static ggml libraries (default: the reference build's; e.g.
    /// target/reference-f32acc/sdref-cc/lib for `cargo xtask reference --f32-accumulation`).
    #[arg(long = "ref-lib", value_name = "DIR")]
    ref_lib: Option<PathBuf>,
    /// Our CPU plugin (default: the one our registry picks on this machine).
    #[arg(long = "plugin", value_name = "FILE")]
    plugin: Option<PathBuf>,
    /// Where the probes and their outputs go (default: target/parity/ops).
    #[arg(long = "out", value_name = "DIR")]
    out: Option<PathBuf>,
}

/// The C compiler: `$CC`, else `cc`.
fn compiler() -> Command {
    Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()))
}

fn run_ok(mut c: Command, what: &str) -> Result<()> {
    let out = c.output().with_context(|| format!("{what}: cannot start {:?}", c.get_program()))?;
    if !out.status.success() {
        bail!("{what} failed ({}):\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The CPU plugin our registry loads on this machine.
///
/// A discovery, not a path built from the plugin directory and a variant's file name:
/// which variant wins is decided at run time by each variant's `ggml_backend_score` on
/// this CPU (only loading them tells), and `SD_PLUGIN_PATH` may put another build first
/// (the parity plugin of `cargo xtask plugins --parity`). The probe must run the kernels
/// sd-cli runs, so it asks the registry sd-cli uses.
fn our_cpu_plugin() -> Result<PathBuf> {
    let reg = PluginRegistry::discover(&PluginSearch::standard(Vec::new()));
    reg.plugins()
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case("cpu"))
        .map(|p| p.path.clone())
        .context("no CPU plugin was found (build the workspace first)")
}

fn read_f32(path: &Path) -> Result<Vec<f64>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if bytes.len() % 4 != 0 {
        bail!("{}: {} bytes is not a whole number of f32", path.display(), bytes.len());
    }
    Ok(bytes.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect())
}

/// One op's comparison, as printed.
fn describe(d: &Diff) -> String {
    if d.max_abs == 0.0 && d.non_finite == 0 {
        "bit-identical".to_string()
    } else {
        format!("rel_rms {:.2e} rel_max {:.2e}", d.rel_rms(), d.rel_max())
    }
}

pub fn run(a: Args) -> Result<()> {
    let out = a.out.unwrap_or_else(|| workspace_root().join("target/parity/ops"));
    let probe = workspace_root().join("xtask/opprobe/probe.c");
    let ref_lib = match a.ref_lib {
        Some(d) => d,
        None => reference::Kernels::Native.static_lib_dir(),
    };
    for lib in ["libggml.a", "libggml-cpu.a", "libggml-base.a"] {
        if !ref_lib.join(lib).is_file() {
            bail!(
                "{} has no {lib}: build the reference (`cargo xtask reference`) or pass --ref-lib",
                ref_lib.display()
            );
        }
    }
    let ref_include = reference::sdcpp_source_dir()?.join("ggml/include");
    let (our_include, our_lib) = (crate::ggml::include_dir(), crate::ggml::lib_dir());
    let plugin = match a.plugin {
        Some(p) => p,
        None => our_cpu_plugin()?,
    };
    let plugin_dir = plugin.parent().context("--plugin has no directory")?.to_path_buf();
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let ref_exe = out.join("probe-ref");
    let mut c = compiler();
    c.args(["-O2", "-w", "-DGGML_MAX_NAME=128"]).arg("-I").arg(&ref_include).arg(&probe);
    for lib in ["libggml.a", "libggml-cpu.a", "libggml-base.a"] {
        c.arg(ref_lib.join(lib));
    }
    c.args(["-fopenmp", "-lstdc++", "-lm", "-lpthread", "-o"]).arg(&ref_exe);
    run_ok(c, "compiling the probe against the reference's ggml")?;

    let our_exe = out.join("probe-ours");
    let mut c = compiler();
    c.args(["-O2", "-w"]).arg("-I").arg(&our_include).arg(&probe);
    c.arg(format!("-L{}", our_lib.display())).arg("-lggml-base").arg(&plugin);
    c.arg(format!("-Wl,-rpath,{}", our_lib.display())).arg(format!("-Wl,-rpath,{}", plugin_dir.display()));
    c.args(["-lm", "-o"]).arg(&our_exe);
    run_ok(c, "compiling the probe against our ggml")?;

    let (ref_out, our_out) = (out.join("ref"), out.join("ours"));
    for (exe, dir) in [(&ref_exe, &ref_out), (&our_exe, &our_out)] {
        std::fs::create_dir_all(dir)?;
        let mut c = Command::new(exe);
        c.arg(dir);
        run_ok(c, &format!("running {}", exe.display()))?;
    }

    println!("ggml ops, ours ({}) against the reference's ({}):", plugin.display(), ref_lib.display());
    let tol = Tolerance::rounding_points(1);
    let mut names: Vec<String> = std::fs::read_dir(&ref_out)?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter_map(|n| n.strip_suffix(".f32").map(str::to_string))
        .filter(|n| !n.starts_with("truth_") && !n.ends_with("_ourstyle"))
        .collect();
    names.sort();
    let mut failed = Vec::new();
    for name in &names {
        let reference = read_f32(&ref_out.join(format!("{name}.f32")))?;
        // Our fused form of an op is compared with the reference's written-out one.
        let ours_name = name.strip_suffix("_refstyle").map_or_else(|| name.clone(), |s| format!("{s}_ourstyle"));
        let ours = read_f32(&our_out.join(format!("{ours_name}.f32")))?;
        let d = Diff::of(&ours, &reference)?;
        let mut line = format!("  {:<28} {:>8} values  {}", ours_name.trim_end_matches("_ourstyle"), d.n, describe(&d));
        let truth = ref_out.join(format!("truth_{name}.f32"));
        if truth.is_file() {
            let t = read_f32(&truth)?;
            line.push_str(&format!(
                "; against f64: ours {:.2e}, reference {:.2e}",
                Diff::of(&ours, &t)?.rel_rms(),
                Diff::of(&reference, &t)?.rel_rms()
            ));
        }
        if !tol.accepts(&d) {
            line.push_str("  EXCEEDS one f16 rounding");
            failed.push(name.clone());
        }
        println!("{line}");
    }
    println!("bound per op: {}", tol.describe());
    if failed.is_empty() {
        Ok(())
    } else {
        bail!("{} op(s) exceed the bound: {}", failed.len(), failed.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn parses_its_flags_and_refuses_others() {
        let a = Cli::try_parse_from(["ops", "--ref-lib", "/r", "--plugin", "/p/libggml-cpu-x64.so", "--out", "/o"])
            .unwrap()
            .args;
        assert_eq!(a.ref_lib, Some(PathBuf::from("/r")));
        assert_eq!(a.plugin, Some(PathBuf::from("/p/libggml-cpu-x64.so")));
        assert_eq!(a.out, Some(PathBuf::from("/o")));
        assert!(Cli::try_parse_from(["ops", "--bogus"]).is_err());
        assert!(Cli::try_parse_from(["ops", "--plugin"]).is_err());
    }
}
