//! Graph execution: one graph per call, the main decode path with tiling and the allocation retry.
//!
//! A model ([`FirstStage`]) knows how to build and run one decode or encode graph on
//! a planar buffer. [`decode_tiled`] and [`encode_tiled`] put the tiling rules of
//! stable-diffusion.cpp's `docs/performance.md` on top:
//! * with `--vae-tiling`, both directions split the input into the grid of
//!   [`crate::tiling`] and blend the tiles as stable-diffusion.cpp blends them;
//! * the decode path retries an allocation failure with smaller tiles, even without
//!   `--vae-tiling`: the first retry uses at most 256-pixel tiles, later ones halve the
//!   effective tile down to the minimum, and each must shrink it; a failure while
//!   computing is returned at once; encoding is never retried.
//!
//! An allocation failure is either the runner failing to allocate the compute buffer,
//! or the measured buffer exceeding the caller's `max_compute_bytes` (checked before
//! allocating), so the retry can be exercised on any machine.

use sd_backends::{alloc::measure, Context, Tensor};
use sd_sched::{Runner, Weights};

use crate::error::{Result, VaeError};
use crate::nn::{Fwd, GraphOptions};
use crate::tiling::{retry_tile_size, run_tiled, tile_grid, Direction, TilingParams};

/// Nodes of one autoencoder graph (stable-diffusion.cpp's `VAE_GRAPH_SIZE`).
pub const GRAPH_SIZE: usize = 20480;

/// The value range of the images a model takes and produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageRange {
    /// `[-1, 1]` (AutoencoderKL): an image in `[0, 1]` enters as `x * 2 - 1`; the output
    /// becomes displayable as `clamp((y + 1) * 0.5, 0, 1)`.
    MinusOneToOne,
    /// `[0, 1]` (TAESD): images enter and leave as they are (clamp the output).
    ZeroToOne,
}

/// An autoencoder that can run one decode or encode graph.
pub trait FirstStage {
    /// `vae` or `taesd`, for logs and errors.
    fn module(&self) -> &'static str;
    /// Image pixels per latent pixel (8).
    fn scale_factor(&self) -> usize;
    /// Channels of a latent.
    fn latent_channels(&self) -> usize;
    /// Channels of an image.
    fn image_channels(&self) -> usize;
    /// The range of the images.
    fn image_range(&self) -> ImageRange;
    /// Diffusion-space latents to what the decoder takes, in place (AutoencoderKL divides
    /// by its scale factor; TAESD takes them unchanged).
    fn diffusion_to_vae(&self, latents: &mut [f32]);
    /// Diffusion-space latents from what the encoder produces, in place (the inverse
    /// of [`FirstStage::diffusion_to_vae`]).
    fn vae_to_diffusion(&self, latents: &mut [f32]);
    /// The ggml parameters its graphs read, for run reports (`None`: it has none).
    fn params(&self) -> Option<&Weights> {
        None
    }
    /// One decode graph on a planar `[channels, h, w]` latent. Returns the planar image
    /// and its channel count.
    fn decode_graph(
        &self,
        runner: &mut Runner,
        latent: &[f32],
        dims: [usize; 2],
        channels: usize,
        max_compute_bytes: Option<usize>,
    ) -> Result<(Vec<f32>, usize)>;
    /// One encode graph on a planar `[channels, H, W]` image. Returns the planar output
    /// (moments for AutoencoderKL, the latent for TAESD) and its channel count.
    fn encode_graph(
        &self,
        runner: &mut Runner,
        image: &[f32],
        dims: [usize; 2],
        channels: usize,
        max_compute_bytes: Option<usize>,
    ) -> Result<(Vec<f32>, usize)>;
}

/// What a ggml autoencoder provides so that [`decode_graph`] and [`encode_graph`] can run
/// it: the one implementation of input checks and graph execution shared by
/// AutoencoderKL and TAESD.
pub(crate) trait GraphModel: FirstStage {
    /// The parameters the graphs read.
    fn weights(&self) -> &Weights;
    /// Graph construction options.
    fn graph_options(&self) -> GraphOptions;
    /// Builds the decode graph on a `[w, h, c, 1]` latent tensor.
    fn build_decode_graph<'g>(&self, f: &Fwd<'_, 'g>, z: Tensor<'g>) -> Result<Tensor<'g>>;
    /// Builds the encode graph on a `[W, H, c, 1]` image tensor.
    fn build_encode_graph<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>>;
}

/// [`FirstStage::decode_graph`] of a ggml autoencoder.
pub(crate) fn decode_graph<M: GraphModel>(
    m: &M,
    runner: &mut Runner,
    latent: &[f32],
    dims: [usize; 2],
    channels: usize,
    max_compute_bytes: Option<usize>,
) -> Result<(Vec<f32>, usize)> {
    let module = m.module();
    if channels != m.latent_channels() {
        return Err(VaeError::input(
            module,
            format!("the latent has {channels} channels, {module} takes {}", m.latent_channels()),
        ));
    }
    let input = [dims[0], dims[1], channels];
    let (out, ne) =
        run_graph(runner, module, m.weights(), m.graph_options(), latent, input, max_compute_bytes, |f, z| {
            m.build_decode_graph(f, z)
        })?;
    Ok((out, ne[2]))
}

