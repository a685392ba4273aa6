//! A hostile RPC server against the real `sd-cli` (issue 32): a loopback proxy in front of a
//! real `sd-cli rpc-server` that lies in one answer (alignment 3, 2^32-1 devices, free memory
//! above total, a buffer shorter than asked, a base near 2^64) or answers a call with
//! keepalive frames forever. Each case ends with a clear error naming the server and the
//! value, the right exit status (1 when the probe refuses the server before ggml sees it, 3
//! when the server is lost later), no signal and no hang.

mod common;

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{sd15_fixture, sd_cli, Server};
use sd_backends::rpc::bounds::{MAX_ALIGNMENT, MAX_BYTES, MAX_DEVICES, MIN_MAX_SIZE};
use sd_backends::rpc_wire::{cmd, KEEPALIVE_FRAME};

/// The exit status of a run whose RPC device was lost.
const EXIT_DEVICE_LOST: i32 = 3;

/// The one answer a proxy falsifies.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Lie {
    Alignment3,
    ManyDevices,
    TinyMaxSize,
    FreeAboveTotal,
    ShortBuffer,
    BaseNearTop,
    /// After the first graph computation, the next call gets keepalive frames forever.
    KeepalivesForever,
}

impl Lie {
    /// The answer to `command` (request `payload`) as the lie has it.
    fn apply(self, command: u8, payload: &[u8], mut answer: Vec<u8>) -> Vec<u8> {
        match (self, command) {
            (Lie::Alignment3, cmd::GET_ALIGNMENT) => answer = 3u64.to_le_bytes().to_vec(),
            (Lie::ManyDevices, cmd::DEVICE_COUNT) => answer = u32::MAX.to_le_bytes().to_vec(),
            (Lie::TinyMaxSize, cmd::GET_MAX_SIZE) => answer = 0u64.to_le_bytes().to_vec(),
            (Lie::FreeAboveTotal, cmd::GET_DEVICE_MEMORY) => {
                let total = u64::from_le_bytes(answer[8..16].try_into().unwrap());
                answer[..8].copy_from_slice(&(total + 1).to_le_bytes());
            }
            (Lie::ShortBuffer, cmd::ALLOC_BUFFER) if answer[..8] != [0; 8] => {
                let asked = u64::from_le_bytes(payload[4..12].try_into().unwrap());
                answer[8..16].copy_from_slice(&(asked / 2).to_le_bytes());
            }
            (Lie::BaseNearTop, cmd::BUFFER_GET_BASE) => answer = (u64::MAX - 4095).to_le_bytes().to_vec(),
            _ => {}
        }
        answer
    }
}

/// Whether a command has an answer (the others are one-way).
fn has_answer(command: u8) -> bool {
    matches!(
        command,
        cmd::HELLO
            | cmd::DEVICE_COUNT
            | cmd::ALLOC_BUFFER
            | cmd::GET_ALLOC_SIZE
            | cmd::GET_ALIGNMENT
            | cmd::GET_MAX_SIZE
            | cmd::BUFFER_GET_BASE
            | cmd::SET_TENSOR_HASH
            | cmd::GET_TENSOR
            | cmd::COPY_TENSOR
            | cmd::GET_DEVICE_MEMORY
    )
}

/// A proxy on a loopback port in front of a real server; connections from the
/// `from`-th on (the probe is the first, ggml's client the second) get the lie.
struct Hostile {
    endpoint: String,
    _server: Server,
}

fn hostile(lie: Lie, from: usize) -> Hostile {
    let server = Server::start();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("127.0.0.1:{}", listener.local_addr().unwrap().port());
    let upstream = server.endpoint.clone();
    std::thread::spawn(move || {
        for (n, client) in listener.incoming().enumerate() {
            let Ok(client) = client else { continue };
            let upstream = upstream.clone();
            let lie = (n + 1 >= from).then_some(lie);
            std::thread::spawn(move || relay(client, &upstream, lie));
        }
    });
    Hostile { endpoint, _server: server }
}

