//! ESRGAN / Real-ESRGAN (RRDBNet), the `upscaler` module: an image in, the same image 1, 2 or 4 times larger out.
//!
//! Reference: Wang et al., "ESRGAN" (2018) and "Real-ESRGAN" (2021); BasicSR's
//! `basicsr/archs/rrdbnet_arch.py` (XPixelGroup/BasicSR) defines the network, and
//! stable-diffusion.cpp's `src/model/upscaler/esrgan.hpp` and `src/upscaler.cpp` are the graph and
//! the tiling this file matches op by op:
//! * `conv_first` (3x3, in -> F), then `num_block` RRDBs, `conv_body` added to the
//!   features, then per factor 2 a nearest x2 upsampling and a 3x3 conv with leaky ReLU
//!   (`conv_up1`, `conv_up2`), then `conv_hr` + leaky ReLU and `conv_last` (F -> out);
//! * an RRDB is three residual dense blocks (`rdb1..3`) and `0.2 * out + x`; a residual dense
//!   block is five 3x3 convolutions, each of the first four reading the concatenation of
//!   the input and every earlier output (leaky ReLU, slope 0.2) and adding `G` channels,
//!   the fifth back to `F`, then `0.2 * x5 + x`.
//!
//! The configuration is read from the tensors ([`EsrganConfig::from_tensors`]): the block
//! count from the highest `body.N`, the factor from `conv_up2` (4), `conv_up1` (2) or
//! neither (1), the channels from the shapes. The reference reads the block count and
//! the factor the same way and fixes `F = 64`, `G = 32`, 3 channels (RealESRGAN x4plus,
//! 23 blocks, and the anime 6B variant, 6 blocks, both have them); we read them from the
//! shapes, so every file it runs runs here the same, and narrower test models run too.
//! The original ESRGAN layout (`model.0`, `model.1.sub.N.RDBk.convj.0`, ...) is renamed by
//! [`canonical_name`].
//!
//! Images are planar `[3, h, w]` in `[0, 1]`, in and out (the output is not clamped). Large
//! images are tiled ([`Esrgan::upscale`]): tiles of `tile` input pixels with a target overlap
//! of 0.25, blended with the VAE's smootherstep ramps ([`crate::tiling`]); an image that
//! fits one tile is one graph, as in the reference. Convolution kernels are f16, biases f32.

use sd_backends::{BufferType, ScaleMode, Tensor};
use sd_sched::{Runner, TensorSource, TensorSpec, Weights};

use crate::error::{Result, VaeError};
use crate::nn::{Conv2d, Fwd, GraphOptions};
use crate::run::run_graph;
use crate::tiling::{run_tiled, tile_grid, Direction};

/// The module's name in errors, plans and reports.
pub const MODULE: &str = "upscaler";

/// Leaky ReLU slope of every activation.
const SLOPE: f32 = 0.2;
/// Residual scale of the dense blocks and the RRDBs.
const RESIDUAL: f32 = 0.2;
/// Target overlap of the tiles (the reference's upscaler).
pub(crate) const TILE_OVERLAP: f32 = 0.25;
/// The reference's default tile size in input pixels (`--upscale-tile-size`).
pub const DEFAULT_TILE: usize = 128;
/// The smallest tile an allocation retry goes down to.
const MIN_TILE: usize = 16;

/// RRDBNet's hyper-parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EsrganConfig {
    /// Upscaling factor: 1, 2 or 4.
    pub scale: usize,
    /// RRDBs in the body.
    pub num_block: usize,
    /// Image channels in.
    pub in_ch: usize,
    /// Image channels out.
    pub out_ch: usize,
    /// Feature channels `F`.
    pub num_feat: usize,
    /// Growth channels `G` of the dense blocks.
    pub num_grow_ch: usize,
}

impl EsrganConfig {
    /// RealESRGAN_x4plus (and the original ESRGAN x4): 23 blocks, F 64, G 32.
    pub fn x4plus() -> Self {
        Self { scale: 4, num_block: 23, in_ch: 3, out_ch: 3, num_feat: 64, num_grow_ch: 32 }
    }

