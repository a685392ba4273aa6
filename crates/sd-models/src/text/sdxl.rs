//! SDXL's conditioner: CLIP ViT-L/14 and OpenCLIP ViT-bigG/14, hidden states concatenated,
//! the pooled bigG output and the size embeddings as the ADM vector.
//!
//! This is the SDXL branch of the reference's `FrozenCLIPEmbedderWithCustomWords`
//! (stable-diffusion.cpp `conditioning/conditioner.hpp`, `get_learned_condition_common`),
//! step for step:
//!
//! 1. The prompt is tokenized once, as for SD 1.x (chunks of 77 ids padded with EOS, one
//!    weight per id; `BREAK` and long prompts as there).
//! 2. Per chunk: CLIP-L reads the ids as tokenized; bigG reads them with every id after the
//!    first EOS set to 0. Both run at the same clip skip (<= 0: 2), neither applies its
//!    final LayerNorm. Their hidden states are concatenated per token (768 + 1280 = 2048
//!    values, CLIP-L first).
//! 3. The prompt weights are applied to the concatenated chunk (the SD 1.x rule:
//!    `crate::text::conditioning`), then, for an empty negative prompt (`zero_out`), the
//!    chunk is set to zeros. Chunks are joined on the token axis.
//! 4. The pooled output: bigG on chunk 0's (zero-padded) ids, every layer, the final
//!    LayerNorm, the state at the first EOS (the last position when there is none), times
//!    `text_projection` ([`ClipEncoder::encode_pooled`]).
//! 5. The ADM vector (2816 for SDXL): pooled (1280) ++ the size embeddings of
//!    `[height, width]` (original size), `[0, 0]` (crop top-left) and `[height, width]`
//!    (target size), each value a 256-wide sinusoidal embedding (`size_embedding`). The
//!    reference of this version has no flags for original size, crop or target size: they
//!    are always the image size and 0, 0, and so they are here.
//!
//! `zero_out` is what the reference sets for the negative prompt when it is empty (and the
//! model is not an EDM v-prediction one); the vector still holds that prompt's pooled output.

use std::sync::Arc;

use sd_backends::GgmlType;
use sd_sched::{Runner, TensorSpec, Weights};

use super::clip::{clip_specs, ClipConfig, ClipEncoder, Result};
use super::conditioning::{apply_token_weights, Conditioning};
use super::{ClipTokenizer, EOS_ID};
use crate::family::{TextEncoder, TextRequest};

/// Width of each size embedding (the reference's `out_dim`).
const SIZE_EMBEDDING_DIM: usize = 256;

/// The sinusoidal embedding of each value, `dim` wide, one after another: cosines of the
/// first `dim / 2` frequencies then their sines (`flip_sin_to_cos`), frequencies
/// `exp(-ln(10000) i / (dim / 2))` computed in f64 and rounded to f32, arguments and
/// functions in f32, as the reference's CPU `timestep_embedding`.
fn size_embedding(values: &[f32], dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let freqs: Vec<f32> = (0..half).map(|i| (-(10000f64.ln()) * i as f64 / half as f64).exp() as f32).collect();
    let mut out = vec![0.0f32; values.len() * dim];
    for (row, &t) in out.chunks_exact_mut(dim).zip(values) {
        for (j, &f) in freqs.iter().enumerate() {
            let arg = t * f;
            row[j] = arg.cos();
            row[j + half] = arg.sin();
        }
    }
    out
}

/// The ADM vector: `pooled` then the size embeddings of `[height, width]`, `[0, 0]` and
/// `[height, width]`.
fn adm_vector(pooled: &[f32], width: usize, height: usize) -> Vec<f32> {
    let size = [height as f32, width as f32];
    let mut v = Vec::with_capacity(pooled.len() + 6 * SIZE_EMBEDDING_DIM);
    v.extend_from_slice(pooled);
    for values in [size, [0.0, 0.0], size] {
        v.extend(size_embedding(&values, SIZE_EMBEDDING_DIM));
    }
    v
}

