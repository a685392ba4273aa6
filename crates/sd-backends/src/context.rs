//! ggml contexts and tensor handles.
//!
//! Ownership: a [`Context`] owns a `ggml_context` (freed on drop) and with it
//! the metadata of every tensor and graph created in it. A [`Tensor`] is a
//! copyable handle borrowed from its context (`Tensor<'ctx>`), so the borrow
//! checker keeps it from outliving the metadata. Tensor *data* lives in a
//! [`crate::Buffer`] (or in the context's own memory when it was created with
//! `no_alloc = false`); giving a tensor storage in a buffer is `unsafe`
//! ([`Tensor::place_in`], [`crate::BufferType::alloc_ctx_tensors`]) because the
//! caller must keep the buffer alive while the tensor's data is used.
//!
//! Threads: a context is `Send` (it can move to another thread with everything
//! borrowed from it) but not `Sync`, and a [`Tensor`] is neither: handles are
//! shared copies whose setters write the ggml struct through a raw pointer (like a
//! `Cell`), so they stay on the thread that owns the context. No reference to a
//! tensor struct outlives a single field read.
//!
//! A tensor handle cannot cross threads:
//!
//! ```compile_fail,E0277
//! fn send<T: Send>(_: T) {}
//! fn f(ctx: &sd_backends::Context) {
//!     send(ctx.new_f32(&[4]));
//! }
//! ```
//!
//! nor be shared between them:
//!
//! ```compile_fail,E0277
//! fn share<T: Sync>(_: &T) {}
//! fn f(ctx: &sd_backends::Context) {
//!     share(&ctx.new_f32(&[4]));
//! }
//! ```
//!
//! while the context that owns it can move (with nothing borrowed from it):
//!
//! ```
//! fn send<T: Send>(_: T) {}
//! send(sd_backends::Context::for_tensors(1).unwrap());
//! ```

use std::ffi::CStr;
use std::marker::PhantomData;
use std::ptr::NonNull;

use ggml_sys as sys;

use crate::error::{BackendError, Result};

pub use sys::ggml_type as GgmlType;
/// The raw ggml tensor struct, for handles stored outside a borrow.
pub type RawTensor = sys::ggml_tensor;

/// Most source operands a ggml operation has.
pub const MAX_SRC: usize = sys::GGML_MAX_SRC as usize;

/// An owned ggml context.
pub struct Context {
    raw: NonNull<sys::ggml_context>,
}

// SAFETY: a context is plain memory owned by this value; moving it between
// threads is fine. It is not Sync: ggml contexts are not thread-safe.
unsafe impl Send for Context {}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({:p})", self.raw)
    }
}

impl Context {
    /// A context with `mem_size` bytes of metadata (and data, unless `no_alloc`).
    pub fn new(mem_size: usize, no_alloc: bool) -> Result<Self> {
        let params = sys::ggml_init_params { mem_size, mem_buffer: std::ptr::null_mut(), no_alloc };
        // SAFETY: ggml_init allocates and returns null on failure.
        let raw = unsafe { sys::ggml_init(params) };
        NonNull::new(raw).map(|raw| Self { raw }).ok_or(BackendError::Context(mem_size))
    }

    /// A metadata-only context for `n_tensors` tensors and one graph of `graph_size` nodes.
    pub fn for_graph(n_tensors: usize, graph_size: usize) -> Result<Self> {
        // SAFETY: pure size computations.
        let size =
            unsafe { sys::ggml_tensor_overhead() * n_tensors + sys::ggml_graph_overhead_custom(graph_size, false) };
        Self::new(size + 1024, true)
    }

    /// A metadata-only context for `n_tensors` tensors (weights, inputs).
    pub fn for_tensors(n_tensors: usize) -> Result<Self> {
        // SAFETY: pure size computation.
        let size = unsafe { sys::ggml_tensor_overhead() } * n_tensors.max(1);
        Self::new(size + 1024, true)
    }

    /// The raw handle.
    pub fn as_raw(&self) -> *mut sys::ggml_context {
        self.raw.as_ptr()
    }

