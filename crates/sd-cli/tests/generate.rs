//! End-to-end generation on fixture checkpoints (real SD layouts, random weights), compared with
//! stable-diffusion.cpp's output for the same checkpoint, seed and settings.
//!
//! The reference PNGs in `tests/data/` were produced by `sdref txt2img` (the reference built by
//! `cargo xtask reference`) on the fixtures these tests regenerate; see tests/data/README.md.

mod common;

use std::path::{Path, PathBuf};

use common::{sd_cli, write_init_png};
use sd_models::fixture::{self, FixtureModel, WeightType};

/// Tolerances for agreement with the reference (issue: mean <= 1/255, max <= 8/255).
const MEAN_TOL: f64 = 1.0;
const MAX_TOL: u8 = 8;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The fixture checkpoint of `family` (seed 42, f16), written once into the fixture cache.
fn fixture(family: FixtureModel) -> PathBuf {
    fixture::ensure_cached(family, 42, WeightType::F16).unwrap().0
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-gen-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn generate(model: &Path, out: &Path, threads: u32, extra: &[&str]) -> std::process::Output {
    generate_steps(model, out, threads, 2, extra)
}

/// [`generate`] with another step count.
fn generate_steps(model: &Path, out: &Path, threads: u32, steps: u32, extra: &[&str]) -> std::process::Output {
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
            &steps.to_string(),
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
    let mut buf = vec![0; r.output_buffer_size().unwrap()];
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
    let model = fixture(FixtureModel::Sd15);
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
    let model = fixture(FixtureModel::Sd21);
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
    // One directory per call: tests run in parallel and may fail with the same arguments.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = out_dir(&format!("bad-{n}"));
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
    // (-W 100 is not an error: like the reference, the size is aligned up to 128.)
    assert!(fails(&["-b", "0"], Some(m)).contains("-b 0"));
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

/// `--type q8_0` re-quantizes the f16 fixture at load. q8_0 stores each block of 32 weights
/// as int8 times an f16 scale (absmax / 127): every weight moves by at most absmax / 254,
/// about 0.4% of the weights' magnitude in RMS terms. A relative perturbation of that size in
/// every layer moves the 8-bit image by about 0.4% of its 255-level range, i.e. about one
/// level: so the mean difference must stay within one level and the largest within the
/// 8 levels we allow between two implementations of the same kernels (the reference
/// tolerance). Changing the seed, for scale, moves the image by ~70 levels on average.
#[test]
fn sd15_q8_0_is_close_to_f16_and_deterministic() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("q8_0");
    let f16 = dir.join("f16.png");
    check_ok(&generate(&model, &f16, 2, &[]));
    let q8 = dir.join("q8_0.png");
    check_ok(&generate(&model, &q8, 2, &["--type", "q8_0"]));
    let (mean, max) = diff(&f16, &q8);
    assert!(mean > 0.0, "--type q8_0 gave the f16 image exactly: the weights were not quantized");
    assert!(mean <= 1.0 && max <= MAX_TOL, "q8_0 vs f16: mean {mean:.3}, max {max}");

    let again = dir.join("q8_0-again.png");
    check_ok(&generate(&model, &again, 2, &["--type", "q8_0"]));
    assert_eq!(std::fs::read(&q8).unwrap(), std::fs::read(&again).unwrap(), "q8_0: same seed gave different bytes");
    let _ = std::fs::remove_dir_all(&dir);
}

/// img2img keeps the init image's content. The fixture's VAE has random weights, so
/// decoding an encoded image does not give the image back: on this fixture every output,
/// img2img or not, is ~75 levels from the init, and whether the img2img output or the
/// txt2img one lies nearer the init is chance (it flips between init images). What img2img
/// must do is start from the init's latent, so the reference point is `r`, the init's latent
/// barely sampled (20 steps at strength 0.05 run only the last two, at the schedule's
/// smallest sigmas). At strength 0.3 (with 2 steps: the last step only) the output must lie
/// nearer `r` than the txt2img image of the same seed does (measured: ~20 vs ~28 levels),
/// and nearer than the output for another init image does.
#[test]
fn sd15_img2img_stays_near_its_init_image() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("img2img");
    let (init_a, init_b) = (dir.join("init-a.png"), dir.join("init-b.png"));
    write_init_png(&init_a, false);
    write_init_png(&init_b, true);
    let a = dir.join("a.png");
    check_ok(&generate(&model, &a, 2, &["-i", init_a.to_str().unwrap(), "--strength", "0.3"]));
    let b = dir.join("b.png");
    check_ok(&generate(&model, &b, 2, &["-i", init_b.to_str().unwrap(), "--strength", "0.3"]));
    let r = dir.join("r.png");
    check_ok(&generate_steps(&model, &r, 2, 20, &["-i", init_a.to_str().unwrap(), "--strength", "0.05"]));
    // The txt2img image of the same seed and settings: stable-diffusion.cpp's, which ours
    // matches within the reference tolerance (sd15_matches_the_reference_...).
    let txt2img = workspace().join("tests/data/ref-sd15-f16-seed42-64x64-euler2-cfg7.png");

    let (to_r, _) = diff(&a, &r);
    let (txt2img_to_r, _) = diff(&txt2img, &r);
    let (other_to_r, _) = diff(&b, &r);
    assert!(to_r < txt2img_to_r, "strength 0.3 is {to_r:.2} levels from the init's decode, txt2img {txt2img_to_r:.2}");
    assert!(
        to_r < other_to_r,
        "strength 0.3 is {to_r:.2} levels from the init's decode, another init's {other_to_r:.2}"
    );
    let (a_to_b, _) = diff(&a, &b);
    assert!(
        a_to_b > MEAN_TOL,
        "two init images gave the same output (mean difference {a_to_b:.3}): the init is unused"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
/// `--strength` must lie in [0, 1], as in the reference (0 is accepted there: it runs the
/// last step only, see `img2img_strength_selects_the_schedule_tail`).
fn strength_outside_zero_to_one_is_a_clear_error() {
    let dir = out_dir("strength");
    let init = dir.join("init.png");
    write_init_png(&init, false);
    let m = workspace().join("target/fixtures-test/never-opened.safetensors");
    for s in ["-0.5", "1.5", "nan"] {
        let flag = format!("--strength={s}");
        let err = fails(&["-p", "x", "-W", "64", "-H", "64", "-i", init.to_str().unwrap(), &flag], Some(&m));
        assert!(err.contains("--strength"), "--strength {s}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// The samplers and schedulers beyond euler/discrete. The reference PNGs
// `tests/data/ref-sd15-f16-seed42-64x64-<method>-<scheduler>3-cfg7.png` were written by
// `cargo xtask parity samplers --write-test-data` (sdref txt2img, "a cat", 64x64, 3 steps, cfg 7,
// seed 42, default eta); see tests/data/README.md.

/// Must match the cases `cargo xtask parity samplers --write-test-data` writes.
const CASES: [(&str, &str); 5] =
    [("ipndm", "karras"), ("res_2s", "discrete"), ("er_sde", "ays"), ("euler_a_cfg_pp", "gits"), ("tcd", "lcm")];

#[test]
fn new_samplers_and_schedulers_match_the_reference() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("samplers");
    let mut failures = Vec::new();
    let mut previous: Option<Vec<u8>> = None;
    for (method, scheduler) in CASES {
        let out = dir.join(format!("{method}-{scheduler}.png"));
        let run = sd_cli()
            .arg("-m")
            .arg(&model)
            .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "3", "--cfg-scale", "7", "-s", "42", "-t", "2"])
            .args(["--sampling-method", method, "--scheduler", scheduler])
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(run.status.success(), "{method} {scheduler}: {}", String::from_utf8_lossy(&run.stderr));
        let reference =
            workspace().join(format!("tests/data/ref-sd15-f16-seed42-64x64-{method}-{scheduler}3-cfg7.png"));
        let (mean, max) = diff(&out, &reference);
        let ours = pixels(&out).2;
        eprintln!("{method} {scheduler}: mean {mean:.3} max {max} levels");
        if mean > MEAN_TOL || max > MAX_TOL {
            failures.push(format!("{method} {scheduler}: mean {mean:.3}, max {max}"));
        }
        // The cases must differ from each other, or the comparison would not tell samplers apart.
        if let Some(p) = &previous {
            assert_ne!(p, &ours, "{method} {scheduler} gave the same image as the case before");
        }
        previous = Some(ours);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "vs stable-diffusion.cpp: {failures:?}");
}

#[test]
fn help_lists_every_sampler_and_scheduler() {
    let out = sd_cli().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    // The flag's line and its description, up to the next flag.
    let line_of = |flag: &str| -> String {
        let lines: Vec<&str> = help.lines().collect();
        let start = lines
            .iter()
            .position(|l| l.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("{flag} not in --help"));
        let end = lines[start + 1..]
            .iter()
            .position(|l| l.trim_start().starts_with('-'))
            .map_or(lines.len(), |i| start + 1 + i);
        format!("{} ", lines[start..end].join(" ").split_whitespace().collect::<Vec<_>>().join(" "))
    };
    let methods = line_of("--sampling-method");
    for m in sd_models::sampling::SampleMethod::ALL {
        let listed = methods.contains(&format!(" {},", m.name())) || methods.contains(&format!(" {} ", m.name()));
        assert!(listed, "{m}: {methods}");
    }
    let schedulers = line_of("--scheduler");
    for s in sd_models::sampling::Scheduler::ALL {
        assert!(
            schedulers.contains(&format!(" {},", s.name())) || schedulers.contains(&format!(" {} ", s.name())),
            "{s}: {schedulers}"
        );
    }
}

#[test]
fn unknown_sampler_and_scheduler_names_are_errors_naming_the_flag() {
    for (flag, bad) in [("--sampling-method", "euler_b"), ("--scheduler", "Karras")] {
        let out = sd_cli().args(["-m", "/nonexistent/model.safetensors", "-p", "x", flag, bad]).output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag) && err.contains(bad), "{err}");
    }
}

