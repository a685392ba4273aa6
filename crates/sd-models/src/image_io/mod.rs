//! Image files in and out: decoding PNG, JPEG, WebP and BMP, fitting an init image to the
//! requested size as stable-diffusion.cpp's CLI does, writing PNG, JPEG and WebP with the
//! generation parameters, and naming batch outputs the way the reference names them.
//!
//! Codecs come from the `image` crate family (pure Rust); this module adds only what the
//! reference does on top of its codecs:
//! * **Fitting** ([`fit_image`]): when `-W` and `-H` are both given and differ from the
//!   image, the image is first centre-cropped to the target aspect ratio (the crop
//!   width/height truncated to whole pixels, skipped when the centring offset rounds to 0),
//!   then resized with a box (area-average) filter in linear light, which is what
//!   `stbir_resize(..., STBIR_FILTER_BOX, STBIR_COLORSPACE_SRGB)` computes.
//! * **Metadata** ([`encode_image`]): PNG gets a `parameters` text chunk (tEXt, or iTXt
//!   when the text is not Latin-1); JPEG a COM segment holding `parameters\0<text>\0`;
//!   WebP an XMP packet with the text in `sdcpp:parameters`: the three places the
//!   reference writes. [`read_parameters`] reads them back.
//! * **Names** ([`crate::output::ImageOutput::plan`]): printf-style `%d` / `%03d` in `-o` numbers the images
//!   from `--output-begin-idx` (default 0); without a pattern a single image keeps the
//!   name and a batch gets `name_<idx>.ext`; an unknown or missing extension gets `.png`.
//!
//! WebP output is lossless (the pure-Rust encoder has no lossy mode; the reference writes
//! lossy quality 90); JPEG output is quality 90 like the reference's.

use std::io::Cursor;
use std::path::{Path, PathBuf};

use crate::output::OutputTarget;
use crate::pipeline::Image;

/// JPEG quality of written files (the reference's).
pub const JPEG_QUALITY: u8 = 90;

/// The keyword under which the parameters are stored (PNG text chunk, JPEG COM prefix).
const PARAMETERS_KEY: &str = "parameters";

/// Errors of image reading and writing, each naming the file.
#[derive(Debug, thiserror::Error)]
pub enum ImageIoError {
    /// The file could not be opened or read.
    #[error("reading image {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The bytes are not an image we decode.
    #[error("{path} is not a readable PNG, JPEG, WebP or BMP image")]
    Decode {
        /// The file.
        path: PathBuf,
        /// What the decoder said.
        source: image::ImageError,
    },
    /// Encoding failed (size limits of the format, bad buffer).
    #[error("encoding {path} as {format}: {reason}")]
    Encode {
        /// The file.
        path: PathBuf,
        /// PNG, JPEG or WebP.
        format: &'static str,
        /// Why.
        reason: String,
    },
    /// The output could not be written (the error names the `-o` path).
    #[error(transparent)]
    Write(#[from] crate::output::OutputError),
    /// The input is not a regular file (a FIFO, a device, a directory), or could not be opened.
    #[error(transparent)]
    Open(#[from] crate::files::FilesError),
    /// The input is larger than any image we read.
    #[error("{path} is {size} bytes, more than the {max} bytes an input image may have")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A size or buffer that cannot be processed.
    #[error("{0}")]
    Invalid(String),
}

/// Result alias.
pub type Result<T, E = ImageIoError> = std::result::Result<T, E>;

/// The formats images are written in, chosen by the output file's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// `.png`.
    Png,
    /// `.jpg`, `.jpeg`, `.jpe`.
    Jpeg,
    /// `.webp`.
    WebP,
}

impl OutputFormat {
    /// The format a path's extension names (case-insensitive), if any.
    pub fn from_path(path: &Path) -> Option<Self> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "png" => Some(Self::Png),
            "jpg" | "jpeg" | "jpe" => Some(Self::Jpeg),
            "webp" => Some(Self::WebP),
            _ => None,
        }
    }

    /// `PNG`, `JPEG`, `WebP`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::WebP => "WebP",
        }
    }
}

