//! Validation of ggml RPC requests before a ggml server sees them (the server side of issue 32).
//!
//! ggml's RPC server trusts its client: a GRAPH_COMPUTE may name any op (MAP_CUSTOM and
//! CUSTOM carry function pointers the server calls), any type and shape (the CPU kernels
//! assert or divide by zero on what their constructors in ggml.c would have refused), and
//! a source chain as deep as the message is long (`create_node` recurses over it). This
//! module is the check `rpc_front` runs on every request: the request's size for its
//! command, the tensors it names, and for a graph every node against an allow-list of the
//! ops sd-rs's clients send (`ops.rs`), each with the rules of its ggml constructor and of
//! the CPU kernel (types, shapes, strides, op parameters), the graph's size and depth
//! bounded and walked without recursion.
//!
//! What it cannot see: tensor *contents*. The one op of the allow-list whose safety
//! depends on data, GET_ROWS (row indices), is range-checked by the server itself
//! (`ggml-sys/patches/rpc-faults.toml`, "GET_ROWS indices"). Buffer bounds of tensors are
//! checked by the patched server, which knows the buffers.

use std::collections::HashMap;

use ggml_sys as sys;

use crate::rpc_wire::{cmd, WireTensor, TENSOR_SIZE};

/// Why a request was refused (the front closes that client's connection and logs this).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

fn refuse<T>(msg: impl Into<String>) -> Result<T, Refused> {
    Err(Refused(msg.into()))
}

/// Bounds of one GRAPH_COMPUTE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphLimits {
    /// Nodes in one graph.
    pub max_nodes: usize,
    /// Tensors (nodes, leaves and views) in one graph.
    pub max_tensors: usize,
    /// The longest chain of sources and view sources. The server builds a graph by
    /// recursion over it; its serving thread's stack is sized for this depth.
    pub max_depth: usize,
}

impl Default for GraphLimits {
    fn default() -> Self {
        // An SDXL UNet graph has about 6,000 nodes and a chain of about 3,000.
        Self { max_nodes: 1 << 17, max_tensors: 1 << 18, max_depth: 1 << 14 }
    }
}

/// Bytes of stack the serving thread needs for graphs of `max_depth` (ggml's
/// `create_node` frame is under 200 bytes; four times that, and 8 MiB for the rest).
pub fn serving_stack_bytes(limits: &GraphLimits) -> usize {
    (8 << 20) + limits.max_depth * 1024
}

/// What a command's request must measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestSize {
    /// Exactly this many bytes.
    Exactly(u64),
    /// At least this many bytes (SET_TENSOR, GRAPH_COMPUTE).
    AtLeast(u64),
}

/// The request size of a command after HELLO; `None` for a command no client may send.
pub fn request_size(command: u8) -> Option<RequestSize> {
    use RequestSize::*;
    const T: u64 = TENSOR_SIZE as u64;
    Some(match command {
        cmd::ALLOC_BUFFER => Exactly(12),
        cmd::GET_ALIGNMENT | cmd::GET_MAX_SIZE | cmd::GET_DEVICE_MEMORY | cmd::GRAPH_RECOMPUTE => Exactly(4),
        cmd::BUFFER_GET_BASE | cmd::FREE_BUFFER => Exactly(8),
        cmd::BUFFER_CLEAR => Exactly(9),
        cmd::SET_TENSOR => AtLeast(T + 9),
        cmd::SET_TENSOR_HASH | cmd::GET_TENSOR => Exactly(T + 16),
        cmd::COPY_TENSOR => Exactly(2 * T),
        cmd::GRAPH_COMPUTE => AtLeast(12),
        cmd::INIT_TENSOR => Exactly(T),
        cmd::GET_ALLOC_SIZE => Exactly(4 + 11 * T),
        cmd::DEVICE_COUNT => Exactly(0),
        cmd::MEMSET_TENSOR => Exactly(T + 17),
        _ => return None,
    })
}

/// The size of the answer to a command (`None`: it has none). GET_TENSOR answers with the
/// size it asked for.
pub fn response_size(command: u8, request: &[u8]) -> Option<u64> {
    Some(match command {
        cmd::ALLOC_BUFFER | cmd::GET_DEVICE_MEMORY => 16,
        cmd::GET_ALIGNMENT | cmd::GET_MAX_SIZE | cmd::BUFFER_GET_BASE | cmd::GET_ALLOC_SIZE => 8,
        cmd::SET_TENSOR_HASH | cmd::COPY_TENSOR => 1,
        cmd::DEVICE_COUNT => 4,
        cmd::GET_TENSOR => u64_at(request, TENSOR_SIZE + 8),
        _ => return None,
    })
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).map_or(0, |s| u32::from_le_bytes(s.try_into().unwrap_or([0; 4])))
}

/// The device index a request names, for the commands that name one.
fn request_device(command: u8, request: &[u8]) -> Option<u32> {
    match command {
        cmd::ALLOC_BUFFER
        | cmd::GET_ALIGNMENT
        | cmd::GET_MAX_SIZE
        | cmd::GET_DEVICE_MEMORY
        | cmd::GRAPH_RECOMPUTE
        | cmd::GET_ALLOC_SIZE
        | cmd::GRAPH_COMPUTE => Some(u32_at(request, 0)),
        _ => None,
    }
}

/// Checks a whole request of `command` (its size already matches [`request_size`]):
/// the device it names and every tensor in it.
pub fn check_request(command: u8, request: &[u8], n_devices: u32, limits: &GraphLimits) -> Result<(), Refused> {
    if let Some(d) = request_device(command, request) {
        if d >= n_devices {
            return refuse(format!("device {d} does not exist (the server has {n_devices})"));
        }
    }
    let tensor = |at: usize| {
        WireTensor::from_bytes(&request[at..at + TENSOR_SIZE])
            .ok_or_else(|| Refused("short tensor".into()))
            .and_then(|t| check_tensor(&t).map(|_| t))
    };
    match command {
        cmd::SET_TENSOR | cmd::SET_TENSOR_HASH | cmd::GET_TENSOR | cmd::INIT_TENSOR | cmd::MEMSET_TENSOR => {
            tensor(0).map(drop)
        }
        cmd::COPY_TENSOR => tensor(0).and_then(|_| tensor(TENSOR_SIZE)).map(drop),
        cmd::GET_ALLOC_SIZE => {
            // ggml's client asks for graph tensors, ops and sources included: the server
            // only reads their type and shape (no kernel runs)
            tensor(4)?;
            for i in 0..10 {
                let s = WireTensor::from_bytes(&request[4 + (i + 1) * TENSOR_SIZE..4 + (i + 2) * TENSOR_SIZE])
                    .unwrap_or_default();
                if s.id != 0 {
                    check_tensor(&s).map_err(|e| Refused(format!("source {i}: {e}")))?;
                }
            }
            Ok(())
        }
        cmd::GRAPH_COMPUTE => check_graph(request, n_devices, limits).map(drop),
        _ => Ok(()),
    }
}

