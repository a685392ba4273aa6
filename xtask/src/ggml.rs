//! Where the workspace's ggml build lies (source tree, `libggml-base`, default plugins): the one place xtask asks.
//!
//! The facts are `ggml-sys`'s build-time constants, fixed by the build of `ggml-sys`
//! that xtask itself links (so they name this checkout's build, with the overrides
//! `SD_GGML_SOURCE_DIR` / `SD_GGML_BUILD_DIR` it was built with). The JSON copy the
//! build script leaves in `target/ggml` is for `xtask/bindgen`, which must run when the
//! workspace does not compile; xtask does not read it.

use std::path::PathBuf;

/// The ggml source tree the library and the default plugins were compiled from.
pub(crate) fn source_dir() -> PathBuf {
    PathBuf::from(ggml_sys::GGML_SOURCE_DIR)
}

/// The public headers of that source (`ggml.h`, `ggml-backend.h`, ...).
pub(crate) fn include_dir() -> PathBuf {
    source_dir().join("include")
}

/// The directory holding `libggml-base.so` (and its versioned names).
pub(crate) fn lib_dir() -> PathBuf {
    PathBuf::from(ggml_sys::BUILD_LIB_DIR)
}

/// Where the build installed the default plugins (the CPU variants, RPC).
pub(crate) fn plugin_dir() -> PathBuf {
    PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)
}

#[cfg(test)]
mod tests {
    /// The facts name what the build made: the source's headers, the core library, and
    /// one plugin file per CPU variant the build compiled.
    #[test]
    fn the_build_facts_name_existing_files() {
        assert!(super::include_dir().join("ggml.h").is_file(), "{}", super::include_dir().display());
        assert!(super::lib_dir().join("libggml-base.so").is_file(), "{}", super::lib_dir().display());
        for v in ggml_sys::BUILD_CPU_VARIANTS {
            let plugin = super::plugin_dir().join(format!("libggml-cpu-{v}.so"));
            assert!(plugin.is_file(), "{}", plugin.display());
        }
    }
}
