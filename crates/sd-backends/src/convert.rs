//! Tensor data type conversion with ggml's own reference kernels (dequantize, quantize, f16/bf16).
//!
//! Used at load time (`--type`) and when a model needs a tensor in another
//! type than the file stores. Conversion goes through f32: source rows are
//! expanded with the type's `to_float`, then packed with `ggml_quantize_chunk`
//! (which covers every storage type, including plain f16/bf16/f32).

use ggml_sys as sys;

use crate::context::{row_size, type_name, GgmlType};

/// Why a conversion is impossible.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// Byte count does not match the shape.
    #[error("expected {expected} bytes of {ty} for {n} elements, got {got}")]
    Size { ty: String, n: i64, expected: usize, got: usize },
    /// The row length is not a multiple of the target's block size.
    #[error("cannot store rows of {row} elements as {ty} (block size {block})")]
    Block { ty: String, row: i64, block: i64 },
    /// ggml cannot convert from or to this type.
    #[error("no conversion from {from} to {to}")]
    Unsupported { from: String, to: String },
}

/// Whether `ty` is a block-quantized type (q8_0, q4_0, the k-quants, ...).
pub fn is_quantized(ty: GgmlType) -> bool {
    // SAFETY: pure lookup.
    unsafe { sys::ggml_is_quantized(ty) }
}

/// Whether rows of `row_len` elements can be stored as `ty`.
pub fn fits_blocks(ty: GgmlType, row_len: i64) -> bool {
    // SAFETY: pure lookup.
    let b = unsafe { sys::ggml_blck_size(ty) };
    b > 0 && row_len % b == 0
}

