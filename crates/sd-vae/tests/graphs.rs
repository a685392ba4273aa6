//! The autoencoder graphs on the real CPU backend: each block against a plain-Rust f64
//! version, whole tiny models against composed references, the real SD 1.x/2.x and
//! TAESD configurations at tiny sizes, and tiled/retried decoding with real graphs.
//!
//! Tolerance: convolutions run ggml's im2col path, which rounds activations to f16 and
//! multiplies by f16 kernels with f32 accumulation. The reference rounds its conv inputs
//! to f16 the same way and accumulates in f64, so the two differ by f32 accumulation
//! error plus the rare activation whose f32 and f64 values round to neighbouring f16
//! numbers (one f16 ulp, 2^-11 relative, diluted by the following sum). We allow
//! 2e-3 of the output's magnitude (a few f16 ulps); a wrong op (missing bias, wrong
//! eps, transposed attention, wrong pad side) is off by far more.

mod common;

use common::reference::{silu, Act, Params};
use common::{cpu_runner, max_diff, uniform, RandomSource};
use sd_backends::GgmlType;
use sd_sched::Runner;
use sd_vae::{
    decode_tiled, encode_tiled, AutoencoderKl, FirstStage, GraphOptions, LatentDistribution, Taesd, TaesdConfig,
    TaesdParts, TilingParams, VaeConfig, VaeLayout, VaeParts,
};

const SRC: RandomSource = RandomSource { seed: 42 };

fn tiny() -> VaeConfig {
    VaeConfig { ch: 32, ch_mult: vec![1, 2], num_res_blocks: 1, ..VaeConfig::sd() }
}

fn load(cfg: VaeConfig, runner: &Runner) -> AutoencoderKl {
    AutoencoderKl::load(cfg, VaeParts::Full, &SRC, runner.backend().device().buffer_type()).unwrap()
}

/// Relative tolerance of whole models (see the module doc).
const WHOLE: f64 = 2e-3;
/// Relative tolerance of single blocks: one f16 rounding of the activations; observed
/// differences are below 2e-5.
const BLOCK: f64 = 1e-4;

fn check(name: &str, got: &[f32], want: &Act) {
    check_tol(name, got, want, WHOLE)
}

fn check_block(name: &str, got: &[f32], want: &Act) {
    check_tol(name, got, want, BLOCK)
}

fn check_tol(name: &str, got: &[f32], want: &Act, rel: f64) {
    let (d, m) = max_diff(got, &want.data);
    let tol = rel * m.max(1.0);
    assert!(d <= tol, "{name}: max diff {d:e} > {tol:e} (max |ref| {m})");
    assert!(got.iter().all(|v| v.is_finite()), "{name}: non-finite output");
}

fn input(c: usize, h: usize, w: usize, seed: u64) -> (Vec<f32>, Act) {
    let v = uniform(c * h * w, seed).into_iter().map(|x| 2.0 * x).collect::<Vec<_>>();
    let a = Act::from_f32(w, h, c, &v);
    (v, a)
}

#[test]
fn each_block_matches_the_f64_reference() {
    let mut runner = cpu_runner("vae");
    let vae = load(tiny(), &runner);
    let p = Params { src: &SRC };
    let pre = "first_stage_model";

    let (x, a) = input(4, 5, 6, 1);
    let (y, d) = vae.run_block(&mut runner, "decoder.conv_in", &x, [6, 5, 4]).unwrap();
    assert_eq!(d, [6, 5, 64]);
    check_block("conv_in", &y, &p.conv(&format!("{pre}.decoder.conv_in"), &a, 64, 3, 1, 1, true));

    let (x, a) = input(32, 4, 5, 2);
    let (y, _) = vae.run_block(&mut runner, "decoder.norm_out", &x, [5, 4, 32]).unwrap();
    check_block("group norm", &y, &p.group_norm(&format!("{pre}.decoder.norm_out"), &a, 32, 1e-6));
    // A tiny variance makes the epsilon visible: 1e-5 instead of 1e-6 would be far off.
    let x: Vec<f32> = x.iter().map(|v| v * 2e-3).collect();
    let a = Act::from_f32(5, 4, 32, &x);
    let (y, _) = vae.run_block(&mut runner, "decoder.norm_out", &x, [5, 4, 32]).unwrap();
    check_block("group norm, small variance", &y, &p.group_norm(&format!("{pre}.decoder.norm_out"), &a, 32, 1e-6));
    let wrong_eps = p.group_norm(&format!("{pre}.decoder.norm_out"), &a, 32, 1e-5);
    assert!(max_diff(&y, &wrong_eps.data).0 > 0.1, "the test would not notice a wrong epsilon");

    let (x, a) = input(64, 6, 5, 3);
    let (y, d) = vae.run_block(&mut runner, "decoder.up.0.block.0", &x, [5, 6, 64]).unwrap();
    assert_eq!(d, [5, 6, 32]);
    check_block("resnet with shortcut", &y, &p.resnet(&format!("{pre}.decoder.up.0.block.0"), &a, 32));

    let (x, a) = input(64, 3, 4, 4);
    let (y, _) = vae.run_block(&mut runner, "decoder.mid.block_1", &x, [4, 3, 64]).unwrap();
    check_block("resnet", &y, &p.resnet(&format!("{pre}.decoder.mid.block_1"), &a, 64));

    let (x, a) = input(64, 4, 3, 5);
    let (y, _) = vae.run_block(&mut runner, "decoder.mid.attn_1", &x, [3, 4, 64]).unwrap();
    check_block("attention", &y, &p.attn(&format!("{pre}.decoder.mid.attn_1"), &a));

    let (x, a) = input(64, 3, 4, 6);
    let (y, d) = vae.run_block(&mut runner, "decoder.up.1.upsample", &x, [4, 3, 64]).unwrap();
    assert_eq!(d, [8, 6, 64]);
    check_block("upsample", &y, &p.upsample(&format!("{pre}.decoder.up.1.upsample"), &a));

    let (x, a) = input(32, 6, 7, 7);
    let (y, d) = vae.run_block(&mut runner, "encoder.down.0.downsample", &x, [7, 6, 32]).unwrap();
    assert_eq!(d, [3, 3, 32]);
    check_block("downsample", &y, &p.downsample(&format!("{pre}.encoder.down.0.downsample"), &a));

    let e = vae.run_block(&mut runner, "decoder.nothing", &x, [7, 6, 32]).unwrap_err();
    assert!(e.to_string().contains("decoder.nothing"), "{e}");
}