// -- types ---------------------------------------------------------------------------

const F32: u32 = sys::ggml_type::GGML_TYPE_F32.0;
const F16: u32 = sys::ggml_type::GGML_TYPE_F16.0;
const BF16: u32 = sys::ggml_type::GGML_TYPE_BF16.0;
const I32: u32 = sys::ggml_type::GGML_TYPE_I32.0;
const FLOATS: &[u32] = &[F32, F16, BF16];

/// Weight types the CPU backend has a dot product for (MUL_MAT's src0); Q8_1 and Q8_K
/// are only ever the other operand's type.
fn has_vec_dot(ty: u32) -> bool {
    use sys::ggml_type as t;
    [
        t::GGML_TYPE_F32,
        t::GGML_TYPE_F16,
        t::GGML_TYPE_BF16,
        t::GGML_TYPE_Q4_0,
        t::GGML_TYPE_Q4_1,
        t::GGML_TYPE_Q5_0,
        t::GGML_TYPE_Q5_1,
        t::GGML_TYPE_Q8_0,
        t::GGML_TYPE_Q2_K,
        t::GGML_TYPE_Q3_K,
        t::GGML_TYPE_Q4_K,
        t::GGML_TYPE_Q5_K,
        t::GGML_TYPE_Q6_K,
        t::GGML_TYPE_IQ2_XXS,
        t::GGML_TYPE_IQ2_XS,
        t::GGML_TYPE_IQ3_XXS,
        t::GGML_TYPE_IQ1_S,
        t::GGML_TYPE_IQ4_NL,
        t::GGML_TYPE_IQ3_S,
        t::GGML_TYPE_IQ2_S,
        t::GGML_TYPE_IQ4_XS,
        t::GGML_TYPE_IQ1_M,
        t::GGML_TYPE_TQ1_0,
        t::GGML_TYPE_TQ2_0,
        t::GGML_TYPE_MXFP4,
    ]
    .iter()
    .any(|x| x.0 == ty)
}

/// GET_ROWS sources the CPU kernel reads: the dot-product types and I32.
fn get_rows_type(ty: u32) -> bool {
    has_vec_dot(ty) || ty == I32
}

/// `(block size, bytes per block)` of a type that exists (`None`: out of range or removed).
fn type_layout(ty: u32) -> Option<(u64, u64)> {
    if ty >= sys::ggml_type::GGML_TYPE_COUNT.0 {
        return None;
    }
    // SAFETY: pure functions of a type below GGML_TYPE_COUNT (ggml's type table).
    let (blck, size) = unsafe { (sys::ggml_blck_size(sys::ggml_type(ty)), sys::ggml_type_size(sys::ggml_type(ty))) };
    (blck > 0 && size > 0).then_some((blck as u64, size as u64))
}

fn type_label(ty: u32) -> String {
    if type_layout(ty).is_none() {
        return format!("type {ty}");
    }
    // SAFETY: a type that exists; ggml returns a static string.
    let name = unsafe { std::ffi::CStr::from_ptr(sys::ggml_type_name(sys::ggml_type(ty))) };
    name.to_string_lossy().into_owned()
}

fn op_label(op: u32) -> String {
    if op < sys::ggml_op::GGML_OP_COUNT.0 {
        // SAFETY: an op below GGML_OP_COUNT; ggml returns a static string.
        unsafe { std::ffi::CStr::from_ptr(sys::ggml_op_name(sys::ggml_op(op))) }.to_string_lossy().into_owned()
    } else {
        format!("op {op}")
    }
}

/// Element count and byte size limits of one tensor (far above any real one, far below
/// where ggml's int64 arithmetic could wrap).
const MAX_ELEMENTS: u128 = 1 << 44;
const MAX_BYTES: u128 = 1 << 50;

/// Checks one tensor on its own: a type that exists, a row length that is a whole number
/// of blocks, an element count and byte extent that cannot overflow, an op that exists.
/// Returns its byte extent (`ggml_nbytes`).
fn check_tensor(t: &WireTensor) -> Result<u64, Refused> {
    let Some((blck, size)) = type_layout(t.ty) else {
        return refuse(format!("tensor {}: {} does not exist", t.id, type_label(t.ty)));
    };
    if t.op >= sys::ggml_op::GGML_OP_COUNT.0 {
        return refuse(format!("tensor {}: op {} does not exist", t.id, t.op));
    }
    if u64::from(t.ne[0]) % blck != 0 {
        return refuse(format!(
            "tensor {}: {} rows of {} elements are not whole blocks of {blck}",
            t.id,
            type_label(t.ty),
            t.ne[0]
        ));
    }
    let count: u128 = t.ne.iter().map(|&n| u128::from(n)).product();
    if count > MAX_ELEMENTS {
        return refuse(format!("tensor {}: {count} elements", t.id));
    }
    let bytes = extent(t, blck, size);
    if bytes > MAX_BYTES {
        return refuse(format!("tensor {}: an extent of more than 2^50 bytes", t.id));
    }
    Ok(bytes as u64)
}

/// `ggml_nbytes` in 128 bits.
fn extent(t: &WireTensor, blck: u64, size: u64) -> u128 {
    if t.ne.contains(&0) {
        return 0;
    }
    let ne = t.ne.map(u128::from);
    let nb = t.nb.map(u128::from);
    let first = if blck == 1 { u128::from(size) } else { ne[0] * nb[0] / u128::from(blck) };
    let rest: u128 = (usize::from(blck != 1)..4).map(|i| (ne[i] - 1) * nb[i]).sum();
    first + rest
}

// -- graphs -----------------------------------------------------------------------------

/// The size of a checked graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphStats {
    /// Nodes computed.
    pub nodes: usize,
    /// Tensors described.
    pub tensors: usize,
    /// The longest chain of sources.
    pub depth: usize,
}