/// Reads an image file (PNG, JPEG, WebP or BMP, recognised by content) as 8-bit RGB.
/// Alpha is dropped and grey is replicated to three channels.
pub fn read_image(path: &Path) -> Result<Image> {
    let bytes = read_bounded(path)?;
    decode_image(&bytes).map_err(|source| ImageIoError::Decode { path: path.to_path_buf(), source })
}

/// Decodes image bytes (format recognised by content) as 8-bit RGB.
pub fn decode_image(bytes: &[u8]) -> std::result::Result<Image, image::ImageError> {
    let img = image::ImageReader::new(Cursor::new(bytes)).with_guessed_format()?.decode()?.into_rgb8();
    let (w, h) = img.dimensions();
    Ok(Image { width: w as usize, height: h as usize, rgb: img.into_raw() })
}

/// The centre crop `(x, y, w, h)` that gives `img_w x img_h` the aspect ratio of
/// `dst_w x dst_h`, as the reference computes it (f32 aspect ratios, sizes truncated; no
/// crop when the centring offset is 0).
pub fn centre_crop(img_w: usize, img_h: usize, dst_w: usize, dst_h: usize) -> (usize, usize, usize, usize) {
    let dst_aspect = dst_w as f32 / dst_h as f32;
    let src_aspect = img_w as f32 / img_h as f32;
    let (mut x, mut y, mut w, mut h) = (0, 0, img_w, img_h);
    if src_aspect > dst_aspect {
        w = ((img_h as f32 * dst_aspect) as usize).min(img_w);
        x = (img_w - w) / 2;
    } else if src_aspect < dst_aspect {
        h = ((img_w as f32 / dst_aspect) as usize).min(img_h);
        y = (img_h - h) / 2;
    }
    if x == 0 && y == 0 {
        (0, 0, img_w, img_h)
    } else {
        (x, y, w, h)
    }
}

/// Fits an init image to `width x height` as the reference's CLI does when both `-W`
/// and `-H` are given: centre crop to the aspect ratio ([`centre_crop`]), then a box
/// resize in linear light ([`resize_box`]). An image of that size is returned unchanged.
pub fn fit_image(img: &Image, width: usize, height: usize) -> Result<Image> {
    check_image(img)?;
    if width == 0 || height == 0 {
        return Err(ImageIoError::Invalid(format!("cannot fit an image to {width}x{height}")));
    }
    if img.width == width && img.height == height {
        return Ok(img.clone());
    }
    let (x, y, w, h) = centre_crop(img.width, img.height, width, height);
    let cropped = if (x, y, w, h) == (0, 0, img.width, img.height) {
        img.clone()
    } else {
        tracing::info!("crop input image from {}x{} to {w}x{h}", img.width, img.height);
        let mut rgb = Vec::with_capacity(w * h * 3);
        for row in y..y + h {
            let start = (row * img.width + x) * 3;
            rgb.extend_from_slice(&img.rgb[start..start + w * 3]);
        }
        Image { width: w, height: h, rgb }
    };
    tracing::info!("resize input image from {w}x{h} to {width}x{height}");
    Ok(resize_box(&cropped, width, height))
}

fn check_image(img: &Image) -> Result<()> {
    if img.width == 0 || img.height == 0 || img.rgb.len() != img.width * img.height * 3 {
        return Err(ImageIoError::Invalid(format!(
            "an image of {}x{} needs {} RGB bytes, it has {}",
            img.width,
            img.height,
            img.width * img.height * 3,
            img.rgb.len()
        )));
    }
    Ok(())
}

fn srgb_to_linear(v: u8) -> f32 {
    let c = v as f32 / 255.0;
    if c <= 0.04045 {
        c / 12.92
    } else {
        ((c + 0.055) / 1.055).powf(2.4)
    }
}

fn linear_to_srgb(l: f32) -> u8 {
    let l = l.clamp(0.0, 1.0);
    let c = if l <= 0.003_130_8 { l * 12.92 } else { 1.055 * l.powf(1.0 / 2.4) - 0.055 };
    (c * 255.0 + 0.5).clamp(0.0, 255.0) as u8
}