/// The whole tiny decoder against the reference composed block by block: checks the
/// wiring (order of levels, channel flow, post_quant_conv first, SiLU before conv_out).
#[test]
fn tiny_decoder_matches_the_composed_reference() {
    let mut runner = cpu_runner("vae");
    let vae = load(tiny(), &runner);
    let p = Params { src: &SRC };
    let d = "first_stage_model.decoder";
    let (z, za) = input(4, 2, 3, 11);
    let got = vae.decode(&mut runner, &z, (3, 2), 4).unwrap();

    let h = p.conv("first_stage_model.post_quant_conv", &za, 4, 1, 1, 0, true);
    let h = p.conv(&format!("{d}.conv_in"), &h, 64, 3, 1, 1, true);
    let h = p.resnet(&format!("{d}.mid.block_1"), &h, 64);
    let h = p.attn(&format!("{d}.mid.attn_1"), &h);
    let h = p.resnet(&format!("{d}.mid.block_2"), &h, 64);
    let h = p.resnet(&format!("{d}.up.1.block.0"), &h, 64);
    let h = p.resnet(&format!("{d}.up.1.block.1"), &h, 64);
    let h = p.upsample(&format!("{d}.up.1.upsample"), &h);
    let h = p.resnet(&format!("{d}.up.0.block.0"), &h, 32);
    let h = p.resnet(&format!("{d}.up.0.block.1"), &h, 32);
    let h =
        Act { data: p.group_norm(&format!("{d}.norm_out"), &h, 32, 1e-6).data.into_iter().map(silu).collect(), ..h };
    let want = p.conv(&format!("{d}.conv_out"), &h, 3, 3, 1, 1, true);
    assert_eq!((want.w, want.h, want.c), (6, 4, 3));
    check("tiny decoder", &got, &want);
}

#[test]
fn tiny_encoder_matches_the_composed_reference() {
    let mut runner = cpu_runner("vae");
    let vae = load(tiny(), &runner);
    let p = Params { src: &SRC };
    let e = "first_stage_model.encoder";
    let (x, xa) = input(3, 4, 6, 12);
    let dist = vae.encode(&mut runner, &x, (6, 4)).unwrap();
    assert_eq!((dist.dims, dist.channels), ((3, 2), 4));

    let h = p.conv(&format!("{e}.conv_in"), &xa, 32, 3, 1, 1, true);
    let h = p.resnet(&format!("{e}.down.0.block.0"), &h, 32);
    let h = p.downsample(&format!("{e}.down.0.downsample"), &h);
    let h = p.resnet(&format!("{e}.down.1.block.0"), &h, 64);
    let h = p.resnet(&format!("{e}.mid.block_1"), &h, 64);
    let h = p.attn(&format!("{e}.mid.attn_1"), &h);
    let h = p.resnet(&format!("{e}.mid.block_2"), &h, 64);
    let h =
        Act { data: p.group_norm(&format!("{e}.norm_out"), &h, 32, 1e-6).data.into_iter().map(silu).collect(), ..h };
    let h = p.conv(&format!("{e}.conv_out"), &h, 8, 3, 1, 1, true);
    let want = p.conv("first_stage_model.quant_conv", &h, 8, 1, 1, 0, true);
    let got: Vec<f32> = dist.mean.iter().chain(&dist.logvar).copied().collect();
    check("tiny encoder", &got, &want);
}

#[test]
fn sampling_uses_the_callers_noise() {
    let moments: Vec<f32> = vec![1.0, -2.0, 0.0, 50.0, -100.0, 2.0f32.ln() * 2.0];
    let d = LatentDistribution::from_moments(&moments, (3, 1), 2).unwrap();
    assert_eq!(d.mean, vec![1.0, -2.0, 0.0]);
    let s = d.sample(&[1.0, 1.0, -1.0]).unwrap();
    // std = exp(0.5 * clamp(logvar, -30, 20)): exp(10), exp(-15), 2.
    assert_eq!(s[0], 1.0 + 10f32.exp());
    assert_eq!(s[1], -2.0 + (-15f32).exp());
    assert!((s[2] - -2.0).abs() < 1e-6);
    assert!(d.sample(&[0.0; 2]).is_err());
    assert_eq!(d.sample(&[0.0; 3]).unwrap(), d.mode());
}

#[test]
fn scale_factor_is_applied_by_the_caller_both_ways() {
    let cfg = VaeConfig::sd();
    let mut v = vec![0.18215f32, -0.3643];
    cfg.diffusion_to_vae(&mut v);
    assert_eq!(v, vec![0.18215f32 / 0.18215, -0.3643 / 0.18215]);
    cfg.vae_to_diffusion(&mut v);
    assert!((v[0] - 0.18215).abs() < 1e-7 && (v[1] + 0.3643).abs() < 1e-7);
}

/// The real SD 1.x/2.x configuration (both families share it) builds and runs at a tiny size.
#[test]
fn sd_vae_decodes_and_encodes_at_tiny_sizes() {
    let mut runner = cpu_runner("vae");
    let vae = load(VaeConfig::sd(), &runner);
    let (z, _) = input(4, 2, 3, 21);
    let img = vae.decode(&mut runner, &z, (3, 2), 4).unwrap();
    assert_eq!(img.len(), 3 * 16 * 24);
    assert!(img.iter().all(|v| v.is_finite()));
    let spread = img.iter().cloned().fold(f32::MIN, f32::max) - img.iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 1e-3, "a constant image means a dead graph");

    let dist = vae.encode(&mut runner, &img, (24, 16)).unwrap();
    assert_eq!((dist.dims, dist.channels, dist.mean.len()), ((3, 2), 4, 24));
    assert!(dist.mean.iter().chain(&dist.logvar).all(|v| v.is_finite()));

    assert!(vae.decode(&mut runner, &z, (3, 2), 8).is_err(), "wrong channel count");
    assert!(vae.decode(&mut runner, &z[1..], (3, 2), 4).is_err(), "wrong length");
    assert!(vae.encode(&mut runner, &img[..3 * 12 * 16], (12, 16)).is_err(), "width not a multiple of 8");
}

#[test]
fn decoder_only_weights_have_no_encoder() {
    let runner = cpu_runner("vae");
    let vae =
        AutoencoderKl::load(tiny(), VaeParts::DecoderOnly, &SRC, runner.backend().device().buffer_type()).unwrap();
    assert!(!vae.has_encoder());
    let specs = sd_vae::vae_specs(&tiny(), VaeParts::DecoderOnly);
    assert!(specs
        .iter()
        .all(|s| !s.name.contains(".encoder.") && !s.name.contains("quant_conv.") || s.name.contains("post_quant")));
    let mut runner = runner;
    let e = vae.encode(&mut runner, &vec![0.0; 3 * 8 * 8], (8, 8)).unwrap_err();
    assert!(e.to_string().contains("encoder"), "{e}");
}