/// `--cpu-extra-bufts on` (the default) puts the UNet's and text encoder's quantized linear
/// weights in ggml's extra CPU buffer types (repacked q4_0 on AVX2; AMX for q8_0 and q4_0 on
/// CPUs with AMX-INT8). The repacked kernels quantize activations as the plain ones do and
/// differ only in the f32 summation order, so the image stays within the parity bound of the
/// same run with them off. Measured on an AVX2 machine (64x64, cfg 7): q4_0 mean 0.354 max 3
/// levels at 1 step, 0.355 and 2 at 2 steps; q8_0 identical (x86 has no repacked q8_0 and
/// that CPU has no AMX, so nothing moves). On a Sapphire Rapids guest (AMX) both go through
/// ggml's AMX kernels, with cfg 7 a batch of two: before `patches/cpu-speed.toml`'s AMX hunks
/// q8_0 died of SIGILL and, with the tile configuration fixed, every image was one flat
/// colour (mean 111); now q8_0 mean 0.394 max 3, q4_0 0.329 and 3. One step each
/// keeps the four runs cheap. A bad value of the flag is a clear error.
#[test]
fn sd15_cpu_extra_buffer_types_stay_within_parity_of_plain_buffers() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("extra-bufts");
    for ty in ["q4_0", "q8_0"] {
        let on = dir.join(format!("{ty}-on.png"));
        let off = dir.join(format!("{ty}-off.png"));
        check_ok(&generate_steps(&model, &on, 2, 1, &["--type", ty, "--cpu-extra-bufts", "on"]));
        check_ok(&generate_steps(&model, &off, 2, 1, &["--type", ty, "--cpu-extra-bufts", "off"]));
        let (mean, max) = diff(&on, &off);
        eprintln!("{ty}: extra buffer types on vs off: mean {mean:.3}, max {max}");
        assert!(mean <= MEAN_TOL && max <= MAX_TOL, "{ty} on vs off: mean {mean:.3}, max {max}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(fails(&["--cpu-extra-bufts", "maybe"], Some(&model)).contains("on"));
}

/// The reference's LoRA command on `model` (64x64, 2 euler steps, cfg 7, seed 42, 2 threads)
/// with `prompt`, `extra` flags and the LoRAs of `dir`, into `dir/name` (checked to succeed).
fn with_loras(model: &Path, dir: &Path, name: &str, prompt: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let o = sd_cli()
        .args(extra)
        .arg("-m")
        .arg(model)
        .args(["-p", prompt, "-W", "64", "-H", "64", "--steps", "2", "--sampling-method", "euler"])
        .args(["-s", "42", "--cfg-scale", "7", "-t", "2", "--lora-model-dir"])
        .arg(dir)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    check_ok(&o);
    out
}

/// The LoRA fixtures of the LoRA tests (written into `dir`): a kohya file (rank 4, alpha 2,
/// values N(0, 0.1), seed 1) and a PEFT file of the UNet (rank 8, no alpha, N(0, 0.05), seed 2;
/// the reference applies no PEFT text-encoder key on SD 1.x, see `sd_models::fixture::lora`).
fn write_loras(dir: &Path) {
    use sd_models::fixture::lora::{write_lora, LoraFixture, LoraLayout};
    let kohya = LoraFixture { layout: LoraLayout::Kohya, rank: 4, seed: 1, scale: 0.1, text_encoder: true };
    let peft = LoraFixture { layout: LoraLayout::Peft, rank: 8, seed: 2, scale: 0.05, text_encoder: false };
    write_lora(&dir.join("kohya.safetensors"), &kohya).unwrap();
    write_lora(&dir.join("peft.safetensors"), &peft).unwrap();
}

#[test]
fn sd15_loras_match_the_reference_and_multiplier_zero_changes_nothing() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("lora");
    write_loras(&dir);
    let gen = |name: &str, prompt: &str, extra: &[&str]| with_loras(&model, &dir, name, prompt, extra);
    let plain = workspace().join("tests/data/ref-sd15-f16-seed42-64x64-euler2-cfg7.png");
    let mut kohya = PathBuf::new();
    for (name, prompt, reference) in [
        ("kohya.png", "a cat<lora:kohya:1>", "ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-kohya1.png"),
        (
            "two.png",
            "a cat<lora:kohya:0.5><lora:peft.safetensors:-1>",
            "ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-kohya0.5-peft-1.png",
        ),
    ] {
        let ours = gen(name, prompt, &[]);
        let (mean, max) = diff(&ours, &workspace().join("tests/data").join(reference));
        assert!(mean <= MEAN_TOL && max <= MAX_TOL, "{prompt} vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
        // The adapters changed the image (far beyond the parity tolerance) from the reference's
        // image without LoRA.
        let (mean, _) = diff(&ours, &plain);
        assert!(mean > 4.0 * MEAN_TOL, "{prompt}: mean {mean:.3} from the image without LoRA");
        if kohya.as_os_str().is_empty() {
            kohya = ours;
        }
    }
    // Multiplier 0 leaves the weights unchanged, bit for bit, and parameters on disk are merged
    // at each staging as those on the device once: the same file as kohya x1 on the device.
    let disk = ["--params-backend", "diffusion=disk,te=disk"];
    let zero = gen(
        "zero.png",
        "a cat<lora:kohya:1><lora:peft:0>",
        &[&disk[..], &["--lora-apply-mode", "immediately"]].concat(),
    );
    assert_eq!(
        std::fs::read(&kohya).unwrap(),
        std::fs::read(&zero).unwrap(),
        "kohya x1 + peft x0 with params on disk differs from kohya x1 on the device"
    );

    // at_runtime: the low-rank products in the graph, against the reference's at_runtime run
    // and within the same tolerance of our merge.
    let rt = gen("rt.png", "a cat<lora:kohya:1>", &["--lora-apply-mode", "at_runtime"]);
    let reference = workspace().join("tests/data/ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-kohya1-at_runtime.png");
    let (mean, max) = diff(&rt, &reference);
    assert!(
        mean <= MEAN_TOL && max <= MAX_TOL,
        "at_runtime vs stable-diffusion.cpp at_runtime: mean {mean:.3}, max {max}"
    );
    let (mean, max) = diff(&rt, &kohya);
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "at_runtime vs immediately: mean {mean:.3}, max {max}");
    assert_ne!(pixels(&rt).2, pixels(&kohya).2, "at_runtime ran the merged weights");
    let (mean, _) = diff(&rt, &plain);
    assert!(mean > 4.0 * MEAN_TOL, "at_runtime: mean {mean:.3} from the image without LoRA");
    // auto with the parameters on disk applies at run time (a merge would be redone at every
    // staging), and an adapter of multiplier 0 adds zero products: the at_runtime image of
    // kohya alone, bit for bit, with the adapters staged from disk with their layers.
    let auto_disk = gen("rt-disk.png", "a cat<lora:kohya:1><lora:peft:0>", &disk);
    assert_eq!(std::fs::read(&rt).unwrap(), std::fs::read(&auto_disk).unwrap(), "auto, params on disk vs at_runtime");

    // Over two RPC servers: a layer split of the UNet (each adapter on its layer's device) and
    // graph-level row splits of the text encoder (the adapters' products on the main device
    // added to the gathered chunks; immediately merges before the weights are cut) give the
    // all-CPU images bit for bit.
    let (a, b) = (common::Server::start(), common::Server::start());
    let rpc = format!("{},{}", a.endpoint, b.endpoint);
    let layer = ["--rpc", rpc.as_str(), "--backend", "diffusion=RPC0&RPC1,te=cpu,vae=cpu", "--pipeline-copies", "1"];
    let runtime = ["--lora-apply-mode", "at_runtime"];
    let px = gen("rt-layer.png", "a cat<lora:kohya:1>", &[&layer[..], &runtime].concat());
    assert_eq!(std::fs::read(&rt).unwrap(), std::fs::read(&px).unwrap(), "at_runtime, UNet layer split vs CPU");
    let rows = ["--rpc", rpc.as_str(), "--split-mode", "te=row", "--backend", "te=RPC0&RPC1,diffusion=cpu,vae=cpu"];
    let px = gen("rt-rows.png", "a cat<lora:kohya:1>", &[&rows[..], &runtime].concat());
    assert_eq!(std::fs::read(&rt).unwrap(), std::fs::read(&px).unwrap(), "at_runtime, te row split vs CPU");
    let px = gen("im-rows.png", "a cat<lora:kohya:1>", &[&rows[..], &["--lora-apply-mode", "immediately"]].concat());
    assert_eq!(std::fs::read(&kohya).unwrap(), std::fs::read(&px).unwrap(), "immediately, te row split vs CPU");
    let _ = std::fs::remove_dir_all(&dir);
}

