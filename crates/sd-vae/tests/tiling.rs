//! The tiling rules of stable-diffusion.cpp's `docs/performance.md` ("Use VAE tiling ..."), one sentence per case,
//! on the pure logic and on the decode/encode drivers with a stand-in model.

mod common;

use std::cell::RefCell;

use sd_sched::Runner;
use sd_vae::tiling::{calc_tiles, edge_factor, merge_tile, retry_tile_size, smootherstep, tile_grid, Tile};
use sd_vae::{
    decode_tiled, decode_tiled_observed, encode_tiled, encode_tiled_observed, FirstStage, ImageRange, TilingOption,
    TilingParams, VaeError,
};

fn params(size: Option<&str>, overlap: Option<&str>, rel: Option<&str>) -> TilingParams {
    TilingParams::from_cli(true, size, overlap, rel).unwrap()
}

fn flag_of(e: VaeError) -> TilingOption {
    match e {
        VaeError::Tiling { option, .. } | VaeError::TilingOff { option } => option,
        other => panic!("expected a tiling option error, got {other}"),
    }
}

// ---------------------------------------------------------------- tile sizes

#[test]
fn default_tile_is_256_image_pixels_whatever_the_scale() {
    // "The default tile size is 256x256 **image pixels**, independent of the VAE scale factor"
    // "A 256-pixel tile corresponds to 32 latent pixels for an 8x VAE, 16 for a 16x VAE, and 8 for a 32x VAE."
    let p = params(None, None, None);
    assert_eq!(p.tile_size_latent([100, 100], 8).unwrap(), [32, 32]);
    assert_eq!(p.tile_size_latent([100, 100], 16).unwrap(), [16, 16]);
    assert_eq!(p.tile_size_latent([100, 100], 32).unwrap(), [8, 8]);
}

#[test]
fn tile_size_is_one_size_or_width_x_height() {
    // "`--vae-tile-size` accepts one size or `WIDTHxHEIGHT`."
    assert_eq!(params(Some("320"), None, None).tile_size, [320, 320]);
    assert_eq!(params(Some("320x192"), None, None).tile_size, [320, 192]);
    assert_eq!(params(Some("320x192"), None, None).tile_size_latent([100, 100], 8).unwrap(), [40, 24]);
}

#[test]
fn zero_dimension_uses_the_default() {
    // "A zero dimension uses the 256-pixel default."
    assert_eq!(params(Some("0x320"), None, None).tile_size_latent([100, 100], 8).unwrap(), [32, 40]);
    assert_eq!(params(Some("0"), None, None).tile_size_latent([100, 100], 8).unwrap(), [32, 32]);
}

#[test]
fn sizes_round_down_to_the_scale_factor_and_cap_at_the_input() {
    // "Sizes are rounded down to a multiple of the VAE scale factor and capped at the current input dimensions."
    assert_eq!(params(Some("300x263"), None, None).tile_size_latent([100, 100], 8).unwrap(), [37, 32]);
    assert_eq!(params(Some("1024"), None, None).tile_size_latent([40, 48], 8).unwrap(), [40, 48]);
    // The default is capped too.
    assert_eq!(params(None, None, None).tile_size_latent([20, 48], 8).unwrap(), [20, 32]);
}

#[test]
fn explicit_sizes_below_four_latent_pixels_are_rejected() {
    // "Explicit sizes below four latent pixels per axis (or the full axis when it is smaller) are rejected."
    for s in ["24", "31", "8x256", "256x16"] {
        let e = params(Some(s), None, None).tile_size_latent([64, 64], 8).unwrap_err();
        assert_eq!(flag_of(e), TilingOption::TileSize, "{s}");
    }
    assert_eq!(params(Some("32"), None, None).tile_size_latent([64, 64], 8).unwrap(), [4, 4]);
    // A 3-latent-pixel axis accepts a 3-pixel tile (the full axis) but not 2.
    assert_eq!(params(Some("24"), None, None).tile_size_latent([3, 3], 8).unwrap(), [3, 3]);
    assert_eq!(
        flag_of(params(Some("16"), None, None).tile_size_latent([3, 3], 8).unwrap_err()),
        TilingOption::TileSize
    );
    // The check can run before any work, on the image size.
    assert_eq!(flag_of(params(Some("24"), None, None).validate([512, 512], 8).unwrap_err()), TilingOption::TileSize);
    assert!(params(Some("24"), None, None).validate([24, 24], 8).is_ok());
    assert!(TilingParams::default().validate([512, 512], 8).is_ok());
}