/// bigG's ids for a chunk: every id after the first EOS set to 0; and the pooling index,
/// the first EOS's position (the last position when the chunk has none).
fn bigg_ids(ids: &[u32]) -> (Vec<u32>, usize) {
    let mut out = ids.to_vec();
    let eos = ids.iter().position(|&id| id == EOS_ID);
    if let Some(p) = eos {
        out[p + 1..].iter_mut().for_each(|id| *id = 0);
    }
    (out, eos.unwrap_or(ids.len().saturating_sub(1)).min(ids.len().saturating_sub(1)))
}

/// Encodes `prompt` for SDXL: CLIP-L (`clip_l`) and bigG (`bigg`) hidden states per token,
/// weighted, zeroed when `zero_out`, and the ADM vector for a `width` x `height` image.
/// `clip_skip` is `--clip-skip` (<= 0: 2).
#[allow(clippy::too_many_arguments)]
pub fn encode_sdxl(
    clip_l: ClipEncoder<'_>,
    bigg: ClipEncoder<'_>,
    runner: &mut Runner,
    tokenizer: &ClipTokenizer,
    prompt: &str,
    clip_skip: i64,
    (width, height): (usize, usize),
    zero_out: bool,
) -> Result<Conditioning> {
    let (cl, cg) = (clip_l.config(), bigg.config());
    let skip_l = cl.resolve_clip_skip(clip_skip)?;
    let skip_g = cg.resolve_clip_skip(clip_skip)?;
    let chunks = tokenizer.tokenize_weighted(prompt, &cl.chunk_config())?;
    let _span = tracing::debug_span!("encode_sdxl", chunks = chunks.len(), clip_skip = skip_l).entered();

    let ids_l: Vec<&[u32]> = chunks.iter().map(|c| c.ids.as_slice()).collect();
    let ids_g: Vec<(Vec<u32>, usize)> = chunks.iter().map(|c| bigg_ids(&c.ids)).collect();
    let hidden_l = clip_l.encode_each(runner, &ids_l, skip_l)?;
    let hidden_g =
        bigg.encode_each(runner, &ids_g.iter().map(|(ids, _)| ids.as_slice()).collect::<Vec<_>>(), skip_g)?;

    let (hl, hg) = (cl.hidden_size, cg.hidden_size);
    let hidden_size = hl + hg;
    let mut data = Vec::with_capacity(hidden_size * cl.n_positions * chunks.len());
    for ((chunk, l), g) in chunks.iter().zip(&hidden_l).zip(&hidden_g) {
        let mut joined: Vec<f32> = Vec::with_capacity(hidden_size * chunk.ids.len());
        for (tl, tg) in l.chunks_exact(hl).zip(g.chunks_exact(hg)) {
            joined.extend_from_slice(tl);
            joined.extend_from_slice(tg);
        }
        apply_token_weights(&mut joined, hidden_size, &chunk.weights);
        if zero_out {
            joined.iter_mut().for_each(|v| *v = 0.0);
        }
        data.extend(joined);
    }
    let (first_ids, index) = &ids_g[0];
    let pooled = bigg.encode_pooled(runner, first_ids, *index)?;
    let vector = adm_vector(&pooled, width, height);
    let n_tokens = data.len() / hidden_size;
    tracing::debug!(tokens = n_tokens, hidden_size, vector = vector.len(), "SDXL prompt encoded");
    Ok(Conditioning { zeroed: zero_out, ..Conditioning::tokens(data, hidden_size, n_tokens, vector) })
}

/// SDXL's two text encoders over one weight set (the `te` module), with the tokenizer.
#[derive(Debug)]
pub struct SdxlText {
    clip_l: ClipConfig,
    bigg: ClipConfig,
    weights: Weights,
    tokenizer: Arc<ClipTokenizer>,
}

impl SdxlText {
    /// The parameters of both encoders (CLIP-L first), as [`clip_specs`] declares each.
    pub fn specs(
        clip_l: &ClipConfig,
        bigg: &ClipConfig,
        dtype_of: &dyn Fn(&str) -> Option<GgmlType>,
        wtype: Option<GgmlType>,
    ) -> Vec<TensorSpec> {
        let mut specs = clip_specs(clip_l, dtype_of, wtype);
        specs.extend(clip_specs(bigg, dtype_of, wtype));
        specs
    }

