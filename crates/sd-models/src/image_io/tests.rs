//! Tests of image reading, fitting, writing with parameters, and output naming.

use std::path::Path;

use super::*;

fn gradient(w: usize, h: usize) -> Image {
    let mut rgb = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            rgb.extend_from_slice(&[(x * 255 / w) as u8, (y * 255 / h) as u8, ((x + y) * 255 / (w + h)) as u8]);
        }
    }
    Image { width: w, height: h, rgb }
}

#[test]
fn centre_crop_follows_the_reference() {
    // (image, target) -> (x, y, w, h). Wider than the target: crop the width to
    // h * aspect and centre it; taller: crop the height; an offset of 0 means no crop.
    let cases = [
        ((100, 50), (64, 64), (25, 0, 50, 50)),
        ((50, 100), (64, 64), (0, 25, 50, 50)),
        ((64, 64), (128, 64), (0, 16, 64, 32)),
        ((65, 64), (64, 64), (0, 0, 65, 64)), // crop of 1 column: offset 0, so none
        ((90, 60), (96, 64), (0, 0, 90, 60)), // same aspect
    ];
    for ((iw, ih), (dw, dh), want) in cases {
        assert_eq!(centre_crop(iw, ih, dw, dh), want, "{iw}x{ih} -> {dw}x{dh}");
    }
}

