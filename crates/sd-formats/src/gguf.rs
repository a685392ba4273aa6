//! GGUF (versions 2 and 3) header reader and writer, with bounded allocation.
//!
//! Layout (ggml's gguf.h): magic `GGUF`, u32 version, u64 tensor count, u64 key/value count,
//! the key/value pairs (string key, u32 value type, value; arrays carry an element type and a
//! u64 length), the tensor infos (string name, u32 n_dims, i64 ne[n_dims] in ggml order,
//! u32 ggml type, u64 offset relative to the data section), padding to `general.alignment`
//! (a u32, default 32), then the data section. Strings are a u64 length and UTF-8 bytes.
//! Everything is little-endian; a big-endian file shows up as an absurd version and is
//! refused with a hint.
//!
//! Every count and length is checked against the bytes the file still has before anything is
//! allocated for it, so a forged header cannot make us reserve more memory than the file's
//! size (typed arrays keep that bound close to 1:1). The rules on tensors follow ggml's own
//! reader: at most 4 dimensions, no negative ones, rows of whole blocks, no size overflow,
//! offsets aligned; in addition every tensor must lie inside the file and overlap no other.
//! Arrays of arrays are refused, as ggml refuses them. Metadata costs memory bounded by
//! fixed limits, not by the file's size (a sparse file is large but holds nothing):
//! an array past [`MAX_ARRAY_LEN`] elements is refused, and past [`KEPT_ELEMENTS`] elements
//! or [`KEPT_STRING_BYTES`] bytes of text in all, arrays are walked without being kept.

use std::collections::HashSet;

use super::dtype::DType;
use super::error::FormatError;
use super::safetensors::{check_overlaps, expected_bytes, HeaderEntry};
use super::RawTensor;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of each tensor when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// The key that sets the alignment.
const ALIGNMENT_KEY: &str = "general.alignment";
/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
const MAX_DIMS: u64 = 4;

/// Smallest encoding of one tensor info: empty name (8), n_dims (4), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 24;
/// Smallest encoding of one key/value pair: empty key (8), type (4), one byte of value.
const MIN_KV_BYTES: u64 = 13;

/// Most elements of one metadata array. Real files' largest arrays are tokenizer
/// vocabularies and merge lists (hundreds of thousands); a longer one is refused before it is
/// walked, so a sparse file declaring a GiB-long array costs neither time nor memory.
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Array elements of one file that [`parse`] keeps in memory, all arrays together; later
/// arrays are walked and kept as [`GgufArray::Unread`]. A kept string costs 24 bytes besides
/// its text, three times its 8 bytes in the file, so keeping every array would let a header
/// cost several times the file's size.
pub const KEPT_ELEMENTS: u64 = 1 << 20;
/// Bytes of string text [`parse`] keeps, all metadata strings together: an array whose
/// strings would pass it is kept as [`GgufArray::Unread`]; a single string value past it is
/// an error (single strings are names, descriptions and templates, kilobytes long).
pub const KEPT_STRING_BYTES: u64 = 64 << 20;

/// An array of GGUF metadata values, stored by element type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    /// An array the reader walked over (every element inside the file, every string's
    /// length checked) without keeping it: past what [`parse`] keeps of a file's metadata
    /// ([`KEPT_ELEMENTS`] elements, [`KEPT_STRING_BYTES`] bytes of strings). The loader reads
    /// no metadata array; such an array cannot be written back.
    Unread {
        elem_type: u32,
        len: u64,
    },
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

/// One GGUF metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The GGUF value type id (`enum gguf_type`).
    pub fn type_id(&self) -> u32 {
        match self {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    /// A short name of the value's type, for messages.
    pub fn type_name(&self) -> &'static str {
        type_name(self.type_id())
    }

    /// The string, when the value is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

fn type_name(id: u32) -> &'static str {
    match id {
        0 => "u8",
        1 => "i8",
        2 => "u16",
        3 => "i16",
        4 => "u32",
        5 => "i32",
        6 => "f32",
        7 => "bool",
        8 => "string",
        9 => "array",
        10 => "u64",
        11 => "i64",
        12 => "f64",
        _ => "unknown",
    }
}

