//! Safetensors header reader and writer, with our own validation.
//!
//! Layout (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of
//! UTF-8 JSON, then the data section. The JSON maps each tensor name to
//! `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to the data section)
//! and may hold `"__metadata__"`, a map of strings.
//!
//! We parse it ourselves rather than through the `safetensors` crate so that every rule is
//! ours and every error names the tensor: the header length must fit the file and stay under
//! [`MAX_HEADER_LEN`]; the JSON must be an object without duplicate names; each dtype must be
//! known; each byte range must lie inside the data section, be exactly shape × dtype bytes,
//! and overlap no other tensor. Gaps between tensors and bytes after the last one are
//! harmless and accepted. Only the header is read: tensor bytes are never touched here.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::Value;

use super::dtype::DType;
use super::error::FormatError;
use super::RawTensor;

/// Largest header we accept. The safetensors crate refuses headers over 100 MB; real
/// checkpoints have headers well under 1 MB.
const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

/// The parsed header of a safetensors file.
#[derive(Debug, Clone, PartialEq)]
pub struct SafetensorsHeader {
    /// Absolute offset of the data section (8 + header length).
    pub data_start: u64,
    /// `__metadata__`, string values only.
    pub metadata: BTreeMap<String, String>,
    /// Tensors in header order, with absolute byte offsets.
    pub tensors: Vec<RawTensor>,
}

/// Parses and validates the header of the safetensors file whose whole contents are `file`
/// (normally a memory map: only the header pages are read).
pub fn parse(file: &[u8]) -> Result<SafetensorsHeader, FormatError> {
    let file_len = file.len() as u64;
    let Some(len_bytes) = file.get(..8) else {
        return Err(FormatError::Truncated { what: "the 8-byte header length".into(), start: 0, end: 8, file_len });
    };
    let header_len = u64::from_le_bytes(len_bytes.try_into().unwrap_or([0; 8]));
    if header_len > MAX_HEADER_LEN || header_len > file_len - 8 {
        return Err(FormatError::HeaderLength { len: header_len, file_len, limit: MAX_HEADER_LEN });
    }
    // Bounded by MAX_HEADER_LEN above, so the cast cannot truncate.
    let json_bytes = &file[8..8 + header_len as usize];
    let json = std::str::from_utf8(json_bytes).map_err(|e| FormatError::NotUtf8 {
        what: "the safetensors JSON header".into(),
        valid_up_to: e.valid_up_to(),
    })?;
    let entries = parse_entries(json)?;

    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(entries.len());
    let mut seen = HashSet::with_capacity(entries.len());
    for (name, value) in entries {
        if !seen.insert(name.clone()) {
            return Err(FormatError::DuplicateTensor { tensor: name });
        }
        if name == "__metadata__" {
            metadata = parse_metadata(value)?;
            continue;
        }
        let t = parse_entry(&name, &value, data_len)?;
        tensors.push(RawTensor { offset: t.offset + data_start, ..t });
    }
    check_overlaps(&tensors, data_start)?;
    Ok(SafetensorsHeader { data_start, metadata, tensors })
}

/// The top-level JSON object as an ordered list, so that duplicate names can be seen
/// (a map would silently keep the last one).
fn parse_entries(json: &str) -> Result<Vec<(String, Value)>, FormatError> {
    struct Entries;
    impl<'de> Visitor<'de> for Entries {
        type Value = Vec<(String, Value)>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object mapping tensor names to tensor descriptions")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(entry) = map.next_entry::<String, Value>()? {
                out.push(entry);
            }
            Ok(out)
        }
    }
    let mut de = serde_json::Deserializer::from_str(json);
    let entries = de
        .deserialize_map(Entries)
        .and_then(|e| de.end().map(|()| e))
        .map_err(|e| FormatError::Json { message: e.to_string() })?;
    Ok(entries)
}

