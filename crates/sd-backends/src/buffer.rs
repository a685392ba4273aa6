//! Buffer types and buffers: where tensor data lives.
//!
//! Ownership: a [`BufferType`] is a non-owning, copyable handle that lives as
//! long as its device (forever). A [`Buffer`] owns a `ggml_backend_buffer_t`
//! and frees it on drop; tensors placed in it must not be used after that.
//! Nothing in a tensor handle keeps its buffer alive, so both ways of giving
//! tensors storage in a buffer are `unsafe` with that contract:
//! [`crate::Tensor::place_in`] and [`BufferType::alloc_ctx_tensors`] (callers
//! keep the buffer next to the context that describes its tensors, or detach
//! the tensors before dropping it).
//!
//! Threads: a buffer is `Send` but not `Sync` ([`Buffer::clear`] and
//! [`Buffer::set_usage`] write through `&self`).

use std::sync::Mutex;

use ggml_sys as sys;

use crate::context::{Context, GgmlType};
use crate::device::Device;
use crate::error::{BackendError, Result};
use crate::registry::cstr;

/// A kind of memory (device memory, host memory, pinned host memory, ...).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct BufferType {
    raw: sys::ggml_backend_buffer_type_t,
}

// SAFETY: buffer types are immutable process-lifetime descriptors.
unsafe impl Send for BufferType {}
// SAFETY: as above.
unsafe impl Sync for BufferType {}

impl std::fmt::Debug for BufferType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BufferType({})", self.name())
    }
}

impl BufferType {
    pub(crate) fn from_raw(raw: sys::ggml_backend_buffer_type_t) -> Self {
        Self { raw }
    }

    /// The raw handle.
    pub fn as_raw(self) -> sys::ggml_backend_buffer_type_t {
        self.raw
    }

    /// The buffer type's name.
    pub fn name(self) -> String {
        // SAFETY: a live buffer type returns a static name.
        unsafe { cstr(sys::ggml_backend_buft_name(self.raw)) }
    }

    /// Allocates a buffer of `size` bytes.
    pub fn alloc(self, size: usize) -> Result<Buffer> {
        // SAFETY: a live buffer type; ggml returns null on failure.
        let raw = unsafe { sys::ggml_backend_buft_alloc_buffer(self.raw, size) };
        if raw.is_null() {
            crate::rpc::check_lost()?;
            return Err(BackendError::Alloc { device: self.name(), bytes: size });
        }
        Ok(Buffer { raw })
    }

    /// Whether buffers of this type are in host memory (readable by the CPU in place).
    pub fn is_host(self) -> bool {
        // SAFETY: a live buffer type.
        unsafe { sys::ggml_backend_buft_is_host(self.raw) }
    }

    /// Alignment of tensor addresses in buffers of this type.
    pub fn alignment(self) -> usize {
        // SAFETY: a live buffer type.
        unsafe { sys::ggml_backend_buft_get_alignment(self.raw) }
    }

    /// Bytes `t` occupies in a buffer of this type (may exceed its data size: padding).
    pub fn alloc_size(self, t: crate::Tensor<'_>) -> usize {
        // SAFETY: live buffer type and tensor.
        unsafe { sys::ggml_backend_buft_get_alloc_size(self.raw, t.as_raw()) }
    }

    /// Bytes needed to allocate every tensor of `ctx` in this buffer type.
    pub fn ctx_tensors_size(self, ctx: &Context) -> usize {
        // SAFETY: live context and buffer type.
        unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft_size(ctx.as_raw(), self.raw) }
    }

    /// Allocates one buffer holding every not-yet-allocated tensor of `ctx`.
    /// Returns `Ok(None)` when the context has nothing to allocate.
    ///
    /// # Safety
    /// The tensors of `ctx` then point into the returned buffer, which they do not keep
    /// alive: the caller must not drop it while any tensor of `ctx` (or a view or graph of
    /// them) reads, writes or computes with that data; keeping the buffer next to `ctx`
    /// and dropping both together satisfies this.
    ///
    /// ```compile_fail,E0133
    /// fn f(ctx: &sd_backends::Context, buft: sd_backends::BufferType) -> sd_backends::Result<()> {
    ///     let t = ctx.new_f32(&[4]);
    ///     let buf = buft.alloc_ctx_tensors(ctx)?; // error: call to unsafe function
    ///     drop(buf);
    ///     t.set_f32(&[1.0; 4])
    /// }
    /// ```
    pub unsafe fn alloc_ctx_tensors(self, ctx: &Context) -> Result<Option<Buffer>> {
        let size = self.ctx_tensors_size(ctx);
        if size == 0 {
            return Ok(None);
        }
        // SAFETY: live context and buffer type; null means failure.
        let raw = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx.as_raw(), self.raw) };
        if raw.is_null() {
            crate::rpc::check_lost()?;
            return Err(BackendError::Alloc { device: self.name(), bytes: size });
        }
        Ok(Some(Buffer { raw }))
    }
}