/// Relays one connection message by message (ggml's client waits for each answer before
/// its next request), falsifying answers as `lie` says.
fn relay(mut client: TcpStream, upstream: &str, lie: Option<Lie>) -> io::Result<()> {
    let mut server = TcpStream::connect(upstream)?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let mut computed = false;
    loop {
        let mut head = [0u8; 9];
        client.read_exact(&mut head)?;
        let command = head[0];
        let mut request = head.to_vec();
        let size = u64::from_le_bytes(head[1..].try_into().unwrap()) as usize;
        request.resize(9 + size, 0);
        client.read_exact(&mut request[9..])?;
        server.write_all(&request)?;
        computed |= command == cmd::GRAPH_COMPUTE || command == cmd::GRAPH_RECOMPUTE;
        if !has_answer(command) {
            continue;
        }
        if lie == Some(Lie::KeepalivesForever) && computed {
            loop {
                client.write_all(&KEEPALIVE_FRAME.to_le_bytes())?;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        let answer = loop {
            let mut size = [0u8; 8];
            server.read_exact(&mut size)?;
            if u64::from_le_bytes(size) == KEEPALIVE_FRAME {
                client.write_all(&size)?;
                continue;
            }
            let mut answer = vec![0u8; u64::from_le_bytes(size) as usize];
            server.read_exact(&mut answer)?;
            break answer;
        };
        let answer = match lie {
            Some(l) => l.apply(command, &request[9..], answer),
            None => answer,
        };
        let mut out = (answer.len() as u64).to_le_bytes().to_vec();
        out.extend(answer);
        client.write_all(&out)?;
    }
}

/// How `sd-cli` ended.
struct Ended {
    code: Option<i32>,
    stderr: String,
    took: Duration,
}

/// Runs `cmd`, failing the test when it is still running after `limit`.
fn run(mut cmd: Command, limit: Duration) -> Ended {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sd-cli still runs after {limit:?}:\n{}", reader.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t.elapsed();
    let stderr = reader.join().unwrap();
    assert_eq!(status.signal(), None, "sd-cli died by a signal:\n{stderr}");
    assert!(!stderr.contains("GGML_ASSERT") && !stderr.contains("panicked"), "{stderr}");
    Ended { code: status.code(), stderr, took }
}

fn list_devices(endpoint: &str) -> Ended {
    let mut c = sd_cli();
    c.args(["--list-devices", "--rpc-servers", endpoint]);
    run(c, Duration::from_secs(60))
}

/// A tiny generation whose every module is on the server's device.
fn generate(endpoint: &str, extra: &[&str]) -> Ended {
    // one generation at a time: the machine has few cores
    static ONE_RUN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_RUN.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("sd-cli-rpc-hostile-{}-{}", std::process::id(), endpoint));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = sd_cli();
    c.arg("-m")
        .arg(sd15_fixture())
        .args(["-p", "a cat", "-W", "64", "-H", "64", "--steps", "1", "-t", "2"])
        .args(["--rpc-servers", endpoint, "--backend", "RPC0"])
        .args(extra)
        .arg("-o")
        .arg(dir.join("out.png"));
    let e = run(c, Duration::from_secs(300));
    assert!(!dir.join("out.png").exists(), "an image was written:\n{}", e.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    e
}

/// An `error:` line must name the endpoint and `needle` (an error on the way out may come
/// first, followed by the loss and its cause).
fn assert_error(e: &Ended, code: i32, endpoint: &str, needle: &str) {
    let err = &e.stderr;
    assert_eq!(e.code, Some(code), "exit status:\n{err}");
    assert!(
        err.lines().any(|l| l.starts_with("error:") && l.contains(endpoint) && l.contains(needle)),
        "expected an error line with `{needle}` and {endpoint} in:\n{err}"
    );
}

#[test]
fn the_probe_refuses_a_server_whose_devices_make_no_sense() {
    for (lie, needle) in [
        (Lie::Alignment3, format!("alignment 3 (a power of two up to {MAX_ALIGNMENT} expected)")),
        (Lie::ManyDevices, format!("reports 4294967295 devices (at most {MAX_DEVICES} expected)")),
        (Lie::TinyMaxSize, format!("maximum buffer size of 0 bytes (at least {MIN_MAX_SIZE} expected)")),
        (Lie::FreeAboveTotal, format!("total at most {MAX_BYTES} expected")),
    ] {
        let h = hostile(lie, 1);
        let e = list_devices(&h.endpoint);
        assert_error(&e, 1, &h.endpoint, &needle);
        assert!(e.stderr.contains("is unusable"), "{lie:?}: {}", e.stderr);
    }
}

#[test]
fn answers_after_the_probe_are_checked_too() {
    // the probe sees an honest server; ggml's own connection gets the lie
    for (lie, needle) in [
        (Lie::ManyDevices, "malformed answer: 4294967295 devices"),
        (Lie::FreeAboveTotal, "malformed answer: device memory"),
    ] {
        let h = hostile(lie, 2);
        let e = list_devices(&h.endpoint);
        assert_error(&e, EXIT_DEVICE_LOST, &h.endpoint, needle);
        assert!(e.stderr.contains("lost RPC server"), "{lie:?}: {}", e.stderr);
    }
}

#[test]
fn bad_buffers_during_a_generation_lose_the_server() {
    for (lie, needle) in [
        (Lie::Alignment3, "malformed answer: alignment 3 "),
        (Lie::ShortBuffer, "malformed answer: a buffer of"),
        (Lie::BaseNearTop, "malformed answer: buffer base 0xfffffffffffff000"),
    ] {
        let h = hostile(lie, 2);
        let e = generate(&h.endpoint, &[]);
        assert_error(&e, EXIT_DEVICE_LOST, &h.endpoint, needle);
    }
}

#[test]
fn keepalives_without_an_answer_end_at_the_compute_limit() {
    let h = hostile(Lie::KeepalivesForever, 2);
    let e = generate(&h.endpoint, &["--rpc-compute-limit", "2"]);
    assert_error(&e, EXIT_DEVICE_LOST, &h.endpoint, "no answer, for 2.0 s (the RPC compute limit)");
    assert!(e.stderr.contains("hint: --rpc-compute-limit"), "{}", e.stderr);
}

#[test]
fn deadlines_have_a_floor_and_never_is_spelled_out() {
    for flag in ["--rpc-timeout", "--rpc-compute-limit"] {
        for bad in ["0", "0.0004", "0.5", "-1", "nan", "1e9", "soon"] {
            let o = sd_cli().args(["--list-devices", &format!("{flag}={bad}")]).output().unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{flag} {bad}: {err}");
            assert!(err.contains(flag) && err.contains(bad), "{flag} {bad}: {err}");
        }
        for good in ["never", "1", "2.5"] {
            let o = sd_cli().args(["--list-devices", flag, good]).output().unwrap();
            assert!(o.status.success(), "{flag} {good}: {}", String::from_utf8_lossy(&o.stderr));
        }
    }
}

#[test]
fn one_server_under_two_spellings_is_refused_before_connecting() {
    let server = Server::start();
    let port = server.endpoint.rsplit_once(':').unwrap().1;
    let list = format!("{},localhost:{port}", server.endpoint);
    let e = list_devices(&list);
    assert_eq!(e.code, Some(1), "{}", e.stderr);
    assert!(e.took < Duration::from_secs(5), "took {:?}", e.took);
    let line = e.stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_default().to_string();
    assert!(
        line.contains("same server") && line.contains(&server.endpoint) && line.contains(&format!("localhost:{port}")),
        "{}",
        e.stderr
    );
}
