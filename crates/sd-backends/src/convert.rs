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
    if ty == GgmlType::GGML_TYPE_F16 {
        let mut out = vec![0f32; n as usize];
        exact::f16_to_f32_row(data, &mut out);
        return Ok(out);
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
    if to == GgmlType::GGML_TYPE_Q8_0 {
        exact::quantize_q8_0(values, &mut out);
        return Ok(out);
    }
    // SAFETY: values holds nrows*row floats; out is sized for that many elements of `to`.
    let written = unsafe {
        sys::ggml_quantize_chunk(to, values.as_ptr(), out.as_mut_ptr().cast(), 0, n / row, row, std::ptr::null())
    };
    debug_assert_eq!(written, out.len());
    Ok(out)
}

/// The conversions a load spends its time in, bit for bit as ggml's reference code computes
/// them but vectorisable (ggml-base's are scalar, with a `roundf` call per value): f16 to f32,
/// and f32 to q8_0 (`quantize_row_q8_0_ref`: the block's absolute maximum over 127 as the f16
/// scale, each value times its inverse rounded half away from zero). A model quantized at
/// load (`--type q8_0`) passes every weight through both.
mod exact {
    /// f16 values (little-endian bytes) to f32: exact for every finite value and infinity
    /// (F16C where the CPU has it, else the bit arithmetic).
    pub(super) fn f16_to_f32_row(src: &[u8], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), 2 * dst.len());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: the CPU has the features the function is compiled for (checked above).
            unsafe { f16_to_f32_row_f16c(src, dst) };
            return;
        }
        for (c, d) in src.chunks_exact(2).zip(dst) {
            *d = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn f16_to_f32_row_f16c(src: &[u8], dst: &mut [f32]) {
        use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
        let n = dst.len().min(src.len() / 2);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: 16 bytes at 2i and 8 floats at i lie inside `src` and `dst` (i + 8 <= n).
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(2 * i).cast::<__m128i>());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = f16_to_f32(u16::from_le_bytes([src[2 * j], src[2 * j + 1]]));
        }
    }

    /// IEEE binary16 bits to binary32 (exact).
    pub(super) fn f16_to_f32(h: u16) -> f32 {
        let sign = u32::from(h & 0x8000) << 16;
        let exp = u32::from((h >> 10) & 0x1f);
        let man = u32::from(h & 0x3ff);
        let bits = match (exp, man) {
            (0, 0) => sign,
            (0, mut m) => {
                // A subnormal, m * 2^-24: normalise (the exponent of 2^-14 is 113 biased).
                let mut e = 113u32;
                while m & 0x400 == 0 {
                    m <<= 1;
                    e -= 1;
                }
                sign | (e << 23) | ((m & 0x3ff) << 13)
            }
            (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
            (e, m) => sign | ((e + 112) << 23) | (m << 13),
        };
        f32::from_bits(bits)
    }

    /// binary32 to binary16 bits, rounding to nearest even (ggml's `GGML_FP32_TO_FP16`:
    /// overflow to infinity, subnormals kept, NaN as 0x7e00 with the sign).
    pub(super) fn f32_to_f16(f: f32) -> u16 {
        let x = f.to_bits();
        let sign = ((x >> 16) & 0x8000) as u16;
        let e = ((x >> 23) & 0xff) as i32;
        let m = x & 0x7f_ffff;
        if e == 0xff {
            return sign | if m != 0 { 0x7e00 } else { 0x7c00 };
        }
        let e16 = e - 127 + 15;
        if e16 >= 0x1f {
            return sign | 0x7c00;
        }
        let round = |q: u32, rem: u32, half: u32| q + u32::from(rem > half || (rem == half && q & 1 == 1));
        if e16 <= 0 {
            if e16 < -10 {
                return sign; // below half the smallest subnormal
            }
            // (1.m * 2^(e-127)) / 2^-24 = (m | 2^23) * 2^(e-126): drop 126 - e bits.
            let full = m | 0x80_0000;
            let shift = (14 - e16) as u32;
            let q = round(full >> shift, full & ((1 << shift) - 1), 1 << (shift - 1));
            return sign | q as u16;
        }
        // A carry out of the mantissa steps the exponent (to infinity at the top).
        let q = round(((e16 as u32) << 10) | (m >> 13), m & 0x1fff, 0x1000);
        sign | q as u16
    }

    /// `roundf`: to the nearest integer, halves away from zero, for |x| <= 128 (a value times
    /// its q8_0 block's inverse scale is within 127).
    #[inline(always)]
    fn round_half_away(x: f32) -> i32 {
        // Bounded first (f32::max and min drop a NaN), so the conversion needs no saturation
        // check and vectorises; a q8_0 value is within [-127, 127] anyway.
        #[allow(clippy::manual_clamp)] // clamp would keep a NaN; max/min drop it
        let x = x.max(-128.0).min(128.0);
        // SAFETY: x is finite and within i32's range.
        let t: i32 = unsafe { x.to_int_unchecked() }; // toward zero
        let frac = x - t as f32; // exact below 2^23
        t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)
    }

    /// f32 values (whole blocks of 32, none NaN) as q8_0 blocks (a little-endian f16 scale,
    /// 32 i8).
    pub(super) fn quantize_q8_0(x: &[f32], out: &mut [u8]) {
        debug_assert_eq!(x.len() / 32 * 34, out.len());
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { quantize_q8_0_avx2(x, out) };
            return;
        }
        quantize_q8_0_blocks(x, out);
    }

    /// [`quantize_q8_0_blocks`] compiled for AVX2 (the same operations, wider vectors: no
    /// operation is fused or reordered, so the bytes are the same).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn quantize_q8_0_avx2(x: &[f32], out: &mut [u8]) {
        quantize_q8_0_blocks(x, out);
    }

    #[inline(always)]
    fn quantize_q8_0_blocks(x: &[f32], out: &mut [u8]) {
        for (b, o) in x.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
            // The maximum of |v| in eight lanes, then over the lanes: for values that are not
            // NaN (the loader refuses those) the order does not change a maximum.
            let mut lanes = [0f32; 8];
            for c in b.chunks_exact(8) {
                for (l, v) in lanes.iter_mut().zip(c) {
                    *l = if *l > v.abs() { *l } else { v.abs() };
                }
            }
            let amax = lanes.iter().fold(0f32, |m, &v| if m > v { m } else { v });
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            o[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
            for (q, &v) in o[2..].iter_mut().zip(b) {
                *q = round_half_away(v * id) as i8 as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's own conversion (`ggml_quantize_chunk`, the reference quantizers).
    fn ggml_pack(to: GgmlType, values: &[f32], row: i64) -> Vec<u8> {
        let n = values.len() as i64;
        let mut out = vec![0u8; row_size(to, n)];
        // SAFETY: values holds n / row rows; out is sized for n elements of `to`.
        unsafe {
            sys::ggml_quantize_chunk(to, values.as_ptr(), out.as_mut_ptr().cast(), 0, n / row, row, std::ptr::null())
        };
        out
    }

    /// ggml's own f16 to f32 (`to_float` of the type traits).
    fn ggml_f16_to_f32(bytes: &[u8]) -> Vec<f32> {
        let n = bytes.len() / 2;
        let mut out = vec![0f32; n];
        // SAFETY: pure lookup; `bytes` holds n f16 values and out n floats.
        unsafe {
            let f = (*sys::ggml_get_type_traits(GgmlType::GGML_TYPE_F16)).to_float.unwrap();
            f(bytes.as_ptr().cast(), out.as_mut_ptr(), n as i64);
        }
        out
    }

    #[test]
    fn the_fast_conversions_give_ggmls_bits() {
        // Every f16 bit pattern but the NaNs (which the loader refuses before converting).
        let all: Vec<u8> =
            (0..=u16::MAX).filter(|h| h & 0x7c00 != 0x7c00 || h & 0x3ff == 0).flat_map(|h| h.to_le_bytes()).collect();
        let ours = to_f32(GgmlType::GGML_TYPE_F16, &all, all.len() as i64 / 2).unwrap();
        let theirs = ggml_f16_to_f32(&all);
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "f16 {:#06x}", u16::from_le_bytes([all[2 * i], all[2 * i + 1]]));
        }
        // The scalar path (CPUs without F16C) agrees with the vector one.
        for (i, c) in all.chunks_exact(2).enumerate() {
            assert_eq!(exact::f16_to_f32(u16::from_le_bytes([c[0], c[1]])).to_bits(), theirs[i].to_bits());
        }
        // f32 to f16 scales: every power of two's neighbourhood from subnormals to overflow.
        let mut fs = Vec::new();
        for e in -30i32..=17 {
            let p = 2f32.powi(e);
            for k in 0..64 {
                for v in [p * (1.0 + k as f32 / 64.0), f32::from_bits(p.to_bits() + k), f32::from_bits(p.to_bits() - k)]
                {
                    fs.extend([v, -v]);
                }
            }
        }
        fs.extend([
            0.0,
            -0.0,
            65504.0,
            65519.99,
            65520.0,
            1e9,
            f32::INFINITY,
            f32::MIN_POSITIVE,
            2f32.powi(-25),
            2f32.powi(-24) * 1.5,
        ]);
        let theirs = ggml_pack(GgmlType::GGML_TYPE_F16, &fs, fs.len() as i64);
        for (i, v) in fs.iter().enumerate() {
            let t = u16::from_le_bytes([theirs[2 * i], theirs[2 * i + 1]]);
            assert_eq!(exact::f32_to_f16(*v), t, "f32 {v:e} ({:#010x})", v.to_bits());
        }
        // q8_0: random blocks over many scales, ties (values k + 1/2 once scaled), zero blocks
        // and blocks of one value.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut vals = Vec::new();
        for b in 0..4096 {
            let scale = 2f32.powi((next() % 40) as i32 - 30);
            let block: Vec<f32> = match b % 8 {
                0 => vec![0.0; 32],
                1 => vec![scale; 32],
                // amax 127 (scale 1): every value a half-integer or an integer
                2 => (0..32).map(|j| if j == 0 { 127.0 } else { ((next() % 253) as f32 - 126.0) * 0.5 }).collect(),
                _ => (0..32).map(|_| ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale).collect(),
            };
            vals.extend(block);
        }
        let ours = pack_f32(GgmlType::GGML_TYPE_Q8_0, &vals, 256).unwrap();
        let theirs = ggml_pack(GgmlType::GGML_TYPE_Q8_0, &vals, 256);
        for (i, (a, b)) in ours.chunks(34).zip(theirs.chunks(34)).enumerate() {
            assert_eq!(a, b, "q8_0 block {i}: {:?}", &vals[32 * i..32 * i + 32]);
        }
    }

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
