//! Embeds the location of libggml-base in the binary's run path, so that
//! `target/<profile>/sd-cli` runs without LD_LIBRARY_PATH. An installed copy
//! also looks in `$ORIGIN` and `$ORIGIN/../lib`.
fn main() {
    if let Ok(dir) = std::env::var("DEP_GGML_BASE_LIB_DIR") {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,$ORIGIN:$ORIGIN/../lib:{dir}");
    }
}
