//! Files shared with sdref: raw f32 tensors with their sidecars, seeded inputs, PNGs.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};

use super::*;

/// Writes raw little-endian f32 and the sdref sidecar (`PATH.json`) with `shape`.
pub fn write_raw(path: &Path, shape: &[usize], data: &[f32], what: &str) -> Result<()> {
    if shape.iter().product::<usize>() != data.len() {
        bail!("{}: shape {shape:?} does not hold {} values", path.display(), data.len());
    }
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    let side = serde_json::json!({
        "format": "sdref-f32", "dtype": "f32", "byte_order": "little", "shape": shape,
        "axis_order": "outermost first, last axis contiguous (PyTorch)", "what": what,
    });
    let side_path = sidecar(path);
    std::fs::write(&side_path, serde_json::to_string_pretty(&side)? + "\n")
        .with_context(|| format!("writing {}", side_path.display()))
}

fn sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// Reads a raw f32 file and its sidecar's shape.
pub fn read_raw(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let side_path = sidecar(path);
    let side: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&side_path).with_context(|| format!("reading {}", side_path.display()))?,
    )
    .with_context(|| format!("parsing {}", side_path.display()))?;
    let shape: Vec<usize> = side["shape"]
        .as_array()
        .and_then(|a| a.iter().map(|v| v.as_u64().and_then(|x| usize::try_from(x).ok())).collect())
        .with_context(|| format!("{}: no integer `shape` array", side_path.display()))?;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let n: usize = shape.iter().product();
    if bytes.len() != n * 4 {
        bail!("{}: {} bytes, but shape {shape:?} of f32 needs {}", path.display(), bytes.len(), n * 4);
    }
    let data = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok((shape, data))
}

/// `n` standard-normal values from `seed` (splitmix64, Box-Muller): the same inputs
/// for both programs, independent of either program's generators.
pub fn normal_values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // Uniform in (0, 1] and [0, 1) from the top 53 bits.
        let u1 = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (next() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        out.push((r * a.cos()) as f32);
        out.push((r * a.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// An 8-bit RGB image from a PNG.
fn read_png_rgb(path: &Path) -> Result<(u32, u32, Vec<u8>)> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut dec = png::Decoder::new(std::io::BufReader::new(file));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().with_context(|| format!("reading {}", path.display()))?;
    let mut buf = vec![0; reader.output_buffer_size().context("PNG too large")?];
    let info = reader.next_frame(&mut buf).with_context(|| format!("decoding {}", path.display()))?;
    let px = info.width as usize * info.height as usize;
    let rgb = match info.color_type {
        png::ColorType::Rgb => buf[..px * 3].to_vec(),
        png::ColorType::Rgba => buf[..px * 4].chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        png::ColorType::Grayscale => buf[..px].iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => buf[..px * 2].chunks_exact(2).flat_map(|p| [p[0], p[0], p[0]]).collect(),
        png::ColorType::Indexed => bail!("{}: a palette image was not expanded", path.display()),
    };
    Ok((info.width, info.height, rgb))
}

/// Compares two PNGs in 8-bit levels.
pub(crate) fn png_diff(ours: &Path, reference: &Path) -> Result<(Diff, String)> {
    let (w1, h1, a) = read_png_rgb(ours)?;
    let (w2, h2, b) = read_png_rgb(reference)?;
    if (w1, h1) != (w2, h2) {
        bail!("{} is {w1}x{h1} but {} is {w2}x{h2}", ours.display(), reference.display());
    }
    let to = |v: &[u8]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    Ok((Diff::of(&to(&a), &to(&b))?, format!("{w1}x{h1}x3")))
}

pub(crate) fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

pub(super) fn shape_str(s: &[usize]) -> String {
    s.iter().map(usize::to_string).collect::<Vec<_>>().join("x")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_values_are_deterministic_and_standard() {
        let a = normal_values(7, 100_000);
        assert_eq!(a, normal_values(7, 100_000));
        assert_ne!(a[..10], normal_values(8, 10)[..]);
        let mean = a.iter().map(|&v| f64::from(v)).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / a.len() as f64;
        // Standard errors: 1/sqrt(n) = 0.003 for the mean, ~0.0045 for the variance.
        assert!(mean.abs() < 0.02 && (var - 1.0).abs() < 0.03, "mean {mean} var {var}");
        assert_eq!(normal_values(1, 3).len(), 3);
    }

    #[test]
    fn raw_files_round_trip_in_sdref_format() {
        let dir = std::env::temp_dir().join(format!("xtask-parity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.f32");
        let v = [0.5f32, -1.0, 2.25, f32::MIN_POSITIVE, 7.0, -0.0];
        write_raw(&p, &[1, 2, 3], &v, "test").unwrap();
        let (shape, back) = read_raw(&p).unwrap();
        assert_eq!(shape, vec![1, 2, 3]);
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // sdref reads little-endian f32, first value first.
        assert_eq!(&std::fs::read(&p).unwrap()[..4], &0.5f32.to_le_bytes());
        assert!(write_raw(&p, &[4], &v, "bad").is_err());
        std::fs::write(&p, [0u8; 8]).unwrap();
        assert!(format!("{:#}", read_raw(&p).unwrap_err()).contains("needs 24"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