#[test]
fn encoding_and_decoding_use_the_same_sizes() {
    // "Encoding and decoding use the same spatial sizes, without an additional encoding multiplier."
    let p = params(Some("128"), Some("0.25"), None);
    let (dec, enc) = (Fake::new(usize::MAX), Fake::new(usize::MAX));
    let mut runner = common::cpu_runner("fake");
    decode_tiled(&dec, &mut runner, &latent(40, 24), (40, 24), 4, &p, None).unwrap();
    encode_tiled(&enc, &mut runner, &image(320, 192), (320, 192), 3, &p, None).unwrap();
    let d = dec.calls.borrow().clone();
    let e: Vec<[usize; 2]> = enc.calls.borrow().iter().map(|c| [c[0] / 8, c[1] / 8]).collect();
    assert_eq!(d, e);
    assert!(d.iter().all(|c| *c == [16, 16]), "{d:?}");
}

#[test]
fn inputs_that_fit_are_one_tile() {
    // "Inputs that fit within a tile are processed as one tile."
    let g = params(None, None, None).grid([32, 24], 8).unwrap();
    assert!(g.is_single());
    assert_eq!(g.tiles, vec![Tile { x: 0, y: 0, skip_x: 0, skip_y: 0 }]);
    let fake = Fake::new(usize::MAX);
    let mut runner = common::cpu_runner("fake");
    decode_tiled(&fake, &mut runner, &latent(32, 24), (32, 24), 4, &params(None, None, None), None).unwrap();
    assert_eq!(*fake.calls.borrow(), vec![[32, 24]]);
}

#[test]
fn a_512_image_with_defaults_is_3x3_tiles_both_ways() {
    // "For a 512x512 image with the default 50% overlap, both encoding and decoding use 3x3 tiles."
    let p = params(None, None, None);
    let g = p.grid([64, 64], 8).unwrap();
    assert_eq!(g.num_tiles, [3, 3]);
    assert_eq!(g.tiles.len(), 9);
    assert_eq!(g.overlap, [16, 16]);
    let (dec, enc) = (Fake::new(usize::MAX), Fake::new(usize::MAX));
    let mut runner = common::cpu_runner("fake");
    decode_tiled(&dec, &mut runner, &latent(64, 64), (64, 64), 4, &p, None).unwrap();
    encode_tiled(&enc, &mut runner, &image(512, 512), (512, 512), 3, &p, None).unwrap();
    assert_eq!(dec.calls.borrow().len(), 9);
    assert_eq!(enc.calls.borrow().len(), 9);
    assert!(enc.calls.borrow().iter().all(|c| *c == [256, 256]));
}

#[test]
fn relative_sizes_fraction_or_tile_count() {
    // "Values up to and including 1 specify a fraction of the current input size; values greater
    // than 1 specify a target number of tiles per axis, accounting for overlap. For example,
    // `0.5x0.5` uses half the width and height in both encode and decode."
    let half = params(None, None, Some("0.5x0.5"));
    assert_eq!(half.tile_size_latent([64, 48], 8).unwrap(), [32, 24]);
    assert_eq!(params(None, None, Some("1")).tile_size_latent([64, 48], 8).unwrap(), [64, 48]);
    // 3 tiles with 50% overlap: tile = 1 / (3 - 3 * 0.5 + 0.5) = half the axis, and the grid has 3 tiles.
    let three = params(None, None, Some("3"));
    assert_eq!(three.tile_size_latent([64, 64], 8).unwrap(), [32, 32]);
    assert_eq!(three.grid([64, 64], 8).unwrap().num_tiles, [3, 3]);
    // 2 tiles without overlap: half the axis each.
    let two = params(None, Some("0"), Some("2x4"));
    let g = two.grid([64, 64], 8).unwrap();
    assert_eq!(g.tile, [32, 16]);
    assert_eq!(g.num_tiles, [2, 4]);
    // "overrides the absolute size on each axis"
    assert_eq!(params(Some("128"), None, Some("0.5")).tile_size_latent([64, 64], 8).unwrap(), [32, 32]);
    // 0 on an axis leaves the absolute size there.
    assert_eq!(params(Some("128"), None, Some("0.5x0")).tile_size_latent([64, 64], 8).unwrap(), [32, 16]);
}

