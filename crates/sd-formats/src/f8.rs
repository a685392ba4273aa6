//! 8-bit floats (safetensors `F8_E4M3`, `F8_E5M2`) widened to f16, as stable-diffusion.cpp loads them.
//!
//! ggml has no 8-bit float type, so the reference widens such tensors to f16 when it reads them
//! and computes with the f16 values; so do we. Both formats fit in f16 exactly: e4m3fn (OCP FP8,
//! "fn": no infinities, one NaN pattern per sign, bias 7, largest 448, smallest subnormal 2^-9)
//! and e5m2 (IEEE-like, bias 15, the top byte of an f16). The widening is exact; NaN codes
//! become f16 NaNs, which the loader's non-finite check then reports by tensor and element.
//!
//! [`f32_to_e4m3fn`] goes the other way (round to nearest, ties to even) for fixtures that
//! store weights as people download them (`F8_E4M3` T5-XXL files).

use super::DType;

/// f16 bits of an e4m3fn value (exact).
pub fn e4m3fn_to_f16(b: u8) -> u16 {
    let sign = u16::from(b & 0x80) << 8;
    let exp = u16::from((b >> 3) & 0x0f);
    let man = u16::from(b & 0x07);
    if exp == 0x0f && man == 0x07 {
        // The format's only NaN pattern (there are no infinities).
        return sign | 0x7e00;
    }
    if exp == 0 {
        if man == 0 {
            return sign;
        }
        // Subnormal: man * 2^-9, renormalised for f16 (whose normal range reaches 2^-14).
        let lead = 15 - man.leading_zeros() as u16; // 0..=2, the leading bit's position
        let f16_exp = lead + 15 - 9;
        let f16_man = (man - (1 << lead)) << (10 - lead);
        return sign | (f16_exp << 10) | f16_man;
    }
    // Normal: 2^(exp - 7) * (1 + man / 8).
    sign | ((exp + 15 - 7) << 10) | (man << 7)
}

/// f16 bits of an e5m2 value (exact: e5m2 is the top byte of an f16).
pub fn e5m2_to_f16(b: u8) -> u16 {
    u16::from(b) << 8
}

/// The f16 bytes (little-endian) of `data` stored as the 8-bit float `dtype`; `None` when
/// `dtype` is not one.
pub fn widen_to_f16(dtype: DType, data: &[u8]) -> Option<Vec<u8>> {
    // Every code's f16 bytes, once per format: a load widens gigabytes (an fp8 T5-XXL).
    static TABLES: std::sync::OnceLock<[[[u8; 2]; 256]; 2]> = std::sync::OnceLock::new();
    let tables = TABLES.get_or_init(|| {
        let table = |f: fn(u8) -> u16| std::array::from_fn(|b| f(b as u8).to_le_bytes());
        [table(e4m3fn_to_f16), table(e5m2_to_f16)]
    });
    let table = match dtype {
        DType::F8_E4M3 => &tables[0],
        DType::F8_E5M2 => &tables[1],
        _ => return None,
    };
    let mut out = vec![0u8; data.len() * 2];
    for (o, &b) in out.chunks_exact_mut(2).zip(data) {
        o.copy_from_slice(&table[usize::from(b)]);
    }
    Some(out)
}

