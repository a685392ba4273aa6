//! Remote devices over ggml's RPC protocol: the client-side probe and the in-process server.
//!
//! ggml's RPC client aborts the whole process when it cannot connect or the
//! handshake fails, so before handing an endpoint to it we connect ourselves
//! (with a timeout) and perform the protocol's HELLO exchange: request
//! `| cmd u8 = 14 | size u64 | caps [u8; 24] |`, response
//! `| size u64 | major u8 | minor u8 | patch u8 | pad u8 | caps [u8; 24] |`.
//! Only an endpoint that answers with our major version reaches ggml.
//!
//! Faults during a run: the RPC plugin is compiled with sd-rs's patch
//! (`ggml-sys/patches/rpc-faults.toml`), so every call has a send/receive
//! deadline ([`set_timeout`], default [`DEFAULT_TIMEOUT`]) and a dead or silent
//! server is recorded instead of aborting the process; later calls to it
//! return at once with zeroed results. [`check_lost`] turns a recorded loss
//! into [`BackendError::RpcLost`]; the wrappers of this crate call it after
//! every operation that can reach a server (compute, tensor reads and writes,
//! allocations), so a loss surfaces as an error at the next one.
//!
//! The protocol has no authentication: the server binds loopback by default
//! and warns when asked to bind anything else.

use std::ffi::{c_char, CString};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use ggml_sys as sys;

use crate::device::Device;
use crate::error::{BackendError, Result};
use crate::registry::PluginRegistry;

/// How long the probe waits for connect and for each read/write.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Default deadline of one RPC send or receive: a server that moves no byte for this
/// long is declared lost. Short enough that a dead or stopped server ends a run within
/// 10 s. Servers built with sd-rs's patch send keepalives while they compute; another
/// server that computes one graph for longer needs a longer deadline.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(8);

static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64);
/// The RPC plugin's loss registry, once a server has been connected.
static LOST_FN: OnceLock<sys::RpcLostFn> = OnceLock::new();
/// Device names of each connected endpoint, for the loss message.
static ENDPOINT_DEVICES: Mutex<Vec<(String, Vec<String>)>> = Mutex::new(Vec::new());

/// Sets the deadline of RPC calls on connections made from now on (call it before
/// adding servers). Zero means no deadline (a stopped server then blocks the run).
pub fn set_timeout(timeout: Duration) {
    TIMEOUT_MS.store(timeout.as_millis().min(i32::MAX as u128) as u64, Ordering::Relaxed);
}

/// The deadline of RPC calls.
pub fn timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS.load(Ordering::Relaxed))
}

/// A server whose connection was lost during the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcLoss {
    /// `HOST:PORT` of the server.
    pub endpoint: String,
    /// What failed (the cause and the command in flight).
    pub reason: String,
    /// The devices that server provided.
    pub devices: Vec<String>,
}

/// The first server lost in this process, if any.
pub fn lost() -> Option<RpcLoss> {
    let f = LOST_FN.get()?;
    let mut endpoint = [0 as c_char; 256];
    let mut reason = [0 as c_char; 512];
    // SAFETY: the function of the patched RPC plugin (RpcLostFn); the buffers are as
    // long as we say and it NUL-terminates what it copies.
    let n = unsafe { f(endpoint.as_mut_ptr(), endpoint.len(), reason.as_mut_ptr(), reason.len()) };
    if n <= 0 {
        return None;
    }
    // SAFETY: NUL-terminated by the callee (n > 0 means both were written).
    let text = |b: &[c_char]| unsafe { std::ffi::CStr::from_ptr(b.as_ptr()) }.to_string_lossy().into_owned();
    let endpoint = text(&endpoint);
    let devices = ENDPOINT_DEVICES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(e, _)| *e == endpoint)
        .map(|(_, d)| d.clone())
        .unwrap_or_default();
    Some(RpcLoss { endpoint, reason: text(&reason), devices })
}

/// `Err(RpcLost)` once any RPC server of this process has been lost.
pub fn check_lost() -> Result<()> {
    match lost() {
        None => Ok(()),
        Some(l) => Err(BackendError::RpcLost {
            devices: if l.devices.is_empty() { "its devices".into() } else { l.devices.join(", ") },
            endpoint: l.endpoint,
            reason: l.reason,
        }),
    }
}

