//! Noise generators that reproduce the reference's `--rng std_default | cuda | cpu` bit for bit.
//!
//! Matching images across implementations needs the same *noise*, not just the same seed, so each
//! generator re-implements one algorithm exactly, including the float/double rounding steps:
//!
//! - [`PhiloxRng`] (`cuda`, the reference's default): Philox 4x32-10 with the A1111/torch-CUDA
//!   counter layout (counter `[offset, 0, i, 0]`, key = the 64-bit seed) and a Box-Muller
//!   transform that keeps only the sine branch. Each request uses a fresh `offset`.
//! - [`StdDefaultRng`] (`std_default`): what the reference gets from `std::default_random_engine`
//!   and `std::normal_distribution<float>` when built with libstdc++ (GCC, Linux). libstdc++'s
//!   default engine is `minstd_rand0` (Park-Miller, multiplier 16807), *not* mt19937; the normal
//!   distribution is Marsaglia's polar method over `generate_canonical<float, 24>`, and the
//!   reference builds a fresh distribution per request, so the cached second value of an odd-sized
//!   request is dropped. (MSVC builds of the reference use mt19937 here and give other numbers.)
//! - [`TorchCpuRng`] (`cpu`): torch's CPU `randn` on mt19937 (16-wide Box-Muller for requests of
//!   16 or more, double-precision Box-Muller with a cached second value below that).
//!
//! Which libm function each step calls (float `logf` or double `log`) follows the overload the
//! reference's C++ resolves to with g++/libstdc++; Rust's `f32`/`f64` methods call the same libm.

use std::fmt;
use std::str::FromStr;

use super::{parse_name, SamplingError};

/// A source of standard-normal noise, requested in whole tensors as the reference does.
pub trait NoiseRng: Send {
    /// Draws `n` standard-normal values, in the order the reference lays them out in its tensor.
    fn randn(&mut self, n: usize) -> Vec<f32>;
}

/// The reference's RNG choices (`--rng`, `--sampler-rng`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RngKind {
    /// `std_default`: libstdc++ `default_random_engine` + `normal_distribution<float>`.
    StdDefault,
    /// `cuda`: Philox 4x32-10, compatible with torch CUDA / A1111 GPU noise. The reference's default.
    #[default]
    Cuda,
    /// `cpu`: torch CPU `randn` (mt19937), compatible with ComfyUI noise.
    Cpu,
}

impl RngKind {
    /// Every kind, in the reference's enum order.
    pub const ALL: [RngKind; 3] = [RngKind::StdDefault, RngKind::Cuda, RngKind::Cpu];

    /// The name the reference's CLI accepts.
    pub fn name(self) -> &'static str {
        match self {
            RngKind::StdDefault => "std_default",
            RngKind::Cuda => "cuda",
            RngKind::Cpu => "cpu",
        }
    }

    /// A generator of this kind seeded as the reference's `manual_seed(seed)` does.
    pub fn seeded(self, seed: u64) -> Box<dyn NoiseRng> {
        new_rng(self, seed)
    }
}

impl fmt::Display for RngKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RngKind {
    type Err = SamplingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("rng", s, &RngKind::ALL, |k| k.name(), &[])
    }
}

/// A generator of `kind` seeded with `seed` (the reference seeds with the per-image seed,
/// `seed + batch_index`, before drawing the initial noise).
pub fn new_rng(kind: RngKind, seed: u64) -> Box<dyn NoiseRng> {
    match kind {
        RngKind::StdDefault => Box::new(StdDefaultRng::new(seed)),
        RngKind::Cuda => Box::new(PhiloxRng::new(seed)),
        RngKind::Cpu => Box::new(TorchCpuRng::new(seed)),
    }
}

// ---------------------------------------------------------------------------------------------
// Philox 4x32-10 (`cuda`)

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// One Philox 4x32 round (Salmon et al. 2011): two 32x32->64 multiplies, then a word permutation.
#[inline]
fn philox_round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let p0 = u64::from(c[0]) * u64::from(PHILOX_M0);
    let p1 = u64::from(c[2]) * u64::from(PHILOX_M1);
    let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
    let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Philox 4x32 with 10 rounds: the block function of Random123's `philox4x32_10`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for _ in 0..9 {
        c = philox_round(c, k);
        k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
    }
    philox_round(c, k)
}

