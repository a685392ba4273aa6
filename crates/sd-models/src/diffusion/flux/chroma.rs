//! Chroma's distilled-guidance approximator: the FLUX.1-schnell transformer with its time,
//! vector and guidance embedders and every modulation projection pruned, one small network
//! (`distilled_guidance_layer`) computing all modulation vectors at once.
//!
//! As the reference computes it (stable-diffusion.cpp `model/diffusion/flux.hpp`,
//! `ChromaApproximator` and `Flux::forward_orig` with `is_chroma`):
//!
//! * The input is 344 rows of 64 values: per row the timestep embedding of `1000 t` (16
//!   values), the embedding of the guidance (16 values; the reference fills the guidance
//!   with 0 for Chroma) and the embedding of the row's index `1000 i` (32 values).
//! * `in_proj` (64 -> inner), then per layer `x + layers.N(norms.N(x))` (an RMSNorm with a
//!   scale, then an MLP embedder: `out_layer(silu(in_layer(x)))`), then `out_proj`
//!   (inner -> hidden): 344 modulation vectors of the model's width.
//! * Row `3 i .. 3 i + 2` are single block `i`'s shift, scale and gate; double block `i`'s
//!   image stream reads rows `114 + 6 i ..` (two triples), its text stream `228 + 6 i ..`; the
//!   final layer's shift and scale are the last two rows. The offsets assume the full model's
//!   19 double and 38 single blocks whatever the file holds (the reference hard-codes them),
//!   so a reduced-depth file reads the same rows as the full model's first blocks.
//! * The reference's approximator is 5120 wide with 5 layers; both are read here from the
//!   file (`in_proj.weight`'s output width, the largest `layers.N`), so a reduced
//!   approximator runs here too (the reference refuses it).
//!
//! The DiT mask (`chroma_use_dit_mask`, on by default in the reference): the text tokens'
//! attention mask (0 or -inf per token, from the conditioner) followed by zeros for the
//! image tokens, added to every attention's scores over the keys.

use sd_arch::chroma::PROBE;
use sd_backends::{Context, GgmlType, Tensor};
use sd_sched::Weights;

use super::super::blocks;
use super::super::{DiffusionError, Result};
use super::{name, rms_norm, MAX_PERIOD, MODEL, PREFIX, TIME_FACTOR};
use crate::wtype::SpecSink;

/// Rows of the approximator's output (the reference's `mod_index_length`).
pub const MOD_INDEX_LEN: usize = 344;
/// Double blocks the reference's offsets assume.
const REFERENCE_DOUBLE: usize = 19;
/// Single blocks the reference's offsets assume.
const REFERENCE_SINGLE: usize = 38;
/// Width of the approximator's input (timestep, guidance and index embeddings).
const IN_DIM: i64 = 64;
/// Width of the timestep and guidance embeddings.
const SCALAR_DIM: i32 = 16;
/// Width of the index embedding.
const INDEX_DIM: i32 = 32;
const LAYER_MARK: &str = "distilled_guidance_layer.layers.";

/// The approximator's shape and Chroma's options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChromaConfig {
    /// Width of the approximator's layers (5120 in the released models).
    pub inner: i64,
    /// Residual layers (5 in the released models).
    pub layers: usize,
    /// The reference's `chroma_use_dit_mask` (default on): padding tokens are masked out of
    /// the DiT's attention.
    pub dit_mask: bool,
}

impl ChromaConfig {
    /// The released Chroma's approximator: 5120 wide, 5 layers, the DiT mask on.
    pub fn released() -> Self {
        Self { inner: 5120, layers: 5, dit_mask: true }
    }
}