    /// Creates a tensor of `ty` with dims `ne` (innermost first, 1 to 4 dims).
    pub fn new_tensor(&self, ty: GgmlType, ne: &[i64]) -> Tensor<'_> {
        assert!((1..=4).contains(&ne.len()), "tensors have 1 to 4 dimensions");
        // SAFETY: live context; ne has ne.len() entries.
        let raw = unsafe { sys::ggml_new_tensor(self.as_raw(), ty, ne.len() as i32, ne.as_ptr()) };
        Tensor::from_raw(raw)
    }

    /// An f32 tensor.
    pub fn new_f32(&self, ne: &[i64]) -> Tensor<'_> {
        self.new_tensor(GgmlType::GGML_TYPE_F32, ne)
    }

    /// Looks a tensor up by its ggml name.
    pub fn get_tensor(&self, name: &str) -> Option<Tensor<'_>> {
        let c = std::ffi::CString::new(name).ok()?;
        // SAFETY: live context, NUL-terminated name.
        let raw = unsafe { sys::ggml_get_tensor(self.as_raw(), c.as_ptr()) };
        (!raw.is_null()).then(|| Tensor::from_raw(raw))
    }

    /// Every tensor of the context, in creation order.
    pub fn tensors(&self) -> Vec<Tensor<'_>> {
        let mut out = Vec::new();
        // SAFETY: live context; iteration functions return null at the end.
        let mut t = unsafe { sys::ggml_get_first_tensor(self.as_raw()) };
        while !t.is_null() {
            out.push(Tensor::from_raw(t));
            // SAFETY: t belongs to this context.
            t = unsafe { sys::ggml_get_next_tensor(self.as_raw(), t) };
        }
        out
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: we own the context; borrowed tensors cannot outlive it.
        unsafe { sys::ggml_free(self.raw.as_ptr()) }
    }
}

/// A handle to a tensor whose metadata lives in a context borrowed for `'c`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Tensor<'c> {
    raw: NonNull<sys::ggml_tensor>,
    _ctx: PhantomData<&'c Context>,
}

// Not Send, not Sync (the raw pointer makes it neither): the context it borrows is
// not Sync, and its setters write the ggml struct through a shared handle.

impl std::fmt::Debug for Tensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {:?} {:?})", self.name(), self.shape(), self.dtype())
    }
}

impl<'c> Tensor<'c> {
    pub(crate) fn from_raw(raw: *mut sys::ggml_tensor) -> Self {
        // A null here means ggml failed an allocation it does not report: a bug in
        // how we sized the context.
        Self { raw: NonNull::new(raw).expect("ggml returned a null tensor"), _ctx: PhantomData }
    }

    /// Re-borrows a raw tensor pointer.
    ///
    /// # Safety
    /// `raw` must point to a live tensor whose context outlives `'c`.
    pub unsafe fn from_raw_unchecked(raw: *mut sys::ggml_tensor) -> Self {
        Self::from_raw(raw)
    }

    /// The raw pointer.
    pub fn as_raw(self) -> *mut sys::ggml_tensor {
        self.raw.as_ptr()
    }

    /// Reads one field of the tensor struct by value, without keeping a reference to the
    /// struct (other handles may write it between two reads).
    fn field<T: Copy>(self, read: impl FnOnce(*const sys::ggml_tensor) -> T) -> T {
        read(self.raw.as_ptr())
    }

    /// Dimensions (ggml `ne`), innermost first.
    pub fn shape(self) -> [i64; 4] {
        // SAFETY: the context outlives 'c and with it the tensor struct; a by-value read.
        self.field(|p| unsafe { (*p).ne })
    }

    /// Strides in bytes.
    pub fn nb(self) -> [usize; 4] {
        // SAFETY: as in `shape`.
        self.field(|p| unsafe { (*p).nb })
    }

    /// Element type.
    pub fn dtype(self) -> GgmlType {
        // SAFETY: as in `shape`.
        self.field(|p| unsafe { (*p).type_ })
    }

    fn buffer_ptr(self) -> sys::ggml_backend_buffer_t {
        // SAFETY: as in `shape`.
        self.field(|p| unsafe { (*p).buffer })
    }

    fn data_ptr(self) -> *mut std::ffi::c_void {
        // SAFETY: as in `shape`.
        self.field(|p| unsafe { (*p).data })
    }

    fn view_src_ptr(self) -> *mut sys::ggml_tensor {
        // SAFETY: as in `shape`.
        self.field(|p| unsafe { (*p).view_src })
    }

    /// Number of elements.
    pub fn n_elements(self) -> i64 {
        self.shape().iter().product()
    }

    /// Size of the data in bytes.
    pub fn nbytes(self) -> usize {
        // SAFETY: a live tensor.
        unsafe { sys::ggml_nbytes(self.as_raw()) }
    }