#[test]
fn sd_spec_shapes_and_types() {
    let specs = sd_vae::vae_specs(&VaeConfig::sd(), VaeParts::Full);
    let find = |n: &str| specs.iter().find(|s| s.name == n).unwrap_or_else(|| panic!("{n}"));
    let f16 = GgmlType::GGML_TYPE_F16;
    let f32 = GgmlType::GGML_TYPE_F32;
    // ggml order, innermost first: [kw, kh, in, out].
    assert_eq!(
        (
            find("first_stage_model.decoder.conv_in.weight").ne.clone(),
            find("first_stage_model.decoder.conv_in.weight").ty
        ),
        (vec![3, 3, 4, 512], f16)
    );
    assert_eq!(find("first_stage_model.decoder.mid.attn_1.q.weight").ne, vec![1, 1, 512, 512]);
    assert_eq!(find("first_stage_model.decoder.up.0.block.0.nin_shortcut.weight").ne, vec![1, 1, 256, 128]);
    assert_eq!(find("first_stage_model.decoder.up.3.upsample.conv.weight").ne, vec![3, 3, 512, 512]);
    assert_eq!(find("first_stage_model.encoder.down.1.block.0.nin_shortcut.weight").ne, vec![1, 1, 128, 256]);
    assert_eq!(find("first_stage_model.encoder.conv_out.weight").ne, vec![3, 3, 512, 8]);
    assert_eq!(find("first_stage_model.quant_conv.weight").ne, vec![1, 1, 8, 8]);
    assert_eq!(find("first_stage_model.post_quant_conv.weight").ne, vec![1, 1, 4, 4]);
    assert_eq!(find("first_stage_model.decoder.norm_out.weight").ty, f32);
    assert_eq!(find("first_stage_model.decoder.conv_out.bias").ty, f32);
    assert!(specs.iter().all(|s| !s.name.contains("up.0.upsample") && !s.name.contains("down.3.downsample")));
    // 248 tensors in the LDM checkpoint's first_stage_model.
    assert_eq!(specs.len(), 248);
    // Diffusers-style linear projections keep the file's type.
    let lin = VaeConfig { attn_linear: Some(f32), ..VaeConfig::sd() };
    let specs = sd_vae::vae_specs(&lin, VaeParts::DecoderOnly);
    let q = specs.iter().find(|s| s.name == "first_stage_model.decoder.mid.attn_1.q.weight").unwrap();
    assert_eq!((q.ne.clone(), q.ty), (vec![512, 512], f32));
}

#[test]
fn linear_attention_projections_match_the_conv_form() {
    // The same weights as a 1x1 convolution (f16) and as a linear layer (f16): the
    // linear form skips im2col but rounds its input to f16 for the f16 matmul too.
    let mut runner = cpu_runner("vae");
    let conv = load(tiny(), &runner);
    let lin = load(VaeConfig { attn_linear: Some(GgmlType::GGML_TYPE_F16), ..tiny() }, &runner);
    let (x, a) = input(64, 4, 3, 8);
    let (y1, _) = conv.run_block(&mut runner, "decoder.mid.attn_1", &x, [3, 4, 64]).unwrap();
    let (y2, _) = lin.run_block(&mut runner, "decoder.mid.attn_1", &x, [3, 4, 64]).unwrap();
    check("linear attention", &y2, &Act::from_f32(3, 4, 64, &y1));
    let _ = a;
}