/// Makes the patched plugin's fault handling ready before the first connection to a
/// server: the deadline, and the loss registry [`check_lost`] reads.
pub(crate) fn prepare_client(rpc: &crate::registry::LoadedPlugin) -> Result<()> {
    let missing = |symbol: &str| BackendError::MissingProc {
        plugin: format!(
            "{} (not built with sd-rs's RPC patch: a lost server would abort the process)",
            rpc.path.display()
        ),
        symbol: symbol.into(),
    };
    let set =
        rpc.reg.proc(c"ggml_backend_rpc_set_timeout_ms").ok_or_else(|| missing("ggml_backend_rpc_set_timeout_ms"))?;
    let lost = rpc.reg.proc(c"ggml_backend_rpc_lost").ok_or_else(|| missing("ggml_backend_rpc_lost"))?;
    // SAFETY: the patched plugin exports this with the RpcSetTimeoutFn signature.
    let set: sys::RpcSetTimeoutFn = unsafe { std::mem::transmute(set) };
    // SAFETY: the patched plugin exports this with the RpcLostFn signature.
    let lost: sys::RpcLostFn = unsafe { std::mem::transmute(lost) };
    // SAFETY: a plain setter of an atomic in the plugin.
    unsafe { set(TIMEOUT_MS.load(Ordering::Relaxed) as i32) };
    let _ = LOST_FN.set(lost);
    Ok(())
}

/// Records which devices an endpoint provides (named in a loss).
pub(crate) fn remember_devices(endpoint: &str, devices: Vec<String>) {
    ENDPOINT_DEVICES.lock().unwrap_or_else(|e| e.into_inner()).push((endpoint.to_string(), devices));
}

/// Parses `HOST:PORT` (IPv4 address or a host name resolving to IPv4).
fn parse_endpoint(endpoint: &str) -> Result<SocketAddr> {
    let bad = || BackendError::BadEndpoint(endpoint.to_string());
    let (host, port) = endpoint.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || host.contains(':') {
        return Err(bad());
    }
    let port: u16 = port.parse().map_err(|_| bad())?;
    if port == 0 {
        return Err(bad());
    }
    (host, port).to_socket_addrs().map_err(|_| bad())?.find(SocketAddr::is_ipv4).ok_or_else(bad)
}

/// Connects to an endpoint and checks that a compatible ggml RPC server answers.
pub fn probe(endpoint: &str, timeout: Duration) -> Result<()> {
    let addr = parse_endpoint(endpoint)?;
    let fail = |reason: String| BackendError::RpcUnreachable { endpoint: endpoint.to_string(), reason };
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| fail(format!("cannot connect: {e}")))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| fail(e.to_string()))?;
    s.set_write_timeout(Some(timeout)).map_err(|e| fail(e.to_string()))?;
    let mut req = vec![sys::RPC_CMD_HELLO];
    req.extend_from_slice(&(sys::RPC_CONN_CAPS_SIZE as u64).to_le_bytes());
    req.extend(std::iter::repeat_n(0u8, sys::RPC_CONN_CAPS_SIZE));
    s.write_all(&req).map_err(|e| fail(format!("handshake send failed: {e}")))?;
    let mut size = [0u8; 8];
    s.read_exact(&mut size).map_err(|e| fail(format!("no handshake answer: {e}")))?;
    let size = u64::from_le_bytes(size);
    let expected = 4 + sys::RPC_CONN_CAPS_SIZE as u64;
    if size != expected {
        return Err(fail(format!("not a ggml RPC server (handshake answer of {size} bytes, expected {expected})")));
    }
    let mut rsp = vec![0u8; expected as usize];
    s.read_exact(&mut rsp).map_err(|e| fail(format!("short handshake answer: {e}")))?;
    if rsp[0] != sys::RPC_PROTO_MAJOR_VERSION {
        return Err(fail(format!(
            "protocol version {}.{}.{}, this client speaks {}.x",
            rsp[0],
            rsp[1],
            rsp[2],
            sys::RPC_PROTO_MAJOR_VERSION
        )));
    }
    Ok(())
}

