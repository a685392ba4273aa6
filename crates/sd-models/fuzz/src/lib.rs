//! The model-file header parsers of `sd-models`, compiled alone for fuzzing.
//!
//! The parsers are pure functions over a byte slice with no dependency on the rest of
//! `sd-models` (which links ggml through its other modules). Compiling their source files
//! here keeps the sanitizer build small and independent of ggml's CMake build, while the
//! fuzzed code is exactly the code `sd-models` ships.

pub mod files;
