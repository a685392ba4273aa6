//! Cross-module tests of the model-file layer: malformed headers, round trips, opening
//! checkpoints / diffusers folders / component files, detection, and no-panic properties.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use crate::files::gguf::{GgufArray, GgufValue};
use crate::files::*;

// ---------------------------------------------------------------------------------------
// Byte builders, written from the format descriptions (not from our writers).
// ---------------------------------------------------------------------------------------

/// A safetensors file with this literal JSON header and `data_len` zero bytes of data.
fn st_raw(json: &str, data_len: usize) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.resize(out.len() + data_len, 0);
    out
}

fn st_err(json: &str, data_len: usize) -> FormatError {
    safetensors::parse(&st_raw(json, data_len)).expect_err("header should be rejected")
}

/// GGUF fields, little-endian, per ggml's gguf.h.
struct G(Vec<u8>);

impl G {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> G {
        let mut g = G(b"GGUF".to_vec());
        g.u32(version).u64(n_tensors).u64(n_kv);
        g
    }
    fn u32(&mut self, v: u32) -> &mut G {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut G {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i64(&mut self, v: i64) -> &mut G {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut G {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut G {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut G {
        self.str(key).u32(4).u32(v)
    }
    fn kv_str(&mut self, key: &str, v: &str) -> &mut G {
        self.str(key).u32(8).str(v)
    }
    /// name, n_dims, ne (ggml order), type, offset.
    fn tensor(&mut self, name: &str, ne: &[i64], ty: u32, offset: u64) -> &mut G {
        self.str(name).u32(ne.len() as u32);
        for &d in ne {
            self.i64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to `align`, then appends `data_len` bytes of data.
    fn data(&mut self, align: usize, data_len: usize) -> Vec<u8> {
        let mut out = self.0.clone();
        out.resize(out.len().div_ceil(align) * align, 0);
        out.extend((0..data_len).map(|i| i as u8));
        out
    }
}

fn gg_err(bytes: &[u8]) -> FormatError {
    gguf::parse(bytes).expect_err("GGUF header should be rejected")
}

// ---------------------------------------------------------------------------------------
// Safetensors: valid and malformed headers.
// ---------------------------------------------------------------------------------------

#[test]
fn safetensors_valid_header_is_read() {
    let json = r#"{"__metadata__":{"format":"pt","n":7},"b":{"dtype":"F16","shape":[2,3],"data_offsets":[16,28]},"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"s":{"dtype":"BF16","shape":[],"data_offsets":[28,30]},"z":{"dtype":"I8","shape":[0,5],"data_offsets":[0,0]}}"#;
    let bytes = st_raw(json, 40); // 10 trailing bytes after the last tensor: harmless.
    let h = safetensors::parse(&bytes).unwrap();
    let data_start = 8 + json.len() as u64;
    assert_eq!(h.data_start, data_start);
    // Non-string metadata values are skipped, strings kept.
    assert_eq!(h.metadata, BTreeMap::from([("format".to_owned(), "pt".to_owned())]));
    let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["b", "a", "s", "z"], "header order kept");
    let b = &h.tensors[0];
    assert_eq!((b.dtype, b.shape.clone(), b.offset, b.len), (DType::F16, vec![2, 3], data_start + 16, 12));
    assert_eq!(h.tensors[2].len, 2, "a scalar has one element");
    assert_eq!(h.tensors[3].len, 0, "zero-size tensors may share an offset");
}

#[test]
fn safetensors_truncated_and_lying_lengths() {
    assert!(matches!(safetensors::parse(&[]), Err(FormatError::Truncated { end: 8, file_len: 0, .. })));
    assert!(matches!(safetensors::parse(&[1, 0, 0]), Err(FormatError::Truncated { file_len: 3, .. })));
    // Length past the end of the file.
    let mut b = st_raw("{}", 0);
    b[..8].copy_from_slice(&1000u64.to_le_bytes());
    assert!(matches!(safetensors::parse(&b), Err(FormatError::HeaderLength { len: 1000, file_len: 10, .. })));
    // Absurd length.
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = safetensors::parse(&b).unwrap_err();
    assert!(matches!(e, FormatError::HeaderLength { len: u64::MAX, .. }), "{e}");
    assert!(e.to_string().contains("impossible"), "{e}");
}

#[test]
fn safetensors_non_utf8_and_bad_json() {
    let mut b = st_raw("{\"\u{e9}\":1}", 0);
    b[10] = 0xff; // break the UTF-8 sequence
    assert!(matches!(safetensors::parse(&b), Err(FormatError::NotUtf8 { .. })));
    assert!(matches!(st_err("{\"a\":", 0), FormatError::Json { .. }));
    assert!(matches!(st_err("[1,2]", 0), FormatError::Json { .. }));
    assert!(matches!(st_err("{} trailing", 0), FormatError::Json { .. }));
    // Deep nesting is refused by serde_json's recursion limit, not a stack overflow.
    let deep = format!("{{\"a\":{}{}}}", "[".repeat(10_000), "]".repeat(10_000));
    assert!(matches!(st_err(&deep, 0), FormatError::Json { .. }));
}

#[test]
fn safetensors_entry_errors_name_the_tensor() {
    let cases: &[(&str, usize, &str)] = &[
        (
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            16,
            "appears twice",
        ),
        (r#"{"w":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}"#, 8, "unknown dtype 'C64'"),
        (r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#, 8, "past its end"),
        (r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}}"#, 8, "begin is after end"),
        (r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8, "needs 12 bytes"),
        (r#"{"w":{"shape":[1],"data_offsets":[0,4]}}"#, 8, "\"dtype\" is missing"),
        (r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#, 8, "shape[0] is -1"),
        (r#"{"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#, 8, "shape[0] is 1.5"),
        (r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#, 8, "not [BEGIN, END]"),
        (r#"{"w":{"dtype":"F32","data_offsets":[0,4]}}"#, 8, "\"shape\" is missing"),
        (r#"{"w":[1,2]}"#, 8, "not an object"),
        (r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}"#, 8, "overflows"),
    ];
    for (json, data_len, needle) in cases {
        let e = st_err(json, *data_len);
        let msg = e.to_string();
        assert!(msg.contains("'w'"), "message must name the tensor: {msg}");
        assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
    }
    assert!(matches!(
        st_err(r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8),
        FormatError::SizeMismatch { expected: 12, actual: 8, .. }
    ));
}

#[test]
fn safetensors_overlap_names_both_tensors() {
    let json = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#;
    let e = st_err(json, 16);
    assert_eq!(e, FormatError::Overlap { first: "a".into(), second: "b".into(), overlap_start: 8, overlap_end: 16 });
    // Adjacent is fine; a gap is fine.
    let ok = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#;
    assert_eq!(safetensors::parse(&st_raw(ok, 20)).unwrap().tensors.len(), 2);
}

#[test]
fn safetensors_metadata_must_be_an_object() {
    assert!(matches!(st_err(r#"{"__metadata__":[1]}"#, 0), FormatError::BadMetadata { .. }));
}

/// The safetensors crate's own writer is an independent oracle for the layout.
#[test]
fn files_written_by_the_safetensors_crate_parse_identically() {
    use ::safetensors::tensor::{serialize, Dtype, TensorView};
    let a: Vec<u8> = (0..24).collect();
    let b: Vec<u8> = (100..104).collect();
    let views = vec![
        ("layer.a".to_owned(), TensorView::new(Dtype::F16, vec![3, 4], &a).unwrap()),
        ("layer.b".to_owned(), TensorView::new(Dtype::U8, vec![4], &b).unwrap()),
    ];
    let meta = std::collections::HashMap::from([("k".to_owned(), "v".to_owned())]);
    let bytes = serialize(views, &Some(meta)).unwrap();
    let h = safetensors::parse(&bytes).unwrap();
    assert_eq!(h.metadata.get("k").map(String::as_str), Some("v"));
    for t in &h.tensors {
        let data = &bytes[t.offset as usize..(t.offset + t.len) as usize];
        match t.name.as_str() {
            "layer.a" => assert_eq!((t.dtype, &t.shape[..], data), (DType::F16, &[3u64, 4][..], &a[..])),
            "layer.b" => assert_eq!((t.dtype, &t.shape[..], data), (DType::U8, &[4u64][..], &b[..])),
            other => panic!("unexpected tensor {other}"),
        }
    }
}

// ---------------------------------------------------------------------------------------
// GGUF: valid and malformed headers.
// ---------------------------------------------------------------------------------------

/// A valid v3 file: 2 KVs, 2 tensors (f32 [2,3] in ggml order, q8_0 [32,2]).
fn valid_gguf() -> Vec<u8> {
    let mut g = G::new(3, 2, 2);
    g.kv_str("general.name", "tiny").kv_u32("general.alignment", 64);
    g.tensor("t.f32", &[2, 3], 0, 0).tensor("t.q8", &[32, 2], 8, 64);
    g.data(64, 64 + 68)
}

#[test]
fn gguf_valid_header_is_read() {
    let bytes = valid_gguf();
    let h = gguf::parse(&bytes).unwrap();
    assert_eq!((h.version, h.alignment), (3, 64));
    assert_eq!(h.data_start % 64, 0);
    assert_eq!(h.metadata[0], ("general.name".to_owned(), GgufValue::String("tiny".into())));
    let t = &h.tensors[0];
    assert_eq!((t.dtype, t.shape.clone(), t.offset, t.len), (DType::F32, vec![3, 2], h.data_start, 24));
    let q = &h.tensors[1];
    // q8_0: 32 elements per 34-byte block; 2 rows of one block each.
    assert_eq!((q.dtype, q.shape.clone(), q.offset, q.len), (DType::Q8_0, vec![2, 32], h.data_start + 64, 68));
    // Version 2 has the same layout.
    let mut v2 = bytes.clone();
    v2[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(gguf::parse(&v2).unwrap().version, 2);
}

#[test]
fn gguf_every_truncation_is_an_error() {
    let bytes = valid_gguf();
    let h = gguf::parse(&bytes).unwrap();
    let needed = h.tensors.iter().map(|t| t.offset + t.len).max().unwrap() as usize;
    for cut in 0..needed {
        let e = gg_err(&bytes[..cut]);
        assert!(
            matches!(
                e,
                FormatError::Truncated { .. } | FormatError::OutOfBounds { .. } | FormatError::CountTooLarge { .. }
            ),
            "cut at {cut}: {e}"
        );
    }
}

/// Found by the fuzzer: a zero-size tensor in a file that ends inside the alignment padding
/// was accepted with an offset past the end of the file.
#[test]
fn gguf_file_ending_inside_the_alignment_padding_is_truncated() {
    let mut g = G::new(3, 1, 0);
    g.tensor("empty", &[0], 0, 0);
    assert_ne!(g.0.len() % 32, 0, "the header must end unaligned for this case");
    let e = gg_err(&g.0);
    assert!(matches!(e, FormatError::Truncated { .. }) && e.to_string().contains("padding"), "{e}");
    // With the padding present, the zero-size tensor sits at the end of the file.
    let bytes = g.data(32, 0);
    let h = gguf::parse(&bytes).unwrap();
    assert_eq!((h.tensors[0].offset, h.tensors[0].len), (bytes.len() as u64, 0));
}

#[test]
fn gguf_magic_and_version() {
    let mut b = valid_gguf();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(gg_err(&b), FormatError::BadMagic { found } if &found == b"GGML"));
    for (v, needle) in [(1u32, "obsolete"), (0x0300_0000, "big-endian"), (4, "accepted: 2, 3"), (0, "accepted")] {
        let mut b = valid_gguf();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let e = gg_err(&b);
        assert!(matches!(e, FormatError::UnsupportedVersion { version, .. } if version == v), "{e}");
        assert!(e.to_string().contains(needle), "{e}");
    }
}

#[test]
fn gguf_absurd_counts_are_bounded_by_the_file_size() {
    // Claims u64::MAX tensors and keys: refused before any allocation.
    let e = gg_err(&G::new(3, u64::MAX, 0).data(1, 0));
    assert!(matches!(e, FormatError::CountTooLarge { count: u64::MAX, .. }), "{e}");
    assert!(e.to_string().contains("tensor count"), "{e}");
    let e = gg_err(&G::new(3, 0, 1 << 60).data(1, 0));
    assert!(matches!(e, FormatError::CountTooLarge { .. }) && e.to_string().contains("metadata key count"), "{e}");
    // A string of 2^62 bytes.
    let mut g = G::new(3, 0, 1);
    g.u64(1 << 62).bytes(&[b'a'; 32]);
    assert!(matches!(gg_err(&g.0), FormatError::Truncated { .. }));
    // An array of 2^40 u32.
    let mut g = G::new(3, 0, 1);
    g.str("tokens").u32(9).u32(4).u64(1 << 40);
    let e = gg_err(&g.0);
    assert!(matches!(e, FormatError::CountTooLarge { .. }) && e.to_string().contains("'tokens'"), "{e}");
    // An array of 2^40 strings (each at least 8 bytes).
    let mut g = G::new(3, 0, 1);
    g.str("vocab").u32(9).u32(8).u64(1 << 40).bytes(&[0; 64]);
    assert!(matches!(gg_err(&g.0), FormatError::CountTooLarge { .. }));
}

#[test]
fn gguf_metadata_arrays_cost_memory_bounded_by_fixed_limits_not_the_declared_length() {
    // A sparse file declaring an array of 2^27 empty strings (1 GiB of lengths, all zero):
    // refused by its declared length, before a byte of it is read.
    let dir = tempfile::tempdir().unwrap();
    let mut g = G::new(3, 0, 1);
    g.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(1 << 27);
    let p = write(dir.path(), "sparse.gguf", &g.0);
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(g.0.len() as u64 + (8 << 27)).unwrap();
    let msg = ModelFiles::open_model(&p).unwrap_err().to_string();
    assert!(
        msg.contains("sparse.gguf")
            && msg.contains("'tokenizer.ggml.tokens'")
            && msg.contains(&format!("{} elements; at most {}", 1u64 << 27, gguf::MAX_ARRAY_LEN)),
        "{msg}"
    );

    // Under the limit but past what is kept: walked (every length checked), not kept; the
    // first array, within the budget, is kept whole.
    let n = gguf::KEPT_ELEMENTS + 1;
    let mut g = G::new(3, 0, 3);
    g.str("small").u32(9).u32(8).u64(2).str("a").str("bc");
    g.str("empty.strings").u32(9).u32(8).u64(n);
    for _ in 0..n {
        g.u64(0);
    }
    g.str("numbers").u32(9).u32(4).u64(n).bytes(&vec![7; 4 * n as usize]);
    let h = gguf::parse(&g.0).unwrap();
    assert_eq!(h.metadata[0].1, GgufValue::Array(GgufArray::String(vec!["a".into(), "bc".into()])));
    assert_eq!(h.metadata[1].1, GgufValue::Array(GgufArray::Unread { elem_type: 8, len: n }));
    assert_eq!(h.metadata[2].1, GgufValue::Array(GgufArray::Unread { elem_type: 4, len: n }));
    // A string inside the walked array that runs past the file is still an error.
    let mut bad = g.0.clone();
    // Back from the end: the u32 data, the array header (type, element type, count), the
    // key "numbers" with its length: the last string's length is the 8 bytes before.
    let at = bad.len() - 4 * n as usize - (4 + 4 + 8) - (8 + "numbers".len()) - 8;
    bad[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let e = gg_err(&bad);
    assert!(matches!(e, FormatError::Truncated { .. }) && e.to_string().contains("'empty.strings'"), "{e}");
    // An array that was not kept cannot be written back.
    let e = gguf::to_bytes(&[], &h.metadata).unwrap_err();
    assert!(e.to_string().contains("'empty.strings'"), "{e}");

    // Strings past the kept bytes: an array of them is walked; a single string value is refused.
    let big = "x".repeat((gguf::KEPT_STRING_BYTES / 2 + 1) as usize);
    let mut g = G::new(3, 0, 3);
    g.kv_str("a", &big);
    g.str("arr").u32(9).u32(8).u64(1).str(&big);
    g.kv_str("b", &big);
    let e = gg_err(&g.0);
    assert!(matches!(e, FormatError::MetadataTooLarge { .. }) && e.to_string().contains("'b'"), "{e}");
}

#[test]
fn gguf_metadata_errors_name_the_key() {
    let mut g = G::new(3, 0, 1);
    g.str("weird").u32(13).u32(0);
    assert!(matches!(gg_err(&g.0), FormatError::UnknownValueType { ref key, type_id: 13 } if key == "weird"));
    // Arrays of arrays are refused, as ggml does.
    let mut g = G::new(3, 0, 1);
    g.str("nested").u32(9).u32(9).u64(1).u32(4).u64(0);
    assert!(matches!(gg_err(&g.0), FormatError::UnknownValueType { ref key, type_id: 9 } if key == "nested"));
    let mut g = G::new(3, 0, 2);
    g.kv_u32("k", 1).kv_u32("k", 2);
    assert!(matches!(gg_err(&g.0), FormatError::DuplicateKey { ref key } if key == "k"));
    let mut g = G::new(3, 0, 1);
    g.kv_u32("", 1);
    assert!(matches!(gg_err(&g.0), FormatError::EmptyKey { index: 0 }));
    let mut g = G::new(3, 0, 1);
    g.kv_str("general.alignment", "32");
    assert!(matches!(gg_err(&g.0), FormatError::WrongKeyType { expected: "u32", found: "string", .. }));
    for bad in [0u32, 48] {
        let mut g = G::new(3, 0, 1);
        g.kv_u32("general.alignment", bad);
        assert!(matches!(gg_err(&g.0), FormatError::BadAlignment { value } if value == u64::from(bad)));
    }
    let mut g = G::new(3, 0, 1);
    g.str("name").u32(8).u64(2).bytes(&[0xc3, 0x28]);
    let e = gg_err(&g.0);
    assert!(matches!(e, FormatError::NotUtf8 { .. }) && e.to_string().contains("'name'"), "{e}");
}

#[test]
fn gguf_tensor_errors_name_the_tensor() {
    let one = |ne: &[i64], ty: u32, offset: u64, data: usize| {
        let mut g = G::new(3, 1, 0);
        g.tensor("blk.w", ne, ty, offset);
        g.data(32, data)
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (one(&[1, 1, 1, 1, 1], 0, 0, 4), "5 dimensions"),
        (one(&[2, -3], 0, 0, 64), "is negative (-3)"),
        (one(&[2], 4, 0, 64), "unknown ggml type id 4"),
        (one(&[2], 43, 0, 64), "unknown ggml type id 43"),
        (one(&[33], 8, 0, 64), "not a multiple of the block size 32"),
        (one(&[4], 0, 8, 64), "not a multiple of the alignment 32"),
        (one(&[4], 0, 32, 40), "past its end"),
        (one(&[i64::MAX, i64::MAX], 0, 0, 64), "overflows"),
        (one(&[1 << 32, 1 << 32, 1 << 32], 24, 0, 64), "overflows"),
    ];
    for (bytes, needle) in cases {
        let e = gg_err(&bytes);
        let msg = e.to_string();
        assert!(msg.contains("'blk.w'") && msg.contains(needle), "expected {needle:?} naming blk.w in: {msg}");
    }
    // Duplicate names and overlapping data.
    let mut g = G::new(3, 2, 0);
    g.tensor("a", &[4], 0, 0).tensor("a", &[4], 0, 32);
    assert!(matches!(gg_err(&g.data(32, 64)), FormatError::DuplicateTensor { ref tensor } if tensor == "a"));
    let mut g = G::new(3, 2, 0);
    g.tensor("a", &[16], 0, 0).tensor("b", &[4], 0, 32);
    assert!(
        matches!(gg_err(&g.data(32, 64)), FormatError::Overlap { ref first, ref second, .. } if first == "a" && second == "b")
    );
    let mut g = G::new(3, 1, 0);
    g.u64(2).bytes(&[0xff, 0xfe]).u32(1).i64(1).u32(0).u64(0);
    assert!(matches!(gg_err(&g.data(32, 8)), FormatError::NotUtf8 { .. }));
}

#[test]
fn gguf_metadata_of_every_type_round_trips() {
    let metadata = vec![
        ("u8".to_owned(), GgufValue::U8(200)),
        ("i8".to_owned(), GgufValue::I8(-5)),
        ("u16".to_owned(), GgufValue::U16(60_000)),
        ("i16".to_owned(), GgufValue::I16(-30_000)),
        ("u32".to_owned(), GgufValue::U32(4_000_000_000)),
        ("i32".to_owned(), GgufValue::I32(-2_000_000_000)),
        ("f32".to_owned(), GgufValue::F32(1.5)),
        ("bool".to_owned(), GgufValue::Bool(true)),
        ("str".to_owned(), GgufValue::String("héllo".into())),
        ("u64".to_owned(), GgufValue::U64(u64::MAX)),
        ("i64".to_owned(), GgufValue::I64(i64::MIN)),
        ("f64".to_owned(), GgufValue::F64(-0.25)),
        ("a.u8".to_owned(), GgufValue::Array(GgufArray::U8(vec![1, 2, 3]))),
        ("a.i8".to_owned(), GgufValue::Array(GgufArray::I8(vec![-1]))),
        ("a.u16".to_owned(), GgufValue::Array(GgufArray::U16(vec![7, 8]))),
        ("a.i16".to_owned(), GgufValue::Array(GgufArray::I16(vec![-7]))),
        ("a.u32".to_owned(), GgufValue::Array(GgufArray::U32(vec![]))),
        ("a.i32".to_owned(), GgufValue::Array(GgufArray::I32(vec![i32::MIN, 0]))),
        ("a.f32".to_owned(), GgufValue::Array(GgufArray::F32(vec![0.5, -2.0]))),
        ("a.bool".to_owned(), GgufValue::Array(GgufArray::Bool(vec![true, false]))),
        ("a.str".to_owned(), GgufValue::Array(GgufArray::String(vec!["a".into(), String::new(), "ü".into()]))),
        ("a.u64".to_owned(), GgufValue::Array(GgufArray::U64(vec![1 << 40]))),
        ("a.i64".to_owned(), GgufValue::Array(GgufArray::I64(vec![-(1 << 40)]))),
        ("a.f64".to_owned(), GgufValue::Array(GgufArray::F64(vec![1e300]))),
    ];
    let bytes = gguf::to_bytes(&[], &metadata).unwrap();
    let h = gguf::parse(&bytes).unwrap();
    assert_eq!(h.metadata, metadata);
    assert_eq!(h.data_start, bytes.len() as u64, "no tensors: no padding");
}

// ---------------------------------------------------------------------------------------
// Round trips through both writers and ModelFiles.
// ---------------------------------------------------------------------------------------

struct T {
    name: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn t(name: &'static str, dtype: DType, shape: &[u64], seed: u8) -> T {
    let len = safetensors::expected_bytes(name, dtype, shape).unwrap() as usize;
    T {
        name,
        dtype,
        shape: shape.to_vec(),
        data: (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect(),
    }
}

fn specs(ts: &[T]) -> Vec<(HeaderEntry<'_>, &[u8])> {
    ts.iter().map(|t| (HeaderEntry { name: t.name, dtype: t.dtype, shape: &t.shape }, &t.data[..])).collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn round_trip_both_formats_through_model_files() {
    let dir = tempfile::tempdir().unwrap();
    let st_tensors = [
        t("model.diffusion_model.out.2.weight", DType::F16, &[4, 8, 3, 3], 1),
        t("model.diffusion_model.out.2.bias", DType::F32, &[4], 2),
        t("first_stage_model.decoder.conv_in.weight", DType::BF16, &[2, 2], 3),
        t("cond_stage_model.transformer.text_model.embeddings.position_ids", DType::I64, &[1, 77], 4),
        t("scalar", DType::F64, &[], 5),
    ];
    let meta = BTreeMap::from([("modelspec.title".to_owned(), "rt".to_owned())]);
    let st = write(dir.path(), "m.safetensors", &safetensors::to_bytes(&specs(&st_tensors), &meta).unwrap());

    let gg_tensors = [
        t("model.diffusion_model.input_blocks.1.1.proj_in.weight", DType::Q8_0, &[4, 64], 6),
        t("model.diffusion_model.input_blocks.1.1.proj_out.weight", DType::Q4_K, &[2, 256], 7),
        t("model.diffusion_model.input_blocks.1.1.norm.weight", DType::Q6_K, &[1, 512], 8),
        t("model.diffusion_model.input_blocks.1.1.norm.bias", DType::Q5_0, &[3, 32], 9),
        t("model.diffusion_model.input_blocks.1.1.x", DType::Q4_0, &[32], 10),
        t("model.diffusion_model.input_blocks.1.1.y", DType::F16, &[2, 3, 4, 5], 11),
    ];
    let kv = vec![
        ("general.alignment".to_owned(), GgufValue::U32(64)),
        ("general.name".to_owned(), GgufValue::String("g".into())),
    ];
    let gg = write(dir.path(), "m.gguf", &gguf::to_bytes(&specs(&gg_tensors), &kv).unwrap());

    for (path, tensors) in [(&st, &st_tensors[..]), (&gg, &gg_tensors[..])] {
        let files = ModelFiles::open_model(path).unwrap();
        let idx = files.index();
        assert_eq!(idx.len(), tensors.len());
        for want in tensors {
            let (e, bytes) = files.tensor(want.name).unwrap_or_else(|| panic!("{} missing", want.name));
            assert_eq!((e.dtype, &e.shape, bytes), (want.dtype, &want.shape, &want.data[..]), "{}", want.name);
            assert_eq!(e.ne(), want.shape.iter().rev().copied().collect::<Vec<_>>());
            assert_eq!(e.original_name, want.name);
        }
    }
    let files = ModelFiles::open_model(&gg).unwrap();
    let f = &files.index().files()[0];
    assert_eq!(f.format, FileFormat::Gguf { version: 3, alignment: 64 });
    assert!(files.index().entries().iter().all(|e| e.offset % 64 == 0), "GGUF tensors are aligned");
    assert_eq!(files.index().metadata("general.name").map(|(_, v)| v.as_str()), Some(Some("g")));
    let files = ModelFiles::open_model(&st).unwrap();
    assert_eq!(files.index().metadata("modelspec.title").map(|(_, v)| v.as_str()), Some(Some("rt")));
}

// ---------------------------------------------------------------------------------------
// Opening real layouts, naming, detection.
// ---------------------------------------------------------------------------------------

/// The tensors SD 1.x/2.x detection reads, under LDM names, with the real widths in the
/// dimension detection reads and tiny others.
fn sd_unet(ctx: u64) -> Vec<T> {
    vec![
        t("model.diffusion_model.input_blocks.0.0.weight", DType::F16, &[2, 4, 3, 3], 1),
        t("model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight", DType::F16, &[2, ctx], 2),
        t("model.diffusion_model.middle_block.1.norm.weight", DType::F32, &[2], 3),
        t("model.diffusion_model.output_blocks.11.1.proj_out.weight", DType::F32, &[2], 4),
        t("first_stage_model.decoder.conv_in.weight", DType::F32, &[2], 5),
        t("first_stage_model.encoder.conv_in.weight", DType::F32, &[2], 6),
        t("alphas_cumprod", DType::F32, &[3], 7),
    ]
}

fn sd1_checkpoint() -> Vec<T> {
    let mut v = sd_unet(768);
    v.push(t("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight", DType::F16, &[2, 768], 8));
    v.push(t(
        "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight",
        DType::F16,
        &[2, 2],
        9,
    ));
    v
}

#[test]
fn sd1_checkpoint_is_detected_with_components_and_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "sd15.safetensors",
        &safetensors::to_bytes(&specs(&sd1_checkpoint()), &BTreeMap::new()).unwrap(),
    );
    let files = ModelFiles::open_model(&p).unwrap();
    let d = files.detect(None).unwrap();
    assert_eq!((d.arch, d.context_dim, d.prediction), ("sd1", 768, Some(Prediction::Eps)));
    assert_eq!(d.prediction_source, PredictionSource::ArchDefault);
    let idx = files.index();
    let e = idx.get("model.diffusion_model.output_blocks.11.1.proj_out.weight").unwrap();
    assert_eq!((idx.component(e), idx.block(e)), (Component::Diffusion, Some(2 + 1 + 11)), "2 input blocks present");
    let e = idx.get("cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!((idx.component(e), idx.block(e)), (Component::TextEncoder(0), Some(0)));
    assert_eq!(idx.component(idx.get("alphas_cumprod").unwrap()), Component::Unused);
    // The override wins over the default.
    let d = files.detect(Some(Prediction::V)).unwrap();
    assert_eq!((d.prediction, d.prediction_source), (Some(Prediction::V), PredictionSource::Override));
}

/// An inpainting checkpoint (UNet input convolution of 9 channels) is SD 1.x and reported as
/// inpainting; 8 channels (instruct-pix2pix, which sd-rs does not run) is no architecture.
#[test]
fn sd1_inpainting_checkpoint_is_detected_by_its_input_channels() {
    let dir = tempfile::tempdir().unwrap();
    for (channels, want) in [(4u64, Some(false)), (9, Some(true)), (8, None)] {
        let mut ts = sd1_checkpoint();
        ts[0] = t("model.diffusion_model.input_blocks.0.0.weight", DType::F16, &[2, channels, 3, 3], 1);
        let name = format!("sd15-{channels}.safetensors");
        let p = write(dir.path(), &name, &safetensors::to_bytes(&specs(&ts), &BTreeMap::new()).unwrap());
        let files = ModelFiles::open_model(&p).unwrap();
        let arch = files.detect(None).ok().map(|d| d.arch);
        assert_eq!(arch.is_some(), want.is_some(), "{channels} channels: {arch:?}");
        if let Some(inpainting) = want {
            assert_eq!(arch, Some("sd1"));
            assert_eq!(crate::family::is_inpainting(&files), inpainting, "{channels} channels");
        }
    }
}

#[test]
fn sd2_open_clip_checkpoint_gets_hf_names_and_split_qkv_views() {
    let dir = tempfile::tempdir().unwrap();
    let mut ts = sd_unet(1024);
    ts.push(t("cond_stage_model.model.token_embedding.weight", DType::F32, &[2, 1024], 10));
    ts.push(t("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight", DType::F16, &[6, 4], 11));
    ts.push(t("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_bias", DType::F32, &[6], 12));
    ts.push(t("cond_stage_model.model.transformer.resblocks.0.ln_1.weight", DType::F32, &[2], 13));
    ts.push(t("cond_stage_model.model.logit_scale", DType::F32, &[], 14));
    let meta = BTreeMap::from([("modelspec.prediction_type".to_owned(), "v".to_owned())]);
    let p = write(dir.path(), "sd21.safetensors", &safetensors::to_bytes(&specs(&ts), &meta).unwrap());
    let files = ModelFiles::open_model(&p).unwrap();
    let d = files.detect(None).unwrap();
    assert_eq!((d.arch, d.context_dim, d.prediction), ("sd2", 1024, Some(Prediction::V)));
    assert_eq!(d.prediction_source, PredictionSource::Metadata { key: "modelspec.prediction_type".into() });

    let te = "cond_stage_model.transformer.text_model.";
    assert!(files.index().contains(&format!("{te}embeddings.token_embedding.weight")));
    assert!(files.index().contains(&format!("{te}encoder.layers.0.layer_norm1.weight")));
    let w = &ts[ts.len() - 4].data; // in_proj_weight: 6 rows of 4 f16 = 8 bytes per row
    let b = &ts[ts.len() - 3].data; // in_proj_bias: 6 f32
    for (k, part) in ["q", "k", "v"].iter().enumerate() {
        let (e, bytes) = files.tensor(&format!("{te}encoder.layers.0.self_attn.{part}_proj.weight")).unwrap();
        assert_eq!(e.shape, vec![2, 4]);
        assert_eq!(e.original_name, "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight");
        assert_eq!(e.part.map(|p| p.index()), Some(k as u64));
        assert_eq!(bytes, &w[k * 16..(k + 1) * 16], "rows {}..{} of the fused weight", 2 * k, 2 * k + 2);
        let (e, bytes) = files.tensor(&format!("{te}encoder.layers.0.self_attn.{part}_proj.bias")).unwrap();
        assert_eq!(e.shape, vec![2]);
        assert_eq!(bytes, &b[k * 8..(k + 1) * 8]);
    }
    assert!(!files.index().entries().iter().any(|e| e.name.contains("in_proj")), "no fused name left");
    assert_eq!(
        files.index().component(files.index().get("cond_stage_model.model.logit_scale").unwrap()),
        Component::Unused
    );
}

#[test]
fn sd2_without_prediction_metadata_leaves_it_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let p =
        write(dir.path(), "u.safetensors", &safetensors::to_bytes(&specs(&sd_unet(1024)), &BTreeMap::new()).unwrap());
    let d = ModelFiles::open_model(&p).unwrap().detect(None).unwrap();
    assert_eq!((d.arch, d.prediction, d.prediction_source), ("sd2", None, PredictionSource::Unknown));
}

#[test]
fn fused_projection_that_cannot_be_split_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let ts = [t("cond_stage_model.model.transformer.resblocks.3.attn.in_proj_weight", DType::F32, &[4, 2], 1)];
    let p = write(dir.path(), "bad.safetensors", &safetensors::to_bytes(&specs(&ts), &BTreeMap::new()).unwrap());
    let msg = ModelFiles::open_model(&p).unwrap_err().to_string();
    assert!(
        msg.contains("bad.safetensors")
            && msg.contains("resblocks.3.attn.in_proj_weight")
            && msg.contains("multiple of 3"),
        "{msg}"
    );
}

#[test]
fn unknown_architectures_list_what_was_found() {
    let dir = tempfile::tempdir().unwrap();
    // instruct-pix2pix (8 input channels) is another architecture.
    let mut ts = sd1_checkpoint();
    ts[0] = t("model.diffusion_model.input_blocks.0.0.weight", DType::F16, &[2, 8, 3, 3], 1);
    let p = write(dir.path(), "pix2pix.safetensors", &safetensors::to_bytes(&specs(&ts), &BTreeMap::new()).unwrap());
    let msg = ModelFiles::open_model(&p).unwrap().detect(None).unwrap_err().to_string();
    assert!(msg.contains("unknown model architecture") && msg.contains("sd1") && msg.contains("sd2"), "{msg}");
    assert!(msg.contains("model.diffusion_model.input_blocks.0.0.weight [2, 8, 3, 3]"), "{msg}");
    assert!(msg.contains("model.diffusion_model.* ("), "{msg}");

    // Text encoder and UNet disagree on the context width.
    let mut ts = sd_unet(1024);
    ts.push(t("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight", DType::F16, &[2, 768], 8));
    let p = write(dir.path(), "mixed.safetensors", &safetensors::to_bytes(&specs(&ts), &BTreeMap::new()).unwrap());
    let msg = ModelFiles::open_model(&p).unwrap().detect(None).unwrap_err().to_string();
    assert!(msg.contains("[2, 768]") && msg.contains("[2, 1024]"), "{msg}");

    // Something else entirely.
    let ts = [t("transformer.blocks.0.weight", DType::F32, &[2], 1), t("lm_head.weight", DType::F32, &[2], 2)];
    let p = write(dir.path(), "llm.safetensors", &safetensors::to_bytes(&specs(&ts), &BTreeMap::new()).unwrap());
    let msg = ModelFiles::open_model(&p).unwrap().detect(None).unwrap_err().to_string();
    assert!(
        msg.contains("2 tensors") && msg.contains("transformer.blocks.* (1)") && msg.contains("lm_head.weight"),
        "{msg}"
    );
    assert!(msg.contains("none of the SD tensors"), "{msg}");
}

#[test]
fn diffusers_folder_maps_to_ldm_names_and_reads_the_scheduler() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sd15-diffusers");
    let unet = [
        t("conv_in.weight", DType::F32, &[2, 4, 3, 3], 1),
        t("down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight", DType::F16, &[2, 768], 2),
        t("mid_block.attentions.0.norm.weight", DType::F32, &[2], 3),
        t("up_blocks.1.upsamplers.0.conv.weight", DType::F32, &[2], 4),
    ];
    let vae = [
        t("decoder.up_blocks.0.resnets.0.conv1.weight", DType::F32, &[2], 5),
        t("decoder.mid_block.attentions.0.to_q.weight", DType::F32, &[2, 2], 6),
    ];
    let te = [t("text_model.embeddings.token_embedding.weight", DType::F16, &[2, 768], 7)];
    let none = BTreeMap::new();
    write(&root, "model_index.json", br#"{"_class_name": "StableDiffusionPipeline"}"#);
    write(&root, "scheduler/scheduler_config.json", br#"{"prediction_type": "v_prediction"}"#);
    write(&root, "unet/diffusion_pytorch_model.safetensors", &safetensors::to_bytes(&specs(&unet), &none).unwrap());
    write(&root, "vae/diffusion_pytorch_model.fp16.safetensors", &safetensors::to_bytes(&specs(&vae), &none).unwrap());
    write(&root, "text_encoder/model.safetensors", &safetensors::to_bytes(&specs(&te), &none).unwrap());

    let files = ModelFiles::open_model(&root).unwrap();
    let idx = files.index();
    for (name, original) in [
        ("model.diffusion_model.input_blocks.0.0.weight", "conv_in.weight"),
        (
            "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
            "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
        ),
        ("model.diffusion_model.middle_block.1.norm.weight", "mid_block.attentions.0.norm.weight"),
        ("model.diffusion_model.output_blocks.5.2.conv.weight", "up_blocks.1.upsamplers.0.conv.weight"),
        ("first_stage_model.decoder.up.3.block.0.conv1.weight", "decoder.up_blocks.0.resnets.0.conv1.weight"),
        ("first_stage_model.decoder.mid.attn_1.q.weight", "decoder.mid_block.attentions.0.to_q.weight"),
        (
            "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
            "text_model.embeddings.token_embedding.weight",
        ),
    ] {
        let e = idx.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(e.original_name, original);
    }
    assert_eq!(idx.files().len(), 3);
    let d = files.detect(None).unwrap();
    assert_eq!((d.arch, d.prediction), ("sd1", Some(Prediction::V)));
    assert_eq!(d.prediction_source, PredictionSource::Metadata { key: "diffusers.scheduler.prediction_type".into() });

    // Without unet weights the folder is refused, naming what is missing.
    std::fs::remove_file(root.join("unet/diffusion_pytorch_model.safetensors")).unwrap();
    let msg = ModelFiles::open_model(&root).unwrap_err().to_string();
    assert!(msg.contains("sd15-diffusers") && msg.contains("unet/diffusion_pytorch_model.safetensors"), "{msg}");
}

#[test]
fn component_files_get_prefixes_and_replace_the_checkpoint_component() {
    let dir = tempfile::tempdir().unwrap();
    let none = BTreeMap::new();
    let ckpt = write(dir.path(), "sd15.safetensors", &safetensors::to_bytes(&specs(&sd1_checkpoint()), &none).unwrap());
    let vae = [
        t("decoder.conv_in.weight", DType::F16, &[3], 20),
        t("decoder.conv_out.bias", DType::F32, &[3], 21),
        // A VAE file that also carries a UNet tensor: only its VAE is used.
        t("model.diffusion_model.out.2.bias", DType::F32, &[1], 22),
    ];
    let vae = write(dir.path(), "vae.safetensors", &safetensors::to_bytes(&specs(&vae), &none).unwrap());
    let taesd = [t("decoder.layers.0.weight", DType::F16, &[4], 23)];
    let taesd = write(dir.path(), "taesd.safetensors", &safetensors::to_bytes(&specs(&taesd), &none).unwrap());
    let clip = [
        t("text_model.embeddings.token_embedding.weight", DType::F16, &[2, 768], 24),
        t("text_model.embeddings.position_ids", DType::I64, &[1, 77], 25),
    ];
    let clip = write(dir.path(), "clip_l.safetensors", &safetensors::to_bytes(&specs(&clip), &none).unwrap());

    let sources = ModelSources {
        model: Some(ckpt),
        vae: Some(vae.clone()),
        clip_l: Some(clip),
        taesd: Some(taesd),
        ..Default::default()
    };
    let files = ModelFiles::open(&sources).unwrap();
    let idx = files.index();
    let (e, bytes) = files.tensor("first_stage_model.decoder.conv_in.weight").unwrap();
    assert_eq!((e.dtype, &e.shape), (DType::F16, &vec![3]), "the --vae tensor, not the checkpoint's");
    assert_eq!(idx.files()[e.file].path, vae);
    assert_eq!(bytes.len(), 6);
    assert!(!idx.contains("first_stage_model.encoder.conv_in.weight"), "the checkpoint's VAE is replaced whole");
    assert!(!idx.contains("model.diffusion_model.out.2.bias"), "foreign tensors of a component file are skipped");
    assert!(idx.contains("tae.decoder.layers.0.weight"));
    assert_eq!(
        idx.get("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight").unwrap().original_name,
        "text_model.embeddings.token_embedding.weight"
    );
    assert!(idx.contains("model.diffusion_model.input_blocks.0.0.weight"), "the UNet stays");
    assert_eq!(files.detect(None).unwrap().arch, "sd1");

    // --clip_g (HF CLIPTextModelWithProjection names): SDXL's second encoder, beside --clip_l.
    let clip_g = [
        t("text_model.encoder.layers.0.self_attn.q_proj.weight", DType::F16, &[4, 4], 26),
        t("text_projection.weight", DType::F16, &[4, 4], 27),
    ];
    let clip_g = write(dir.path(), "clip_g.safetensors", &safetensors::to_bytes(&specs(&clip_g), &none).unwrap());
    let sources = ModelSources { clip_g: Some(clip_g.clone()), ..sources };
    let files = ModelFiles::open(&sources).unwrap();
    let idx = files.index();
    let q = idx.get("cond_stage_model.1.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(
        (q.original_name.as_str(), &idx.files()[q.file].path),
        ("text_model.encoder.layers.0.self_attn.q_proj.weight", &clip_g)
    );
    assert!(idx.contains("cond_stage_model.1.transformer.text_model.text_projection"));
    assert!(
        idx.contains("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"),
        "--clip_l stays"
    );

    // --diffusion-model alone (no text encoder): detected from the UNet's cross-attention.
    let unet =
        write(dir.path(), "unet.safetensors", &safetensors::to_bytes(&specs(&sd_unet(1024)[..4]), &none).unwrap());
    let files = ModelFiles::open(&ModelSources { diffusion_model: Some(unet), ..Default::default() }).unwrap();
    assert_eq!(files.detect(None).unwrap().arch, "sd2");
}

#[test]
fn open_errors_name_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    // Truncated: the header promises 16 bytes of data, the file has 8.
    let json = r#"{"model.diffusion_model.out.2.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let p = write(dir.path(), "trunc.safetensors", &st_raw(json, 8));
    let msg = ModelFiles::open_model(&p).unwrap_err().to_string();
    assert!(msg.contains("trunc.safetensors") && msg.contains("'model.diffusion_model.out.2.weight'"), "{msg}");
    // Empty file.
    let p = write(dir.path(), "empty.safetensors", b"");
    let msg = ModelFiles::open_model(&p).unwrap_err().to_string();
    assert!(msg.contains("empty.safetensors") && msg.contains("truncated"), "{msg}");
    // Neither format.
    let p = write(dir.path(), "model.ckpt", b"PK\x03\x04 not a safetensors file");
    let msg = ModelFiles::open_model(&p).unwrap_err().to_string();
    assert!(msg.contains("model.ckpt") && msg.contains("neither"), "{msg}");
    // Missing.
    let msg = ModelFiles::open_model(dir.path().join("nope.gguf")).unwrap_err().to_string();
    assert!(msg.contains("nope.gguf"), "{msg}");
    // Two stored names for one internal name.
    let ts = [
        t("model.diffusion_model.out.2.bias", DType::F32, &[1], 1),
        t("diffusion_model.out.2.bias", DType::F32, &[1], 2),
    ];
    let p = write(dir.path(), "dup.safetensors", &safetensors::to_bytes(&specs(&ts), &BTreeMap::new()).unwrap());
    let msg = ModelFiles::open_model(&p).unwrap_err().to_string();
    assert!(msg.contains("dup.safetensors") && msg.contains("'diffusion_model.out.2.bias'"), "{msg}");
    // GGUF with a lying tensor.
    let mut g = G::new(3, 1, 0);
    g.tensor("first_stage_model.decoder.conv_in.weight", &[64], 0, 0);
    let p = write(dir.path(), "short.gguf", &g.data(32, 100));
    let msg = ModelFiles::open_model(&p).unwrap_err().to_string();
    assert!(msg.contains("short.gguf") && msg.contains("'first_stage_model.decoder.conv_in.weight'"), "{msg}");
    // Nothing given.
    assert!(matches!(ModelFiles::open(&ModelSources::default()), Err(FilesError::NoModel)));
}

#[test]
fn gguf_weights_of_types_ggml_cannot_compute_are_refused_at_open_naming_file_tensor_and_type() {
    // Each type through a GGUF file: a UNet matmul weight (mul_mat), the CLIP token
    // embedding (get_rows) and a VAE conv weight (converted to f16 at load).
    let dir = tempfile::tempdir().unwrap();
    let names = [
        ("model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight", "diffusion model"),
        ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight", "text encoder"),
        ("first_stage_model.decoder.conv_in.weight", "VAE"),
    ];
    for d in [DType::Q8_1, DType::Q8_K, DType::I8, DType::I16, DType::I32, DType::I64, DType::F64] {
        for (name, component) in names {
            let ts = [t(name, d, &[2, 256], 3)];
            let file = format!("{}.gguf", d.name());
            let p = write(dir.path(), &file, &gguf::to_bytes(&specs(&ts), &[]).unwrap());
            let err = ModelFiles::open_model(&p).unwrap_err();
            assert!(matches!(err, FilesError::UnsupportedDType { .. }), "{d} {name}: {err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&file)
                    && msg.contains(&format!("'{name}'"))
                    && msg.contains(&format!("dtype {}", d.name()))
                    && msg.contains(component),
                "{msg}"
            );
        }
    }
    // The neighbours that ggml computes open.
    for d in [DType::Q8_0, DType::Q4_1, DType::Q6_K, DType::IQ4_XS, DType::TQ2_0] {
        let ts = [t(names[0].0, d, &[2, 256], 3)];
        let p = write(dir.path(), "ok.gguf", &gguf::to_bytes(&specs(&ts), &[]).unwrap());
        ModelFiles::open_model(&p).unwrap_or_else(|e| panic!("{d}: {e}"));
    }
}

#[test]
fn registry_names_are_unique_and_include_sd() {
    let names: Vec<&str> = arch::registered().iter().map(|a| a.name).collect();
    let mut dedup = names.clone();
    dedup.dedup();
    assert_eq!(names, dedup, "duplicate ArchSpec names");
    assert!(names.contains(&"sd1") && names.contains(&"sd2"));
}

// ---------------------------------------------------------------------------------------
// Fuzz corpus replay and property tests: no input makes a parser panic.
// ---------------------------------------------------------------------------------------

/// Replays the committed seeds (`fuzz/seeds/<target>/`) and, where a fuzzing run left
/// them, libFuzzer's corpus and crash artifacts through the code the fuzz targets run.
#[test]
fn fuzz_corpus_replays_without_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut n = 0;
    for (target, parse) in [("safetensors_header", parse_safetensors_any as fn(&[u8])), ("gguf_header", parse_gguf_any)]
    {
        for sub in ["seeds", "corpus", "artifacts"] {
            let Ok(rd) = std::fs::read_dir(root.join(sub).join(target)) else { continue };
            for f in rd.flatten() {
                if let Ok(bytes) = std::fs::read(f.path()) {
                    parse(&bytes);
                    n += 1;
                }
            }
        }
    }
    // The seeds are committed with the fuzz project.
    assert!(n > 0, "no fuzz seeds found under {}", root.display());
}

/// The seeds were written by a separate Python script straight from the format
/// descriptions, so they also check our readers against an independent writer.
#[test]
fn independently_written_seed_files_parse_as_intended() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    let g = std::fs::read(root.join("gguf_header/seed-valid")).unwrap();
    let h = gguf::parse(&g).unwrap();
    assert_eq!(h.alignment, 32);
    assert_eq!(h.metadata[0], ("general.name".to_owned(), GgufValue::String("seed".into())));
    assert_eq!(h.metadata[2], ("tok".to_owned(), GgufValue::Array(GgufArray::String(vec!["a".into(), "bc".into()]))));
    assert_eq!(h.metadata[3], ("f".to_owned(), GgufValue::F32(1.5)));
    let w = &h.tensors[0];
    assert_eq!((w.name.as_str(), w.dtype, w.shape.clone(), w.len), ("w", DType::F32, vec![3, 2], 24));
    let q = &h.tensors[1];
    assert_eq!(
        (q.name.as_str(), q.dtype, q.shape.clone(), q.offset - h.data_start, q.len),
        ("q", DType::Q8_0, vec![1, 32], 32, 34)
    );
    assert_eq!(h.data_start + 32 + 34, g.len() as u64);

    let s = std::fs::read(root.join("safetensors_header/seed-valid")).unwrap();
    let h = safetensors::parse(&s).unwrap();
    assert_eq!(h.tensors.iter().map(|t| (t.name.as_str(), t.len)).collect::<Vec<_>>(), [("a", 12), ("b", 8)]);
    assert_eq!(&s[h.tensors[1].offset as usize..][..8], &[12, 13, 14, 15, 16, 17, 18, 19]);
    assert!(matches!(
        safetensors::parse(&std::fs::read(root.join("safetensors_header/seed-overlap")).unwrap()),
        Err(FormatError::Overlap { .. })
    ));
}

fn parse_safetensors_any(b: &[u8]) {
    let _ = safetensors::parse(b);
}

fn parse_gguf_any(b: &[u8]) {
    let _ = gguf::parse(b);
}

fn valid_safetensors() -> Vec<u8> {
    let ts = [t("a.weight", DType::F16, &[2, 3], 1), t("b", DType::F32, &[2], 2)];
    safetensors::to_bytes(&specs(&ts), &BTreeMap::from([("k".to_owned(), "v".to_owned())])).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = safetensors::parse(&bytes);
        let _ = gguf::parse(&bytes);
        let mut gg = b"GGUF\x03\0\0\0".to_vec();
        gg.extend_from_slice(&bytes);
        let _ = gguf::parse(&gg);
    }

    #[test]
    fn mutated_valid_files_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        for mut bytes in [valid_safetensors(), valid_gguf()] {
            for (at, v) in &edits {
                let i = at.index(bytes.len());
                bytes[i] = *v;
            }
            let _ = safetensors::parse(&bytes);
            let _ = gguf::parse(&bytes);
            let keep = cut.index(bytes.len() + 1);
            let _ = safetensors::parse(&bytes[..keep]);
            let _ = gguf::parse(&bytes[..keep]);
        }
    }

    /// Whatever a parser accepts is internally consistent: ranges inside the file, sizes
    /// equal to shape × dtype, no two tensors sharing bytes.
    #[test]
    fn accepted_headers_are_consistent(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        for (mut bytes, is_gguf) in [(valid_safetensors(), false), (valid_gguf(), true)] {
            for (at, v) in &edits {
                let i = at.index(bytes.len());
                bytes[i] = *v;
            }
            let tensors = if is_gguf {
                gguf::parse(&bytes).map(|h| h.tensors)
            } else {
                safetensors::parse(&bytes).map(|h| h.tensors)
            };
            if let Ok(ts) = tensors {
                let mut spans = Vec::new();
                for t in &ts {
                    prop_assert!(t.offset + t.len <= bytes.len() as u64);
                    prop_assert_eq!(safetensors::expected_bytes(&t.name, t.dtype, &t.shape).unwrap(), t.len);
                    if t.len > 0 { spans.push((t.offset, t.offset + t.len)); }
                }
                spans.sort_unstable();
                for w in spans.windows(2) { prop_assert!(w[0].1 <= w[1].0); }
            }
        }
    }
}

// In sd-models rather than sd-formats: it reads ggml's own traits, and the packaged sd-formats
// has no ggml.
#[test]
fn compute_types_are_the_types_ggml_can_dequantize() {
    // ggml's own traits, read at run time: a type computes iff ggml has a `to_float` for
    // it (f32 needs none). ggml-cpu.c's `vec_dot` table, not reachable from here, has
    // the same set (see `is_compute_type`); q8_1 and q8_K lack both.
    for d in DType::ALL {
        let Some(id) = d.ggml_type_id() else { continue };
        // SAFETY: `id` is a type ggml knows (the facts table above); the traits are static.
        let traits = unsafe { &*ggml_sys::ggml_get_type_traits(ggml_sys::ggml_type(id)) };
        let ggml_computes = d == DType::F32 || traits.to_float.is_some();
        assert_eq!(d.is_compute_type(), ggml_computes, "{d}: to_float {}", traits.to_float.is_some());
    }
    for d in [DType::Q8_1, DType::Q8_K, DType::I8, DType::I32, DType::F64, DType::U8, DType::Bool] {
        assert!(!d.is_compute_type(), "{d}");
    }
    for d in [DType::Q8_0, DType::Q4_K, DType::IQ4_NL, DType::TQ1_0, DType::BF16, DType::F8_E4M3] {
        assert!(d.is_compute_type(), "{d}");
    }
}