/// Encoded size of one element of the type, strings counted at their minimum (8).
fn min_elem_bytes(id: u32) -> Option<u64> {
    Some(match id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        _ => return None,
    })
}

/// The parsed header of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufHeader {
    /// 2 or 3.
    pub version: u32,
    /// `general.alignment`, or [`DEFAULT_ALIGNMENT`].
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    /// Key/value pairs in file order (keys are unique).
    pub metadata: Vec<(String, GgufValue)>,
    /// Tensors in file order, with absolute offsets; shapes row-major (ggml `ne` reversed).
    pub tensors: Vec<RawTensor>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: u64,
    /// Array elements still to be kept ([`KEPT_ELEMENTS`] at the start).
    kept_elements: u64,
    /// Bytes of string text still to be kept ([`KEPT_STRING_BYTES`] at the start).
    kept_bytes: u64,
}

impl<'a> Reader<'a> {
    fn len(&self) -> u64 {
        self.buf.len() as u64
    }

    fn remaining(&self) -> u64 {
        self.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], FormatError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.len()).ok_or_else(|| FormatError::Truncated {
            what: what(),
            start: self.pos,
            end: self.pos.saturating_add(n),
            file_len: self.len(),
        })?;
        // Both bounds are <= buf.len(), which is a usize.
        let out = &self.buf[self.pos as usize..end as usize];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], FormatError> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, FormatError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|e| FormatError::NotUtf8 { what: what(), valid_up_to: e.valid_up_to() })
    }

    /// Fails unless `count` items of at least `min_bytes` each fit in what is left.
    fn bound(&self, count: u64, min_bytes: u64, what: &dyn Fn() -> String) -> Result<(), FormatError> {
        let max = self.remaining() / min_bytes.max(1);
        if count > max {
            return Err(FormatError::CountTooLarge { what: what(), count, remaining: self.remaining(), max });
        }
        Ok(())
    }

    fn value(&mut self, type_id: u32, key: &str) -> Result<GgufValue, FormatError> {
        let what = || format!("value of metadata key '{key}'");
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>(&what)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => GgufValue::U32(self.u32(&what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what)?)),
            // ggml reads a bool as one byte; any non-zero byte is true.
            7 => GgufValue::Bool(self.array::<1>(&what)?[0] != 0),
            8 => {
                // A length the file holds is checked against what is kept before the text
                // is copied (one it does not hold is an error of `string`: truncated).
                let start = self.pos;
                let len = self.u64(&what)?;
                if len <= self.remaining() {
                    self.kept_bytes = self.kept_bytes.checked_sub(len).ok_or_else(|| {
                        FormatError::MetadataTooLarge { key: key.to_owned(), limit: KEPT_STRING_BYTES }
                    })?;
                }
                self.pos = start;
                GgufValue::String(self.string(&what)?)
            }
            9 => GgufValue::Array(self.array_value(key)?),
            10 => GgufValue::U64(self.u64(&what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what)?)),
            _ => return Err(FormatError::UnknownValueType { key: key.to_owned(), type_id }),
        })
    }

    fn array_value(&mut self, key: &str) -> Result<GgufArray, FormatError> {
        let what = || format!("array header of metadata key '{key}'");
        let elem = self.u32(&what)?;
        let n = self.u64(&what)?;
        let Some(min) = min_elem_bytes(elem) else {
            return Err(FormatError::UnknownValueType { key: key.to_owned(), type_id: elem });
        };
        self.bound(n, min, &|| format!("array length of metadata key '{key}'"))?;
        if n > MAX_ARRAY_LEN {
            return Err(FormatError::ArrayTooLong { key: key.to_owned(), len: n, max: MAX_ARRAY_LEN });
        }
        let what = || format!("array of metadata key '{key}'");
        // Walk the array once: every string's length checked against the bytes left, and the
        // bytes of text counted, before anything is allocated for it.
        let start = self.pos;
        let mut text = 0u64;
        if elem == 8 {
            for i in 0..n {
                let len = self.u64(&|| format!("string #{i} of metadata key '{key}'"))?;
                self.take(len, &|| format!("string #{i} of metadata key '{key}'"))?;
                text += len;
            }
        } else {
            self.take(n * min, &what)?;
        }
        if n > self.kept_elements || text > self.kept_bytes {
            return Ok(GgufArray::Unread { elem_type: elem, len: n });
        }
        self.kept_elements -= n;
        self.kept_bytes -= text;
        self.pos = start;
        // `n` is bounded by the bytes left, so these reservations are at most the file size.
        fn fixed<T, const N: usize>(
            r: &mut Reader<'_>,
            n: u64,
            what: &dyn Fn() -> String,
            conv: fn([u8; N]) -> T,
        ) -> Result<Vec<T>, FormatError> {
            let bytes = r.take(n * N as u64, what)?;
            Ok(bytes
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    conv(a)
                })
                .collect())
        }
        Ok(match elem {
            0 => GgufArray::U8(fixed(self, n, &what, |a: [u8; 1]| a[0])?),
            1 => GgufArray::I8(fixed(self, n, &what, i8::from_le_bytes)?),
            2 => GgufArray::U16(fixed(self, n, &what, u16::from_le_bytes)?),
            3 => GgufArray::I16(fixed(self, n, &what, i16::from_le_bytes)?),
            4 => GgufArray::U32(fixed(self, n, &what, u32::from_le_bytes)?),
            5 => GgufArray::I32(fixed(self, n, &what, i32::from_le_bytes)?),
            6 => GgufArray::F32(fixed(self, n, &what, f32::from_le_bytes)?),
            7 => GgufArray::Bool(fixed(self, n, &what, |a: [u8; 1]| a[0] != 0)?),
            8 => {
                // No reservation: a string may be 8 bytes in the file but 24 in memory.
                let mut v = Vec::new();
                for i in 0..n {
                    v.push(self.string(&|| format!("string #{i} of metadata key '{key}'"))?);
                }
                GgufArray::String(v)
            }
            10 => GgufArray::U64(fixed(self, n, &what, u64::from_le_bytes)?),
            11 => GgufArray::I64(fixed(self, n, &what, i64::from_le_bytes)?),
            12 => GgufArray::F64(fixed(self, n, &what, f64::from_le_bytes)?),
            _ => return Err(FormatError::UnknownValueType { key: key.to_owned(), type_id: elem }),
        })
    }
}