/// For each of `dst` output pixels along an axis of `src` input pixels, the input pixels
/// it covers and the share of its footprint each covers (the box filter: output pixel `j`
/// spans `[j, j + 1) * src / dst` in input coordinates; the weights sum to 1).
pub fn box_weights(src: usize, dst: usize) -> Vec<Vec<(usize, f32)>> {
    let ratio = src as f64 / dst as f64;
    (0..dst)
        .map(|j| {
            let (lo, hi) = (j as f64 * ratio, (j + 1) as f64 * ratio);
            let first = lo.floor() as usize;
            let last = (hi.ceil() as usize).min(src);
            (first..last)
                .filter_map(|i| {
                    let overlap = (hi.min(i as f64 + 1.0) - lo.max(i as f64)).max(0.0);
                    (overlap > 0.0).then_some((i, (overlap / ratio) as f32))
                })
                .collect()
        })
        .collect()
}

/// Resizes with a box (area-average) filter in linear light, separably (rows, then columns).
pub fn resize_box(img: &Image, width: usize, height: usize) -> Image {
    let lut: Vec<f32> = (0..=255u8).map(srgb_to_linear).collect();
    let linear: Vec<f32> = img.rgb.iter().map(|&v| lut[v as usize]).collect();
    let wx = box_weights(img.width, width);
    let wy = box_weights(img.height, height);
    // Horizontal pass: img.height rows of `width` pixels.
    let mut rows = vec![0f32; img.height * width * 3];
    for y in 0..img.height {
        for (x, taps) in wx.iter().enumerate() {
            for c in 0..3 {
                let s: f32 = taps.iter().map(|&(i, w)| w * linear[(y * img.width + i) * 3 + c]).sum();
                rows[(y * width + x) * 3 + c] = s;
            }
        }
    }
    let mut rgb = vec![0u8; width * height * 3];
    for (y, taps) in wy.iter().enumerate() {
        for x in 0..width {
            for c in 0..3 {
                let s: f32 = taps.iter().map(|&(i, w)| w * rows[(i * width + x) * 3 + c]).sum();
                rgb[(y * width + x) * 3 + c] = linear_to_srgb(s);
            }
        }
    }
    Image { width, height, rgb }
}

/// The image in grey, as the reference's CLI reads a mask (`stbi_load` with one channel):
/// stb_image's luma `(77 R + 150 G + 29 B) >> 8` in all three channels (grey stays grey).
pub fn to_gray(img: &Image) -> Image {
    let rgb = img
        .rgb
        .chunks_exact(3)
        .flat_map(|p| [((p[0] as u32 * 77 + p[1] as u32 * 150 + p[2] as u32 * 29) >> 8) as u8; 3])
        .collect();
    Image { width: img.width, height: img.height, rgb }
}

/// Nearest-neighbour resize with the index rule `src = dst * src_len / dst_len`: what the
/// reference's library does to an init image whose size differs from the (aligned) request.
pub fn resize_nearest(img: &Image, width: usize, height: usize) -> Image {
    if img.width == width && img.height == height {
        return img.clone();
    }
    let mut rgb = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        let sy = y * img.height / height;
        for x in 0..width {
            let sx = x * img.width / width;
            let i = (sy * img.width + sx) * 3;
            rgb.extend_from_slice(&img.rgb[i..i + 3]);
        }
    }
    Image { width, height, rgb }
}

/// The image as planar `[3, H, W]` floats in `[0, 1]` (what the pipeline's init image takes).
pub fn to_planar(img: &Image) -> Vec<f32> {
    let plane = img.width * img.height;
    let mut planar = vec![0f32; plane * 3];
    for i in 0..plane {
        for c in 0..3 {
            planar[c * plane + i] = img.rgb[i * 3 + c] as f32 / 255.0;
        }
    }
    planar
}