/// [`FirstStage::encode_graph`] of a ggml autoencoder.
pub(crate) fn encode_graph<M: GraphModel>(
    m: &M,
    runner: &mut Runner,
    image: &[f32],
    dims: [usize; 2],
    channels: usize,
    max_compute_bytes: Option<usize>,
) -> Result<(Vec<f32>, usize)> {
    let module = m.module();
    let s = m.scale_factor();
    if channels != m.image_channels() || !dims[0].is_multiple_of(s) || !dims[1].is_multiple_of(s) {
        return Err(VaeError::input(
            module,
            format!(
                "cannot encode a {channels}-channel {}x{} image: expected {} channels and sides that are multiples of {s}",
                dims[0],
                dims[1],
                m.image_channels()
            ),
        ));
    }
    let input = [dims[0], dims[1], channels];
    let (out, ne) =
        run_graph(runner, module, m.weights(), m.graph_options(), image, input, max_compute_bytes, |f, x| {
            m.build_encode_graph(f, x)
        })?;
    Ok((out, ne[2]))
}

/// Builds a graph on an input of `dims` (`[w, h, c]`, batch 1) with `build`, checks the
/// compute buffer against `max_compute_bytes`, allocates, runs it and reads the output
/// (planar data and `[w, h, c]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_graph<F>(
    runner: &mut Runner,
    module: &'static str,
    weights: &Weights,
    opts: GraphOptions,
    input: &[f32],
    dims: [usize; 3],
    max_compute_bytes: Option<usize>,
    build: F,
) -> Result<(Vec<f32>, [usize; 3])>
where
    F: for<'w, 'g> FnOnce(&Fwd<'w, 'g>, Tensor<'g>) -> Result<Tensor<'g>>,
{
    let [w, h, c] = dims;
    if w == 0 || h == 0 || c == 0 || input.len() != w * h * c {
        return Err(VaeError::input(
            module,
            format!("input has {} values, expected {c}x{h}x{w} (non-empty)", input.len()),
        ));
    }
    let backend_err = |e| VaeError::Backend { module, source: e };
    let ctx = Context::for_graph(GRAPH_SIZE, GRAPH_SIZE).map_err(backend_err)?;
    let x = ctx.new_f32(&[w as i64, h as i64, c as i64, 1]).set_name("vae.input").set_input();
    let device = runner.backend().device();
    let fwd = Fwd { ctx: &ctx, weights, opts, device, module };
    let out = build(&fwd, x)?.set_output();
    if let Some(cap) = max_compute_bytes {
        let graph = ctx.new_graph(GRAPH_SIZE);
        graph.expand(out);
        let need = measure(device.buffer_type(), &graph);
        if need > cap {
            return Err(VaeError::Alloc { device: device.name(), module, bytes: need, cap: Some(cap) });
        }
    }
    // The graph runs whole (no cuts: VAE activations are large and each stage feeds the
    // next, so segments would hold little but cut buffers; under a tight budget the VAE
    // tiles instead, performance.md), its weights staged from their home. Running out of
    // room, whatever refused it, is an allocation failure: the caller retries with tiles.
    runner
        .run(weights, &ctx, GRAPH_SIZE, &[], out, &mut || {
            x.set_f32(input)?;
            Ok(())
        })
        .map_err(|e| match e.no_room() {
            Some(r) => {
                VaeError::Alloc { device: r.device, module, bytes: r.bytes as usize, cap: r.cap.map(|c| c as usize) }
            }
            None => VaeError::Compute { module, source: e },
        })?;
    let [ow, oh, oc, on] = out.shape();
    if on != 1 {
        return Err(VaeError::input(module, format!("the graph produced a batch of {on}")));
    }
    let data = out.get_f32().map_err(backend_err)?;
    Ok((data, [ow as usize, oh as usize, oc as usize]))
}

/// The main decode path: decodes a VAE latent (planar `[channels, h, w]`, already passed
/// through [`FirstStage::diffusion_to_vae`]) to a planar `[3, 8h, 8w]` image in the
/// model's [`ImageRange`]. Tiles when `tiling.enabled`; retries an allocation failure
/// with smaller tiles whether or not tiling is enabled. `tiling` is not modified.
pub fn decode_tiled(
    model: &dyn FirstStage,
    runner: &mut Runner,
    latent: &[f32],
    dims: (usize, usize),
    channels: usize,
    tiling: &TilingParams,
    max_compute_bytes: Option<usize>,
) -> Result<Vec<f32>> {
    decode_tiled_observed(model, runner, latent, dims, channels, tiling, max_compute_bytes, &mut |_, _| {})
}

/// [`decode_tiled`], calling `on_tile(done, tiles)` after each tile of a tiled run (a
/// retry with smaller tiles counts again from 1 with its own total; an untiled run
/// reports nothing).
#[allow(clippy::too_many_arguments)]
pub fn decode_tiled_observed(
    model: &dyn FirstStage,
    runner: &mut Runner,
    latent: &[f32],
    dims: (usize, usize),
    channels: usize,
    tiling: &TilingParams,
    max_compute_bytes: Option<usize>,
    on_tile: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f32>> {
    let small = [dims.0, dims.1];
    let scale = model.scale_factor();
    let overlap = tiling.overlap();
    // None: one graph over the whole latent.
    let mut tile: Option<[usize; 2]> = if tiling.enabled { Some(tiling.tile_size_latent(small, scale)?) } else { None };
    let mut first_retry = true;
    loop {
        let attempt = match tile {
            None => model.decode_graph(runner, latent, small, channels, max_compute_bytes).map(|(v, _)| v),
            Some(t) => decode_grid(model, runner, latent, small, channels, t, overlap, max_compute_bytes, on_tile),
        };
        match attempt {
            Err(e) if e.is_alloc() => {
                let effective = tile.map_or(small, |t| tile_grid(small, t, overlap).tile);
                match retry_tile_size(effective, small, scale, first_retry) {
                    Some(next) => {
                        tracing::warn!(
                            "{}: {e}; retrying the decode with {}x{} pixel tiles",
                            model.module(),
                            next[0] * scale,
                            next[1] * scale
                        );
                        tile = Some(next);
                        first_retry = false;
                    }
                    None => return Err(e),
                }
            }
            other => return other,
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn decode_grid(
    model: &dyn FirstStage,
    runner: &mut Runner,
    latent: &[f32],
    small: [usize; 2],
    channels: usize,
    tile: [usize; 2],
    overlap: f32,
    max_compute_bytes: Option<usize>,
    on_tile: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f32>> {
    let grid = tile_grid(small, tile, overlap);
    if grid.is_single() {
        return model.decode_graph(runner, latent, small, channels, max_compute_bytes).map(|(v, _)| v);
    }
    tracing::debug!(
        tiles = grid.tiles.len(),
        tile_w = grid.tile[0],
        tile_h = grid.tile[1],
        overlap_x = grid.overlap_factor[0],
        overlap_y = grid.overlap_factor[1],
        "{} decode tiling",
        model.module()
    );
    let scale = model.scale_factor();
    let (tiles, mut done) = (grid.tiles.len(), 0);
    run_tiled(&grid, latent, channels, scale, Direction::Decode, |piece, d| {
        let out = model.decode_graph(runner, piece, d, channels, max_compute_bytes)?;
        done += 1;
        on_tile(done, tiles);
        Ok(out)
    })
}

/// Encodes a planar `[channels, H, W]` image (in the model's [`ImageRange`]); tiles when
/// `tiling.enabled`, with the same tile sizes as decoding. Never retried. Returns the
/// planar output (AutoencoderKL: the moments, see [`crate::LatentDistribution`]; TAESD: the
/// latent) and its channel count.
pub fn encode_tiled(
    model: &dyn FirstStage,
    runner: &mut Runner,
    image: &[f32],
    dims: (usize, usize),
    channels: usize,
    tiling: &TilingParams,
    max_compute_bytes: Option<usize>,
) -> Result<(Vec<f32>, usize)> {
    encode_tiled_observed(model, runner, image, dims, channels, tiling, max_compute_bytes, &mut |_, _| {})
}

/// [`encode_tiled`], calling `on_tile(done, tiles)` after each tile of a tiled run.
#[allow(clippy::too_many_arguments)]
pub fn encode_tiled_observed(
    model: &dyn FirstStage,
    runner: &mut Runner,
    image: &[f32],
    dims: (usize, usize),
    channels: usize,
    tiling: &TilingParams,
    max_compute_bytes: Option<usize>,
    on_tile: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<f32>, usize)> {
    let scale = model.scale_factor();
    if !tiling.enabled {
        return model.encode_graph(runner, image, [dims.0, dims.1], channels, max_compute_bytes);
    }
    if !dims.0.is_multiple_of(scale) || !dims.1.is_multiple_of(scale) {
        return Err(VaeError::input(
            model.module(),
            format!("cannot tile-encode a {}x{} image: sides must be multiples of {scale}", dims.0, dims.1),
        ));
    }
    let small = [dims.0 / scale, dims.1 / scale];
    let grid = tiling.grid(small, scale)?;
    if grid.is_single() {
        return model.encode_graph(runner, image, [dims.0, dims.1], channels, max_compute_bytes);
    }
    let mut out_channels = 0;
    let (tiles, mut done) = (grid.tiles.len(), 0);
    let out = run_tiled(&grid, image, channels, scale, Direction::Encode, |piece, d| {
        let r = model.encode_graph(runner, piece, d, channels, max_compute_bytes)?;
        out_channels = r.1;
        done += 1;
        on_tile(done, tiles);
        Ok(r)
    })?;
    Ok((out, out_channels))
}