    /// Reads the configuration from a file's tensors: `names` lists every tensor (after
    /// [`canonical_name`]), `ne_of` gives a tensor's shape in ggml order (`[kw, kh, in, out]`
    /// for a convolution). Every tensor the network reads is then checked to exist with its
    /// shape, so a file that is not an ESRGAN model, or a damaged one, is refused here with
    /// the tensor named, before anything is loaded.
    pub fn from_tensors<'a>(
        names: impl IntoIterator<Item = &'a str>,
        ne_of: impl Fn(&str) -> Option<Vec<u64>>,
    ) -> Result<Self> {
        let conv = |name: &str| -> Result<[usize; 4]> {
            let ne = ne_of(name)
                .ok_or_else(|| VaeError::upscaler(name, "missing: the file is not an ESRGAN (RRDBNet) model"))?;
            match ne[..] {
                [3, 3, i, o] if i > 0 && o > 0 => Ok([3, 3, i as usize, o as usize]),
                _ => {
                    Err(VaeError::upscaler(name, format!("has shape {ne:?} (ggml order), expected a 3x3 convolution")))
                }
            }
        };
        let first = conv("conv_first.weight")?;
        let num_block = names
            .into_iter()
            .filter_map(|n| n.strip_prefix("body.")?.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |m| m + 1);
        if num_block == 0 {
            return Err(VaeError::upscaler("body.0.rdb1.conv1.weight", "missing: the file has no RRDB blocks"));
        }
        let grow = conv("body.0.rdb1.conv1.weight")?[3];
        let last = conv("conv_last.weight")?;
        let (up1, up2) = (ne_of("conv_up1.weight").is_some(), ne_of("conv_up2.weight").is_some());
        let scale = match (up1, up2) {
            (true, true) => 4,
            (true, false) => 2,
            (false, false) => 1,
            (false, true) => {
                return Err(VaeError::upscaler("conv_up1.weight", "missing while conv_up2.weight is present"));
            }
        };
        let cfg = Self { scale, num_block, in_ch: first[2], out_ch: last[3], num_feat: first[3], num_grow_ch: grow };
        for s in esrgan_specs(&cfg) {
            let want: Vec<u64> = s.ne.iter().map(|&n| n as u64).collect();
            match ne_of(&s.name) {
                None => return Err(VaeError::upscaler(&s.name, "missing")),
                Some(ne) if strip_ones(&ne) != strip_ones(&want) => {
                    return Err(VaeError::upscaler(
                        &s.name,
                        format!("has shape {ne:?} (ggml order), expected {want:?} for {}", cfg.describe()),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(cfg)
    }

    /// `x4, 23 blocks, 64 features, growth 32`, for messages.
    pub fn describe(&self) -> String {
        format!(
            "ESRGAN x{}, {} blocks, {} features, growth {}, {} -> {} channels",
            self.scale, self.num_block, self.num_feat, self.num_grow_ch, self.in_ch, self.out_ch
        )
    }
}

fn strip_ones(ne: &[u64]) -> Vec<u64> {
    ne.iter().copied().filter(|&n| n != 1).collect()
}

/// The RRDBNet name of a tensor stored in the original ESRGAN layout (a `Sequential`:
/// `model.0` the first conv, `model.1.sub.N.RDBk.convj.0` the blocks, `model.1.sub.<last>`
/// the body conv, then the learned layers at the indices of the x1, x2 and x4 layouts);
/// other names are returned as they are.
pub fn canonical_name(original: &str) -> String {
    let Some(rest) = original.strip_prefix("model.") else { return original.to_string() };
    let (index, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let layer = match index {
        "0" => "conv_first",
        "1" => return body_name(tail).unwrap_or_else(|| original.to_string()),
        "2" | "5" | "8" => "conv_hr",
        "3" => "conv_up1",
        "6" => "conv_up2",
        "4" | "7" | "10" => "conv_last",
        _ => return original.to_string(),
    };
    format!("{layer}.{tail}")
}

/// `sub.N.RDBk.convj.0.P` -> `body.N.rdbk.convj.P`; `sub.N.P` -> `conv_body.P`.
fn body_name(tail: &str) -> Option<String> {
    let rest = tail.strip_prefix("sub.")?;
    let (block, rest) = rest.split_once('.')?;
    block.parse::<usize>().ok()?;
    if let Some(rdb) = rest.strip_prefix("RDB") {
        let (k, rest) = rdb.split_once('.')?;
        let (conv, rest) = rest.split_once('.')?;
        let param = rest.strip_prefix("0.")?;
        return Some(format!("body.{block}.rdb{k}.{conv}.{param}"));
    }
    matches!(rest, "weight" | "bias").then(|| format!("conv_body.{rest}"))
}

fn conv(name: impl Into<String>, i: usize, o: usize) -> Conv2d {
    Conv2d::new(name, i, o, 3, 1, 1)
}

fn dense_convs(prefix: &str, cfg: &EsrganConfig) -> [Conv2d; 5] {
    let (f, g) = (cfg.num_feat, cfg.num_grow_ch);
    std::array::from_fn(|j| conv(format!("{prefix}.conv{}", j + 1), f + j * g, if j == 4 { f } else { g }))
}

/// The network's layers, in graph order.
#[derive(Clone, Debug, PartialEq)]
struct Layers {
    first: Conv2d,
    /// `body[i][k]`: block `i`, dense block `k + 1`, its five convolutions.
    body: Vec<[[Conv2d; 5]; 3]>,
    conv_body: Conv2d,
    up: Vec<Conv2d>,
    hr: Conv2d,
    last: Conv2d,
}

impl Layers {
    fn new(cfg: &EsrganConfig) -> Self {
        let f = cfg.num_feat;
        let body = (0..cfg.num_block)
            .map(|i| std::array::from_fn(|k| dense_convs(&format!("body.{i}.rdb{}", k + 1), cfg)))
            .collect();
        let up = match cfg.scale {
            4 => vec![conv("conv_up1", f, f), conv("conv_up2", f, f)],
            2 => vec![conv("conv_up1", f, f)],
            _ => Vec::new(),
        };
        Self {
            first: conv("conv_first", cfg.in_ch, f),
            body,
            conv_body: conv("conv_body", f, f),
            up,
            hr: conv("conv_hr", f, f),
            last: conv("conv_last", f, cfg.out_ch),
        }
    }

    fn convs(&self) -> impl Iterator<Item = &Conv2d> {
        std::iter::once(&self.first)
            .chain(self.body.iter().flatten().flatten())
            .chain([&self.conv_body])
            .chain(&self.up)
            .chain([&self.hr, &self.last])
    }
}

/// RRDBNet's parameters, in graph order.
pub fn esrgan_specs(cfg: &EsrganConfig) -> Vec<TensorSpec> {
    let mut out = Vec::new();
    for c in Layers::new(cfg).convs() {
        c.specs(&mut out);
    }
    out
}

fn lrelu<'g>(f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Tensor<'g> {
    f.ctx.leaky_relu(x, SLOPE, true)
}

/// A residual dense block on `x` (`[W, H, F, 1]`).
fn dense_block<'g>(f: &Fwd<'_, 'g>, convs: &[Conv2d; 5], x: Tensor<'g>) -> Result<Tensor<'g>> {
    let mut cat = x;
    for c in &convs[..4] {
        let y = lrelu(f, c.forward(f, cat)?);
        cat = f.ctx.concat(cat, y, 2);
    }
    let x5 = convs[4].forward(f, cat)?;
    Ok(f.ctx.add(f.ctx.scale(x5, RESIDUAL), x))
}

/// ESRGAN with its weights.
pub struct Esrgan {
    cfg: EsrganConfig,
    layers: Layers,
    weights: Weights,
    opts: GraphOptions,
}

impl std::fmt::Debug for Esrgan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Esrgan").field("cfg", &self.cfg).finish()
    }
}

impl Esrgan {
    /// Declares the parameters of `cfg`, allocates them on `buft` and fills them from `source`.
    pub fn load(cfg: EsrganConfig, source: &dyn TensorSource, buft: BufferType) -> Result<Self> {
        let w = |e| VaeError::Weights { module: MODULE, source: e };
        let mut weights = Weights::new(esrgan_specs(&cfg)).map_err(w)?;
        weights.allocate(buft).map_err(w)?;
        weights.load_from(source).map_err(w)?;
        Self::from_weights(cfg, weights)
    }

    /// Wraps weights declared with [`esrgan_specs`] (placed and filled by the caller).
    pub fn from_weights(cfg: EsrganConfig, weights: Weights) -> Result<Self> {
        if let Some(s) = esrgan_specs(&cfg).into_iter().find(|s| !weights.contains(&s.name)) {
            return Err(VaeError::Weights { module: MODULE, source: sd_sched::SchedError::MissingTensor(s.name) });
        }
        Ok(Self { layers: Layers::new(&cfg), cfg, weights, opts: GraphOptions::default() })
    }

    /// Sets the graph switches (direct convolution).
    pub fn with_options(mut self, opts: GraphOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &EsrganConfig {
        &self.cfg
    }

    /// The parameters the graphs read.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Builds the network on `x` (`[W, H, in, 1]`); returns `[W*s, H*s, out, 1]`.
    pub fn build<'g>(&self, f: &Fwd<'_, 'g>, x: Tensor<'g>) -> Result<Tensor<'g>> {
        let l = &self.layers;
        let feat = l.first.forward(f, x)?;
        let mut body = feat;
        for block in &l.body {
            let mut out = body;
            for rdb in block {
                out = dense_block(f, rdb, out)?;
            }
            body = f.ctx.add(f.ctx.scale(out, RESIDUAL), body);
        }
        let body = l.conv_body.forward(f, body)?;
        let mut feat = f.ctx.add(feat, body);
        for up in &l.up {
            feat = lrelu(f, up.forward(f, f.ctx.upscale(feat, 2, ScaleMode::Nearest))?);
        }
        let hr = lrelu(f, l.hr.forward(f, feat)?);
        l.last.forward(f, hr)
    }

    /// One graph over a planar `[in, h, w]` image of `dims` (`[w, h]`); returns the planar
    /// `[out, h*s, w*s]` output. `max_compute_bytes` caps the compute buffer
    /// ([`VaeError::Alloc`] beyond it).
    pub fn upscale_graph(
        &self,
        runner: &mut Runner,
        image: &[f32],
        dims: [usize; 2],
        max_compute_bytes: Option<usize>,
    ) -> Result<Vec<f32>> {
        let input = [dims[0], dims[1], self.cfg.in_ch];
        run_graph(runner, MODULE, &self.weights, self.opts, image, input, max_compute_bytes, |f, x| self.build(f, x))
            .map(|(v, _)| v)
    }

    /// Upscales a planar `[in, h, w]` image in `[0, 1]` of `dims` (`[w, h]`) to a planar
    /// `[out, h*s, w*s]` one (not clamped), as the reference's upscaler: one graph when
    /// both sides are at most `tile` (or `tile` is 0), else tiles of `tile` pixels blended
    /// over an overlap of about a quarter. When a graph does not fit (the device's budget or
    /// `max_compute_bytes`), the tile is halved and the image done again, down to 16 pixels:
    /// then the allocation error is returned. `on_tile(done, tiles)` follows a tiled run.
    pub fn upscale(
        &self,
        runner: &mut Runner,
        image: &[f32],
        dims: [usize; 2],
        tile: usize,
        max_compute_bytes: Option<usize>,
        on_tile: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        let [w, h] = dims;
        if w == 0 || h == 0 || image.len() != w * h * self.cfg.in_ch {
            return Err(VaeError::input(
                MODULE,
                format!("the image has {} values, expected {}x{h}x{w} (non-empty)", image.len(), self.cfg.in_ch),
            ));
        }
        let mut tile = tile;
        loop {
            let attempt = if tile == 0 || (w <= tile && h <= tile) {
                self.upscale_graph(runner, image, dims, max_compute_bytes)
            } else {
                let grid = tile_grid(dims, [tile, tile], TILE_OVERLAP);
                let (tiles, mut done) = (grid.tiles.len(), 0);
                run_tiled(&grid, image, self.cfg.in_ch, self.cfg.scale, Direction::Decode, |piece, d| {
                    let out = self.upscale_graph(runner, piece, d, max_compute_bytes)?;
                    done += 1;
                    on_tile(done, tiles);
                    Ok((out, self.cfg.out_ch))
                })
            };
            match attempt {
                Err(e) if e.is_alloc() => {
                    let effective = if tile == 0 { w.max(h) } else { tile.min(w.max(h)) };
                    let next = effective / 2;
                    if next < MIN_TILE {
                        return Err(e);
                    }
                    tracing::warn!("{MODULE}: {e}; retrying with {next}x{next} pixel tiles");
                    tile = next;
                }
                other => return other,
            }
        }
    }
}