#[test]
fn overlap_is_clamped_and_adjusted_to_fit() {
    // "The target overlap is clamped to 0 through 0.5 and the actual overlap is adjusted to fit the image."
    assert_eq!(params(None, Some("0.9"), None).overlap(), 0.5);
    assert_eq!(params(None, Some("1"), None).overlap(), 0.5);
    // Issue 11: what is no fraction of a tile is refused, not clamped.
    for bad in ["-1", "5", "NaN", "inf"] {
        assert_eq!(flag_of(TilingParams::from_cli(true, None, Some(bad), None).unwrap_err()), TilingOption::Overlap);
    }
    // 70 latent pixels, 32-pixel tiles, target 0.5: 3 tiles with (32*3 - 70) / (32*2) = 0.40625.
    let (n, f) = calc_tiles(70, 32, 0.5);
    assert_eq!((n, f), (3, 0.40625));
    let g = tile_grid([70, 70], [32, 32], 0.5);
    assert_eq!(g.overlap, [13, 13]);
    let xs: Vec<usize> = g.tiles.iter().filter(|t| t.y == 0).map(|t| t.x).collect();
    assert_eq!(xs, vec![0, 19, 38]);
}

#[test]
fn size_and_overlap_options_require_vae_tiling() {
    // "Size and overlap options require `--vae-tiling`."
    let e = TilingParams::from_cli(false, Some("256"), None, None).unwrap_err();
    assert_eq!(flag_of(e), TilingOption::TileSize);
    let e = TilingParams::from_cli(false, None, Some("0.25"), None).unwrap_err();
    assert_eq!(flag_of(e), TilingOption::Overlap);
    let e = TilingParams::from_cli(false, None, None, Some("0.5")).unwrap_err();
    assert_eq!(flag_of(e), TilingOption::RelativeSize);
    assert_eq!(TilingParams::from_cli(false, None, None, None).unwrap(), TilingParams::default());
}

#[test]
fn bad_values_name_their_flag() {
    for (size, overlap, rel, flag) in [
        (Some("abc"), None, None, TilingOption::TileSize),
        (Some("-32"), None, None, TilingOption::TileSize),
        (Some("32x"), None, None, TilingOption::TileSize),
        (Some("32x32x32"), None, None, TilingOption::TileSize),
        (None, Some("half"), None, TilingOption::Overlap),
        (None, Some("nan"), None, TilingOption::Overlap),
        (None, None, Some("-0.5"), TilingOption::RelativeSize),
        (None, None, Some("inf"), TilingOption::RelativeSize),
        (None, None, Some("x"), TilingOption::RelativeSize),
    ] {
        let e = TilingParams::from_cli(true, size, overlap, rel).unwrap_err();
        let msg = e.to_string();
        assert_eq!(flag_of(e), flag, "{msg}");
        assert!(msg.starts_with(flag.name()), "{msg}");
    }
}

// ---------------------------------------------------------------- grid and blending

/// Every output pixel is covered and the blend weights of all tiles sum to 1, for many
/// input and tile sizes: blending never darkens or brightens a flat image.
#[test]
fn blend_weights_sum_to_one_over_every_grid() {
    for small in [5usize, 17, 32, 33, 40, 47, 64, 70, 96, 127] {
        for tile in [4usize, 7, 16, 24, 32, 33] {
            for overlap in [0.0f32, 0.25, 0.4, 0.5] {
                let tile = tile.min(small);
                let g = tile_grid([small, 9.max(small / 2)], [tile, tile.min(9.max(small / 2))], overlap);
                for scale in [1usize, 8] {
                    let out_dims = [g.small[0] * scale, g.small[1] * scale];
                    let tdims = [g.tile[0] * scale, g.tile[1] * scale];
                    let mut acc = vec![0.0f32; out_dims[0] * out_dims[1]];
                    let ones = vec![1.0f32; tdims[0] * tdims[1]];
                    for t in &g.tiles {
                        merge_tile(
                            &mut acc,
                            out_dims,
                            &ones,
                            tdims,
                            1,
                            [t.x * scale, t.y * scale],
                            [g.overlap[0] * scale, g.overlap[1] * scale],
                            [t.skip_x * scale, t.skip_y * scale],
                        );
                    }
                    let worst = acc.iter().map(|v| (v - 1.0).abs()).fold(0.0f32, f32::max);
                    assert!(worst < 1e-5, "small {small} tile {tile} overlap {overlap} scale {scale}: off by {worst}");
                }
            }
        }
    }
}