/// Encodes `img` in `format`, with `parameters` in the format's metadata place when given.
pub fn encode_image(img: &Image, format: OutputFormat, parameters: Option<&str>) -> Result<Vec<u8>, String> {
    check_image(img).map_err(|e| e.to_string())?;
    let (w, h) = (
        u32::try_from(img.width).map_err(|_| "width too large".to_string())?,
        u32::try_from(img.height).map_err(|_| "height too large".to_string())?,
    );
    let parameters = parameters.filter(|p| !p.is_empty());
    let mut out = Vec::new();
    match format {
        OutputFormat::Png => {
            let mut enc = png::Encoder::new(&mut out, w, h);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            if let Some(text) = parameters {
                let latin1 = text.chars().all(|c| (c as u32) < 256);
                let r = if latin1 {
                    enc.add_text_chunk(PARAMETERS_KEY.into(), text.into())
                } else {
                    enc.add_itxt_chunk(PARAMETERS_KEY.into(), text.into())
                };
                r.map_err(|e| e.to_string())?;
            }
            let mut writer = enc.write_header().map_err(|e| e.to_string())?;
            writer.write_image_data(&img.rgb).map_err(|e| e.to_string())?;
            writer.finish().map_err(|e| e.to_string())?;
        }
        OutputFormat::Jpeg => {
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, JPEG_QUALITY)
                .encode(&img.rgb, w, h, image::ExtendedColorType::Rgb8)
                .map_err(|e| e.to_string())?;
            if let Some(text) = parameters {
                out = insert_jpeg_comment(&out, &jpeg_comment_payload(text))?;
            }
        }
        OutputFormat::WebP => {
            let mut enc = image_webp::WebPEncoder::new(&mut out);
            if let Some(text) = parameters {
                enc.set_xmp_metadata(webp_xmp_packet(text).into_bytes());
            }
            enc.encode(&img.rgb, w, h, image_webp::ColorType::Rgb8).map_err(|e| e.to_string())?;
        }
    }
    Ok(out)
}

/// The COM payload the reference writes: `parameters\0<text>\0`, cut (at a character
/// boundary) so that the segment fits its 16-bit length.
fn jpeg_comment_payload(text: &str) -> Vec<u8> {
    let max_text = 0xFFFF - 2 - PARAMETERS_KEY.len() - 2;
    let mut end = text.len().min(max_text);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut p = Vec::with_capacity(PARAMETERS_KEY.len() + end + 2);
    p.extend_from_slice(PARAMETERS_KEY.as_bytes());
    p.push(0);
    p.extend_from_slice(&text.as_bytes()[..end]);
    p.push(0);
    p
}

/// Inserts a COM segment after the SOI marker and the JFIF APP0 segment that must follow it.
fn insert_jpeg_comment(jpeg: &[u8], payload: &[u8]) -> Result<Vec<u8>, String> {
    if jpeg.len() < 4 || jpeg[0..2] != [0xFF, 0xD8] {
        return Err("the encoder produced no JPEG start marker".into());
    }
    let mut at = 2;
    if jpeg[2..4] == [0xFF, 0xE0] && jpeg.len() >= 6 {
        at = 4 + u16::from_be_bytes([jpeg[4], jpeg[5]]) as usize;
        if at > jpeg.len() {
            return Err("the encoder produced a truncated APP0 segment".into());
        }
    }
    let len = u16::try_from(payload.len() + 2).map_err(|_| "comment too long".to_string())?;
    let mut out = Vec::with_capacity(jpeg.len() + payload.len() + 4);
    out.extend_from_slice(&jpeg[..at]);
    out.extend_from_slice(&[0xFF, 0xFE]);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&jpeg[at..]);
    Ok(out)
}

fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

fn xml_unescape(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&apos;", "'").replace("&amp;", "&")
}

const XMP_OPEN: &str = "<sdcpp:parameters>";
const XMP_CLOSE: &str = "</sdcpp:parameters>";

/// The XMP packet of a WebP file: the parameters in `sdcpp:parameters`, in the namespace
/// the reference uses.
fn webp_xmp_packet(parameters: &str) -> String {
    format!(
        "<?xpacket begin=\"\" id=\"W5M0MpCehiHzreSzNTczkc9d\"?>\n\
         <x:xmpmeta xmlns:x=\"adobe:ns:meta/\">\n  \
         <rdf:RDF xmlns:rdf=\"http://www.w3.org/1999/02/22-rdf-syntax-ns#\">\n    \
         <rdf:Description xmlns:sdcpp=\"https://github.com/leejet/stable-diffusion.cpp/ns/1.0/\">\n      \
         {XMP_OPEN}{}{XMP_CLOSE}\n    \
         </rdf:Description>\n  \
         </rdf:RDF>\n\
         </x:xmpmeta>\n\
         <?xpacket end=\"w\"?>",
        xml_escape(parameters)
    )
}

