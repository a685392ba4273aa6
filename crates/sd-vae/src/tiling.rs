//! VAE tiling as pure logic: the flags, the tile size, the tile grid, the blend weights, the retry sizes.
//!
//! Design: everything here is arithmetic on sizes and plain `f32` buffers, with no
//! ggml type, so each rule of `performance.md` ("Use VAE tiling ...") is a unit
//! test. The graph half lives in [`crate::run`]: it hands each tile to a model's
//! single-graph decode or encode and merges the results with [`merge_tile`].
//!
//! Units: the user speaks in **image pixels** (`--vae-tile-size 256x256`); the grid
//! is laid out on the **latent** ("small") side, as stable-diffusion.cpp lays it out,
//! so a 256-pixel tile is 32 latent pixels for an 8x VAE. Buffers are planar
//! (`[planes][height][width]`, ggml's `[W, H, C]`).
//!
//! The grid and the blend mirror stable-diffusion.cpp's `sd_tiling_calc_tiles`,
//! `process_tiles_2d` and `sd_tensor_merge_2d` (non-circular axes): the same integer
//! and `f32` arithmetic, so tile positions and blend weights agree to the bit.

use crate::error::{Result, VaeError};

/// Default tile edge in image pixels ("The default tile size is 256x256 image pixels").
const DEFAULT_TILE_PIXELS: usize = 256;
/// Smallest explicit tile edge in latent pixels ("below four latent pixels per axis ... are rejected").
const MIN_TILE_LATENT: usize = 4;
/// Default target overlap, as a fraction of the tile (`--vae-tile-overlap 0.5`).
const DEFAULT_OVERLAP: f32 = 0.5;

/// The tiling flags, as the user gave them.
///
/// These are never changed by the runtime: the allocation-failure retry of the decode
/// path works on its own copy of the sizes ("These runtime adjustments do not change
/// the caller's parameters").
#[derive(Clone, Debug, PartialEq)]
pub struct TilingParams {
    /// `--vae-tiling`: tile both encoding and decoding.
    pub enabled: bool,
    /// `--vae-tile-size` in image pixels, `[width, height]`; 0 means the 256-pixel default.
    pub tile_size: [usize; 2],
    /// `--vae-tile-overlap`, a fraction of the tile; clamped to `[0, 0.5]` when used.
    pub target_overlap: f32,
    /// `--vae-relative-tile-size`, `[width, height]`; 0 on an axis means "not set"
    /// (the absolute size applies there). `<= 1`: fraction of the input; `> 1`: tiles per axis.
    pub rel_size: [f32; 2],
}

impl Default for TilingParams {
    fn default() -> Self {
        Self { enabled: false, tile_size: [0, 0], target_overlap: DEFAULT_OVERLAP, rel_size: [0.0, 0.0] }
    }
}

/// A tiling option, for errors (the reference's flags: `--vae-tile-size`,
/// `--vae-tile-overlap`, `--vae-relative-tile-size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TilingOption {
    /// The tile size in image pixels.
    TileSize,
    /// The overlap, a fraction of the tile.
    Overlap,
    /// The tile size relative to the input.
    RelativeSize,
}

impl TilingOption {
    /// The option's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            TilingOption::TileSize => "VAE tile size",
            TilingOption::Overlap => "VAE tile overlap",
            TilingOption::RelativeSize => "relative VAE tile size",
        }
    }
}

