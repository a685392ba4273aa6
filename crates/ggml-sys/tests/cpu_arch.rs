//! The CPU backend's branch per target architecture (`build/spec.rs` over `ggml-build.toml`
//! and `plugins/cpu/plugin.toml`): x86-64 compiles what it compiled before the ARM branch
//! existed, AArch64 Linux gets ggml's ARM sources, score function and per-variant `-march`
//! flags as ggml's CMake files give them, and any other target stops with its architecture
//! named. Pure logic: this x86 machine has no AArch64 compiler, so the ARM build itself is
//! not compiled here.

#[path = "../../../plugins/manifest.rs"]
mod manifest;
#[path = "../build/spec.rs"]
#[allow(dead_code)] // the build script reads the other tables
mod spec;

use std::path::Path;

fn spec() -> spec::Spec {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("ggml-build.toml");
    toml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn plugin() -> manifest::Manifest {
    manifest::Manifest::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../plugins/cpu/plugin.toml")).unwrap()
}

fn target(arch: &str) -> spec::CpuTarget {
    spec().cpu.for_target(arch, "linux", true).unwrap()
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Every variant's sources before the branch's own (`[cpu].sources`).
const COMMON: [&str; 14] = [
    "src/ggml-cpu/ggml-cpu.c",
    "src/ggml-cpu/ggml-cpu.cpp",
    "src/ggml-cpu/repack.cpp",
    "src/ggml-cpu/hbm.cpp",
    "src/ggml-cpu/quants.c",
    "src/ggml-cpu/traits.cpp",
    "src/ggml-cpu/amx/amx.cpp",
    "src/ggml-cpu/amx/mmq.cpp",
    "src/ggml-cpu/tiled/tiled.cpp",
    "src/ggml-cpu/tiled/tiled-kernel.cpp",
    "src/ggml-cpu/binary-ops.cpp",
    "src/ggml-cpu/unary-ops.cpp",
    "src/ggml-cpu/vec.cpp",
    "src/ggml-cpu/ops.cpp",
];

/// What the x86 build compiled before the manifest had branches (the old `[cpu]`,
/// `[cpu.features]` and `[cpu.variants]` tables, resolved by the old `compile::plan`):
/// `variant | definitions | flags`. The compile commands, and so the cache keys of the
/// libraries, depend on exactly these lists in this order.
const X86_BEFORE: &str = "\
alderlake | GGML_AVX GGML_AVX2 GGML_AVX_VNNI GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mavxvnni -mbmi2 -mf16c -mfma -msse4.2
cannonlake | GGML_AVX GGML_AVX2 GGML_AVX512 GGML_AVX512_VBMI GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512vbmi -mbmi2 -mf16c -mfma -msse4.2
cascadelake | GGML_AVX GGML_AVX2 GGML_AVX512 GGML_AVX512_VNNI GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512vnni -mbmi2 -mf16c -mfma -msse4.2
cooperlake | GGML_AVX GGML_AVX2 GGML_AVX512 GGML_AVX512_BF16 GGML_AVX512_VNNI GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512bf16 -mavx512vnni -mbmi2 -mf16c -mfma -msse4.2
haswell | GGML_AVX GGML_AVX2 GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mbmi2 -mf16c -mfma -msse4.2
icelake | GGML_AVX GGML_AVX2 GGML_AVX512 GGML_AVX512_VBMI GGML_AVX512_VNNI GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512vbmi -mavx512vnni -mbmi2 -mf16c -mfma -msse4.2
ivybridge | GGML_AVX GGML_F16C GGML_SSE42 | -mavx -mf16c -msse4.2
native-f32acc |  | -march=native -mno-avx512fp16
piledriver | GGML_AVX GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mf16c -mfma -msse4.2
sandybridge | GGML_AVX GGML_SSE42 | -mavx -msse4.2
sapphirerapids | GGML_AMX_INT8 GGML_AMX_TILE GGML_AVX GGML_AVX2 GGML_AVX512 GGML_AVX512_BF16 GGML_AVX512_VBMI GGML_AVX512_VNNI GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mamx-int8 -mamx-tile -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512bf16 -mavx512vbmi -mavx512vnni -mbmi2 -mf16c -mfma -msse4.2
skylakex | GGML_AVX GGML_AVX2 GGML_AVX512 GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mbmi2 -mf16c -mfma -msse4.2
sse42 | GGML_SSE42 | -msse4.2
x64 |  | 
zen4 | GGML_AVX GGML_AVX2 GGML_AVX512 GGML_AVX512_BF16 GGML_AVX512_VBMI GGML_AVX512_VNNI GGML_BMI2 GGML_F16C GGML_FMA GGML_SSE42 | -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512bf16 -mavx512vbmi -mavx512vnni -mbmi2 -mf16c -mfma -msse4.2";

#[test]
fn x86_64_compiles_what_it_compiled_before() {
    let t = target("x86_64");
    assert_eq!(t.arch, "x86");
    let mut sources = strings(&COMMON);
    sources.extend(strings(&[
        "src/ggml-cpu/arch/x86/quants.c",
        "src/ggml-cpu/arch/x86/repack.cpp",
        "src/ggml-cpu/llamafile/sgemm.cpp",
    ]));
    assert_eq!(t.sources, sources);
    assert_eq!(t.defines, ["GGML_USE_LLAMAFILE", "GGML_USE_CPU_REPACK"]);
    assert_eq!(t.includes, ["src", "src/ggml-cpu", "include"]);
    assert_eq!(t.feats_source, "src/ggml-cpu/arch/x86/cpu-feats.cpp");
    assert_eq!(t.feats_includes, ["src", "include"]);
    assert!(t.flags_if_accepted.is_empty(), "x86 probes no flag");
    let words = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    let mut names = Vec::new();
    for line in X86_BEFORE.lines() {
        let [name, defines, flags] = line.split(" | ").collect::<Vec<_>>()[..] else { panic!("{line}") };
        let want = spec::Variant { flags: words(flags), defines: words(defines) };
        assert_eq!(t.variants[name.trim()], want, "{name}");
        names.push(name.trim());
    }
    assert_eq!(t.variants.keys().map(String::as_str).collect::<Vec<_>>(), names);
    // the defaults, and `all` (without the parity-only variant)
    let defaults = t.choose_variants(None, plugin().cpu_variants("x86_64")).unwrap();
    assert_eq!(defaults, ["x64", "haswell", "skylakex", "zen4", "sapphirerapids"]);
    let all = t.choose_variants(Some("all"), &[]).unwrap();
    assert_eq!(all.len(), 14);
    assert!(!all.iter().any(|v| v == "native-f32acc"));
    assert_eq!(t.choose_variants(Some(" haswell, x64 "), &[]).unwrap(), ["haswell", "x64"]);
}

#[test]
fn aarch64_linux_takes_the_arm_branch() {
    let t = target("aarch64");
    assert_eq!(t.arch, "arm");
    let mut sources = strings(&COMMON);
    sources.extend(strings(&[
        "src/ggml-cpu/arch/arm/quants.c",
        "src/ggml-cpu/arch/arm/repack.cpp",
        "src/ggml-cpu/llamafile/sgemm.cpp",
    ]));
    assert_eq!(t.sources, sources);
    assert_eq!(t.defines, ["GGML_USE_LLAMAFILE", "GGML_USE_CPU_REPACK"]);
    assert_eq!(t.feats_source, "src/ggml-cpu/arch/arm/cpu-feats.cpp");
    assert_eq!(t.flags_if_accepted, ["-mfp16-format=ieee"]);
    assert!(!t.sources.iter().chain([&t.feats_source]).any(|s| s.contains("/x86/")));
}

/// ggml/src/ggml-cpu/CMakeLists.txt, GGML_CPU_ALL_VARIANTS on ARM: ARM_MCPU starts at
/// armv8-a; DOTPROD, FP16_VECTOR_ARITHMETIC and SVE raise it to armv8.2-a, MATMUL_INT8 and
/// SVE2 to armv8.6-a, SME to armv9.2-a; tags +dotprod +fp16 +sve +i8mm +sve2 +sme in that
/// order; definitions GGML_USE_<feature>. Features per variant: ggml/src/CMakeLists.txt.
#[test]
fn each_arm_variant_gets_ggml_cmake_flags_and_definitions() {
    let t = target("aarch64");
    let d = |f: &str| format!("GGML_USE_{f}");
    let expect = [
        ("armv8.0_1", "-march=armv8-a", vec![]),
        ("armv8.2_1", "-march=armv8.2-a+dotprod", vec![d("DOTPROD")]),
        ("armv8.2_2", "-march=armv8.2-a+dotprod+fp16", vec![d("DOTPROD"), d("FP16_VECTOR_ARITHMETIC")]),
        ("armv8.2_3", "-march=armv8.2-a+dotprod+fp16+sve", vec![d("DOTPROD"), d("FP16_VECTOR_ARITHMETIC"), d("SVE")]),
        (
            "armv8.6_1",
            "-march=armv8.6-a+dotprod+fp16+sve+i8mm",
            vec![d("DOTPROD"), d("FP16_VECTOR_ARITHMETIC"), d("SVE"), d("MATMUL_INT8")],
        ),
        (
            "armv8.6_2",
            "-march=armv8.6-a+dotprod+fp16+sve+i8mm+sve2",
            vec![d("DOTPROD"), d("FP16_VECTOR_ARITHMETIC"), d("SVE"), d("MATMUL_INT8"), d("SVE2")],
        ),
        (
            "armv9.2_1",
            "-march=armv9.2-a+dotprod+fp16+sve+i8mm+sme",
            vec![d("DOTPROD"), d("FP16_VECTOR_ARITHMETIC"), d("SVE"), d("MATMUL_INT8"), d("SME")],
        ),
        (
            "armv9.2_2",
            "-march=armv9.2-a+dotprod+fp16+sve+i8mm+sve2+sme",
            vec![d("DOTPROD"), d("FP16_VECTOR_ARITHMETIC"), d("SVE"), d("MATMUL_INT8"), d("SVE2"), d("SME")],
        ),
    ];
    for (name, march, defines) in &expect {
        assert_eq!(
            t.variants[*name],
            spec::Variant { flags: vec![march.to_string()], defines: defines.clone() },
            "{name}"
        );
    }
    assert_eq!(t.variants.len(), expect.len());
}

#[test]
fn aarch64_picks_its_own_defaults_and_all() {
    let t = target("aarch64");
    let defaults = t.choose_variants(None, plugin().cpu_variants("aarch64")).unwrap();
    assert_eq!(defaults, ["armv8.0_1", "armv8.2_2", "armv8.6_1"]);
    let all = t.choose_variants(Some("all"), &[]).unwrap();
    assert_eq!(all.len(), 8);
    assert!(all.iter().all(|v| v.starts_with("armv")), "{all:?}");
    // an x86 variant asked for on AArch64 is refused with the branch's own list
    let err = t.choose_variants(Some("haswell"), &[]).unwrap_err();
    assert!(err.contains("`haswell`") && err.contains("arm branch") && err.contains("armv8.0_1"), "{err}");
    let err = t.choose_variants(Some(" , "), &[]).unwrap_err();
    assert!(err.contains("SD_GGML_CPU_VARIANTS is empty"), "{err}");
}

#[test]
fn llamafile_off_drops_its_source_and_definition_on_every_branch() {
    for arch in ["x86_64", "aarch64"] {
        let on = spec().cpu.for_target(arch, "linux", true).unwrap();
        let off = spec().cpu.for_target(arch, "linux", false).unwrap();
        assert_eq!(off.defines, ["GGML_USE_CPU_REPACK"]);
        let without: Vec<String> = on.sources.iter().filter(|s| !s.contains("/llamafile/")).cloned().collect();
        assert_eq!(off.sources, without);
        assert_eq!(off.sources.len() + 1, on.sources.len());
        assert_eq!(off.variants, on.variants);
    }
}

#[test]
fn another_architecture_or_os_stops_the_build_with_its_name() {
    for arch in ["riscv64", "powerpc64", "x86", "arm", "wasm32"] {
        let err = spec().cpu.for_target(arch, "linux", true).unwrap_err();
        assert!(err.contains(&format!("target architecture `{arch}`")), "{err}");
        assert!(err.contains("x86_64 (x86)") && err.contains("aarch64 on linux (arm)"), "{err}");
    }
    // ggml's CMake lists other ARM variants for Apple and Android
    for os in ["macos", "android"] {
        let err = spec().cpu.for_target("aarch64", os, true).unwrap_err();
        assert!(err.contains("`aarch64`") && err.contains(&format!("not on `{os}`")), "{err}");
    }
    // x86-64 is described for any OS, as before
    assert_eq!(spec().cpu.for_target("x86_64", "macos", true).unwrap().arch, "x86");
    assert!(plugin().cpu_variants("riscv64").is_empty());
}

#[test]
fn a_variant_naming_an_unknown_feature_is_refused() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ggml-build.toml")).unwrap();
    let bad = text.replace(r#""armv8.2_1" = ["DOTPROD"]"#, r#""armv8.2_1" = ["DOTPROD", "NEON2"]"#);
    assert_ne!(bad, text, "the test no longer edits the manifest");
    let s: spec::Spec = toml::from_str(&bad).unwrap();
    let err = s.cpu.for_target("aarch64", "linux", true).unwrap_err();
    assert!(err.contains("`armv8.2_1`") && err.contains("`NEON2`") && err.contains("[cpu.arch.arm]"), "{err}");
}

/// The body of `if (<cond>)` up to its `endif()` in `text`.
fn cmake_block<'a>(text: &'a str, cond: &str) -> &'a str {
    let open = format!("if ({cond})");
    let at = text.find(&open).unwrap_or_else(|| panic!("no `{open}` in ggml's CMake"));
    let body = &text[at + open.len()..];
    &body[..body.find("endif()").unwrap()]
}