fn parse_metadata(value: Value) -> Result<BTreeMap<String, String>, FormatError> {
    let Value::Object(map) = value else {
        return Err(FormatError::BadMetadata { found: json_kind(&value).into() });
    };
    let mut out = BTreeMap::new();
    for (k, v) in map {
        match v {
            Value::String(s) => {
                out.insert(k, s);
            }
            // The format says strings; other values are harmless, so skip them with a note.
            other => tracing::warn!(key = %k, kind = json_kind(&other), "ignoring non-string __metadata__ value"),
        }
    }
    Ok(out)
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// One tensor entry, with its offset still relative to the data section.
fn parse_entry(name: &str, value: &Value, data_len: u64) -> Result<RawTensor, FormatError> {
    let bad = |problem: String| FormatError::BadEntry { tensor: name.to_owned(), problem };
    let Value::Object(obj) = value else {
        return Err(bad(format!("the entry is {}, not an object", json_kind(value))));
    };
    let dtype_str = match obj.get("dtype") {
        Some(Value::String(s)) => s.as_str(),
        Some(v) => return Err(bad(format!("\"dtype\" is {}, not a string", json_kind(v)))),
        None => return Err(bad("\"dtype\" is missing".into())),
    };
    let dtype = DType::from_safetensors_name(dtype_str).ok_or_else(|| FormatError::UnknownDType {
        tensor: name.to_owned(),
        dtype: dtype_str.to_owned(),
        accepted: DType::SAFETENSORS_ACCEPTED,
    })?;
    let shape = match obj.get("shape") {
        Some(Value::Array(dims)) => dims
            .iter()
            .enumerate()
            .map(|(i, d)| d.as_u64().ok_or_else(|| bad(format!("shape[{i}] is {d}, not a non-negative integer"))))
            .collect::<Result<Vec<u64>, _>>()?,
        Some(v) => return Err(bad(format!("\"shape\" is {}, not an array", json_kind(v)))),
        None => return Err(bad("\"shape\" is missing".into())),
    };
    let (begin, end) = match obj.get("data_offsets") {
        Some(Value::Array(o)) if o.len() == 2 => match (o[0].as_u64(), o[1].as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => {
                return Err(bad(format!(
                    "data_offsets {value} are not two non-negative integers",
                    value = obj["data_offsets"]
                )))
            }
        },
        Some(v) => return Err(bad(format!("\"data_offsets\" is {v}, not [BEGIN, END]"))),
        None => return Err(bad("\"data_offsets\" is missing".into())),
    };
    if begin > end {
        return Err(FormatError::ReversedOffsets { tensor: name.to_owned(), begin, end });
    }
    if end > data_len {
        return Err(FormatError::OutOfBounds { tensor: name.to_owned(), begin, end, data_len });
    }
    let expected = expected_bytes(name, dtype, &shape)?;
    if expected != end - begin {
        return Err(FormatError::SizeMismatch {
            tensor: name.to_owned(),
            dtype: dtype_str.to_owned(),
            shape,
            expected,
            actual: end - begin,
        });
    }
    Ok(RawTensor { name: name.to_owned(), dtype, shape, offset: begin, len: end - begin })
}

/// Bytes that `shape` (row-major, outermost first) of `dtype` occupies.
pub fn expected_bytes(name: &str, dtype: DType, shape: &[u64]) -> Result<u64, FormatError> {
    let overflow = || FormatError::ShapeOverflow { tensor: name.to_owned(), shape: shape.to_vec() };
    let n: u64 = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
    let ne0 = shape.last().copied().unwrap_or(1);
    if ne0 != 0 && ne0 % dtype.block_size() != 0 {
        return Err(FormatError::PartialBlock {
            tensor: name.to_owned(),
            dtype: dtype.name().to_owned(),
            ne0,
            block: dtype.block_size(),
        });
    }
    dtype.tensor_bytes(ne0, n).ok_or_else(overflow)
}

/// Fails when two non-empty tensors share a byte. Offsets in `tensors` are absolute; the
/// error reports them relative to the data section, as the header writes them.
pub(crate) fn check_overlaps(tensors: &[RawTensor], data_start: u64) -> Result<(), FormatError> {
    let mut spans: Vec<(u64, u64, usize)> =
        tensors.iter().enumerate().filter(|(_, t)| t.len > 0).map(|(i, t)| (t.offset, t.offset + t.len, i)).collect();
    spans.sort_unstable();
    for w in spans.windows(2) {
        let (a, b) = (w[0], w[1]);
        if b.0 < a.1 {
            return Err(FormatError::Overlap {
                first: tensors[a.2].name.clone(),
                second: tensors[b.2].name.clone(),
                overlap_start: b.0 - data_start,
                overlap_end: a.1.min(b.1) - data_start,
            });
        }
    }
    Ok(())
}

/// One tensor of a header to write: its name, type and row-major shape (the parameter
/// declarations of a model are `sd_sched::TensorSpec`, a fixture's tensors `FixtureTensor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderEntry<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [u64],
}

/// The bytes before the data section of a safetensors file holding `specs` in order (length
/// prefix and JSON, padded with spaces to a multiple of 8). The data section is then the
/// tensors' bytes concatenated in the same order, without padding.
pub fn header_bytes(specs: &[HeaderEntry<'_>], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>, FormatError> {
    let mut obj = serde_json::Map::new();
    if !metadata.is_empty() {
        let m = metadata.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
        obj.insert("__metadata__".into(), Value::Object(m));
    }
    let mut offset = 0u64;
    for s in specs {
        let dtype = s.dtype.safetensors_name().ok_or_else(|| FormatError::UnknownDType {
            tensor: s.name.to_owned(),
            dtype: s.dtype.name().to_owned(),
            accepted: DType::SAFETENSORS_ACCEPTED,
        })?;
        if obj.contains_key(s.name) {
            return Err(FormatError::DuplicateTensor { tensor: s.name.to_owned() });
        }
        let len = expected_bytes(s.name, s.dtype, s.shape)?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| FormatError::ShapeOverflow { tensor: s.name.to_owned(), shape: s.shape.to_vec() })?;
        obj.insert(
            s.name.to_owned(),
            serde_json::json!({ "dtype": dtype, "shape": s.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut json = Value::Object(obj).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok(out)
}

/// A whole safetensors file in memory: header, then each tensor's `data` in order.
/// Each `data` must be exactly the tensor's size.
pub fn to_bytes(
    tensors: &[(HeaderEntry<'_>, &[u8])],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, FormatError> {
    let specs: Vec<HeaderEntry<'_>> = tensors.iter().map(|(s, _)| *s).collect();
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
    }
    Ok(out)
}