    /// Both encoders over `weights` (declared from [`SdxlText::specs`], allocated, loaded);
    /// an error naming the first parameter either encoder misses or has the wrong shape of.
    pub fn new(clip_l: ClipConfig, bigg: ClipConfig, weights: Weights, tokenizer: Arc<ClipTokenizer>) -> Result<Self> {
        ClipEncoder::new(&clip_l, &weights)?;
        ClipEncoder::new(&bigg, &weights)?;
        Ok(Self { clip_l, bigg, weights, tokenizer })
    }

    /// Checks `--clip-skip` against both encoders.
    pub fn check_clip_skip(clip_l: &ClipConfig, bigg: &ClipConfig, clip_skip: i64) -> Result<()> {
        clip_l.resolve_clip_skip(clip_skip)?;
        bigg.resolve_clip_skip(clip_skip)?;
        Ok(())
    }

    /// The conditioning of `request`, zeroed (the vector kept) when `zero_out`: the
    /// reference does that for an empty negative prompt.
    fn encode_with(&self, runner: &mut Runner, request: &TextRequest<'_>, zero_out: bool) -> Result<Conditioning> {
        let clip_l = ClipEncoder::new(&self.clip_l, &self.weights)?;
        let bigg = ClipEncoder::new(&self.bigg, &self.weights)?;
        encode_sdxl(
            clip_l,
            bigg,
            runner,
            &self.tokenizer,
            request.prompt,
            request.clip_skip,
            (request.width, request.height),
            zero_out,
        )
    }
}

impl TextEncoder for SdxlText {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    /// An empty negative prompt is zeroed, as the reference does for SDXL (its pooled output
    /// still goes into the vector).
    fn encode(&self, runner: &mut Runner, request: &TextRequest<'_>) -> crate::pipeline::Result<Conditioning> {
        let zero_out = request.negative && request.prompt.is_empty();
        Ok(self.encode_with(runner, request, zero_out)?)
    }
}

#[cfg(test)]
mod tests {
    use sd_backends::GgmlType;
    use sd_sched::{Runner, Weights};

    use super::*;
    use crate::text::clip::test_support::{backend, tiny, RANDOM};
    use crate::text::clip::{Activation, ClipError};
    use crate::text::BOS_ID;

    const F32: GgmlType = GgmlType::GGML_TYPE_F32;

    /// Tiny stand-ins with the real prefixes: CLIP-L 32 wide, bigG 48 wide with a projection.
    fn configs() -> (ClipConfig, ClipConfig) {
        let l = ClipConfig { with_final_ln: false, ..tiny(Activation::QuickGelu, 2, EOS_ID) };
        let g = ClipConfig {
            prefix: ClipConfig::vit_bigg14().prefix,
            hidden_size: 48,
            intermediate_size: 96,
            projection_dim: Some(48),
            ..ClipConfig { with_final_ln: false, ..tiny(Activation::GeluTanh, 2, 0) }
        };
        (l, g)
    }

    fn text(backend: &sd_backends::Backend) -> SdxlText {
        let (l, g) = configs();
        let mut w = Weights::new(SdxlText::specs(&l, &g, &|_| Some(F32), None)).unwrap();
        w.allocate(backend.device().buffer_type()).unwrap();
        w.load_from(&RANDOM).unwrap();
        SdxlText::new(l, g, w, Arc::new(ClipTokenizer::new())).unwrap()
    }

