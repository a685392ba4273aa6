//! Diffusion models: the denoising networks a sampler evaluates once per step.
//!
//! # Design
//!
//! * **Mirror the reference op by op.** Outputs must match stable-diffusion.cpp to the
//!   rounding error, so every block builds the same ggml operations on the same storage
//!   types as the reference does (`common/block.hpp`, `ggml_extend.hpp`, `unet.hpp`): where
//!   weights are f16 the ggml CPU backend rounds activations to f16 before the product, so
//!   the storage type of each parameter is part of the model math ([`crate::wtype::linear_weight_type`]).
//!   Deviations are allowed only where they are exactly equivalent on ggml's kernels (a
//!   fused `soft_max_ext` scale instead of a separate scale node, the fused swapped GEGLU
//!   instead of `cont` + `gelu` + `mul`, casting a permuted view instead of copying it
//!   first); each is noted where it is made.
//! * **One layout walk.** The UNet's block list ([`unet::layout`]) is computed once from
//!   the config; the parameter specs and the graph both walk it, so names, shapes and
//!   the forward pass cannot drift apart.
//! * **Blocks are plain functions** over a [`sd_sched::Weights`] set and a name prefix
//!   ([`blocks`]), so a parity harness can run one ResBlock or one transformer on given
//!   inputs ([`run_graph`]) and compare it with the reference's dump of the same block.
//! * **Graph cuts at block boundaries:** every forward pushes `(block name, activation)`
//!   after each block; [`sd_sched::Runner::run`] executes the graph segment by segment
//!   between them when the module's weights do not fit on the device at once.
//!
//! What it refuses to do: read files (the loader hands a [`sd_sched::TensorSource`]),
//! choose devices, or sample. Prediction type (eps / v) is the sampler's business: the
//! UNet returns its raw output.

pub mod blocks;
pub mod controlnet;
pub mod flux;
pub mod unet;
pub mod zimage;

#[cfg(test)]
mod tests;

use sd_backends::{Context, Tensor};
use sd_sched::Runner;

pub use blocks::AttnKernel;
pub use unet::{forward, unet_specs, validate_against_file, Heads, UNetConfig, UNetModel};

