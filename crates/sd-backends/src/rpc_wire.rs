//! A raw client of ggml's RPC protocol, byte for byte, for tests and fuzzing of servers.
//!
//! Unlike ggml's client it sends exactly what it is given, valid or not, and
//! reports a closed connection as an error instead of aborting. Layouts follow
//! the pinned ggml-rpc.cpp: `rpc_tensor` is packed, 296 bytes; requests are
//! `| cmd u8 | size u64 | payload |`, responses `| size u64 | payload |`.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ggml_sys as sys;

/// Command numbers of the pinned protocol (`enum rpc_cmd`).
#[allow(missing_docs)]
pub mod cmd {
    pub const ALLOC_BUFFER: u8 = 0;
    pub const GET_ALIGNMENT: u8 = 1;
    pub const GET_MAX_SIZE: u8 = 2;
    pub const BUFFER_GET_BASE: u8 = 3;
    pub const FREE_BUFFER: u8 = 4;
    pub const BUFFER_CLEAR: u8 = 5;
    pub const SET_TENSOR: u8 = 6;
    pub const SET_TENSOR_HASH: u8 = 7;
    pub const GET_TENSOR: u8 = 8;
    pub const COPY_TENSOR: u8 = 9;
    pub const GRAPH_COMPUTE: u8 = 10;
    pub const GET_DEVICE_MEMORY: u8 = 11;
    pub const INIT_TENSOR: u8 = 12;
    pub const GET_ALLOC_SIZE: u8 = 13;
    pub const HELLO: u8 = 14;
    pub const DEVICE_COUNT: u8 = 15;
    pub const GRAPH_RECOMPUTE: u8 = 16;
    pub const MEMSET_TENSOR: u8 = 17;
    /// One past the last command.
    pub const COUNT: u8 = 19;
}

/// The last HELLO caps byte by which a client asks sd-rs's patched server for keepalive
/// frames while it computes (`patches/rpc-faults.toml`).
pub const KEEPALIVE_CAP: u8 = 0x5d;
/// A response size that is no response but a keepalive frame.
pub const KEEPALIVE_FRAME: u64 = u64::MAX;

/// Size of a serialised `rpc_tensor`.
pub const TENSOR_SIZE: usize = 296;

/// The fields of ggml's `rpc_tensor` (dimensions and strides are 32-bit on the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct WireTensor {
    pub id: u64,
    pub ty: u32,
    pub buffer: u64,
    pub ne: [u32; 4],
    pub nb: [u32; 4],
    pub op: u32,
    pub op_params: [i32; 16],
    pub flags: i32,
    pub src: [u64; 10],
    pub view_src: u64,
    pub view_offs: u64,
    pub data: u64,
    pub name: [u8; 64],
}

impl Default for WireTensor {
    fn default() -> Self {
        Self {
            id: 0,
            ty: 0,
            buffer: 0,
            ne: [0; 4],
            nb: [0; 4],
            op: 0,
            op_params: [0; 16],
            flags: 0,
            src: [0; 10],
            view_src: 0,
            view_offs: 0,
            data: 0,
            name: [0; 64],
        }
    }
}

/// The payload of a GRAPH_COMPUTE request for `device`: `| device u32 | n_nodes u32 |
/// node ids u64... | n_tensors u32 | rpc_tensor... |`.
pub fn graph_payload(device: u32, nodes: &[u64], tensors: &[WireTensor]) -> Vec<u8> {
    let mut p = device.to_le_bytes().to_vec();
    p.extend((nodes.len() as u32).to_le_bytes());
    nodes.iter().for_each(|n| p.extend(n.to_le_bytes()));
    p.extend((tensors.len() as u32).to_le_bytes());
    tensors.iter().for_each(|t| p.extend(t.to_bytes()));
    p
}

impl WireTensor {
    /// A contiguous f32 tensor of `n` elements at `data` in `buffer`.
    pub fn f32(id: u64, buffer: u64, data: u64, n: u32) -> Self {
        Self { id, ty: 0, buffer, data, ne: [n, 1, 1, 1], nb: [4, 4 * n, 4 * n, 4 * n], ..Self::default() }
    }