/// The extra buffer types devices have reported (raw addresses): their buffers take writes
/// only (ggml's AMX and `CPU_REPACK` buffers have no `get_tensor`), so reads are refused.
static EXTRA: Mutex<Vec<usize>> = Mutex::new(Vec::new());

pub(crate) fn remember_extra(bufts: &[BufferType]) {
    let mut known = EXTRA.lock().unwrap_or_else(|e| e.into_inner());
    for b in bufts {
        if !known.contains(&(b.raw as usize)) {
            known.push(b.raw as usize);
        }
    }
}

/// Whether any device has reported an extra buffer type in this process.
pub(crate) fn any_extra() -> bool {
    !EXTRA.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
}

/// Checks that every node of `graph` that reads a tensor stored in an extra buffer type is a
/// matrix product with that tensor, itself and not a view, as its matrix, and that `device`
/// computes that product with that buffer type (`ggml_backend_dev_supports_op`). Anything
/// else would read the buffer type's private layout as if it were ggml's.
pub(crate) fn check_extra_uses(device: Device, graph: &crate::Graph<'_>) -> crate::Result<()> {
    if !any_extra() {
        return Ok(());
    }
    for i in 0..graph.n_nodes() {
        let node = graph.node(i);
        for j in 0..sys::GGML_MAX_SRC as usize {
            let Some(src) = node.src(j) else { continue };
            let root = src.storage_root();
            // SAFETY: a live tensor struct.
            let buf = unsafe { (*root.as_raw()).buffer };
            if buf.is_null() {
                continue;
            }
            // SAFETY: a live buffer.
            let buft = BufferType::from_raw(unsafe { sys::ggml_backend_buffer_get_type(buf) });
            if !buft.is_extra() {
                continue;
            }
            // SAFETY: a live tensor struct.
            let op = unsafe { (*node.as_raw()).op };
            let fine = op == sys::ggml_op::GGML_OP_MUL_MAT && j == 0 && src == root && device.supports_op(node);
            if !fine {
                return Err(BackendError::ExtraBufferUse {
                    node: node.name(),
                    op: node.op_desc(),
                    weight: root.name(),
                    buffer_type: buft.name(),
                });
            }
        }
    }
    Ok(())
}

impl BufferType {
    /// Whether this is one of a device's extra buffer types ([`Device::extra_buffer_types`]):
    /// tensors in it hold a layout of the plugin's own (repacked, converted), are written
    /// through `ggml_backend_tensor_set` and cannot be read back.
    pub fn is_extra(self) -> bool {
        EXTRA.lock().unwrap_or_else(|e| e.into_inner()).contains(&(self.raw as usize))
    }

    /// Whether a weight of type `ty` and shape `ne` (ggml order) stored in this buffer type
    /// can be the matrix of a product computed on `device`: the device's own support check
    /// (`ggml_backend_dev_supports_op`, which hands the question to the extra buffer type
    /// holding the weight) on `mul_mat(weight, x)` with an f32 activation `x` of 8 columns.
    /// The weight is given this type's zero-size placeholder buffer for the question only
    /// (ggml's way of asking, as llama.cpp's loader does); nothing is allocated.
    pub fn supports_matmul_weight(self, device: Device, ty: GgmlType, ne: &[i64]) -> bool {
        if ne.is_empty() || ne.len() > 4 || ne.iter().any(|&n| n <= 0) {
            return false;
        }
        let Ok(ctx) = Context::for_tensors(3) else { return false };
        let w = ctx.new_tensor(ty, ne);
        let x = ctx.new_f32(&[ne[0], 8]);
        let op = ctx.mul_mat(w, x);
        // SAFETY: a live buffer type; size 0 gives ggml's placeholder buffer (no memory).
        let dummy = unsafe { sys::ggml_backend_buft_alloc_buffer(self.raw, 0) };
        if dummy.is_null() {
            return false;
        }
        // SAFETY: `w` is a metadata-only tensor of `ctx` that nothing else sees; its buffer
        // field is set for the support question and cleared before the placeholder is freed.
        unsafe {
            (*w.as_raw()).buffer = dummy;
            let ok = sys::ggml_backend_dev_supports_op(device.as_raw(), op.as_raw());
            (*w.as_raw()).buffer = std::ptr::null_mut();
            sys::ggml_backend_buffer_free(dummy);
            ok
        }
    }
}

/// How a buffer is used (the scheduler prefers running ops next to weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferUsage {
    /// Anything.
    Any,
    /// Model weights.
    Weights,
    /// Compute scratch.
    Compute,
}

