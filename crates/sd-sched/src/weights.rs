//! A module's parameters: declared as specs, placed in a buffer, filled from a source.
//!
//! Tensor names inside a [`Weights`] set are the workspace's internal names
//! (sd-models normalises file names to them). ggml limits a tensor's own name
//! to 63 bytes, which long UNet names exceed, so the ggml name is a shortened
//! form ([`short_name`]) used only for logs and debugging; lookups use the full
//! name through our own index.

use std::borrow::Cow;
use std::collections::HashMap;

use sd_backends::{Buffer, BufferType, BufferUsage, Context, GgmlType, Tensor};

use crate::error::{Result, SchedError};

/// One parameter: internal name, storage type, shape (ggml order, innermost first).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// Internal name.
    pub name: String,
    /// Type the tensor is stored in on the device.
    pub ty: GgmlType,
    /// Shape, innermost first (ggml `ne`).
    pub ne: Vec<i64>,
}

/// Why a source could not deliver a tensor.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SourceError(pub String);

/// Provides tensor bytes converted to the requested type and shape.
pub trait TensorSource: Sync {
    /// The bytes of `name` as `ty` with shape `ne` (row-major ggml layout).
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> std::result::Result<Cow<'_, [u8]>, SourceError>;
}

/// A ggml-safe name: the full name if it fits in 63 bytes, else a prefix hash plus its tail.
pub fn short_name(name: &str) -> String {
    const MAX: usize = 63;
    if name.len() <= MAX {
        return name.to_string();
    }
    let mut h: u32 = 0x811c9dc5;
    for b in name.bytes() {
        h = (h ^ b as u32).wrapping_mul(0x01000193);
    }
    let head = format!("{h:08x}~");
    let keep = MAX - head.len();
    let mut start = name.len() - keep;
    while !name.is_char_boundary(start) {
        start += 1;
    }
    format!("{head}{}", &name[start..])
}

/// A set of parameter tensors with their storage.
pub struct Weights {
    ctx: Context,
    buffer: Option<Buffer>,
    specs: Vec<TensorSpec>,
    index: HashMap<String, usize>,
    raw: Vec<*mut sd_backends::context::RawTensor>,
}

// SAFETY: the raw pointers point into `ctx`, which this value owns and moves with it.
unsafe impl Send for Weights {}
// SAFETY: shared access only reads tensor metadata and copies data through ggml's
// thread-safe backend functions.
unsafe impl Sync for Weights {}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Weights({} tensors, {} bytes)", self.specs.len(), self.nbytes())
    }
}

impl Weights {
    /// Declares the tensors (metadata only; no storage yet).
    pub fn new(specs: Vec<TensorSpec>) -> Result<Self> {
        let ctx = Context::for_tensors(specs.len())?;
        let mut index = HashMap::with_capacity(specs.len());
        let mut raw = Vec::with_capacity(specs.len());
        for (i, s) in specs.iter().enumerate() {
            raw.push(ctx.new_tensor(s.ty, &s.ne).set_name(&short_name(&s.name)).as_raw());
            index.insert(s.name.clone(), i);
        }
        Ok(Self { ctx, buffer: None, specs, index, raw })
    }

    /// The declared tensors.
    pub fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// Total bytes of all tensors.
    pub fn nbytes(&self) -> usize {
        self.ctx.tensors().iter().map(|t| t.nbytes()).sum()
    }

    /// Allocates storage for every tensor in one buffer of `buft`.
    pub fn allocate(&mut self, buft: BufferType) -> Result<()> {
        let need = buft.ctx_tensors_size(&self.ctx);
        let buf = buft.alloc_ctx_tensors(&self.ctx).map_err(|_| SchedError::Alloc {
            device: buft.name(),
            bytes: need,
            what: format!("{} weight tensors", self.specs.len()),
        })?;
        if let Some(b) = &buf {
            b.set_usage(BufferUsage::Weights);
        }
        self.buffer = buf;
        Ok(())
    }

    /// Whether storage has been allocated.
    pub fn is_allocated(&self) -> bool {
        self.buffer.is_some() || self.specs.is_empty()
    }

    /// Copies every tensor's bytes from `src`.
    pub fn load_from(&self, src: &dyn TensorSource) -> Result<()> {
        for (i, spec) in self.specs.iter().enumerate() {
            let t = self.nth(i);
            let bytes = src
                .load(&spec.name, spec.ty, &spec.ne)
                .map_err(|e| SchedError::Source { name: spec.name.clone(), source: e })?;
            t.set_bytes(&bytes)?;
        }
        Ok(())
    }

    /// The tensor with internal name `name`.
    pub fn get(&self, name: &str) -> Result<Tensor<'_>> {
        let i = *self.index.get(name).ok_or_else(|| SchedError::MissingTensor(name.to_string()))?;
        Ok(self.nth(i))
    }

    /// Whether the set has a tensor named `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn nth(&self, i: usize) -> Tensor<'_> {
        // SAFETY: raw[i] was created in self.ctx, which lives as long as &self.
        unsafe { Tensor::from_raw_unchecked(self.raw[i]) }
    }
}
