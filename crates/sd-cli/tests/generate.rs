//! End-to-end generation on fixture checkpoints (real SD layouts, random weights), compared with
//! stable-diffusion.cpp's output for the same checkpoint, seed and settings.
//!
//! The reference PNGs in `tests/data/` were produced by `sdref txt2img` (the reference built by
//! `cargo xtask reference`) on the fixtures these tests regenerate; see tests/data/README.md.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use sd_models::fixture::{self, Family, FileFormat, FixtureRequest, WeightType};

/// Tolerances for agreement with the reference (issue: mean <= 1/255, max <= 8/255).
const MEAN_TOL: f64 = 1.0;
const MAX_TOL: u8 = 8;

static FIXTURE_LOCK: Mutex<()> = Mutex::new(());

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The fixture checkpoint of `family` (seed 42, f16), written once per target directory.
fn fixture(family: Family) -> PathBuf {
    let _g = FIXTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = workspace().join("target/fixtures-test");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}-f16-seed42.safetensors", family.name()));
    if !path.exists() {
        let req = FixtureRequest::family(family, 42, WeightType::F16, FileFormat::Safetensors);
        fixture::write_fixture(&path, &req).unwrap();
    }
    path
}

fn sd_cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sd-cli"))
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-gen-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn generate(model: &Path, out: &Path, threads: u32, extra: &[&str]) -> std::process::Output {
    sd_cli()
        .arg("-m")
        .arg(model)
        .args([
            "-p",
            "a cat",
            "-W",
            "64",
            "-H",
            "64",
            "--steps",
            "2",
            "--sampling-method",
            "euler",
            "-s",
            "42",
            "--cfg-scale",
            "7",
        ])
        .args(["-t", &threads.to_string()])
        .arg("-o")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

fn pixels(path: &Path) -> (u32, u32, Vec<u8>) {
    let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut r = dec.read_info().unwrap();
    let mut buf = vec![0; r.output_buffer_size()];
    let info = r.next_frame(&mut buf).unwrap();
    let data = match info.color_type {
        png::ColorType::Rgb => buf[..(info.width * info.height * 3) as usize].to_vec(),
        png::ColorType::Rgba => buf.chunks_exact(4).flat_map(|c| [c[0], c[1], c[2]]).collect(),
        other => panic!("unexpected color type {other:?}"),
    };
    (info.width, info.height, data)
}

/// (mean, max) absolute difference in 8-bit levels.
fn diff(a: &Path, b: &Path) -> (f64, u8) {
    let (wa, ha, pa) = pixels(a);
    let (wb, hb, pb) = pixels(b);
    assert_eq!((wa, ha), (wb, hb), "image sizes differ");
    let d: Vec<u8> = pa.iter().zip(&pb).map(|(x, y)| x.abs_diff(*y)).collect();
    (d.iter().map(|&v| v as f64).sum::<f64>() / d.len() as f64, d.iter().copied().max().unwrap_or(0))
}

fn check_ok(out: &std::process::Output) {
    assert!(out.status.success(), "sd-cli failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn sd15_matches_the_reference_is_deterministic_and_thread_independent() {
    let model = fixture(Family::Sd15);
    let dir = out_dir("sd15");
    let a = dir.join("a.png");
    check_ok(&generate(&model, &a, 2, &[]));
    let reference = workspace().join("tests/data/ref-sd15-f16-seed42-64x64-euler2-cfg7.png");
    let (mean, max) = diff(&a, &reference);
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "vs stable-diffusion.cpp: mean {mean:.3}, max {max}");

    // Same seed, same settings: byte-identical file.
    let b = dir.join("b.png");
    check_ok(&generate(&model, &b, 2, &[]));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "same seed gave different bytes");

    // Another thread count: the kernels split work differently; within the parity tolerance.
    let c = dir.join("c.png");
    check_ok(&generate(&model, &c, 1, &[]));
    let (mean, max) = diff(&a, &c);
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "-t 1 vs -t 2: mean {mean:.3}, max {max}");

    // The parameters chunk names the settings.
    let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&a).unwrap()));
    let r = dec.read_info().unwrap();
    let text = r.info().uncompressed_latin1_text.iter().find(|t| t.keyword == "parameters").expect("parameters chunk");
    assert!(text.text.starts_with("a cat\nSteps: 2, Sampler: Euler"), "{}", text.text);
    assert!(text.text.contains("Seed: 42") && text.text.contains("Size: 64x64"), "{}", text.text);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sd21_v_prediction_matches_the_reference() {
    let model = fixture(Family::Sd21);
    let dir = out_dir("sd21");
    let a = dir.join("a.png");
    let out = generate(&model, &a, 2, &[]);
    check_ok(&out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("prediction v"));
    let reference = workspace().join("tests/data/ref-sd21-f16-seed42-64x64-euler2-cfg7.png");
    let (mean, max) = diff(&a, &reference);
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs sd-cli expecting failure; returns stderr. No output file may be left behind.
fn fails(args: &[&str], model: Option<&Path>) -> String {
    let dir = out_dir(&format!("bad-{}", args.join("_").replace(['/', ' '], "")));
    let out_png = dir.join("x.png");
    let mut cmd = sd_cli();
    if let Some(m) = model {
        cmd.arg("-m").arg(m);
    }
    let out = cmd.args(args).arg("-o").arg(&out_png).output().unwrap();
    assert!(!out.status.success(), "expected failure for {args:?}");
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    assert!(leftovers.is_empty(), "files left behind: {leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_generation_settings_are_clear_errors() {
    let m = Path::new("/nonexistent/model.safetensors");
    assert!(fails(&["-W", "100", "-H", "64"], Some(m)).contains("multiples of 8"));
    assert!(fails(&["--steps", "0"], Some(m)).contains("--steps 0"));
    assert!(fails(&["--sampling-method", "nope"], Some(m)).contains("euler"));
    assert!(fails(&["--strength", "2"], Some(m)).contains("--strength"));
    assert!(fails(&["--type", "q9"], Some(m)).contains("q8_0"));
    assert!(fails(&["-p", "x"], Some(m)).contains("/nonexistent/model.safetensors"));
}

#[test]
fn malformed_model_files_are_clear_errors() {
    let dir = out_dir("malformed");
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, [200u8, 0, 0, 0, 0, 0, 0, 0, b'{']).unwrap();
    let err = fails(&["-p", "x", "-W", "64", "-H", "64"], Some(&truncated));
    assert!(err.contains("truncated.safetensors"), "{err}");
    let text = dir.join("notes.safetensors");
    std::fs::write(&text, "just some text, not a model at all").unwrap();
    let err = fails(&["-p", "x"], Some(&text));
    assert!(err.contains("notes.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
