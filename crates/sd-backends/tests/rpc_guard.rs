//! Thousands of random and mutated GRAPH_COMPUTE messages through the real RPC front
//! (`rpc_front`) to a real ggml RPC server on loopback, in this process: any message that
//! reached a ggml assert would end the test process. Each message is either computed (the
//! connection stays usable) or refused (the connection is closed) exactly as the guard
//! decides, and a well-behaved client is served at the end.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use ggml_sys as sys;
use sd_backends::rpc_front::{FrontConfig, Worker};
use sd_backends::rpc_guard::{self, GraphLimits};
use sd_backends::rpc_wire::{cmd, WireClient, WireTensor};
use sd_backends::{PluginRegistry, PluginSearch};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A ggml server (on a thread with the stack the guard's depth needs) behind a front.
fn start() -> String {
    let reg: &'static PluginRegistry =
        Box::leak(Box::new(PluginRegistry::discover(&PluginSearch::only(vec![std::path::PathBuf::from(
            ggml_sys::BUILD_PLUGIN_DIR,
        )]))));
    let cpu = reg.device("cpu").unwrap();
    let worker_port = free_port();
    std::thread::Builder::new()
        .stack_size(rpc_guard::serving_stack_bytes(&GraphLimits::default()))
        .spawn(move || sd_backends::rpc::serve(reg, "127.0.0.1", worker_port, &[cpu], 1, None).unwrap())
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let cfg = FrontConfig::new(1, 64 << 20);
    let spawn = move || Ok(Worker { addr: ([127, 0, 0, 1], worker_port).into(), child: None });
    std::thread::spawn(move || sd_backends::rpc_front::serve(listener, cfg, Box::new(spawn)));
    let t = Instant::now();
    while WireClient::connect(&endpoint, Duration::from_secs(2)).is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "the front did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    endpoint
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

const F32: u32 = sys::ggml_type::GGML_TYPE_F32.0;
const I32: u32 = sys::ggml_type::GGML_TYPE_I32.0;

/// A connection with one 1 MiB buffer whose tensors are laid out one after another.
struct Conn {
    c: WireClient,
    buf: u64,
    base: u64,
}

impl Conn {
    fn open(endpoint: &str) -> Self {
        let mut c = WireClient::connect(endpoint, Duration::from_secs(10)).expect("the front serves a new client");
        let (buf, size) = c.alloc_buffer(1 << 20).unwrap();
        assert!(buf != 0 && size >= 1 << 20);
        let base = c.buffer_base(buf).unwrap();
        Self { c, buf, base }
    }
}

/// A random graph of mostly well-formed nodes of the ops our clients send, then with
/// probability 1/2 one mutated field.
fn random_graph(r: &mut Rng, buf: u64, base: u64) -> (Vec<u64>, Vec<WireTensor>) {
    use sys::ggml_op as o;
    let dims = [1u32, 2, 3, 4, 8, 16];
    let mut ts: Vec<WireTensor> = Vec::new();
    let mut at = 0u64;
    let mut new = |ts: &mut Vec<WireTensor>, ty: u32, ne: [u32; 4]| {
        let id = ts.len() as u64 + 1;
        let el = if ty == sys::ggml_type::GGML_TYPE_F16.0 { 2 } else { 4 };
        let nb = [el, el * ne[0], el * ne[0] * ne[1], el * ne[0] * ne[1] * ne[2]];
        let bytes = u64::from(nb[3] * ne[3]);
        let t = WireTensor { id, ty, buffer: buf, data: base + at, ne, nb, flags: 16, ..WireTensor::default() };
        at = (at + bytes).div_ceil(64) * 64 % (1 << 19);
        ts.push(t);
        id
    };
    for _ in 0..1 + r.below(3) {
        let ne = [r.pick(&dims), r.pick(&dims), r.pick(&[1, 1, 2]), 1];
        new(&mut ts, F32, ne);
    }
    let mut nodes = Vec::new();
    for _ in 0..1 + r.below(5) {
        let a = ts[r.below(ts.len() as u64) as usize].clone();
        let (op, ne, srcs, params): (o, [u32; 4], Vec<u64>, Vec<i32>) = match r.below(12) {
            0 => {
                let row = [a.ne[0], 1, 1, 1];
                let b = new(&mut ts, F32, if r.below(2) == 0 { a.ne } else { row });
                (r.pick(&[o::GGML_OP_ADD, o::GGML_OP_SUB, o::GGML_OP_MUL, o::GGML_OP_DIV]), a.ne, vec![a.id, b], vec![])
            }
            1 => {
                let w = new(&mut ts, F32, [a.ne[0], r.pick(&dims), 1, 1]);
                let m = ts[w as usize - 1].ne[1];
                (o::GGML_OP_MUL_MAT, [m, a.ne[1], a.ne[2], a.ne[3]], vec![w, a.id], vec![])
            }
            2 => {
                let u = r.pick(&[
                    sys::ggml_unary_op::GGML_UNARY_OP_GELU,
                    sys::ggml_unary_op::GGML_UNARY_OP_SILU,
                    sys::ggml_unary_op::GGML_UNARY_OP_TANH,
                    sys::ggml_unary_op::GGML_UNARY_OP_GELU_QUICK,
                ]);
                (o::GGML_OP_UNARY, a.ne, vec![a.id], vec![u.0 as i32])
            }
            3 => (r.pick(&[o::GGML_OP_SQR, o::GGML_OP_SQRT, o::GGML_OP_SIN, o::GGML_OP_COS]), a.ne, vec![a.id], vec![]),
            4 => (o::GGML_OP_SOFT_MAX, a.ne, vec![a.id], vec![1f32.to_bits() as i32, 0]),
            5 => (o::GGML_OP_NORM, a.ne, vec![a.id], vec![1e-5f32.to_bits() as i32]),
            6 => (o::GGML_OP_SUM_ROWS, [1, a.ne[1], a.ne[2], a.ne[3]], vec![a.id], vec![]),
            7 => (o::GGML_OP_SCALE, a.ne, vec![a.id], vec![0.5f32.to_bits() as i32, 0]),
            8 => {
                let b = new(&mut ts, F32, a.ne);
                (o::GGML_OP_CONCAT, [a.ne[0] * 2, a.ne[1], a.ne[2], a.ne[3]], vec![a.id, b], vec![0])
            }
            9 => (o::GGML_OP_REPEAT, [a.ne[0], a.ne[1] * 2, a.ne[2], a.ne[3]], vec![a.id], vec![]),
            10 => {
                // indices are whatever the buffer holds: the server checks them
                let idx = new(&mut ts, I32, [r.pick(&dims), a.ne[2], a.ne[3], 1]);
                let n = ts[idx as usize - 1].ne[0];
                (o::GGML_OP_GET_ROWS, [a.ne[0], n, a.ne[2], a.ne[3]], vec![a.id, idx], vec![])
            }
            _ => (o::GGML_OP_CONT, a.ne, vec![a.id], vec![]),
        };
        let id = new(&mut ts, F32, ne);
        let t = &mut ts[id as usize - 1];
        t.op = op.0;
        t.src[..srcs.len()].copy_from_slice(&srcs);
        t.op_params[..params.len()].copy_from_slice(&params);
        nodes.push(id);
    }
    if r.below(2) == 0 {
        let n = ts.len() as u64;
        let t = &mut ts[r.below(n) as usize];
        match r.below(10) {
            0 => t.op = r.below(110) as u32,
            1 => t.ty = r.below(45) as u32,
            2 => t.ne[r.below(4) as usize] = r.pick(&[0, 3, 5, 100, u32::MAX]),
            3 => t.nb[r.below(4) as usize] = r.pick(&[0, 1, 2, 7, u32::MAX]),
            4 => t.src[r.below(3) as usize] = r.below(n + 3),
            5 => t.op_params[r.below(8) as usize] = r.pick(&[0, -1, 1, 3, i32::MAX, i32::MIN]),
            6 => t.view_src = r.below(n + 2),
            7 => t.data = t.data.wrapping_add(r.pick(&[1 << 20, u64::MAX - 8, 4])),
            8 => {
                let i = r.below(nodes.len() as u64) as usize;
                nodes[i] = r.pick(&[0, n + 1, nodes[0]]);
            }
            _ => {
                t.op =
                    r.pick(&[o::GGML_OP_MAP_CUSTOM1.0, o::GGML_OP_CUSTOM.0, o::GGML_OP_MUL_MAT_ID.0, o::GGML_OP_ROPE.0])
            }
        }
    }
    (nodes, ts)
}

fn payload(nodes: &[u64], ts: &[WireTensor]) -> Vec<u8> {
    sd_backends::rpc_wire::graph_payload(0, nodes, ts)
}

#[test]
fn random_and_mutated_graphs_never_reach_a_ggml_assert() {
    let endpoint = start();
    let mut r = Rng(0x5d_2026_1206);
    let mut conn = Conn::open(&endpoint);
    let (mut computed, mut refused_by_guard, mut refused_by_server) = (0, 0, 0);
    for i in 0..3000 {
        let (nodes, ts) = random_graph(&mut r, conn.buf, conn.base);
        let p = payload(&nodes, &ts);
        let verdict = rpc_guard::check_graph(&p, 1, &GraphLimits::default());
        conn.c.send(cmd::GRAPH_COMPUTE, &p).unwrap();
        // a call with an answer: it arrives only if the graph was accepted and computed
        let alive = conn.c.buffer_base(conn.buf).is_ok();
        match (&verdict, alive) {
            (Ok(_), true) => computed += 1,
            (Ok(_), false) => refused_by_server += 1, // the server's own checks (GET_ROWS indices, bounds)
            (Err(_), false) => refused_by_guard += 1,
            (Err(e), true) => panic!("message {i}: the guard refuses it ({e}) but the front forwarded it"),
        }
        if !alive {
            conn = Conn::open(&endpoint);
        }
    }
    eprintln!("{computed} computed, {refused_by_guard} refused by the guard, {refused_by_server} by the server");
    // neither half is empty: the generator reaches both sides of every check
    assert!(computed > 500 && refused_by_guard > 500, "{computed} computed, {refused_by_guard} refused");
    // and a well-behaved client is served (once the last one left: the one in-process
    // ggml server here serves one connection at a time)
    drop(conn);
    let mut c = Conn::open(&endpoint);
    let t = WireTensor::f32(1, c.buf, c.base, 16);
    let data: Vec<u8> = (0..64).collect();
    c.c.set_tensor(&t, 0, &data).unwrap();
    assert_eq!(c.c.get_tensor(&t, 0, 64).unwrap(), data);
}

#[test]
fn an_allocation_beyond_the_limit_fails_without_reaching_ggml() {
    let endpoint = start();
    let mut c = WireClient::connect(&endpoint, Duration::from_secs(10)).unwrap();
    // 64 MiB in all (FrontConfig above): 1 GiB is answered as a failed allocation
    assert_eq!(c.alloc_buffer(1 << 30).unwrap(), (0, 0));
    let (a, _) = c.alloc_buffer(48 << 20).unwrap();
    assert_ne!(a, 0);
    // the limit counts what is held: 32 MiB more no longer fit, until the first is freed
    assert_eq!(c.alloc_buffer(32 << 20).unwrap().0, 0);
    c.send(cmd::FREE_BUFFER, &a.to_le_bytes()).unwrap();
    let (b, held) = c.alloc_buffer(32 << 20).unwrap();
    assert_ne!(b, 0);
    // the device memory reported is what is left of the limit
    let m = c.call(cmd::GET_DEVICE_MEMORY, &0u32.to_le_bytes()).unwrap();
    let free = u64::from_le_bytes(m[..8].try_into().unwrap());
    let total = u64::from_le_bytes(m[8..].try_into().unwrap());
    assert_eq!((free, total), ((64 << 20) - held, 64 << 20));
}
