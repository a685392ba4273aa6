//! `at_runtime`: a LoRA's matrices as tensors of the module they adapt, added in the graph.
//!
//! For every weight of a module that a [`LoraSet`] adapts, each adapter becomes two tensors of
//! the module's [`Weights`], named after the weight (`<weight>#lora<k>.down`, `.up`, `k` the
//! adapter's place in application order) and recorded with their scale
//! ([`Weights::set_adapters`]); the graph's linear and convolution helpers add
//! `scale * up(down(x))` after their bias (`sd_sched::adapter`). The tensors are declared with
//! the module, so they are placed where its weights are (on its computing device, in RAM, on
//! disk, in the layer of a split), in the group of the weight they adapt, and charged to the
//! same ledgers; [`AdapterSource`] serves their bytes from the set, so nothing is read from
//! the model's files and no weight byte changes.
//!
//! Types, as the reference's runtime path (stable-diffusion.cpp's
//! `src/model/adapter/lora.hpp`): the matrices of a linear layer keep the file's f16 (other
//! file types are multiplied as f32); a convolution's are f16 kernels, `down` with the
//! layer's own kernel size, stride and padding and `up` a 1x1 kernel.

use std::borrow::Cow;
use std::sync::Arc;

use sd_backends::{convert, GgmlType};
use sd_sched::{Adapter, MappedBytes, SchedError, SourceError, TensorSource, TensorSpec, Weights};

use super::{Delta, LoraSet};

/// Between an adapted weight's name and the name of one of its adapter tensors.
const MARK: &str = "#lora";

/// The weight an adapter tensor belongs to; any other name unchanged.
pub fn adapted_weight(name: &str) -> &str {
    name.split_once(MARK).map_or(name, |(weight, _)| weight)
}

/// `(weight, adapter index, up)` of an adapter tensor's name.
fn parse(name: &str) -> Option<(&str, usize, bool)> {
    let (weight, rest) = name.split_once(MARK)?;
    let (k, part) = rest.split_once('.')?;
    let up = match part {
        "down" => false,
        "up" => true,
        _ => return None,
    };
    Some((weight, k.parse().ok()?, up))
}

/// A module's adapter tensors and what they adapt (from [`LoraSet::runtime`]).
#[derive(Debug, Default)]
pub(crate) struct RuntimeAdapters {
    specs: Vec<TensorSpec>,
    by_weight: Vec<(String, Vec<Adapter>)>,
}

impl RuntimeAdapters {
    /// The tensors to declare with the module.
    pub fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// Bytes of those tensors (what the adapters add to the module's weights).
    pub fn bytes(&self) -> u64 {
        self.specs
            .iter()
            .map(|s| sd_backends::row_size(s.ty, s.ne[0]) as u64 * s.ne[1..].iter().product::<i64>() as u64)
            .sum()
    }

    /// Number of weights adapted.
    pub fn weights(&self) -> usize {
        self.by_weight.len()
    }

    /// Records the adapters in `w`, which declares [`RuntimeAdapters::specs`].
    pub fn attach(self, w: &mut Weights) -> Result<(), SchedError> {
        for (weight, adapters) in self.by_weight {
            w.set_adapters(&weight, adapters)?;
        }
        Ok(())
    }
}

/// The type of an adapter's matrices at run time.
fn adapter_type(d: &Delta) -> GgmlType {
    if d.conv || d.f16 {
        GgmlType::GGML_TYPE_F16
    } else {
        GgmlType::GGML_TYPE_F32
    }
}

/// The shapes (ggml order) and type of an adapter's `down` and `up` for the weight `spec`.
fn adapter_shapes(spec: &TensorSpec, d: &Delta) -> (Vec<i64>, Vec<i64>, GgmlType) {
    // A part of a fused weight ([`super::LoraBody::Mapped`]) is added as an `up` over all the
    // weight's rows, zero outside the part's: the product adds exactly 0 there.
    let (rank, out) = (d.rank() as i64, d.rows as i64);
    if d.conv {
        let down = vec![spec.ne[0], spec.ne[1], spec.ne[2], rank];
        (down, vec![1, 1, rank, out], GgmlType::GGML_TYPE_F16)
    } else {
        (vec![d.inner as i64, rank], vec![rank, out], adapter_type(d))
    }
}

impl LoraSet {
    /// `(adapted weight, tensor name, bytes)` of every tensor `at_runtime` adds, for the
    /// planner (`sd-cli plan`).
    pub fn runtime_tensor_bytes(&self) -> Vec<(String, String, u64)> {
        let mut out = Vec::new();
        let mut names: Vec<&String> = self.deltas.keys().collect();
        names.sort();
        for weight in names {
            for (k, d) in self.deltas[weight].iter().enumerate() {
                let size = if adapter_type(d) == GgmlType::GGML_TYPE_F16 { 2 } else { 4 };
                let (down, up) = ((d.inner * d.rank() * size) as u64, (d.rank() * d.rows * size) as u64);
                out.push((weight.clone(), format!("{weight}{MARK}{k}.down"), down));
                out.push((weight.clone(), format!("{weight}{MARK}{k}.up"), up));
            }
        }
        out
    }