    /// The packed bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(TENSOR_SIZE);
        b.extend(self.id.to_le_bytes());
        b.extend(self.ty.to_le_bytes());
        b.extend(self.buffer.to_le_bytes());
        self.ne.iter().for_each(|v| b.extend(v.to_le_bytes()));
        self.nb.iter().for_each(|v| b.extend(v.to_le_bytes()));
        b.extend(self.op.to_le_bytes());
        self.op_params.iter().for_each(|v| b.extend(v.to_le_bytes()));
        b.extend(self.flags.to_le_bytes());
        self.src.iter().for_each(|v| b.extend(v.to_le_bytes()));
        b.extend(self.view_src.to_le_bytes());
        b.extend(self.view_offs.to_le_bytes());
        b.extend(self.data.to_le_bytes());
        b.extend(self.name);
        b.extend(0i32.to_le_bytes()); // use_count
        debug_assert_eq!(b.len(), TENSOR_SIZE);
        b
    }

    /// Parses the packed bytes of one `rpc_tensor` (`None` when `b` is not
    /// [`TENSOR_SIZE`] bytes long). The trailing `use_count` is not kept.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != TENSOR_SIZE {
            return None;
        }
        let mut at = 0;
        let mut take = |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap_or([0; 8]));
        let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap_or([0; 4]));
        let mut t = Self { id: u64_(take(8)), ty: u32_(take(4)), buffer: u64_(take(8)), ..Self::default() };
        t.ne.iter_mut().for_each(|v| *v = u32_(take(4)));
        t.nb.iter_mut().for_each(|v| *v = u32_(take(4)));
        t.op = u32_(take(4));
        t.op_params.iter_mut().for_each(|v| *v = u32_(take(4)) as i32);
        t.flags = u32_(take(4)) as i32;
        t.src.iter_mut().for_each(|v| *v = u64_(take(8)));
        t.view_src = u64_(take(8));
        t.view_offs = u64_(take(8));
        t.data = u64_(take(8));
        t.name.copy_from_slice(take(64));
        Some(t)
    }
}

/// One connection to a server, after the HELLO exchange.
pub struct WireClient {
    stream: TcpStream,
    /// Keepalive frames skipped so far.
    pub keepalives: usize,
}

impl WireClient {
    /// Connects and performs HELLO; every read and write then has `timeout`.
    pub fn connect(endpoint: &str, timeout: Duration) -> io::Result<Self> {
        Self::connect_with(endpoint, timeout, false).map(|(c, _)| c)
    }

    /// Like [`connect`](Self::connect), optionally asking for keepalive frames; also
    /// returns whether the server agreed.
    pub fn connect_with(endpoint: &str, timeout: Duration, keepalive: bool) -> io::Result<(Self, bool)> {
        let stream = TcpStream::connect(endpoint)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut c = Self { stream, keepalives: 0 };
        let mut caps = [0u8; sys::RPC_CONN_CAPS_SIZE];
        if keepalive {
            caps[sys::RPC_CONN_CAPS_SIZE - 1] = KEEPALIVE_CAP;
        }
        let rsp = c.call(cmd::HELLO, &caps)?;
        if rsp.len() != 4 + sys::RPC_CONN_CAPS_SIZE || rsp[0] != sys::RPC_PROTO_MAJOR_VERSION {
            return Err(io::Error::other(format!("unexpected HELLO answer {rsp:?}")));
        }
        let agreed = rsp[3 + sys::RPC_CONN_CAPS_SIZE] == KEEPALIVE_CAP;
        Ok((c, agreed))
    }

    /// Sends one request (any command byte, any payload).
    pub fn send(&mut self, command: u8, payload: &[u8]) -> io::Result<()> {
        let mut msg = Vec::with_capacity(9 + payload.len());
        msg.push(command);
        msg.extend((payload.len() as u64).to_le_bytes());
        msg.extend_from_slice(payload);
        self.stream.write_all(&msg)
    }