/// LyCORIS LoHa and LoKr files under kohya's names (rank 4, alpha 2 on some keys, seed 3,
/// values N(0, 0.3) and N(0, 0.1); LoKr on the linear layers only, see
/// `sd_models::fixture::lora`), against
/// the reference merged and, for LoHa, in the graph (the reference's at_runtime merges LoHa
/// into the weight in the graph; its runtime path for a LoKr whose `w2` is a product does
/// not run, so our at_runtime LoKr is checked against our merge).
#[test]
fn sd15_loha_and_lokr_match_the_reference() {
    use sd_models::fixture::lora::{write_lora, LoraFixture, LoraLayout};
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("lycoris");
    for (layout, name, scale) in [(LoraLayout::Loha, "loha", 0.3), (LoraLayout::Lokr, "lokr", 0.1)] {
        let req = LoraFixture { layout, rank: 4, seed: 3, scale, text_encoder: true };
        write_lora(&dir.join(format!("{name}.safetensors")), &req).unwrap();
    }
    let gen = |name: &str, prompt: &str, extra: &[&str]| with_loras(&model, &dir, name, prompt, extra);
    let plain = workspace().join("tests/data/ref-sd15-f16-seed42-64x64-euler2-cfg7.png");
    let rt = ["--lora-apply-mode", "at_runtime"];
    let mut images = Vec::new();
    for (name, prompt, extra, reference) in [
        ("loha.png", "a cat<lora:loha:1>", &[][..], "ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-loha1.png"),
        // The reference's at_runtime merges a LoHa delta into the weight in the graph: its
        // image is the merged one, bit for bit.
        ("loha-rt.png", "a cat<lora:loha:1>", &rt[..], "ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-loha1.png"),
        (
            "lokr.png",
            "a cat<lora:lokr:1><lora:loha:-0.5>",
            &[][..],
            "ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-lokr1-loha-0.5.png",
        ),
    ] {
        let ours = gen(name, prompt, extra);
        let (mean, max) = diff(&ours, &workspace().join("tests/data").join(reference));
        assert!(
            mean <= MEAN_TOL && max <= MAX_TOL,
            "{prompt} {extra:?} vs stable-diffusion.cpp: mean {mean:.3}, max {max}"
        );
        let (mean, _) = diff(&ours, &plain);
        assert!(mean > 4.0 * MEAN_TOL, "{prompt}: mean {mean:.3} from the image without LoRA");
        images.push(ours);
    }
    // At run time the LoHa and LoKr deltas are low-rank products in the graph (no weight byte
    // changed): within rounding of the merge, and not the merged weights.
    let lokr_rt = gen("lokr-rt.png", "a cat<lora:lokr:1><lora:loha:-0.5>", &rt);
    let (mean, max) = diff(&lokr_rt, &images[2]);
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "LoKr at_runtime vs immediately: mean {mean:.3}, max {max}");
    assert_ne!(pixels(&lokr_rt).2, pixels(&images[2]).2, "at_runtime ran merged weights");
    assert_ne!(pixels(&images[1]).2, pixels(&images[0]).2, "at_runtime ran merged weights");
    let _ = std::fs::remove_dir_all(&dir);
}