#[test]
fn box_weights_are_pixel_overlaps() {
    assert_eq!(box_weights(4, 2), vec![vec![(0, 0.5), (1, 0.5)], vec![(2, 0.5), (3, 0.5)]]);
    let w = box_weights(3, 2);
    assert_eq!(w[0].iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
    assert!((w[0][0].1 - 2.0 / 3.0).abs() < 1e-6 && (w[0][1].1 - 1.0 / 3.0).abs() < 1e-6);
    assert_eq!(w[1].iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
    // Upsampling: each output pixel lies inside one input pixel.
    assert_eq!(box_weights(2, 4), vec![vec![(0, 1.0)], vec![(0, 1.0)], vec![(1, 1.0)], vec![(1, 1.0)]]);
    for (src, dst) in [(7, 3), (3, 7), (512, 64), (100, 128), (1, 5)] {
        for taps in box_weights(src, dst) {
            let sum: f32 = taps.iter().map(|t| t.1).sum();
            assert!((sum - 1.0).abs() < 1e-5, "{src}->{dst}: weights sum to {sum}");
        }
    }
}

#[test]
fn box_resize_averages_in_linear_light() {
    for v in 0..=255u8 {
        assert_eq!(linear_to_srgb(srgb_to_linear(v)), v, "sRGB round trip of {v}");
    }
    // Black and white averaged in linear light is sRGB 188, not the 128 of a gamma-space mean.
    let img = Image { width: 2, height: 1, rgb: vec![0, 0, 0, 255, 255, 255] };
    assert_eq!(resize_box(&img, 1, 1).rgb, vec![188, 188, 188]);
    // A uniform image stays uniform at any size.
    let flat = Image { width: 5, height: 3, rgb: [40u8, 120, 200].repeat(15) };
    let out = resize_box(&flat, 8, 2);
    assert!(out.rgb.chunks(3).all(|p| p == [40, 120, 200]), "{:?}", out.rgb);
}

#[test]
fn fit_crops_the_centre_then_resizes() {
    // 128x64 to 64x64: the centre 64 columns, unscaled.
    let img = gradient(128, 64);
    let fitted = fit_image(&img, 64, 64).unwrap();
    let mut want = Vec::new();
    for y in 0..64 {
        want.extend_from_slice(&img.rgb[(y * 128 + 32) * 3..(y * 128 + 96) * 3]);
    }
    assert_eq!((fitted.width, fitted.height), (64, 64));
    assert_eq!(fitted.rgb, want);
    // Same size: unchanged; another size: that size.
    assert_eq!(fit_image(&img, 128, 64).unwrap(), img);
    let small = fit_image(&img, 40, 24).unwrap();
    assert_eq!((small.width, small.height, small.rgb.len()), (40, 24, 40 * 24 * 3));
    assert!(fit_image(&img, 0, 64).is_err());
    assert!(fit_image(&Image { width: 2, height: 2, rgb: vec![0; 5] }, 4, 4).is_err());
}

#[test]
fn nearest_resize_repeats_pixels() {
    let img = Image { width: 2, height: 1, rgb: vec![1, 2, 3, 4, 5, 6] };
    let up = resize_nearest(&img, 4, 2);
    assert_eq!(up.rgb, [[1, 2, 3], [1, 2, 3], [4, 5, 6], [4, 5, 6]].concat().repeat(2));
    let planar = to_planar(&img);
    assert_eq!(planar, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0].map(|v| v / 255.0));
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sd-models-image-io-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn every_format_round_trips_with_its_parameters() {
    let img = gradient(64, 48);
    let text = "a <cat> & 'dog'\nNegative prompt: ugly\nSteps: 1, Seed: 42";
    let unicode = "一只猫 🐱\nSteps: 1";
    for (name, format) in [("a.png", OutputFormat::Png), ("a.jpg", OutputFormat::Jpeg), ("a.webp", OutputFormat::WebP)]
    {
        let path = temp(name);
        assert_eq!(OutputFormat::from_path(&path), Some(format));
        for params in [text, unicode] {
            save_image(&path, &img, format, Some(params)).unwrap();
            assert_eq!(read_parameters(&path).unwrap().as_deref(), Some(params), "{name}");
            let back = read_image(&path).unwrap();
            assert_eq!((back.width, back.height), (64, 48), "{name}");
            let mean =
                back.rgb.iter().zip(&img.rgb).map(|(a, b)| a.abs_diff(*b) as f64).sum::<f64>() / img.rgb.len() as f64;
            match format {
                OutputFormat::Jpeg => assert!(mean < 4.0, "{name}: quality {JPEG_QUALITY} is {mean:.2} levels off"),
                _ => assert_eq!(back.rgb, img.rgb, "{name}: lossless"),
            }
        }
        save_image(&path, &img, format, None).unwrap();
        assert_eq!(read_parameters(&path).unwrap(), None, "{name}: --disable-image-metadata");
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn jpeg_comment_follows_the_jfif_header() {
    let bytes = encode_image(&gradient(16, 16), OutputFormat::Jpeg, Some("x")).unwrap();
    assert_eq!(bytes[0..4], [0xFF, 0xD8, 0xFF, 0xE0], "SOI then APP0 (JFIF)");
    let com = 4 + u16::from_be_bytes([bytes[4], bytes[5]]) as usize;
    assert_eq!(bytes[com..com + 2], [0xFF, 0xFE]);
    assert_eq!(&bytes[com + 4..com + 4 + 13], b"parameters\0x\0");
    // A text longer than a segment is cut to fit, at a character boundary.
    let long = "é".repeat(40_000);
    let bytes = encode_image(&gradient(8, 8), OutputFormat::Jpeg, Some(&long)).unwrap();
    let got = parameters_of(&bytes).unwrap();
    assert!(got.len() <= 0xFFFF && long.starts_with(&got) && got.len() > 60_000, "{}", got.len());
    assert!(decode_image(&bytes).is_ok());
}

#[test]
fn bmp_and_other_inputs_decode_and_garbage_is_named() {
    let img = gradient(10, 6);
    let path = temp("in.bmp");
    image::RgbImage::from_raw(10, 6, img.rgb.clone())
        .unwrap()
        .save_with_format(&path, image::ImageFormat::Bmp)
        .unwrap();
    assert_eq!(read_image(&path).unwrap(), img);
    let bad = temp("notes.png");
    std::fs::write(&bad, "not an image").unwrap();
    let e = read_image(&bad).unwrap_err().to_string();
    assert!(e.contains("notes.png") && e.contains("PNG, JPEG, WebP or BMP"), "{e}");
    let e = read_image(Path::new("/nonexistent/x.jpg")).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/x.jpg"), "{e}");
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&bad);
}

#[test]
fn index_patterns_are_printf_d_conversions() {
    let cases = [
        ("out_%d.png", Some("out_5.png")),
        ("out_%03d.png", Some("out_005.png")),
        ("out_%3d.png", Some("out_  5.png")),
        ("out_%0d.png", Some("out_5.png")),
        ("100%%_%d.png", Some("100%_5.png")),
        ("%%%d", Some("%5")),
        ("a%d%d", Some("a55")),
        ("%%d.png", None),
        ("%0005d.png", None),
        ("%s.png", None),
        ("plain.png", None),
    ];
    for (pattern, want) in cases {
        assert_eq!(format_index(pattern, 5).as_deref(), want, "{pattern}");
    }
}

#[test]
fn outputs_are_named_as_the_reference_names_them() {
    let names = |o: &str, n: usize, begin: Option<i64>| -> Vec<String> {
        output_paths(Path::new(o), n, begin).into_iter().map(|(p, _)| p.to_string_lossy().into_owned()).collect()
    };
    assert_eq!(names("output.png", 1, None), ["output.png"]);
    assert_eq!(names("output.png", 2, None), ["output_0.png", "output_1.png"]);
    assert_eq!(names("dir/out.png", 2, Some(3)), ["dir/out_3.png", "dir/out_4.png"]);
    assert_eq!(names("out.png", 2, Some(-4)), ["out_0.png", "out_1.png"]);
    assert_eq!(names("img_%03d.jpg", 2, None), ["img_000.jpg", "img_001.jpg"]);
    assert_eq!(names("img_%d.webp", 1, Some(7)), ["img_7.webp"]);
    assert_eq!(names("x.foo", 1, None), ["x.foo.png"]);
    assert_eq!(names("x", 2, None), ["x_0.png", "x_1.png"]);
    assert_eq!(names("x.avi", 1, None), ["x.png"]);
    assert_eq!(names("pics/x.JPG", 1, None), ["pics/x.JPG"]);
    let formats: Vec<OutputFormat> =
        ["a.jpeg", "a.webp", "a.png", "a.gif"].iter().map(|o| output_paths(Path::new(o), 1, None)[0].1).collect();
    assert_eq!(formats, [OutputFormat::Jpeg, OutputFormat::WebP, OutputFormat::Png, OutputFormat::Png]);
}

#[test]
fn an_existing_output_without_extension_is_taken_as_written() {
    let dir = std::env::temp_dir().join(format!("sd-io-existing-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    // a directory (or a device, a FIFO) is named as given, for the target checks to refuse
    let got = output_paths(&dir.join("sub"), 1, None);
    assert_eq!(got[0].0, dir.join("sub"));
    // a name that does not exist gets the reference's `.png`
    assert_eq!(output_paths(&dir.join("new"), 1, None)[0].0, dir.join("new.png"));
    // a batch is always numbered
    assert_eq!(output_paths(&dir.join("sub"), 2, None)[1].0, dir.join("sub_1.png"));
    let _ = std::fs::remove_dir_all(&dir);
}
