//! A module's parameters: declared as specs, placed in a buffer, filled from a source.
//!
//! Tensor names inside a [`Weights`] set are the workspace's internal names
//! (sd-models normalises file names to them). ggml limits a tensor's own name
//! to 63 bytes, which long UNet names exceed, so the ggml name is a shortened
//! form ([`short_name`]) used only for logs and debugging; lookups use the full
//! name through our own index.
//!
//! Threads: a [`Weights`] set is `Send` but not `Sync`. Its tensors are ggml structs
//! that staging and eviction rewrite through `&self` (like a `Cell`), so shared access
//! stays on one thread; the one cross-thread use, the runner's prefetch worker, gets a
//! narrow job (`Weights::fill_on_worker`) whose safety argument is local to it.
//!
//! ```compile_fail,E0277
//! fn f(w: &sd_sched::Weights) {
//!     std::thread::scope(|s| {
//!         s.spawn(|| w.nbytes()); // error: `Weights` cannot be shared between threads
//!     });
//! }
//! ```
//!
//! ```
//! fn send<T: Send>(_: T) {}
//! send(sd_sched::Weights::new(Vec::new()).unwrap());
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sd_backends::{Backend, Buffer, BufferType, BufferUsage, Context, GgmlType, Tensor};

use crate::error::{Result, SchedError};
use crate::ledger::{Evict, Ledger, Ledgers, Owner};

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

/// Why a source could not deliver a tensor: the source's own error (shown as it is, with its
/// causes).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct SourceError(Box<dyn std::error::Error + Send + Sync>);

impl SourceError {
    /// A source's error, or a message (`String` and `&str` convert).
    pub fn new(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        SourceError(cause.into())
    }
}

/// Provides tensor bytes converted to the requested type and shape.
pub trait TensorSource: Sync {
    /// The bytes of `name` as `ty` with shape `ne` (row-major ggml layout).
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> std::result::Result<Cow<'_, [u8]>, SourceError>;

    /// The caller has copied `name`'s bytes where they belong and will not read them again
    /// soon: a source backed by a memory map may drop those pages from the process (they are
    /// read again from the file on the next [`load`](Self::load)). The default does nothing.
    fn release(&self, _name: &str) {}

    /// The bytes of `name` as `ty` with shape `ne` where they already lie in memory in that
    /// form for as long as the source lives (a read-only memory map of the model file), for
    /// weights on a CPU device to use in place instead of copying them
    /// ([`Weights::use_in_place`]); `None` (the default) when they must be loaded: converted,
    /// merged with an adapter, or not mapped.
    fn mapped(&self, _name: &str, _ty: GgmlType, _ne: &[i64]) -> std::result::Result<Option<MappedBytes>, SourceError> {
        Ok(None)
    }
}

/// Bytes a [`TensorSource`] holds in memory for as long as it lives, unchanged
/// ([`TensorSource::mapped`]).
#[derive(Clone, Copy, Debug)]
pub struct MappedBytes {
    ptr: *const u8,
    len: usize,
}

impl MappedBytes {
    /// The bytes of `bytes`, promised to outlive the borrow.
    ///
    /// # Safety
    /// The memory of `bytes` stays mapped, readable and unchanged for as long as the
    /// source returning this value lives (not only for the borrow): weights placed in it
    /// keep the source and read the memory until they are dropped. Mappings start at a page
    /// boundary (the 32 bytes before `bytes`, rounded down, belong to the same mapping).
    pub unsafe fn new(bytes: &[u8]) -> Self {
        MappedBytes { ptr: bytes.as_ptr(), len: bytes.len() }
    }

    /// The address of the first byte.
    pub fn as_ptr(self) -> *const u8 {
        self.ptr
    }