/// Errors of the diffusion models.
#[derive(Debug, thiserror::Error)]
pub enum DiffusionError {
    /// The file's tensors disagree with the architecture (missing tensors, wrong shapes).
    #[error("{model}: {} tensor(s) of the file disagree with the architecture: {}", problems.len(), summarize(problems))]
    WeightsMismatch { model: &'static str, problems: Vec<TensorProblem> },
    /// A config that does not describe a buildable network.
    #[error("invalid {model} config: {reason}")]
    Config { model: &'static str, reason: String },
    /// Inputs whose sizes disagree with each other or with the model.
    #[error("{model} input: {reason}")]
    Input { model: &'static str, reason: String },
    /// Weights or compute-buffer failure.
    #[error(transparent)]
    Sched(#[from] sd_sched::SchedError),
    /// A ggml-level failure.
    #[error(transparent)]
    Backend(#[from] sd_backends::BackendError),
}

/// One disagreement between a file and the tensors an architecture needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorProblem {
    /// The architecture needs `name` with shape `expected`; the file lacks it.
    Missing { name: String, expected: Vec<i64> },
    /// The file has `name` with shape `found`, the architecture needs `expected` (ggml order).
    Shape { name: String, expected: Vec<i64>, found: Vec<i64> },
}

impl std::fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorProblem::Missing { name, expected } => {
                write!(f, "missing tensor '{name}' (expected shape {expected:?}, ggml order)")
            }
            TensorProblem::Shape { name, expected, found } => {
                write!(f, "tensor '{name}' has shape {found:?}, expected {expected:?} (ggml order, innermost first)")
            }
        }
    }
}

fn summarize(problems: &[TensorProblem]) -> String {
    const SHOWN: usize = 5;
    let mut s = problems.iter().take(SHOWN).map(|p| p.to_string()).collect::<Vec<_>>().join("; ");
    if problems.len() > SHOWN {
        s.push_str(&format!("; and {} more", problems.len() - SHOWN));
    }
    s
}

/// Result alias of this module.
pub type Result<T, E = DiffusionError> = std::result::Result<T, E>;

/// The pipeline's batch for a DiT evaluated one sample per graph (FLUX, Z-Image): `x` holds
/// `conds` latents of `per` values each, with one timestep each.
pub(crate) fn check_batch(model: &'static str, per: usize, x: usize, timesteps: usize, conds: usize) -> Result<()> {
    if conds == 0 || x != per * conds || timesteps != conds {
        let reason =
            format!("{x} latent values and {timesteps} timesteps for {conds} conditionings of {per} values each");
        return Err(DiffusionError::Input { model, reason });
    }
    Ok(())
}

/// The pipeline's batch for a DiT evaluated one sample per graph (Z-Image, SD3's MMDiT): checks
/// the batch ([`check_batch`]) and each conditioning's width (`width`, what the model's `input`
/// layer takes), evaluates each sample with `one(latent, timestep, conditioning)` and joins the
/// predictions.
pub(crate) fn eval_each(
    model: &'static str,
    (per, width, input): (usize, usize, &str),
    x: &[f32],
    timesteps: &[f32],
    cond: &[&crate::text::conditioning::Conditioning],
    mut one: impl FnMut(&[f32], f32, &crate::text::conditioning::Conditioning) -> Result<Vec<f32>>,
) -> crate::pipeline::Result<Vec<f32>> {
    check_batch(model, per, x.len(), timesteps.len(), cond.len())?;
    let mut out = Vec::with_capacity(x.len());
    for (i, c) in cond.iter().enumerate() {
        if c.hidden_size != width {
            let reason = format!("the conditioning is {} wide, the model's {input} takes {width}", c.hidden_size);
            return Err(DiffusionError::Input { model, reason }.into());
        }
        out.extend(one(&x[i * per..(i + 1) * per], timesteps[i], c)?);
    }
    Ok(out)
}

/// The checks every patchified DiT (FLUX, Z-Image) makes on its inputs: one latent
/// `[W, H, C, 1]` with sides that are positive multiples of `patch` and `channels` channels,
/// and a context `[context_dim, L, 1]` of at least one token (ggml order). Returns `(W, H, L)`.
pub(crate) fn check_dit_inputs(
    model: &'static str,
    x: [i64; 4],
    context: [i64; 4],
    patch: i64,
    channels: i64,
    context_dim: i64,
) -> Result<(i64, i64, i64)> {
    let bad = |reason: String| Err(DiffusionError::Input { model, reason });
    let [wd, ht, c, n] = x;
    if n != 1 {
        return bad(format!("a batch of {n}: {model} evaluates one sample per graph"));
    }
    if wd <= 0 || ht <= 0 || wd % patch != 0 || ht % patch != 0 {
        return bad(format!("latent size {wd}x{ht} is not a positive multiple of {patch}"));
    }
    if c != channels {
        return bad(format!("latent has {c} channels, the model takes {channels}"));
    }
    let [cd, lt, cn, _] = context;
    if cd != context_dim || cn != 1 || lt <= 0 {
        return bad(format!("context shape [{cd}, {lt}, {cn}] does not fit [{context_dim}, tokens, 1] (ggml order)"));
    }
    Ok((wd, ht, lt))
}

/// Builds a graph over f32 inputs of the given shapes (ggml order), computes it on the
/// runner's backend and returns the output's values and shape.
///
/// For parity checks of single blocks: `build` receives the input tensors (created in the
/// graph context, marked as inputs) and returns the output. `graph_size` bounds the number
/// of nodes (and tensors) the graph may create.
pub fn run_graph<F>(
    runner: &mut Runner,
    inputs: &[(&[i64], &[f32])],
    graph_size: usize,
    build: F,
) -> Result<(Vec<f32>, [i64; 4])>
where
    F: for<'g> FnOnce(&'g Context, &[Tensor<'g>]) -> Result<Tensor<'g>>,
{
    let g = Context::for_graph(graph_size, graph_size)?;
    let mut ts = Vec::with_capacity(inputs.len());
    for (i, (ne, data)) in inputs.iter().enumerate() {
        let n: i64 = ne.iter().product();
        if n as usize != data.len() || ne.is_empty() || ne.len() > 4 {
            return Err(DiffusionError::Input {
                model: "graph",
                reason: format!("input {i}: shape {ne:?} needs {n} values, got {}", data.len()),
            });
        }
        ts.push(g.new_f32(ne).set_name(&format!("input{i}")).set_input());
    }
    let out = build(&g, &ts)?.set_output();
    let graph = g.new_graph(graph_size);
    graph.expand(out);
    runner.alloc(&graph)?;
    // An input the graph does not use has no storage and needs no data.
    for (t, (_, data)) in ts.iter().zip(inputs).filter(|(t, _)| t.is_allocated()) {
        t.set_f32(data)?;
    }
    runner.compute(&graph)?;
    Ok((out.get_f32()?, out.shape()))
}