    fn request(prompt: &str) -> TextRequest<'_> {
        TextRequest { prompt, clip_skip: 0, width: 832, height: 1216, negative: false }
    }

    #[test]
    fn bigg_ids_zero_everything_after_the_first_eos() {
        let mut ids = vec![BOS_ID, 320, 2368, EOS_ID];
        ids.extend([EOS_ID; 73]);
        let (g, index) = bigg_ids(&ids);
        assert_eq!(index, 3);
        assert_eq!(&g[..4], &ids[..4]);
        assert!(g[4..].iter().all(|&id| id == 0));
        // No EOS (a chunk cut mid-prompt never lacks one, but ids may): the last position.
        let (g, index) = bigg_ids(&[BOS_ID, 1, 2]);
        assert_eq!((g, index), (vec![BOS_ID, 1, 2], 2));
    }

    #[test]
    fn size_embeddings_are_cos_then_sin_of_the_reference_frequencies() {
        let e = size_embedding(&[1216.0, 832.0], 256);
        assert_eq!(e.len(), 512);
        for (k, t) in [1216.0f64, 832.0].into_iter().enumerate() {
            for j in 0..128 {
                let f = (-(10000f64.ln()) * j as f64 / 128.0).exp();
                let row = &e[k * 256..(k + 1) * 256];
                // f32 arguments of up to ~1216 rad: a few ulps of the argument.
                assert!((row[j] as f64 - (t * f).cos()).abs() < 2e-4, "cos {k} {j}");
                assert!((row[j + 128] as f64 - (t * f).sin()).abs() < 2e-4, "sin {k} {j}");
            }
        }
        let v = adm_vector(&[7.0; 1280], 832, 1216);
        assert_eq!(v.len(), 2816, "SDXL's adm_in_channels");
        assert_eq!(&v[1280..1792], &e[..], "original size: height then width");
        assert_eq!(&v[1792..2304], &size_embedding(&[0.0, 0.0], 256)[..], "crop 0, 0");
        assert_eq!(&v[2304..], &e[..], "target size");
        assert!(v[1792..1920].iter().all(|&x| x == 1.0) && v[1920..2048].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn hidden_states_concatenate_both_encoders_and_the_vector_holds_the_pooled_output() {
        let backend = backend();
        let mut runner = Runner::new("te", backend.clone());
        let t = text(&backend);
        let (l, g) = configs();
        let c = t.encode_with(&mut runner, &request("a photo of a cat"), false).unwrap();
        assert_eq!((c.hidden_size, c.n_tokens), (80, 77));
        assert_eq!(c.vector.len(), 48 + 1536);

        let chunk = ClipTokenizer::new().tokenize_weighted("a photo of a cat", &l.chunk_config()).unwrap();
        let ids = &chunk[0].ids;
        let (ids_g, eos) = bigg_ids(ids);
        assert_eq!(eos, 6);
        let el = ClipEncoder::new(&l, &t.weights).unwrap();
        let eg = ClipEncoder::new(&g, &t.weights).unwrap();
        let want_l = el.encode_ids(&mut runner, ids, 2).unwrap();
        let want_g = eg.encode_ids(&mut runner, &ids_g, 2).unwrap();
        for tok in 0..77 {
            assert_eq!(&c.data[tok * 80..tok * 80 + 32], &want_l[tok * 32..(tok + 1) * 32], "token {tok} CLIP-L");
            assert_eq!(&c.data[tok * 80 + 32..(tok + 1) * 80], &want_g[tok * 48..(tok + 1) * 48], "token {tok} bigG");
        }
        // bigG really saw zero padding: EOS padding gives other states after the first EOS.
        let eos_padded = eg.encode_ids(&mut runner, ids, 2).unwrap();
        assert_eq!(eos_padded[..7 * 48], want_g[..7 * 48]);
        assert_ne!(eos_padded[7 * 48..], want_g[7 * 48..]);

        let pooled = eg.encode_pooled(&mut runner, &ids_g, eos).unwrap();
        assert_eq!(c.vector, adm_vector(&pooled, 832, 1216));
        // The width and height are not swapped.
        let swapped = TextRequest { width: 1216, height: 832, ..request("a photo of a cat") };
        assert_ne!(t.encode_with(&mut runner, &swapped, false).unwrap().vector, c.vector);
    }

    #[test]
    fn weights_long_prompts_clip_skip_and_zero_out() {
        let backend = backend();
        let mut runner = Runner::new("te", backend.clone());
        let t = text(&backend);
        // Weights apply to the 80-wide concatenation: token 1 scaled, then the mean restored.
        let plain = t.encode_with(&mut runner, &request("cat sitting"), false).unwrap();
        let weighted = t.encode_with(&mut runner, &request("(cat:1.5) sitting"), false).unwrap();
        let mut want = plain.data.clone();
        let mut w = vec![1.0f32; 77];
        w[1] = 1.5;
        apply_token_weights(&mut want, 80, &w);
        assert_eq!(weighted.data, want);
        assert_eq!(weighted.vector, plain.vector, "the pooled output ignores prompt weights");

        // Two chunks; the pooled output comes from the first alone.
        let long = ["cat"; 80].join(" ");
        let c = t.encode_with(&mut runner, &request(&long), false).unwrap();
        assert_eq!(c.n_tokens, 154);
        let first = ["cat"; 75].join(" ");
        assert_eq!(t.encode_with(&mut runner, &request(&first), false).unwrap().vector, c.vector);

        // An empty negative prompt: zero hidden states, its pooled output kept.
        let empty = t.encode_with(&mut runner, &request(""), false).unwrap();
        let zeroed = t.encode_with(&mut runner, &request(""), true).unwrap();
        assert!(zeroed.data.iter().all(|&v| v == 0.0) && zeroed.data.len() == empty.data.len());
        assert!(zeroed.zeroed && !empty.zeroed, "the conditioning says it is zero by design");
        assert!(empty.data.iter().any(|&v| v != 0.0));
        assert_eq!(zeroed.vector, empty.vector);
        // Through the trait: zeroed for the negative prompt only, and only when it is empty.
        let negative = |p| TextRequest { negative: true, ..request(p) };
        assert_eq!(TextEncoder::encode(&t, &mut runner, &negative("")).unwrap(), zeroed);
        assert_eq!(TextEncoder::encode(&t, &mut runner, &request("")).unwrap(), empty);
        let cat = TextEncoder::encode(&t, &mut runner, &negative("cat")).unwrap();
        assert!(!cat.zeroed && cat == t.encode_with(&mut runner, &request("cat"), false).unwrap());

        // Clip skip 1 (last layer) differs from the default 2; beyond the depth is an error.
        let last = t.encode_with(&mut runner, &TextRequest { clip_skip: 1, ..request("cat") }, false).unwrap();
        let default = t.encode_with(&mut runner, &request("cat"), false).unwrap();
        assert_ne!(last.data, default.data);
        assert_eq!(last.vector, default.vector, "pooling runs every layer whatever the clip skip");
        let e = t.encode_with(&mut runner, &TextRequest { clip_skip: 4, ..request("cat") }, false).unwrap_err();
        assert!(matches!(e, ClipError::ClipSkip { requested: 4, layers: 3, .. }), "{e}");
        let (l, g) = configs();
        assert!(SdxlText::check_clip_skip(&l, &g, 4).is_err() && SdxlText::check_clip_skip(&l, &g, 3).is_ok());
    }

    #[test]
    fn a_weight_set_missing_big_g_is_refused() {
        let backend = backend();
        let (l, g) = configs();
        let mut w = Weights::new(clip_specs(&l, &|_| None, None)).unwrap();
        w.allocate(backend.device().buffer_type()).unwrap();
        match SdxlText::new(l, g, w, Arc::new(ClipTokenizer::new())) {
            Err(ClipError::MissingWeight(n)) => {
                assert!(n.starts_with("cond_stage_model.1.transformer.text_model."), "{n}")
            }
            other => panic!("{other:?}"),
        }
        // The real sizes: the vector is SDXL's 2816 wide, the context 2048.
        let (rl, rg) = (ClipConfig::vit_l14_sdxl(), ClipConfig::vit_bigg14());
        assert_eq!(rl.hidden_size + rg.hidden_size, 2048);
        assert_eq!(adm_vector(&vec![0.0; rg.projection_dim.unwrap()], 1024, 1024).len(), 2816);
    }
}
