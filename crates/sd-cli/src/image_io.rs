//! PNG output with the generation parameters, and PNG input for img2img.
//!
//! The output carries a `parameters` tEXt chunk (iTXt when the text is not Latin-1) in the format A1111 writes and
//! image browsers read (prompt, `Negative prompt:` line, then `Key: value`
//! pairs). Files are written to a temporary name next to the target and
//! renamed, so a failure never leaves a partial image behind.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};

/// An 8-bit RGB image.
#[derive(Clone, Debug, PartialEq)]
pub struct Rgb8 {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

/// Writes `img` as PNG with a `parameters` text chunk, atomically.
pub fn write_png(path: &Path, img: &Rgb8, parameters: &str) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp: PathBuf = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("out.png"),
        std::process::id()
    ));
    let result = (|| -> Result<()> {
        let file = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), img.width, img.height);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        // tEXt holds Latin-1 only; a prompt with other characters (emoji, CJK, dashes)
        // goes into an iTXt chunk, which is UTF-8, under the same keyword.
        if parameters.chars().all(|c| (c as u32) < 256) {
            enc.add_text_chunk("parameters".into(), parameters.into())?;
        } else {
            enc.add_itxt_chunk("parameters".into(), parameters.into())?;
        }
        let mut w = enc.write_header()?;
        w.write_image_data(&img.data)?;
        w.finish()?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Reads a PNG as 8-bit RGB (grey and alpha are converted).
pub fn read_png(path: &Path) -> Result<Rgb8> {
    let file = std::fs::File::open(path).with_context(|| format!("opening init image {}", path.display()))?;
    let mut dec = png::Decoder::new(std::io::BufReader::new(file));
    dec.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = dec.read_info().with_context(|| format!("{} is not a readable PNG", path.display()))?;
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).with_context(|| format!("decoding {}", path.display()))?;
    let px = (info.width * info.height) as usize;
    let data: Vec<u8> = match info.color_type {
        png::ColorType::Rgb => buf[..px * 3].to_vec(),
        png::ColorType::Rgba => buf[..px * 4].chunks_exact(4).flat_map(|c| [c[0], c[1], c[2]]).collect(),
        png::ColorType::Grayscale => buf[..px].iter().flat_map(|&g| [g, g, g]).collect(),
        png::ColorType::GrayscaleAlpha => buf[..px * 2].chunks_exact(2).flat_map(|c| [c[0], c[0], c[0]]).collect(),
        other => bail!("{}: unsupported PNG color type {other:?}", path.display()),
    };
    Ok(Rgb8 { width: info.width, height: info.height, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parameters_of(path: &Path) -> String {
        let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
        let reader = dec.read_info().unwrap();
        let info = reader.info();
        let latin = info.uncompressed_latin1_text.iter().find(|t| t.keyword == "parameters").map(|t| t.text.clone());
        let utf8 = info.utf8_text.iter().find(|t| t.keyword == "parameters").map(|t| t.get_text().unwrap());
        latin.or(utf8).expect("a parameters chunk")
    }

    #[test]
    fn parameters_of_any_prompt_are_written() {
        // Found by `cargo xtask parity --fuzz`: a prompt with an em dash made the PNG encoder
        // refuse the tEXt chunk after the whole generation had run.
        let dir = std::env::temp_dir().join(format!("sd-cli-image-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = Rgb8 { width: 2, height: 1, data: vec![0, 1, 2, 3, 4, 5] };
        for text in ["a naïve café", "a dog — 東京 🐱\nNegative prompt: ✨"] {
            let path = dir.join("p.png");
            write_png(&path, &img, text).unwrap();
            assert_eq!(parameters_of(&path), text);
            assert_eq!(read_png(&path).unwrap(), img);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
