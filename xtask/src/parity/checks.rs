//! The checks of `cargo xtask parity`: the reference's side and each comparison per family.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use sd_models::files::ModelFiles;
use sd_models::fixture::FixtureModel;

use super::*;
use crate::bench::run_measured;

fn sdref(exe: &Path, sub: &str, model: &Path, threads: u32) -> Command {
    let mut c = Command::new(exe);
    c.arg(sub).arg("-m").arg(model).args(["-t", &threads.to_string()]);
    c
}

pub(crate) fn run_ok(mut cmd: Command, what: &str) -> Result<f64> {
    let m = run_measured(&mut cmd)?;
    m.check(what)?;
    Ok(m.wall_s)
}

/// `txt2img` flags shared by both programs.
fn gen_flags(prompt: &str, side: u32, steps: u32, threads: u32) -> Vec<String> {
    let side = side.to_string();
    [
        "-p",
        prompt,
        "-W",
        &side,
        "-H",
        &side,
        "--steps",
        &steps.to_string(),
        "--sampling-method",
        "euler",
        "--cfg-scale",
        "7",
        "-s",
        "42",
        "-t",
        &threads.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

// ---------------------------------------------------------------------------------------
// The checks
// ---------------------------------------------------------------------------------------

pub(super) fn check_family(
    family: FixtureModel,
    threads: u32,
    sdref_exe: &Path,
    ours_exe: &Path,
    cpu: &Cpu,
) -> Result<Vec<Row>> {
    let name = family.name();
    let model = ensure_fixture(family)?;
    let dir = crate::workspace_root().join("target/parity").join(name);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let files = ModelFiles::open_model(&model)?;
    let (clip, unet_cfg, clip_points) = configs(&files)?;
    let mut rows = Vec::new();
    let mut push = |row: Row| {
        row.print();
        rows.push(row);
    };

    // (a) Text.
    let prompts = [PROMPT, WEIGHTED_PROMPT];
    let mut ref_te = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let out = dir.join(format!("te{i}.ref.f32"));
        let mut c = sdref(sdref_exe, "encode-text", &model, threads);
        c.args(["-p", p, "-o"]).arg(&out);
        let s = run_ok(c, "sdref encode-text")?;
        eprintln!("parity: {name}: sdref encode-text {:?} took {s:.1} s (with model load)", p);
        ref_te.push(read_raw(&out)?);
    }
    let t = Instant::now();
    let ours_te = our_text(cpu, &files, &clip, &prompts)?;
    eprintln!("parity: {name}: our text encoder took {:.1} s (with weight load)", t.elapsed().as_secs_f64());
    for (i, ((shape, r), (o, n_tok, hidden))) in ref_te.iter().zip(&ours_te).enumerate() {
        if shape.iter().product::<usize>() != o.len() {
            bail!("{name}: text {i}: the reference's conditioning is {shape:?}, ours [1, {n_tok}, {hidden}]");
        }
        write_raw(&dir.join(format!("te{i}.ours.f32")), &[1, *n_tok, *hidden], o, "our conditioning")?;
        push(Row {
            family: name,
            what: if i == 0 { "text".into() } else { "text (weighted)".into() },
            shape: shape_str(shape),
            diff: Diff::of(&to_f64(o), &to_f64(r))?,
            tol: Tolerance::rounding_points(clip_points),
        });
    }

    // (b) UNet, on the reference's conditioning.
    let (ctx_shape, ctx) = &ref_te[0];
    let n_ctx = ctx_shape.get(1).copied().context("the reference's conditioning has no token axis")?;
    let x_shape = [1, 4, LATENT_SIDE, LATENT_SIDE];
    let x = normal_values(0x5eed_0001, x_shape.iter().product());
    let x_path = dir.join("unet_x.f32");
    write_raw(&x_path, &x_shape, &x, "UNet input x (scaled by c_in), standard normal, splitmix64 seed 0x5eed0001")?;
    let out = dir.join("unet.ref.f32");
    let mut c = sdref(sdref_exe, "unet", &model, threads);
    c.arg("--latent")
        .arg(&x_path)
        .args(["--timestep", &TIMESTEP.to_string(), "--context"])
        .arg(dir.join("te0.ref.f32"));
    c.arg("-o").arg(&out);
    let s = run_ok(c, "sdref unet")?;
    eprintln!("parity: {name}: sdref unet took {s:.1} s (with model load)");
    let (shape, r) = read_raw(&out)?;
    let t = Instant::now();
    let o = our_unet(cpu, &files, &unet_cfg, &x, ctx, n_ctx)?;
    eprintln!("parity: {name}: our UNet took {:.1} s (with weight load)", t.elapsed().as_secs_f64());
    write_raw(&dir.join("unet.ours.f32"), &shape, &o, "our UNet output").ok();
    push(Row {
        family: name,
        what: format!("unet t={TIMESTEP}"),
        shape: shape_str(&shape),
        diff: Diff::of(&to_f64(&o), &to_f64(&r))?,
        tol: Tolerance::rounding_points(UNET_POINTS),
    });

    // (c) VAE decode.
    let z = normal_values(0x5eed_0002, x_shape.iter().product());
    let z_path = dir.join("vae_z.f32");
    write_raw(&z_path, &x_shape, &z, "diffusion-space latent, standard normal, splitmix64 seed 0x5eed0002")?;
    let out = dir.join("vae.ref.f32");
    let mut c = sdref(sdref_exe, "vae-decode", &model, threads);
    c.arg("--latent").arg(&z_path).arg("-o").arg(&out);
    let s = run_ok(c, "sdref vae-decode")?;
    eprintln!("parity: {name}: sdref vae-decode took {s:.1} s (with model load)");
    let (shape, r) = read_raw(&out)?;
    let t = Instant::now();
    let o = our_vae(cpu, &files, &z)?;
    eprintln!("parity: {name}: our VAE took {:.1} s (with weight load)", t.elapsed().as_secs_f64());
    write_raw(&dir.join("vae.ours.f32"), &shape, &o, "our VAE output").ok();
    push(Row {
        family: name,
        what: "vae decode".into(),
        shape: shape_str(&shape),
        diff: Diff::of(&to_f64(&o), &to_f64(&r))?,
        tol: Tolerance::rounding_points(VAE_POINTS),
    });
    drop(files);

    // (d) Whole generation.
    let flags = gen_flags(PROMPT, 256, 4, threads);
    let ref_png = dir.join("txt2img.ref.png");
    let mut c = Command::new(sdref_exe);
    c.arg("txt2img").arg("-m").arg(&model).args(&flags).arg("-o").arg(&ref_png);
    let s = run_ok(c, "sdref txt2img")?;
    eprintln!("parity: {name}: sdref txt2img took {s:.1} s");
    let ours_png = dir.join("txt2img.ours.png");
    let mut c = Command::new(ours_exe);
    c.arg("-m").arg(&model).args(&flags).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
    let s = run_ok(c, "sd-cli")?;
    eprintln!("parity: {name}: our sd-cli took {s:.1} s");
    let (diff, shape) = png_diff(&ours_png, &ref_png)?;
    push(Row { family: name, what: "png 256 euler4".into(), shape, diff, tol: Tolerance::PNG });
    Ok(rows)
}

/// The CI test inputs: `ref-<family>-f16-seed42-64x64-euler2-cfg7.png` (tests/data/README.md),
/// written by the reference, then compared with ours at the same settings.
pub(super) fn write_test_data(
    family: FixtureModel,
    threads: u32,
    sdref_exe: &Path,
    ours_exe: &Path,
    dir: &Path,
) -> Result<Row> {
    let name = family.name();
    let model = ensure_fixture(family)?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let file = dir.join(format!("ref-{name}-f16-seed42-64x64-euler2-cfg7.png"));
    let tmp = dir.join(format!(".ref-{name}.partial.png"));
    let flags = gen_flags("a cat", 64, 2, threads);
    let mut c = Command::new(sdref_exe);
    c.arg("txt2img").arg("-m").arg(&model).args(&flags).arg("-o").arg(&tmp);
    run_ok(c, "sdref txt2img")?;
    std::fs::rename(&tmp, &file).with_context(|| format!("renaming {} to {}", tmp.display(), file.display()))?;
    println!("wrote {}", file.display());
    let work = crate::workspace_root().join("target/parity").join(name);
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let ours_png = work.join("test-data.ours.png");
    let mut c = Command::new(ours_exe);
    c.arg("-m").arg(&model).args(&flags).arg("-o").arg(&ours_png).env("NO_COLOR", "1");
    run_ok(c, "sd-cli")?;
    let (diff, shape) = png_diff(&ours_png, &file)?;
    Ok(Row { family: name, what: "png 64 euler2".into(), shape, diff, tol: Tolerance::PNG })
}
