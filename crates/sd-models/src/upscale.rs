//! Upscaling an image with an ESRGAN model file (the `upscaler` module): open and check the file, load it on a device, run it.
//!
//! What stable-diffusion.cpp's upscaler does (`src/upscaler.cpp`, its `upscale` C API), on our
//! graph ([`sd_vae::Esrgan`]): the image's bytes become `[0, 1]` floats, the network runs in
//! tiles of `tile` pixels (128 by default, one graph when the image fits), and the output is
//! rounded back to bytes as every image of the pipeline is. Repeats feed each output to the
//! next pass. [`UpscalerFile::open`] reads headers only and refuses a file that is not an
//! ESRGAN model (naming the tensor), so callers check before any weight is read;
//! [`UpscalerFile::load`] reads the weights onto a backend.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sd_backends::{Backend, GgmlType};
use sd_sched::{MappedBytes, Runner, SourceError, TensorSource};
use sd_vae::{esrgan_canonical_name, Esrgan, EsrganConfig, VaeError};

use crate::files::{FilesError, ModelFiles};
use crate::loader::FileSource;
use crate::pipeline::Image;
use crate::report::RunReport;

/// The reference's default tile size (input pixels).
pub const DEFAULT_TILE: usize = sd_vae::esrgan::DEFAULT_TILE;
/// The largest side an upscaled image may have (a repeat count that would pass it is refused
/// before anything runs).
pub const MAX_SIDE: usize = 16384;

/// Errors of the upscaler.
#[derive(Debug, thiserror::Error)]
pub enum UpscaleError {
    /// The file cannot be opened or read as a model file.
    #[error("upscale model '{}'", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<FilesError>,
    },
    /// The file opened, but it is not an ESRGAN model (or lacks a tensor of one).
    #[error("upscale model '{}' is not a usable ESRGAN model", path.display())]
    Layout {
        /// The file.
        path: PathBuf,
        /// The tensor and what is wrong with it.
        #[source]
        source: Box<VaeError>,
    },
    /// The upscaled image would be larger than [`MAX_SIDE`].
    #[error("upscaling a {width}x{height} image {passes} time(s) by {scale} gives {out_w}x{out_h} pixels, more than {MAX_SIDE} per side")]
    TooLarge {
        /// Input width.
        width: usize,
        /// Input height.
        height: usize,
        /// Passes asked for.
        passes: usize,
        /// The model's factor.
        scale: usize,
        /// Output width (saturated).
        out_w: usize,
        /// Output height (saturated).
        out_h: usize,
    },
    /// No passes asked for.
    #[error("the number of upscaling passes must be at least 1")]
    NoPasses,
    /// Loading the weights or running the network failed.
    #[error("upscaler on {device}")]
    Run {
        /// The device.
        device: String,
        /// The network's error.
        #[source]
        source: Box<VaeError>,
    },
}

/// A checked ESRGAN file: its configuration and its tensors under RRDBNet names, nothing loaded.
pub struct UpscalerFile {
    path: PathBuf,
    files: ModelFiles,
    config: EsrganConfig,
    /// RRDBNet name -> the index's name.
    names: HashMap<String, String>,
}

impl std::fmt::Debug for UpscalerFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpscalerFile").field("path", &self.path).field("config", &self.config).finish()
    }
}

impl UpscalerFile {
    /// Opens `path` (safetensors or GGUF; the original ESRGAN names are renamed), reads the
    /// configuration from its tensors and checks every tensor the network reads.
    pub fn open(path: &Path) -> Result<Self, UpscaleError> {
        let files = ModelFiles::open_model(path)
            .map_err(|e| UpscaleError::Open { path: path.to_path_buf(), source: Box::new(e) })?;
        let names: HashMap<String, String> =
            files.index().entries().iter().map(|e| (esrgan_canonical_name(&e.original_name), e.name.clone())).collect();
        let config = EsrganConfig::from_tensors(names.keys().map(String::as_str), |n| {
            names.get(n).and_then(|i| files.index().get(i)).map(|e| e.ne())
        })
        .map_err(|e| UpscaleError::Layout { path: path.to_path_buf(), source: Box::new(e) })?;
        // Images are RGB in and out (as the reference's, which fixes 3 channels).
        for (tensor, channels, side) in
            [("conv_first.weight", config.in_ch, "input"), ("conv_last.weight", config.out_ch, "output")]
        {
            if channels != 3 {
                let source = VaeError::UpscalerLayout {
                    tensor: tensor.into(),
                    message: format!("{channels} {side} channels; RGB images need 3"),
                };
                return Err(UpscaleError::Layout { path: path.to_path_buf(), source: Box::new(source) });
            }
        }
        Ok(Self { path: path.to_path_buf(), files, config, names })
    }

