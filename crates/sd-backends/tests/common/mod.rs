//! Helpers shared by this crate's integration tests.

#![allow(dead_code)]

/// IEEE binary16 to binary32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as u32;
    let mag = match exp {
        0 => man as f32 * (2f32).powi(-24),
        0x1f => return f32::from_bits(sign | 0x7f80_0000 | (man << 13)),
        _ => return f32::from_bits(sign | (((exp + 112) as u32) << 23) | (man << 13)),
    };
    f32::from_bits(sign | mag.to_bits())
}

/// IEEE binary32 to binary16, round to nearest even (what F16C's `vcvtps2ph` with
/// immediate 0 and ggml's software conversion compute for every non-NaN input).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    assert!(exp != 0xff || man == 0, "no NaN in the inputs");
    if exp == 0xff {
        return sign | 0x7c00;
    }
    let e = exp - 112; // the binary16 biased exponent
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    let round = |kept: u32, dropped: u32, half: u32| -> u32 {
        if dropped > half || (dropped == half && kept & 1 == 1) {
            kept + 1
        } else {
            kept
        }
    };
    if e <= 0 {
        if e < -10 {
            return sign; // at most half the smallest subnormal (f32 subnormals included)
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        return sign | round(m >> shift, m & ((1 << shift) - 1), 1 << (shift - 1)) as u16;
    }
    // a carry out of the mantissa moves to the next exponent (or to infinity): still right
    sign | round(((e as u32) << 10) | (man >> 13), man & 0x1fff, 0x1000) as u16
}