#[test]
fn flash_attention_and_direct_convolution_agree_on_cpu() {
    let mut runner = cpu_runner("vae");
    let plain = load(tiny(), &runner);
    let (z, _) = input(4, 4, 4, 31);
    let want = plain.decode(&mut runner, &z, (4, 4), 4).unwrap();
    let (x, _) = input(3, 8, 8, 32);
    let want_enc = plain.encode(&mut runner, &x, (8, 8)).unwrap();

    let flash = load(tiny(), &runner).with_options(GraphOptions { flash_attn: true, conv_direct: false });
    let got = flash.decode(&mut runner, &z, (4, 4), 4).unwrap();
    // Flash attention rounds q, k and v to f16: a few f16 ulps at most.
    check("flash attention", &got, &Act::from_f32(8, 8, 3, &want));

    // GraphOptions::recommended picks direct convolution on the CPU: ggml's CPU kernel feeds
    // the same f16 im2col rows to a matmul, in chunks. With the CPU plugin built with
    // GGML_LLAMAFILE=ON (our default) the chunked GEMM sums in another order than the one
    // big im2col matmul, so the results agree to float rounding, not bit for bit.
    let opts = GraphOptions::recommended(runner.backend().device());
    assert!(opts.conv_direct && !opts.flash_attn);
    let direct = load(tiny(), &runner).with_options(opts);
    let got = direct.decode(&mut runner, &z, (4, 4), 4).unwrap();
    check("direct convolution (decode)", &got, &Act::from_f32(8, 8, 3, &want));
    let got_enc = direct.encode(&mut runner, &x, (8, 8)).unwrap();
    for (name, a, b) in [("mean", &got_enc.mean, &want_enc.mean), ("logvar", &got_enc.logvar, &want_enc.logvar)] {
        let max = a.iter().zip(b.iter()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let scale = b.iter().map(|v| v.abs()).fold(0f32, f32::max);
        assert!(max <= 1e-3 * scale.max(1.0), "direct convolution (encode {name}): max diff {max} at scale {scale}");
    }
}

#[test]
fn taesd_blocks_and_whole_decoder_match_the_reference() {
    let mut runner = cpu_runner("taesd");
    let cfg = TaesdConfig::sd();
    let tae = Taesd::load(cfg.clone(), TaesdParts::Full, &SRC, runner.backend().device().buffer_type()).unwrap();
    let p = Params { src: &SRC };

    let (x, a) = input(64, 5, 4, 41);
    let (y, _) = tae.run_block(&mut runner, "decoder.layers.7", &x, [4, 5, 64]).unwrap();
    check_block("tae block", &y, &p.tae_block("tae.decoder.layers.7", &a));

    // Whole decoder: 3 tanh(z / 3), conv, relu, 3 x (3 blocks, up, conv), block, conv.
    let (z, za) = input(4, 2, 2, 42);
    let got = tae.decode(&mut runner, &z, (2, 2), 4).unwrap();
    let l = |i: usize| format!("tae.decoder.layers.{i}");
    let mut h = Act { data: za.data.iter().map(|v| 3.0 * (v / 3.0).tanh()).collect(), ..za };
    h = p.conv(&l(0), &h, 64, 3, 1, 1, true);
    h = Act { data: h.data.iter().map(|v| v.max(0.0)).collect(), ..h };
    let mut i = 2;
    for _ in 0..3 {
        for _ in 0..3 {
            h = p.tae_block(&l(i), &h);
            i += 1;
        }
        let (w, hh) = (h.w * 2, h.h * 2);
        let mut up = vec![0.0; w * hh * h.c];
        for c in 0..h.c {
            for y in 0..hh {
                for x in 0..w {
                    up[(c * hh + y) * w + x] = h.data[(c * h.h + y / 2) * h.w + x / 2];
                }
            }
        }
        i += 1;
        h = p.conv(&l(i), &Act::new(w, hh, h.c, up), 64, 3, 1, 1, false);
        i += 1;
    }
    h = p.tae_block(&l(17), &h);
    let want = p.conv(&l(18), &h, 3, 3, 1, 1, true);
    assert_eq!((want.w, want.h, want.c), (16, 16, 3));
    check("taesd decoder", &got, &want);

    let (img, _) = input(3, 16, 24, 43);
    let lat = tae.encode(&mut runner, &img, (24, 16)).unwrap();
    assert_eq!(lat.len(), 4 * 2 * 3);
    assert!(lat.iter().all(|v| v.is_finite()));
    let (lat2, c) = tae.run_block(&mut runner, "encoder.layers.2", &uniform(64 * 8 * 8, 3), [8, 8, 64]).unwrap();
    assert_eq!((lat2.len(), c), (64 * 4 * 4, [4, 4, 64]));
}

#[test]
fn taesd_spec_names_follow_the_file() {
    let specs = sd_vae::taesd_specs(&TaesdConfig::sd(), TaesdParts::Full);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    for n in [
        "tae.decoder.layers.0.weight",
        "tae.decoder.layers.0.bias",
        "tae.decoder.layers.2.conv.0.weight",
        "tae.decoder.layers.6.weight",
        "tae.decoder.layers.18.bias",
        "tae.encoder.layers.0.weight",
        "tae.encoder.layers.2.weight",
        "tae.encoder.layers.13.conv.4.bias",
        "tae.encoder.layers.14.weight",
    ] {
        assert!(names.contains(&n), "{n}");
    }
    for n in [
        "tae.decoder.layers.6.bias",
        "tae.encoder.layers.2.bias",
        "tae.decoder.layers.1.weight",
        "tae.decoder.layers.5.weight",
    ] {
        assert!(!names.contains(&n), "{n}");
    }
    assert_eq!(specs.iter().find(|s| s.name == "tae.decoder.layers.0.weight").unwrap().ne, vec![3, 3, 4, 64]);
}

/// Tiling with real graphs: an input that fits one tile decodes exactly as without tiling;
/// several tiles give an image of the right size.
#[test]
fn tiled_decode_with_real_graphs() {
    let mut runner = cpu_runner("vae");
    let vae = load(tiny(), &runner);
    let (z, _) = input(4, 6, 6, 51);
    let plain = vae.decode(&mut runner, &z, (6, 6), 4).unwrap();
    let on = TilingParams::from_cli(true, None, None, None).unwrap();
    let single = decode_tiled(&vae, &mut runner, &z, (6, 6), 4, &on, None).unwrap();
    assert!(plain == single, "one tile must be exactly the untiled decode");

    // The tiny model scales by 2: 16-pixel tiles are 8 latent pixels.
    assert_eq!(vae.scale_factor(), 2);
    let (z, _) = input(4, 10, 12, 52);
    let small = TilingParams::from_cli(true, Some("16"), None, None).unwrap();
    let tiled = decode_tiled(&vae, &mut runner, &z, (12, 10), 4, &small, None).unwrap();
    assert_eq!(tiled.len(), 3 * 20 * 24);
    assert!(tiled.iter().all(|v| v.is_finite()));
    assert_ne!(tiled, vae.decode(&mut runner, &z, (12, 10), 4).unwrap(), "tiles see less context than the whole");
    let (enc, c) = encode_tiled(&vae, &mut runner, &tiled, (24, 20), 3, &small, None).unwrap();
    assert_eq!((enc.len(), c), (8 * 10 * 12, 8));
}

/// A compute-buffer cap between the needs of the whole graph and of 64-pixel tiles makes
/// the untiled decode fail allocation and retry; the result is the tiled decode.
#[test]
fn memory_cap_triggers_the_retry_with_real_graphs() {
    let mut runner = cpu_runner("vae");
    let vae = load(tiny(), &runner);
    let (z, _) = input(4, 16, 16, 61);
    let need = |runner: &mut Runner, d: usize| match vae.decode_graph(runner, &z[..4 * d * d], [d, d], 4, Some(0)) {
        Err(sd_vae::VaeError::Alloc { bytes, cap: Some(0), .. }) => bytes,
        other => panic!("expected a capped allocation failure, got {other:?}"),
    };
    let (whole, tile8) = (need(&mut runner, 16), need(&mut runner, 8));
    assert!(tile8 < whole);
    let retried = decode_tiled(&vae, &mut runner, &z, (16, 16), 4, &TilingParams::default(), Some(tile8)).unwrap();
    // 16 latent pixels: the first retry (at most 256 pixels = 128 latent for this 2x model)
    // would not shrink, so it halves to 8 latent = 16 pixels.
    let tiled = TilingParams::from_cli(true, Some("16"), None, None).unwrap();
    let want = decode_tiled(&vae, &mut runner, &z, (16, 16), 4, &tiled, None).unwrap();
    assert!(retried == want, "the retried decode differs from the 16-pixel tiled decode");
    // Below every tile's need, the decode fails with the allocation error.
    let e = decode_tiled(&vae, &mut runner, &z, (16, 16), 4, &TilingParams::default(), Some(1024)).unwrap_err();
    assert!(e.is_alloc(), "{e}");
    // Encoding is not retried.
    let img = vec![0.1f32; 3 * 32 * 32];
    let e = encode_tiled(&vae, &mut runner, &img, (32, 32), 3, &TilingParams::default(), Some(1024)).unwrap_err();
    assert!(e.is_alloc(), "{e}");
}

/// A device budget (`--max-vram`) that holds 16-pixel tiles but not the whole decode: the
/// runner refuses the whole graph's compute buffer before allocating, and the decode retries
/// with tiles exactly as for an allocation failure.
#[test]
fn a_device_budget_triggers_the_same_retry() {
    let probe = cpu_runner("vae");
    let vae = load(tiny(), &probe);
    let (z, _) = input(4, 16, 16, 61);
    let mut p = cpu_runner("vae");
    let need = |runner: &mut Runner, d: usize| match vae.decode_graph(runner, &z[..4 * d * d], [d, d], 4, Some(0)) {
        Err(sd_vae::VaeError::Alloc { bytes, .. }) => bytes as u64,
        other => panic!("expected a capped allocation failure, got {other:?}"),
    };
    let (whole, tile8) = (need(&mut p, 16), need(&mut p, 8));
    let budget = (tile8 + whole) / 2;
    assert!(tile8 < budget && budget < whole);
    let ledger = sd_sched::Ledger::new("CPU", Some(budget));
    let mut runner =
        Runner::with_ledger("vae", probe.backend().clone(), ledger.clone(), sd_sched::plan::Options::default());
    let retried = decode_tiled(&vae, &mut runner, &z, (16, 16), 4, &TilingParams::default(), None).unwrap();
    let tiled = TilingParams::from_cli(true, Some("16"), None, None).unwrap();
    let want = decode_tiled(&vae, &mut cpu_runner("vae"), &z, (16, 16), 4, &tiled, None).unwrap();
    assert!(retried == want, "the budget-driven retry differs from the 16-pixel tiled decode");
    assert!(ledger.high_water() <= budget, "{} > {budget}", ledger.high_water());
}

fn tiny_flux() -> VaeConfig {
    VaeConfig { ch: 32, ch_mult: vec![1, 2], num_res_blocks: 1, ..VaeConfig::flux() }
}

/// FLUX.1's autoencoder has no quant convs: the decoder reads the 16-channel latent
/// directly and the encoder's moments are its `conv_out`, checked against the composed
/// reference (a leftover `post_quant_conv` would change every value).
#[test]
fn flux_vae_runs_without_quant_convs() {
    let mut runner = cpu_runner("vae");
    let vae = load(tiny_flux(), &runner);
    let p = Params { src: &SRC };
    assert!(vae.weights().specs().iter().all(|s| !s.name.contains("quant_conv")), "no quant convs declared");
    let d = "first_stage_model.decoder";
    let (z, za) = input(16, 2, 3, 31);
    let got = vae.decode(&mut runner, &z, (3, 2), 16).unwrap();
    let h = p.conv(&format!("{d}.conv_in"), &za, 64, 3, 1, 1, true);
    let h = p.resnet(&format!("{d}.mid.block_1"), &h, 64);
    let h = p.attn(&format!("{d}.mid.attn_1"), &h);
    let h = p.resnet(&format!("{d}.mid.block_2"), &h, 64);
    let h = p.resnet(&format!("{d}.up.1.block.0"), &h, 64);
    let h = p.resnet(&format!("{d}.up.1.block.1"), &h, 64);
    let h = p.upsample(&format!("{d}.up.1.upsample"), &h);
    let h = p.resnet(&format!("{d}.up.0.block.0"), &h, 32);
    let h = p.resnet(&format!("{d}.up.0.block.1"), &h, 32);
    let h =
        Act { data: p.group_norm(&format!("{d}.norm_out"), &h, 32, 1e-6).data.into_iter().map(silu).collect(), ..h };
    let want = p.conv(&format!("{d}.conv_out"), &h, 3, 3, 1, 1, true);
    check("tiny flux decoder", &got, &want);
    assert!(vae.decode(&mut runner, &z[..4 * 6], (3, 2), 4).is_err(), "a 4-channel latent is refused");

    let e = "first_stage_model.encoder";
    let (x, xa) = input(3, 4, 6, 32);
    let dist = vae.encode(&mut runner, &x, (6, 4)).unwrap();
    assert_eq!((dist.dims, dist.channels), ((3, 2), 16));
    let h = p.conv(&format!("{e}.conv_in"), &xa, 32, 3, 1, 1, true);
    let h = p.resnet(&format!("{e}.down.0.block.0"), &h, 32);
    let h = p.downsample(&format!("{e}.down.0.downsample"), &h);
    let h = p.resnet(&format!("{e}.down.1.block.0"), &h, 64);
    let h = p.resnet(&format!("{e}.mid.block_1"), &h, 64);
    let h = p.attn(&format!("{e}.mid.attn_1"), &h);
    let h = p.resnet(&format!("{e}.mid.block_2"), &h, 64);
    let h =
        Act { data: p.group_norm(&format!("{e}.norm_out"), &h, 32, 1e-6).data.into_iter().map(silu).collect(), ..h };
    let want = p.conv(&format!("{e}.conv_out"), &h, 32, 3, 1, 1, true);
    let got: Vec<f32> = dist.mean.iter().chain(&dist.logvar).copied().collect();
    check("tiny flux encoder", &got, &want);
    let e = vae.run_block(&mut runner, "post_quant_conv", &z, [3, 2, 16]).unwrap_err();
    assert!(e.to_string().contains("post_quant_conv"), "{e}");
}

/// The full FLUX.1 configuration has the shapes of BFL's `ae.safetensors` (244 tensors:
/// the SD VAE's 248 less the two quant convs' weight and bias).
#[test]
fn flux_spec_shapes_and_scale() {
    let specs = sd_vae::vae_specs(&VaeConfig::flux(), VaeParts::Full);
    let find = |n: &str| specs.iter().find(|s| s.name == n).unwrap_or_else(|| panic!("{n}"));
    assert_eq!(find("first_stage_model.decoder.conv_in.weight").ne, vec![3, 3, 16, 512]);
    assert_eq!(find("first_stage_model.encoder.conv_out.weight").ne, vec![3, 3, 512, 32]);
    assert!(specs.iter().all(|s| !s.name.contains("quant_conv")));
    assert_eq!(specs.len(), 244);
    let params: i64 = specs.iter().map(|s| s.ne.iter().product::<i64>()).sum();
    assert!((83_000_000..85_000_000).contains(&params), "{params} parameters, ae.safetensors has 83.8M");
    assert_eq!(sd_vae::vae_specs(&VaeConfig::flux(), VaeParts::DecoderOnly).len(), 138);

    // latent_vae = latent / 0.3611 + 0.1159 and back, in f32.
    let cfg = VaeConfig::flux();
    let mut v = vec![0.3611f32, -1.0];
    cfg.diffusion_to_vae(&mut v);
    assert_eq!(v, vec![0.3611f32 / 0.3611 + 0.1159, -1.0 / 0.3611 + 0.1159]);
    cfg.vae_to_diffusion(&mut v);
    assert!((v[0] - 0.3611).abs() < 1e-6 && (v[1] + 1.0).abs() < 1e-6, "{v:?}");
}

/// A file's layout is read from its tensor shapes and checked against the family's
/// configuration: the wrong VAE for a model is an error naming both layouts.
#[test]
fn vae_layout_is_read_from_the_file_and_checked() {
    let shapes = |cfg: &VaeConfig| {
        let specs = sd_vae::vae_specs(cfg, VaeParts::DecoderOnly);
        move |n: &str| specs.iter().find(|s| s.name == n).map(|s| s.ne.iter().map(|&d| d as u64).collect())
    };
    let flux = VaeLayout::of_tensors(shapes(&VaeConfig::flux())).unwrap();
    assert_eq!(flux, VaeLayout { latent_channels: 16, quant_convs: false });
    let sd = VaeLayout::of_tensors(shapes(&VaeConfig::sd())).unwrap();
    assert_eq!(sd, VaeLayout { latent_channels: 4, quant_convs: true });
    VaeConfig::flux().check_layout(&flux).unwrap();
    VaeConfig::sd().check_layout(&sd).unwrap();
    let e = VaeConfig::flux().check_layout(&sd).unwrap_err().to_string();
    assert!(e.contains("4 latent channels with quant convs") && e.contains("needs 16 latent channels"), "{e}");
    let e = VaeConfig::sd().check_layout(&flux).unwrap_err().to_string();
    assert!(e.contains("FLUX.1"), "{e}");
    let e = VaeLayout::of_tensors(|_| None).unwrap_err().to_string();
    assert!(e.contains("decoder.conv_in.weight"), "{e}");
    let e = VaeLayout::of_tensors(|_| Some(vec![16, 512])).unwrap_err().to_string();
    assert!(e.contains("[16, 512]"), "{e}");
}

/// A narrow ESRGAN of the real layout: 2 blocks, 8 features, growth 4.
fn tiny_esrgan(scale: usize) -> sd_vae::EsrganConfig {
    sd_vae::EsrganConfig { scale, num_block: 2, num_feat: 8, num_grow_ch: 4, ..sd_vae::EsrganConfig::x4plus() }
}

/// ESRGAN in f64: each dense block concatenates its input with every earlier output,
/// leaky ReLU 0.2, residual scale 0.2, nearest x2 before each up conv.
fn esrgan_reference(p: &Params, cfg: &sd_vae::EsrganConfig, x: &Act) -> Act {
    let lrelu = |a: Act| Act { data: a.data.iter().map(|&v| if v > 0.0 { v } else { 0.2 * v }).collect(), ..a };
    let scaled_add =
        |a: &Act, b: &Act| Act { data: a.data.iter().zip(&b.data).map(|(u, v)| 0.2 * u + v).collect(), ..a.clone() };
    let (f, g) = (cfg.num_feat, cfg.num_grow_ch);
    let feat = p.conv("conv_first", x, f, 3, 1, 1, true);
    let mut body = feat.clone();
    for i in 0..cfg.num_block {
        let mut out = body.clone();
        for k in 1..=3 {
            let mut cat = out.clone();
            for j in 1..=4 {
                let y = lrelu(p.conv(&format!("body.{i}.rdb{k}.conv{j}"), &cat, g, 3, 1, 1, true));
                // Planar [c][h][w]: concatenating channels appends the planes.
                cat = Act::new(cat.w, cat.h, cat.c + g, [cat.data, y.data].concat());
            }
            let x5 = p.conv(&format!("body.{i}.rdb{k}.conv5"), &cat, f, 3, 1, 1, true);
            out = scaled_add(&x5, &out);
        }
        body = scaled_add(&out, &body);
    }
    let mut feat = feat.add(&p.conv("conv_body", &body, f, 3, 1, 1, true));
    let ups: &[&str] = match cfg.scale {
        4 => &["conv_up1", "conv_up2"],
        2 => &["conv_up1"],
        _ => &[],
    };
    for name in ups {
        let (w, h) = (feat.w * 2, feat.h * 2);
        let mut d = vec![0.0; w * h * f];
        for c in 0..f {
            for y in 0..h {
                for xx in 0..w {
                    d[(c * h + y) * w + xx] = feat.data[(c * feat.h + y / 2) * feat.w + xx / 2];
                }
            }
        }
        feat = lrelu(p.conv(name, &Act::new(w, h, f, d), f, 3, 1, 1, true));
    }
    let hr = lrelu(p.conv("conv_hr", &feat, f, 3, 1, 1, true));
    p.conv("conv_last", &hr, cfg.out_ch, 3, 1, 1, true)
}

fn esrgan_input(w: usize, h: usize, seed: u64) -> (Vec<f32>, Act) {
    let v: Vec<f32> = uniform(3 * w * h, seed).into_iter().map(|x| 0.5 + 0.5 * x).collect();
    let a = Act::from_f32(w, h, 3, &v);
    (v, a)
}

#[test]
fn esrgan_matches_the_f64_reference_at_each_scale() {
    let mut runner = cpu_runner("upscaler");
    let p = Params { src: &SRC };
    for scale in [4, 2, 1] {
        let cfg = tiny_esrgan(scale);
        let net = sd_vae::Esrgan::load(cfg.clone(), &SRC, runner.backend().device().buffer_type()).unwrap();
        let (x, a) = esrgan_input(6, 5, 70 + scale as u64);
        let got = net.upscale(&mut runner, &x, [6, 5], 0, None, &mut |_, _| {}).unwrap();
        let want = esrgan_reference(&p, &cfg, &a);
        assert_eq!((want.w, want.h), (6 * scale, 5 * scale));
        check(&format!("esrgan x{scale}"), &got, &want);
    }
}

/// The configuration comes from the tensors; a file that is not an ESRGAN, or lacks a
/// tensor or has one of the wrong shape, is refused naming the tensor.
#[test]
fn esrgan_config_is_read_from_the_tensor_names() {
    use std::collections::HashMap;
    let table = |cfg: &sd_vae::EsrganConfig| -> HashMap<String, Vec<u64>> {
        sd_vae::esrgan_specs(cfg).into_iter().map(|s| (s.name, s.ne.iter().map(|&n| n as u64).collect())).collect()
    };
    let read = |t: &HashMap<String, Vec<u64>>| {
        sd_vae::EsrganConfig::from_tensors(t.keys().map(String::as_str), |n| t.get(n).cloned())
    };
    for cfg in [
        sd_vae::EsrganConfig::x4plus(),
        tiny_esrgan(2),
        tiny_esrgan(1),
        sd_vae::EsrganConfig { num_block: 6, ..sd_vae::EsrganConfig::x4plus() },
    ] {
        assert_eq!(read(&table(&cfg)).unwrap(), cfg);
    }
    let layout_err = |t: &HashMap<String, Vec<u64>>| match read(t) {
        Err(sd_vae::VaeError::UpscalerLayout { tensor, message }) => (tensor, message),
        other => panic!("expected a layout error, got {other:?}"),
    };
    let mut t = table(&tiny_esrgan(4));
    t.remove("body.1.rdb3.conv5.bias");
    assert_eq!(layout_err(&t).0, "body.1.rdb3.conv5.bias");
    let mut t = table(&tiny_esrgan(4));
    t.insert("body.0.rdb2.conv3.weight".into(), vec![3, 3, 16, 5]);
    let (tensor, message) = layout_err(&t);
    assert_eq!(tensor, "body.0.rdb2.conv3.weight");
    assert!(message.contains("[3, 3, 16, 4]"), "{message}");
    let mut t = table(&tiny_esrgan(4));
    t.remove("conv_up1.weight");
    assert_eq!(layout_err(&t).0, "conv_up1.weight");
    // A VAE is not an upscaler.
    let vae: HashMap<String, Vec<u64>> =
        [("first_stage_model.decoder.conv_in.weight".to_string(), vec![3, 3, 4, 512])].into();
    let (tensor, message) = layout_err(&vae);
    assert_eq!(tensor, "conv_first.weight");
    assert!(message.contains("not an ESRGAN"), "{message}");
}

#[test]
fn esrgan_original_layout_names_map_to_rrdbnet() {
    for (old, new) in [
        ("model.0.weight", "conv_first.weight"),
        ("model.1.sub.3.RDB2.conv5.0.bias", "body.3.rdb2.conv5.bias"),
        ("model.1.sub.23.weight", "conv_body.weight"),
        ("model.3.bias", "conv_up1.bias"),
        ("model.6.weight", "conv_up2.weight"),
        ("model.8.weight", "conv_hr.weight"),
        ("model.10.bias", "conv_last.bias"),
        ("conv_first.weight", "conv_first.weight"),
        ("body.0.rdb1.conv1.weight", "body.0.rdb1.conv1.weight"),
    ] {
        assert_eq!(sd_vae::esrgan_canonical_name(old), new, "{old}");
    }
}

/// Tiling: an image within one tile is exactly the whole graph; a larger one is tiled into
/// an output of the right size; a compute cap between the needs of the whole image and of
/// 16-pixel tiles makes the whole-image run retry with 16-pixel tiles, whose result it is.
#[test]
fn esrgan_tiles_and_retries_under_a_cap() {
    let mut runner = cpu_runner("upscaler");
    let net = sd_vae::Esrgan::load(tiny_esrgan(2), &SRC, runner.backend().device().buffer_type()).unwrap();
    let (x, _) = esrgan_input(32, 24, 81);
    let whole = net.upscale(&mut runner, &x, [32, 24], 0, None, &mut |_, _| {}).unwrap();
    assert!(whole == net.upscale(&mut runner, &x, [32, 24], 32, None, &mut |_, _| {}).unwrap());
    let mut seen = Vec::new();
    let tiled = net.upscale(&mut runner, &x, [32, 24], 16, None, &mut |d, n| seen.push((d, n))).unwrap();
    assert_eq!(tiled.len(), 3 * 64 * 48);
    assert!(!seen.is_empty() && seen.iter().all(|&(_, n)| n == seen.len()), "{seen:?}");
    assert_ne!(tiled, whole, "tiles see less context than the whole");
    let (d, m) = max_diff(&tiled, &whole.iter().map(|&v| v as f64).collect::<Vec<_>>());
    assert!(d < 0.5 * m, "blended tiles stray from the whole image: {d} (max {m})");

    let mut need = |d: [usize; 2]| match net.upscale_graph(&mut runner, &x[..3 * d[0] * d[1]], d, Some(0)) {
        Err(sd_vae::VaeError::Alloc { bytes, .. }) => bytes,
        other => panic!("expected a capped allocation failure, got {other:?}"),
    };
    let cap = need([16, 16]);
    assert!(cap < need([32, 24]));
    let retried = net.upscale(&mut runner, &x, [32, 24], 0, Some(cap), &mut |_, _| {}).unwrap();
    assert!(retried == tiled, "the retried run differs from the 16-pixel tiled run");
    let e = net.upscale(&mut runner, &x, [32, 24], 0, Some(1024), &mut |_, _| {}).unwrap_err();
    assert!(e.is_alloc(), "{e}");
}

/// A patched latent (FLUX.2's autoencoder): the decode graph unpatchifies `4 c + 2 dy + dx`
/// into the plain decoder's input and the encode graph patchifies the plain encoder's mean,
/// both checked against the same weights run unpatched with the permutation done here; the
/// per-channel statistics round-trip.
#[test]
fn a_patched_latent_is_the_plain_one_in_2x2_patches() {
    static MEAN: [f32; 16] = [0.1, -0.2, 0.3, 0.0, 0.05, -0.05, 0.2, -0.3, 0.0, 0.1, 0.1, -0.1, 0.4, -0.4, 0.0, 0.2];
    static STD: [f32; 16] = [1.5, 1.7, 1.8, 1.6, 1.9, 1.75, 1.65, 1.55, 1.5, 1.7, 1.8, 1.6, 1.9, 1.75, 1.65, 1.55];
    let mut runner = cpu_runner("vae");
    let stats = sd_vae::LatentStats { mean: &MEAN, std: &STD };
    let patched_cfg = VaeConfig { patched: true, latent_stats: Some(stats), ..tiny() };
    assert_eq!((patched_cfg.latent_scale(), patched_cfg.latent_channels()), (4, 16));
    let patched = load(patched_cfg.clone(), &runner);
    let plain = load(tiny(), &runner);
    assert_eq!((patched.scale_factor(), patched.latent_channels()), (4, 16));
    let (w, h) = (3, 2);
    let (z, _) = input(16, h, w, 41);
    let mut unpatched = vec![0f32; 4 * 4 * w * h];
    for c in 0..4 {
        for y in 0..h {
            for x in 0..w {
                for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    let from = ((4 * c + 2 * dy + dx) * h + y) * w + x;
                    unpatched[(c * 2 * h + 2 * y + dy) * 2 * w + 2 * x + dx] = z[from];
                }
            }
        }
    }
    let (got, c) = patched.decode_graph(&mut runner, &z, [w, h], 16, None).unwrap();
    let want = plain.decode(&mut runner, &unpatched, (2 * w, 2 * h), 4).unwrap();
    assert_eq!((c, got.len()), (3, 3 * 4 * w * 4 * h));
    assert_eq!(got, want, "decode: the graph's unpatchify is not the 2x2 permutation");

    let (x, _) = input(3, 4 * h, 4 * w, 42);
    let (latent, c) = patched.encode_graph(&mut runner, &x, [4 * w, 4 * h], 3, None).unwrap();
    let dist = plain.encode(&mut runner, &x, (4 * w, 4 * h)).unwrap();
    assert_eq!((c, dist.dims), (16, (2 * w, 2 * h)));
    let (pw, ph) = (w, h);
    let mut want = vec![0f32; 16 * pw * ph];
    for ch in 0..4 {
        for y in 0..ph {
            for xx in 0..pw {
                for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    let from = (ch * 2 * ph + 2 * y + dy) * 2 * pw + 2 * xx + dx;
                    want[((4 * ch + 2 * dy + dx) * ph + y) * pw + xx] = dist.mean[from];
                }
            }
        }
    }
    assert_eq!(latent, want, "encode: the graph's patchify of the mean");

    let mut v = z.clone();
    patched.diffusion_to_vae(&mut v);
    let plane = w * h;
    let scale = patched_cfg.scale_factor;
    assert!((v[5 * plane] - (z[5 * plane] * STD[5] / scale + MEAN[5])).abs() < 1e-5);
    patched.vae_to_diffusion(&mut v);
    let (d, _) = max_diff(&v, &z.iter().map(|&a| f64::from(a)).collect::<Vec<_>>());
    assert!(d < 1e-5, "the statistics do not round-trip: {d}");
    let bad = VaeConfig { latent_stats: Some(sd_vae::LatentStats { mean: &MEAN[..4], std: &STD }), ..patched_cfg };
    assert!(AutoencoderKl::load(bad, VaeParts::Full, &SRC, runner.backend().device().buffer_type()).is_err());
}

