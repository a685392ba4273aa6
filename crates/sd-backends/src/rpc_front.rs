//! The RPC server's public front: every client gets its own ggml worker process, and only
//! requests that pass [`rpc_guard`](crate::rpc_guard) reach it.
//!
//! `sd-cli rpc-server` listens on the public port itself. For each client it takes a
//! ready worker (a process running ggml's RPC server on a private loopback port; one is
//! kept started ahead so a client's HELLO is answered at once) and relays: each request
//! is read whole (SET_TENSOR's data is streamed), its size checked for its command and
//! bounded, its contents checked by the guard, and only then forwarded; answers (and
//! the keepalive frames of a computing worker) are relayed back. A refused request closes
//! that client's connection with a logged reason; its worker is killed, so whatever it
//! allocated is freed and nothing of it can reach another client.
//!
//! Bounds: [`FrontConfig::max_buffer_bytes`] over all clients' buffers together (an
//! ALLOC_BUFFER beyond it is answered as a failed allocation without reaching ggml, and
//! GET_DEVICE_MEMORY reports what is left of it), [`FrontConfig::max_clients`] at once, a
//! HELLO within [`FrontConfig::handshake_timeout`], the next request within
//! [`FrontConfig::idle_timeout`] and each part of a started request within
//! [`FrontConfig::io_timeout`].

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::Child;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ggml_sys as sys;

use crate::rpc_guard::{self, GraphLimits, RequestSize};
use crate::rpc_wire::{cmd, KEEPALIVE_FRAME, TENSOR_SIZE};

/// Limits of the front.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    /// Devices the workers serve (a request naming another is refused).
    pub n_devices: u32,
    /// Clients served at once; one more is closed at once with a log line.
    pub max_clients: usize,
    /// From the connection to a complete HELLO.
    pub handshake_timeout: Duration,
    /// Between two requests of a client.
    pub idle_timeout: Duration,
    /// For each read of a request once its first byte arrived.
    pub io_timeout: Duration,
    /// Bytes of buffers all clients together may hold.
    pub max_buffer_bytes: u64,
    /// Bounds of one graph.
    pub limits: GraphLimits,
}

impl FrontConfig {
    /// The defaults, for `n_devices` devices and a buffer limit.
    pub fn new(n_devices: u32, max_buffer_bytes: u64) -> Self {
        Self {
            n_devices,
            max_clients: 8,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
            io_timeout: Duration::from_secs(30),
            max_buffer_bytes,
            limits: GraphLimits::default(),
        }
    }
}

/// A started ggml RPC server that serves one client.
#[derive(Debug)]
pub struct Worker {
    /// Its private loopback address.
    pub addr: SocketAddr,
    /// The process, killed when its client leaves (`None`: not ours to kill, as in tests
    /// and the fuzz target, which serve in-process).
    pub child: Option<Child>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The descriptor number a worker's inherited listening socket has (the patched ggml
/// server adopts it when `SDRS_RPC_LISTEN_FD` names it).
#[cfg(unix)]
const WORKER_LISTEN_FD: i32 = 3;

/// Starts `cmd` as a worker listening on a loopback port bound here. On Unix the socket
/// itself is handed to the worker (as descriptor 3, named by `SDRS_RPC_LISTEN_FD`), so the
/// port is never free between its choice and the worker's listen: another process cannot
/// take it, and a connection made before the worker is ready waits in the backlog. Elsewhere
/// the port is chosen here and bound again by the worker (`--worker-port` names it either way).
pub fn spawn_worker(cmd: &mut std::process::Command) -> io::Result<Worker> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    cmd.arg("--worker-port").arg(addr.port().to_string());
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd as _;
        use std::os::unix::process::CommandExt as _;
        let fd = listener.as_raw_fd();
        cmd.env("SDRS_RPC_LISTEN_FD", WORKER_LISTEN_FD.to_string());
        // SAFETY: between fork and exec only dup2 runs (async-signal-safe); the new
        // descriptor does not have close-on-exec, so the worker inherits it.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 onto itself keeps close-on-exec: clear it instead
                let ok = if fd == WORKER_LISTEN_FD {
                    libc::fcntl(fd, libc::F_SETFD, 0) >= 0
                } else {
                    libc::dup2(fd, WORKER_LISTEN_FD) >= 0
                };
                if !ok {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(unix))]
    drop(listener);
    let child = cmd.spawn()?;
    // the parent's copy closes here (on Unix): a worker that dies leaves no listener behind
    Ok(Worker { addr, child: Some(child) })
}

