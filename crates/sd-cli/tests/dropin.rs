//! The reference's CLI details that scripts rely on, through the real binary on the SD 1.5
//! fixture (64x64, 1 step): prompt files, `-M`, output names (`%d`, `--output-begin-idx`,
//! batches), output formats with their parameters, init images in other formats and sizes,
//! `-t 0`, and the plain progress lines off a terminal.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sd_models::fixture::{self, FixtureModel, WeightType};
use sd_models::image_io::{self, OutputFormat};
use sd_models::pipeline::Image;

/// The SD 1.5 fixture (seed 42, f16), shared with the other end-to-end tests.
fn fixture() -> PathBuf {
    fixture::ensure_cached(FixtureModel::Sd15, 42, WeightType::F16).unwrap().0
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-cli-dropin-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One step of euler at 64x64 (unless `extra` says otherwise), seed 42, 2 threads.
fn run<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(extra: &[S]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_sd-cli"))
        .arg("-m")
        .arg(fixture())
        .args(["--steps", "1", "--sampling-method", "euler", "-s", "42", "--cfg-scale", "1"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "sd-cli {extra:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn read(path: &Path) -> Image {
    image_io::read_image(path).unwrap_or_else(|e| panic!("{e}"))
}

fn sniff(path: &Path) -> &'static str {
    let b = std::fs::read(path).unwrap();
    if b.starts_with(b"\x89PNG") {
        "png"
    } else if b.starts_with(&[0xFF, 0xD8]) {
        "jpeg"
    } else if b.len() > 12 && &b[8..12] == b"WEBP" {
        "webp"
    } else {
        "other"
    }
}

fn mean_diff(a: &Image, b: &Image) -> f64 {
    assert_eq!((a.width, a.height), (b.width, b.height));
    a.rgb.iter().zip(&b.rgb).map(|(x, y)| x.abs_diff(*y) as f64).sum::<f64>() / a.rgb.len() as f64
}

#[test]
fn batches_are_named_numbered_and_written_in_the_asked_format() {
    let dir = scratch("batch");
    let prompt = dir.join("prompt.txt");
    std::fs::write(&prompt, "a cat from a file").unwrap();
    let o = dir.join("out.jpg");
    let out = run(&[
        "-W",
        "64",
        "-H",
        "64",
        "-b",
        "2",
        "-t",
        "0",
        "-M",
        "img_gen",
        "--prompt-file",
        prompt.to_str().unwrap(),
        "--output-begin-idx",
        "3",
        "--vae-tiling",
        "--vae-tile-size",
        "48",
        "-o",
        o.to_str().unwrap(),
    ]);
    // The reference's names: a batch is <stem>_<begin + i>.<ext>.
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["out_3.jpg", "out_4.jpg", "prompt.txt"]);
    for (i, name) in ["out_3.jpg", "out_4.jpg"].iter().enumerate() {
        let p = dir.join(name);
        assert_eq!(sniff(&p), "jpeg", "{name}");
        let img = read(&p);
        assert_eq!((img.width, img.height), (64, 64));
        // The JPEG comment carries the parameters: the prompt read from the file, the
        // image's own seed.
        let text = image_io::read_parameters(&p).unwrap().expect("parameters in the JPEG");
        assert!(text.starts_with("a cat from a file\n"), "{text}");
        assert!(text.contains(&format!("Seed: {}", 42 + i)), "{text}");
    }
    assert!(mean_diff(&read(&dir.join("out_3.jpg")), &read(&dir.join("out_4.jpg"))) > 1.0, "two seeds, two images");
    // Off a terminal, progress is one parseable line per step and per VAE tile.
    let log = String::from_utf8_lossy(&out.stderr);
    for image in 1..=2 {
        assert!(log.contains(&format!("image {image}/2 step 1/1 took ")), "{log}");
        let tiles: Vec<&str> = log.lines().filter(|l| l.contains(&format!("decode image {image}/2 tile "))).collect();
        let total = tiles.first().and_then(|l| l.rsplit('/').next()).and_then(|n| n.trim().parse::<usize>().ok());
        let total = total.unwrap_or_else(|| panic!("no tile lines for image {image}:\n{log}"));
        assert!(total > 1, "48-pixel tiles on a 64-pixel image: {total}");
        assert_eq!(tiles.len(), total, "{log}");
        assert!(tiles.last().unwrap().ends_with(&format!("tile {total}/{total}")), "{log}");
    }
    assert!(!log.contains('\r') && !log.contains('\u{1b}'), "no bar or escape codes off a terminal");

    // A %d pattern numbers from 0, WebP output, no metadata when disabled.
    let o = dir.join("img_%02d.webp");
    run(&["-W", "64", "-H", "64", "-p", "x", "--disable-image-metadata", "-o", o.to_str().unwrap()]);
    let p = dir.join("img_00.webp");
    assert_eq!(sniff(&p), "webp");
    assert_eq!(image_io::read_parameters(&p).unwrap(), None);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 64x48 image with structure, and the same scene centred in a 128x48 frame of noise.
fn init_images() -> (Image, Image) {
    let mut centre = Image { width: 64, height: 48, rgb: Vec::new() };
    for y in 0..48usize {
        for x in 0..64usize {
            let check = if (x / 16 + y / 16) % 2 == 0 { 40 } else { 200 };
            centre.rgb.extend_from_slice(&[(x * 4) as u8, (y * 5) as u8, check]);
        }
    }
    let mut wide = Image { width: 128, height: 48, rgb: Vec::new() };
    for y in 0..48usize {
        for x in 0..128usize {
            if (32..96).contains(&x) {
                let i = (y * 64 + x - 32) * 3;
                wide.rgb.extend_from_slice(&centre.rgb[i..i + 3]);
            } else {
                wide.rgb.extend_from_slice(&[((x * 37 + y * 11) % 256) as u8, 255, 0]);
            }
        }
    }
    (centre, wide)
}

#[test]
fn init_images_in_other_formats_are_fitted_and_sized_as_the_reference_does() {
    let dir = scratch("init");
    let (centre, wide) = init_images();
    let centre_png = dir.join("centre.png");
    image_io::save_image(&centre_png, &centre, OutputFormat::Png, None).unwrap();
    let wide_bmp = dir.join("wide.bmp");
    image::RgbImage::from_raw(128, 48, wide.rgb.clone())
        .unwrap()
        .save_with_format(&wide_bmp, image::ImageFormat::Bmp)
        .unwrap();
    let centre_jpg = dir.join("centre.jpg");
    image_io::save_image(&centre_jpg, &centre, OutputFormat::Jpeg, None).unwrap();

    // -W/-H both given: the 128x48 BMP is centre-cropped to 64x48 (then not resized), so the
    // result is exactly that of the centre PNG. The size 64x48 is aligned up to 64x64.
    let img2img = ["--strength", "0.5", "-p", "a cat"];
    let from_bmp = dir.join("from-bmp.png");
    let args = |init: &Path, out: &Path, wh: bool| -> Vec<String> {
        let mut v: Vec<String> = img2img.iter().map(|s| s.to_string()).collect();
        if wh {
            v.extend(["-W", "64", "-H", "48"].map(String::from));
        }
        v.extend(["-i".into(), init.to_string_lossy().into_owned(), "-o".into(), out.to_string_lossy().into_owned()]);
        v
    };
    run(&args(&wide_bmp, &from_bmp, true));
    // No -W/-H: the init image's size (64x48), aligned up the same way.
    let from_png = dir.join("from-png.png");
    run(&args(&centre_png, &from_png, false));
    let (x, y) = (read(&from_bmp), read(&from_png));
    assert_eq!((x.width, x.height), (64, 64), "64x48 is aligned up to the model's multiple of 64");
    assert_eq!(x, y, "-W 64 -H 48 on the 128x48 image must use its centre, like the 64x48 image");

    // A JPEG init works and its content matters: the output differs from the PNG's by
    // about the JPEG error, far less than from another init image's.
    let from_jpg = dir.join("from-jpg.png");
    run(&args(&centre_jpg, &from_jpg, false));
    let z = read(&from_jpg);
    let unrelated = dir.join("unrelated.png");
    let flipped = Image { rgb: centre.rgb.chunks(3).rev().flatten().copied().collect(), ..centre.clone() };
    let flipped_png = dir.join("flipped.png");
    image_io::save_image(&flipped_png, &flipped, OutputFormat::Png, None).unwrap();
    run(&args(&flipped_png, &unrelated, false));
    let (near, far) = (mean_diff(&z, &y), mean_diff(&read(&unrelated), &y));
    assert!(near < far / 2.0, "JPEG init vs PNG init: {near:.2} levels; another init: {far:.2}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs sd-cli expecting failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sd-cli")).args(args).output().unwrap();
    assert!(!out.status.success(), "expected failure for {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn reference_flags_that_cannot_work_are_clear_errors() {
    let m = "/nonexistent/model.safetensors";
    let e = fails(&["-m", m, "-M", "vid_gen"]);
    assert!(e.contains("-M vid_gen") && e.contains("only img_gen"), "{e}");
    let e = fails(&["-m", m, "--mode", "paint"]);
    assert!(e.contains("invalid mode"), "{e}");
    let e = fails(&["-m", m, "--prompt-file", "/nonexistent/prompt.txt"]);
    assert!(e.contains("prompt file") && e.contains("/nonexistent/prompt.txt"), "{e}");
    let e = fails(&["-m", m, "-p", "x", "--prompt-file", "/tmp/p.txt"]);
    assert!(e.contains("--prompt-file") && e.contains("--prompt"), "{e}");
    let e = fails(&["-m", m, "-i", "/nonexistent/init.webp"]);
    assert!(e.contains("/nonexistent/init.webp"), "{e}");
    // --tae is --taesd: the file it names is the one opened.
    let e = fails(&["-m", &fixture().to_string_lossy(), "--tae", "/nonexistent/taesd.safetensors", "-p", "x"]);
    assert!(e.contains("/nonexistent/taesd.safetensors"), "{e}");
}

#[test]
fn help_marks_our_own_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_sd-cli")).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--rpc-servers", "--tae", "--mode", "--prompt-file", "--negative-prompt-file", "--output-begin-idx"] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    let line = |flag: &str| help.lines().skip_while(|l| !l.contains(flag)).take(2).collect::<String>();
    for ours in [
        "--plugin-dir",
        "--json",
        "--disable-prefetch",
        "--disable-segmented-compute",
        "--split-by",
        "--pipeline-copies",
        "  plan ",
        "  rpc-server ",
    ] {
        assert!(line(ours).contains("[sd-rs]"), "{ours} is ours: {}", line(ours));
    }
    for theirs in ["--rpc-servers", "--prompt-file", "--max-vram", "--vae-tiling"] {
        assert!(!line(theirs).contains("[sd-rs]"), "{theirs} is the reference's: {}", line(theirs));
    }
}