impl TilingParams {
    /// Parses the command-line values. `enabled` is `--vae-tiling`; the others are the
    /// raw strings of `--vae-tile-size`, `--vae-tile-overlap` and `--vae-relative-tile-size`
    /// when given. "Size and overlap options require `--vae-tiling`": giving one without it
    /// is an error naming the option ([`VaeError::TilingOff`]).
    pub fn from_cli(
        enabled: bool,
        tile_size: Option<&str>,
        overlap: Option<&str>,
        relative: Option<&str>,
    ) -> Result<Self> {
        for (option, value) in [
            (TilingOption::TileSize, tile_size),
            (TilingOption::Overlap, overlap),
            (TilingOption::RelativeSize, relative),
        ] {
            if value.is_some() && !enabled {
                return Err(VaeError::TilingOff { option });
            }
        }
        let mut p = TilingParams { enabled, ..Default::default() };
        if let Some(s) = tile_size {
            p.tile_size = parse_pair(s, |v| v.parse::<usize>().ok()).ok_or_else(|| {
                VaeError::tiling(
                    TilingOption::TileSize,
                    format!("expected one size or WIDTHxHEIGHT in image pixels (whole numbers, 0 = {DEFAULT_TILE_PIXELS}), got `{s}`"),
                )
            })?;
        }
        if let Some(s) = overlap {
            // A fraction above 0.5 is clamped as documented; a value that is no fraction of a
            // tile at all (`5`, a typo for 0.5 or a percentage; negative; NaN) is refused (issue 11).
            p.target_overlap = s.trim().parse::<f32>().ok().filter(|v| (0.0..=1.0).contains(v)).ok_or_else(|| {
                VaeError::tiling(
                    TilingOption::Overlap,
                    format!("expected a fraction of the tile size from 0 to 1 (clamped to 0.5), got `{s}`"),
                )
            })?;
        }
        if let Some(s) = relative {
            p.rel_size = parse_pair(s, |v| v.parse::<f32>().ok().filter(|f| f.is_finite() && *f >= 0.0)).ok_or_else(|| {
                VaeError::tiling(
                    TilingOption::RelativeSize,
                    format!("expected one positive value or WIDTHxHEIGHT (up to 1: fraction of the input; above 1: tiles per axis), got `{s}`"),
                )
            })?;
        }
        Ok(p)
    }

    /// The overlap actually targeted: "The target overlap is clamped to 0 through 0.5".
    pub fn overlap(&self) -> f32 {
        if self.target_overlap.is_nan() {
            return 0.0;
        }
        self.target_overlap.clamp(0.0, 0.5)
    }

    /// The tile size in latent pixels for an input of `latent` latent pixels (`[w, h]`)
    /// and a VAE that scales by `scale`. The same for encoding and decoding ("Encoding
    /// and decoding use the same spatial sizes, without an additional encoding multiplier").
    pub fn tile_size_latent(&self, latent: [usize; 2], scale: usize) -> Result<[usize; 2]> {
        let scale = scale.max(1);
        let overlap = self.overlap();
        let mut out = [0; 2];
        for (axis, name) in [(0, "width"), (1, "height")] {
            out[axis] = axis_tile(self.tile_size[axis], self.rel_size[axis], latent[axis], scale, overlap, name)?;
        }
        Ok(out)
    }

    /// Checks the sizes against an image of `image` pixels (`[w, h]`) before any work is
    /// done, so a bad `--vae-tile-size` fails before sampling rather than at decode time.
    pub fn validate(&self, image: [usize; 2], scale: usize) -> Result<()> {
        if self.enabled {
            let scale = scale.max(1);
            self.tile_size_latent([image[0] / scale, image[1] / scale], scale)?;
        }
        Ok(())
    }

    /// The grid for an input of `latent` latent pixels.
    pub fn grid(&self, latent: [usize; 2], scale: usize) -> Result<TileGrid> {
        Ok(tile_grid(latent, self.tile_size_latent(latent, scale)?, self.overlap()))
    }
}

/// Splits `a` or `AxB` and parses both halves with `f`; one value is used for both axes.
fn parse_pair<T: Copy>(s: &str, f: impl Fn(&str) -> Option<T>) -> Option<[T; 2]> {
    let s = s.trim();
    match s.split_once('x') {
        Some((a, b)) => Some([f(a.trim())?, f(b.trim())?]),
        None => f(s).map(|v| [v, v]),
    }
}

