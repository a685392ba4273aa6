//! Byte units and their human-readable rendering.

/// One MiB.
pub const MIB: u64 = 1 << 20;
/// One GiB.
pub const GIB: u64 = 1 << 30;

/// `1.50 GiB` from one GiB up, `512.0 MiB` below.
pub fn fmt_bytes(bytes: u64) -> String {
    if bytes >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

/// `bytes` for `Some`, `unknown` for `None`.
pub fn fmt_opt(bytes: Option<u64>) -> String {
    bytes.map_or_else(|| "unknown".to_string(), fmt_bytes)
}