    /// The length in bytes.
    pub fn len(self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(self) -> bool {
        self.len == 0
    }
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
///
/// Two ways to give it storage: [`allocate`](Self::allocate) + [`load_from`](Self::load_from)
/// (everything in one buffer, for tests and simple tools), or [`place`](Self::place), which
/// gives the set a [`ParamHome`] and splits it into groups that the [`crate::Runner`]
/// stages to the computing device, evicts and prefetches, with every device byte charged to
/// the device's [`Ledger`].
pub struct Weights {
    ctx: Context,
    buffer: Option<Buffer>,
    specs: Vec<TensorSpec>,
    index: HashMap<String, usize>,
    raw: Vec<*mut sd_backends::context::RawTensor>,
    by_raw: HashMap<usize, usize>,
    residency: Option<Residency>,
    /// Tensors that stay in the device's own buffer type whatever [`weight_buffer_type`] says
    /// (read by something other than a matrix product: [`Weights::keep_in_device_buffer`]).
    plain_only: Vec<bool>,
    /// The row chunks, when placed for a row split ([`Weights::place_rows`]).
    pub(crate) rows: Option<crate::rowsplit::RowIndex>,
    /// Low-rank adapters by the weight they adapt ([`Weights::set_adapters`]).
    pub(crate) adapters: HashMap<String, Vec<crate::adapter::Adapter>>,
    /// Whether a set pinned on a CPU device may use its source's mapped bytes in place
    /// ([`Weights::use_in_place`]).
    in_place_allowed: bool,
    /// The tensors using their source's mapped bytes in place.
    in_place: Vec<bool>,
}

/// The buffer type a parameter computed on `compute` is stored in when the set's home is
/// the computing device: the first of the backend's extra buffer types
/// ([`Backend::weight_buffer_types`]: the CPU's AMX and repacked layouts, when switched on)
/// that takes it as the matrix of a product (`BufferType::supports_matmul_weight`, the
/// device's own check), for a block-quantized 2-D matrix; the device's buffer type for
/// everything else (f16/f32 tensors, vectors, convolution kernels, and every tensor when the
/// backend has no extra types).
pub fn weight_buffer_type(compute: &Backend, spec: &TensorSpec) -> BufferType {
    let device = compute.device();
    let default = device.buffer_type();
    let matrix = spec.ne.len() >= 2 && spec.ne[2..].iter().all(|&n| n == 1);
    if !matrix || !sd_backends::convert::is_quantized(spec.ty) {
        return default;
    }
    compute
        .weight_buffer_types()
        .iter()
        .copied()
        .find(|b| b.supports_matmul_weight(device, spec.ty, &spec.ne))
        .unwrap_or(default)
}

/// Where a module's parameters live between uses (`--params-backend`).
#[derive(Clone, Debug)]
pub enum ParamHome {
    /// On the computing device: loaded once, pinned, never evicted.
    Compute,
    /// On another device (its weights buffer), copied to the computing device as needed.
    Device(Arc<Backend>),
    /// In CPU RAM (plain host memory), copied to the computing device as needed.
    Host,
    /// Nowhere: read again from the model file each time they are needed; no RAM copy kept.
    Disk,
}

impl ParamHome {
    /// A short description for logs.
    pub fn describe(&self) -> String {
        match self {
            ParamHome::Compute => "on the computing device".into(),
            ParamHome::Device(b) => format!("on {}", b.device().name()),
            ParamHome::Host => "in CPU RAM".into(),
            ParamHome::Disk => "on disk (read from the model file on demand)".into(),
        }
    }
}

/// A group of a placed weight set: its index in declaration order. Groups cross from the
/// runner's analysis to its replay as these, never as names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct GroupId(pub(crate) usize);

/// A group of tensors staged, pinned and evicted as a unit (one block's parameters).
#[derive(Debug)]
struct Group {
    /// Qualified name (`unet/input_blocks.1`).
    name: String,
    /// The computing device it runs on (an index into the residency's devices; 0 = main).
    device: usize,
    tensors: Vec<usize>,
    /// Offsets of the tensors in the group's replica buffer.
    offsets: Vec<usize>,
    /// Bytes of the replica buffer on the computing device.
    bytes: u64,
}

/// The groups a placement splits a set into, laid out before any storage exists
/// ([`Weights::plan_groups`]).
struct GroupPlan {
    groups: Vec<Group>,
    /// Each tensor's group (an index into `groups`).
    group_of_tensor: Vec<usize>,
    /// Each tensor's buffer type when the set is pinned on one device and some tensor is in
    /// one of the device's extra buffer types; `None` otherwise.
    pinned_bufts: Option<Vec<BufferType>>,
}

enum Home {
    /// One buffer on the computing device (every group pinned), or one per buffer type when
    /// some tensors are in the device's extra buffer types.
    /// Tensors used in place from the source's memory map have a read-only buffer each.
    Compute { _buffer: Option<Buffer>, _by_type: Vec<Buffer>, _mapped: Vec<Buffer> },
    /// A layer split with parameters on the computing devices: each group was loaded into a
    /// replica of its own on its own device at placement, pinned there, never evicted.
    Pinned,
    /// A mirror set on another device, charged to that device's ledger under a name.
    Device(Box<Weights>, Ledger, String),
    /// Per-tensor bytes in RAM.
    Host(Vec<HostBytes>),
    /// Re-read from the source.
    Disk,
}

/// A tensor's bytes in RAM: a copy of its own, or the source's mapped bytes
/// ([`Weights::use_in_place`]), which the residency's source keeps alive.
enum HostBytes {
    Owned(Vec<u8>),
    Mapped(MappedBytes),
}

impl HostBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            HostBytes::Owned(v) => v,
            // SAFETY: `MappedBytes` promises the memory for the source's life; the residency
            // holds the source for as long as its home, so for as long as this borrow.
            HostBytes::Mapped(m) => unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) },
        }
    }
}

struct Residency {
    module: String,
    /// The computing devices, main first, each with its ledger (one for a module on one device).
    devices: Vec<(Arc<Backend>, Ledger)>,
    home: Home,
    home_desc: String,
    src: Arc<dyn TensorSource + Send + Sync>,
    groups: Vec<Group>,
    group_of_tensor: Vec<usize>,
    /// This placement's id in the ledgers ([`crate::ledger::Owner`]).
    id: u64,
    /// The staged replicas' buffers, per group; shared with the ledgers, which may free an
    /// idle one for another allocation.
    slots: Arc<Slots>,
    copied_bytes: AtomicU64,
    copy_nanos: AtomicU64,
}

/// The replica buffers of a placed set's groups. The ledger frees an idle one through
/// [`Evict`] without touching the set's tensor structs (another thread may own them): they
/// keep the freed storage's address until the set stages the group again
/// ([`Weights::alloc_group`] detaches them first), and no graph reads them before that,
/// because a runner holds every group its segment reads and re-stages the missing ones
/// before computing.
struct Slots(Mutex<Vec<Option<Buffer>>>);

impl Slots {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<Buffer>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Evict for Slots {
    fn evict(&self, slot: usize) -> bool {
        let buf = self.lock().get_mut(slot).and_then(Option::take);
        buf.is_some()
    }
}

/// Placements so far, for [`Residency::id`].
static PLACEMENTS: AtomicU64 = AtomicU64::new(0);

/// Counters of a placed weight set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResidencyStats {
    /// Bytes copied to the computing device so far.
    pub copied_bytes: u64,
    /// Time spent copying, in nanoseconds (summed over threads).
    pub copy_nanos: u64,
}

