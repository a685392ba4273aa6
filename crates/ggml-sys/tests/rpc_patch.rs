//! The RPC patch (`patches/rpc-faults.toml`) against the pinned source: it applies, and a
//! source that drifted from it stops the build with the hunk named instead of compiling.

#[path = "../build/patch.rs"]
#[allow(dead_code)]
mod patch;

use std::path::Path;

fn patch() -> patch::Patch {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("patches/rpc-faults.toml");
    patch::Patch::parse(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn pinned(name: &str) -> String {
    std::fs::read_to_string(Path::new(ggml_sys::GGML_SOURCE_DIR).join("src/ggml-rpc").join(name)).unwrap()
}

#[test]
fn the_patch_applies_to_the_pinned_source_and_removes_every_abort_site() {
    let p = patch();
    for name in ["ggml-rpc.cpp", "transport.cpp", "transport.h"] {
        let out = p.apply_to("rpc-faults.toml", name, &pinned(name)).unwrap();
        assert_ne!(out, pinned(name), "{name} unchanged");
    }
    let rpc = p.apply_to("rpc-faults.toml", "ggml-rpc.cpp", &pinned("ggml-rpc.cpp")).unwrap();
    assert!(!rpc.contains("RPC_STATUS_ASSERT(status)") && rpc.contains("mark_lost"));
}

#[test]
fn a_drifted_source_is_refused_with_the_hunk_named() {
    let p = patch();
    let src = pinned("ggml-rpc.cpp");
    // an anchor that no longer exists
    let gone = src.replace("RPC_STATUS_ASSERT(status);", "CHECK(status);");
    let err = p.apply_to("rpc-faults.toml", "ggml-rpc.cpp", &gone).unwrap_err();
    assert!(err.contains("hunk") && err.contains("found it 0 times"), "{err}");
    // an anchor that now occurs twice
    let twice = format!("{src}\n{}", "    sock->get_caps(rsp.conn_caps);\n");
    let err = p.apply_to("rpc-faults.toml", "ggml-rpc.cpp", &twice).unwrap_err();
    assert!(err.contains("found it 2 times") && err.contains("keepalives"), "{err}");
    // a new abort site upstream added elsewhere
    let more = format!("{src}\nstatic void f(bool status) {{ RPC_STATUS_ASSERT(status); }}\n");
    let err = p.apply_to("rpc-faults.toml", "ggml-rpc.cpp", &more).unwrap_err();
    assert!(err.contains("still in the patched"), "{err}");
}