/// Expands `data` (`n` elements of `ty`) to f32.
pub fn to_f32(ty: GgmlType, data: &[u8], n: i64) -> Result<Vec<f32>, ConvertError> {
    let expected = row_size(ty, n);
    if data.len() != expected {
        return Err(ConvertError::Size { ty: type_name(ty), n, expected, got: data.len() });
    }
    if ty == GgmlType::GGML_TYPE_F32 {
        return Ok(data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
    }
    // SAFETY: pure lookup; traits are static.
    let traits = unsafe { &*sys::ggml_get_type_traits(ty) };
    let f = traits.to_float.ok_or_else(|| ConvertError::Unsupported { from: type_name(ty), to: "f32".into() })?;
    let mut out = vec![0f32; n as usize];
    // SAFETY: data holds exactly n elements of ty (checked), out has n floats.
    unsafe { f(data.as_ptr().cast(), out.as_mut_ptr(), n) };
    Ok(out)
}

/// Converts `data` of shape `ne` (innermost first) from `from` to `to`.
pub fn convert(from: GgmlType, to: GgmlType, data: &[u8], ne: &[i64]) -> Result<Vec<u8>, ConvertError> {
    let n: i64 = ne.iter().product();
    if from == to {
        let expected = row_size(from, n);
        if data.len() != expected {
            return Err(ConvertError::Size { ty: type_name(from), n, expected, got: data.len() });
        }
        return Ok(data.to_vec());
    }
    let row = ne.first().copied().unwrap_or(1).max(1);
    if !fits_blocks(to, row) {
        // SAFETY: pure lookup.
        return Err(ConvertError::Block { ty: type_name(to), row, block: unsafe { sys::ggml_blck_size(to) } });
    }
    let nrows = (n / row) as usize;
    let threads = conversion_threads(n).min(nrows);
    let in_row = row_size(from, row);
    if threads <= 1 || !fits_blocks(from, row) || n % row != 0 || data.len() != in_row * nrows {
        let f = to_f32(from, data, n)?;
        return pack_f32(to, &f, row);
    }
    // A large tensor: whole rows per thread, each through f32 and back, in order. Every row
    // converts on its own, so the bytes are those of the one-thread path.
    let out_row = row_size(to, row);
    let per = nrows.div_ceil(threads);
    let mut out = vec![0u8; out_row * nrows];
    std::thread::scope(|s| {
        let parts: Vec<_> = data
            .chunks(per * in_row)
            .zip(out.chunks_mut(per * out_row))
            .map(|(src, dst)| {
                s.spawn(move || -> Result<(), ConvertError> {
                    let rows = (src.len() / in_row) as i64;
                    dst.copy_from_slice(&pack_f32(to, &to_f32(from, src, rows * row)?, row)?);
                    Ok(())
                })
            })
            .collect();
        parts.into_iter().try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })?;
    Ok(out)
}

/// Threads a conversion of `n` elements uses: the machine's cores (at most 8) for tensors of
/// a million elements or more (a load converts one tensor at a time, with nothing else
/// running), one below that.
fn conversion_threads(n: i64) -> usize {
    if n < 1 << 20 {
        return 1;
    }
    std::thread::available_parallelism().map_or(1, |p| p.get().min(8))
}

/// Packs f32 values (rows of `row` elements) as `to`.
pub fn pack_f32(to: GgmlType, values: &[f32], row: i64) -> Result<Vec<u8>, ConvertError> {
    let n = values.len() as i64;
    if to == GgmlType::GGML_TYPE_F32 {
        return Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect());
    }
    // SAFETY: pure query.
    if unsafe { sys::ggml_quantize_requires_imatrix(to) } {
        return Err(ConvertError::Unsupported { from: "f32".into(), to: type_name(to) });
    }
    if row <= 0 || n % row != 0 || !fits_blocks(to, row) {
        // SAFETY: pure lookup.
        return Err(ConvertError::Block { ty: type_name(to), row, block: unsafe { sys::ggml_blck_size(to) } });
    }
    let mut out = vec![0u8; row_size(to, n)];
    // SAFETY: values holds nrows*row floats; out is sized for that many elements of `to`.
    let written = unsafe {
        sys::ggml_quantize_chunk(to, values.as_ptr(), out.as_mut_ptr().cast(), 0, n / row, row, std::ptr::null())
    };
    debug_assert_eq!(written, out.len());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_f16_and_q8_0() {
        let v: Vec<f32> = (0..64).map(|i| (i as f32 * 0.1).sin()).collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let h = convert(GgmlType::GGML_TYPE_F32, GgmlType::GGML_TYPE_F16, &bytes, &[64]).unwrap();
        assert_eq!(h.len(), 128);
        let back = to_f32(GgmlType::GGML_TYPE_F16, &h, 64).unwrap();
        assert!(v.iter().zip(&back).all(|(a, b)| (a - b).abs() < 1e-3));
        let q = convert(GgmlType::GGML_TYPE_F16, GgmlType::GGML_TYPE_Q8_0, &h, &[32, 2]).unwrap();
        assert_eq!(q.len(), 2 * 34);
        let back = to_f32(GgmlType::GGML_TYPE_Q8_0, &q, 64).unwrap();
        assert!(v.iter().zip(&back).all(|(a, b)| (a - b).abs() < 1e-2));
    }

    #[test]
    fn rejects_bad_sizes_and_blocks() {
        assert!(matches!(
            convert(GgmlType::GGML_TYPE_F32, GgmlType::GGML_TYPE_F16, &[0; 7], &[2]),
            Err(ConvertError::Size { .. })
        ));
        assert!(matches!(
            convert(GgmlType::GGML_TYPE_F32, GgmlType::GGML_TYPE_Q8_0, &[0; 40], &[10]),
            Err(ConvertError::Block { .. })
        ));
    }

    #[test]
    fn a_large_tensor_converts_over_threads_to_the_same_bytes() {
        // 1027 rows of 2048: above the threading threshold; rows split unevenly over threads.
        let (row, rows) = (2048i64, 1027i64);
        let v: Vec<f32> = (0..row * rows).map(|i| ((i * 7919 % 10007) as f32 / 5003.0) - 1.0).collect();
        let h = pack_f32(GgmlType::GGML_TYPE_F16, &v, row).unwrap();
        for to in [GgmlType::GGML_TYPE_Q8_0, GgmlType::GGML_TYPE_F32, GgmlType::GGML_TYPE_Q4_0] {
            let one = pack_f32(to, &to_f32(GgmlType::GGML_TYPE_F16, &h, row * rows).unwrap(), row).unwrap();
            assert_eq!(convert(GgmlType::GGML_TYPE_F16, to, &h, &[row, rows]).unwrap(), one, "{}", type_name(to));
        }
        // A wrong byte count is still the size error, not a thread's.
        assert!(matches!(
            convert(GgmlType::GGML_TYPE_F16, GgmlType::GGML_TYPE_Q8_0, &h[2..], &[row, rows]),
            Err(ConvertError::Size { .. })
        ));
    }
}