// SAFETY: the raw pointers point into `ctx`, which this value owns and moves with it;
// every other field (buffers, the mirror set, the source) is Send. Not Sync: staging and
// eviction rewrite tensor structs through `&self` (module docs).
unsafe impl Send for Weights {}

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
        let by_raw = raw.iter().enumerate().map(|(i, r)| (*r as usize, i)).collect();
        let plain_only = vec![false; specs.len()];
        let in_place = vec![false; specs.len()];
        Ok(Self {
            ctx,
            buffer: None,
            specs,
            index,
            raw,
            by_raw,
            residency: None,
            plain_only,
            rows: None,
            adapters: HashMap::new(),
            in_place_allowed: false,
            in_place,
        })
    }

    /// Keeps the tensors `keep` selects (by internal name) in the computing device's own
    /// buffer type: tensors some graph reads with another operation than a matrix product
    /// (an embedding table gathered with `get_rows`), which an extra buffer type's layout
    /// would break ([`weight_buffer_type`]). Call before [`place`](Self::place).
    pub fn keep_in_device_buffer(&mut self, keep: &dyn Fn(&str) -> bool) {
        for (i, s) in self.specs.iter().enumerate() {
            self.plain_only[i] |= keep(&s.name);
        }
    }

    /// Lets the set, when it is pinned on a CPU device ([`ParamHome::Compute`]), use the
    /// bytes its source has mapped in memory in place ([`TensorSource::mapped`]: a model
    /// file's memory map) instead of copying them into a buffer of its own: no load time
    /// and no second copy of the weights in memory, the pages shared with the page cache. Only
    /// tensors in the device's own buffer type (not an extra one) whose mapped address is
    /// aligned to their element size are used in place; the rest are copied as usual. With
    /// parameters in RAM ([`ParamHome::Host`], any computing device) the mapped bytes are the
    /// RAM copy that replicas are staged from. The file must then not change while the set
    /// lives: it is read, not copied. Off by default; call before [`place`](Self::place).
    pub fn use_in_place(&mut self, allowed: bool) {
        self.in_place_allowed = allowed;
    }

    /// How many tensors, and bytes, use their source's mapped bytes in place.
    pub fn in_place_totals(&self) -> (usize, u64) {
        let n = self.in_place.iter().filter(|&&m| m).count();
        let bytes = (0..self.specs.len()).filter(|&i| self.in_place[i]).map(|i| self.nth(i).nbytes() as u64).sum();
        (n, bytes)
    }

    /// Places each tensor [`use_in_place`](Self::use_in_place) allows in the bytes `src`
    /// maps, one read-only buffer per tensor, and returns the buffers; `bufts` is each
    /// tensor's buffer type on the device (`default` its own).
    fn place_in_mapped(
        &mut self,
        src: &dyn TensorSource,
        bufts: Option<&[BufferType]>,
        default: BufferType,
    ) -> Result<Vec<Buffer>> {
        let mut out = Vec::new();
        for i in 0..self.specs.len() {
            if bufts.is_some_and(|b| b[i] != default) {
                continue;
            }
            let spec = &self.specs[i];
            let t = self.nth(i);
            let Some(m) = src
                .mapped(&spec.name, spec.ty, &spec.ne)
                .map_err(|e| SchedError::Source { name: spec.name.clone(), source: e })?
            else {
                continue;
            };
            // An element's alignment for floats; blocks of a quantized type at ggml's tensor
            // alignment (GGUF's default), as its kernels were written for.
            let align = match spec.ty {
                GgmlType::GGML_TYPE_F32 => 4,
                GgmlType::GGML_TYPE_F16 | GgmlType::GGML_TYPE_BF16 => 2,
                _ => 32,
            };
            if m.len() != t.nbytes() || !(m.as_ptr() as usize).is_multiple_of(align) {
                continue;
            }
            // SAFETY: `MappedBytes` promises the memory (and the 32 bytes before it) for the
            // source's life; the residency keeps the source after the buffers (`Home::Compute`
            // is dropped first), and the buffers are kept next to `self.ctx`.
            let buf = unsafe { Buffer::over_read_only_host_memory(m.as_ptr(), m.len()) }?;
            let off = m.as_ptr() as usize - buf.base() as usize;
            // SAFETY: as above; the tensor has no storage yet.
            unsafe { t.place_in(&buf, off) }?;
            self.in_place[i] = true;
            out.push(buf);
        }
        Ok(out)
    }

    /// The buffer type of each tensor when the set is pinned on `compute`
    /// ([`weight_buffer_type`], except the tensors kept in the device's buffer type).
    pub fn buffer_types_on(&self, compute: &Backend) -> Vec<BufferType> {
        let default = compute.device().buffer_type();
        self.specs
            .iter()
            .zip(&self.plain_only)
            .map(|(s, &plain)| if plain { default } else { weight_buffer_type(compute, s) })
            .collect()
    }

    /// Allocates each tensor in the buffer type `bufts` gives it (one buffer per buffer type,
    /// tensors at aligned offsets in declaration order) and returns the buffers with, per
    /// buffer, its type's name, bytes and tensor count.
    fn allocate_by_type(&self, bufts: &[BufferType]) -> Result<Vec<(Buffer, usize)>> {
        let mut kinds: Vec<BufferType> = Vec::new();
        for b in bufts {
            if !kinds.contains(b) {
                kinds.push(*b);
            }
        }
        let mut out = Vec::with_capacity(kinds.len());
        for buft in kinds {
            let members: Vec<usize> =
                (0..self.specs.len()).filter(|&i| bufts[i] == buft && !self.in_place[i]).collect();
            if members.is_empty() {
                continue;
            }
            let mut offsets = Vec::with_capacity(members.len());
            let mut size = 0usize;
            for &i in &members {
                let off = align_up(size, buft.alignment());
                offsets.push(off);
                size = off + buft.alloc_size(self.nth(i));
            }
            let size = align_up(size, buft.alignment());
            let buf = buft.alloc(size).map_err(|_| SchedError::Alloc {
                device: buft.name(),
                bytes: size,
                what: format!("{} weight tensors", members.len()),
            })?;
            buf.set_usage(BufferUsage::Weights);
            for (&i, &off) in members.iter().zip(&offsets) {
                // SAFETY: `buf` is returned to the caller, which keeps it next to `self.ctx`
                // (in `Home::Compute`) until the set is dropped, or drops it together with
                // the whole set's placement on an error; the offsets are disjoint aligned
                // ranges inside `size`.
                if let Err(e) = unsafe { self.nth(i).place_in(&buf, off) } {
                    for &j in &members {
                        // SAFETY: the placement failed before any graph used these tensors.
                        unsafe { self.nth(j).detach_storage() };
                    }
                    return Err(e.into());
                }
            }
            out.push((buf, members.len()));
        }
        Ok(out)
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
        // SAFETY: the buffer is kept in `self.buffer` (or moved into the residency's
        // `Home::Compute`), next to `self.ctx`, until the set is dropped: no tensor of the
        // context outlives it.
        let buf = unsafe { buft.alloc_ctx_tensors(&self.ctx) }.map_err(|_| SchedError::Alloc {
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

    /// Whether storage has been allocated (by [`allocate`](Self::allocate) or [`place`](Self::place)).
    pub fn is_allocated(&self) -> bool {
        self.buffer.is_some() || self.specs.is_empty() || self.residency.is_some()
    }

    /// Copies every tensor's bytes from `src`.
    pub fn load_from(&self, src: &dyn TensorSource) -> Result<()> {
        for (i, spec) in self.specs.iter().enumerate() {
            if self.in_place[i] {
                continue;
            }
            let t = self.nth(i);
            let bytes = src
                .load(&spec.name, spec.ty, &spec.ne)
                .map_err(|e| SchedError::Source { name: spec.name.clone(), source: e })?;
            t.set_bytes(&bytes)?;
            drop(bytes);
            src.release(&spec.name);
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

    /// Index of the tensor whose ggml struct is `t`, if it belongs to this set.
    pub(crate) fn index_of(&self, t: Tensor<'_>) -> Option<usize> {
        self.by_raw.get(&(t.as_raw() as usize)).copied()
    }

    pub(crate) fn nth(&self, i: usize) -> Tensor<'_> {
        // SAFETY: raw[i] was created in self.ctx, which lives as long as &self.
        unsafe { Tensor::from_raw_unchecked(self.raw[i]) }
    }
}

fn align_up(n: usize, a: usize) -> usize {
    n.div_ceil(a.max(1)) * a.max(1)
}

impl Weights {
    /// Gives the set its home and groups: `group_of` maps an internal tensor name to its
    /// group (a block), qualified here with `module`. With [`ParamHome::Compute`] every
    /// group is loaded now and pinned; otherwise the home copy is made now (another
    /// device's buffer, or RAM) or nothing is (disk), and groups are staged on demand by
    /// the runner. Device bytes are charged to the ledgers of `ledgers`.
    pub fn place(
        &mut self,
        module: &str,
        home: ParamHome,
        compute: Arc<Backend>,
        ledgers: &Ledgers,
        group_of: &dyn Fn(&str) -> String,
        src: Arc<dyn TensorSource + Send + Sync>,
    ) -> Result<()> {
        self.place_split(module, home, &[compute], &|_: &str| 0, ledgers, group_of, src)
    }

    /// [`place`](Self::place) for a module split over several computing devices (a layer
    /// split): `device_of` maps an internal tensor name to an index into `devices` (main
    /// first), and every tensor of a group must map to the same device. Each group is staged
    /// to (or, with [`ParamHome::Compute`], loaded and pinned on) its own device, charged to
    /// that device's ledger. The [`Runner`](crate::Runner) running the set must have the same
    /// devices in the same order ([`Runner::with_devices`](crate::Runner::with_devices)).
    #[allow(clippy::too_many_arguments)]
    pub fn place_split(
        &mut self,
        module: &str,
        home: ParamHome,
        devices: &[Arc<Backend>],
        device_of: &dyn Fn(&str) -> usize,
        ledgers: &Ledgers,
        group_of: &dyn Fn(&str) -> String,
        src: Arc<dyn TensorSource + Send + Sync>,
    ) -> Result<()> {
        if self.is_allocated() && !self.specs.is_empty() {
            return Err(SchedError::Invalid(format!("{module}: the weights already have storage")));
        }
        if devices.is_empty() {
            return Err(SchedError::Invalid(format!("{module}: no computing device to place the weights for")));
        }
        let plan = self.plan_groups(module, &home, devices, device_of, group_of)?;
        let devices: Vec<(Arc<Backend>, Ledger)> =
            devices.iter().map(|b| (b.clone(), ledgers.get(&b.device().name()))).collect();
        let n_groups = plan.groups.len();
        let t0 = Instant::now();
        let home_desc = home.describe();
        let home = match home {
            ParamHome::Compute if devices.len() > 1 => Home::Pinned,
            ParamHome::Compute => self.pin_on_compute(module, &devices[0], &plan, &src)?,
            ParamHome::Device(dev) => self.mirror_home(module, &dev, ledgers, &src)?,
            ParamHome::Host => self.host_home(module, &src)?,
            ParamHome::Disk => Home::Disk,
        };
        let pinned = matches!(home, Home::Compute { .. });
        let pin_each = matches!(home, Home::Pinned);
        self.residency = Some(Residency {
            module: module.to_string(),
            devices,
            home,
            home_desc: home_desc.clone(),
            src,
            id: PLACEMENTS.fetch_add(1, Ordering::Relaxed),
            slots: Arc::new(Slots(Mutex::new((0..n_groups).map(|_| None).collect()))),
            groups: plan.groups,
            group_of_tensor: plan.group_of_tensor,
            copied_bytes: AtomicU64::new(0),
            copy_nanos: AtomicU64::new(0),
        });
        if pin_each {
            self.load_each_group(n_groups)?;
        }
        tracing::debug!(
            "{module}: {} parameter tensors in {n_groups} groups, params {home_desc}, placed in {:.2} s",
            self.specs.len(),
            t0.elapsed().as_secs_f64()
        );
        if pinned {
            let r = self.residency.as_ref().expect("just set");
            r.copied_bytes.store(r.groups.iter().map(|g| g.bytes).sum(), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Splits the tensors into their groups (`group_of`, qualified with `module`), each on the
    /// device `device_of` gives, and lays each group's tensors out at aligned offsets in its
    /// replica buffer. Refuses a device index out of range and a group spread over two devices.
    fn plan_groups(
        &self,
        module: &str,
        home: &ParamHome,
        devices: &[Arc<Backend>],
        device_of: &dyn Fn(&str) -> usize,
        group_of: &dyn Fn(&str) -> String,
    ) -> Result<GroupPlan> {
        let mut groups: Vec<Group> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut group_of_tensor = Vec::with_capacity(self.specs.len());
        // A set pinned on one device may use the device's extra buffer types per tensor;
        // staged replicas and split sets keep one buffer of the device's type per group.
        let pinned_bufts = (matches!(home, ParamHome::Compute) && devices.len() == 1)
            .then(|| self.buffer_types_on(&devices[0]))
            .filter(|b| b.iter().any(|t| t.is_extra()));
        for (i, spec) in self.specs.iter().enumerate() {
            let name = format!("{module}/{}", group_of(&spec.name));
            let device = device_of(&spec.name);
            if device >= devices.len() {
                return Err(SchedError::Invalid(format!(
                    "{module}: tensor `{}` is assigned device {device} of {}",
                    spec.name,
                    devices.len()
                )));
            }
            let gi = *by_name.entry(name.clone()).or_insert_with(|| {
                groups.push(Group { name, device, tensors: Vec::new(), offsets: Vec::new(), bytes: 0 });
                groups.len() - 1
            });
            let g = &mut groups[gi];
            if g.device != device {
                return Err(SchedError::Invalid(format!(
                    "{module}: group `{}` has tensors on {} and on {} (`{}`); a group runs on one device",
                    g.name,
                    devices[g.device].device().name(),
                    devices[device].device().name(),
                    spec.name
                )));
            }
            let buft = pinned_bufts.as_ref().map_or_else(|| devices[device].device().buffer_type(), |b| b[i]);
            let off = align_up(g.bytes as usize, buft.alignment());
            g.tensors.push(i);
            g.offsets.push(off);
            g.bytes = (off + buft.alloc_size(self.nth(i))) as u64;
            group_of_tensor.push(gi);
        }
        for g in &mut groups {
            g.bytes = align_up(g.bytes as usize, devices[g.device].device().buffer_type().alignment()) as u64;
        }
        Ok(GroupPlan { groups, group_of_tensor, pinned_bufts })
    }

    /// The home of a set pinned on its one computing device: every group charged to the
    /// device's ledger as a pinned replica, and every tensor loaded now into the device's
    /// buffer type, the extra buffer types of the plan or the source's memory map
    /// ([`use_in_place`](Self::use_in_place)). On an error nothing stays charged or allocated.
    fn pin_on_compute(
        &mut self,
        module: &str,
        (compute, ledger): &(Arc<Backend>, Ledger),
        plan: &GroupPlan,
        src: &Arc<dyn TensorSource + Send + Sync>,
    ) -> Result<Home> {
        let buft = compute.device().buffer_type();
        for g in &plan.groups {
            ledger.add_replica(&g.name, g.bytes, true)?;
        }
        let mut extra = Vec::new();
        let mut mapped = Vec::new();
        let in_place =
            self.in_place_allowed && compute.device().kind() == sd_backends::DeviceKind::Cpu && buft.is_host();
        let placed = (|| -> Result<()> {
            if in_place {
                mapped = self.place_in_mapped(src.as_ref(), plan.pinned_bufts.as_deref(), buft)?;
            }
            match &plan.pinned_bufts {
                None if mapped.is_empty() => self.allocate(buft)?,
                None => extra = self.allocate_by_type(&vec![buft; self.specs.len()])?,
                Some(bufts) => extra = self.allocate_by_type(bufts)?,
            }
            self.load_from(src.as_ref())
        })();
        if let Err(e) = placed {
            if !extra.is_empty() || !mapped.is_empty() {
                for i in 0..self.specs.len() {
                    // SAFETY: the placement failed before any graph used the tensors.
                    unsafe { self.nth(i).detach_storage() };
                }
                self.in_place.iter_mut().for_each(|m| *m = false);
            }
            for g in &plan.groups {
                ledger.remove_replica(&g.name);
            }
            self.buffer = None;
            return Err(e);
        }
        self.log_pinned_buffers(module, &extra);
        Ok(Home::Compute {
            _buffer: self.buffer.take(),
            _by_type: extra.into_iter().map(|(b, _)| b).collect(),
            _mapped: mapped,
        })
    }

    /// Logs the buffers of a set pinned on its computing device: each extra buffer type's
    /// share (`extra`, with its tensor count) and the bytes used in place from the memory map.
    fn log_pinned_buffers(&self, module: &str, extra: &[(Buffer, usize)]) {
        for (b, n) in extra {
            tracing::debug!(
                "{module}: {:.1} MiB of weights in buffer type {} ({n} tensors)",
                b.size() as f64 / (1u64 << 20) as f64,
                b.buffer_type().name()
            );
        }
        let (n, bytes) = self.in_place_totals();
        if n > 0 {
            tracing::debug!(
                "{module}: {:.1} MiB of weights ({n} tensors) used in place from the model file's memory map",
                bytes as f64 / (1u64 << 20) as f64
            );
        }
    }

    /// The home of a set whose parameters live on another device `dev`: a mirror set loaded
    /// there now, charged to that device's ledger as `<module> (home)`.
    fn mirror_home(
        &self,
        module: &str,
        dev: &Backend,
        ledgers: &Ledgers,
        src: &Arc<dyn TensorSource + Send + Sync>,
    ) -> Result<Home> {
        let mut mirror = Weights::new(self.specs.clone())?;
        let mirror_ledger = ledgers.get(&dev.device().name());
        let bytes = dev.device().buffer_type().ctx_tensors_size(&mirror.ctx) as u64;
        mirror_ledger.add_replica(&format!("{module} (home)"), bytes, true)?;
        let placed = (|| -> Result<()> {
            mirror.allocate(dev.device().buffer_type())?;
            mirror.load_from(src.as_ref())
        })();
        if let Err(e) = placed {
            mirror_ledger.remove_replica(&format!("{module} (home)"));
            return Err(e);
        }
        Ok(Home::Device(Box::new(mirror), mirror_ledger, format!("{module} (home)")))
    }

    /// The home of a set whose parameters live in RAM: each tensor's bytes read from `src`
    /// now, or its mapped bytes where [`use_in_place`](Self::use_in_place) allows.
    fn host_home(&mut self, module: &str, src: &Arc<dyn TensorSource + Send + Sync>) -> Result<Home> {
        let mut bytes = Vec::with_capacity(self.specs.len());
        for (i, spec) in self.specs.iter().enumerate() {
            let err = |e| SchedError::Source { name: spec.name.clone(), source: e };
            if self.in_place_allowed {
                if let Some(m) = src.mapped(&spec.name, spec.ty, &spec.ne).map_err(err)? {
                    self.in_place[i] = true;
                    bytes.push(HostBytes::Mapped(m));
                    continue;
                }
            }
            let b = src.load(&spec.name, spec.ty, &spec.ne).map_err(err)?.into_owned();
            src.release(&spec.name);
            bytes.push(HostBytes::Owned(b));
        }
        let (n, mapped) = self.in_place_totals();
        if n > 0 {
            tracing::debug!(
                "{module}: {:.1} MiB of the parameters in RAM ({n} tensors) are the model file's memory map",
                mapped as f64 / (1u64 << 20) as f64
            );
        }
        Ok(Home::Host(bytes))
    }

    /// Loads every group of a layer split pinned on its computing devices into one pinned
    /// replica on its own device; on an error frees them all and drops the placement.
    fn load_each_group(&mut self, n_groups: usize) -> Result<()> {
        let loaded = (0..n_groups).map(GroupId).try_for_each(|g| {
            self.alloc_replica(g, true)?;
            let r = self.residency.as_ref().expect("just set");
            let job = FillJob::new(self, r, &[g], HomeCopy::Disk(r.src.as_ref()));
            job.run()
        });
        if let Err(e) = loaded {
            self.release_all_forced();
            self.residency = None;
            return Err(e);
        }
        Ok(())
    }

    /// Whether every group is pinned on the computing device (unplaced sets count as pinned).
    pub fn is_pinned(&self) -> bool {
        self.residency.as_ref().is_none_or(|r| matches!(r.home, Home::Compute { .. } | Home::Pinned))
    }

    /// Where the parameters live, for logs.
    pub fn home_description(&self) -> String {
        self.residency.as_ref().map_or_else(|| "on the computing device".into(), |r| r.home_desc.clone())
    }

    /// Where the parameters live, for a run report (unplaced sets are on the computing device).
    pub fn home_report(&self) -> crate::report::HomeReport {
        use crate::report::HomeReport;
        match self.residency.as_ref().map(|r| &r.home) {
            None | Some(Home::Compute { .. } | Home::Pinned) => HomeReport::Compute,
            Some(Home::Device(_, ledger, _)) => HomeReport::Device { device: ledger.device().to_string() },
            Some(Home::Host(_)) => HomeReport::Host,
            Some(Home::Disk) => HomeReport::Disk,
        }
    }

    /// Bytes of every staging group together and the number of groups (the whole set and 1
    /// when not placed).
    pub fn group_totals(&self) -> (u64, usize) {
        self.residency
            .as_ref()
            .map_or_else(|| (self.nbytes() as u64, 1), |r| (r.groups.iter().map(|g| g.bytes).sum(), r.groups.len()))
    }

    /// Copy counters.
    pub fn stats(&self) -> ResidencyStats {
        self.residency.as_ref().map_or_else(ResidencyStats::default, |r| ResidencyStats {
            copied_bytes: r.copied_bytes.load(Ordering::Relaxed),
            copy_nanos: r.copy_nanos.load(Ordering::Relaxed),
        })
    }

    /// Qualified group names and bytes, in declaration order (empty when not placed).
    pub(crate) fn groups(&self) -> Vec<(String, u64)> {
        self.residency.as_ref().map_or_else(Vec::new, |r| r.groups.iter().map(|g| (g.name.clone(), g.bytes)).collect())
    }

    /// The group of tensor `i`.
    pub(crate) fn group_of_tensor(&self, i: usize) -> Option<GroupId> {
        self.residency.as_ref().map(|r| GroupId(r.group_of_tensor[i]))
    }

    /// Every group by its qualified name (the planner's vocabulary), built once per schedule.
    pub(crate) fn group_ids(&self) -> HashMap<&str, GroupId> {
        self.residency.as_ref().map_or_else(HashMap::new, |r| {
            r.groups.iter().enumerate().map(|(i, g)| (g.name.as_str(), GroupId(i))).collect()
        })
    }

    /// Whether group `g` is on the computing device.
    pub(crate) fn is_resident(&self, g: GroupId) -> bool {
        match &self.residency {
            None => true,
            Some(r) => matches!(r.home, Home::Compute { .. }) || r.slots.lock()[g.0].is_some(),
        }
    }

    /// Allocates group `g`'s replica on its computing device (charged to the ledger) and
    /// places its tensors; the data is copied by [`fill_group`](Self::fill_group).
    pub(crate) fn alloc_group(&self, g: GroupId) -> Result<()> {
        self.alloc_replica(g, false)
    }

    /// [`alloc_group`](Self::alloc_group), the replica charged as pinned or not.
    fn alloc_replica(&self, g: GroupId, pinned: bool) -> Result<()> {
        let Some(r) = &self.residency else { return Ok(()) };
        if self.is_resident(g) {
            return Ok(());
        }
        let group = &r.groups[g.0];
        let (backend, ledger) = &r.devices[group.device];
        if pinned {
            ledger.add_replica(&group.name, group.bytes, true)?;
        } else {
            let slots: Arc<dyn Evict> = r.slots.clone();
            let owner = Owner { id: r.id, slot: g.0, evictor: Arc::downgrade(&slots) };
            ledger.add_evictable(&group.name, group.bytes, owner)?;
        }
        // The ledger may have freed this group's replica for another allocation: its tensors
        // still hold the old address.
        self.detach_group(g);
        let buft = backend.device().buffer_type();
        let placed = (|| -> Result<Buffer> {
            let buf = buft.alloc(group.bytes as usize).map_err(|_| SchedError::Alloc {
                device: backend.device().name(),
                bytes: group.bytes as usize,
                what: format!("the weights of {}", group.name),
            })?;
            buf.set_usage(BufferUsage::Weights);
            for (&t, &off) in group.tensors.iter().zip(&group.offsets) {
                // SAFETY: `buf` goes into `slots[g]` below and is freed only by `evict_group`,
                // which detaches these tensors first (as the error path here does before `buf`
                // drops), or by the ledger while the group is not held, after which no graph
                // reads the tensors before they are placed again (`Slots`); the offsets are
                // `place`'s layout of the group, disjoint aligned ranges inside `group.bytes`.
                if let Err(e) = unsafe { self.nth(t).place_in(&buf, off) } {
                    self.detach_group(g);
                    return Err(e.into());
                }
            }
            Ok(buf)
        })();
        match placed {
            Ok(buf) => {
                r.slots.lock()[g.0] = Some(buf);
                Ok(())
            }
            Err(e) => {
                ledger.remove_replica(&group.name);
                Err(e)
            }
        }
    }

    /// Forgets the storage of group `g`'s tensors.
    fn detach_group(&self, g: GroupId) {
        let Some(r) = &self.residency else { return };
        for &t in &r.groups[g.0].tensors {
            // SAFETY: callers detach only groups no graph about to run uses (eviction, a
            // placement that failed before anything used it, or a group about to be staged
            // again after the ledger freed its replica); graphs are rebuilt for every run, and
            // views of the old storage are re-made.
            unsafe { self.nth(t).detach_storage() };
        }
    }

    /// Copies group `g`'s data from its home into its replica, on this thread.
    pub(crate) fn fill_group(&self, g: GroupId) -> Result<()> {
        match self.fill_job(&[g]) {
            Some(job) => job.run(),
            None => Ok(()),
        }
    }

    /// The copy of `groups` from their home into their replicas, as a job for the runner's
    /// prefetch worker (`None` when there is nothing to copy: unplaced or pinned sets).
    ///
    /// # Safety
    /// Until the job is dropped, nothing but the job may read or write the data of the
    /// tensors of `groups` or rewrite their structs: no graph being computed may hold them,
    /// and none of them may be allocated, evicted or filled (`alloc_group`, `evict_group`,
    /// `fill_group`, dropping the set). Their replicas must
    /// be allocated. The job reads only those tensors, their home copies (mirror tensors of
    /// the same indices, RAM bytes, or the `Send + Sync` source) and atomic counters.
    pub(crate) unsafe fn fill_on_worker(&self, groups: &[GroupId]) -> Option<WorkerFill<'_>> {
        self.fill_job(groups).map(WorkerFill)
    }

    fn fill_job(&self, groups: &[GroupId]) -> Option<FillJob<'_>> {
        let r = self.residency.as_ref()?;
        let home = match &r.home {
            Home::Compute { .. } | Home::Pinned => return None,
            Home::Device(mirror, _, _) => HomeCopy::Device(mirror.raw.as_slice()),
            Home::Host(bytes) => HomeCopy::Host(bytes.as_slice()),
            Home::Disk => HomeCopy::Disk(r.src.as_ref()),
        };
        Some(FillJob::new(self, r, groups, home))
    }

    /// Frees group `g`'s replica (no-op for pinned or absent ones); whether there was one.
    pub(crate) fn evict_group(&self, g: GroupId) -> bool {
        let Some(r) = &self.residency else { return false };
        if matches!(r.home, Home::Compute { .. } | Home::Pinned) {
            return false;
        }
        self.free_replica(r, g)
    }

    fn free_replica(&self, r: &Residency, g: GroupId) -> bool {
        let buf = r.slots.lock()[g.0].take();
        let Some(buf) = buf else { return false };
        self.detach_group(g);
        drop(buf);
        r.devices[r.groups[g.0].device].1.remove_replica(&r.groups[g.0].name);
        true
    }

    /// Holds exactly `groups` in the ledgers (the groups a running segment reads and those
    /// being prefetched): the ledger never evicts a held replica, and evicts the others, least
    /// recently used first, when an allocation needs the room ([`crate::ledger`]). Holding
    /// marks a group used. An empty list releases every hold.
    pub(crate) fn set_in_use(&self, groups: &[GroupId]) {
        let Some(r) = &self.residency else { return };
        let mut held = vec![false; r.groups.len()];
        for g in groups {
            held[g.0] = true;
        }
        for (_, ledger) in &r.devices {
            ledger.hold_only(r.id, &|slot| held[slot]);
        }
    }

    /// Frees every replica, pinned ones included (the set is being dropped or unplaced).
    fn release_all_forced(&self) {
        let Some(r) = &self.residency else { return };
        for g in (0..r.groups.len()).map(GroupId) {
            self.free_replica(r, g);
        }
    }

    /// The computing devices' names, main first (one when not placed over a split; none when
    /// not placed).
    pub(crate) fn device_names(&self) -> Vec<String> {
        self.residency.as_ref().map_or_else(Vec::new, |r| r.devices.iter().map(|(b, _)| b.device().name()).collect())
    }

    /// Bytes of group `g`'s replica.
    pub(crate) fn group_bytes(&self, g: GroupId) -> u64 {
        self.residency.as_ref().map_or(0, |r| r.groups[g.0].bytes)
    }

    /// The index of group `g`'s computing device.
    pub(crate) fn device_of_group(&self, g: GroupId) -> usize {
        self.residency.as_ref().map_or(0, |r| r.groups[g.0].device)
    }

    /// Whether the parameters are re-read from the source at each staging (a disk home).
    pub(crate) fn is_disk_home(&self) -> bool {
        self.residency.as_ref().is_some_and(|r| matches!(r.home, Home::Disk))
    }
}

/// Where a fill copies from, borrowed from the residency.
enum HomeCopy<'w> {
    /// The mirror set's tensors (same indices).
    Device(&'w [*mut sd_backends::context::RawTensor]),
    /// Per-tensor bytes in RAM.
    Host(&'w [HostBytes]),
    /// Re-read from the source.
    Disk(&'w (dyn TensorSource + Send + Sync)),
}

/// The copy of some groups' data from their home into their allocated replicas.
struct FillJob<'w> {
    raw: &'w [*mut sd_backends::context::RawTensor],
    specs: &'w [TensorSpec],
    /// Indices of the tensors to fill.
    tensors: Vec<usize>,
    home: HomeCopy<'w>,
    /// Replica bytes of the groups (for the counters).
    bytes: u64,
    copied_bytes: &'w AtomicU64,
    copy_nanos: &'w AtomicU64,
}

impl<'w> FillJob<'w> {
    /// The copy of `groups` of `w` (placed as `r`) from `home`.
    fn new(w: &'w Weights, r: &'w Residency, groups: &[GroupId], home: HomeCopy<'w>) -> Self {
        FillJob {
            raw: &w.raw,
            specs: &w.specs,
            tensors: groups.iter().flat_map(|g| r.groups[g.0].tensors.iter().copied()).collect(),
            home,
            bytes: groups.iter().map(|g| r.groups[g.0].bytes).sum(),
            copied_bytes: &r.copied_bytes,
            copy_nanos: &r.copy_nanos,
        }
    }

    fn run(self) -> Result<()> {
        let t0 = Instant::now();
        for &i in &self.tensors {
            // SAFETY: raw[i] lives in the set's context, which outlives 'w.
            let t = unsafe { Tensor::from_raw_unchecked(self.raw[i]) };
            let spec = &self.specs[i];
            match &self.home {
                // SAFETY: the mirror's tensor i lives in the mirror set, which outlives 'w.
                HomeCopy::Device(mirror) => t.copy_from(unsafe { Tensor::from_raw_unchecked(mirror[i]) })?,
                HomeCopy::Host(bytes) => t.set_bytes(bytes[i].as_slice())?,
                HomeCopy::Disk(src) => {
                    let b = src
                        .load(&spec.name, spec.ty, &spec.ne)
                        .map_err(|e| SchedError::Source { name: spec.name.clone(), source: e })?;
                    t.set_bytes(&b)?;
                    drop(b);
                    src.release(&spec.name);
                }
            }
        }
        self.copied_bytes.fetch_add(self.bytes, Ordering::Relaxed);
        self.copy_nanos.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// A [`FillJob`] that may run on another thread ([`Weights::fill_on_worker`]).
pub(crate) struct WorkerFill<'w>(FillJob<'w>);

// SAFETY: the job holds shared borrows of `Sync` data (specs, RAM bytes, the `Send + Sync`
// source, atomics) and raw pointers to tensor structs; the contract of `fill_on_worker`
// gives the job exclusive use of the tensors it fills (and of their mirror copies) for its
// whole life, so touching them from another thread races with nothing.
unsafe impl Send for WorkerFill<'_> {}

impl WorkerFill<'_> {
    /// Copies the data; run it on the worker thread.
    pub(crate) fn run(self) -> Result<()> {
        self.0.run()
    }
}

impl Weights {
    /// The module name given to [`place`](Self::place).
    pub fn module(&self) -> Option<&str> {
        self.residency.as_ref().map(|r| r.module.as_str())
    }
}

impl Drop for Weights {
    fn drop(&mut self) {
        self.release_all_forced();
        if let Some(r) = &self.residency {
            match &r.home {
                Home::Compute { .. } => {
                    for g in &r.groups {
                        r.devices[0].1.remove_replica(&g.name);
                    }
                    // The pages of tensors used in place stay in the source's map (and in the
                    // process's resident set) until released: the set will not read them again.
                    for (spec, _) in self.specs.iter().zip(&self.in_place).filter(|(_, &m)| m) {
                        r.src.release(&spec.name);
                    }
                }
                Home::Pinned => {}
                Home::Device(_, ledger, name) => ledger.remove_replica(name),
                // Parameters in RAM that were the map: their pages go with the set.
                Home::Host(_) => {
                    for (spec, _) in self.specs.iter().zip(&self.in_place).filter(|(_, &m)| m) {
                        r.src.release(&spec.name);
                    }
                }
                Home::Disk => {}
            }
        }
    }
}