    /// The operation that computes the tensor, as ggml describes it (`MUL_MAT`, `SOFT_MAX`,
    /// a unary or GLU op by its own name; `NONE` for a leaf).
    pub fn op_desc(self) -> String {
        // SAFETY: a live tensor; ggml returns a static NUL-terminated string.
        unsafe { CStr::from_ptr(sys::ggml_op_desc(self.as_raw())) }.to_string_lossy().into_owned()
    }

    /// The ggml name.
    pub fn name(self) -> String {
        // SAFETY: name is a NUL-terminated array inside the live struct; the CStr is copied
        // out before anything can write the struct again (handles stay on one thread).
        unsafe { CStr::from_ptr(std::ptr::addr_of!((*self.raw.as_ptr()).name).cast()) }.to_string_lossy().into_owned()
    }

    /// Sets the ggml name (truncated by ggml to `GGML_MAX_NAME - 1` bytes; callers
    /// that need names longer than that keep their own map).
    pub fn set_name(self, name: &str) -> Self {
        let c = std::ffi::CString::new(name.replace('\0', "")).unwrap_or_default();
        // SAFETY: live tensor, NUL-terminated name; ggml copies with truncation.
        unsafe { sys::ggml_set_name(self.as_raw(), c.as_ptr()) };
        self
    }

    /// Marks the tensor as a graph input (allocated so it can be set before compute).
    pub fn set_input(self) -> Self {
        // SAFETY: a live tensor.
        unsafe { sys::ggml_set_input(self.as_raw()) };
        self
    }

    /// Marks the tensor as a graph output (never overwritten by the allocator).
    pub fn set_output(self) -> Self {
        // SAFETY: a live tensor.
        unsafe { sys::ggml_set_output(self.as_raw()) };
        self
    }

    /// Whether the tensor has storage (a buffer or context memory).
    pub fn is_allocated(self) -> bool {
        !self.data_ptr().is_null() || !self.buffer_ptr().is_null()
    }

    /// Whether the data can be read or written: the tensor has storage, and so does the
    /// tensor its view chain ends at (a view keeps the pointer it was made with after its
    /// source's storage is detached).
    fn has_live_storage(self) -> bool {
        self.is_allocated() && self.storage_root().is_allocated()
    }

