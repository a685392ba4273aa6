//! ggml's log messages, forwarded into `tracing` under the target `ggml`.
//!
//! ggml logs in fragments (`GGML_LOG_LEVEL_CONT` continues the previous
//! message); we buffer per thread until a newline and emit whole lines at the
//! level of the fragment that started them. Installing the bridge is global
//! and idempotent; it installs no subscriber (binaries do that).

use std::cell::RefCell;
use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::sync::Once;

use ggml_sys as sys;

thread_local! {
    static PENDING: RefCell<(u32, String)> = const { RefCell::new((0, String::new())) };
}

/// Routes ggml's (and every plugin's) log output into `tracing`.
pub fn install_log_bridge() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the callback is a plain function valid for the whole program and
        // ignores user_data; ggml stores the pointer in a global.
        unsafe { sys::ggml_log_set(Some(on_log), std::ptr::null_mut()) };
    });
}

unsafe extern "C" fn on_log(level: sys::ggml_log_level, text: *const c_char, _ud: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: ggml passes a NUL-terminated string valid for the call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let _ = std::panic::catch_unwind(|| {
        PENDING.with(|p| {
            let mut p = p.borrow_mut();
            if level != sys::ggml_log_level::GGML_LOG_LEVEL_CONT {
                if !p.1.is_empty() {
                    let line = std::mem::take(&mut p.1);
                    emit(p.0, &line);
                }
                p.0 = level.0;
            }
            p.1.push_str(&text);
            while let Some(pos) = p.1.find('\n') {
                let line: String = p.1.drain(..=pos).collect();
                emit(p.0, line.trim_end());
            }
        })
    });
}

fn emit(level: u32, line: &str) {
    if line.is_empty() {
        return;
    }
    match sys::ggml_log_level(level) {
        sys::ggml_log_level::GGML_LOG_LEVEL_ERROR => tracing::error!(target: "ggml", "{line}"),
        sys::ggml_log_level::GGML_LOG_LEVEL_WARN => tracing::warn!(target: "ggml", "{line}"),
        sys::ggml_log_level::GGML_LOG_LEVEL_INFO => tracing::info!(target: "ggml", "{line}"),
        _ => tracing::debug!(target: "ggml", "{line}"),
    }
}
