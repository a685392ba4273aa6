//! The first stage of a model that diffuses in pixel space (Chroma1-Radiance): no network.
//! Its "latent" is the image in `[-1, 1]`, channel for channel, one position per pixel; the
//! stage only checks shapes and copies, as the reference's `FakeVAE` does (the range mapping,
//! `x * 2 - 1` in and `clamp((y + 1) / 2)` out, is the caller's, as for AutoencoderKL).

use sd_sched::Runner;

use crate::error::{Result, VaeError};
use crate::run::{FirstStage, ImageRange};

const MODULE: &str = "pixel space";

/// The identity first stage of `channels`-channel images.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PixelSpace {
    channels: usize,
}

impl PixelSpace {
    /// The stage of `channels`-channel images (3 for RGB).
    pub fn new(channels: usize) -> Self {
        Self { channels }
    }

    fn copy(&self, what: &str, data: &[f32], dims: [usize; 2], channels: usize) -> Result<(Vec<f32>, usize)> {
        if channels != self.channels || data.len() != channels * dims[0] * dims[1] {
            return Err(VaeError::input(
                MODULE,
                format!(
                    "{what} of {} values as {channels} x {} x {}: a pixel-space model takes {} channels",
                    data.len(),
                    dims[1],
                    dims[0],
                    self.channels
                ),
            ));
        }
        Ok((data.to_vec(), channels))
    }
}

impl FirstStage for PixelSpace {
    fn module(&self) -> &'static str {
        MODULE
    }

    fn scale_factor(&self) -> usize {
        1
    }

    fn latent_channels(&self) -> usize {
        self.channels
    }

    fn image_channels(&self) -> usize {
        self.channels
    }

    fn image_range(&self) -> ImageRange {
        ImageRange::MinusOneToOne
    }

    fn diffusion_to_vae(&self, _latents: &mut [f32]) {}

    fn vae_to_diffusion(&self, _latents: &mut [f32]) {}

    fn decode_graph(
        &self,
        _runner: &mut Runner,
        latent: &[f32],
        dims: [usize; 2],
        channels: usize,
        _max_compute_bytes: Option<usize>,
    ) -> Result<(Vec<f32>, usize)> {
        self.copy("a latent", latent, dims, channels)
    }

    fn encode_graph(
        &self,
        _runner: &mut Runner,
        image: &[f32],
        dims: [usize; 2],
        channels: usize,
        _max_compute_bytes: Option<usize>,
    ) -> Result<(Vec<f32>, usize)> {
        self.copy("an image", image, dims, channels)
    }
}
