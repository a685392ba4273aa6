//! The SIGBUS guard of mapped model files: a fault inside one of our maps ends the run with a message naming the file.
//!
//! A memory-mapped file that another process truncates while we read it makes the kernel
//! send SIGBUS on the first access past the new end. Nothing can resume the faulting read
//! (the bytes are gone), so the process must end; what this guard changes is *how*: instead of
//! a silent signal death, the handler writes
//! `error: model file '<path>' was truncated while in use (...)` to stderr and exits with
//! status [`EXIT_FILE_CHANGED`]. It acts only on faults whose address lies inside a map
//! registered here; any other SIGBUS is passed to the disposition that was installed before
//! (Rust's runtime installs one for stack guard pages), exactly as if the guard were absent.
//!
//! Truncation *between* reads is caught earlier and as an ordinary error: the loader compares
//! each file's size and modification time with those seen at open before it reads a tensor
//! (`ModelFiles::check_unchanged`). The guard covers the remaining window, a truncation during
//! the copy of one tensor.
//!
//! The handler is async-signal-safe: it reads a fixed table of atomics (no allocation, no
//! lock) and calls only `write(2)`, `sigaction(2)` and `_exit(2)`. Registered paths are leaked
//! on purpose (a few bytes per opened file), so the handler can never read freed memory.

use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Exit status of a run ended because a mapped model file was truncated under it.
const EXIT_FILE_CHANGED: i32 = 74;

const SLOTS: usize = 64;

struct Slot {
    /// First address of the map; 0 while the slot is free.
    start: AtomicUsize,
    end: AtomicUsize,
    path: AtomicPtr<u8>,
    path_len: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    path: AtomicPtr::new(std::ptr::null_mut()),
    path_len: AtomicUsize::new(0),
};
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];

/// The disposition SIGBUS had before ours, restored for faults that are not ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A registered map; unregisters on drop.
#[derive(Debug)]
pub(crate) struct Registration(Option<usize>);

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            TABLE[i].start.store(0, Ordering::SeqCst);
        }
    }
}

/// Registers `len` bytes at `start`, mapped from `path`. With every slot taken the map is
/// simply not guarded (a debug line says so).
pub(crate) fn register(start: *const u8, len: usize, path: &std::path::Path) -> Registration {
    install();
    let bytes: &'static mut [u8] = Box::leak(path.display().to_string().into_bytes().into_boxed_slice());
    for (i, slot) in TABLE.iter().enumerate() {
        // Claim the slot with a marker that no real map start can equal (1 is never page-aligned).
        if slot.start.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            slot.path.store(bytes.as_mut_ptr(), Ordering::SeqCst);
            slot.path_len.store(bytes.len(), Ordering::SeqCst);
            slot.end.store(start as usize + len, Ordering::SeqCst);
            slot.start.store(start as usize, Ordering::SeqCst);
            return Registration(Some(i));
        }
    }
    tracing::debug!(path = %path.display(), "no free SIGBUS guard slot; this map is not guarded");
    Registration(None)
}

fn install() {
    PREVIOUS.get_or_init(|| {
        // SAFETY: plain sigaction calls with valid, zero-initialised structs; the handler is an
        // `extern "C"` function that stays valid for the life of the process.
        unsafe {
            let mut previous: libc::sigaction = std::mem::zeroed();
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGBUS, &action, &mut previous);
            previous
        }
    });
}

fn write_stderr(bytes: &[u8]) {
    // SAFETY: write(2) on fd 2 with a valid buffer; async-signal-safe.
    unsafe {
        libc::write(2, bytes.as_ptr().cast(), bytes.len());
    }
}

/// Decimal digits of `v` into `buf`, returning the used tail (no allocation).
fn decimal(mut v: usize, buf: &mut [u8; 24]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[i..];
        }
    }
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in &TABLE {
        let start = slot.start.load(Ordering::SeqCst);
        if start <= 1 || addr < start || addr >= slot.end.load(Ordering::SeqCst) {
            continue;
        }
        let (ptr, len) = (slot.path.load(Ordering::SeqCst), slot.path_len.load(Ordering::SeqCst));
        write_stderr(b"error: model file '");
        if !ptr.is_null() {
            // SAFETY: the path bytes were leaked at registration and are never freed.
            write_stderr(unsafe { std::slice::from_raw_parts(ptr, len) });
        }
        write_stderr(b"' was truncated while in use (read fault at byte ");
        let mut buf = [0u8; 24];
        write_stderr(decimal(addr - start, &mut buf));
        write_stderr(b" of the map); do not modify or truncate a model file during a run\n");
        // SAFETY: _exit is async-signal-safe; nothing else may run after a lost read.
        unsafe { libc::_exit(EXIT_FILE_CHANGED) };
    }
    // Not ours: put the previous disposition back and return; the faulting instruction runs
    // again and the fault goes where it would have gone without us.
    if let Some(previous) = PREVIOUS.get() {
        // SAFETY: restoring a disposition obtained from sigaction itself.
        unsafe { libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_digits() {
        let mut b = [0u8; 24];
        assert_eq!(decimal(0, &mut b), b"0");
        assert_eq!(decimal(4096, &mut b), b"4096");
        assert_eq!(decimal(usize::MAX, &mut b), usize::MAX.to_string().as_bytes());
    }

    /// Runs in two roles: as the test, it starts this test binary again on itself with
    /// `SD_GUARD_CHILD` set; as the child, it maps a file, truncates it and reads past the new
    /// end, which must end the child with [`EXIT_FILE_CHANGED`] and a message naming the file,
    /// not a SIGBUS death.
    #[test]
    fn a_fault_inside_a_map_ends_the_run_with_a_message_naming_the_file() {
        if let Some(path) = std::env::var_os("SD_GUARD_CHILD") {
            let files = crate::ModelFiles::open_model(&path).unwrap();
            let e = files.index().entries()[0].clone();
            std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(0).unwrap();
            let sum: u64 = files.bytes(&e).iter().map(|&b| u64::from(b)).sum();
            println!("read {sum} without a fault");
            std::process::exit(0);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("victim.safetensors");
        let n = 1 << 18;
        let json = format!(r#"{{"w":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#, 4 * n);
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        bytes.resize(bytes.len() + 4 * n, 1);
        std::fs::write(&path, &bytes).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "guard::tests::a_fault_inside_a_map_ends_the_run_with_a_message_naming_the_file"])
            .args(["--nocapture", "--test-threads=1"])
            .env("SD_GUARD_CHILD", &path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), None, "died by a signal: {stderr}");
        assert_eq!(out.status.code(), Some(EXIT_FILE_CHANGED), "{stderr}");
        assert!(stderr.contains("victim.safetensors") && stderr.contains("truncated while in use"), "{stderr}");
    }

    #[test]
    fn slots_are_reused_after_drop() {
        let p = std::path::Path::new("/x.safetensors");
        let regs: Vec<Registration> = (0..SLOTS).map(|i| register((4096 * (i + 1)) as *const u8, 10, p)).collect();
        // Other tests may hold slots too; at least one of ours is real, and dropping frees it.
        let held: Vec<usize> = regs.iter().filter_map(|r| r.0).collect();
        assert!(!held.is_empty());
        drop(regs);
        for i in held {
            assert_eq!(TABLE[i].start.load(Ordering::SeqCst), 0, "slot {i} not freed");
        }
    }
}