#[test]
fn smootherstep_is_the_quintic() {
    for i in 0..=100 {
        let x = i as f64 / 100.0;
        let want = 6.0 * x.powi(5) - 15.0 * x.powi(4) + 10.0 * x.powi(3);
        assert!((smootherstep(x as f32) as f64 - want).abs() < 1e-6, "{x}");
    }
    assert_eq!(smootherstep(0.0), 0.0);
    assert_eq!(smootherstep(1.0), 1.0);
}

#[test]
fn blend_weights_of_the_512_grid_by_hand() {
    // 512-pixel image, tiles of 256 pixels every 128: pixel 200 lies in tile 0 (falling
    // edge: (256 - 200) / 128) and tile 1 (rising edge: (200 - 128) / 128).
    let f0 = edge_factor(200, 256, 0, 512, 128, 0);
    let f1 = edge_factor(200 - 128, 256, 128, 512, 128, 0);
    assert_eq!(f0, 56.0 / 128.0);
    assert_eq!(f1, 72.0 / 128.0);
    let s = |x: f64| 6.0 * x.powi(5) - 15.0 * x.powi(4) + 10.0 * x.powi(3);
    assert!((smootherstep(f0) as f64 - s(56.0 / 128.0)).abs() < 1e-6);
    // At the image border a tile keeps full weight; in the interior too.
    assert_eq!(edge_factor(10, 256, 0, 512, 128, 0), 1.0);
    assert_eq!(edge_factor(250, 256, 256, 512, 128, 0), 1.0);
}

#[test]
fn without_overlap_tiles_are_written_not_added() {
    let mut out = vec![5.0f32; 4 * 2];
    merge_tile(&mut out, [4, 2], &[1.0, 2.0, 3.0, 4.0], [2, 2], 1, [2, 0], [0, 0], [0, 0]);
    assert_eq!(out, vec![5.0, 5.0, 1.0, 2.0, 5.0, 5.0, 3.0, 4.0]);
}

#[test]
fn last_tile_is_moved_back_and_skips_covered_columns() {
    // 64 latent pixels, 24-pixel tiles, target 0.5: 4 tiles, overlap 10, step 14; the last
    // would start at 42 and is moved back to 40, skipping the 2 columns before 42.
    let g = tile_grid([64, 24], [24, 24], 0.5);
    assert_eq!(g.overlap[0], 10);
    let row: Vec<(usize, usize)> = g.tiles.iter().map(|t| (t.x, t.skip_x)).collect();
    assert_eq!(row, vec![(0, 0), (14, 0), (28, 0), (40, 2)]);
}

// ---------------------------------------------------------------- retry rule

#[test]
fn retries_start_at_256_pixels_and_halve_to_the_minimum() {
    // "spatial retries use at most 256-pixel tiles initially and then halve the effective
    // tile dimensions down to the minimum size. Each spatial retry must reduce the effective tile size."
    let mut seq = vec![];
    let mut cur = [128, 128];
    let mut first = true;
    while let Some(n) = retry_tile_size(cur, [128, 128], 8, first) {
        seq.push(n);
        cur = n;
        first = false;
    }
    assert_eq!(seq, vec![[32, 32], [16, 16], [8, 8], [4, 4]]);
    // A failed 256-pixel attempt must shrink on the first retry too.
    assert_eq!(retry_tile_size([32, 32], [32, 32], 8, true), Some([16, 16]));
    // Non-square: each axis halves to its own minimum.
    assert_eq!(retry_tile_size([64, 24], [64, 24], 8, true), Some([32, 24]));
    assert_eq!(retry_tile_size([8, 6], [64, 24], 8, false), Some([4, 4]));
    assert_eq!(retry_tile_size([4, 4], [64, 24], 8, false), None);
    // A tiny input cannot go below its own size.
    assert_eq!(retry_tile_size([3, 3], [3, 3], 8, true), None);
}