    /// The `i`-th source operand of an operation node.
    pub fn src(self, i: usize) -> Option<Tensor<'c>> {
        // SAFETY: as in `shape`.
        let src = self.field(|p| unsafe { (*p).src });
        src.get(i).and_then(|p| NonNull::new(*p)).map(|raw| Self { raw, _ctx: PhantomData })
    }

    /// The tensor this one is a view of.
    pub fn view_src(self) -> Option<Tensor<'c>> {
        NonNull::new(self.view_src_ptr()).map(|raw| Self { raw, _ctx: PhantomData })
    }

    /// The tensor whose storage this one uses: itself, or the end of its view chain.
    pub fn storage_root(self) -> Tensor<'c> {
        let mut t = self;
        while let Some(v) = t.view_src() {
            t = v;
        }
        t
    }

    /// Places a tensor without storage at `offset` inside `buffer`. Checks what ggml would
    /// abort on: existing storage, a view, and a range past the buffer's end.
    ///
    /// # Safety
    /// The tensor then points into `buffer`, which this call does not keep alive. Until the
    /// caller removes the placement with [`detach_storage`](Self::detach_storage) (or the
    /// tensor's context is freed):
    /// * `buffer` must not be dropped while any handle of the tensor, any view of it, or any
    ///   graph holding it reads or writes its data, or computes;
    /// * the range `offset..offset + alloc size` must not be handed to another tensor whose
    ///   data is used at the same time (the buffer belongs to this placement).
    ///
    /// Without this contract safe code could write freed memory:
    ///
    /// ```compile_fail,E0133
    /// fn f(ctx: &sd_backends::Context, buft: sd_backends::BufferType) -> sd_backends::Result<()> {
    ///     let t = ctx.new_f32(&[4]);
    ///     let buf = buft.alloc(1024)?;
    ///     t.place_in(&buf, 0)?; // error: call to unsafe function
    ///     drop(buf);
    ///     t.set_f32(&[1.0; 4])
    /// }
    /// ```
    ///
    /// The sound use keeps the buffer until the placement is gone:
    ///
    /// ```no_run
    /// fn f(ctx: &sd_backends::Context, buft: sd_backends::BufferType) -> sd_backends::Result<()> {
    ///     let t = ctx.new_f32(&[4]);
    ///     let buf = buft.alloc(1024)?;
    ///     // SAFETY: `buf` outlives every use of `t`'s data below; the placement is removed
    ///     // before `buf` is dropped.
    ///     unsafe { t.place_in(&buf, 0)? };
    ///     t.set_f32(&[1.0; 4])?;
    ///     // SAFETY: nothing uses the old storage after this.
    ///     unsafe { t.detach_storage() };
    ///     drop(buf);
    ///     Ok(())
    /// }
    /// ```
    pub unsafe fn place_in(self, buffer: &crate::Buffer, offset: usize) -> Result<()> {
        if self.is_allocated() || !self.view_src_ptr().is_null() {
            return Err(BackendError::Placement {
                name: self.name(),
                reason: "it already has storage or is a view".into(),
            });
        }
        // SAFETY: live buffer and tensor.
        let need = unsafe { sys::ggml_backend_buffer_get_alloc_size(buffer.as_raw(), self.as_raw()) };
        if offset.checked_add(need).is_none_or(|end| end > buffer.size()) {
            return Err(BackendError::Placement {
                name: self.name(),
                reason: format!("{need} bytes at offset {offset} do not fit a buffer of {} bytes", buffer.size()),
            });
        }
        // SAFETY: checked above: no storage, not a view, inside the buffer.
        let status = unsafe {
            let base = sys::ggml_backend_buffer_get_base(buffer.as_raw()).cast::<u8>();
            sys::ggml_backend_tensor_alloc(buffer.as_raw(), self.as_raw(), base.add(offset).cast())
        };
        if status != sys::ggml_status::GGML_STATUS_SUCCESS {
            return Err(BackendError::Placement { name: self.name(), reason: format!("ggml status {}", status.0) });
        }
        Ok(())
    }

    /// Forgets the tensor's storage (buffer and data pointer), so it can be placed again.
    ///
    /// # Safety
    /// No graph about to run may use the tensor's old storage, and the caller keeps the
    /// buffer alive or frees it separately; views made of the tensor keep the old pointer.
    pub unsafe fn detach_storage(self) {
        // SAFETY: live tensor struct; the caller upholds the rest.
        unsafe {
            (*self.as_raw()).buffer = std::ptr::null_mut();
            (*self.as_raw()).data = std::ptr::null_mut();
        }
    }

    /// Forgets the operands of a tensor already computed, so that a later graph reading it
    /// sees a leaf (backends that walk operands, like RPC's serialiser, stop here).
    ///
    /// # Safety
    /// The tensor must not be computed again by any graph.
    pub unsafe fn sever_operands(self) {
        // SAFETY: live tensor struct; the caller upholds the rest.
        unsafe { (*self.as_raw()).src = [std::ptr::null_mut(); MAX_SRC] }
    }

    /// Marks a tensor without storage as "stored elsewhere" for a measurement with ggml's
    /// measure-only allocator (which then does not count it), using a pointer that is never
    /// dereferenced. Undo with [`detach_storage`](Self::detach_storage).
    ///
    /// # Safety
    /// Nothing may read or write the tensor, compute with it or allocate a graph holding
    /// it until the marker is removed.
    pub unsafe fn mark_stored_elsewhere(self) {
        // SAFETY: live tensor struct; the pointer is the tensor's own address, unique and
        // never dereferenced while marked (caller contract).
        unsafe { (*self.as_raw()).data = self.as_raw().cast() }
    }

    /// Copies the data of `src` (same type and shape, any device) into this tensor.
    pub fn copy_from(self, src: Tensor<'_>) -> Result<()> {
        if src.nbytes() != self.nbytes()
            || src.dtype() != self.dtype()
            || !src.has_live_storage()
            || !self.has_live_storage()
        {
            return Err(BackendError::DataSize { name: self.name(), expected: self.nbytes(), got: src.nbytes() });
        }
        src.check_readable()?;
        self.check_writable()?;
        // SAFETY: both allocated with identical layout (checked).
        unsafe { sys::ggml_backend_tensor_copy(src.as_raw(), self.as_raw()) };
        crate::rpc::check_lost()
    }

    /// Copies raw bytes into the tensor's storage.
    pub fn set_bytes(self, data: &[u8]) -> Result<()> {
        self.check_size(data.len())?;
        self.check_writable()?;
        // SAFETY: allocated tensor (checked) and exactly nbytes of data.
        unsafe { sys::ggml_backend_tensor_set(self.as_raw(), data.as_ptr().cast(), 0, data.len()) };
        crate::rpc::check_lost()
    }

    /// Copies f32 values into an f32 tensor.
    pub fn set_f32(self, data: &[f32]) -> Result<()> {
        self.check_type(GgmlType::GGML_TYPE_F32)?;
        // SAFETY: reinterpreting f32s as bytes is always valid.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) };
        self.set_bytes(bytes)
    }

    /// Copies i32 values into an i32 tensor.
    pub fn set_i32(self, data: &[i32]) -> Result<()> {
        self.check_type(GgmlType::GGML_TYPE_I32)?;
        // SAFETY: reinterpreting i32s as bytes is always valid.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) };
        self.set_bytes(bytes)
    }

    /// An error when the data is used in place from read-only memory
    /// ([`crate::Buffer::over_read_only_host_memory`]).
    fn check_writable(self) -> Result<()> {
        let buf = self.storage_root().buffer_ptr();
        if !buf.is_null() && crate::buffer::is_read_only(buf) {
            return Err(BackendError::ReadOnly { name: self.name() });
        }
        Ok(())
    }

    /// An error when the data lives in an extra buffer type (write-only: see
    /// [`crate::BufferType::is_extra`]).
    fn check_readable(self) -> Result<()> {
        let buf = self.storage_root().buffer_ptr();
        if buf.is_null() {
            return Ok(());
        }
        // SAFETY: a live tensor's buffer.
        let buft = crate::BufferType::from_raw(unsafe { sys::ggml_backend_buffer_get_type(buf) });
        if buft.is_extra() {
            return Err(BackendError::WriteOnly { name: self.name(), buffer_type: buft.name() });
        }
        Ok(())
    }

    /// Reads the raw bytes.
    fn get_bytes(self) -> Result<Vec<u8>> {
        self.check_readable()?;
        if !self.has_live_storage() {
            return Err(BackendError::DataSize { name: self.name(), expected: self.nbytes(), got: 0 });
        }
        let mut out = vec![0u8; self.nbytes()];
        // SAFETY: allocated tensor; out has nbytes.
        unsafe { sys::ggml_backend_tensor_get(self.as_raw(), out.as_mut_ptr().cast(), 0, out.len()) };
        crate::rpc::check_lost()?;
        Ok(out)
    }

    /// Reads `len` bytes from `offset` of the tensor's data (clamped to its size).
    pub fn read_range(self, offset: usize, len: usize) -> Result<Vec<u8>> {
        self.check_readable()?;
        if !self.has_live_storage() {
            return Err(BackendError::DataSize { name: self.name(), expected: self.nbytes(), got: 0 });
        }
        let offset = offset.min(self.nbytes());
        let mut out = vec![0u8; len.min(self.nbytes() - offset)];
        if !out.is_empty() {
            // SAFETY: allocated tensor; the range lies inside its data.
            unsafe { sys::ggml_backend_tensor_get(self.as_raw(), out.as_mut_ptr().cast(), offset, out.len()) };
        }
        crate::rpc::check_lost()?;
        Ok(out)
    }

    /// Reads an f32 (or f16, converted) tensor.
    pub fn get_f32(self) -> Result<Vec<f32>> {
        let bytes = self.get_bytes()?;
        match self.dtype() {
            GgmlType::GGML_TYPE_F32 => {
                Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            GgmlType::GGML_TYPE_F16 => Ok(bytes
                .chunks_exact(2)
                // SAFETY: pure conversion function.
                .map(|c| unsafe { sys::ggml_fp16_to_fp32(u16::from_le_bytes([c[0], c[1]])) })
                .collect()),
            other => Err(BackendError::TypeMismatch {
                name: self.name(),
                expected: "f32 or f16".into(),
                actual: type_name(other),
            }),
        }
    }

    fn check_type(self, ty: GgmlType) -> Result<()> {
        if self.dtype() != ty {
            return Err(BackendError::TypeMismatch {
                name: self.name(),
                expected: type_name(ty),
                actual: type_name(self.dtype()),
            });
        }
        Ok(())
    }

    fn check_size(self, len: usize) -> Result<()> {
        if len != self.nbytes() || !self.has_live_storage() {
            return Err(BackendError::DataSize { name: self.name(), expected: self.nbytes(), got: len });
        }
        Ok(())
    }
}

/// Bytes of one row of `n` elements of `ty`.
pub fn row_size(ty: GgmlType, n: i64) -> usize {
    // SAFETY: pure computation.
    unsafe { sys::ggml_row_size(ty, n) }
}

/// The name of a ggml type (`f32`, `q8_0`, ...).
pub fn type_name(ty: GgmlType) -> String {
    // SAFETY: returns a static string for every type id.
    unsafe { crate::registry::cstr(sys::ggml_type_name(ty)) }
}