    /// The network's configuration.
    pub fn config(&self) -> &EsrganConfig {
        &self.config
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the parameters as they are loaded (f16 kernels, f32 biases), for plans.
    pub fn param_bytes(&self) -> u64 {
        sd_vae::esrgan_specs(&self.config)
            .iter()
            .map(|s| {
                let n: i64 = s.ne.iter().product();
                n as u64 * if s.ty == GgmlType::GGML_TYPE_F16 { 2 } else { 4 }
            })
            .sum()
    }

    /// Checks that `passes` passes over a `width` x `height` image stay within [`MAX_SIDE`].
    pub fn check_passes(&self, width: usize, height: usize, passes: usize) -> Result<(), UpscaleError> {
        if passes == 0 {
            return Err(UpscaleError::NoPasses);
        }
        let scale = self.config.scale;
        // `scale^passes * side`, saturated (an x1 model never grows).
        let out = |side: usize| {
            u32::try_from(passes).ok().and_then(|p| scale.checked_pow(p)).and_then(|f| side.checked_mul(f))
        };
        match (out(width), out(height)) {
            (Some(w), Some(h)) if w <= MAX_SIDE && h <= MAX_SIDE => Ok(()),
            (w, h) => Err(UpscaleError::TooLarge {
                width,
                height,
                passes,
                scale,
                out_w: w.unwrap_or(usize::MAX),
                out_h: h.unwrap_or(usize::MAX),
            }),
        }
    }

    /// Loads the weights onto `backend`'s device (graphs without a memory budget).
    pub fn load(self, backend: Arc<Backend>) -> Result<Upscaler, UpscaleError> {
        self.load_with_budget(backend, None)
    }

    /// [`UpscalerFile::load`] with the device's memory budget in bytes: a graph whose compute
    /// buffer would pass it is retried with smaller tiles (the device's `--max-vram`).
    pub fn load_with_budget(self, backend: Arc<Backend>, budget: Option<u64>) -> Result<Upscaler, UpscaleError> {
        let device = backend.device().name();
        let run = |e| UpscaleError::Run { device: device.clone(), source: Box::new(e) };
        let source = Renamed { inner: FileSource::new(&self.files), names: &self.names };
        let net = Esrgan::load(self.config.clone(), &source, backend.device().buffer_type()).map_err(run)?;
        let ledger = sd_sched::Ledger::new(backend.device().name(), budget);
        let runner = Runner::with_ledger(sd_vae::esrgan::MODULE, backend, ledger, Default::default());
        Ok(Upscaler { file: self, net, runner, tile: DEFAULT_TILE })
    }
}

/// The file's tensors under RRDBNet names.
struct Renamed<'a> {
    inner: FileSource<'a>,
    names: &'a HashMap<String, String>,
}

impl Renamed<'_> {
    fn name<'n>(&'n self, name: &'n str) -> &'n str {
        self.names.get(name).map_or(name, String::as_str)
    }
}

impl TensorSource for Renamed<'_> {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<std::borrow::Cow<'_, [u8]>, SourceError> {
        self.inner.load_tensor(self.name(name), ty, ne)
    }

    fn release(&self, name: &str) {
        self.inner.release(self.name(name))
    }

    fn mapped(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Option<MappedBytes>, SourceError> {
        self.inner.mapped_tensor(self.name(name), ty, ne)
    }
}

/// An ESRGAN model loaded on a device.
pub struct Upscaler {
    file: UpscalerFile,
    net: Esrgan,
    runner: Runner,
    tile: usize,
}

impl std::fmt::Debug for Upscaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upscaler").field("file", &self.file).field("tile", &self.tile).finish()
    }
}

impl Upscaler {
    /// Sets the tile size in input pixels (0: never tile); the default is [`DEFAULT_TILE`].
    pub fn with_tile(mut self, tile: usize) -> Self {
        self.tile = tile;
        self
    }

    /// The checked file it was loaded from.
    pub fn file(&self) -> &UpscalerFile {
        &self.file
    }

    /// Upscales a planar RGB image in [0, 1] of `(w, h)` once, in f32 (not rounded to 8 bits,
    /// not clamped), as the reference's hires fix runs its upscaler model; gives the image
    /// and its size.
    pub(crate) fn upscale_planar(
        &mut self,
        planar: &[f32],
        (w, h): (usize, usize),
    ) -> Result<(Vec<f32>, (usize, usize)), UpscaleError> {
        self.file.check_passes(w, h, 1)?;
        let s = self.file.config.scale;
        tracing::info!("hires Model upscale {w}x{h} -> {}x{}", w * s, h * s);
        let out = self
            .net
            .upscale(&mut self.runner, planar, [w, h], self.tile, None, &mut |d, n| {
                tracing::debug!("upscaler tile {d}/{n}")
            })
            .map_err(|e| UpscaleError::Run { device: self.runner.backend().device().name(), source: Box::new(e) })?;
        Ok((out, (w * s, h * s)))
    }

