//! Helpers shared by this crate's integration tests.

#![allow(dead_code)]

use std::path::PathBuf;

use sd_backends::{Backend, PluginRegistry, PluginSearch};

/// The CPU device of the plugins this build compiled.
pub fn cpu() -> Backend {
    let reg = PluginRegistry::discover(&PluginSearch::only(vec![PathBuf::from(ggml_sys::BUILD_PLUGIN_DIR)]));
    Backend::new(reg.device("cpu").expect("the CPU plugin is built with ggml-sys")).unwrap()
}

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn int(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }

    /// Uniform in [-1, 1).
    pub fn val(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

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