/// The e4m3fn code nearest to `x` (ties to the even code); values beyond the largest finite
/// value (448) saturate to it, a NaN gives the NaN code.
pub fn f32_to_e4m3fn(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7f;
    }
    let a = x.abs();
    // The positive finite codes 0x00..=0x7e are increasing in value: search the first code
    // whose value is >= a, then pick the nearer of it and the one below.
    let value = |c: u8| half::f16::from_bits(e4m3fn_to_f16(c)).to_f32();
    let (mut lo, mut hi) = (0u8, 0x7eu8);
    if a >= value(hi) {
        return sign | hi;
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if value(mid) >= a {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let up = lo;
    if up == 0 {
        return sign;
    }
    let down = up - 1;
    let (du, dd) = (value(up) - a, a - value(down));
    let code = if du < dd || (du == dd && up % 2 == 0) { up } else { down };
    sign | code
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The e4m3fn value of a code from its definition, in f64.
    fn e4m3fn_value(b: u8) -> f64 {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((b >> 3) & 0x0f);
        let m = f64::from(b & 0x07);
        if e == 0 {
            s * m / 8.0 * 2f64.powi(-6)
        } else {
            s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    #[test]
    fn every_e4m3fn_code_widens_to_its_exact_value() {
        for b in 0..=255u8 {
            let h = half::f16::from_bits(e4m3fn_to_f16(b));
            if b & 0x7f == 0x7f {
                assert!(h.is_nan(), "{b:#04x}");
                continue;
            }
            assert_eq!(f64::from(h.to_f32()), e4m3fn_value(b), "{b:#04x}");
            // Negative zero keeps its sign.
            assert_eq!(h.is_sign_negative(), b & 0x80 != 0, "{b:#04x}");
        }
        assert_eq!(e4m3fn_value(0x7e), 448.0);
        assert_eq!(e4m3fn_value(0x01), 2f64.powi(-9));
    }

    #[test]
    fn every_e5m2_code_widens_to_its_exact_value() {
        for b in 0..=255u8 {
            let h = half::f16::from_bits(e5m2_to_f16(b));
            let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
            let e = i32::from((b >> 2) & 0x1f);
            let m = f64::from(b & 0x03);
            match e {
                31 if m == 0.0 => assert!(h.is_infinite() && h.is_sign_negative() == (s < 0.0), "{b:#04x}"),
                31 => assert!(h.is_nan(), "{b:#04x}"),
                0 => assert_eq!(f64::from(h.to_f32()), s * m / 4.0 * 2f64.powi(-14), "{b:#04x}"),
                _ => assert_eq!(f64::from(h.to_f32()), s * (1.0 + m / 4.0) * 2f64.powi(e - 15), "{b:#04x}"),
            }
        }
    }

    #[test]
    fn rounding_to_e4m3fn_is_nearest_with_ties_to_even_and_saturates() {
        // Every finite code round-trips.
        for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            let v = e4m3fn_value(b) as f32;
            let back = f32_to_e4m3fn(v);
            assert_eq!(e4m3fn_value(back), e4m3fn_value(b), "{b:#04x}");
        }
        // Midpoints go to the even neighbour, points off the midpoint to the nearer one.
        for b in 0..0x7eu8 {
            let (a, c) = (e4m3fn_value(b), e4m3fn_value(b + 1));
            let mid = ((a + c) / 2.0) as f32;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3fn(mid), even, "midpoint of {b:#04x}");
            let off = (c - a) / 8.0;
            assert_eq!(f32_to_e4m3fn((a + off) as f32), b, "just above {b:#04x}");
            assert_eq!(f32_to_e4m3fn((c - off) as f32), b + 1, "just below {:#04x}", b + 1);
        }
        assert_eq!(f32_to_e4m3fn(1e9), 0x7e);
        assert_eq!(f32_to_e4m3fn(-1e9), 0xfe);
        assert_eq!(f32_to_e4m3fn(-0.0), 0x80);
        assert_eq!(f32_to_e4m3fn(f32::NAN), 0x7f);
    }

    #[test]
    fn widening_takes_only_8_bit_floats() {
        assert_eq!(widen_to_f16(DType::F8_E4M3, &[0x38, 0xb8]).unwrap(), [0x00, 0x3c, 0x00, 0xbc]);
        assert_eq!(widen_to_f16(DType::F8_E5M2, &[0x3c]).unwrap(), [0x00, 0x3c]);
        assert!(widen_to_f16(DType::F16, &[0, 0]).is_none());
    }
}