/// Checks a GRAPH_COMPUTE request:
/// `| device u32 | n_nodes u32 | node ids u64 * n | n_tensors u32 | rpc_tensor * m |`.
pub fn check_graph(payload: &[u8], n_devices: u32, limits: &GraphLimits) -> Result<GraphStats, Refused> {
    let len = payload.len() as u64;
    if len < 12 {
        return refuse(format!("a graph of {len} bytes"));
    }
    let device = u32_at(payload, 0);
    if device >= n_devices {
        return refuse(format!("device {device} does not exist (the server has {n_devices})"));
    }
    let n_nodes = u64::from(u32_at(payload, 4));
    if n_nodes == 0 || n_nodes > limits.max_nodes as u64 {
        return refuse(format!("a graph of {n_nodes} nodes (1 to {} allowed)", limits.max_nodes));
    }
    let tensors_at = 8 + 8 * n_nodes + 4;
    if len < tensors_at {
        return refuse(format!("a graph of {n_nodes} nodes in {len} bytes"));
    }
    let n_tensors = u64::from(u32_at(payload, (tensors_at - 4) as usize));
    if n_tensors > limits.max_tensors as u64 {
        return refuse(format!("a graph of {n_tensors} tensors (at most {} allowed)", limits.max_tensors));
    }
    if len != tensors_at + n_tensors * TENSOR_SIZE as u64 {
        return refuse(format!("a graph of {n_nodes} nodes and {n_tensors} tensors in {len} bytes"));
    }
    let mut tensors: HashMap<u64, WireTensor> = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors as usize {
        let at = tensors_at as usize + i * TENSOR_SIZE;
        let t = WireTensor::from_bytes(&payload[at..at + TENSOR_SIZE]).unwrap_or_default();
        if t.id == 0 {
            return refuse(format!("graph tensor {i} has id 0"));
        }
        check_tensor(&t)?;
        if t.ne.contains(&0) {
            return refuse(format!("graph tensor {} is empty (ne {:?})", t.id, t.ne));
        }
        if t.buffer == 0 {
            return refuse(format!("graph tensor {} has no buffer", t.id));
        }
        if tensors.insert(t.id, t).is_some() {
            return refuse(format!("graph tensor id {} is described twice", u64_at(payload, at)));
        }
    }
    let lookup = |id: u64, what: &str| {
        tensors.get(&id).ok_or_else(|| Refused(format!("{what} names tensor {id}, which the graph does not describe")))
    };
    let mut nodes = Vec::with_capacity(n_nodes as usize);
    let mut seen = std::collections::HashSet::with_capacity(n_nodes as usize);
    for i in 0..n_nodes as usize {
        let id = u64_at(payload, 8 + 8 * i);
        if id == 0 {
            return refuse(format!("graph node {i} has id 0"));
        }
        if !seen.insert(id) {
            return refuse(format!("graph node {i}: tensor {id} is a node twice"));
        }
        nodes.push(lookup(id, &format!("graph node {i}"))?);
    }
    // every edge names a described tensor other than itself
    for t in tensors.values() {
        for (k, &s) in t.src.iter().enumerate() {
            if s != 0 {
                // ggml_cast's result is its own destination (CPY's source 1)
                if s == t.id && !(k == 1 && t.op == sys::ggml_op::GGML_OP_CPY.0) {
                    return refuse(format!("tensor {} is its own source {k}", t.id));
                }
                lookup(s, &format!("tensor {} source {k}", t.id))?;
            }
        }
        if t.view_src != 0 {
            if t.view_src == t.id {
                return refuse(format!("tensor {} is a view of itself", t.id));
            }
            lookup(t.view_src, &format!("tensor {} view source", t.id))?;
        }
    }
    let depth = graph_depth(&tensors, limits.max_depth)?;
    for (i, node) in nodes.iter().enumerate() {
        let srcs = node.src.map(|s| (s != 0).then(|| &tensors[&s]));
        check_node(node, &srcs)
            .map_err(|e| Refused(format!("graph node {i} (tensor {}, {}): {e}", node.id, op_label(node.op))))?;
    }
    Ok(GraphStats { nodes: nodes.len(), tensors: tensors.len(), depth })
}

/// The longest chain of sources and view sources, by an iterative depth-first walk;
/// refuses a cycle and a chain longer than `max_depth`.
fn graph_depth(tensors: &HashMap<u64, WireTensor>, max_depth: usize) -> Result<usize, Refused> {
    // 0: unvisited; 1: on the stack; 2: done (depth known)
    let mut state: HashMap<u64, (u8, usize)> = HashMap::with_capacity(tensors.len());
    let mut deepest = 0;
    for &root in tensors.keys() {
        if state.contains_key(&root) {
            continue;
        }
        // (tensor, next edge to look at)
        let mut stack: Vec<(u64, usize)> = vec![(root, 0)];
        state.insert(root, (1, 0));
        while let Some(&(id, first)) = stack.last() {
            let t = &tensors[&id];
            let edges = |k: usize| if k < 10 { t.src[k] } else { t.view_src };
            let mut next = None;
            let mut k = first;
            while k < 11 {
                let s = edges(k);
                k += 1;
                if s == 0 || s == id {
                    continue;
                }
                match state.get(&s) {
                    Some((1, _)) => return refuse(format!("tensor {s} is its own source (a cycle through {id})")),
                    Some(_) => {}
                    None => {
                        next = Some(s);
                        break;
                    }
                }
            }
            if let Some(top) = stack.last_mut() {
                top.1 = k;
            }
            if let Some(s) = next {
                if stack.len() >= max_depth {
                    return refuse(format!("a chain of sources deeper than {max_depth}"));
                }
                state.insert(s, (1, 0));
                stack.push((s, 0));
                continue;
            }
            let d = 1 + (0..11).map(edges).filter(|&s| s != 0 && s != id).map(|s| state[&s].1).max().unwrap_or(0);
            if d > max_depth {
                return refuse(format!("a chain of sources deeper than {max_depth}"));
            }
            deepest = deepest.max(d);
            state.insert(id, (2, d));
            stack.pop();
        }
    }
    Ok(deepest)
}

// -- ops ----------------------------------------------------------------------------

/// Shape and stride view of a tensor, in u64.
struct Shape {
    ty: u32,
    ne: [u64; 4],
    nb: [u64; 4],
    blck: u64,
    size: u64,
}

