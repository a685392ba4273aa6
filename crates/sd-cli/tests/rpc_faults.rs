//! RPC faults against real `sd-cli rpc-server` processes on loopback: a server killed
//! or stopped in the middle of a generation ends the run within 10 s with an error
//! naming the endpoint (exit status 3, no signal, no hang), and malformed client
//! messages close only the offending connection while the server serves the next one.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{round_trip, sd15_fixture, sd_cli, Server};
use sd_backends::rpc_wire::{cmd, WireClient, WireTensor};

/// The exit status of a run whose RPC device was lost (distinct from 2, bad input).
const EXIT_DEVICE_LOST: i32 = 3;

/// What a client run ended with.
struct Ended {
    status: ExitStatus,
    stderr: String,
    /// From the fault to the exit.
    after_fault: Duration,
}

/// Runs a generation whose UNet is on the server's device and applies `fault` to the
/// server once the first sampling step is done (the weights are on the server, the run
/// is half-way). Fails the test if the client does not exit within 20 s of the fault.
fn run_and_fault(server: &Server, extra: &[&str], fault: impl FnOnce()) -> Ended {
    // one generation at a time: two on a 2-core machine could make an honest server slower
    // than the deadline
    static ONE_RUN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_RUN.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("sd-cli-rpc-faults-{}-{}", std::process::id(), server.endpoint));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = sd_cli()
        .arg("-m")
        .arg(sd15_fixture())
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "40", "--sampling-method", "euler"])
        .args(["-s", "42", "--cfg-scale", "1", "-t", "2", "--rpc", &server.endpoint, "--backend", "RPC0"])
        .args(extra)
        .arg("-o")
        .arg(dir.join("out.png"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let started = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(line) if line.contains("step 1/40") => break,
            Ok(_) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => {
                assert!(started.elapsed() < Duration::from_secs(300), "the run never reached its first step");
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = child.wait();
                panic!("the run ended before its first step:\n{}", reader.join().unwrap());
            }
        }
    }
    fault();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the client still runs 20 s after the fault:\n{}", reader.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let after_fault = t.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    Ended { status, stderr: reader.join().unwrap(), after_fault }
}

fn assert_clean_loss(e: &Ended, endpoint: &str, cause: &str) {
    let err = &e.stderr;
    assert_eq!(e.status.signal(), None, "the client died by a signal:\n{err}");
    assert_eq!(e.status.code(), Some(EXIT_DEVICE_LOST), "exit status:\n{err}");
    assert!(e.after_fault < Duration::from_secs(10), "took {:?} after the fault:\n{err}", e.after_fault);
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("no error line:\n{err}"));
    assert!(line.contains(&format!("lost RPC server {endpoint}")), "{line}");
    assert!(line.contains("RPC0") && line.contains(cause), "{line}");
    assert!(!err.contains("GGML_ABORT") && !err.contains("panicked"), "{err}");
}

#[test]
fn a_killed_server_ends_the_run_with_an_error_naming_it() {
    let server = Server::start();
    let e = run_and_fault(&server, &[], || server.signal("-KILL"));
    // the cause depends on where the client was: a closed or reset connection
    assert_clean_loss(&e, &server.endpoint, "connection");
}

#[test]
fn a_stopped_server_ends_the_run_at_the_deadline() {
    let server = Server::start();
    // the default deadline (8 s): no --rpc-timeout
    let e = run_and_fault(&server, &[], || server.signal("-STOP"));
    assert_clean_loss(&e, &server.endpoint, "no answer within 8.0 s");
    assert!(e.stderr.contains("--rpc-timeout"), "the hint names the flag:\n{}", e.stderr);
    assert!(e.after_fault >= Duration::from_secs(7), "gave up before the deadline: {:?}", e.after_fault);
}

#[test]
fn the_deadline_is_configurable() {
    let server = Server::start();
    let e = run_and_fault(&server, &["--rpc-timeout", "2"], || server.signal("-STOP"));
    assert_clean_loss(&e, &server.endpoint, "no answer within 2.0 s");
    assert!(e.after_fault < Duration::from_secs(5), "{:?}", e.after_fault);
}

#[test]
fn a_bad_deadline_is_bad_input() {
    for bad in ["-1", "nan", "1e9", "soon"] {
        let o = sd_cli().args(["--list-devices", &format!("--rpc-timeout={bad}")]).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--rpc-timeout") && err.contains(bad), "{bad}: {err}");
    }
}