/// The approximator a file holds, or `None` when it has no `distilled_guidance_layer`:
/// `tensors` lists (internal name, ggml shape). Errors name the malformed tensor.
pub(super) fn from_file(tensors: &[(String, Vec<u64>)]) -> Result<Option<ChromaConfig>> {
    let bad = |reason: String| Err(DiffusionError::Config { model: MODEL, reason });
    let Some((_, ne)) = tensors.iter().find(|(n, _)| n == PROBE) else { return Ok(None) };
    let inner = match ne.as_slice() {
        [inp, out, rest @ ..] if *inp as i64 == IN_DIM && *out > 0 && rest.iter().all(|&d| d == 1) => *out as i64,
        _ => return bad(format!("tensor '{PROBE}' has ggml shape {ne:?}, expected [{IN_DIM}, inner width]")),
    };
    let mut layers = 0;
    let prefix = format!("{PREFIX}.{LAYER_MARK}");
    for (n, _) in tensors {
        if let Some(rest) = n.strip_prefix(&prefix) {
            match rest.split('.').next().unwrap_or("").parse::<usize>() {
                Ok(i) if i < 1024 => layers = layers.max(i + 1),
                _ => return bad(format!("tensor '{n}' has no valid layer index after '{LAYER_MARK}'")),
            }
        }
    }
    Ok(Some(ChromaConfig { inner, layers, dit_mask: true }))
}

/// Checks the block counts against the reference's fixed offsets.
pub(super) fn validate(depth: usize, single: usize) -> Result<()> {
    if depth > REFERENCE_DOUBLE || single > REFERENCE_SINGLE {
        return Err(DiffusionError::Config {
            model: MODEL,
            reason: format!(
                "a Chroma file has at most {REFERENCE_DOUBLE} double and {REFERENCE_SINGLE} single blocks \
                 (the approximator's {MOD_INDEX_LEN} modulation rows), this one {depth} and {single}"
            ),
        });
    }
    Ok(())
}

/// The approximator's parameters (after `img_in`, in the reference's order).
pub(super) fn specs(s: &mut SpecSink<'_>, c: &ChromaConfig, hidden: i64) {
    let p = name("distilled_guidance_layer");
    s.linear(&format!("{p}.in_proj"), IN_DIM, c.inner, true);
    for i in 0..c.layers {
        s.push(format!("{p}.norms.{i}.scale"), GgmlType::GGML_TYPE_F32, &[c.inner]);
        s.linear(&format!("{p}.layers.{i}.in_layer"), c.inner, c.inner, true);
        s.linear(&format!("{p}.layers.{i}.out_layer"), c.inner, c.inner, true);
    }
    s.linear(&format!("{p}.out_proj"), c.inner, hidden, true);
}

/// The 344 modulation vectors `[hidden, 344]` for the sampler's `timestep` `[1]`, the
/// `guidance` `[1]` (0 for Chroma) and the row indices `mod_index` `[344]`.
pub(super) fn modulation_vectors<'g>(
    g: &'g Context,
    w: &Weights,
    c: &ChromaConfig,
    timestep: Tensor<'g>,
    guidance: Tensor<'g>,
    mod_index: Tensor<'g>,
    eps: Tensor<'g>,
) -> Result<Tensor<'g>> {
    let emb = |v: Tensor<'g>, dim: i32| g.timestep_embedding(g.scale(v, TIME_FACTOR), dim, MAX_PERIOD);
    let index = emb(mod_index, INDEX_DIM); // [32, 344]
    let tg = g.concat(emb(timestep, SCALAR_DIM), emb(guidance, SCALAR_DIM), 0); // [32, 1]
    let tg = g.repeat(tg, index);
    let mut x = g.concat(tg, index, 0); // [64, 344]
    let p = name("distilled_guidance_layer");
    x = blocks::linear(g, w, &format!("{p}.in_proj"), x, true)?;
    for i in 0..c.layers {
        let scale = w.get(&format!("{p}.norms.{i}.scale"))?;
        let y = rms_norm(g, x, scale, eps);
        let y = blocks::linear(g, w, &format!("{p}.layers.{i}.in_layer"), y, true)?;
        let y = blocks::linear(g, w, &format!("{p}.layers.{i}.out_layer"), g.silu(y), true)?;
        x = g.add(x, y);
    }
    blocks::linear(g, w, &format!("{p}.out_proj"), x, true)
}