/// 2^-32 as the reference writes it (a float literal).
const TWO_POW32_INV: f32 = 2.328_306_4e-10;
/// 2^-32 * 2*pi, multiplied in float as the reference does.
const TWO_POW32_INV_2PI: f32 = 2.328_306_4e-10_f32 * 6.283_185_5_f32;

/// The reference's Box-Muller step for one pair of Philox words (already converted to float).
///
/// The uniforms are formed in float; `log`, `sqrt` and `sin` run in double (the C++ resolves the
/// unqualified calls to the `double` overloads), with a rounding to float after the square root
/// and at the end.
pub fn philox_box_muller(x: f32, y: f32) -> f32 {
    let u = x * TWO_POW32_INV + TWO_POW32_INV / 2.0;
    let v = y * TWO_POW32_INV_2PI + TWO_POW32_INV_2PI / 2.0;
    let s = (-2.0_f64 * f64::from(u).ln()).sqrt() as f32;
    (f64::from(s) * f64::from(v).sin()) as f32
}

/// `--rng cuda`: torch-CUDA-compatible normal noise from Philox 4x32-10.
#[derive(Clone, Debug)]
pub struct PhiloxRng {
    seed: u64,
    offset: u32,
}

impl PhiloxRng {
    /// A generator as after the reference's `manual_seed(seed)`: key = seed, offset 0.
    pub fn new(seed: u64) -> Self {
        PhiloxRng { seed, offset: 0 }
    }
}

impl NoiseRng for PhiloxRng {
    fn randn(&mut self, n: usize) -> Vec<f32> {
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        let offset = self.offset;
        self.offset = self.offset.wrapping_add(1);
        (0..n)
            .map(|i| {
                // The reference indexes with a 32-bit counter word.
                let g = philox4x32_10([offset, 0, i as u32, 0], key);
                philox_box_muller(g[0] as f32, g[1] as f32)
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// libstdc++ default_random_engine + normal_distribution<float> (`std_default`)

/// libstdc++'s `minstd_rand0`: x <- 16807 * x mod (2^31 - 1).
#[derive(Clone, Debug)]
pub struct MinstdRand0 {
    x: u32,
}

impl MinstdRand0 {
    const MODULUS: u64 = 2_147_483_647;
    const MULTIPLIER: u64 = 16_807;
    /// `max() - min() + 1` of the engine.
    const RANGE: u32 = 2_147_483_646;

    /// Seeded as `engine.seed(s)`: s mod m, and 1 if that is 0.
    pub fn new(seed: u32) -> Self {
        let x = (u64::from(seed) % Self::MODULUS) as u32;
        MinstdRand0 { x: if x == 0 { 1 } else { x } }
    }

    /// The next engine output, in `[1, 2^31 - 2]`.
    pub fn next_u32(&mut self) -> u32 {
        self.x = (u64::from(self.x) * Self::MULTIPLIER % Self::MODULUS) as u32;
        self.x
    }

    /// `std::generate_canonical<float, 24>` as libstdc++ 12 computes it: one engine call (its
    /// range holds 30 bits), `(x - min) as f32 / (range rounded to float)`, clamped below 1.
    fn canonical_f32(&mut self) -> f32 {
        let sample = (self.next_u32() - 1) as f32;
        let range = Self::RANGE as f32; // (float)(long double)2147483646 == 2^31
        let r = sample / range;
        if r >= 1.0 {
            1.0_f32.next_down()
        } else {
            r
        }
    }
}

/// `--rng std_default` on a libstdc++ build of the reference.
#[derive(Clone, Debug)]
pub struct StdDefaultRng {
    engine: MinstdRand0,
}

impl StdDefaultRng {
    /// The reference seeds with `(unsigned int)seed`: only the low 32 bits count.
    pub fn new(seed: u64) -> Self {
        StdDefaultRng { engine: MinstdRand0::new(seed as u32) }
    }
}

impl NoiseRng for StdDefaultRng {
    fn randn(&mut self, n: usize) -> Vec<f32> {
        // A fresh normal_distribution per request: the cache starts empty every time.
        let mut out = Vec::with_capacity(n);
        let mut saved: Option<f32> = None;
        while out.len() < n {
            let value = match saved.take() {
                Some(v) => v,
                None => {
                    let (x, y, r2) = loop {
                        // `float(2.0) * u - 1.0`: the subtraction happens in double.
                        let x = (f64::from(2.0_f32 * self.engine.canonical_f32()) - 1.0) as f32;
                        let y = (f64::from(2.0_f32 * self.engine.canonical_f32()) - 1.0) as f32;
                        let r2 = x * x + y * y;
                        if !(r2 > 1.0 || r2 == 0.0) {
                            break (x, y, r2);
                        }
                    };
                    let mult = (-2.0_f32 * r2.ln() / r2).sqrt();
                    saved = Some(x * mult);
                    y * mult
                }
            };
            // `ret * stddev + mean` with stddev 1 and mean 0.
            out.push(value * 1.0 + 0.0);
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// torch CPU randn on mt19937 (`cpu`)

/// The 32-bit Mersenne Twister (MT19937) as in `std::mt19937` and torch's CPU generator.
#[derive(Clone)]
pub struct Mt19937 {
    state: Box<[u32; 624]>,
    index: usize,
}

impl fmt::Debug for Mt19937 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mt19937").field("index", &self.index).finish_non_exhaustive()
    }
}

impl Mt19937 {
    const N: usize = 624;
    const M: usize = 397;

    /// Seeded with Matsumoto-Nishimura's `init_genrand`.
    pub fn new(seed: u32) -> Self {
        let mut state = Box::new([0u32; 624]);
        state[0] = seed;
        for j in 1..Self::N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253_u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(j as u32);
        }
        Mt19937 { state, index: Self::N }
    }

    fn twist(&mut self) {
        for i in 0..Self::N {
            let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % Self::N] & 0x7fff_ffff);
            let mut v = self.state[(i + Self::M) % Self::N] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= 0x9908_b0df;
            }
            self.state[i] = v;
        }
        self.index = 0;
    }

    /// The next tempered output.
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= Self::N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }
}