#[test]
fn decode_retries_allocation_failures_even_without_tiling() {
    // "The main VAE decode path retries allocation failures with smaller tiles, even without `--vae-tiling`."
    let fake = Fake::new(16 * 16);
    let mut runner = common::cpu_runner("fake");
    let p = TilingParams::default();
    let before = p.clone();
    let lat = latent(64, 48);
    let out = decode_tiled(&fake, &mut runner, &lat, (64, 48), 4, &p, None).unwrap();
    let calls = fake.calls.borrow().clone();
    assert_eq!(calls[0], [64, 48], "the first attempt is one graph");
    assert_eq!(calls[1], [32, 32], "then at most 256-pixel tiles");
    assert!(calls[2..].iter().all(|c| *c == [16, 16]), "then half: {calls:?}");
    // "These runtime adjustments do not change the caller's parameters."
    assert_eq!(p, before);
    // Blended tiles of a pointwise model give the untiled answer.
    let (want, _) = fake.upsample(&lat, [64, 48]);
    let worst = out.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "{worst}");
}

#[test]
fn decode_gives_up_when_no_smaller_tile_exists() {
    let fake = Fake::new(3 * 3);
    let mut runner = common::cpu_runner("fake");
    let e = decode_tiled(&fake, &mut runner, &latent(16, 16), (16, 16), 4, &TilingParams::default(), None).unwrap_err();
    assert!(e.is_alloc());
    let calls = fake.calls.borrow().clone();
    assert_eq!(calls.iter().map(|c| c[0]).collect::<Vec<_>>(), vec![16, 8, 4], "{calls:?}");
}

#[test]
fn execution_failures_and_encoding_are_not_retried() {
    // "Execution failures are not retried, and encoding has no automatic OOM retry."
    let mut fake = Fake::new(usize::MAX);
    fake.fail_compute = true;
    let mut runner = common::cpu_runner("fake");
    let e = decode_tiled(&fake, &mut runner, &latent(64, 64), (64, 64), 4, &TilingParams::default(), None).unwrap_err();
    assert!(matches!(e, VaeError::Compute { .. }));
    assert_eq!(fake.calls.borrow().len(), 1);

    let fake = Fake::new(16 * 16);
    let e =
        encode_tiled(&fake, &mut runner, &image(256, 256), (256, 256), 3, &TilingParams::default(), None).unwrap_err();
    assert!(e.is_alloc());
    assert_eq!(fake.calls.borrow().len(), 1);
}

#[test]
fn tiled_runs_report_each_tile_and_retries_count_again() {
    let mut runner = common::cpu_runner("fake");
    // The (done, tiles) reports of one decode of a `w x h` latent.
    let mut decode = |fake: &Fake, (w, h): (usize, usize), p: &TilingParams| {
        let mut seen = Vec::new();
        decode_tiled_observed(fake, &mut runner, &latent(w, h), (w, h), 4, p, None, &mut |d, n| seen.push((d, n)))
            .unwrap();
        seen
    };
    let count_to = |n: usize| (1..=n).map(|d| (d, n)).collect::<Vec<_>>();
    // 512x512 with the default tiles: 3x3 tiles, reported 1..=9 of 9, in both directions.
    let p = params(None, None, None);
    assert_eq!(decode(&Fake::new(usize::MAX), (64, 64), &p), count_to(9));
    // Untiled: nothing to report.
    assert_eq!(decode(&Fake::new(usize::MAX), (32, 24), &TilingParams::default()), vec![]);
    // An allocation retry reports its own grid's tiles: the whole latent and one 32x32
    // tile failed, then every 16x16 tile succeeded.
    let retried = Fake::new(16 * 16);
    let seen = decode(&retried, (64, 48), &TilingParams::default());
    let n = retried.calls.borrow().iter().filter(|c| **c == [16, 16]).count();
    assert!(n > 1);
    assert_eq!(seen, count_to(n));
    let mut seen = Vec::new();
    let enc = Fake::new(usize::MAX);
    encode_tiled_observed(&enc, &mut runner, &image(512, 512), (512, 512), 3, &p, None, &mut |d, n| seen.push((d, n)))
        .unwrap();
    assert_eq!(seen, count_to(9));
}