/// Row `j` of the modulation vectors `[hidden, 344]` as a `[hidden, 1]` view.
fn row<'g>(g: &'g Context, vec: Tensor<'g>, j: usize) -> Tensor<'g> {
    let h = vec.shape()[0];
    let nb = vec.nb();
    g.view(vec, [h, 1, 1, 1], [nb[1], nb[1], nb[1]], j * nb[1])
}

/// Six rows from `offset`: (shift, scale, gate) of attention, then of the MLP.
fn six<'g>(g: &'g Context, vec: Tensor<'g>, offset: usize) -> Vec<Tensor<'g>> {
    (offset..offset + 6).map(|j| row(g, vec, j)).collect()
}

/// Double block `i`'s image and text modulations.
pub(super) fn double_mods<'g>(g: &'g Context, vec: Tensor<'g>, i: usize) -> (Vec<Tensor<'g>>, Vec<Tensor<'g>>) {
    let img = 6 * i + 3 * REFERENCE_SINGLE;
    let txt = 6 * i + 6 * REFERENCE_DOUBLE + 3 * REFERENCE_SINGLE;
    (six(g, vec, img), six(g, vec, txt))
}

/// Single block `i`'s shift, scale and gate.
pub(super) fn single_mods<'g>(g: &'g Context, vec: Tensor<'g>, i: usize) -> Vec<Tensor<'g>> {
    (3 * i..3 * i + 3).map(|j| row(g, vec, j)).collect()
}

/// The final layer's shift and scale (the last two rows).
pub(super) fn final_mods<'g>(g: &'g Context, vec: Tensor<'g>) -> (Tensor<'g>, Tensor<'g>) {
    (row(g, vec, MOD_INDEX_LEN - 2), row(g, vec, MOD_INDEX_LEN - 1))
}

/// The row indices 0..344, the approximator's index input.
pub(super) fn mod_index_values() -> Vec<f32> {
    (0..MOD_INDEX_LEN).map(|i| i as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_cover_the_rows_once_for_the_full_model() {
        let mut seen = vec![0u32; MOD_INDEX_LEN];
        for i in 0..REFERENCE_SINGLE {
            (3 * i..3 * i + 3).for_each(|j| seen[j] += 1);
        }
        for i in 0..REFERENCE_DOUBLE {
            let img = 6 * i + 3 * REFERENCE_SINGLE;
            let txt = 6 * i + 6 * REFERENCE_DOUBLE + 3 * REFERENCE_SINGLE;
            (img..img + 6).chain(txt..txt + 6).for_each(|j| seen[j] += 1);
        }
        seen[MOD_INDEX_LEN - 2] += 1;
        seen[MOD_INDEX_LEN - 1] += 1;
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }

    #[test]
    fn the_approximator_is_read_from_the_names() {
        let t = |n: &str, ne: &[u64]| (format!("{PREFIX}.{n}"), ne.to_vec());
        let mut files = vec![
            t("distilled_guidance_layer.in_proj.weight", &[64, 256]),
            t("distilled_guidance_layer.layers.0.in_layer.weight", &[256, 256]),
            t("distilled_guidance_layer.layers.2.out_layer.weight", &[256, 256]),
        ];
        assert_eq!(from_file(&files).unwrap(), Some(ChromaConfig { inner: 256, layers: 3, dit_mask: true }));
        assert_eq!(from_file(&files[1..]).unwrap(), None, "no in_proj: not Chroma");
        files[0].1 = vec![16, 256];
        let e = from_file(&files).unwrap_err().to_string();
        assert!(e.contains(PROBE) && e.contains("[16, 256]"), "{e}");
        files[0].1 = vec![64, 256];
        files.push(t("distilled_guidance_layer.layers.x.in_layer.weight", &[256, 256]));
        let e = from_file(&files).unwrap_err().to_string();
        assert!(e.contains("layers.x.in_layer"), "{e}");
        assert!(validate(19, 38).is_ok());
        let e = validate(20, 1).unwrap_err().to_string();
        assert!(e.contains("20") && e.contains("344"), "{e}");
    }
}