    /// The adapter tensors of the weights among `module` that the set adapts.
    pub(crate) fn runtime(&self, module: &[TensorSpec]) -> RuntimeAdapters {
        let mut out = RuntimeAdapters::default();
        for spec in module {
            let Some(deltas) = self.deltas.get(&spec.name) else { continue };
            let mut adapters = Vec::with_capacity(deltas.len());
            for (k, d) in deltas.iter().enumerate() {
                let (down_ne, up_ne, ty) = adapter_shapes(spec, d);
                let down = format!("{}{MARK}{k}.down", spec.name);
                let up = format!("{}{MARK}{k}.up", spec.name);
                out.specs.push(TensorSpec { name: down.clone(), ty, ne: down_ne });
                out.specs.push(TensorSpec { name: up.clone(), ty, ne: up_ne });
                adapters.push(Adapter { down, up, scale: d.scale });
            }
            out.by_weight.push((spec.name.clone(), adapters));
        }
        out
    }
}

/// A [`TensorSource`] that serves a [`LoraSet`]'s adapter tensors ([`LoraSet::runtime`]) and
/// passes every other name to the model's source.
pub struct AdapterSource {
    inner: Arc<dyn TensorSource + Send + Sync>,
    set: Arc<LoraSet>,
}

impl AdapterSource {
    /// `inner` plus the adapter tensors of `set`.
    pub fn new(inner: Arc<dyn TensorSource + Send + Sync>, set: Arc<LoraSet>) -> Self {
        Self { inner, set }
    }
}

impl TensorSource for AdapterSource {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        let Some((weight, k, up)) = parse(name) else { return self.inner.load(name, ty, ne) };
        let d = self.set.deltas.get(weight).and_then(|v| v.get(k));
        let Some(d) = d else { return Err(SourceError::new(format!("no LoRA adapter '{name}'"))) };
        // Only the factor asked for is formed (LoHa's and LoKr's are computed at each read).
        let rank = d.rank();
        let values: Cow<'_, [f32]> = match up {
            false => d.form.down(d.inner),
            true if d.rows == d.out => d.form.up(d.out),
            true => {
                let mut v = vec![0f32; d.rows * rank];
                v[d.offset * rank..(d.offset + d.out) * rank].copy_from_slice(&d.form.up(d.out));
                Cow::Owned(v)
            }
        };
        let n: i64 = ne.iter().product();
        if n as usize != values.len() {
            return Err(SourceError::new(format!(
                "LoRA adapter '{name}': {} values, asked for shape {ne:?}",
                values.len()
            )));
        }
        let bytes = convert::pack_f32(ty, &values, ne[0])
            .map_err(|e| SourceError::new(format!("LoRA adapter '{name}': {e}")))?;
        Ok(Cow::Owned(bytes))
    }

    fn release(&self, name: &str) {
        if parse(name).is_none() {
            self.inner.release(name)
        }
    }

    /// The model's mapped bytes of its weights (left unchanged at run time); adapters are
    /// formed when read.
    fn mapped(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Option<MappedBytes>, SourceError> {
        match parse(name) {
            Some(_) => Ok(None),
            None => self.inner.mapped(name, ty, ne),
        }
    }
}

/// What one module's weights are like, for [`resolve`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ModuleWeights {
    /// Some of the adapted weights are quantized.
    pub quantized: bool,
    /// The parameters live elsewhere than on the computing device (RAM, disk, another device).
    pub off_device: bool,
    /// The module's matrices are cut by rows over several devices (a graph-level row split).
    pub row_split: bool,
}

/// The mode `requested` gives a module whose weights are `m`, with the reason.
///
/// `auto` follows the reference's rule (stable-diffusion.cpp's `src/stable-diffusion.cpp`:
/// runtime application when a weight is quantized or the diffusion parameters are off the
/// computing device, else merging), taken per module here, and adds the row split (backend.md:
/// row-split tensors take runtime application): a merge would requantize quantized weights,
/// and would be redone at every staging for parameters kept off the device. `immediately`
/// stays what was asked; with a row split the merge happens before the weight is cut.
pub fn resolve(requested: super::ApplyMode, m: &ModuleWeights) -> (super::ApplyMode, &'static str) {
    use super::ApplyMode::{AtRuntime, Auto, Immediately};
    match requested {
        Immediately if m.row_split => (Immediately, "as asked; merged before the weights are cut for the row split"),
        Immediately => (Immediately, "as asked"),
        AtRuntime => (AtRuntime, "as asked"),
        Auto if m.quantized => (AtRuntime, "some adapted weights are quantized (a merge would requantize them)"),
        Auto if m.row_split => {
            (AtRuntime, "the weights are cut by rows over devices (row-split tensors take runtime application)")
        }
        Auto if m.off_device => {
            (AtRuntime, "the parameters live off the computing device (a merge would be redone at every staging)")
        }
        Auto => (Immediately, "f16/f32 weights on the computing device (merged once as they load)"),
    }
}