/// `--rng cpu`: torch's CPU `randn` algorithm.
#[derive(Clone, Debug)]
pub struct TorchCpuRng {
    mt: Mt19937,
    next_gauss: Option<f64>,
}

impl TorchCpuRng {
    /// Seeded with the low 32 bits of `seed`, as torch's `manual_seed` on the CPU generator.
    pub fn new(seed: u64) -> Self {
        TorchCpuRng { mt: Mt19937::new(seed as u32), next_gauss: None }
    }

    /// A float in [0, 1) from the low 24 bits of one output.
    fn uniform_f32(&mut self) -> f32 {
        (self.mt.next_u32() & 0x00ff_ffff) as f32 * (1.0 / 16_777_216.0)
    }

    /// A double in [0, 1) from the low 53 bits of two outputs (high word first).
    fn uniform_f64(&mut self) -> f64 {
        let hi = u64::from(self.mt.next_u32());
        let lo = u64::from(self.mt.next_u32());
        let v = (hi << 32) | lo;
        (v & ((1u64 << 53) - 1)) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// torch's scalar normal: double Box-Muller, the sine branch cached for the next call.
    fn normal_f64(&mut self) -> f64 {
        if let Some(v) = self.next_gauss.take() {
            return v;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.next_gauss = Some(r * theta.sin() * 1.0 + 0.0);
        r * theta.cos() * 1.0 + 0.0
    }

    /// torch's `normal_fill_16`: 8 pairs of uniforms -> 16 normals, in place.
    fn fill_16(data: &mut [f32]) {
        const TWO_PI: f32 = 2.0_f32 * std::f32::consts::PI;
        for j in 0..8 {
            let u1 = 1.0_f32 - data[j];
            let u2 = data[j + 8];
            let r = (-2.0_f32 * u1.ln()).sqrt();
            let theta = TWO_PI * u2;
            data[j] = r * theta.cos() * 1.0 + 0.0;
            data[j + 8] = r * theta.sin() * 1.0 + 0.0;
        }
    }
}

impl NoiseRng for TorchCpuRng {
    fn randn(&mut self, n: usize) -> Vec<f32> {
        let mut data = vec![0.0_f32; n];
        if n >= 16 {
            for v in data.iter_mut() {
                *v = self.uniform_f32();
            }
            let mut i = 0;
            while i + 16 <= n {
                Self::fill_16(&mut data[i..i + 16]);
                i += 16;
            }
            if !n.is_multiple_of(16) {
                // torch redraws the last 16 values (overlapping the last full block).
                let tail = &mut data[n - 16..];
                for v in tail.iter_mut() {
                    *v = self.uniform_f32();
                }
                Self::fill_16(tail);
            }
        } else {
            for v in data.iter_mut() {
                *v = self.normal_f64() as f32;
            }
        }
        data
    }
}