/// Whether an address is loopback (the only safe place for this protocol).
pub fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().map(|ip| ip.is_loopback()).unwrap_or(false)
}

/// Serves `devices` over RPC on `host:port`. Blocks for as long as the server
/// runs (ggml's server loop never returns), so call it on its own thread.
/// Fails early (without blocking) when the port cannot be bound.
pub fn serve(
    registry: &PluginRegistry,
    host: &str,
    port: u16,
    devices: &[Device],
    threads: usize,
    cache_dir: Option<&std::path::Path>,
) -> Result<()> {
    let endpoint = format!("{host}:{port}");
    let addr = parse_endpoint(&endpoint)?;
    if !is_loopback(host) {
        tracing::warn!(
            "serving on {endpoint}: the RPC protocol has no authentication or encryption; \
             anyone who can reach this address can use the device and read its memory"
        );
    }
    // ggml aborts when bind fails; find out first.
    drop(std::net::TcpListener::bind(addr).map_err(|e| BackendError::RpcUnreachable {
        endpoint: endpoint.clone(),
        reason: format!("cannot listen: {e}"),
    })?);
    let rpc = registry
        .plugins()
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case("RPC") && p.endpoint.is_none())
        .ok_or_else(|| BackendError::PluginMissing("RPC".into(), String::new()))?;
    let start = rpc.reg.proc(c"ggml_backend_rpc_start_server").ok_or_else(|| BackendError::MissingProc {
        plugin: rpc.path.display().to_string(),
        symbol: "ggml_backend_rpc_start_server".into(),
    })?;
    // SAFETY: the RPC plugin exports this function with this signature (ggml-rpc.h).
    let start: sys::RpcStartServerFn = unsafe { std::mem::transmute(start) };
    let c_endpoint = CString::new(endpoint.clone()).map_err(|_| BackendError::BadEndpoint(endpoint.clone()))?;
    let c_cache = cache_dir.map(|d| CString::new(d.display().to_string()).unwrap_or_default());
    let mut raw: Vec<sys::ggml_backend_dev_t> = devices.iter().map(|d| d.as_raw()).collect();
    tracing::info!(
        "RPC server listening on {endpoint}, serving {}",
        devices.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ")
    );
    // SAFETY: endpoint and cache dir are NUL-terminated and outlive the call (it
    // never returns); the device handles are process-lifetime.
    unsafe {
        start(
            c_endpoint.as_ptr(),
            c_cache.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            threads,
            raw.len(),
            raw.as_mut_ptr(),
        )
    };
    Ok(())
}

/// In a supervised worker: exits this process when its supervisor goes away, so a
/// killed supervisor leaves no server behind.
#[cfg(unix)]
pub fn exit_with_supervisor() {
    let supervisor = std::os::unix::process::parent_id();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(200));
        if std::os::unix::process::parent_id() != supervisor {
            std::process::exit(0);
        }
    });
}

/// In a supervised worker (no-op where the parent cannot be watched).
#[cfg(not(unix))]
pub fn exit_with_supervisor() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert!(parse_endpoint("127.0.0.1:50052").is_ok());
        assert!(parse_endpoint("localhost:1").is_ok());
        for bad in ["", "127.0.0.1", "127.0.0.1:", ":80", "127.0.0.1:0", "127.0.0.1:99999", "[::1]:80", "a:b"] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn probe_rejects_a_server_that_is_not_ggml() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 33];
            let _ = s.read_exact(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        });
        let err = probe(&format!("127.0.0.1:{port}"), PROBE_TIMEOUT).unwrap_err().to_string();
        assert!(err.contains("not a ggml RPC server"), "{err}");
        t.join().unwrap();
    }

    #[test]
    fn loopback() {
        assert!(is_loopback("127.0.0.1") && is_loopback("localhost") && is_loopback("127.3.4.5"));
        assert!(!is_loopback("0.0.0.0") && !is_loopback("192.0.2.1"));
    }
}
