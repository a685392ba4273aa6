//! Fuzz target: the RPC server (sd-rs's front, `rpc_front`/`rpc_guard`, before ggml's
//! server) survives any sequence of client messages, compute messages of real ops
//! included, and keeps serving. See ../README.md for what is and is not covered.

#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use sd_backends::rpc_front::{FrontConfig, Worker};
use sd_backends::rpc_guard::{serving_stack_bytes, GraphLimits};
use sd_backends::rpc_wire::{cmd, WireClient, WireTensor};
use sd_backends::{DeviceKind, PluginRegistry, PluginSearch};

/// Ops a fuzzed node may carry: those sd-rs's clients send (so the guard's rules for
/// each are exercised on both sides), and some it must refuse.
const OPS: &[u32] = &[
    0, 1, 2, 6, 7, 8, 9, 10, 12, 13, 15, 17, 18, 20, 22, 24, 27, 29, 32, 34, 35, 36, 37, 38, 39, 40, 44, 46, 50, 52,
    56, 63, 64, 68, 74, 91, 100, // the allow-list
    3, 5, 30, 48, 92, 93, 94, 95, 96, 101, 5000, // refused: ADD_ID, ACC, MUL_MAT_ID, ROPE, custom ops, out of range
];

/// One in-process ggml server behind one in-process front for the whole run.
fn server() -> &'static str {
    static ENDPOINT: OnceLock<String> = OnceLock::new();
    ENDPOINT.get_or_init(|| {
        // libFuzzer's C main does not ignore SIGPIPE as a Rust main would: writing to a
        // connection the server closed must be an error, not the end of the run
        // SAFETY: setting a signal disposition to SIG_IGN before any other thread runs.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let reg: &'static PluginRegistry =
            Box::leak(Box::new(PluginRegistry::discover(&PluginSearch::standard(vec![]))));
        let cpu = reg.devices().into_iter().find(|d| d.kind() == DeviceKind::Cpu).expect("a CPU device");
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        std::thread::Builder::new()
            .stack_size(serving_stack_bytes(&GraphLimits::default()))
            .spawn(move || sd_backends::rpc::serve(reg, "127.0.0.1", port, &[cpu], 1, None))
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = listener.local_addr().unwrap().to_string();
        let spawn = move || Ok(Worker { addr: ([127, 0, 0, 1], port).into(), child: None });
        std::thread::spawn(move || sd_backends::rpc_front::serve(listener, FrontConfig::new(1, 256 << 20), Box::new(spawn)));
        for _ in 0..200 {
            if WireClient::connect(&endpoint, Duration::from_secs(1)).is_ok() {
                return endpoint;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the RPC server did not start");
    })
}

/// A tensor description relative to the connection's buffers.
#[derive(Arbitrary, Debug)]
struct T {
    id: u8,
    ty: u8,
    /// Index into the connection's buffers; 255: a pointer the server never gave out.
    buffer: u8,
    /// Data address relative to that buffer's base.
    offset: i32,
    ne: [u16; 4],
    /// None: contiguous strides for the type; Some: these.
    nb: Option<[u32; 4]>,
    /// Index into OPS.
    op: u8,
    params: [i8; 8],
    src: [u8; 3],
    view_src: u8,
}

#[derive(Arbitrary, Debug)]
enum Msg {
    Raw { command: u8, payload: Vec<u8> },
    Alloc { size: u16 },
    Base { buffer: u8 },
    Free { buffer: u8 },
    Clear { buffer: u8, value: u8 },
    Set { t: T, offset: u64, len: u16 },
    Get { t: T, offset: u64, size: u16 },
    Memset { t: T, offset: u64, size: u64 },
    Copy { src: T, dst: T },
    Init { t: T },
    AllocSize { t: T },
    Graph { device: u32, nodes: Vec<u8>, tensors: Vec<T>, recompute: bool },
}

struct Conn {
    c: WireClient,
    /// (remote pointer, base) of each buffer allocated on this connection.
    buffers: Vec<(u64, u64)>,
}

impl Conn {
    fn wire(&self, t: &T) -> WireTensor {
        let (buf, base) = match self.buffers.get(t.buffer as usize % self.buffers.len().max(1)) {
            Some(&b) if t.buffer != 255 => b,
            _ => (0xdead_0000, 0x1000),
        };
        let ty = u32::from(t.ty % 45);
        let ne = t.ne.map(u32::from);
        let elem = [4u32, 2].get(ty as usize).copied().unwrap_or(1);
        let row = elem.wrapping_mul(ne[0]);
        let plane = row.wrapping_mul(ne[1]);
        let nb = t.nb.unwrap_or([elem, row, plane, plane.wrapping_mul(ne[2])]);
        let mut w = WireTensor {
            id: u64::from(t.id) + 1,
            ty,
            buffer: buf,
            data: base.wrapping_add_signed(i64::from(t.offset)),
            ne,
            nb,
            op: OPS[usize::from(t.op) % OPS.len()],
            flags: 16,
            ..WireTensor::default()
        };
        for (k, &p) in t.params.iter().enumerate() {
            w.op_params[k] = i32::from(p);
        }
        for (k, &s) in t.src.iter().enumerate() {
            w.src[k] = u64::from(s);
        }
        w.view_src = u64::from(t.view_src);
        w
    }

    fn buffer(&self, i: u8) -> u64 {
        self.buffers.get(i as usize % self.buffers.len().max(1)).map_or(0xdead_0000, |b| b.0)
    }

    /// Sends one message (and reads its answer). Err: the server closed the connection.
    fn send(&mut self, m: &Msg) -> std::io::Result<()> {
        match m {
            Msg::Raw { command, payload } => self.c.send(*command, payload),
            Msg::Alloc { size } => {
                let (ptr, _) = self.c.alloc_buffer(u64::from(*size))?;
                if ptr != 0 {
                    let base = self.c.buffer_base(ptr)?;
                    self.buffers.push((ptr, base));
                }
                Ok(())
            }
            Msg::Base { buffer } => {
                let b = self.buffer(*buffer);
                self.c.buffer_base(b).map(drop)
            }
            Msg::Free { buffer } => {
                let b = self.buffer(*buffer);
                self.buffers.retain(|x| x.0 != b);
                self.c.send(cmd::FREE_BUFFER, &b.to_le_bytes())
            }
            Msg::Clear { buffer, value } => {
                let mut p = self.buffer(*buffer).to_le_bytes().to_vec();
                p.push(*value);
                self.c.send(cmd::BUFFER_CLEAR, &p)
            }
            Msg::Set { t, offset, len } => {
                let w = self.wire(t);
                self.c.set_tensor(&w, *offset, &vec![0x3c; usize::from(*len)])
            }
            Msg::Get { t, offset, size } => {
                let w = self.wire(t);
                self.c.get_tensor(&w, *offset, u64::from(*size)).map(drop)
            }
            Msg::Memset { t, offset, size } => {
                let mut p = self.wire(t).to_bytes();
                p.extend(offset.to_le_bytes());
                p.extend(size.to_le_bytes());
                p.push(7);
                self.c.send(cmd::MEMSET_TENSOR, &p)
            }
            Msg::Copy { src, dst } => {
                let mut p = self.wire(src).to_bytes();
                p.extend(self.wire(dst).to_bytes());
                self.c.call(cmd::COPY_TENSOR, &p).map(drop)
            }
            Msg::Init { t } => {
                let p = self.wire(t).to_bytes();
                self.c.send(cmd::INIT_TENSOR, &p)
            }
            Msg::AllocSize { t } => {
                let mut p = 0u32.to_le_bytes().to_vec();
                p.extend(self.wire(t).to_bytes());
                for _ in 0..10 {
                    p.extend(WireTensor::default().to_bytes());
                }
                self.c.call(cmd::GET_ALLOC_SIZE, &p).map(drop)
            }
            Msg::Graph { device, nodes, tensors, recompute } => {
                let mut p = (device % 2).to_le_bytes().to_vec();
                p.extend((nodes.len() as u32).to_le_bytes());
                nodes.iter().for_each(|n| p.extend((u64::from(*n) + 1).to_le_bytes()));
                p.extend((tensors.len() as u32).to_le_bytes());
                for t in tensors {
                    p.extend(self.wire(t).to_bytes());
                }
                self.c.send(cmd::GRAPH_COMPUTE, &p)?;
                if *recompute {
                    self.c.send(cmd::GRAPH_RECOMPUTE, &(device % 2).to_le_bytes())?;
                }
                Ok(())
            }
        }
    }
}

fuzz_target!(|msgs: Vec<Msg>| {
    let endpoint = server();
    let c = WireClient::connect(endpoint, Duration::from_secs(5)).expect("the server stopped serving");
    let mut conn = Conn { c, buffers: Vec::new() };
    let _ = conn.send(&Msg::Alloc { size: 4096 });
    for m in msgs.iter().take(16) {
        if conn.send(m).is_err() {
            break;
        }
    }
    drop(conn);
    // the server must answer the next client whatever this one sent
    WireClient::connect(endpoint, Duration::from_secs(5)).expect("the server stopped serving after this input");
});