/// Writes `img` to `path` in `format` with `parameters` (None: no metadata). The bytes go
/// to a temporary file next to `path` that is renamed over it, so a failure never leaves a
/// partial image behind.
pub fn write_image(target: &OutputTarget, img: &Image, format: OutputFormat, parameters: Option<&str>) -> Result<()> {
    let bytes = encode_image(img, format, parameters).map_err(|reason| ImageIoError::Encode {
        path: target.path().to_path_buf(),
        format: format.name(),
        reason,
    })?;
    Ok(target.write(&bytes)?)
}

/// [`write_image`] to a path, checked as an output first ([`OutputTarget::resolve`]).
pub fn save_image(path: &Path, img: &Image, format: OutputFormat, parameters: Option<&str>) -> Result<()> {
    write_image(&OutputTarget::resolve(path)?, img, format, parameters)
}

/// The most bytes an input image file may have (a 16k x 16k RGBA PNG stored raw is 1 GiB).
const MAX_INPUT_BYTES: u64 = 1 << 30;

/// Reads a regular file of at most [`MAX_INPUT_BYTES`] (never blocks on a FIFO or device).
fn read_bounded(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read as _;
    let (file, meta) = crate::files::open::open_regular(path)?;
    if meta.len() > MAX_INPUT_BYTES {
        return Err(ImageIoError::TooLarge { path: path.to_path_buf(), size: meta.len(), max: MAX_INPUT_BYTES });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_INPUT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| ImageIoError::Read { path: path.to_path_buf(), source })?;
    Ok(bytes)
}

/// The generation parameters stored in an image file by [`write_image`] (or by the
/// reference), if any: PNG text chunks, JPEG COM segments, WebP XMP.
pub fn read_parameters(path: &Path) -> Result<Option<String>> {
    let bytes = read_bounded(path)?;
    Ok(parameters_of(&bytes))
}

/// [`read_parameters`] on bytes in memory.
pub fn parameters_of(bytes: &[u8]) -> Option<String> {
    if bytes.starts_with(b"\x89PNG") {
        let mut reader = png::Decoder::new(Cursor::new(bytes)).read_info().ok()?;
        // Text chunks after the image data are read with it.
        if let Some(size) = reader.output_buffer_size() {
            let mut buf = vec![0; size];
            let _ = reader.next_frame(&mut buf);
        }
        let info = reader.info();
        if let Some(t) = info.uncompressed_latin1_text.iter().find(|t| t.keyword == PARAMETERS_KEY) {
            return Some(t.text.clone());
        }
        if let Some(t) = info.utf8_text.iter().find(|t| t.keyword == PARAMETERS_KEY) {
            return t.get_text().ok();
        }
        return info.compressed_latin1_text.iter().find(|t| t.keyword == PARAMETERS_KEY)?.get_text().ok();
    }
    if bytes.starts_with(&[0xFF, 0xD8]) {
        return jpeg_parameters(bytes);
    }
    if bytes.len() >= 12 && &bytes[0..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        let mut dec = image_webp::WebPDecoder::new(Cursor::new(bytes)).ok()?;
        let xmp = String::from_utf8(dec.xmp_metadata().ok()??).ok()?;
        let start = xmp.find(XMP_OPEN)? + XMP_OPEN.len();
        let end = start + xmp[start..].find(XMP_CLOSE)?;
        return Some(xml_unescape(&xmp[start..end]));
    }
    None
}

/// The text of the first COM segment that starts with `parameters\0`.
fn jpeg_parameters(bytes: &[u8]) -> Option<String> {
    let mut at = 2;
    while at + 4 <= bytes.len() && bytes[at] == 0xFF {
        let marker = bytes[at + 1];
        if marker == 0xDA || marker == 0xD9 {
            return None; // start of scan / end of image: no more headers
        }
        let len = u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]) as usize;
        let body = bytes.get(at + 4..at + 2 + len)?;
        if marker == 0xFE {
            if let Some(rest) = body.strip_prefix(PARAMETERS_KEY.as_bytes()).and_then(|r| r.strip_prefix(&[0])) {
                let text = rest.split(|&b| b == 0).next().unwrap_or(rest);
                return Some(String::from_utf8_lossy(text).into_owned());
            }
        }
        at += 2 + len;
    }
    None
}