/// One axis of [`TilingParams::tile_size_latent`].
fn axis_tile(requested_px: usize, rel: f32, len: usize, scale: usize, overlap: f32, axis: &str) -> Result<usize> {
    let len = len.max(1);
    // "(or the full axis when it is smaller)"
    let min = MIN_TILE_LATENT.min(len);
    if rel > 0.0 {
        // "Values up to and including 1 specify a fraction of the current input size;
        // values greater than 1 specify a target number of tiles per axis, accounting for overlap."
        let fraction = if rel > 1.0 { 1.0 / (rel - rel * overlap + overlap) } else { rel };
        let px = ((len * scale) as f32 * fraction).round().max(0.0) as usize;
        // Rounded down to a multiple of the scale factor, within [minimum, input].
        return Ok((px / scale).clamp(min, len));
    }
    let explicit = requested_px != 0;
    // "A zero dimension uses the 256-pixel default."
    let px = if explicit { requested_px } else { DEFAULT_TILE_PIXELS };
    // "Sizes are rounded down to a multiple of the VAE scale factor"
    let tile = px / scale;
    if explicit && tile < min {
        return Err(VaeError::tiling(
            TilingOption::TileSize,
            format!(
                "{requested_px} pixels on the {axis} axis is below the minimum tile of {min} latent pixels ({} image pixels) for this input",
                min * scale
            ),
        ));
    }
    // "and capped at the current input dimensions"
    Ok(tile.min(len))
}

/// One tile of a grid, in latent ("small") units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// Left edge.
    pub x: usize,
    /// Top edge.
    pub y: usize,
    /// Columns at the tile's left that an earlier tile already covers and that this
    /// tile does not write (the last tile of a row is moved back to end at the edge).
    pub skip_x: usize,
    /// Rows at the tile's top likewise.
    pub skip_y: usize,
}

/// The tiles covering an input, with the overlap actually used.
#[derive(Clone, Debug, PartialEq)]
pub struct TileGrid {
    /// Input size in latent pixels `[w, h]`.
    pub small: [usize; 2],
    /// Tile size in latent pixels (at most `small`).
    pub tile: [usize; 2],
    /// Tiles per axis as planned.
    pub num_tiles: [usize; 2],
    /// The overlap factor adjusted to fit the input ("the actual overlap is adjusted to fit the image").
    pub overlap_factor: [f32; 2],
    /// Overlap in latent pixels.
    pub overlap: [usize; 2],
    /// Tiles in processing order (rows top to bottom, each left to right).
    pub tiles: Vec<Tile>,
}

impl TileGrid {
    /// Whether the whole input is one tile ("Inputs that fit within a tile are processed as one tile").
    pub fn is_single(&self) -> bool {
        self.tiles.len() == 1
    }
}

/// How many tiles one axis needs and the overlap factor that makes them fit
/// (stable-diffusion.cpp's `sd_tiling_calc_tiles`, non-circular).
pub fn calc_tiles(small: usize, tile: usize, target_overlap: f32) -> (usize, f32) {
    let (small, tile) = (small as i64, tile as i64);
    let tile_overlap = (tile as f32 * target_overlap) as i64;
    let step = (tile - tile_overlap).max(1);
    let mut num = (small - tile_overlap) / step;
    let overshoot = ((num + 1) * step + tile_overlap) % small.max(1);
    if overshoot != step && overshoot <= num * (tile / 2 - tile_overlap) {
        // The tiles do not fit exactly and one more fits without the overlap exceeding 0.5.
        num += 1;
    }
    let mut factor = (tile * num - small) as f32 / (tile * (num - 1)) as f32;
    if num <= 2 {
        if small <= tile {
            num = 1;
            factor = 0.0;
        } else {
            num = 2;
            factor = (2 * tile - small) as f32 / tile as f32;
        }
    }
    (num.max(1) as usize, factor)
}