#[test]
fn malformed_messages_close_only_their_connection() {
    let mut server = Server::start();
    // Each case: a connection with one buffer of 1024 bytes, then one bad message.
    type Case = (&'static str, fn(&mut WireClient, u64, u64) -> std::io::Result<()>);
    let cases: [Case; 8] = [
        ("SET_TENSOR with data outside its buffer", |c, buf, base| {
            c.set_tensor(&WireTensor::f32(1, buf, base + 4096, 16), 0, &[0; 64])
        }),
        ("SET_TENSOR past the end of its tensor", |c, buf, base| {
            c.set_tensor(&WireTensor::f32(1, buf, base, 16), 32, &[0; 64])
        }),
        ("GET_TENSOR past the end of its tensor", |c, buf, base| {
            c.get_tensor(&WireTensor::f32(1, buf, base, 16), 0, 128).map(drop)
        }),
        ("a tensor whose size overflows", |c, buf, base| {
            let mut t = WireTensor::f32(1, buf, base, 16);
            t.nb = [u32::MAX; 4];
            t.ne = [u32::MAX; 4];
            c.set_tensor(&t, 0, &[0; 16])
        }),
        ("a graph with an unknown op", |c, buf, base| {
            let mut t = WireTensor::f32(7, buf, base, 16);
            t.op = 5000;
            let mut p = 0u32.to_le_bytes().to_vec(); // device
            p.extend(1u32.to_le_bytes()); // n_nodes
            p.extend(7u64.to_le_bytes());
            p.extend(1u32.to_le_bytes()); // n_tensors
            p.extend(t.to_bytes());
            c.send(cmd::GRAPH_COMPUTE, &p)
        }),
        ("an unknown command", |c, _, _| c.send(200, &[])),
        ("a request of the wrong size", |c, _, _| c.send(cmd::BUFFER_GET_BASE, &[1, 2, 3])),
        ("a buffer that does not exist", |c, _, _| c.send(cmd::FREE_BUFFER, &0xdead_beefu64.to_le_bytes())),
    ];
    for (what, bad) in cases {
        let mut c = WireClient::connect(&server.endpoint, Duration::from_secs(2)).unwrap();
        let (buf, _) = c.alloc_buffer(1024).unwrap();
        let base = c.buffer_base(buf).unwrap();
        let _ = bad(&mut c, buf, base);
        assert!(c.is_closed(), "{what}: the server kept the offending connection open");
        drop(c);
        assert!(server.is_running(), "{what}: the server died");
        round_trip(&server.endpoint);
    }
    // and a real client of ggml's own kind is served too
    let o = sd_cli().args(["--list-devices", "--rpc", &server.endpoint]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(server.is_running());
}

#[test]
fn a_graph_the_kernel_would_assert_on_costs_only_its_connection() {
    let mut server = Server::start();
    // ADD of a 3-element tensor onto a 16-element one: well-formed on the wire, but the
    // CPU kernel asserts on the shapes. The front refuses it before ggml sees it.
    let mut c = WireClient::connect(&server.endpoint, Duration::from_secs(5)).unwrap();
    let (buf, _) = c.alloc_buffer(1024).unwrap();
    let base = c.buffer_base(buf).unwrap();
    let a = WireTensor::f32(1, buf, base, 16);
    let b = WireTensor::f32(2, buf, base + 64, 3);
    let mut sum = WireTensor::f32(3, buf, base + 128, 16);
    sum.op = 2; // GGML_OP_ADD
    sum.flags = 16; // GGML_TENSOR_FLAG_COMPUTE
    sum.src[0] = 1;
    sum.src[1] = 2;
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend(1u32.to_le_bytes());
    p.extend(3u64.to_le_bytes());
    p.extend(3u32.to_le_bytes());
    for t in [&a, &b, &sum] {
        p.extend(t.to_bytes());
    }
    c.send(cmd::GRAPH_COMPUTE, &p).unwrap();
    assert!(c.is_closed(), "the offending connection stayed open");
    drop(c);
    let t = Instant::now();
    loop {
        assert!(server.is_running(), "the supervisor died");
        match std::panic::catch_unwind(|| round_trip(&server.endpoint)) {
            Ok(_) => break,
            Err(_) if t.elapsed() < Duration::from_secs(20) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

/// Sends a graph of `n` independent 1024x1024 f32 matrix products (seconds of CPU work)
/// and returns how many keepalive frames arrived before its result could be read.
fn keepalives_during_a_long_compute(endpoint: &str, ask: bool) -> (bool, usize) {
    const N: u32 = 1024;
    let bytes = u64::from(N * N * 4);
    let (mut c, agreed) = WireClient::connect_with(endpoint, Duration::from_secs(60), ask).unwrap();
    let (buf, _) = c.alloc_buffer(3 * bytes).unwrap();
    let base = c.buffer_base(buf).unwrap();
    let matrix = |id: u64, at: u64| {
        let mut t = WireTensor::f32(id, buf, base + at, N);
        t.ne = [N, N, 1, 1];
        t.nb = [4, 4 * N, 4 * N * N, 4 * N * N];
        t
    };
    let (a, b) = (matrix(1, 0), matrix(2, bytes));
    c.set_tensor(&a, 0, &vec![0; bytes as usize]).unwrap();
    c.set_tensor(&b, 0, &vec![0; bytes as usize]).unwrap();
    // ~550 GFLOP: about 2 s on an idle 2-core AVX-512 machine, many keepalive intervals (200 ms)
    let n = 256u64;
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend((n as u32).to_le_bytes());
    (0..n).for_each(|i| p.extend((10 + i).to_le_bytes()));
    p.extend((n as u32 + 2).to_le_bytes());
    p.extend(a.to_bytes());
    p.extend(b.to_bytes());
    for i in 0..n {
        let mut d = matrix(10 + i, 2 * bytes); // every product writes the same place
        d.op = 29; // GGML_OP_MUL_MAT
        d.flags = 16; // GGML_TENSOR_FLAG_COMPUTE: the CPU backend skips nodes without it
        d.src[0] = 1;
        d.src[1] = 2;
        p.extend(d.to_bytes());
    }
    c.send(cmd::GRAPH_COMPUTE, &p).unwrap();
    c.get_tensor(&matrix(10, 2 * bytes), 0, 16).unwrap();
    (agreed, c.keepalives)
}

#[test]
fn a_computing_server_sends_keepalives_to_clients_that_ask() {
    let server = Server::start();
    let (agreed, frames) = keepalives_during_a_long_compute(&server.endpoint, true);
    assert!(agreed, "the server did not agree to keepalives");
    assert!(frames >= 1, "no keepalive during a computation of seconds");
    // a client of upstream's kind (no marker) gets plain responses
    assert_eq!(keepalives_during_a_long_compute(&server.endpoint, false), (false, 0));
}