impl Shape {
    fn of(t: &WireTensor) -> Self {
        let (blck, size) = type_layout(t.ty).unwrap_or((1, 1));
        Self { ty: t.ty, ne: t.ne.map(u64::from), nb: t.nb.map(u64::from), blck, size }
    }
    fn count(&self) -> u64 {
        self.ne.iter().product()
    }
    /// ggml_is_contiguous_n: dims above `n` packed, dims up to `n` only row-contiguous.
    fn contiguous_n(&self, n: usize) -> bool {
        let mut next = self.size;
        if self.ne[0] != self.blck && self.nb[0] != next {
            return false;
        }
        next *= self.ne[0] / self.blck;
        for i in 1..4 {
            if self.ne[i] != 1 {
                if i > n {
                    if self.nb[i] != next {
                        return false;
                    }
                    next *= self.ne[i];
                } else {
                    next = self.ne[i] * self.nb[i];
                }
            }
        }
        true
    }
    fn contiguous(&self) -> bool {
        self.contiguous_n(0)
    }
    fn rows_contiguous(&self) -> bool {
        self.nb[0] == self.size
    }
    /// Exactly the strides ggml_new_tensor gives (no exemption for dims of one element:
    /// kernels assert on those strides too, as MUL_MAT's `nb0 <= nb1 <= nb2 <= nb3`).
    fn packed(&self) -> bool {
        let nb1 = self.size * (self.ne[0] / self.blck);
        self.nb == [self.size, nb1, nb1 * self.ne[1], nb1 * self.ne[1] * self.ne[2]]
    }
}

fn ensure(ok: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(msg())
    }
}

fn type_in(what: &str, s: &Shape, allowed: &[u32]) -> Result<(), String> {
    ensure(allowed.contains(&s.ty), || {
        format!(
            "{what} is {} (allowed: {})",
            type_label(s.ty),
            allowed.iter().map(|&t| type_label(t)).collect::<Vec<_>>().join(", ")
        )
    })
}

fn same_shape(a: &Shape, b: &Shape) -> bool {
    a.ne == b.ne
}

/// ggml_can_repeat(a, b): every dim of b a multiple of a's.
fn can_repeat(a: &Shape, b: &Shape) -> bool {
    (0..4).all(|i| b.ne[i].is_multiple_of(a.ne[i]))
}

fn param_f32(t: &WireTensor, i: usize) -> f32 {
    f32::from_bits(t.op_params[i] as u32)
}

/// Unary ops of the allow-list (GGML_OP_UNARY's `op_params[0]`).
fn unary_allowed(u: i32) -> bool {
    use sys::ggml_unary_op as u_;
    [
        u_::GGML_UNARY_OP_NEG,
        u_::GGML_UNARY_OP_TANH,
        u_::GGML_UNARY_OP_RELU,
        u_::GGML_UNARY_OP_SIGMOID,
        u_::GGML_UNARY_OP_GELU,
        u_::GGML_UNARY_OP_GELU_QUICK,
        u_::GGML_UNARY_OP_SILU,
        u_::GGML_UNARY_OP_EXP,
        u_::GGML_UNARY_OP_GELU_ERF,
    ]
    .iter()
    .any(|x| x.0 as i64 == i64::from(u))
}

/// ggml_calc_conv_output_size, `None` when not positive.
fn conv_out(ins: u64, ks: u64, s: i32, p: i32, d: i32) -> Option<u64> {
    let v = (ins as i64 + 2 * i64::from(p) - i64::from(d) * (ks as i64 - 1) - 1) / i64::from(s) + 1;
    (v > 0).then_some(v as u64)
}