/// The manifest's ARM facts against the pinned ggml's own CMake files, so a moved pin that
/// changes them fails here rather than on an AArch64 machine.
#[test]
fn the_arm_branch_matches_the_pinned_ggml_cmake() {
    let src = Path::new(ggml_sys::GGML_SOURCE_DIR);
    let cpu_cmake = std::fs::read_to_string(src.join("src/ggml-cpu/CMakeLists.txt")).unwrap();
    let spec = spec();
    let arm = &spec.cpu.arch["arm"];
    // the branch's sources and its score function
    let arm_branch = cmake_block(&cpu_cmake, r#"GGML_SYSTEM_ARCH STREQUAL "ARM""#);
    for s in &arm.sources {
        assert!(arm_branch.contains(s.strip_prefix("src/").unwrap()), "{s} not in ggml's ARM branch");
    }
    assert!(cpu_cmake.contains("ggml_add_cpu_backend_features(${GGML_CPU_NAME} arm ${ARCH_DEFINITIONS})"));
    assert!(src.join(&arm.feats_source).is_file());
    assert!(cpu_cmake.contains("check_cxx_compiler_flag(-mfp16-format=ieee"));
    // each feature: the architecture it raises -march to, its tag, its definition
    let march = arm.march.as_ref().unwrap();
    assert!(cpu_cmake.contains(&format!(r#"set(ARM_MCPU "{}")"#, march.base)));
    let mut at = 0;
    for f in &march.features {
        let block = cmake_block(&cpu_cmake, &format!("GGML_INTERNAL_{}", f.name));
        let arch = f.arch.as_ref().unwrap();
        assert!(block.contains(&format!(r#"set(ARM_MCPU "{arch}")"#)), "{}: {block}", f.name);
        assert!(block.contains(&format!(r#"set(ARCH_TAGS "${{ARCH_TAGS}}{}")"#, f.tag)), "{}: {block}", f.name);
        let define = f.define.as_ref().unwrap();
        assert!(block.contains(&format!("list(APPEND ARCH_DEFINITIONS {define})")), "{}: {block}", f.name);
        // in CMake's order (the tags' order in -march)
        let pos = cpu_cmake.find(&format!("if (GGML_INTERNAL_{})", f.name)).unwrap();
        assert!(pos > at, "{} out of CMake's order", f.name);
        at = pos;
    }
    assert!(cpu_cmake.contains(r#"list(APPEND ARCH_FLAGS "-march=${ARM_MCPU}${ARCH_TAGS}")"#));
    // the Linux variants: ggml_add_cpu_backend_variant(<name> <features>) lines of
    // ggml/src/CMakeLists.txt's ARM Linux list
    let cmake = std::fs::read_to_string(src.join("src/CMakeLists.txt")).unwrap();
    let linux = cmake_block(
        &cmake[cmake.find(r#"elseif(GGML_SYSTEM_ARCH STREQUAL "ARM")"#).unwrap()..],
        "CMAKE_SYSTEM_NAME MATCHES \"Linux\"",
    );
    let linux = &linux[..linux.find("elseif").unwrap()];
    let listed: Vec<(String, Vec<String>)> = linux
        .lines()
        .filter_map(|l| l.trim().strip_prefix("ggml_add_cpu_backend_variant(")?.strip_suffix(')').map(str::to_owned))
        .map(|l| {
            let mut w = l.split_whitespace().map(String::from);
            (w.next().unwrap(), w.collect())
        })
        .collect();
    assert_eq!(listed.len(), 8, "{linux}");
    let ours: Vec<(String, Vec<String>)> = arm.variants.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    assert_eq!(ours, listed);
}