/// TAESD with the group-norm branch and a patched latent (TAEF2's form): a block with the
/// branch against the composed reference (1x1 conv to 4x, group norm of 4 groups, ReLU, 1x1
/// conv back, added, then the plain block), the branch only next to the latent, and the
/// patched latent's scale and channels.
#[test]
fn taesd_with_group_norm_branches_and_patches() {
    let mut runner = cpu_runner("taesd");
    let cfg = TaesdConfig { z_channels: 4, midblock_gn: true, patched: true, ..TaesdConfig::sd() };
    let tae = Taesd::load(cfg.clone(), TaesdParts::Full, &SRC, runner.backend().device().buffer_type()).unwrap();
    let p = Params { src: &SRC };
    let (x, a) = input(64, 5, 4, 51);
    let (y, _) = tae.run_block(&mut runner, "decoder.layers.2", &x, [4, 5, 64]).unwrap();
    let name = "tae.decoder.layers.2";
    let g = p.conv(&format!("{name}.pool.0"), &a, 256, 1, 1, 0, false);
    let g = p.group_norm(&format!("{name}.pool.1"), &g, 4, 1e-6);
    let g = Act { data: g.data.iter().map(|v| v.max(0.0)).collect(), ..g };
    let g = p.conv(&format!("{name}.pool.3"), &g, 64, 1, 1, 0, false);
    let sum = Act { data: a.data.iter().zip(&g.data).map(|(u, v)| u + v).collect(), ..a };
    // Five convolutions with f16 kernels in a row: the whole-model tolerance.
    check("tae block with the group-norm branch", &y, &p.tae_block(name, &sum));
    let names: Vec<String> = sd_vae::taesd_specs(&cfg, TaesdParts::Full).into_iter().map(|s| s.name).collect();
    let has = |n: &str| names.iter().any(|s| s == n);
    assert!(has("tae.decoder.layers.4.pool.1.weight") && has("tae.encoder.layers.13.pool.3.weight"));
    assert!(!has("tae.decoder.layers.7.pool.0.weight") && !has("tae.encoder.layers.5.pool.0.weight"));
    assert_eq!((tae.scale_factor(), tae.latent_channels()), (16, 16));
    let (z, _) = input(16, 2, 3, 52);
    let (img, c) = tae.decode_graph(&mut runner, &z, [3, 2], 16, None).unwrap();
    assert_eq!((c, img.len()), (3, 3 * 48 * 32));
    let (lat, c) = tae.encode_graph(&mut runner, &img, [48, 32], 3, None).unwrap();
    assert_eq!((c, lat.len()), (16, 16 * 3 * 2));
}