/// Lays tiles of `tile` latent pixels over an input of `small` latent pixels with the
/// target overlap (clamped by the caller), the way stable-diffusion.cpp walks them.
pub fn tile_grid(small: [usize; 2], tile: [usize; 2], target_overlap: f32) -> TileGrid {
    let small = [small[0].max(1), small[1].max(1)];
    let tile = [tile[0].clamp(1, small[0]), tile[1].clamp(1, small[1])];
    let mut num_tiles = [0; 2];
    let mut overlap_factor = [0.0; 2];
    let mut overlap = [0; 2];
    let mut step = [0; 2];
    for a in 0..2 {
        let (n, f) = calc_tiles(small[a], tile[a], target_overlap);
        num_tiles[a] = n;
        overlap_factor[a] = f;
        overlap[a] = (tile[a] as f32 * f) as usize;
        step[a] = (tile[a] - overlap[a]).max(1);
    }
    let mut tiles = Vec::with_capacity(num_tiles[0] * num_tiles[1]);
    let mut y = 0;
    let mut last_y = false;
    while y < small[1] && !last_y {
        let mut skip_y = 0;
        if y + tile[1] >= small[1] {
            let original = y;
            y = small[1] - tile[1];
            skip_y = original - y;
            last_y = true;
        }
        let mut x = 0;
        let mut last_x = false;
        while x < small[0] && !last_x {
            let mut skip_x = 0;
            if x + tile[0] >= small[0] {
                let original = x;
                x = small[0] - tile[0];
                skip_x = original - x;
                last_x = true;
            }
            tiles.push(Tile { x, y, skip_x, skip_y });
            x += step[0];
        }
        y += step[1];
    }
    TileGrid { small, tile, num_tiles, overlap_factor, overlap, tiles }
}

/// `6x^5 - 15x^4 + 10x^3` for `x` in `[0, 1]`, evaluated in the reference's order.
pub fn smootherstep(x: f32) -> f32 {
    x * x * x * (x * (6.0 * x - 15.0) + 10.0)
}

/// The ramp position of index `i` of a tile of `size` placed at `origin` on an axis of
/// `full` with `overlap` (all in output units): 1 in the interior, falling linearly to 0
/// over `overlap` at an edge shared with a neighbour, 1 at the image border.
pub fn edge_factor(i: usize, size: usize, origin: usize, full: usize, overlap: usize, skip: usize) -> f32 {
    let rising = if overlap > 0 && origin > 0 { (i as i64 - skip as i64) as f32 / overlap as f32 } else { 1.0 };
    let falling = if overlap > 0 && (origin as i64) < full as i64 - size as i64 {
        (size as i64 - i as i64) as f32 / overlap as f32
    } else {
        1.0
    };
    rising.min(falling).min(1.0)
}

/// Copies the `size` window at `origin` out of a planar buffer of `dims`.
fn split_tile(input: &[f32], dims: [usize; 2], planes: usize, origin: [usize; 2], size: [usize; 2]) -> Vec<f32> {
    let mut out = Vec::with_capacity(size[0] * size[1] * planes);
    for p in 0..planes {
        for iy in 0..size[1] {
            let row = p * dims[0] * dims[1] + (origin[1] + iy) * dims[0] + origin[0];
            out.extend_from_slice(&input[row..row + size[0]]);
        }
    }
    out
}

/// Adds a processed tile into the output (stable-diffusion.cpp's `sd_tensor_merge_2d`):
/// with any overlap, each value is added with weight `S(fy) * S(fx)` (`S` = [`smootherstep`],
/// `f` = [`edge_factor`]); without overlap it is written as is. `skip` leading rows and
/// columns are left alone. All sizes in output units.
#[allow(clippy::too_many_arguments)]
pub fn merge_tile(
    out: &mut [f32],
    out_dims: [usize; 2],
    tile: &[f32],
    tile_dims: [usize; 2],
    planes: usize,
    origin: [usize; 2],
    overlap: [usize; 2],
    skip: [usize; 2],
) {
    let [w, h] = tile_dims;
    let blend = overlap[0] > 0 || overlap[1] > 0;
    for iy in skip[1]..h {
        let sy =
            if blend { smootherstep(edge_factor(iy, h, origin[1], out_dims[1], overlap[1], skip[1])) } else { 1.0 };
        for ix in skip[0]..w {
            let sx =
                if blend { smootherstep(edge_factor(ix, w, origin[0], out_dims[0], overlap[0], skip[0])) } else { 1.0 };
            let src = iy * w + ix;
            let dst = (origin[1] + iy) * out_dims[0] + origin[0] + ix;
            for p in 0..planes {
                let v = tile[p * w * h + src];
                let o = &mut out[p * out_dims[0] * out_dims[1] + dst];
                *o = if blend { *o + v * sy * sx } else { v };
            }
        }
    }
}

