//! Low-rank adapters added in the graph (a LoRA applied `at_runtime`).
//!
//! An adapter of a weight `W` is a pair of ordinary tensors of the same [`Weights`] set, `down`
//! (`[in, rank]` in ggml order, or a `[kw, kh, in, rank]` kernel) and `up` (`[rank, out]`, or a
//! `[1, 1, rank, out]` kernel), with a scale: the layer computes `W x + scale * up(down(x))`
//! instead of `W x`, and no byte of `W` changes. Because the pair is declared with the set,
//! it is placed, staged, evicted and charged to the device ledgers like every other weight
//! (the caller puts it in the group of the weight it adapts), so parameters on disk, segments
//! and layer splits need nothing of their own; a row split cuts `W` but never the pair, whose
//! product runs on the main device and is added to the gathered result.
//!
//! The set only records which pairs adapt which weight ([`Weights::set_adapters`]); a graph
//! builder that multiplies by a weight asks [`Weights::adapters`] and adds the terms after its
//! own bias, one after the other ([`add_linear_adapters`]; convolutions do the same with their
//! kernels, in `sd-models`' blocks), which is stable-diffusion.cpp's order.

use sd_backends::{Context, Tensor};

use crate::error::{Result, SchedError};
use crate::weights::Weights;

/// One adapter of a weight: the names of its two tensors in the set and its scale.
#[derive(Clone, Debug, PartialEq)]
pub struct Adapter {
    /// The `down` tensor (applied to the layer's input).
    pub down: String,
    /// The `up` tensor (applied to `down`'s output).
    pub up: String,
    /// The factor of the product (`multiplier * alpha / rank` for a LoRA).
    pub scale: f32,
}

/// An [`Adapter`] with its tensors, for a graph.
#[derive(Clone, Copy, Debug)]
pub struct AdapterTerm<'w> {
    /// The `down` tensor.
    pub down: Tensor<'w>,
    /// The `up` tensor.
    pub up: Tensor<'w>,
    /// The factor of the product.
    pub scale: f32,
}

impl Weights {
    /// Records that `adapters` (whose tensors the set declares) adapt the weight `target`,
    /// in the order they are added. Replaces what was recorded for `target`.
    pub fn set_adapters(&mut self, target: &str, adapters: Vec<Adapter>) -> Result<()> {
        for name in std::iter::once(target).chain(adapters.iter().flat_map(|a| [a.down.as_str(), a.up.as_str()])) {
            if !self.contains(name) {
                return Err(SchedError::MissingTensor(name.to_string()));
            }
        }
        self.adapters.insert(target.to_string(), adapters);
        Ok(())
    }

    /// The adapters of the weight `target`, in order (empty when it has none).
    pub fn adapters(&self, target: &str) -> Result<Vec<AdapterTerm<'_>>> {
        let Some(list) = self.adapters.get(target) else { return Ok(Vec::new()) };
        list.iter()
            .map(|a| Ok(AdapterTerm { down: self.get(&a.down)?, up: self.get(&a.up)?, scale: a.scale }))
            .collect()
    }
}

impl Weights {
    /// A linear layer's `W x`, plus `bias` when given, plus its adapters' terms: the product
    /// of the matrix `weight` by `x` as one product per part of a row-split matrix
    /// ([`Weights::matrix_parts`], [`crate::mul_mat_parts`]), then the bias, then
    /// [`add_linear_adapters`] (stable-diffusion.cpp's order). Every linear layer of the
    /// model families goes through here, so a cut matrix or an adapter reaches all of them.
    pub fn linear<'g>(
        &self,
        g: &'g Context,
        weight: &str,
        bias: Option<Tensor<'_>>,
        x: Tensor<'_>,
    ) -> Result<Tensor<'g>> {
        let y = crate::mul_mat_parts(g, &self.matrix_parts(weight)?, x);
        let y = match bias {
            Some(b) => g.add(y, b),
            None => y,
        };
        Ok(add_linear_adapters(g, &self.adapters(weight)?, x, y))
    }
}

/// `y + scale * (up (down x))` for each term in order, the product scaled after both matrix
/// products (f32 results; the activation is rounded to each matrix's dot type as in any
/// product). `y` is the layer's output for `x`, bias included.
pub fn add_linear_adapters<'g>(g: &'g Context, terms: &[AdapterTerm<'_>], x: Tensor<'_>, y: Tensor<'g>) -> Tensor<'g> {
    terms.iter().fold(y, |y, t| g.add(y, g.scale(g.mul_mat(t.up, g.mul_mat(t.down, x)), t.scale)))
}