/// LyCORIS files the reference also reads: LoCon's Tucker-decomposed 3x3 convolutions
/// (`lora_mid`, kohya pairs on the other modules) and full deltas (`diff`), rank 4, seed 5.
/// The Tucker file is checked against the reference's at_runtime image: its graph runs down,
/// core and up as the three convolutions LyCORIS trains, while its merge contracts the core's
/// two rank axes with the wrong factors (10.6 levels mean from its own at_runtime image on
/// this file; ours agree with at_runtime in both modes: 0.07 mean, max 1). The diff file against its merge. At
/// run time ours are within rounding of our merge.
#[test]
fn sd15_tucker_and_diff_loras_match_the_reference() {
    use sd_models::fixture::lora::{write_lora, LoraFixture, LoraLayout};
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("tucker");
    for (layout, name, scale) in [(LoraLayout::Tucker, "tucker", 0.15), (LoraLayout::Diff, "diff", 0.008)] {
        let req = LoraFixture { layout, rank: 4, seed: 5, scale, text_encoder: true };
        write_lora(&dir.join(format!("{name}.safetensors")), &req).unwrap();
    }
    let gen = |name: &str, prompt: &str, extra: &[&str]| with_loras(&model, &dir, name, prompt, extra);
    let plain = workspace().join("tests/data/ref-sd15-f16-seed42-64x64-euler2-cfg7.png");
    let rt = ["--lora-apply-mode", "at_runtime"];
    for (name, prompt, reference) in [
        ("tucker", "a cat<lora:tucker:1>", "ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-tucker1-at_runtime.png"),
        ("diff", "a cat<lora:diff:-0.7>", "ref-sd15-f16-seed42-64x64-euler2-cfg7-lora-diff-0.7.png"),
    ] {
        let ours = gen(&format!("{name}.png"), prompt, &[]);
        let at_rt = gen(&format!("{name}-rt.png"), prompt, &rt);
        for (mode, image) in [("immediately", &ours), ("at_runtime", &at_rt)] {
            let (mean, max) = diff(image, &workspace().join("tests/data").join(reference));
            assert!(
                mean <= MEAN_TOL && max <= MAX_TOL,
                "{prompt} {mode} vs stable-diffusion.cpp: mean {mean:.3}, max {max}"
            );
        }
        let (mean, _) = diff(&ours, &plain);
        assert!(mean > 4.0 * MEAN_TOL, "{prompt}: mean {mean:.3} from the image without LoRA");
        assert_ne!(pixels(&at_rt).2, pixels(&ours).2, "{prompt}: at_runtime ran merged weights");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_at_runtime_counts_in_the_plan() {
    // `sd-cli plan` with at_runtime adds each adapter's matrices to the module it adapts (f16
    // here, as in the file: the same bytes as the file's `lora_unet_` matrices); immediately
    // adds nothing to the devices.
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("lora-plan");
    write_loras(&dir);
    let d = dir.to_str().unwrap();
    let diffusion_bytes = |extra: &[&str]| {
        let o = sd_cli()
            .arg("plan")
            .arg("-m")
            .arg(&model)
            .args(["--lora-model-dir", d, "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&o.stderr));
        let p: sd_placement::Plan = serde_json::from_slice(&o.stdout).unwrap();
        p.modules.iter().find(|m| m.module.name() == "diffusion").unwrap().param_bytes
    };
    let files = sd_models::files::ModelFiles::open_model(dir.join("kohya.safetensors")).unwrap();
    let unet_matrices: u64 = files
        .index()
        .entries()
        .iter()
        .filter(|e| e.original_name.starts_with("lora_unet_") && e.original_name.ends_with(".weight"))
        .map(|e| e.len)
        .sum();
    assert!(unet_matrices > 0);
    let none = diffusion_bytes(&[]);
    let rt = diffusion_bytes(&["-p", "a cat<lora:kohya:1>", "--lora-apply-mode", "at_runtime"]);
    let merged = diffusion_bytes(&["-p", "a cat<lora:kohya:1>", "--lora-apply-mode", "immediately"]);
    assert_eq!(rt - none, unet_matrices, "at_runtime adds the adapters' bytes");
    assert_eq!(merged, none, "immediately adds no device bytes");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lora_bad_inputs_are_clear_errors() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("lora-bad");
    write_loras(&dir);
    let d = dir.to_str().unwrap();
    let base = ["-W", "64", "-H", "64", "--steps", "1", "--lora-model-dir", d];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [base, extra].concat()
    }
    let e = fails(&with(&base, &["-p", "a cat <lora:missing_style:1>"]), Some(&model));
    assert!(e.contains("missing_style") && e.contains(d), "{e}");
    let e = fails(&with(&base, &["-p", "x", "--lora-apply-mode", "later"]), Some(&model));
    assert!(e.contains("--lora-apply-mode") && e.contains("later"), "{e}");
    std::fs::write(dir.join("broken.safetensors"), b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}").unwrap();
    let e = fails(&with(&base, &["-p", "<lora:broken:1>"]), Some(&model));
    assert!(e.contains("broken.safetensors"), "{e}");
    let e = fails(&with(&base, &["-p", "<lora:broken:1>", "--lora-apply-mode", "at_runtime"]), Some(&model));
    assert!(e.contains("broken.safetensors"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--taesd` (the tiny autoencoder instead of the VAE) on the SD 1.5 fixture with a TAESD
/// fixture (`cargo xtask fixture taesd`, seed 42): the reference's image within the parity
/// tolerance, and another image than the VAE's.
#[test]
fn sd15_with_taesd_matches_the_reference() {
    use sd_models::fixture::taesd::{cached_taesd_path, write_taesd};
    let model = fixture(FixtureModel::Sd15);
    let tae = cached_taesd_path(4, 42, WeightType::F16);
    if !tae.exists() {
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        write_taesd(&tae, 4, 42, WeightType::F16, fixture::FileFormat::Safetensors).unwrap();
    }
    let dir = out_dir("taesd");
    let out = dir.join("taesd.png");
    check_ok(&generate(&model, &out, 2, &["--taesd", tae.to_str().unwrap()]));
    let data = workspace().join("tests/data");
    let (mean, max) = diff(&out, &data.join("ref-sd15-f16-seed42-64x64-euler2-cfg7-taesd.png"));
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "TAESD decode vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    let (mean, _) = diff(&out, &data.join("ref-sd15-f16-seed42-64x64-euler2-cfg7.png"));
    assert!(mean > 4.0 * MEAN_TOL, "the TAESD image is the VAE's: mean {mean:.3}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A narrow ESRGAN fixture of the real layout (2 blocks, 16 features) of factor `scale`.
fn esrgan_fixture(dir: &Path, scale: usize) -> PathBuf {
    let path = dir.join(format!("esrgan-x{scale}.safetensors"));
    let f = fixture::esrgan::EsrganFixture { scale, blocks: 2, features: 16, std: None, seed: 7 };
    f.write(&path, WeightType::F16, fixture::FileFormat::Safetensors).unwrap();
    path
}

fn upscale_run(model: &Path, input: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    sd_cli()
        .args(["-M", "upscale", "-t", "2", "--upscale-model"])
        .arg(model)
        .arg("-i")
        .arg(input)
        .arg("-o")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

/// `-M upscale` upscales the -i image by the model's factor (repeats compound), reports the
/// upscaler module and stage, agrees with itself whether or not an image within one tile is
/// tiled, and refuses a repeat count whose image would be too large before loading anything.
#[test]
fn esrgan_upscale_mode() {
    let dir = out_dir("esrgan");
    let (x4, x2) = (esrgan_fixture(&dir, 4), esrgan_fixture(&dir, 2));
    let input = dir.join("in.png");
    write_init_png(&input, false);

    let (a, report) = (dir.join("a.png"), dir.join("a.json"));
    let o = upscale_run(&x4, &input, &a, &["--report-json", report.to_str().unwrap()]);
    check_ok(&o);
    let (w, h, pa) = pixels(&a);
    assert_eq!((w, h), (256, 256));
    let r = sd_models::report::RunReport::from_json(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert!(r.stages.iter().any(|s| s.name == "upscale"), "{:?}", r.stages);
    let m = r.module("upscaler").expect("the report names the upscaler module");
    assert!(m.param_bytes > 0 && !m.devices.is_empty(), "{m:?}");

    // The same model as GGUF, and under the original ESRGAN names (`model.N`): the same image.
    let f = fixture::esrgan::EsrganFixture { scale: 4, blocks: 2, features: 16, std: None, seed: 7 };
    let gguf = dir.join("esrgan-x4.gguf");
    f.write(&gguf, WeightType::F16, fixture::FileFormat::Gguf).unwrap();
    let old = dir.join("esrgan-x4-original.safetensors");
    f.write_original_layout(&old, WeightType::F16, fixture::FileFormat::Safetensors).unwrap();
    for (model, what) in [(&gguf, "gguf"), (&old, "original names")] {
        let out = dir.join(format!("{what}.png"));
        check_ok(&upscale_run(model, &input, &out, &[]));
        assert_eq!(pixels(&out).2, pa, "{what}");
    }

    // 64 pixels fit the default 128-pixel tile: the same as no tiling; 32-pixel tiles blend.
    let b = dir.join("b.png");
    check_ok(&upscale_run(&x4, &input, &b, &["--upscale-tile-size", "0"]));
    assert_eq!(pixels(&b).2, pa, "one tile is the whole image");
    let c = dir.join("c.png");
    check_ok(&upscale_run(&x4, &input, &c, &["--upscale-tile-size", "32"]));
    let (mean, _) = diff(&a, &c);
    assert!(mean > 0.0 && mean < 32.0, "tiled vs whole: mean {mean}");

    // A budget below the whole image's compute buffer: retried with 32-pixel tiles, the same
    // image as asking for them.
    let budgeted = dir.join("budgeted.png");
    check_ok(&upscale_run(&x4, &input, &budgeted, &["--upscale-tile-size", "0", "--max-vram", "0.008"]));
    assert_eq!(pixels(&budgeted).2, pixels(&c).2, "the budget-driven retry is the 32-pixel tiled run");

    let d = dir.join("d.png");
    check_ok(&upscale_run(&x2, &input, &d, &["--upscale-repeats", "2"]));
    assert_eq!((pixels(&d).0, pixels(&d).1), (256, 256), "two x2 passes");

    // `plan` shows the upscaler and its device from the header alone.
    let o = sd_cli()
        .arg("plan")
        .arg("-m")
        .arg(fixture(FixtureModel::Sd15))
        .arg("--upscale-model")
        .arg(&x4)
        .args(["--backend", "esrgan=cpu"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("upscaler: ESRGAN x4, 2 blocks, 16 features") && text.contains(" on CPU"), "{text}");

    let e = dir.join("e.png");
    let o = upscale_run(&x4, &input, &e, &["--upscale-repeats", "8"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--upscale-repeats") && err.contains("more than 16384"), "{err}");
    assert!(!e.exists());
}

/// With a generation, `--upscale-model` upscales the decoded image before it is saved, on the
/// device `--backend upscaler=` names.
#[test]
fn esrgan_after_generation() {
    let dir = out_dir("esrgan-gen");
    let x2 = esrgan_fixture(&dir, 2);
    let (plain, up) = (dir.join("plain.png"), dir.join("up.png"));
    check_ok(&generate_steps(&fixture(FixtureModel::Sd15), &plain, 2, 1, &[]));
    let model = x2.to_str().unwrap();
    let o = generate_steps(
        &fixture(FixtureModel::Sd15),
        &up,
        2,
        1,
        &["--upscale-model", model, "--backend", "upscaler=cpu"],
    );
    check_ok(&o);
    let (w, h, _) = pixels(&up);
    assert_eq!((w, h), (128, 128));
    // The upscaled image of the plain one, from -M upscale, is the same.
    let again = dir.join("again.png");
    check_ok(&upscale_run(&x2, &plain, &again, &[]));
    assert_eq!(diff(&up, &again), (0.0, 0));
}

/// The inpainting mask of the parity tests: 64x64 grey, white (repaint) on `x >= 24,
/// 16 <= y < 48` (latent-block aligned), black elsewhere.
fn write_mask_png(path: &Path) {
    let data: Vec<u8> = (0..64u32)
        .flat_map(|y| (0..64u32).map(move |x| if x >= 24 && (16..48).contains(&y) { 255 } else { 0 }))
        .collect();
    let mut enc = png::Encoder::new(std::io::BufWriter::new(std::fs::File::create(path).unwrap()), 64, 64);
    enc.set_color(png::ColorType::Grayscale);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header().unwrap().write_image_data(&data).unwrap();
}

/// The SD 1.5 inpainting fixture of the parity test (`cargo xtask fixture sd15-inpaint --seed 7
/// --std 0.01`: a seed and weights unlike the default fixture's), written once into the cache.
fn inpaint_fixture() -> PathBuf {
    let path = fixture::cache_dir().join("sd15-inpaint-std0.01-seed7-f16.safetensors");
    if !path.exists() {
        std::fs::create_dir_all(fixture::cache_dir()).unwrap();
        let mut req = fixture::FixtureRequest::family(
            FixtureModel::Sd15Inpaint,
            7,
            WeightType::F16,
            fixture::FileFormat::Safetensors,
        );
        req.weight_std = Some(0.01);
        fixture::write_fixture(&path, &req).unwrap();
    }
    path
}

/// `-i` + `--mask` with a normal checkpoint: the reference's latent masking (the denoised
/// estimate keeps the init image's latent outside the mask) within the parity tolerance.
#[test]
fn sd15_inpaint_with_a_normal_checkpoint_matches_the_reference() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("inpaint-sd15");
    let (init, mask, out) = (dir.join("init.png"), dir.join("mask.png"), dir.join("out.png"));
    write_init_png(&init, false);
    write_mask_png(&mask);
    check_ok(&generate(&model, &out, 2, &["-i", init.to_str().unwrap(), "--mask", mask.to_str().unwrap()]));
    let data = workspace().join("tests/data");
    let (mean, max) = diff(&out, &data.join("ref-sd15-f16-seed42-64x64-euler2-cfg7-inpaint-mask.png"));
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "inpaint (sd15) vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An inpainting checkpoint (9-channel UNet input: latent, mask, masked image's latent): the
/// reference's image within the parity tolerance, and the same image bit for bit with the
/// diffusion model's parameters read from disk on demand.
#[test]
fn sd15_inpainting_checkpoint_matches_the_reference_and_any_placement() {
    let model = inpaint_fixture();
    let dir = out_dir("inpaint-9ch");
    let (init, mask) = (dir.join("init.png"), dir.join("mask.png"));
    write_init_png(&init, false);
    write_mask_png(&mask);
    let args = ["-i", init.to_str().unwrap(), "--mask", mask.to_str().unwrap()];
    let (a, b) = (dir.join("a.png"), dir.join("b.png"));
    check_ok(&generate(&model, &a, 2, &args));
    let data = workspace().join("tests/data");
    let (mean, max) = diff(&a, &data.join("ref-sd15-inpaint-std0.01-seed7-f16-64x64-euler2-cfg7-mask.png"));
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "inpainting model vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    check_ok(&generate(&model, &b, 2, &[&args[..], &["--params-backend", "diffusion=disk"]].concat()));
    assert_eq!(pixels(&a), pixels(&b), "diffusion params on disk changed the inpainted image");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mask_bad_inputs_are_clear_errors() {
    let m = Path::new("/nonexistent/model.safetensors");
    let dir = out_dir("mask-bad");
    let (init, mask, junk) = (dir.join("init.png"), dir.join("mask.png"), dir.join("junk.png"));
    write_init_png(&init, false);
    write_mask_png(&mask);
    std::fs::write(&junk, b"not an image").unwrap();
    let (init, mask, junk) = (init.to_str().unwrap(), mask.to_str().unwrap(), junk.to_str().unwrap());
    // Before the model is read (the model path does not exist): each error names the flag.
    let e = fails(&["-p", "x", "--mask", mask], Some(m));
    assert!(e.contains("--mask") && e.contains("needs an init image (-i)"), "{e}");
    let e = fails(&["-p", "x", "-i", init, "--mask", junk], Some(m));
    assert!(e.contains("--mask") && e.contains("junk.png") && !e.contains("/nonexistent"), "{e}");
    let e = fails(&["-p", "x", "-i", init, "--mask", "/nonexistent/mask.png"], Some(m));
    assert!(e.contains("--mask") && e.contains("/nonexistent/mask.png"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The SD 1.5 fixture of the ControlNet parity test (`cargo xtask fixture sd15 --seed 11 --std
/// 0.01`) and its ControlNet (`cargo xtask fixture controlnet-sd15 --seed 7 --std 0.02`): seeds
/// and weights unlike the default fixtures', written once into the cache.
fn controlnet_fixtures() -> (PathBuf, PathBuf) {
    let model = fixture::cache_dir().join("sd15-std0.01-seed11-f16.safetensors");
    std::fs::create_dir_all(fixture::cache_dir()).unwrap();
    if !model.exists() {
        let mut req =
            fixture::FixtureRequest::family(FixtureModel::Sd15, 11, WeightType::F16, fixture::FileFormat::Safetensors);
        req.weight_std = Some(0.01);
        fixture::write_fixture(&model, &req).unwrap();
    }
    let cn = fixture::controlnet::ControlNetFixture::sd15(Some(0.02), 7);
    let path = cn.cached_path(WeightType::F16);
    if !path.exists() {
        cn.write(&path, WeightType::F16, fixture::FileFormat::Safetensors).unwrap();
    }
    (model, path)
}

/// `img` (RGB8, `w x h`) with every pixel repeated `k x k` times.
fn write_upscaled_png(src: &Path, dst: &Path, k: u32) {
    let (w, h, rgb) = pixels(src);
    let data: Vec<u8> = (0..h * k)
        .flat_map(|y| (0..w * k).map(move |x| ((y / k) * w + x / k) as usize))
        .flat_map(|i| rgb[3 * i..3 * i + 3].to_vec())
        .collect();
    let mut enc = png::Encoder::new(std::io::BufWriter::new(std::fs::File::create(dst).unwrap()), w * k, h * k);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header().unwrap().write_image_data(&data).unwrap();
}

/// ControlNet (txt2img, cfg 7: the ControlNet runs for the cond and the uncond pass): the
/// reference's image within the parity tolerance, far from the image without the ControlNet
/// (the residuals matter), and the same image bit for bit with its parameters on disk, and on
/// the CPU by `--control-net-cpu` with a control image of twice the size (2x2 blocks, resized to
/// the same hint).
#[test]
fn sd15_controlnet_matches_the_reference_and_any_placement() {
    let (model, cn) = controlnet_fixtures();
    let dir = out_dir("controlnet");
    let data = workspace().join("tests/data");
    let control = data.join("control-64x64.png");
    let big = dir.join("control-128.png");
    write_upscaled_png(&control, &big, 2);
    let run = |name: &str, control: &Path, extra: &[&str]| {
        let out = dir.join(name);
        let args = ["--control-net", cn.to_str().unwrap(), "--control-image", control.to_str().unwrap()];
        check_ok(&generate(&model, &out, 2, &[&args[..], extra].concat()));
        out
    };
    let a = run("a.png", &control, &[]);
    let (mean, max) = diff(&a, &data.join("ref-sd15-std0.01-seed11-f16-cn-std0.02-seed7-64x64-euler2-cfg7.png"));
    eprintln!("ControlNet vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    assert!(mean <= MEAN_TOL && max <= MAX_TOL, "ControlNet vs stable-diffusion.cpp: mean {mean:.3}, max {max}");
    let plain = dir.join("plain.png");
    check_ok(&generate(&model, &plain, 2, &[]));
    let (mean, _) = diff(&a, &plain);
    assert!(mean > 3.0, "the ControlNet changed the image by only {mean:.3} levels (mean)");
    let b = run("disk.png", &control, &["--params-backend", "controlnet=disk"]);
    assert_eq!(pixels(&a), pixels(&b), "the ControlNet's params on disk changed the image");
    let c = run("cpu.png", &big, &["--control-net-cpu"]);
    assert_eq!(
        pixels(&a),
        pixels(&c),
        "--control-net-cpu with a 128x128 control image of 2x2 blocks changed the image"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A ControlNet for another family, a file that is no ControlNet, an unreadable control image and
/// a strength that is not a number: each a clear error naming the flag or file, before any weight
/// is read.
#[test]
fn controlnet_bad_inputs_are_clear_errors() {
    let dir = out_dir("controlnet-bad");
    let model = fixture(FixtureModel::Sd15);
    let control = workspace().join("tests/data/control-64x64.png");
    let control = control.to_str().unwrap();
    // An SDXL-shaped ControlNet (context 2048, a class embedding, 9 skips), narrow to stay small.
    let sdxl = dir.join("sdxl-cn.safetensors");
    let unet = sd_models::diffusion::UNetConfig {
        model_channels: 64,
        time_embed_dim: 256,
        transformer_depth: vec![1, 1, 1],
        ..sd_models::diffusion::UNetConfig::sdxl()
    };
    let f = fixture::controlnet::ControlNetFixture { unet, std: None, seed: 1 };
    f.write(&sdxl, WeightType::F16, fixture::FileFormat::Safetensors).unwrap();
    let base = ["-p", "x", "-W", "64", "-H", "64", "--control-image", control];
    let e = fails(&[&base[..], &["--control-net", sdxl.to_str().unwrap()]].concat(), Some(&model));
    assert!(
        e.contains("sdxl-cn.safetensors") && e.contains("context width 2048") && e.contains("context width 768"),
        "{e}"
    );
    // A file without a hint encoder (the TAESD fixture).
    let taesd = fixture::taesd::cached_taesd_path(4, 42, WeightType::F16);
    if !taesd.exists() {
        fixture::taesd::write_taesd(&taesd, 4, 42, WeightType::F16, fixture::FileFormat::Safetensors).unwrap();
    }
    let e = fails(&[&base[..], &["--control-net", taesd.to_str().unwrap()]].concat(), Some(&model));
    assert!(e.contains("is not a ControlNet") && e.contains("input_hint_block.0.weight"), "{e}");
    // Before the model is read (the model path does not exist).
    let m = Path::new("/nonexistent/model.safetensors");
    let junk = dir.join("junk.png");
    std::fs::write(&junk, b"not an image").unwrap();
    let e = fails(&["-p", "x", "--control-image", junk.to_str().unwrap()], Some(m));
    assert!(e.contains("--control-image") && e.contains("junk.png"), "{e}");
    let e = fails(&["-p", "x", "--control-strength", "nan"], Some(m));
    assert!(e.contains("--control-strength"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `plan` counts the ControlNet as the `controlnet` module, sized from its header, and takes its
/// placement (`--params-backend controlnet=disk`, `--control-net-cpu`) like any module's.
#[test]
fn plan_counts_the_controlnet_module_and_its_placement() {
    let (model, cn) = controlnet_fixtures();
    let dir = out_dir("controlnet-plan");
    let report = dir.join("plan.json");
    let o = sd_cli()
        .arg("plan")
        .arg("-m")
        .arg(&model)
        .arg("--control-net")
        .arg(&cn)
        .args(["--params-backend", "controlnet=disk", "--control-net-cpu", "--report-json"])
        .arg(&report)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(0), "{err}");
    let text = std::fs::read_to_string(&report).unwrap();
    let plan = sd_models::report::RunReport::from_json(&text).unwrap().plan.expect("the plan");
    let m = plan.modules.iter().find(|m| m.module.name() == "controlnet").unwrap_or_else(|| panic!("{plan:?}"));
    // Tensor bytes are the file less its header.
    let file = std::fs::metadata(&cn).unwrap().len();
    assert!(m.param_bytes <= file && m.param_bytes + (1 << 20) > file, "{m:?} vs {file}");
    assert_eq!(m.params, sd_placement::ParamsHome::Disk, "{m:?}");
    assert_eq!(m.runtime, ["CPU"], "{m:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The hires fix, 64x64 -> 128x128 (the default `--hires-scale` 2), 2 second-pass steps at
/// the default denoising strength 0.7, with the default latent upscaler (bilinear) and the
/// image upscalers (decode, resize, encode): the reference's image within the parity
/// tolerance, each.
#[test]
fn sd15_hires_matches_the_reference() {
    let model = fixture(FixtureModel::Sd15);
    let dir = out_dir("hires");
    let data = workspace().join("tests/data");
    let mut failed = Vec::new();
    for (upscaler, name) in [("Latent", "latent"), ("Lanczos", "lanczos"), ("Nearest", "nearest")] {
        let out = dir.join(format!("{name}.png"));
        check_ok(&generate(&model, &out, 2, &["--hires", "--hires-steps", "2", "--hires-upscaler", upscaler]));
        let reference = data.join(format!("ref-sd15-f16-seed42-64x64-euler2-cfg7-hires-{name}-128x128-steps2.png"));
        let (mean, max) = diff(&out, &reference);
        eprintln!("hires {upscaler}: mean {mean:.3}, max {max}");
        if !(mean <= MEAN_TOL && max <= MAX_TOL) {
            failed.push(format!("{upscaler}: mean {mean:.3}, max {max}"));
        }
    }
    // An ESRGAN model (x2, 2 blocks of 64 features, seed 42: `cargo xtask parity esrgan`'s
    // fixture), named in --hires-upscalers-dir.
    let f = fixture::esrgan::EsrganFixture { scale: 2, blocks: 2, features: 64, std: None, seed: 42 };
    let ups = dir.join("upscalers");
    std::fs::create_dir_all(&ups).unwrap();
    f.write(&ups.join("x2.safetensors"), WeightType::F16, fixture::FileFormat::Safetensors).unwrap();
    let out = dir.join("model.png");
    let args =
        ["--hires", "--hires-steps", "2", "--hires-upscalers-dir", ups.to_str().unwrap(), "--hires-upscaler", "x2"];
    check_ok(&generate(&model, &out, 2, &args));
    let reference = data.join("ref-sd15-f16-seed42-64x64-euler2-cfg7-hires-esrgan-x2-b2-f64-seed42-128x128-steps2.png");
    let (mean, max) = diff(&out, &reference);
    eprintln!("hires model: mean {mean:.3}, max {max}");
    if !(mean <= MEAN_TOL && max <= MAX_TOL) {
        failed.push(format!("ESRGAN x2: mean {mean:.3}, max {max}"));
    }
    assert!(failed.is_empty(), "hires vs stable-diffusion.cpp: {failed:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hires_bad_inputs_are_clear_errors() {
    let m = Path::new("/nonexistent/model.safetensors");
    let e = fails(&["--hires", "--hires-scale", "0"], Some(m));
    assert!(e.contains("--hires-scale 0"), "{e}");
    let e = fails(&["--hires", "--hires-scale", "100"], Some(m));
    assert!(e.contains("--hires-scale 100"), "{e}");
    let e = fails(&["--hires", "--hires-denoising-strength", "1.5"], Some(m));
    assert!(e.contains("--hires-denoising-strength"), "{e}");
    let e = fails(&["--hires", "--hires-upscaler", "Latent (bilinear)"], Some(m));
    assert!(e.contains("--hires-upscaler 'Latent (bilinear)'") && e.contains("Latent (nearest-exact)"), "{e}");
    let e = fails(&["--hires", "--hires-upscaler", "my-esrgan"], Some(m));
    assert!(e.contains("--hires-upscaler 'my-esrgan'") && e.contains("--hires-upscalers-dir"), "{e}");
    // A file that is no upscaler: named, from its header, before the checkpoint loads.
    let sd15 = fixture(FixtureModel::Sd15);
    let e = fails(&["--hires", "--hires-upscaler", sd15.to_str().unwrap()], Some(m));
    assert!(e.contains("--hires-upscaler") && e.contains(sd15.to_str().unwrap()), "{e}");
    let e = fails(&["--hires", "--hires-upscalers-dir", "/nonexistent/upscalers"], Some(m));
    assert!(e.contains("--hires-upscalers-dir /nonexistent/upscalers"), "{e}");
    // A hires target far past any device is refused before sampling, naming its size.
    let e = fails(&["--hires", "--hires-width", "1000000", "-p", "x"], Some(&fixture(FixtureModel::Sd15)));
    assert!(e.contains("1000000"), "{e}");
}