// ---------------------------------------------------------------- stand-in model

fn latent(w: usize, h: usize) -> Vec<f32> {
    common::uniform(4 * w * h, 7)
}

fn image(w: usize, h: usize) -> Vec<f32> {
    common::uniform(3 * w * h, 9)
}

/// A pointwise "autoencoder": decode is nearest x8 of the first 3 channels, encode is the
/// 8x8 mean plus a fourth channel. Fails allocation above `limit` latent pixels per call.
struct Fake {
    limit: usize,
    fail_compute: bool,
    calls: RefCell<Vec<[usize; 2]>>,
}

impl Fake {
    fn new(limit: usize) -> Self {
        Self { limit, fail_compute: false, calls: RefCell::new(vec![]) }
    }

    fn upsample(&self, latent: &[f32], d: [usize; 2]) -> (Vec<f32>, usize) {
        let (w, h) = (d[0] * 8, d[1] * 8);
        let mut out = vec![0.0; 3 * w * h];
        for c in 0..3 {
            for y in 0..h {
                for x in 0..w {
                    out[(c * h + y) * w + x] = latent[(c * d[1] + y / 8) * d[0] + x / 8];
                }
            }
        }
        (out, 3)
    }

    fn failure(&self, area: usize) -> Option<VaeError> {
        if self.fail_compute {
            return Some(VaeError::Compute { module: "fake", source: sd_sched::SchedError::MissingTensor("x".into()) });
        }
        (area > self.limit).then(|| VaeError::Alloc {
            device: "CPU".into(),
            module: "fake",
            bytes: area,
            cap: Some(self.limit),
        })
    }
}

impl FirstStage for Fake {
    fn module(&self) -> &'static str {
        "fake"
    }
    fn scale_factor(&self) -> usize {
        8
    }
    fn latent_channels(&self) -> usize {
        4
    }
    fn image_channels(&self) -> usize {
        3
    }
    fn image_range(&self) -> ImageRange {
        ImageRange::MinusOneToOne
    }
    fn diffusion_to_vae(&self, _: &mut [f32]) {}
    fn vae_to_diffusion(&self, _: &mut [f32]) {}
    fn decode_graph(
        &self,
        _: &mut Runner,
        latent: &[f32],
        dims: [usize; 2],
        _: usize,
        _: Option<usize>,
    ) -> sd_vae::Result<(Vec<f32>, usize)> {
        self.calls.borrow_mut().push(dims);
        if let Some(e) = self.failure(dims[0] * dims[1]) {
            return Err(e);
        }
        Ok(self.upsample(latent, dims))
    }
    fn encode_graph(
        &self,
        _: &mut Runner,
        image: &[f32],
        dims: [usize; 2],
        _: usize,
        _: Option<usize>,
    ) -> sd_vae::Result<(Vec<f32>, usize)> {
        self.calls.borrow_mut().push(dims);
        if let Some(e) = self.failure(dims[0] * dims[1] / 64) {
            return Err(e);
        }
        let (w, h) = (dims[0] / 8, dims[1] / 8);
        let mut out = vec![0.0; 4 * w * h];
        for c in 0..3 {
            for y in 0..dims[1] {
                for x in 0..dims[0] {
                    out[(c * h + y / 8) * w + x / 8] += image[(c * dims[1] + y) * dims[0] + x] / 64.0;
                }
            }
        }
        Ok((out, 4))
    }
}

#[test]
fn tiled_encoding_of_a_pointwise_model_matches_untiled() {
    let fake = Fake::new(usize::MAX);
    let mut runner = common::cpu_runner("fake");
    let img = image(512, 384);
    let (whole, c) = encode_tiled(&fake, &mut runner, &img, (512, 384), 3, &TilingParams::default(), None).unwrap();
    let (tiled, c2) =
        encode_tiled(&fake, &mut runner, &img, (512, 384), 3, &params(Some("128"), Some("0.3"), None), None).unwrap();
    assert_eq!((c, c2), (4, 4));
    assert!(fake.calls.borrow().len() > 2);
    let worst = whole.iter().zip(&tiled).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "{worst}");
}