/// An owned allocation of device or host memory, or a CPU buffer over host memory it does
/// not own ([`Buffer::over_read_only_host_memory`]).
pub struct Buffer {
    raw: sys::ggml_backend_buffer_t,
}

/// The buffers over read-only memory alive now (raw addresses): writing a tensor of one
/// would fault, so [`crate::Tensor`]'s writes refuse them.
static READ_ONLY: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Whether `raw` is a live buffer over read-only memory.
pub(crate) fn is_read_only(raw: sys::ggml_backend_buffer_t) -> bool {
    READ_ONLY.lock().unwrap_or_else(|e| e.into_inner()).contains(&(raw as usize))
}

// SAFETY: a buffer is a handle to memory that this value owns; ggml's buffer
// functions may be called from any thread as long as calls on one buffer are not
// concurrent. Not Sync: `clear` and `set_usage` write through `&self`.
unsafe impl Send for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes)", self.size())
    }
}

impl Buffer {
    /// A CPU buffer over `len` bytes at `ptr` that stay readable and unchanged, but must not
    /// be written (a read-only memory map of a model file): tensors placed in it
    /// ([`crate::Tensor::place_in`]) use those bytes in place, with no copy; writing one of
    /// them is refused ([`BackendError::ReadOnly`]). `ptr` is rounded down to ggml's tensor
    /// alignment (32 bytes) and `len` extended to match, so the buffer may start before
    /// `ptr`; offsets of tensors are from [`Buffer::base`].
    ///
    /// # Safety
    /// The memory from `ptr` rounded down to 32 bytes to `ptr + len` stays mapped, readable
    /// and unchanged for as long as the buffer, and any tensor placed in it, is used.
    pub unsafe fn over_read_only_host_memory(ptr: *const u8, len: usize) -> Result<Buffer> {
        const TENSOR_ALIGNMENT: usize = 32;
        let pad = ptr as usize % TENSOR_ALIGNMENT;
        // SAFETY: `ptr - pad` lies in the same mapping (caller contract: mappings start
        // at page boundaries); ggml only records the pointer, and writes through the
        // buffer are refused by `is_read_only`.
        let raw = unsafe { sys::ggml_backend_cpu_buffer_from_ptr(ptr.wrapping_sub(pad).cast_mut().cast(), len + pad) };
        if raw.is_null() {
            return Err(BackendError::Alloc { device: "CPU_Mapped".into(), bytes: len + pad });
        }
        READ_ONLY.lock().unwrap_or_else(|e| e.into_inner()).push(raw as usize);
        Ok(Buffer { raw })
    }

    /// The address of the buffer's first byte (host buffers; an opaque value on devices).
    pub fn base(&self) -> *const u8 {
        // SAFETY: a live buffer.
        unsafe { sys::ggml_backend_buffer_get_base(self.raw).cast::<u8>().cast_const() }
    }

    /// Whether writes to the buffer's tensors are refused ([`Buffer::over_read_only_host_memory`]).
    pub fn is_read_only(&self) -> bool {
        is_read_only(self.raw)
    }

    /// The raw handle.
    pub fn as_raw(&self) -> sys::ggml_backend_buffer_t {
        self.raw
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        // SAFETY: a live buffer.
        unsafe { sys::ggml_backend_buffer_get_size(self.raw) }
    }

    /// Fills the buffer with a byte (nothing, for a buffer over read-only memory).
    pub fn clear(&self, value: u8) {
        if self.is_read_only() {
            return;
        }
        // SAFETY: a live buffer.
        unsafe { sys::ggml_backend_buffer_clear(self.raw, value) }
    }

    /// Marks how the buffer is used.
    pub fn set_usage(&self, usage: BufferUsage) {
        let u = match usage {
            BufferUsage::Any => sys::ggml_backend_buffer_usage::GGML_BACKEND_BUFFER_USAGE_ANY,
            BufferUsage::Weights => sys::ggml_backend_buffer_usage::GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
            BufferUsage::Compute => sys::ggml_backend_buffer_usage::GGML_BACKEND_BUFFER_USAGE_COMPUTE,
        };
        // SAFETY: a live buffer.
        unsafe { sys::ggml_backend_buffer_set_usage(self.raw, u) }
    }

    /// The buffer's type.
    pub fn buffer_type(&self) -> BufferType {
        // SAFETY: a live buffer.
        BufferType::from_raw(unsafe { sys::ggml_backend_buffer_get_type(self.raw) })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut read_only = READ_ONLY.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = read_only.iter().position(|&r| r == self.raw as usize) {
            read_only.swap_remove(i);
        }
        drop(read_only);
        // SAFETY: we own the buffer; no tensor of it is used after this (module docs).
        unsafe { sys::ggml_backend_buffer_free(self.raw) }
    }
}