    /// Upscales `image` `passes` times; `report` gets the module, its runner and the stage
    /// `upscale` (the time of all passes).
    pub fn upscale(&mut self, image: &Image, passes: usize, report: &mut RunReport) -> Result<Image, UpscaleError> {
        self.file.check_passes(image.width, image.height, passes)?;
        let t = std::time::Instant::now();
        let mut img = image.clone();
        for pass in 0..passes {
            let s = self.file.config.scale;
            tracing::info!(
                "upscaling from {}x{} to {}x{} (pass {} of {passes})",
                img.width,
                img.height,
                img.width * s,
                img.height * s,
                pass + 1
            );
            let planar = crate::image_io::to_planar(&img);
            let out = self
                .net
                .upscale(&mut self.runner, &planar, [img.width, img.height], self.tile, None, &mut |d, n| {
                    tracing::debug!("upscaler tile {d}/{n}")
                })
                .map_err(|e| UpscaleError::Run {
                    device: self.runner.backend().device().name(),
                    source: Box::new(e),
                })?;
            img = crate::pipeline::planar_to_rgb8(&out, img.width * s, img.height * s, sd_vae::ImageRange::ZeroToOne);
        }
        let secs = t.elapsed().as_secs_f64();
        tracing::info!("upscaling took {secs:.2} s");
        report.modules.push(crate::report::ModuleReport::of(sd_vae::esrgan::MODULE, self.net.weights(), &self.runner));
        report.runners.push(crate::report::RunnerReport::of(&self.runner, self.net.weights()));
        report.stage("upscale", secs);
        Ok(img)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::esrgan::EsrganFixture;
    use crate::fixture::{write_table, FileFormat, WeightType};

    const F: EsrganFixture = EsrganFixture { scale: 2, blocks: 1, features: 8, std: None, seed: 3 };

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("sd-models-upscale-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn layout_tensor(e: UpscaleError) -> String {
        match e {
            UpscaleError::Layout { source, .. } => match *source {
                VaeError::UpscalerLayout { tensor, .. } => tensor,
                other => panic!("{other:?}"),
            },
            other => panic!("expected a layout error, got {other:?}"),
        }
    }

    /// A file is checked from its header: a missing tensor and a one-channel output are named;
    /// passes are at least 1 and may not make an image larger than MAX_SIDE.
    #[test]
    fn files_and_passes_are_checked_before_loading() {
        let d = dir("checks");
        let good = d.join("good.safetensors");
        F.write(&good, WeightType::F16, FileFormat::Safetensors).unwrap();
        let file = UpscalerFile::open(&good).unwrap();
        assert_eq!((file.config().scale, file.config().num_block, file.config().num_feat), (2, 1, 8));
        assert!(file.check_passes(64, 64, 1).is_ok());
        assert!(matches!(file.check_passes(64, 64, 0), Err(UpscaleError::NoPasses)));
        match file.check_passes(64, 48, 9) {
            Err(UpscaleError::TooLarge { out_w: 32768, out_h: 24576, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(file.check_passes(64, 48, 8).is_ok(), "16384 x 12288 fits");
        assert!(matches!(file.check_passes(64, 48, usize::MAX), Err(UpscaleError::TooLarge { .. })));

        let missing = d.join("missing.safetensors");
        let table: Vec<_> = F.table().into_iter().filter(|t| t.name != "body.0.rdb2.conv4.weight").collect();
        write_table(&missing, table, WeightType::F16, FileFormat::Safetensors, &[], 3).unwrap();
        assert_eq!(layout_tensor(UpscalerFile::open(&missing).unwrap_err()), "body.0.rdb2.conv4.weight");

        let gray = d.join("gray.safetensors");
        let table: Vec<_> = F
            .table()
            .into_iter()
            .map(|mut t| {
                if t.name.starts_with("conv_last.") {
                    t.shape[0] = 1;
                }
                t
            })
            .collect();
        write_table(&gray, table, WeightType::F16, FileFormat::Safetensors, &[], 3).unwrap();
        assert_eq!(layout_tensor(UpscalerFile::open(&gray).unwrap_err()), "conv_last.weight");
        let _ = std::fs::remove_dir_all(&d);
    }
}