/// Which way a tiled run goes: the latent is the small side either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Latent in, image out (`scale` times larger).
    Decode,
    /// Image in, latent out.
    Encode,
}

/// Runs `f` on every tile of `grid` and blends the outputs. `input` is planar with
/// `planes` planes; on the decode side it has the grid's size, on the encode side
/// `scale` times that. `f` gets a tile and its `[w, h]` and returns the processed tile
/// and its plane count.
pub fn run_tiled<F>(
    grid: &TileGrid,
    input: &[f32],
    planes: usize,
    scale: usize,
    dir: Direction,
    mut f: F,
) -> Result<Vec<f32>>
where
    F: FnMut(&[f32], [usize; 2]) -> Result<(Vec<f32>, usize)>,
{
    let (in_mul, out_mul) = match dir {
        Direction::Decode => (1, scale),
        Direction::Encode => (scale, 1),
    };
    let in_dims = [grid.small[0] * in_mul, grid.small[1] * in_mul];
    let out_dims = [grid.small[0] * out_mul, grid.small[1] * out_mul];
    let in_tile = [grid.tile[0] * in_mul, grid.tile[1] * in_mul];
    let out_tile = [grid.tile[0] * out_mul, grid.tile[1] * out_mul];
    let overlap = [grid.overlap[0] * out_mul, grid.overlap[1] * out_mul];
    if input.len() != in_dims[0] * in_dims[1] * planes {
        return Err(VaeError::input(
            "tiling",
            format!("input has {} values, expected {planes}x{}x{}", input.len(), in_dims[1], in_dims[0]),
        ));
    }
    let mut out: Vec<f32> = Vec::new();
    let mut out_planes = 0;
    for (i, t) in grid.tiles.iter().enumerate() {
        let piece = split_tile(input, in_dims, planes, [t.x * in_mul, t.y * in_mul], in_tile);
        let (processed, p) = f(&piece, in_tile)?;
        if processed.len() != p * out_tile[0] * out_tile[1] || (i > 0 && p != out_planes) {
            return Err(VaeError::input(
                "tiling",
                format!(
                    "tile {i} came back with {} values, expected {p}x{}x{}",
                    processed.len(),
                    out_tile[1],
                    out_tile[0]
                ),
            ));
        }
        if i == 0 {
            out_planes = p;
            out = vec![0.0; p * out_dims[0] * out_dims[1]];
        }
        merge_tile(
            &mut out,
            out_dims,
            &processed,
            out_tile,
            p,
            [t.x * out_mul, t.y * out_mul],
            overlap,
            [t.skip_x * out_mul, t.skip_y * out_mul],
        );
        tracing::debug!(tile = i + 1, of = grid.tiles.len(), "vae tile done");
    }
    Ok(out)
}

/// The tile size (latent pixels) of the next spatial retry after an allocation failure
/// with effective tile `current` on an input of `latent`, or `None` when no smaller tile
/// is possible. "spatial retries use at most 256-pixel tiles initially and then halve the
/// effective tile dimensions down to the minimum size. Each spatial retry must reduce the
/// effective tile size."
pub fn retry_tile_size(current: [usize; 2], latent: [usize; 2], scale: usize, first: bool) -> Option<[usize; 2]> {
    let cap = (DEFAULT_TILE_PIXELS / scale.max(1)).max(1);
    let min = |a: usize| MIN_TILE_LATENT.min(latent[a].max(1));
    let current = [current[0].min(latent[0]).max(1), current[1].min(latent[1]).max(1)];
    let halve = |c: [usize; 2]| [0, 1].map(|a| (c[a] / 2).max(min(a)).min(c[a]));
    let mut next = if first { [current[0].min(cap), current[1].min(cap)] } else { halve(current) };
    if next == current {
        next = halve(current);
    }
    (next != current).then_some(next)
}