/// Formats the printf `%d` conversions of `pattern` (`%d`, `%3d`, `%03d`: at most three
/// digits of flags and width) with `idx` and turns `%%` into `%`, as the reference's
/// `format_frame_idx` does. Returns `None` when the pattern has no such conversion.
pub fn format_index(pattern: &str, idx: u64) -> Option<String> {
    let chars: Vec<char> = pattern.chars().collect();
    let mut out = String::with_capacity(pattern.len() + 8);
    let mut found = false;
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '%' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|&&c| c == '%').count();
        // Pairs are escaped percent signs; an odd one out may start a conversion.
        out.extend(std::iter::repeat_n("%%", run / 2));
        i += run;
        if run % 2 == 1 {
            let digits = chars[i..].iter().take_while(|c| c.is_ascii_digit()).count();
            if digits <= 3 && chars.get(i + digits) == Some(&'d') {
                let spec: String = chars[i..i + digits].iter().collect();
                let zero = spec.starts_with('0');
                let width: usize = spec.trim_start_matches('0').parse().unwrap_or(0);
                if zero {
                    out.push_str(&format!("{idx:0width$}"));
                } else {
                    out.push_str(&format!("{idx:width$}"));
                }
                found = true;
                i += digits + 1;
            } else {
                out.push('%');
            }
        }
    }
    found.then(|| out.replace("%%", "%"))
}

/// The files `count` images are written to for `-o output` and `--output-begin-idx`
/// (negative or `None`: 0), named as the reference names them, each with its format:
/// * the extension decides the format (`.png`, `.jpg`/`.jpeg`/`.jpe`, `.webp`); any other
///   extension, or none, keeps the name and appends `.png`;
/// * with a `%d`-style pattern ([`format_index`]), image `i` is the pattern at `begin + i`;
/// * otherwise one image keeps the name, and a batch is `<stem>_<begin + i>.<ext>`.
pub(crate) fn output_paths(output: &Path, count: usize, begin_idx: Option<i64>) -> Vec<(PathBuf, OutputFormat)> {
    let text = output.to_string_lossy();
    let ext = output.extension().map(|e| e.to_string_lossy().into_owned());
    let known = OutputFormat::from_path(output);
    let strip =
        known.is_some() || matches!(ext.as_deref().map(str::to_ascii_lowercase).as_deref(), Some("avi" | "webm"));
    let (base, ext) = match (&ext, strip) {
        (Some(e), true) => (text[..text.len() - e.len() - 1].to_string(), e.clone()),
        _ => (text.to_string(), String::new()),
    };
    let format = known.unwrap_or(OutputFormat::Png);
    // The reference appends `.png` to a name without a known extension. A single output that
    // names something that exists (a directory, a device, a FIFO, a file without extension)
    // is taken as written, so the checks of the output target refuse or replace that thing
    // instead of writing a new file beside it (`-o /dev/full` must not create /dev/full.png).
    if known.is_none() && count == 1 && !has_index_pattern(&text) && std::fs::symlink_metadata(output).is_ok() {
        return vec![(output.to_path_buf(), format)];
    }
    let ext = if known.is_some() { format!(".{ext}") } else { ".png".to_string() };
    let begin = begin_idx.unwrap_or(0).max(0) as u64;
    let pattern = format!("{base}{ext}");
    let has_pattern = has_index_pattern(&text);
    (0..count)
        .map(|i| {
            let idx = begin + i as u64;
            let name = if has_pattern {
                format_index(&pattern, idx).unwrap_or_else(|| pattern.clone())
            } else if count > 1 {
                format!("{base}_{idx}{ext}")
            } else {
                pattern.clone()
            };
            (PathBuf::from(name), format)
        })
        .collect()
}

/// Whether an output name holds a `%d`-style index.
fn has_index_pattern(text: &str) -> bool {
    format_index(text, 0).is_some()
}

#[cfg(test)]
mod tests;

pub mod canny;
