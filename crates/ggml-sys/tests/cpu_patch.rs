//! The CPU patch (`patches/cpu-speed.toml`) against the pinned source: it applies, upstream's
//! im2col loops are gone, the CPU variants are compiled from the patched copy, and a source
//! that drifted from the patch stops the build with the hunk named.

#[path = "../build/patch.rs"]
#[allow(dead_code)]
mod patch;

use std::path::Path;

fn patch() -> patch::Patch {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("patches/cpu-speed.toml");
    patch::Patch::parse(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn pinned_ops() -> String {
    std::fs::read_to_string(Path::new(ggml_sys::GGML_SOURCE_DIR).join("src/ggml-cpu/ops.cpp")).unwrap()
}

/// upstream's per-value im2col statements (2-D/1-D, f32 and f16 destinations)
const UPSTREAM_LOOPS: [&str; 3] = [
    "ikh*KW + ikw] = (src_data[iih*IW + iiw]);",
    "ikh*KW + ikw] = GGML_CPU_FP32_TO_FP16(src_data_f32[iih*IW + iiw]);",
    "ikh*KW + ikw] = src_data_f16[iih*IW + iiw];",
];

#[test]
fn the_patch_applies_to_the_pinned_source_and_replaces_the_im2col_loops() {
    let src = pinned_ops();
    for s in UPSTREAM_LOOPS {
        assert!(src.contains(s), "the pinned ops.cpp lost `{s}`: the test no longer checks anything");
    }
    let out = patch().apply_to("cpu-speed.toml", "ops.cpp", &src).unwrap();
    for s in UPSTREAM_LOOPS {
        assert!(!out.contains(s), "`{s}` is still in the patched ops.cpp");
    }
    // both destinations dispatch to the new kernel; the f16 one for both input types
    for call in [
        "sdrs_im2col_rows<float, float>(params, src1, dst, g);",
        "sdrs_im2col_rows<float, ggml_fp16_t>(params, src1, dst, g);",
        "sdrs_im2col_rows<ggml_fp16_t, ggml_fp16_t>(params, src1, dst, g);",
    ] {
        assert_eq!(out.matches(call).count(), 1, "{call}");
    }
    // the other im2col kernels (backward, 3-D) are upstream's
    for f in ["ggml_compute_forward_im2col_back_f32(", "ggml_compute_forward_im2col_3d_f16("] {
        let body = |t: &str| t[t.find(f).unwrap()..][..2000].to_string();
        assert_eq!(body(&out), body(&src), "{f} changed");
    }
}

#[test]
fn the_cpu_variants_are_compiled_from_the_patched_copy() {
    // build.rs writes the copy next to the objects it compiles: <build>/cc/patched/ggml-cpu
    let build_root = Path::new(ggml_sys::BUILD_PLUGIN_DIR).parent().unwrap();
    let copy = build_root.join("cc/patched/ggml-cpu");
    let ops = std::fs::read_to_string(copy.join("ops.cpp")).unwrap();
    assert_eq!(ops, patch().apply_to("cpu-speed.toml", "ops.cpp", &pinned_ops()).unwrap());
    let pinned_c =
        std::fs::read_to_string(Path::new(ggml_sys::GGML_SOURCE_DIR).join("src/ggml-cpu/ggml-cpu.c")).unwrap();
    let c = std::fs::read_to_string(copy.join("ggml-cpu.c")).unwrap();
    assert_eq!(c, patch().apply_to("cpu-speed.toml", "ggml-cpu.c", &pinned_c).unwrap());
    assert!(c.contains("if (sdrs_f16_amx_mul_mat(params, dst)) {"));
    assert!(c.contains("if (sdrs_gemm_avx512_mul_mat(params, dst)) {"));
    // the patch's own file is added as it is
    let added = ["sdrs-f16-amx.cpp", "sdrs-gemm-avx512.cpp"];
    for name in added {
        let ours = Path::new(env!("CARGO_MANIFEST_DIR")).join("patches/cpu-speed").join(name);
        let same = std::fs::read(copy.join(name)).unwrap() == std::fs::read(ours).unwrap();
        assert!(same, "{name}: the copy compiled differs from patches/cpu-speed/{name}");
    }
    assert_eq!(patch().adds.iter().map(|a| a.name.as_str()).collect::<Vec<_>>(), added);
    // the rest of the tree is copied unchanged, subdirectories included
    for rel in ["ggml-cpu.cpp", "arch/x86/quants.c", "llamafile/sgemm.cpp"] {
        let pinned = std::fs::read(Path::new(ggml_sys::GGML_SOURCE_DIR).join("src/ggml-cpu").join(rel)).unwrap();
        assert_eq!(std::fs::read(copy.join(rel)).unwrap(), pinned, "{rel}");
    }
}

#[test]
fn a_drifted_source_is_refused_with_the_hunk_named() {
    let p = patch();
    let src = pinned_ops();
    // an anchor that no longer exists (upstream renamed the f16 kernel's buffer)
    let gone = src.replace("ggml_fp16_t * const wdata = (ggml_fp16_t *) dst->data;\n\n        for (int64_t in", "X");
    let err = p.apply_to("cpu-speed.toml", "ops.cpp", &gone).unwrap_err();
    assert!(err.contains("hunk 7") && err.contains("f16 destination") && err.contains("found it 0 times"), "{err}");
    // an anchor that now occurs twice
    let twice = format!("{src}\n// ggml_compute_forward_im2col_f32\n");
    let err = p.apply_to("cpu-speed.toml", "ops.cpp", &twice).unwrap_err();
    assert!(err.contains("hunk 5") && err.contains("found it 2 times"), "{err}");
    // a second copy of an upstream loop elsewhere in the file
    let more = format!("{src}\n// dst_data[iic*(KH*KW) + {}\n", UPSTREAM_LOOPS[1]);
    let err = p.apply_to("cpu-speed.toml", "ops.cpp", &more).unwrap_err();
    assert!(err.contains("still in the patched ops.cpp"), "{err}");
}