    /// Writes bytes as they are (a frame whose size field lies, a partial request).
    pub fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Reads one response, skipping keepalive frames. A closed connection is `UnexpectedEof`.
    fn recv(&mut self) -> io::Result<Vec<u8>> {
        let mut size = [0u8; 8];
        let size = loop {
            self.stream.read_exact(&mut size)?;
            match u64::from_le_bytes(size) {
                KEEPALIVE_FRAME => self.keepalives += 1,
                n => break n,
            }
        };
        if size > 1 << 30 {
            return Err(io::Error::other(format!("answer of {size} bytes")));
        }
        let mut out = vec![0u8; size as usize];
        self.stream.read_exact(&mut out)?;
        Ok(out)
    }

    /// A request with a response.
    pub fn call(&mut self, command: u8, payload: &[u8]) -> io::Result<Vec<u8>> {
        self.send(command, payload)?;
        self.recv()
    }

    /// This end's address: how the server names the client in its log.
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.stream.local_addr()
    }

    /// Whether the server has closed this connection: end of stream or a reset within
    /// the read timeout (a timeout or a byte of data means it is still open).
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        match self.stream.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut),
        }
    }

    /// ALLOC_BUFFER on device 0: `(remote_ptr, size)`; remote_ptr 0 means it failed.
    pub fn alloc_buffer(&mut self, size: u64) -> io::Result<(u64, u64)> {
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend(size.to_le_bytes());
        let r = self.call(cmd::ALLOC_BUFFER, &p)?;
        Ok((u64_at(&r, 0)?, u64_at(&r, 8)?))
    }

    /// BUFFER_GET_BASE.
    pub fn buffer_base(&mut self, remote_ptr: u64) -> io::Result<u64> {
        let r = self.call(cmd::BUFFER_GET_BASE, &remote_ptr.to_le_bytes())?;
        u64_at(&r, 0)
    }

    /// SET_TENSOR (no response): `| tensor | cache flag 0 | offset | data |`.
    pub fn set_tensor(&mut self, t: &WireTensor, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut p = t.to_bytes();
        p.push(0);
        p.extend(offset.to_le_bytes());
        p.extend_from_slice(data);
        self.send(cmd::SET_TENSOR, &p)
    }

    /// GET_TENSOR: `size` bytes from `offset`.
    pub fn get_tensor(&mut self, t: &WireTensor, offset: u64, size: u64) -> io::Result<Vec<u8>> {
        let mut p = t.to_bytes();
        p.extend(offset.to_le_bytes());
        p.extend(size.to_le_bytes());
        self.call(cmd::GET_TENSOR, &p)
    }
}

fn u64_at(b: &[u8], at: usize) -> io::Result<u64> {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
        .ok_or_else(|| io::Error::other(format!("answer of {} bytes, expected at least {}", b.len(), at + 8)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_layout_is_ggmls_packed_rpc_tensor() {
        let t = WireTensor { id: 1, data: 0x1122, name: [b'x'; 64], ..WireTensor::default() };
        let b = t.to_bytes();
        assert_eq!(b.len(), TENSOR_SIZE);
        assert_eq!(&b[..8], &1u64.to_le_bytes());
        // data sits after id, type, buffer, ne, nb, op, op_params, flags, src, view_src, view_offs
        let at = 8 + 4 + 8 + 16 + 16 + 4 + 64 + 4 + 80 + 8 + 8;
        assert_eq!(&b[at..at + 8], &0x1122u64.to_le_bytes());
        assert_eq!(b[at + 8], b'x');
        let mut u = t.clone();
        u.ne = [1, 2, 3, 4];
        u.op_params[15] = -7;
        u.src[9] = 9;
        assert_eq!(WireTensor::from_bytes(&u.to_bytes()), Some(u));
        assert_eq!(WireTensor::from_bytes(&b[1..]), None);
    }
}
