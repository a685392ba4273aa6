//! Events: points in a backend's queue that other work can wait for.
//!
//! Ownership: an [`Event`] owns its `ggml_backend_event_t` and frees it on drop.

use ggml_sys as sys;

use crate::backend::Backend;
use crate::device::Device;

/// A synchronisation event on a device.
pub struct Event {
    raw: sys::ggml_backend_event_t,
}

// SAFETY: events are designed to be signalled and waited on across threads.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event")
    }
}

impl Event {
    /// A new event, or None when the device has no event support.
    pub fn new(device: Device) -> Option<Self> {
        if !device.caps().events {
            return None;
        }
        // SAFETY: a live device with event support.
        let raw = unsafe { sys::ggml_backend_event_new(device.as_raw()) };
        (!raw.is_null()).then_some(Self { raw })
    }

    /// Records the event in `backend`'s queue.
    pub fn record(&self, backend: &Backend) {
        // SAFETY: live event and backend of the same device.
        unsafe { sys::ggml_backend_event_record(self.raw, backend.as_raw()) }
    }

    /// Blocks until the event has happened.
    pub fn synchronize(&self) {
        // SAFETY: live event.
        unsafe { sys::ggml_backend_event_synchronize(self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own it.
        unsafe { sys::ggml_backend_event_free(self.raw) }
    }
}