/// Parses and validates the header of the GGUF file whose whole contents are `file`
/// (normally a memory map: only the header pages are read).
pub fn parse(file: &[u8]) -> Result<GgufHeader, FormatError> {
    let mut r = Reader { buf: file, pos: 0, kept_elements: KEPT_ELEMENTS, kept_bytes: KEPT_STRING_BYTES };
    let magic: [u8; 4] = r.array(&|| "the GGUF magic".into())?;
    if magic != MAGIC {
        return Err(FormatError::BadMagic { found: magic });
    }
    let version = r.u32(&|| "the GGUF version".into())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(FormatError::UnsupportedVersion {
                version,
                hint: "; GGUF v1 files are obsolete, convert them again",
            })
        }
        v if v & 0xFFFF == 0 => {
            return Err(FormatError::UnsupportedVersion {
                version,
                hint: "; the file looks big-endian, only little-endian files are read",
            })
        }
        _ => return Err(FormatError::UnsupportedVersion { version, hint: "" }),
    }
    let n_tensors = r.u64(&|| "the tensor count".into())?;
    let n_kv = r.u64(&|| "the metadata key count".into())?;
    r.bound(n_kv, MIN_KV_BYTES, &|| "the metadata key count".into())?;
    // The tensor infos follow the key/value pairs; bounding by what is left now is weaker
    // than after the pairs but already caps any allocation by the file size.
    r.bound(n_tensors, MIN_TENSOR_INFO_BYTES, &|| "the tensor count".into())?;

    let mut metadata: Vec<(String, GgufValue)> = Vec::new();
    let mut keys = HashSet::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for i in 0..n_kv {
        let key = r.string(&|| format!("metadata key #{i}"))?;
        if key.is_empty() {
            return Err(FormatError::EmptyKey { index: i });
        }
        if !keys.insert(key.clone()) {
            return Err(FormatError::DuplicateKey { key });
        }
        let type_id = r.u32(&|| format!("value type of metadata key '{key}'"))?;
        let value = r.value(type_id, &key)?;
        if key == ALIGNMENT_KEY {
            let GgufValue::U32(a) = value else {
                return Err(FormatError::WrongKeyType { key, expected: "u32", found: value.type_name() });
            };
            if a == 0 || !a.is_power_of_two() {
                return Err(FormatError::BadAlignment { value: u64::from(a) });
            }
            alignment = u64::from(a);
        }
        metadata.push((key, value));
    }

    r.bound(n_tensors, MIN_TENSOR_INFO_BYTES, &|| "the tensor count".into())?;
    // Grown as infos are read (each takes >= 24 file bytes), never reserved up front.
    let mut tensors = Vec::new();
    let mut names = HashSet::new();
    for i in 0..n_tensors {
        let name = r.string(&|| format!("name of tensor #{i}"))?;
        if !names.insert(name.clone()) {
            return Err(FormatError::DuplicateTensor { tensor: name });
        }
        let what = || format!("info of tensor '{name}'");
        let n_dims = u64::from(r.u32(&what)?);
        if n_dims > MAX_DIMS {
            return Err(FormatError::TooManyDims { tensor: name, n_dims, max: MAX_DIMS });
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for dim in 0..n_dims as usize {
            let v = i64::from_le_bytes(r.array(&what)?);
            let Ok(v) = u64::try_from(v) else {
                return Err(FormatError::NegativeDim { tensor: name, dim, value: v });
            };
            ne.push(v);
        }
        let type_id = r.u32(&what)?;
        let dtype = DType::from_ggml_type_id(type_id)
            .ok_or_else(|| FormatError::UnknownGgmlType { tensor: name.clone(), id: type_id })?;
        let offset = r.u64(&what)?;
        let shape: Vec<u64> = ne.iter().rev().copied().collect();
        let len = expected_bytes(&name, dtype, &shape)?;
        // ggml also refuses element counts past i64::MAX.
        if shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).is_none_or(|n| n > i64::MAX as u64) {
            return Err(FormatError::ShapeOverflow { tensor: name, shape });
        }
        tensors.push(RawTensor { name, dtype, shape, offset, len });
    }

    let header_end = r.pos;
    let data_start = if n_tensors > 0 { header_end.div_ceil(alignment) * alignment } else { header_end };
    if data_start > r.len() {
        // ggml also refuses a file whose alignment padding runs past its end.
        return Err(FormatError::Truncated {
            what: format!("the padding to the {alignment}-byte aligned data section"),
            start: header_end,
            end: data_start,
            file_len: r.len(),
        });
    }
    let data_len = r.len() - data_start;
    for t in &mut tensors {
        if t.offset % alignment != 0 {
            return Err(FormatError::Misaligned { tensor: t.name.clone(), offset: t.offset, alignment });
        }
        let end = t.offset.checked_add(t.len).filter(|&e| e <= data_len);
        if end.is_none() {
            return Err(FormatError::OutOfBounds {
                tensor: t.name.clone(),
                begin: t.offset,
                end: t.offset.saturating_add(t.len),
                data_len,
            });
        }
        t.offset += data_start;
    }
    check_overlaps(&tensors, data_start)?;
    Ok(GgufHeader { version, alignment, data_start, metadata, tensors })
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Array(a) => {
            macro_rules! arr {
                ($id:expr, $v:expr, $put:expr) => {{
                    out.extend_from_slice(&($id as u32).to_le_bytes());
                    out.extend_from_slice(&($v.len() as u64).to_le_bytes());
                    for x in $v {
                        $put(&mut *out, x);
                    }
                }};
            }
            match a {
                GgufArray::U8(v) => arr!(0, v, |o: &mut Vec<u8>, x: &u8| o.push(*x)),
                GgufArray::I8(v) => arr!(1, v, |o: &mut Vec<u8>, x: &i8| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::U16(v) => arr!(2, v, |o: &mut Vec<u8>, x: &u16| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::I16(v) => arr!(3, v, |o: &mut Vec<u8>, x: &i16| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::U32(v) => arr!(4, v, |o: &mut Vec<u8>, x: &u32| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::I32(v) => arr!(5, v, |o: &mut Vec<u8>, x: &i32| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::F32(v) => arr!(6, v, |o: &mut Vec<u8>, x: &f32| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::Bool(v) => arr!(7, v, |o: &mut Vec<u8>, x: &bool| o.push(u8::from(*x))),
                GgufArray::String(v) => arr!(8, v, |o: &mut Vec<u8>, x: &String| put_str(o, x)),
                GgufArray::U64(v) => arr!(10, v, |o: &mut Vec<u8>, x: &u64| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::I64(v) => arr!(11, v, |o: &mut Vec<u8>, x: &i64| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::F64(v) => arr!(12, v, |o: &mut Vec<u8>, x: &f64| o.extend_from_slice(&x.to_le_bytes())),
                GgufArray::Unread { .. } => unreachable!("header_bytes refuses unread arrays before writing"),
            }
        }
    }
}

fn alignment_of(metadata: &[(String, GgufValue)]) -> Result<u64, FormatError> {
    match metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, GgufValue::U32(a))) if *a != 0 && a.is_power_of_two() => Ok(u64::from(*a)),
        Some((_, GgufValue::U32(a))) => Err(FormatError::BadAlignment { value: u64::from(*a) }),
        Some((k, v)) => Err(FormatError::WrongKeyType { key: k.clone(), expected: "u32", found: v.type_name() }),
    }
}

/// The bytes before the data section of a GGUF v3 file holding `specs` in order, padded to
/// the alignment (`general.alignment` in `metadata`, else 32). In the data section each
/// tensor's bytes follow in order, each padded with zeros to the alignment.
pub fn header_bytes(specs: &[HeaderEntry<'_>], metadata: &[(String, GgufValue)]) -> Result<Vec<u8>, FormatError> {
    let alignment = alignment_of(metadata)?;
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(specs.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    let mut keys = HashSet::new();
    for (k, v) in metadata {
        if !keys.insert(k.as_str()) {
            return Err(FormatError::DuplicateKey { key: k.clone() });
        }
        if let GgufValue::Array(GgufArray::Unread { .. }) = v {
            return Err(FormatError::UnreadArray { key: k.clone() });
        }
        put_str(&mut out, k);
        out.extend_from_slice(&v.type_id().to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0u64;
    let mut names = HashSet::new();
    for s in specs {
        if !names.insert(s.name) {
            return Err(FormatError::DuplicateTensor { tensor: s.name.to_owned() });
        }
        if s.shape.len() as u64 > MAX_DIMS {
            return Err(FormatError::TooManyDims {
                tensor: s.name.to_owned(),
                n_dims: s.shape.len() as u64,
                max: MAX_DIMS,
            });
        }
        let id = s.dtype.ggml_type_id().ok_or_else(|| FormatError::UnknownDType {
            tensor: s.name.to_owned(),
            dtype: s.dtype.name().to_owned(),
            accepted: "ggml types",
        })?;
        let len = expected_bytes(s.name, s.dtype, s.shape)?;
        put_str(&mut out, s.name);
        out.extend_from_slice(&(s.shape.len() as u32).to_le_bytes());
        for d in s.shape.iter().rev() {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset = (offset + len).div_ceil(alignment) * alignment;
    }
    if !specs.is_empty() {
        out.resize((out.len() as u64).div_ceil(alignment) as usize * alignment as usize, 0);
    }
    Ok(out)
}

/// A whole GGUF v3 file in memory: header, then each tensor's `data`, padded.
/// Each `data` must be exactly the tensor's size.
pub fn to_bytes(
    tensors: &[(HeaderEntry<'_>, &[u8])],
    metadata: &[(String, GgufValue)],
) -> Result<Vec<u8>, FormatError> {
    let specs: Vec<HeaderEntry<'_>> = tensors.iter().map(|(s, _)| *s).collect();
    let alignment = alignment_of(metadata)? as usize;
    let mut out = header_bytes(&specs, metadata)?;
    for (s, data) in tensors {
        let expected = expected_bytes(s.name, s.dtype, s.shape)?;
        if expected != data.len() as u64 {
            return Err(FormatError::SizeMismatch {
                tensor: s.name.to_owned(),
                dtype: s.dtype.name().to_owned(),
                shape: s.shape.to_vec(),
                expected,
                actual: data.len() as u64,
            });
        }
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(alignment) * alignment, 0);
    }
    Ok(out)
}