/// Starts a worker (it may still be starting when this returns).
pub type SpawnWorker = dyn Fn() -> io::Result<Worker> + Send + Sync;

struct Shared {
    cfg: FrontConfig,
    spawn: Box<SpawnWorker>,
    /// Bytes of buffers held by all clients.
    allocated: Mutex<u64>,
    clients: AtomicUsize,
    spare: Mutex<Option<(Worker, TcpStream)>>,
    /// A spare is being started: a client waits for it instead of starting a second worker
    /// at the same time (two connections made at once could reach a server in either order).
    refilling: AtomicUsize,
}

/// How often a waiting client's worker is looked at.
const POLL: Duration = Duration::from_millis(100);

/// Whether the worker closed its end (end of stream or an error; pending keepalive frames
/// are data, not an end).
fn worker_gone(w: &TcpStream) -> bool {
    if w.set_nonblocking(true).is_err() {
        return true;
    }
    let r = w.peek(&mut [0u8; 1]);
    let back = w.set_nonblocking(false);
    back.is_err() || matches!(r, Ok(0)) || matches!(r, Err(e) if e.kind() != io::ErrorKind::WouldBlock)
}

/// How long a worker may take to listen.
const WORKER_START: Duration = Duration::from_secs(60);

/// Starts a worker and connects to it.
fn start_worker(spawn: &SpawnWorker) -> io::Result<(Worker, TcpStream)> {
    let mut w = spawn()?;
    let t = Instant::now();
    loop {
        match TcpStream::connect_timeout(&w.addr, Duration::from_secs(1)) {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok((w, s));
            }
            Err(e) => {
                if let Some(c) = &mut w.child {
                    if let Some(status) = c.try_wait()? {
                        return Err(io::Error::other(format!("the worker exited while starting ({status})")));
                    }
                }
                if t.elapsed() > WORKER_START {
                    return Err(io::Error::other(format!("the worker did not listen within {WORKER_START:?}: {e}")));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Shared {
    /// The spare worker if it is alive, else a new one; then a new spare is started.
    fn take_worker(self: &Arc<Self>) -> io::Result<(Worker, TcpStream)> {
        let t = Instant::now();
        while self.refilling.load(Ordering::SeqCst) > 0
            && self.spare.lock().unwrap_or_else(|e| e.into_inner()).is_none()
            && t.elapsed() < WORKER_START
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let spare = self.spare.lock().unwrap_or_else(|e| e.into_inner()).take();
        let ready = match spare {
            Some((mut w, s)) => {
                if w.child.as_mut().is_none_or(|c| matches!(c.try_wait(), Ok(None))) {
                    Ok((w, s))
                } else {
                    drop((w, s));
                    start_worker(&*self.spawn)
                }
            }
            None => start_worker(&*self.spawn),
        };
        let me = Arc::clone(self);
        self.refilling.fetch_add(1, Ordering::SeqCst);
        std::thread::spawn(move || {
            me.refill();
            me.refilling.fetch_sub(1, Ordering::SeqCst);
        });
        ready
    }

    fn refill(&self) {
        if self.spare.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return;
        }
        match start_worker(&*self.spawn) {
            Ok(w) => {
                let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
                if spare.is_none() {
                    *spare = Some(w);
                }
            }
            Err(e) => tracing::warn!("could not start a spare RPC worker: {e}"),
        }
    }
}

/// Serves clients on `listener` until it fails. A first worker is started before the
/// first client is accepted, so a worker that cannot start at all is an error here.
pub fn serve(listener: TcpListener, cfg: FrontConfig, spawn: Box<SpawnWorker>) -> io::Result<()> {
    let first = start_worker(&*spawn)?;
    let shared = Arc::new(Shared {
        cfg,
        spawn,
        allocated: Mutex::new(0),
        clients: AtomicUsize::new(0),
        spare: Mutex::new(Some(first)),
        refilling: AtomicUsize::new(0),
    });
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let n = shared.clients.fetch_add(1, Ordering::SeqCst);
        if n >= shared.cfg.max_clients {
            shared.clients.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!(
                "RPC client {peer} refused: {} clients are being served (the limit, --max-clients)",
                shared.cfg.max_clients
            );
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let s = Arc::clone(&shared);
        std::thread::spawn(move || {
            let mut c = Client { shared: &s, peer, buffers: HashMap::new() };
            let end = c.serve(stream);
            c.release_all();
            s.clients.fetch_sub(1, Ordering::SeqCst);
            match end {
                Ok(()) => tracing::info!("RPC client {peer} disconnected"),
                Err(End::Refused(why)) => tracing::warn!("RPC client {peer} dropped: {why}"),
                Err(End::Io(e)) => tracing::info!("RPC client {peer} lost: {e}"),
            }
        });
    }
}

/// How a client's service ended early.
enum End {
    /// The client sent something the front refuses (or stayed silent too long).
    Refused(String),
    /// The connection (or the worker) failed.
    Io(io::Error),
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> Self {
        End::Io(e)
    }
}

fn refused<T>(why: impl Into<String>) -> Result<T, End> {
    Err(End::Refused(why.into()))
}

struct Client<'s> {
    shared: &'s Arc<Shared>,
    peer: SocketAddr,
    /// Buffers this client holds on its worker: remote pointer -> bytes.
    buffers: HashMap<u64, u64>,
}

/// Reads exactly `buf.len()` bytes; a timeout becomes `what` refused.
fn read_or(s: &mut TcpStream, buf: &mut [u8], what: impl FnOnce() -> String) -> Result<(), End> {
    match s.read_exact(buf) {
        Ok(()) => Ok(()),
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => refused(what()),
        Err(e) => Err(End::Io(e)),
    }
}

/// Copies `n` bytes from `from` to `to` in chunks.
fn stream_bytes(from: &mut TcpStream, to: &mut TcpStream, mut n: u64, what: &str) -> Result<(), End> {
    let mut chunk = vec![0u8; 1 << 20];
    while n > 0 {
        let k = n.min(chunk.len() as u64) as usize;
        read_or(from, &mut chunk[..k], || format!("{what}: no data within the deadline"))?;
        to.write_all(&chunk[..k])?;
        n -= k as u64;
    }
    Ok(())
}

impl Client<'_> {
    fn cfg(&self) -> &FrontConfig {
        &self.shared.cfg
    }

    fn release_all(&mut self) {
        let total: u64 = self.buffers.drain().map(|(_, b)| b).sum();
        let mut a = self.shared.allocated.lock().unwrap_or_else(|e| e.into_inner());
        *a = a.saturating_sub(total);
    }

    fn serve(&mut self, mut client: TcpStream) -> Result<(), End> {
        client.set_nodelay(true)?;
        client.set_write_timeout(Some(self.cfg().io_timeout))?;
        // HELLO: | 14 | 24u64 | caps[24] |
        client.set_read_timeout(Some(self.cfg().handshake_timeout))?;
        let mut hello = [0u8; 9 + sys::RPC_CONN_CAPS_SIZE];
        let secs = self.cfg().handshake_timeout.as_secs_f64();
        match client.read_exact(&mut hello) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()), // a probe of the port
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return refused(format!("no HELLO within {secs} s"))
            }
            Err(e) => return Err(e.into()),
        }
        let size = u64::from_le_bytes(hello[1..9].try_into().unwrap_or_default());
        if hello[0] != cmd::HELLO || size != sys::RPC_CONN_CAPS_SIZE as u64 {
            return refused(format!("the first request is command {} of {size} bytes, not HELLO", hello[0]));
        }
        let (_worker, mut w) = self.shared.take_worker().map_err(|e| {
            tracing::error!("cannot start an RPC worker for {}: {e}", self.peer);
            End::Io(e)
        })?;
        w.write_all(&hello)?;
        self.relay_answer(&mut w, &mut client, 4 + sys::RPC_CONN_CAPS_SIZE as u64, |_| {})?;
        tracing::info!("RPC client {} connected", self.peer);
        loop {
            let command = self.next_command(&mut client, &w)?;
            let Some(command) = command else { return Ok(()) };
            client.set_read_timeout(Some(self.cfg().io_timeout))?;
            let mut size = [0u8; 8];
            read_or(&mut client, &mut size, || format!("command {command}: its size did not arrive in time"))?;
            let size = u64::from_le_bytes(size);
            self.request(command, size, &mut client, &mut w)?;
        }
    }

    /// Waits for the client's next command byte (`None`: it closed the connection) while
    /// watching the worker: a worker that closed its side (it refused the last request
    /// itself, such as a tensor outside its buffer) ends this client's service at once.
    fn next_command(&self, client: &mut TcpStream, w: &TcpStream) -> Result<Option<u8>, End> {
        let idle = self.cfg().idle_timeout;
        let since = Instant::now();
        client.set_read_timeout(Some(POLL.min(idle)))?;
        let mut command = [0u8; 1];
        loop {
            match client.read(&mut command) {
                Ok(0) => return Ok(None),
                Ok(_) => return Ok(Some(command[0])),
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
            if worker_gone(w) {
                return refused("the server refused its last request (the worker closed the connection)");
            }
            if since.elapsed() >= idle {
                return refused(format!("idle for {} s (the limit, --idle-timeout)", idle.as_secs_f64()));
            }
        }
    }

    /// Checks, forwards and answers one request whose command and size were read.
    fn request(&mut self, command: u8, size: u64, client: &mut TcpStream, w: &mut TcpStream) -> Result<(), End> {
        let cfg = self.cfg().clone();
        let Some(expected) = rpc_guard::request_size(command) else {
            return refused(format!("command {command} is not served"));
        };
        let max = match command {
            cmd::SET_TENSOR => TENSOR_SIZE as u64 + 9 + cfg.max_buffer_bytes,
            cmd::GRAPH_COMPUTE => {
                12 + 8 * cfg.limits.max_nodes as u64 + TENSOR_SIZE as u64 * cfg.limits.max_tensors as u64
            }
            _ => size,
        };
        let fits = match expected {
            RequestSize::Exactly(n) => size == n,
            RequestSize::AtLeast(n) => size >= n && size <= max,
        };
        if !fits {
            return refused(format!("command {command} with a request of {size} bytes ({expected:?}, at most {max})"));
        }
        // SET_TENSOR: the header is checked, the data streamed
        let head = if command == cmd::SET_TENSOR { TENSOR_SIZE as u64 + 9 } else { size };
        let mut req = vec![0u8; head as usize];
        read_or(client, &mut req, || format!("command {command}: its request did not arrive in time"))?;
        rpc_guard::check_request(command, &req, cfg.n_devices, &cfg.limits)
            .map_err(|e| End::Refused(format!("command {command}: {e}")))?;
        if command == cmd::ALLOC_BUFFER {
            return self.alloc(&req, client, w);
        }
        let mut frame = Vec::with_capacity(9 + req.len());
        frame.push(command);
        frame.extend(size.to_le_bytes());
        frame.extend_from_slice(&req);
        w.write_all(&frame)?;
        if size > head {
            stream_bytes(client, w, size - head, "SET_TENSOR")?;
        }
        if command == cmd::FREE_BUFFER {
            let ptr = u64::from_le_bytes(req[..8].try_into().unwrap_or_default());
            if let Some(b) = self.buffers.remove(&ptr) {
                let mut a = self.shared.allocated.lock().unwrap_or_else(|e| e.into_inner());
                *a = a.saturating_sub(b);
            }
        }
        let Some(answer) = rpc_guard::response_size(command, &req) else { return Ok(()) };
        if command == cmd::GET_DEVICE_MEMORY {
            let left = {
                let a = self.shared.allocated.lock().unwrap_or_else(|e| e.into_inner());
                cfg.max_buffer_bytes.saturating_sub(*a)
            };
            // what this server lets a client allocate, not only what the device has
            return self.relay_answer(w, client, answer, |b| {
                let free = u64::from_le_bytes(b[..8].try_into().unwrap_or_default()).min(left);
                let total = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()).min(cfg.max_buffer_bytes);
                b[..8].copy_from_slice(&free.to_le_bytes());
                b[8..16].copy_from_slice(&total.to_le_bytes());
            });
        }
        self.relay_answer(w, client, answer, |_| {})
    }

    /// ALLOC_BUFFER within the limit: beyond it, a failed allocation without asking ggml.
    fn alloc(&mut self, req: &[u8], client: &mut TcpStream, w: &mut TcpStream) -> Result<(), End> {
        let want = u64::from_le_bytes(req[4..12].try_into().unwrap_or_default());
        let limit = self.cfg().max_buffer_bytes;
        let granted = {
            let mut a = self.shared.allocated.lock().unwrap_or_else(|e| e.into_inner());
            let ok = want <= limit.saturating_sub(*a);
            if ok {
                *a += want;
            }
            ok
        };
        if !granted {
            tracing::warn!(
                "RPC client {}: refused a buffer of {want} bytes (the server's limit is {limit} bytes in all, \
                 --max-buffer-mib)",
                self.peer
            );
            let mut answer = 16u64.to_le_bytes().to_vec();
            answer.extend([0u8; 16]);
            client.write_all(&answer)?;
            return Ok(());
        }
        let mut frame = vec![cmd::ALLOC_BUFFER];
        frame.extend(12u64.to_le_bytes());
        frame.extend_from_slice(req);
        w.write_all(&frame)?;
        let mut got = (0u64, 0u64);
        let r = self.relay_answer(w, client, 16, |b| {
            got = (
                u64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
                u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()),
            );
        });
        let mut a = self.shared.allocated.lock().unwrap_or_else(|e| e.into_inner());
        *a = a.saturating_sub(want);
        if got.0 != 0 {
            *a += got.1;
            self.buffers.insert(got.0, got.1);
        }
        r
    }

    /// Relays the worker's keepalive frames and then its answer of `size` bytes (a small
    /// answer may be edited on its way).
    fn relay_answer(
        &self,
        w: &mut TcpStream,
        client: &mut TcpStream,
        size: u64,
        edit: impl FnOnce(&mut [u8]),
    ) -> Result<(), End> {
        loop {
            let mut n = [0u8; 8];
            w.read_exact(&mut n)?;
            let n = u64::from_le_bytes(n);
            if n == KEEPALIVE_FRAME {
                client.write_all(&KEEPALIVE_FRAME.to_le_bytes())?;
                continue;
            }
            if n != size {
                return Err(End::Io(io::Error::other(format!("the worker answered {n} bytes, expected {size}"))));
            }
            client.write_all(&n.to_le_bytes())?;
            if size <= 64 {
                let mut b = vec![0u8; size as usize];
                w.read_exact(&mut b)?;
                edit(&mut b);
                client.write_all(&b)?;
                return Ok(());
            }
            return stream_bytes(w, client, size, "the worker's answer");
        }
    }
}
