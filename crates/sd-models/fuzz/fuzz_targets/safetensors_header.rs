//! Fuzz target: arbitrary bytes as a whole safetensors file must never panic the header parser.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sd_models_fuzz::files::safetensors;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = safetensors::parse(data) {
        // Whatever is accepted must point inside the input.
        for t in &h.tensors {
            assert!(t.offset + t.len <= data.len() as u64, "{} out of bounds", t.name);
        }
    }
});
