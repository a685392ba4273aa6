//! Issue 32, rows 1-5, against the real `sd-cli rpc-server` on loopback: a message no
//! client of ours sends is refused before ggml sees it (that client's connection is
//! closed, the server goes on and serves the next one), buffers are bounded, an idle
//! client neither blocks others nor stays forever, and `--threads` is bounded.

mod common;

use std::time::{Duration, Instant};

use common::{round_trip, sd_cli, Server};
use ggml_sys as sys;
use sd_backends::rpc_wire::{cmd, graph_payload, WireClient, WireTensor};

fn graph(nodes: &[u64], tensors: &[WireTensor]) -> Vec<u8> {
    graph_payload(0, nodes, tensors)
}

fn node(id: u64, buf: u64, data: u64, op: sys::ggml_op, n: u32, srcs: &[u64]) -> WireTensor {
    let mut t = WireTensor::f32(id, buf, data, n);
    t.op = op.0;
    t.flags = 16; // GGML_TENSOR_FLAG_COMPUTE
    t.src[..srcs.len()].copy_from_slice(srcs);
    t
}

/// Rows 1 and 2: each graph on a connection with a 64 KiB buffer; the connection is
/// closed, the server serves the next client.
#[test]
fn graphs_no_client_of_ours_sends_are_refused() {
    use sys::ggml_op as o;
    let mut server = Server::start();
    type Case = (&'static str, fn(u64, u64) -> Vec<u8>);
    let cases: Vec<Case> = vec![
        ("MAP_CUSTOM1 with a function pointer", |buf, base| {
            let a = WireTensor::f32(1, buf, base, 16);
            let mut c = node(2, buf, base + 64, o::GGML_OP_MAP_CUSTOM1, 16, &[1]);
            // the fields of ggml_map_custom1_op_params: fun, n_tasks, userdata
            c.op_params[..6].copy_from_slice(&[0x4141_4141, 0x4141, 1, 0, 0x4141_4141, 0x4141]);
            graph(&[2], &[a, c])
        }),
        ("CUSTOM", |buf, base| {
            let a = WireTensor::f32(1, buf, base, 16);
            let mut c = node(2, buf, base + 64, o::GGML_OP_CUSTOM, 16, &[1]);
            c.op_params[..2].copy_from_slice(&[0x4141_4141, 0x4141]);
            graph(&[2], &[a, c])
        }),
        ("ADD of I32", |buf, base| {
            let mut a = WireTensor::f32(1, buf, base, 16);
            a.ty = sys::ggml_type::GGML_TYPE_I32.0;
            let mut b = a.clone();
            b.id = 2;
            let mut s = node(3, buf, base + 128, o::GGML_OP_ADD, 16, &[1, 2]);
            s.ty = a.ty;
            graph(&[3], &[a, b, s])
        }),
        ("ADD of shapes that do not repeat", |buf, base| {
            let a = WireTensor::f32(1, buf, base, 16);
            let b = WireTensor::f32(2, buf, base + 64, 3);
            graph(&[3], &[a, b, node(3, buf, base + 128, o::GGML_OP_ADD, 16, &[1, 2])])
        }),
        ("GROUP_NORM of zero groups (a division by zero)", |buf, base| {
            let a = WireTensor::f32(1, buf, base, 16);
            graph(&[2], &[a, node(2, buf, base + 64, o::GGML_OP_GROUP_NORM, 16, &[1])])
        }),
        ("node id 0", |buf, base| graph(&[0], &[WireTensor::f32(1, buf, base, 16)])),
        ("a 200,000-long source chain", |buf, base| {
            let n = 200_000u64;
            let mut ts = vec![WireTensor::f32(1, buf, base, 4)];
            ts.extend((2..=n).map(|id| node(id, buf, base + 16, o::GGML_OP_SQR, 4, &[id - 1])));
            graph(&[n], &ts)
        }),
        ("GET_ROWS at indices outside the rows", |buf, base| {
            // the indices are whatever the new buffer holds: set below to 1000
            let mut rows = WireTensor::f32(1, buf, base, 4);
            rows.ne = [4, 2, 1, 1];
            rows.nb = [4, 16, 32, 32];
            let mut idx = WireTensor::f32(2, buf, base + 1024, 1);
            idx.ty = sys::ggml_type::GGML_TYPE_I32.0;
            let mut g = node(3, buf, base + 2048, o::GGML_OP_GET_ROWS, 4, &[1, 2]);
            g.ne = [4, 1, 1, 1];
            graph(&[3], &[rows, idx, g])
        }),
    ];
    for (what, make) in cases {
        let mut c = WireClient::connect(&server.endpoint, Duration::from_secs(10)).unwrap();
        let (buf, _) = c.alloc_buffer(64 << 10).unwrap();
        let base = c.buffer_base(buf).unwrap();
        let mut idx = WireTensor::f32(9, buf, base + 1024, 1);
        idx.ty = sys::ggml_type::GGML_TYPE_I32.0;
        c.set_tensor(&idx, 0, &1000i32.to_le_bytes()).unwrap();
        let _ = c.send(cmd::GRAPH_COMPUTE, &make(buf, base));
        assert!(c.is_closed(), "{what}: the server kept the connection open");
        drop(c);
        assert!(server.is_running(), "{what}: the server died");
        round_trip(&server.endpoint);
    }
}

/// Row 3: buffers are bounded by `--max-buffer-mib` (and by default by the device's free
/// memory); a refused allocation is a failed allocation, the connection goes on.
#[test]
fn buffers_are_bounded() {
    let server = Server::start_with(&["--max-buffer-mib", "64"]);
    let mut c = WireClient::connect(&server.endpoint, Duration::from_secs(10)).unwrap();
    for gib in [1u64, 8, 1 << 20] {
        assert_eq!(c.alloc_buffer(gib << 30).unwrap(), (0, 0), "{gib} GiB");
    }
    assert_ne!(c.alloc_buffer(32 << 20).unwrap().0, 0);
    // a request that announces more data than any buffer may hold is refused unread
    let mut frame = vec![cmd::SET_TENSOR];
    frame.extend((1u64 << 40).to_le_bytes());
    c.send_raw(&frame).unwrap();
    assert!(c.is_closed(), "a SET_TENSOR of 1 TiB was waited for");
    round_trip(&server.endpoint);
    // without the flag: the device's free memory
    let server = Server::start();
    let mut c = WireClient::connect(&server.endpoint, Duration::from_secs(10)).unwrap();
    assert_eq!(c.alloc_buffer(u64::MAX / 2).unwrap(), (0, 0));
    assert_ne!(c.alloc_buffer(1 << 20).unwrap().0, 0);
}

/// Row 4: a client that says HELLO and then idles blocks nobody, and is dropped after
/// `--idle-timeout`; a client beyond `--max-clients` is closed at once.
#[test]
fn an_idle_client_blocks_nobody_and_is_dropped() {
    let server = Server::start_with(&["--idle-timeout", "3", "--max-clients", "2"]);
    let mut idle = WireClient::connect(&server.endpoint, Duration::from_secs(10)).unwrap();
    let t = Instant::now();
    let passer = round_trip(&server.endpoint);
    assert!(t.elapsed() < Duration::from_secs(3), "another client waited {:?}", t.elapsed());
    // two clients at once: a third is closed (once the round trip's client has left)
    server.wait_gone(passer);
    let _second = WireClient::connect(&server.endpoint, Duration::from_secs(10)).unwrap();
    assert!(WireClient::connect(&server.endpoint, Duration::from_secs(5)).is_err(), "a third client was served");
    // the idle one is dropped after its deadline
    let t = Instant::now();
    while !idle.is_closed() {
        assert!(t.elapsed() < Duration::from_secs(10), "the idle client was never dropped");
    }
}

/// Row 5: `--threads` is bounded.
#[test]
fn threads_are_bounded() {
    let t = Instant::now();
    let o = sd_cli().args(["rpc-server", "--port", "1", "--threads", "100000"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--threads 100000") && err.contains("at most"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10));
}
