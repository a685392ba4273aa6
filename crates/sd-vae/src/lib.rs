//! AutoencoderKL and TAESD decoders/encoders with tiling.
//!
//! What it is for: turning diffusion latents into images and images into latents for
//! SD 1.x/2.x, SDXL and FLUX.1, as ggml graphs that match stable-diffusion.cpp op by op (so the numbers
//! agree with the reference), plus the VAE tiling of `performance.md`.
//!
//! Main types:
//! * [`AutoencoderKl`] with [`VaeConfig::sd`] / [`VaeConfig::flux`] and [`vae_specs`]: the
//!   LDM autoencoder (`first_stage_model.*`); decode gives `[3, 8h, 8w]` in `[-1, 1]`, encode
//!   gives a [`LatentDistribution`] that the caller samples with its own noise.
//!   [`VaeLayout`] reads a file's latent channels and quant convs, checked against the
//!   family's configuration with [`VaeConfig::check_layout`].
//! * [`Taesd`] with [`TaesdConfig::sd`] and [`taesd_specs`]: the tiny autoencoder
//!   (`--taesd`, `tae.*`), images in `[0, 1]`.
//! * [`TilingParams`] (parsed from the CLI strings) and [`decode_tiled`] /
//!   [`encode_tiled`]: the main paths, with tiling and the allocation-failure retry of
//!   the decode path. The tiling arithmetic is pure logic in [`tiling`].
//!
//! * [`Esrgan`] with [`EsrganConfig::from_tensors`] and [`esrgan_specs`]: ESRGAN /
//!   Real-ESRGAN (RRDBNet), the `upscaler` module (`esrgan.rs`), images in `[0, 1]`, tiled.
//!
//! Where the latent scale factor is applied (0.18215 for SD 1.x/2.x): **by the caller**,
//! outside every graph, as stable-diffusion.cpp does:
//! * text-to-image: `model.diffusion_to_vae(&mut latent)` (AutoencoderKL: `x / 0.18215`;
//!   TAESD: unchanged), then [`decode_tiled`], then map the image with [`ImageRange`];
//! * image-to-image: image `[0, 1]` -> `x * 2 - 1` (AutoencoderKL only), [`encode_tiled`],
//!   [`LatentDistribution::from_moments`], `.sample(noise)` with noise from the
//!   generation's RNG, then [`VaeConfig::vae_to_diffusion`] (`x * 0.18215`).
//!
//! Convolution path: by default ggml's im2col + matmul (`ggml_conv_2d`) with f16
//! kernels, the reference's default. [`GraphOptions::conv_direct`] selects
//! `ggml_conv_2d_direct` (the reference's `--vae-conv-direct`); on the CPU backend it
//! gives images within 1 level with a compute buffer about 2.6x smaller, so
//! [`GraphOptions::recommended`] turns it on for CPU devices (the pipeline does not use it).
//!
//! What it refuses to do: it reads no file (weights come from a
//! [`sd_sched::TensorSource`]), draws no random numbers, and never clamps or quantises
//! images; that is the pipeline's job.

pub mod error;
pub mod esrgan;
pub mod kl;
pub mod nn;
pub mod pixel;
pub mod run;
pub mod tae;
pub mod tiling;

pub use error::{Result, VaeError};
pub use esrgan::{canonical_name as esrgan_canonical_name, esrgan_specs, Esrgan, EsrganConfig};
pub use kl::{vae_specs, AutoencoderKl, LatentDistribution, LatentStats, VaeConfig, VaeLayout, VaeParts};
pub use nn::GraphOptions;
pub use pixel::PixelSpace;
pub use run::{
    decode_tiled, decode_tiled_observed, encode_tiled, encode_tiled_observed, FirstStage, ImageRange, GRAPH_SIZE,
};
pub use tae::{taesd_specs, Taesd, TaesdConfig, TaesdParts};
pub use tiling::{TileGrid, TilingOption, TilingParams};
