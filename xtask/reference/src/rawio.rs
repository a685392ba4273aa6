//! Raw tensor files: little-endian f32 data plus a JSON sidecar with the shape.
//!
//! `FILE` holds the values, outermost axis first (PyTorch's memory order);
//! `FILE.json` holds `{"format": "sdref-f32", "dtype": "f32", "byte_order":
//! "little", "shape": [1, 77, 768], ...}` and any descriptive fields. Inputs
//! may omit the sidecar when the shape is given on the command line.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::ffi::Tensor;

const FORMAT: &str = "sdref-f32";

fn sidecar_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// Writes `t` to `path` and its sidecar; `extra` fields go into the sidecar.
pub fn write_tensor(path: &Path, t: &Tensor, extra: Map<String, Value>) -> Result<(), String> {
    let mut bytes = Vec::with_capacity(t.data.len() * 4);
    for v in &t.data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    fs::write(path, &bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut meta = Map::new();
    meta.insert("format".into(), json!(FORMAT));
    meta.insert("dtype".into(), json!("f32"));
    meta.insert("byte_order".into(), json!("little"));
    meta.insert("shape".into(), json!(t.shape_torch()));
    meta.insert("axis_order".into(), json!("outermost first, last axis contiguous (PyTorch)"));
    meta.extend(extra);
    let side = sidecar_path(path);
    let text = serde_json::to_string_pretty(&Value::Object(meta)).map_err(|e| e.to_string())?;
    fs::write(&side, text + "\n").map_err(|e| format!("{}: {e}", side.display()))
}

/// Parses "1,4,32,32" (or "1x4x32x32").
pub fn parse_shape(s: &str) -> Result<Vec<i64>, String> {
    let dims: Result<Vec<i64>, _> = s.split([',', 'x']).map(|d| d.trim().parse::<i64>()).collect();
    match dims {
        Ok(d) if !d.is_empty() && d.len() <= 4 && d.iter().all(|&x| x > 0) => Ok(d),
        _ => Err(format!("shape {s:?}: expected 1 to 4 positive integers separated by commas, e.g. 1,4,32,32")),
    }
}

/// Reads a tensor from `path`, its shape from `shape` or else from the sidecar.
pub fn read_tensor(path: &Path, shape: Option<&[i64]>) -> Result<Tensor, String> {
    let shape: Vec<i64> = match shape {
        Some(s) => s.to_vec(),
        None => {
            let side = sidecar_path(path);
            let text = fs::read_to_string(&side).map_err(|e| {
                format!("{}: {e}; give the shape of {} with its --*-shape option", side.display(), path.display())
            })?;
            let meta: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", side.display()))?;
            if let Some(dtype) = meta.get("dtype").and_then(Value::as_str) {
                if dtype != "f32" {
                    return Err(format!("{}: dtype {dtype:?}, only \"f32\" is accepted", side.display()));
                }
            }
            let dims = meta
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| format!("{}: no \"shape\" array", side.display()))?;
            let dims: Option<Vec<i64>> = dims.iter().map(Value::as_i64).collect();
            let dims = dims.ok_or_else(|| format!("{}: \"shape\" must hold integers", side.display()))?;
            parse_shape(&dims.iter().map(i64::to_string).collect::<Vec<_>>().join(","))
                .map_err(|e| format!("{}: {e}", side.display()))?
        }
    };
    let bytes = fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let numel: i64 = shape.iter().product();
    if bytes.len() as i64 != numel * 4 {
        return Err(format!(
            "{}: {} bytes, but shape {:?} of f32 needs {}",
            path.display(),
            bytes.len(),
            shape,
            numel * 4
        ));
    }
    let data = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Tensor::from_torch_shape(&shape, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_tensor_reads_back_with_its_shape() {
        let dir = std::env::temp_dir().join(format!("sdref-rawio-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.f32");
        let t = Tensor::from_torch_shape(&[1, 2, 3], vec![0.5, -1.0, 2.0, 3.25, f32::MIN_POSITIVE, 7.0]);
        write_tensor(&path, &t, Map::new()).unwrap();
        let back = read_tensor(&path, None).unwrap();
        assert_eq!(back.shape_torch(), vec![1, 2, 3]);
        assert_eq!(back.ne, vec![3, 2, 1]);
        assert_eq!(back.data, t.data);
        // The raw bytes are little-endian f32, first value first.
        let bytes = fs::read(&path).unwrap();
        assert_eq!(&bytes[..4], &0.5f32.to_le_bytes());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_size_mismatch_is_an_error_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("sdref-rawio-bad-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.f32");
        fs::write(&path, [0u8; 12]).unwrap();
        let err = read_tensor(&path, Some(&[1, 4])).unwrap_err();
        assert!(err.contains("bad.f32") && err.contains("needs 16"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shapes_parse_with_commas_or_x() {
        assert_eq!(parse_shape("1,4,32,32").unwrap(), vec![1, 4, 32, 32]);
        assert_eq!(parse_shape("1x77x768").unwrap(), vec![1, 77, 768]);
        assert!(parse_shape("1,0").is_err());
        assert!(parse_shape("1,2,3,4,5").is_err());
    }
}