/// The pixel-space stage passes values unchanged both ways, through the tiled paths too, and
/// refuses a wrong channel count or length by name.
#[test]
fn pixel_space_copies_and_checks_shapes() {
    use sd_vae::{FirstStage, PixelSpace};
    let stage = PixelSpace::new(3);
    let mut runner = common::cpu_runner("vae");
    let data: Vec<f32> = (0..3 * 4 * 2).map(|i| i as f32 * 0.1 - 1.0).collect();
    let (out, c) = stage.decode_graph(&mut runner, &data, [4, 2], 3, None).unwrap();
    assert_eq!((out, c), (data.clone(), 3));
    let (out, _) = stage.encode_graph(&mut runner, &data, [4, 2], 3, None).unwrap();
    assert_eq!(out, data);
    let tiling = sd_vae::TilingParams::default();
    let out = sd_vae::decode_tiled(&stage, &mut runner, &data, (4, 2), 3, &tiling, None).unwrap();
    assert_eq!(out, data);
    let e = stage.decode_graph(&mut runner, &data, [4, 2], 4, None).unwrap_err().to_string();
    assert!(e.contains("pixel space") && e.contains("takes 3 channels"), "{e}");
    assert!(stage.encode_graph(&mut runner, &data[1..], [4, 2], 3, None).is_err());
}