/// Checks one node against its op's rules. `srcs[k]` is source `k` when set.
fn check_node(t: &WireTensor, srcs: &[Option<&WireTensor>; 10]) -> Result<(), String> {
    use sys::ggml_op as o;
    let op = sys::ggml_op(t.op);
    let d = Shape::of(t);
    let n_srcs = srcs.iter().rposition(Option::is_some).map_or(0, |k| k + 1);
    // (required sources, optional sources after them)
    let arity = |req: usize, opt: usize| -> Result<Vec<Shape>, String> {
        for (k, s) in srcs.iter().enumerate().take(req) {
            ensure(s.is_some(), || format!("source {k} is missing"))?;
        }
        ensure(n_srcs <= req + opt, || format!("{n_srcs} sources (at most {})", req + opt))?;
        Ok(srcs.iter().take(req + opt).map(|s| s.map(Shape::of).unwrap_or(Shape::of(&WireTensor::default()))).collect())
    };
    let view_ops = [o::GGML_OP_RESHAPE, o::GGML_OP_VIEW, o::GGML_OP_PERMUTE, o::GGML_OP_TRANSPOSE];
    if op != o::GGML_OP_NONE && !view_ops.contains(&op) && op != o::GGML_OP_CPY {
        // the result of a computation is a tensor of its own, packed
        ensure(d.packed(), || format!("a result with strides {:?} (not packed)", d.nb))?;
    }
    match op {
        o::GGML_OP_NONE => {
            ensure(n_srcs == 0, || "a leaf with sources".into())?;
        }
        o::GGML_OP_RESHAPE | o::GGML_OP_VIEW | o::GGML_OP_PERMUTE | o::GGML_OP_TRANSPOSE => {
            let s = arity(1, 0)?;
            ensure(t.view_src != 0, || "a view without a view source".into())?;
            ensure(d.ty == s[0].ty, || "a view of another type".into())?;
            if op == o::GGML_OP_RESHAPE {
                ensure(d.count() == s[0].count() && d.contiguous(), || "a reshape to another element count".into())?;
            }
            if op == o::GGML_OP_PERMUTE || op == o::GGML_OP_TRANSPOSE {
                let (mut x, mut y) = (d.ne, s[0].ne);
                x.sort_unstable();
                y.sort_unstable();
                ensure(x == y, || "a permutation with other dimensions".into())?;
            }
        }
        o::GGML_OP_DUP | o::GGML_OP_CONT => {
            let s = arity(1, 0)?;
            type_in("the source", &s[0], &[F32, F16, BF16, I32])?;
            ensure(d.ty == s[0].ty && d.count() == s[0].count(), || "a copy of another type or size".into())?;
        }
        o::GGML_OP_CPY => {
            let s = arity(2, 0)?;
            type_in("the source", &s[0], FLOATS)?;
            type_in("the destination", &s[1], FLOATS)?;
            ensure(s[0].count() == s[1].count(), || "source and destination differ in element count".into())?;
            ensure(d.ty == s[1].ty && d.ne == s[1].ne && d.nb == s[1].nb, || {
                "the result is not its destination".into()
            })?;
            ensure(d.rows_contiguous() && s[1].rows_contiguous(), || "a destination with split rows".into())?;
        }
        o::GGML_OP_ADD | o::GGML_OP_SUB | o::GGML_OP_MUL | o::GGML_OP_DIV => {
            let s = arity(2, 0)?;
            let (a, b) = (&s[0], &s[1]);
            let types_ok = (a.ty == b.ty && d.ty == a.ty && FLOATS.contains(&a.ty))
                || ((a.ty == F16 || a.ty == BF16) && b.ty == F32 && (d.ty == a.ty || d.ty == F32));
            ensure(types_ok, || {
                format!("types {} and {} into {}", type_label(a.ty), type_label(b.ty), type_label(d.ty))
            })?;
            ensure(can_repeat(b, a) && same_shape(a, &d), || {
                format!("shapes {:?} and {:?} into {:?}", a.ne, b.ne, d.ne)
            })?;
            ensure(a.rows_contiguous(), || "a first operand with split rows".into())?;
        }
        o::GGML_OP_SQR | o::GGML_OP_SQRT | o::GGML_OP_SIN | o::GGML_OP_COS | o::GGML_OP_UNARY => {
            let s = arity(1, 0)?;
            if op == o::GGML_OP_UNARY {
                ensure(unary_allowed(t.op_params[0]), || format!("unary op {} is not served", t.op_params[0]))?;
            }
            type_in("the operand", &s[0], FLOATS)?;
            ensure(d.ty == s[0].ty && same_shape(&s[0], &d), || "a result of another type or shape".into())?;
            ensure(s[0].contiguous_n(1) && s[0].rows_contiguous(), || "an operand with split rows".into())?;
        }
        o::GGML_OP_GLU => {
            let s = arity(1, 1)?;
            ensure(t.op_params[0] == sys::ggml_glu_op::GGML_GLU_OP_GEGLU.0 as i32, || {
                format!("GLU op {} is not served", t.op_params[0])
            })?;
            ensure(matches!(t.op_params[1], 0 | 1), || format!("swapped flag {}", t.op_params[1]))?;
            type_in("the operand", &s[0], FLOATS)?;
            ensure(s[0].contiguous_n(1) && s[0].rows_contiguous() && d.ty == s[0].ty, || {
                "an operand with split rows or another type".into()
            })?;
            if srcs[1].is_some() {
                ensure(
                    same_shape(&s[0], &s[1]) && s[1].ty == s[0].ty && s[1].contiguous_n(1) && s[1].rows_contiguous(),
                    || "halves of other shapes or types".into(),
                )?;
                ensure(same_shape(&s[0], &d), || "a result of another shape".into())?;
            } else {
                let a = &s[0];
                ensure(a.ne[0] % 2 == 0 && d.ne == [a.ne[0] / 2, a.ne[1], a.ne[2], a.ne[3]], || {
                    format!("a result {:?} for an operand {:?}", d.ne, a.ne)
                })?;
            }
        }
        o::GGML_OP_SCALE => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32, BF16])?;
            ensure(d.ty == s[0].ty && same_shape(&s[0], &d) && s[0].contiguous(), || {
                "a scale of another shape".into()
            })?;
        }
        o::GGML_OP_CLAMP => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32, F16])?;
            ensure(d.ty == s[0].ty && same_shape(&s[0], &d) && s[0].rows_contiguous(), || {
                "a clamp of another shape".into()
            })?;
        }
        o::GGML_OP_NORM | o::GGML_OP_RMS_NORM | o::GGML_OP_GROUP_NORM => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32])?;
            ensure(d.ty == F32 && same_shape(&s[0], &d) && s[0].rows_contiguous(), || {
                "a norm of another shape".into()
            })?;
            let eps = param_f32(t, if op == o::GGML_OP_GROUP_NORM { 1 } else { 0 });
            ensure(eps.is_finite() && eps >= 0.0, || format!("epsilon {eps}"))?;
            if op == o::GGML_OP_GROUP_NORM {
                let g = t.op_params[0];
                ensure(g >= 1 && u64::from(g as u32) <= s[0].ne[2], || {
                    format!("{g} groups of {} channels", s[0].ne[2])
                })?;
            }
        }
        o::GGML_OP_SUM_ROWS | o::GGML_OP_MEAN => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32])?;
            let a = &s[0];
            ensure(d.ty == F32 && d.ne == [1, a.ne[1], a.ne[2], a.ne[3]] && a.rows_contiguous(), || {
                format!("a result {:?} for an operand {:?}", d.ne, a.ne)
            })?;
        }
        o::GGML_OP_ARGMAX => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32])?;
            let a = &s[0];
            ensure(a.ne[2] == 1 && a.ne[3] == 1 && a.rows_contiguous(), || "argmax of more than a matrix".into())?;
            ensure(d.ty == I32 && d.ne == [a.ne[1], 1, 1, 1], || "a result of another shape or type".into())?;
        }
        o::GGML_OP_REPEAT => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32, F16, BF16, I32])?;
            ensure(d.ty == s[0].ty && can_repeat(&s[0], &d) && s[0].rows_contiguous(), || {
                format!("{:?} does not repeat into {:?}", s[0].ne, d.ne)
            })?;
        }
        o::GGML_OP_CONCAT => {
            let s = arity(2, 0)?;
            let (a, b) = (&s[0], &s[1]);
            type_in("the first operand", a, &[F32, F16, BF16, I32])?;
            let dim = t.op_params[0];
            ensure((0..4).contains(&dim), || format!("dimension {dim}"))?;
            let dim = dim as usize;
            ensure(b.ty == a.ty && d.ty == a.ty, || "operands of other types".into())?;
            ensure(a.rows_contiguous() && b.rows_contiguous(), || "operands with split rows".into())?;
            let fits = (0..4).all(|i| {
                if i == dim {
                    d.ne[i] == a.ne[i] + b.ne[i]
                } else {
                    a.ne[i] == b.ne[i] && d.ne[i] == a.ne[i]
                }
            });
            ensure(fits, || format!("{:?} and {:?} joined on {dim} into {:?}", a.ne, b.ne, d.ne))?;
        }
        o::GGML_OP_MUL_MAT => {
            let s = arity(2, 0)?;
            let (a, b) = (&s[0], &s[1]);
            ensure(has_vec_dot(a.ty), || format!("weights of type {} (no matrix product)", type_label(a.ty)))?;
            ensure(b.ty == F32 || ((a.ty == F16 || a.ty == BF16) && b.ty == a.ty), || {
                format!("{} times {}", type_label(a.ty), type_label(b.ty))
            })?;
            ensure(a.ne[0] == b.ne[0] && b.ne[2] % a.ne[2] == 0 && b.ne[3] % a.ne[3] == 0, || {
                format!("{:?} times {:?}", a.ne, b.ne)
            })?;
            ensure(a.nb[0] == a.size && a.nb[0] <= a.nb[1] && b.nb[0] == b.size, || "transposed operands".into())?;
            ensure(d.ty == F32 && d.ne == [a.ne[1], b.ne[1], b.ne[2], b.ne[3]], || {
                format!("a result {:?} of {}", d.ne, type_label(d.ty))
            })?;
        }
        o::GGML_OP_GET_ROWS => {
            let s = arity(2, 0)?;
            let (a, b) = (&s[0], &s[1]);
            ensure(get_rows_type(a.ty), || format!("rows of {}", type_label(a.ty)))?;
            type_in("the indices", b, &[I32])?;
            ensure(a.ne[2] == b.ne[1] && a.ne[3] == b.ne[2] && b.ne[3] == 1 && b.rows_contiguous(), || {
                format!("indices {:?} for rows {:?}", b.ne, a.ne)
            })?;
            let ty = if a.ty == I32 { I32 } else { F32 };
            ensure(d.ty == ty && d.ne == [a.ne[0], b.ne[0], b.ne[1], b.ne[2]], || "a result of another shape".into())?;
        }
        o::GGML_OP_DIAG_MASK_INF | o::GGML_OP_SOFT_MAX => {
            let soft = op == o::GGML_OP_SOFT_MAX;
            let s = arity(1, if soft { 2 } else { 0 })?;
            type_in("the operand", &s[0], &[F32])?;
            let a = &s[0];
            ensure(d.ty == F32 && same_shape(a, &d) && a.contiguous(), || "a result of another shape".into())?;
            if !soft {
                ensure(t.op_params[0] >= 0, || format!("n_past {}", t.op_params[0]))?;
            }
            if soft && srcs[1].is_some() {
                let m = &s[1];
                type_in("the mask", m, &[F16, F32])?;
                ensure(
                    m.contiguous()
                        && m.ne[0] == a.ne[0]
                        && m.ne[1] >= a.ne[1]
                        && a.ne[2] % m.ne[2] == 0
                        && a.ne[3] % m.ne[3] == 0,
                    || format!("a mask {:?} for {:?}", m.ne, a.ne),
                )?;
            }
            if soft && srcs[2].is_some() {
                ensure(s[2].ty == F32 && s[2].ne[0] == a.ne[2], || "sinks of another shape".into())?;
            }
        }
        o::GGML_OP_IM2COL => {
            let s = arity(2, 0)?;
            let (a, b) = (&s[0], &s[1]);
            let p = &t.op_params;
            let (s0, s1, p0, p1, d0, d1, two) = (p[0], p[1], p[2], p[3], p[4], p[5], p[6]);
            ensure(s0 >= 1 && s1 >= 1 && d0 >= 1 && d1 >= 1 && p0 >= 0 && p1 >= 0 && (two == 0 || two == 1), || {
                format!("stride, padding or dilation out of range {:?}", &p[..7])
            })?;
            type_in("the kernel", a, &[F16, F32])?;
            type_in("the input", b, &[F32])?;
            type_in("the result", &d, &[F16, F32])?;
            ensure(b.nb[0] == b.size, || "an input with split rows".into())?;
            let expect = if two == 1 {
                ensure(a.ne[2] == b.ne[2], || "kernel and input channels differ".into())?;
                let oh = conv_out(b.ne[1], a.ne[1], s1, p1, d1).ok_or("the input is smaller than the kernel")?;
                let ow = conv_out(b.ne[0], a.ne[0], s0, p0, d0).ok_or("the input is smaller than the kernel")?;
                [a.ne[2] * a.ne[1] * a.ne[0], ow, oh, b.ne[3]]
            } else {
                ensure(b.ne[1] == a.ne[1] && b.ne[3] == 1, || "kernel and input channels differ".into())?;
                let ow = conv_out(b.ne[0], a.ne[0], s0, p0, d0).ok_or("the input is smaller than the kernel")?;
                [a.ne[1] * a.ne[0], ow, b.ne[2], 1]
            };
            ensure(d.ne == expect, || format!("a result {:?}, expected {expect:?}", d.ne))?;
        }
        o::GGML_OP_CONV_2D => {
            let s = arity(2, 0)?;
            let (a, b) = (&s[0], &s[1]);
            let p = &t.op_params;
            let (s0, s1, p0, p1, d0, d1) = (p[0], p[1], p[2], p[3], p[4], p[5]);
            ensure(s0 >= 1 && s1 >= 1 && d0 >= 1 && d1 >= 1 && p0 >= 0 && p1 >= 0, || {
                format!("stride, padding or dilation out of range {:?}", &p[..6])
            })?;
            type_in("the kernel", a, &[F16, F32])?;
            type_in("the input", b, &[F32])?;
            ensure(a.contiguous() && b.rows_contiguous() && a.ne[2] == b.ne[2], || {
                "kernel and input do not fit".into()
            })?;
            let ow = conv_out(b.ne[0], a.ne[0], s0, p0, d0).ok_or("the input is smaller than the kernel")?;
            let oh = conv_out(b.ne[1], a.ne[1], s1, p1, d1).ok_or("the input is smaller than the kernel")?;
            let expect = [ow, oh, a.ne[3], b.ne[3]];
            ensure(d.ty == F32 && d.ne == expect, || format!("a result {:?}, expected {expect:?}", d.ne))?;
        }
        o::GGML_OP_UPSCALE => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32])?;
            let mode = t.op_params[0];
            // nearest (0) or bilinear (1), optionally with align-corners (flag 1 << 8)
            ensure(matches!(mode & 0xff, 0 | 1) && mode & !0x1ff == 0, || format!("scale mode {mode:#x}"))?;
            ensure(d.ty == F32 && s[0].rows_contiguous(), || "a result of another type".into())?;
        }
        o::GGML_OP_PAD => {
            let s = arity(1, 0)?;
            type_in("the operand", &s[0], &[F32])?;
            let p = &t.op_params;
            ensure(p[..8].iter().all(|&v| v >= 0) && p[8] == 0, || format!("padding {:?}", &p[..9]))?;
            let a = &s[0];
            let expect: Vec<u64> = (0..4).map(|i| a.ne[i] + p[2 * i] as u64 + p[2 * i + 1] as u64).collect();
            ensure(d.ty == F32 && d.ne[..] == expect[..] && a.rows_contiguous(), || {
                format!("a result {:?}, expected {expect:?}", d.ne)
            })?;
        }
        o::GGML_OP_TIMESTEP_EMBEDDING => {
            let s = arity(1, 0)?;
            type_in("the timesteps", &s[0], &[F32])?;
            let dim = t.op_params[0];
            ensure(dim >= 1 && t.op_params[1] >= 1, || format!("dimension {dim}, period {}", t.op_params[1]))?;
            ensure(d.ty == F32 && d.ne == [dim as u64, s[0].ne[0], 1, 1], || "a result of another shape".into())?;
        }
        o::GGML_OP_FLASH_ATTN_EXT => {
            let s = arity(3, 2)?;
            let (q, k, v) = (&s[0], &s[1], &s[2]);
            type_in("q", q, &[F32])?;
            type_in("k", k, &[F16, F32])?;
            ensure(v.ty == k.ty, || "v and k of different types".into())?;
            ensure(q.rows_contiguous() && k.rows_contiguous() && v.rows_contiguous(), || {
                "operands with split rows".into()
            })?;
            ensure(
                k.ne[0] == q.ne[0]
                    && v.ne[1] == k.ne[1]
                    && q.ne[2] % k.ne[2] == 0
                    && q.ne[2] % v.ne[2] == 0
                    && q.ne[3] == k.ne[3]
                    && q.ne[3] == v.ne[3],
                || format!("q {:?}, k {:?}, v {:?}", q.ne, k.ne, v.ne),
            )?;
            if srcs[3].is_some() {
                let m = &s[3];
                type_in("the mask", m, &[F16])?;
                ensure(
                    m.contiguous()
                        && m.ne[0] == k.ne[1]
                        && m.ne[1] >= q.ne[1]
                        && q.ne[2] % m.ne[2] == 0
                        && q.ne[3] % m.ne[3] == 0,
                    || format!("a mask {:?} for q {:?} and k {:?}", m.ne, q.ne, k.ne),
                )?;
            }
            if srcs[4].is_some() {
                ensure(s[4].ty == F32 && s[4].ne[0] == q.ne[2], || "sinks of another shape".into())?;
            }
            ensure(d.ty == F32 && d.ne == [v.ne[0], q.ne[2], q.ne[1], q.ne[3]], || {
                format!("a result {:?} for q {:?} and v {:?}", d.ne, q.ne, v.ne)
            })?;
        }
        o::GGML_OP_ROPE => {
            // ggml_rope_ext as the LLM encoders build it: normal or NeoX rotation, one I32
            // position per row of ne[2], no frequency factors.
            let s = arity(2, 0)?;
            let (a, pos) = (&s[0], &s[1]);
            type_in("the operand", a, &[F32, F16])?;
            type_in("the positions", pos, &[I32])?;
            let p = &t.op_params;
            let (n_dims, mode, n_ctx_orig) = (p[1], p[2], p[4]);
            ensure(matches!(mode, 0 | 2), || format!("rope mode {mode} (normal or NeoX only)"))?;
            ensure(n_dims >= 2 && n_dims % 2 == 0 && n_dims as u64 <= a.ne[0] && n_ctx_orig >= 0, || {
                format!("{n_dims} rotated dimensions of {} (context {n_ctx_orig})", a.ne[0])
            })?;
            ensure((5..=10).all(|i| param_f32(t, i).is_finite()) && param_f32(t, 5) > 0.0, || {
                format!("frequency parameters {:?}", (5..=10).map(|i| param_f32(t, i)).collect::<Vec<_>>())
            })?;
            ensure(pos.contiguous() && pos.ne == [a.ne[2], 1, 1, 1], || {
                format!("positions {:?} for {:?} (one per row of ne[2])", pos.ne, a.ne)
            })?;
            ensure(a.nb[0] == a.size, || "an operand with split elements".into())?;
            ensure(d.ty == a.ty && same_shape(a, &d), || "a result of another shape or type".into())?;
        }
        _ => return Err("not an op sd-rs's clients send (refused)".into()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUF: u64 = 0x1000;

    fn f32t(id: u64, ne: [u32; 4]) -> WireTensor {
        let nb = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]];
        WireTensor { id, ty: F32, buffer: BUF, data: 0x10000, ne, nb, ..WireTensor::default() }
    }

    fn node(id: u64, op: sys::ggml_op, ne: [u32; 4], srcs: &[u64]) -> WireTensor {
        let mut t = f32t(id, ne);
        t.op = op.0;
        t.flags = 16;
        t.src[..srcs.len()].copy_from_slice(srcs);
        t
    }

    fn graph(nodes: &[u64], tensors: &[WireTensor]) -> Vec<u8> {
        crate::rpc_wire::graph_payload(0, nodes, tensors)
    }

    fn check(nodes: &[u64], tensors: &[WireTensor]) -> Result<GraphStats, Refused> {
        check_graph(&graph(nodes, tensors), 1, &GraphLimits::default())
    }

    #[test]
    fn a_valid_graph_passes() {
        use sys::ggml_op as o;
        let w = f32t(1, [8, 4, 1, 1]);
        let x = f32t(2, [8, 3, 1, 1]);
        let mm = node(3, o::GGML_OP_MUL_MAT, [4, 3, 1, 1], &[1, 2]);
        let b = f32t(4, [4, 1, 1, 1]);
        let add = node(5, o::GGML_OP_ADD, [4, 3, 1, 1], &[3, 4]);
        let mut act = node(6, o::GGML_OP_UNARY, [4, 3, 1, 1], &[5]);
        act.op_params[0] = sys::ggml_unary_op::GGML_UNARY_OP_GELU.0 as i32;
        let st = check(&[3, 5, 6], &[w, x, mm, b, add, act]).unwrap();
        assert_eq!(st, GraphStats { nodes: 3, tensors: 6, depth: 4 });
    }

    /// Each case: what is wrong, the graph, and a word the refusal must contain.
    #[test]
    fn bad_graphs_are_refused_with_the_reason() {
        use sys::ggml_op as o;
        let a = f32t(1, [16, 1, 1, 1]);
        let b3 = f32t(2, [3, 1, 1, 1]);
        let mut ai = a.clone();
        ai.ty = I32;
        let mut bi = f32t(2, [16, 1, 1, 1]);
        bi.ty = I32;
        let mut di = node(3, o::GGML_OP_ADD, [16, 1, 1, 1], &[1, 2]);
        di.ty = I32;
        let mut custom = node(3, o::GGML_OP_MAP_CUSTOM1, [16, 1, 1, 1], &[1]);
        custom.op_params[..4].copy_from_slice(&[0x4141_4141, 0x4141, 0, 0]);
        let mut q81 = f32t(1, [32, 4, 1, 1]);
        q81.ty = sys::ggml_type::GGML_TYPE_Q8_1.0;
        q81.nb = [36, 36, 144, 144];
        let mut gn = node(3, o::GGML_OP_GROUP_NORM, [16, 1, 1, 1], &[1]);
        gn.op_params[0] = 0;
        let mut im = node(3, o::GGML_OP_IM2COL, [1, 1, 1, 1], &[1, 2]);
        im.op_params[..7].copy_from_slice(&[0, 1, 0, 0, 1, 1, 1]);
        let mut gelu_back = node(3, o::GGML_OP_UNARY, [16, 1, 1, 1], &[1]);
        gelu_back.op_params[0] = 99;
        let cases: Vec<(&str, Vec<u64>, Vec<WireTensor>, &str)> = vec![
            ("MAP_CUSTOM1", vec![3], vec![a.clone(), custom], "not an op"),
            ("CUSTOM", vec![3], vec![a.clone(), node(3, o::GGML_OP_CUSTOM, [16, 1, 1, 1], &[1])], "not an op"),
            ("ADD of I32", vec![3], vec![ai, bi, di], "types"),
            (
                "ADD of shapes that do not repeat",
                vec![3],
                vec![a.clone(), b3.clone(), node(3, o::GGML_OP_ADD, [16, 1, 1, 1], &[1, 2])],
                "shapes",
            ),
            ("node id 0", vec![0], vec![a.clone()], "id 0"),
            ("an unknown node", vec![9], vec![a.clone()], "does not describe"),
            ("a missing source", vec![3], vec![node(3, o::GGML_OP_ADD, [16, 1, 1, 1], &[1, 7])], "does not describe"),
            (
                "a Q8_1 weight",
                vec![3],
                vec![q81, f32t(2, [32, 1, 1, 1]), node(3, o::GGML_OP_MUL_MAT, [4, 1, 1, 1], &[1, 2])],
                "matrix product",
            ),
            ("zero groups", vec![3], vec![a.clone(), gn], "groups"),
            ("a zero stride", vec![3], vec![a.clone(), b3, im], "out of range"),
            ("an unknown unary op", vec![3], vec![a.clone(), gelu_back], "unary op"),
            (
                "a cycle",
                vec![3],
                vec![node(3, o::GGML_OP_SQR, [16, 1, 1, 1], &[4]), node(4, o::GGML_OP_SQR, [16, 1, 1, 1], &[3])],
                "cycle",
            ),
        ];
        for (what, nodes, tensors, word) in cases {
            let e = check(&nodes, &tensors).expect_err(what).0;
            assert!(e.contains(word), "{what}: {e}");
        }
    }

    /// The LLM encoders' NeoX RoPE passes; other modes, too many rotated dimensions, positions
    /// that do not cover the rows, frequency factors and NaN frequencies are refused.
    #[test]
    fn rope_is_served_within_its_rules() {
        use sys::ggml_op as o;
        let x = f32t(1, [8, 2, 3, 1]);
        let mut pos = f32t(2, [3, 1, 1, 1]);
        pos.ty = I32;
        pos.nb = [4, 12, 12, 12];
        let rope = |n_dims: i32, mode: i32, base: f32| {
            let mut r = node(3, o::GGML_OP_ROPE, [8, 2, 3, 1], &[1, 2]);
            r.op_params[1] = n_dims;
            r.op_params[2] = mode;
            r.op_params[4] = 4096;
            r.op_params[5] = base.to_bits() as i32;
            r.op_params[6] = 1f32.to_bits() as i32;
            r.op_params[8] = 1f32.to_bits() as i32;
            r
        };
        check(&[3], &[x.clone(), pos.clone(), rope(8, 2, 1e6)]).unwrap();
        check(&[3], &[x.clone(), pos.clone(), rope(4, 0, 1e4)]).unwrap();
        let mut short = pos.clone();
        short.ne = [2, 1, 1, 1];
        let mut with_factors = rope(8, 2, 1e6);
        with_factors.src[2] = 1;
        let cases: Vec<(&str, Vec<WireTensor>, &str)> = vec![
            ("mrope", vec![x.clone(), pos.clone(), rope(8, 8, 1e6)], "mode"),
            ("too many dims", vec![x.clone(), pos.clone(), rope(10, 2, 1e6)], "rotated"),
            ("odd dims", vec![x.clone(), pos.clone(), rope(7, 2, 1e6)], "rotated"),
            ("NaN base", vec![x.clone(), pos.clone(), rope(8, 2, f32::NAN)], "frequency"),
            ("short positions", vec![x.clone(), short, rope(8, 2, 1e6)], "positions"),
            ("frequency factors", vec![x.clone(), pos.clone(), with_factors], "sources"),
        ];
        for (what, tensors, word) in cases {
            let e = check(&[3], &tensors).expect_err(what).0;
            assert!(e.contains(word), "{what}: {e}");
        }
    }

    #[test]
    fn a_deep_chain_is_refused_without_recursion() {
        use sys::ggml_op as o;
        // 200,000 SQR nodes in a chain: the check walks it iteratively and stops at the limit
        let n = 200_000u64;
        let mut ts = vec![f32t(1, [4, 1, 1, 1])];
        ts.extend((2..=n).map(|id| node(id, o::GGML_OP_SQR, [4, 1, 1, 1], &[id - 1])));
        let nodes: Vec<u64> = (2..=n).collect();
        let limits = GraphLimits { max_nodes: 1 << 20, max_tensors: 1 << 20, max_depth: 1 << 14 };
        let e = check_graph(&graph(&nodes, &ts), 1, &limits).unwrap_err().0;
        assert!(e.contains("deeper than 16384"), "{e}");
        // within the limit it passes
        let short: Vec<u64> = (2..=1000).collect();
        assert_eq!(check_graph(&graph(&short, &ts[..1000]), 1, &limits).unwrap().depth, 1000);
    }

    #[test]
    fn framing_and_sizes() {
        assert!(check_graph(&[0; 8], 1, &GraphLimits::default()).is_err());
        let g = graph(&[1], &[f32t(1, [4, 1, 1, 1])]);
        assert!(check_graph(&g, 1, &GraphLimits::default()).is_ok());
        assert!(check_graph(&g, 0, &GraphLimits::default()).unwrap_err().0.contains("device 0"));
        assert!(check_graph(&g[..g.len() - 1], 1, &GraphLimits::default()).is_err());
        let mut bad = f32t(1, [1; 4]);
        bad.ne = [u32::MAX; 4];
        bad.nb = [u32::MAX; 4];
        assert!(check_tensor(&bad).is_err());
        let mut gone = f32t(1, [4, 1, 1, 1]);
        gone.ty = 4; // Q4_2, removed: block size 0
        assert!(check_tensor(&gone).unwrap_err().0.contains("does not exist"));
        assert_eq!(request_size(cmd::HELLO), None);
        assert_eq!(request_size(18), None);
        assert_eq!(request_size(cmd::GET_ALLOC_SIZE), Some(RequestSize::Exactly(4 + 11 * 296)));
    }
}
