//! Tests of the sampling module against independent truth: the reference's own code and libstdc++.
//!
//! `testdata/reference.txt` was printed by `testdata/gen_reference.cpp`, which compiles the
//! reference's headers (Philox, torch-CPU RNG, schedulers, samplers, scalings) unchanged;
//! `testdata/std_rng.txt` by `testdata/gen_std_rng.cpp` with libstdc++'s own engines and
//! `normal_distribution<float>`. Other tests check formulas computed independently in f64 and
//! analytic properties (convergence to a fixed target, call and noise-draw counts).
//!
//! On Linux with glibc the comparisons with the generated files are bit-exact: the reference
//! build and ours call the same libm. Elsewhere libm may round differently, so a few ulps are
//! allowed there.

use std::collections::HashMap;

use super::rng::{philox4x32_10, philox_box_muller, MinstdRand0, Mt19937};
use super::*;

const REFERENCE: &str = include_str!("testdata/reference.txt");
const STD_RNG: &str = include_str!("testdata/std_rng.txt");

/// Bit-exact where the libm is the one the data was generated with.
const MAX_ULPS: u32 = if cfg!(all(target_os = "linux", target_env = "gnu")) { 0 } else { 4 };

/// `head: v0 v1 ...` lines of a data file, by head.
fn table(text: &str) -> HashMap<String, Vec<String>> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (head, values) = l.split_once(':').expect("data line without ':'");
            (head.trim().to_owned(), values.split_whitespace().map(str::to_owned).collect())
        })
        .collect()
}

fn floats(t: &HashMap<String, Vec<String>>, head: &str) -> Vec<f32> {
    t.get(head)
        .unwrap_or_else(|| panic!("no line '{head}' in test data"))
        .iter()
        .map(|v| v.parse::<f32>().unwrap_or_else(|e| panic!("'{v}' in '{head}': {e}")))
        .collect()
}

fn ints(t: &HashMap<String, Vec<String>>, head: &str) -> Vec<u64> {
    t.get(head)
        .unwrap_or_else(|| panic!("no line '{head}' in test data"))
        .iter()
        .map(|v| v.parse::<u64>().unwrap())
        .collect()
}

fn reference() -> HashMap<String, Vec<String>> {
    table(REFERENCE)
}

fn ulps(a: f32, b: f32) -> u32 {
    if a == b || (a.is_nan() && b.is_nan()) {
        return 0;
    }
    if a.is_sign_negative() != b.is_sign_negative() {
        return u32::MAX;
    }
    a.to_bits().abs_diff(b.to_bits())
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], max_ulps: u32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = ulps(g, w);
        assert!(d <= max_ulps, "{what}[{i}]: got {g:e}, reference {w:e} ({d} ulps apart)");
    }
}

#[track_caller]
fn assert_rel(what: &str, got: f64, want: f64, rel: f64) {
    assert!(
        (got - want).abs() <= rel * want.abs().max(1e-30),
        "{what}: got {got:e}, expected {want:e} (relative tolerance {rel:e})"
    );
}

// ---------------------------------------------------------------------------------------------
// Philox (`cuda`)

/// Random123's published known-answer tests for philox4x32_10 (kat_vectors).
#[test]
fn philox_block_matches_random123_known_answers() {
    let cases: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        ([0, 0, 0, 0], [0, 0], [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
        (
            [0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff],
            [0xffffffff, 0xffffffff],
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
        ),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];
    for (ctr, key, want) in cases {
        assert_eq!(philox4x32_10(ctr, key), want, "counter {ctr:08x?} key {key:08x?}");
    }
}

/// The normal transform against the Box-Muller formula evaluated independently in f64.
#[test]
fn philox_box_muller_is_the_sine_branch_of_box_muller() {
    for (a, b) in [(0u32, 0u32), (1, 2), (0x8000_0000, 0x4000_0000), (123_456_789, 987_654_321), (0xffff_0000, 7)] {
        let (x, y) = (a as f32, b as f32);
        let u = (f64::from(x) + 0.5) / 4_294_967_296.0;
        let v = (f64::from(y) + 0.5) / 4_294_967_296.0 * std::f64::consts::TAU;
        let want = (-2.0 * u.ln()).sqrt() * v.sin();
        // Float uniforms and a float radius: a few float roundings from the exact value.
        let got = f64::from(philox_box_muller(x, y));
        assert!((got - want).abs() <= 2e-6 * want.abs().max(1.0), "({a}, {b}): got {got}, expected {want}");
    }
    // u32::MAX converts to 2^32 in float, so the float uniform rounds to exactly 1: radius 0.
    assert_eq!(philox_box_muller(u32::MAX as f32, 12_345.0), 0.0);
}

/// Request `r` of a generator uses counter `[r, 0, i, 0]` and the seed as the key, low word first.
#[test]
fn philox_counter_and_key_layout() {
    let seed: u64 = 0x0123_4567_89ab_cdef;
    let mut rng = PhiloxRng::new(seed);
    let _ = rng.randn(3);
    let second = rng.randn(4);
    for (i, &v) in second.iter().enumerate() {
        let g = philox4x32_10([1, 0, i as u32, 0], [0x89ab_cdef, 0x0123_4567]);
        assert_eq!(v.to_bits(), philox_box_muller(g[0] as f32, g[1] as f32).to_bits(), "element {i}");
    }
}

#[test]
fn philox_noise_matches_reference() {
    let t = reference();
    for seed in [0u64, 42, 1_234_567_890_123] {
        let mut rng = RngKind::Cuda.seeded(seed);
        for (r, n) in [(0, 8), (1, 5), (2, 16)] {
            let head = format!("philox {seed} {r} {n}");
            assert_close(&head, &rng.randn(n), &floats(&t, &head), MAX_ULPS);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// libstdc++ (`std_default`) and mt19937 (`cpu`)

#[test]
fn minstd_engine_matches_libstdcxx() {
    let t = table(STD_RNG);
    for seed in [0u64, 1, 42, 2_147_483_647, 4_294_967_295, 4_294_967_338] {
        let mut e = MinstdRand0::new(seed as u32);
        let got: Vec<u64> = (0..8).map(|_| u64::from(e.next_u32())).collect();
        assert_eq!(got, ints(&t, &format!("engine {seed}")), "seed {seed}");
    }
}

#[test]
fn std_default_noise_matches_libstdcxx() {
    let t = table(STD_RNG);
    let cases: [(u64, &[usize]); 5] =
        [(0, &[16]), (42, &[16, 7, 9]), (1, &[1, 1, 3]), (12345, &[64]), (4_294_967_338, &[10])];
    for (seed, sizes) in cases {
        let mut rng = RngKind::StdDefault.seeded(seed);
        for (r, &n) in sizes.iter().enumerate() {
            let head = format!("normal {seed} {r} {n}");
            assert_close(&head, &rng.randn(n), &floats(&t, &head), MAX_ULPS);
        }
    }
}

/// An odd-sized request drops the cached second value: the next request starts on a new pair.
#[test]
fn std_default_drops_the_cached_value_between_requests() {
    let mut a = StdDefaultRng::new(1);
    let one = a.randn(1);
    let next = a.randn(1);
    let mut b = StdDefaultRng::new(1);
    let pair = b.randn(2);
    assert_eq!(one[0], pair[0]);
    assert_ne!(next[0], pair[1], "the second request must not reuse the cached value");
}

#[test]
fn mt19937_matches_libstdcxx() {
    let t = table(STD_RNG);
    for seed in [0u64, 42, 4_294_967_295] {
        let mut mt = Mt19937::new(seed as u32);
        let mut got: Vec<u64> = (0..8).map(|_| u64::from(mt.next_u32())).collect();
        for _ in 8..624 {
            mt.next_u32();
        }
        got.extend((0..4).map(|_| u64::from(mt.next_u32())));
        assert_eq!(got, ints(&t, &format!("mt19937 {seed}")), "seed {seed}");
    }
}

#[test]
fn torch_cpu_noise_matches_reference() {
    let t = reference();
    for seed in [0u64, 42] {
        let mut rng = RngKind::Cpu.seeded(seed);
        for (r, n) in [(0, 5), (1, 3), (2, 16), (3, 37), (4, 1)] {
            let head = format!("cpu {seed} {r} {n}");
            assert_close(&head, &rng.randn(n), &floats(&t, &head), MAX_ULPS);
        }
    }
}

#[test]
fn noise_is_roughly_standard_normal() {
    for kind in RngKind::ALL {
        let v = kind.seeded(7).randn(20_000);
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.03, "{kind}: mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "{kind}: variance {var}");
    }
}

// ---------------------------------------------------------------------------------------------
// Schedule

/// SD's sigmas computed independently in f64 from the scaled-linear betas.
fn sd_sigmas_f64() -> Vec<f64> {
    let (a, b) = (0.00085_f64.sqrt(), 0.012_f64.sqrt());
    let mut prod = 1.0;
    (0..1000)
        .map(|i| {
            let beta = (a + (b - a) * i as f64 / 999.0).powi(2);
            prod *= 1.0 - beta;
            ((1.0 - prod) / prod).sqrt()
        })
        .collect()
}

#[test]
fn sigma_table_matches_reference_and_formula() {
    let s = DiscreteSchedule::sd();
    assert_close("sigma_table", s.sigmas(), &floats(&reference(), "sigma_table"), MAX_ULPS);
    let exact = sd_sigmas_f64();
    // The float running product drifts a little from the f64 one over 1000 factors.
    for i in [0, 1, 500, 998, 999] {
        assert_rel(&format!("sigma[{i}]"), f64::from(s.sigmas()[i]), exact[i], 1e-4);
    }
    assert_rel("sigma_min", f64::from(s.sigma_min()), 0.029_167_5, 1e-4);
    assert_rel("sigma_max", f64::from(s.sigma_max()), 14.614_6, 1e-4);
}

#[test]
fn checkpoint_alphas_cumprod_is_validated() {
    let good = scaled_linear_alphas_cumprod(0.00085, 0.012);
    let from_file = DiscreteSchedule::from_alphas_cumprod(&good).unwrap();
    assert_eq!(from_file.sigmas(), DiscreteSchedule::sd().sigmas());
    assert!(matches!(DiscreteSchedule::from_alphas_cumprod(&good[..999]), Err(SamplingError::InvalidAlphasCumprod(_))));
    let mut bad = good.clone();
    bad[10] = 1.0;
    let err = DiscreteSchedule::from_alphas_cumprod(&bad).unwrap_err().to_string();
    assert!(err.contains("index 10"), "{err}");
    bad[10] = f32::NAN;
    assert!(DiscreteSchedule::from_alphas_cumprod(&bad).is_err());
}

#[test]
fn sigma_timestep_conversions_match_reference() {
    let t = reference();
    let s = DiscreteSchedule::sd();
    let got: Vec<f32> = floats(&t, "sigma_to_t_in").iter().map(|&x| s.sigma_to_t(x)).collect();
    assert_close("sigma_to_t", &got, &floats(&t, "sigma_to_t_out"), MAX_ULPS);
    let got: Vec<f32> = floats(&t, "t_to_sigma_in").iter().map(|&x| s.t_to_sigma(x)).collect();
    assert_close("t_to_sigma", &got, &floats(&t, "t_to_sigma_out"), MAX_ULPS);
}

/// t -> sigma -> t returns the timestep (log-linear interpolation is invertible inside the table),
/// and integer timesteps land on table entries.
#[test]
fn sigma_timestep_round_trip() {
    let s = DiscreteSchedule::sd();
    for t in [0.0_f32, 0.25, 1.0, 17.5, 250.0, 640.75, 998.5, 999.0] {
        let back = s.sigma_to_t(s.t_to_sigma(t));
        assert!((back - t).abs() < 2e-3, "t {t} -> {back}");
    }
    for i in [0usize, 3, 500, 999] {
        let sigma = s.t_to_sigma(i as f32);
        assert_rel(&format!("t_to_sigma({i})"), f64::from(sigma), f64::from(s.sigmas()[i]), 2e-7);
    }
    assert_eq!(s.sigma_to_t(1e-3), 0.0, "below the table clamps to 0");
    assert_eq!(s.sigma_to_t(100.0), 999.0, "above the table clamps to 999");
}

#[test]
fn schedulers_match_reference() {
    let t = reference();
    let s = DiscreteSchedule::sd();
    let mut checked = 0;
    for sched in Scheduler::ALL {
        for n in [1usize, 2, 3, 4, 7, 10, 20, 22, 25, 43, 50, 1000] {
            let head = format!("schedule {} {n}", sched.name());
            if !t.contains_key(&head) {
                continue;
            }
            assert_close(&head, &sched.sigmas(n, &s).unwrap(), &floats(&t, &head), MAX_ULPS);
            checked += 1;
        }
    }
    assert!(checked >= 120, "only {checked} schedules compared");
    for seq in [64usize, 256, 1024] {
        for n in [1usize, 2, 3, 4, 10] {
            let head = format!("schedule ltx2@{seq} {n}");
            let ctx = ScheduleContext { ays: AysLevels::Table(&AYS_SD15), image_seq_len: seq };
            assert_close(&head, &Scheduler::Ltx2.sigmas_for(n, &s, &ctx).unwrap(), &floats(&t, &head), MAX_ULPS);
        }
    }
}

#[test]
fn ays_uses_the_sdxl_noise_levels_for_sdxl() {
    // At 10 steps AYS is its table with the last level set to 0 (NVIDIA's SDXL table).
    let s = DiscreteSchedule::sd();
    let xl = ScheduleContext { ays: AysLevels::Table(&AYS_SDXL), image_seq_len: 64 };
    let sig = Scheduler::Ays.sigmas_for(10, &s, &xl).unwrap();
    assert_eq!(sig.len(), 11);
    assert_eq!((sig[1], sig[9], sig[10]), (6.318_448_5, 0.111_418_82, 0.0));
    let sd1 = ScheduleContext { ays: AysLevels::Table(&AYS_SD15), image_seq_len: 64 };
    assert_ne!(Scheduler::Ays.sigmas_for(10, &s, &sd1).unwrap()[1], sig[1]);
    // Other step counts interpolate the same table: descending to 0 from its first level.
    let sig = Scheduler::Ays.sigmas_for(4, &s, &xl).unwrap();
    assert_eq!(sig.len(), 5);
    assert!(sig.windows(2).all(|w| w[0] > w[1]) && (sig[0] - 14.614641).abs() < 1e-4 && sig[4] == 0.0, "{sig:?}");
}

#[test]
fn every_schedule_descends_to_zero() {
    let s = DiscreteSchedule::sd();
    for sched in Scheduler::ALL {
        for n in [1usize, 2, 5, 30] {
            if sched == Scheduler::Gits && n == 1 {
                continue; // an error, see `schedulers_reject_what_the_reference_cannot_compute`
            }
            let sig = sched.sigmas(n, &s).unwrap();
            assert_eq!(sig.len(), n + 1, "{sched} {n}");
            assert_eq!(*sig.last().unwrap(), 0.0, "{sched} {n}");
            assert!(sig.windows(2).all(|w| w[0] > w[1]), "{sched} {n}: {sig:?}");
            assert!(sig[0] <= s.sigma_max() * 1.000_01, "{sched} {n}: starts above sigma_max");
        }
    }
}

/// Where the reference reads outside its tables (GITS row `n - 2` for one step, AYS's levels on
/// SD 2.x, which it has none of), we return an error naming the scheduler.
#[test]
fn schedulers_reject_what_the_reference_cannot_compute() {
    let s = DiscreteSchedule::sd();
    let err = Scheduler::Gits.sigmas(1, &s).unwrap_err().to_string();
    assert!(err.contains("scheduler gits") && err.contains("2 steps"), "{err}");
    let sd2 = ScheduleContext { ays: AysLevels::Unpublished("SD 2.x"), image_seq_len: 64 };
    let err = Scheduler::Ays.sigmas_for(10, &s, &sd2).unwrap_err().to_string();
    assert!(err.contains("scheduler ays") && err.contains("SD 2"), "{err}");
    // Everything else works on SD 2.x.
    for sched in Scheduler::ALL.into_iter().filter(|&k| k != Scheduler::Ays) {
        assert_eq!(sched.sigmas_for(4, &s, &sd2).unwrap().len(), 5, "{sched}");
    }
}

/// AYS with 10 steps is NVIDIA's published SD 1.5 table itself; the LTX-2 schedule without
/// stretching would be `e^s / (e^s + 1/t - 1)`, and its stretched second-to-last sigma is the
/// terminal 0.1.
#[test]
fn ays_and_ltx2_by_hand() {
    let s = DiscreteSchedule::sd();
    let ays = Scheduler::Ays.sigmas(10, &s).unwrap();
    assert_eq!(ays[0], 14.614_641);
    assert_eq!(ays[5], 1.394_380_5);
    assert_eq!(ays[10], 0.0);
    for seq in [64usize, 4096] {
        let ctx = ScheduleContext { ays: AysLevels::Table(&AYS_SD15), image_seq_len: seq };
        let l = Scheduler::Ltx2.sigmas_for(4, &s, &ctx).unwrap();
        assert_eq!(l[0], 1.0, "ltx2 starts at 1");
        assert!((l[3] - 0.1).abs() < 1e-6, "ltx2 {seq}: {l:?}");
        assert!(l.windows(2).all(|w| w[0] > w[1]), "{l:?}");
    }
    // More tokens shift the schedule up (more time at high noise).
    let small = Scheduler::Ltx2.sigmas_for(4, &s, &ScheduleContext { image_seq_len: 64, ..Default::default() });
    let large = Scheduler::Ltx2.sigmas_for(4, &s, &ScheduleContext { image_seq_len: 4096, ..Default::default() });
    assert!(small.unwrap()[1] < large.unwrap()[1]);
}

/// Karras et al. 2022 eq. 5 for 4 steps, evaluated by hand in f64.
#[test]
fn karras_by_hand() {
    let s = DiscreteSchedule::sd();
    let (smin, smax) = (f64::from(s.sigma_min()), f64::from(s.sigma_max()));
    let (a, b) = (smax.powf(1.0 / 7.0), smin.powf(1.0 / 7.0));
    let want: Vec<f64> = (0..4).map(|i| (a + i as f64 / 3.0 * (b - a)).powi(7)).collect();
    let got = Scheduler::Karras.sigmas(4, &s).unwrap();
    for i in 0..4 {
        assert_rel(&format!("karras[{i}]"), f64::from(got[i]), want[i], 1e-5);
    }
    assert_eq!(got[4], 0.0);
}

/// Discrete with 4 steps uses timesteps 999, 666, 333, 0: the table's own sigmas there.
#[test]
fn discrete_by_hand() {
    let exact = sd_sigmas_f64();
    let got = Scheduler::Discrete.sigmas(4, &DiscreteSchedule::sd()).unwrap();
    for (i, t) in [999usize, 666, 333, 0].into_iter().enumerate() {
        assert_rel(&format!("discrete[{i}] (t = {t})"), f64::from(got[i]), exact[t], 1e-4);
    }
    assert_eq!(got[4], 0.0);
    // Exponential: log-evenly spaced between the ends.
    let e = Scheduler::Exponential.sigmas(3, &DiscreteSchedule::sd()).unwrap();
    assert_rel("exponential middle", f64::from(e[1]), (exact[0] * exact[999]).sqrt(), 1e-5);
    // Simple with 4 steps: timesteps 999, 749, 499, 249.
    let simple = Scheduler::Simple.sigmas(4, &DiscreteSchedule::sd()).unwrap();
    for (i, t) in [999usize, 749, 499, 249].into_iter().enumerate() {
        assert_rel(&format!("simple[{i}] (t = {t})"), f64::from(simple[i]), exact[t], 1e-4);
    }
    // LCM with 4 steps: timesteps 999, 759, 499, 259 ((50 - floor(50 i / 4)) * 20 - 1).
    let lcm = Scheduler::Lcm.sigmas(4, &DiscreteSchedule::sd()).unwrap();
    for (i, t) in [999usize, 759, 499, 259].into_iter().enumerate() {
        assert_rel(&format!("lcm[{i}] (t = {t})"), f64::from(lcm[i]), exact[t], 1e-4);
    }
}

/// With 22 steps the discrete scheduler's last timestep is -6.1e-5 in float; the reference then
/// interpolates towards the float stored before its log-sigma table (sigma_max), giving
/// 0.0291999 instead of sigma_min. We reproduce that value.
#[test]
fn discrete_22_steps_reproduces_the_reference_edge_value() {
    let sig = Scheduler::Discrete.sigmas(22, &DiscreteSchedule::sd()).unwrap();
    assert_eq!(sig[21], 0.029_199_863);
    assert_ne!(sig[21], DiscreteSchedule::sd().sigma_min());
}

#[test]
fn single_step_karras_and_exponential_start_at_sigma_max() {
    let s = DiscreteSchedule::sd();
    for sched in [Scheduler::Karras, Scheduler::Exponential] {
        let sig = sched.sigmas(1, &s).unwrap();
        assert_eq!(sig.len(), 2);
        assert_rel(&format!("{sched}"), f64::from(sig[0]), f64::from(s.sigma_max()), 1e-6);
        assert_eq!(sig[1], 0.0);
    }
}

#[test]
fn zero_steps_is_an_error() {
    let err = Scheduler::Discrete.sigmas(0, &DiscreteSchedule::sd()).unwrap_err();
    assert!(matches!(err, SamplingError::ZeroSteps));
    assert!(err.to_string().contains("must be at least 1, got 0"));
}

#[test]
fn img2img_strength_selects_the_schedule_tail() {
    let sigmas: Vec<f32> = (0..=10).rev().map(|v| v as f32).collect(); // 10 steps: 10, 9, ..., 0
                                                                       // strength 0.75: t_enc = floor(7.5) = 7; start at index 10 - 7 - 1 = 2, so 8 steps.
    assert_eq!(img2img_sigmas(&sigmas, 0.75).unwrap(), &sigmas[2..]);
    assert_eq!(img2img_sigmas(&sigmas, 1.0).unwrap(), sigmas);
    // strength 0: t_enc = 0, one step from the lowest non-zero sigma.
    assert_eq!(img2img_sigmas(&sigmas, 0.0).unwrap(), vec![1.0, 0.0]);
    // t_enc may not reach the step count (0.99999994 * 10 rounds to 9.9999995, floor 9).
    assert_eq!(img2img_sigmas(&sigmas, 0.999_999_94).unwrap(), &sigmas[0..]);
    // 20 steps at 0.5: t_enc 10, start at 9, 11 steps.
    let twenty: Vec<f32> = (0..=20).rev().map(|v| v as f32).collect();
    assert_eq!(img2img_sigmas(&twenty, 0.5).unwrap().len(), 12);
    for bad in [-0.1_f32, 1.5, f32::NAN] {
        let err = img2img_sigmas(&sigmas, bad).unwrap_err();
        assert!(err.to_string().contains("strength must be between 0 and 1"), "{err}");
    }
    assert!(img2img_sigmas(&[1.0], 0.5).is_err());
}

#[test]
fn initial_latents() {
    let noise = [1.0_f32, -2.0, -0.0];
    assert_eq!(txt2img_latent(&noise, 3.0), vec![3.0, -6.0, 0.0]);
    assert!(txt2img_latent(&noise, 3.0)[2].is_sign_positive(), "0 + (-0) is +0 as in the reference");
    assert_eq!(noised_latent(&[0.5, 0.5, 0.5], &noise, 2.0).unwrap(), vec![2.5, -3.5, 0.5]);
    assert!(matches!(
        noised_latent(&[0.0; 2], &noise, 1.0),
        Err(SamplingError::LengthMismatch { expected: 2, got: 3, .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Denoiser

#[test]
fn scalings_match_reference() {
    let t = reference();
    for &sigma in &floats(&t, "sigma_to_t_in") {
        let head = format!("scalings {}", format_g9(sigma));
        let want = floats(&t, &head);
        let e = Prediction::Eps.scalings(sigma);
        let v = Prediction::V.scalings(sigma);
        assert_close(&head, &[e.c_skip, e.c_out, e.c_in, v.c_skip, v.c_out, v.c_in], &want, MAX_ULPS);
    }
}

/// Independent closed forms: eps (1, -s, 1/sqrt(s^2+1)), v (1/(s^2+1), -s/sqrt(s^2+1), same c_in).
#[test]
fn scalings_closed_form() {
    for sigma in [0.03_f32, 1.0, 14.6] {
        let s = f64::from(sigma);
        let r = (s * s + 1.0).sqrt();
        let e = Prediction::Eps.scalings(sigma);
        assert_eq!((e.c_skip, e.c_out), (1.0, -sigma));
        assert_rel("eps c_in", f64::from(e.c_in), 1.0 / r, 1e-6);
        let v = Prediction::V.scalings(sigma);
        assert_rel("v c_skip", f64::from(v.c_skip), 1.0 / (s * s + 1.0), 1e-6);
        assert_rel("v c_out", f64::from(v.c_out), -s / r, 1e-6);
        assert_rel("v c_in", f64::from(v.c_in), 1.0 / r, 1e-6);
    }
}

/// `%.9g` as the C++ generator printed the sigma in the line head.
fn format_g9(v: f32) -> String {
    let t = reference();
    t.keys()
        .filter_map(|k| k.strip_prefix("scalings "))
        .find(|s| s.parse::<f32>().ok() == Some(v))
        .unwrap_or_else(|| panic!("no scalings line for {v}"))
        .to_owned()
}

#[test]
fn guided_denoiser_matches_reference_composition() {
    let t = reference();
    let schedule = DiscreteSchedule::sd();
    for prediction in Prediction::ALL {
        for cfg in [1.0_f32, 7.0] {
            let sigma = 3.7_f32;
            let x: Vec<f32> = PhiloxRng::new(5).randn(12).iter().map(|v| v * 2.0).collect();
            let mut asked_uncond = None;
            let mut den = GuidedDenoiser::new(&schedule, prediction, cfg, |m: ModelInput<'_>| {
                asked_uncond = Some(m.uncond);
                let t = m.timestep;
                let cond = m.x.iter().enumerate().map(|(i, &v)| 0.3 * v + 0.001 * t * (i + 1) as f32).collect();
                let uncond = m.x.iter().enumerate().map(|(i, &v)| 0.2 * v - 0.01 * i as f32).collect();
                Ok::<_, SamplingError>(ModelOutput {
                    cond,
                    uncond: m.uncond.then_some(uncond),
                    skipped: None,
                    img_uncond: None,
                })
            });
            let step = Step { index: 0, count: 1, last_eval: true, leading: false };
            let got = den.denoise(&x, sigma, step).unwrap();
            assert_eq!(asked_uncond, Some(cfg != 1.0));
            let head = t
                .keys()
                .find(|k| k.starts_with(&format!("guided {} {} ", prediction.name(), cfg)))
                .expect("guided line")
                .clone();
            let want_t: f32 = head.split_whitespace().nth(4).unwrap().parse().unwrap();
            assert_eq!(schedule.sigma_to_t(sigma).to_bits(), want_t.to_bits(), "{head}: timestep");
            assert_close(&head, &got, &floats(&t, &head), MAX_ULPS);
        }
    }
}

#[test]
fn guided_denoiser_rejects_missing_uncond_and_wrong_lengths() {
    let schedule = DiscreteSchedule::sd();
    let step = Step { index: 0, count: 1, last_eval: true, leading: false };
    let mut no_uncond = GuidedDenoiser::new(&schedule, Prediction::Eps, 5.0, |m: ModelInput<'_>| {
        Ok::<_, SamplingError>(ModelOutput { cond: m.x.to_vec(), uncond: None, skipped: None, img_uncond: None })
    });
    assert!(matches!(no_uncond.denoise(&[1.0, 2.0], 1.0, step), Err(SamplingError::MissingUncond)));
    let mut short = GuidedDenoiser::new(&schedule, Prediction::V, 1.0, |_: ModelInput<'_>| {
        Ok::<_, SamplingError>(ModelOutput { cond: vec![0.0], uncond: None, skipped: None, img_uncond: None })
    });
    assert!(matches!(short.denoise(&[1.0, 2.0], 1.0, step), Err(SamplingError::LengthMismatch { got: 1, .. })));
}

/// A model that predicts the true noise makes the eps denoiser return the clean latent.
#[test]
fn eps_denoiser_recovers_the_clean_latent_from_the_true_noise() {
    let schedule = DiscreteSchedule::sd();
    let clean = [0.5_f32, -1.0, 2.0];
    let noise = [1.0_f32, 0.25, -0.5];
    let sigma = 2.0_f32;
    let x: Vec<f32> = clean.iter().zip(&noise).map(|(c, n)| c + n * sigma).collect();
    let mut den = GuidedDenoiser::new(&schedule, Prediction::Eps, 1.0, |_: ModelInput<'_>| {
        Ok::<_, SamplingError>(ModelOutput { cond: noise.to_vec(), uncond: None, skipped: None, img_uncond: None })
    });
    let got = den.denoise(&x, sigma, Step { index: 0, count: 1, last_eval: true, leading: false }).unwrap();
    for (g, c) in got.iter().zip(&clean) {
        assert!((g - c).abs() < 1e-6, "{got:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Samplers

/// The generator's analytic denoiser: pulls x towards a fixed target, more strongly at low sigma.
fn analytic_denoise(x: &[f32], sigma: f32) -> Vec<f32> {
    let a = 0.5 * sigma / (sigma + 1.0);
    let b = 1.0 - a;
    x.iter().enumerate().map(|(i, &v)| v * a + (0.25 * (i % 5) as f32 - 0.5) * b).collect()
}

/// The generator's unconditional estimate for the CFG++ samplers.
fn analytic_denoise_uncond(x: &[f32], sigma: f32) -> Vec<f32> {
    let a = 0.7 * sigma / (sigma + 1.0);
    let b = 1.0 - a;
    x.iter().enumerate().map(|(i, &v)| v * a + (0.25 * (i % 5) as f32 - 0.5 + 0.125) * b).collect()
}

#[test]
fn samplers_match_reference() {
    let t = reference();
    let s = DiscreteSchedule::sd();
    let methods = [
        ("euler", SampleMethod::Euler, 0.0),
        ("euler_a", SampleMethod::EulerA, 1.0),
        ("euler_a_eta0", SampleMethod::EulerA, 0.0),
        ("euler_a_eta05", SampleMethod::EulerA, 0.5),
        ("heun", SampleMethod::Heun, 0.0),
        ("dpm2", SampleMethod::Dpm2, 0.0),
        ("dpm++2s_a", SampleMethod::DpmPp2sA, 1.0),
        ("dpm++2s_a_eta0", SampleMethod::DpmPp2sA, 0.0),
        ("dpm++2m", SampleMethod::DpmPp2m, 0.0),
        ("lcm", SampleMethod::Lcm, 0.0),
        ("dpm++2mv2", SampleMethod::DpmPp2mV2, 0.0),
        ("ipndm", SampleMethod::Ipndm, 0.0),
        ("ipndm_v", SampleMethod::IpndmV, 0.0),
        ("ddim_trailing", SampleMethod::DdimTrailing, 0.0),
        ("tcd", SampleMethod::Tcd, 0.0),
        ("tcd_eta03", SampleMethod::Tcd, 0.3),
        ("res_multistep", SampleMethod::ResMultistep, 0.0),
        ("res_multistep_eta1", SampleMethod::ResMultistep, 1.0),
        ("res_2s", SampleMethod::Res2s, 0.0),
        ("res_2s_eta1", SampleMethod::Res2s, 1.0),
        ("er_sde", SampleMethod::ErSde, 1.0),
        ("er_sde_eta0", SampleMethod::ErSde, 0.0),
        ("euler_cfg_pp", SampleMethod::EulerCfgPp, 0.0),
        ("euler_a_cfg_pp", SampleMethod::EulerACfgPp, 1.0),
        ("euler_ge", SampleMethod::EulerGe, 0.0),
        ("euler_ge_eta1", SampleMethod::EulerGe, 1.0),
    ];
    for m in SampleMethod::ALL {
        assert!(methods.iter().any(|c| c.1 == m), "{m} is not compared with the reference");
    }
    let runs = [(Scheduler::Discrete, 4, 42u64, 16usize), (Scheduler::Karras, 6, 7, 13), (Scheduler::Lcm, 3, 1, 16)];
    for (label, method, eta) in methods {
        for (sched, steps, seed, numel) in runs {
            let tail = format!("{label} {} {steps} {seed} {numel}", sched.name());
            let sigmas = sched.sigmas(steps, &s).unwrap();
            let mut rng = RngKind::Cuda.seeded(seed);
            let x = noised_latent(&vec![0.0; numel], &rng.randn(numel), sigmas[0]).unwrap();
            let mut calls: Vec<(f32, Step)> = Vec::new();
            let mut den = |x: &[f32], sigma: f32, step: Step| {
                calls.push((sigma, step));
                let uncond = method.needs_uncond_denoised().then(|| analytic_denoise_uncond(x, sigma));
                Ok::<_, SamplingError>(Denoised { pred: analytic_denoise(x, sigma), uncond })
            };
            let out = sample(method, &mut den, x, &sigmas, rng.as_mut(), eta).unwrap();
            assert_close(&format!("sample {tail}"), &out, &floats(&t, &format!("sample {tail}")), MAX_ULPS);
            let got_sigmas: Vec<f32> = calls.iter().map(|c| c.0).collect();
            assert_close(&format!("calls {tail}"), &got_sigmas, &floats(&t, &format!("calls {tail}")), MAX_ULPS);
            // The reference numbers steps from 1 and negates the number on a step's first of two
            // evaluations (and on the single evaluation of a second-order sampler's last step).
            let ref_steps = floats(&t, &format!("steps {tail}"));
            for (k, ((_, step), &r)) in calls.iter().zip(&ref_steps).enumerate() {
                assert_eq!(step.index + 1, r.abs() as usize, "steps {tail}: call {k}");
                assert_eq!(step.count, steps, "steps {tail}: call {k}");
                if r > 0.0 {
                    assert!(step.last_eval, "steps {tail}: call {k} completes its step");
                } else if k + 1 < calls.len() {
                    assert!(!step.last_eval, "steps {tail}: call {k} is followed by a second evaluation");
                }
            }
            assert!(calls.last().unwrap().1.last_eval, "steps {tail}: the final call completes the run");
        }
    }
}

/// Counts the sampler's noise draws.
struct CountingRng {
    inner: PhiloxRng,
    draws: usize,
}

impl NoiseRng for CountingRng {
    fn randn(&mut self, n: usize) -> Vec<f32> {
        self.draws += 1;
        self.inner.randn(n)
    }
}

/// With a denoiser that always returns the same target, every sampler must end on that target
/// (the last step to sigma 0 lands on the denoised estimate), with a known number of model calls
/// and noise draws.
#[test]
fn samplers_converge_to_a_fixed_target_with_expected_call_counts() {
    let s = DiscreteSchedule::sd();
    let target: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.3).collect();
    for steps in [1usize, 2, 5, 12] {
        let sigmas = Scheduler::Karras.sigmas(steps, &s).unwrap();
        for method in SampleMethod::ALL {
            let mut rng = CountingRng { inner: PhiloxRng::new(3), draws: 0 };
            let x = txt2img_latent(&rng.randn(target.len()), sigmas[0]);
            rng.draws = 0;
            let mut calls = 0;
            let mut den = |x: &[f32], _sigma: f32, _step: Step| {
                assert_eq!(x.len(), target.len());
                calls += 1;
                Ok::<_, SamplingError>(target.clone())
            };
            let out = sample(method, &mut den, x, &sigmas, &mut rng, method.default_eta()).unwrap();
            // TCD's last step lands on timestep 0's alpha, not on the clean latent (see
            // `tcd_single_step_by_hand`).
            if method != SampleMethod::Tcd {
                for (o, t) in out.iter().zip(&target) {
                    assert!((o - t).abs() < 1e-5, "{method} {steps} steps: {out:?}");
                }
            }
            let two_evals = matches!(
                method,
                SampleMethod::Heun | SampleMethod::Dpm2 | SampleMethod::DpmPp2sA | SampleMethod::Res2s
            );
            let want_calls = if two_evals { 2 * steps - 1 } else { steps };
            assert_eq!(calls, want_calls, "{method} {steps} steps: model calls");
            let want_draws = if method.is_stochastic() { steps - 1 } else { 0 };
            assert_eq!(rng.draws, want_draws, "{method} {steps} steps: noise draws");
        }
    }
}

/// TCD's one step to sigma 0 with eta 0: timestep 0, so `x = sqrt(a0) D + sqrt(1 - a0) (x - D) / sigma`
/// with `a0 = 1 - beta_0 = 1 - 0.00085`; starting from `D + sigma z` that is `sqrt(a0) D + sqrt(1 - a0) z`.
#[test]
fn tcd_single_step_by_hand() {
    let target = [0.5_f32, -1.0, 2.0];
    let z = [1.0_f32, -0.5, 0.25];
    let sigma = 3.0_f32;
    let x: Vec<f32> = target.iter().zip(&z).map(|(t, z)| t + sigma * z).collect();
    let mut den = |_: &[f32], _: f32, _: Step| Ok::<_, SamplingError>(target.to_vec());
    let out = sample(SampleMethod::Tcd, &mut den, x, &[sigma, 0.0], &mut PhiloxRng::new(0), 0.0).unwrap();
    let a0 = 1.0 - 0.00085_f64;
    for i in 0..3 {
        let want = a0.sqrt() * f64::from(target[i]) + (1.0 - a0).sqrt() * f64::from(z[i]);
        assert!((f64::from(out[i]) - want).abs() < 1e-5, "tcd[{i}]: got {}, expected {want}", out[i]);
    }
}

/// iPNDM on a linear-in-sigma trajectory (constant derivative) is exact, like Euler, at every
/// order: the Adams-Bashforth weights sum to 1. RES multistep and Euler GE follow it exactly too
/// (their second-order terms vanish when D does not change; DPM++(2M)v2 does not: its
/// exponential factor uses the mean of two step sizes).
#[test]
fn multistep_samplers_are_exact_for_a_constant_target() {
    let sigmas = [10.0_f32, 6.0, 3.0, 2.0, 1.0, 0.5, 0.0];
    let target = [1.0_f32, -2.0];
    let x0 = vec![11.0_f32, 18.0];
    for method in [SampleMethod::Ipndm, SampleMethod::IpndmV, SampleMethod::ResMultistep, SampleMethod::EulerGe] {
        let mut seen = Vec::new();
        let mut den = |x: &[f32], sigma: f32, _: Step| {
            seen.push((sigma, x.to_vec()));
            Ok::<_, SamplingError>(target.to_vec())
        };
        let out = sample(method, &mut den, x0.clone(), &sigmas, &mut PhiloxRng::new(0), 0.0).unwrap();
        for (sigma, x) in &seen {
            // On the exact ODE solution x = D + (x0 - D) sigma / sigma0.
            for k in 0..2 {
                let want = target[k] + (x0[k] - target[k]) * sigma / 10.0;
                assert!((x[k] - want).abs() < 1e-4, "{method} at sigma {sigma}: {x:?}");
            }
        }
        assert_eq!(out, target.to_vec(), "{method}");
    }
}

/// Euler CFG++ steps along the unconditional estimate: from x at sigma, `x' = D + (x - U) s' / s`.
#[test]
fn euler_cfg_pp_uses_the_unconditional_direction() {
    let x0 = vec![4.0_f32, -4.0];
    let (d, u) = (vec![1.0_f32, 1.0], vec![0.0_f32, 2.0]);
    let mut calls = 0;
    let mut den = |_: &[f32], _: f32, _: Step| {
        calls += 1;
        Ok::<_, SamplingError>(Denoised { pred: d.clone(), uncond: Some(u.clone()) })
    };
    let out = sample(SampleMethod::EulerCfgPp, &mut den, x0, &[2.0, 1.0], &mut PhiloxRng::new(0), 0.0).unwrap();
    // 1 + (4 - 0) / 2 = 3; 1 + (-4 - 2) / 2 = -2.
    assert_eq!(out, vec![3.0, -2.0]);
    assert_eq!(calls, 1);
}

/// Euler on a constant target is exactly linear interpolation: x_i = T + (x_0 - T) sigma_i / sigma_0.
#[test]
fn euler_follows_the_exact_ode_solution_for_a_constant_target() {
    let sigmas = [10.0_f32, 4.0, 1.0, 0.0];
    let target = [1.0_f32, -2.0];
    let x0 = vec![11.0_f32, 18.0];
    let mut seen = Vec::new();
    let mut den = |x: &[f32], sigma: f32, _: Step| {
        seen.push((sigma, x.to_vec()));
        Ok::<_, SamplingError>(target.to_vec())
    };
    let out = sample(SampleMethod::Euler, &mut den, x0, &sigmas, &mut PhiloxRng::new(0), 0.0).unwrap();
    assert_eq!(seen[1], (4.0, vec![5.0, 6.0]));
    assert_eq!(seen[2], (1.0, vec![2.0, 0.0]));
    assert_eq!(out, vec![1.0, -2.0]);
}

#[test]
fn sampler_errors() {
    let mut rng = PhiloxRng::new(0);
    let mut den = |x: &[f32], _: f32, _: Step| Ok::<_, SamplingError>(x.to_vec());
    let err = sample(SampleMethod::Euler, &mut den, vec![1.0], &[1.0], &mut rng, 0.0).unwrap_err();
    assert!(matches!(err, SamplingError::EmptySchedule(1)));
    let mut bad = |_: &[f32], _: f32, _: Step| Ok::<_, SamplingError>(vec![0.0; 3]);
    let err = sample(SampleMethod::Heun, &mut bad, vec![1.0, 2.0], &[2.0, 1.0, 0.0], &mut rng, 0.0).unwrap_err();
    assert!(matches!(err, SamplingError::LengthMismatch { expected: 2, got: 3, .. }), "{err}");
    // The callback's own error comes back unchanged.
    let mut failing = |_: &[f32], _: f32, _: Step| Err::<Vec<f32>, _>(SamplingError::MissingUncond);
    let err = sample(SampleMethod::Lcm, &mut failing, vec![1.0], &[2.0, 0.0], &mut rng, 0.0).unwrap_err();
    assert!(matches!(err, SamplingError::MissingUncond));
}

// ---------------------------------------------------------------------------------------------
// Names

#[test]
fn names_round_trip_and_match_the_reference_cli() {
    let methods: Vec<&str> = SampleMethod::ALL.iter().map(|m| m.name()).collect();
    // The reference's sample_method_to_str and scheduler_to_str, in order.
    assert_eq!(
        methods,
        [
            "euler",
            "euler_a",
            "heun",
            "dpm2",
            "dpm++2s_a",
            "dpm++2m",
            "dpm++2mv2",
            "ipndm",
            "ipndm_v",
            "lcm",
            "ddim_trailing",
            "tcd",
            "res_multistep",
            "res_2s",
            "er_sde",
            "euler_cfg_pp",
            "euler_a_cfg_pp",
            "euler_ge"
        ]
    );
    let schedulers: Vec<&str> = Scheduler::ALL.iter().map(|s| s.name()).collect();
    assert_eq!(
        schedulers,
        [
            "discrete",
            "karras",
            "exponential",
            "ays",
            "gits",
            "sgm_uniform",
            "simple",
            "smoothstep",
            "kl_optimal",
            "lcm",
            "bong_tangent",
            "ltx2"
        ]
    );
    for m in SampleMethod::ALL {
        assert_eq!(m.name().parse::<SampleMethod>().unwrap(), m);
    }
    for s in Scheduler::ALL {
        assert_eq!(s.name().parse::<Scheduler>().unwrap(), s);
    }
    for k in RngKind::ALL {
        assert_eq!(k.name().parse::<RngKind>().unwrap(), k);
    }
    assert_eq!("cuda".parse::<RngKind>().unwrap(), RngKind::default());
    assert_eq!("v".parse::<Prediction>().unwrap(), Prediction::V);
    assert_eq!(SampleMethod::default(), SampleMethod::EulerA);
    assert_eq!(SampleMethod::Lcm.default_scheduler(), Scheduler::Lcm);
    assert_eq!(SampleMethod::Heun.default_scheduler(), Scheduler::Discrete);
    assert_eq!(SampleMethod::Tcd.default_scheduler(), Scheduler::Lcm);
    assert_eq!(SampleMethod::DdimTrailing.default_scheduler(), Scheduler::Simple);
    let eta_one: Vec<SampleMethod> = SampleMethod::ALL.into_iter().filter(|m| m.default_eta() == 1.0).collect();
    assert_eq!(eta_one, [SampleMethod::EulerA, SampleMethod::DpmPp2sA, SampleMethod::ErSde, SampleMethod::EulerACfgPp]);
}

#[test]
fn unknown_and_unimplemented_names_are_errors() {
    let err = "euler_b".parse::<SampleMethod>().unwrap_err().to_string();
    assert!(err.contains("unknown sampling method 'euler_b'"), "{err}");
    assert!(err.contains("euler_a") && err.contains("dpm++2m") && err.contains("lcm"), "{err}");
    let err = "Karras".parse::<Scheduler>().unwrap_err().to_string();
    assert!(err.contains("unknown scheduler 'Karras'") && err.contains("karras"), "{err}");
    let err = "mt19937".parse::<RngKind>().unwrap_err().to_string();
    assert!(err.contains("std_default, cuda, cpu"), "{err}");
    assert!("EULER".parse::<SampleMethod>().is_err(), "names are case-sensitive, as in the reference");
    assert!(matches!("flux_flow".parse::<Prediction>(), Err(SamplingError::NotImplemented { .. })));
}

// ---------------------------------------------------------------------------------------------
// Flow matching (FLUX.1, SD3)

fn flows() -> [(&'static str, FlowSchedule); 3] {
    [
        ("flux1", FlowSchedule::exponential(1.0)),
        ("flux1.15", FlowSchedule::exponential(1.15)),
        ("sd3_3", FlowSchedule::linear(3.0)),
    ]
}

/// Sigma range, t -> sigma, sigma -> timestep and the scalings of FLUX.1's (shift 1, 1.15) and
/// SD3's (shift 3) flow denoisers, to the bit.
#[test]
fn flow_schedules_match_reference() {
    let t = reference();
    for (name, f) in flows() {
        let range = floats(&t, &format!("flow {name} range"));
        assert_close(&format!("{name} range"), &[f.sigma_min(), f.sigma_max()], &range, MAX_ULPS);
        let ts = [0.0f32, 0.5, 1.0, 10.25, 499.5, 998.75, 999.0];
        let got: Vec<f32> = ts.iter().map(|&x| f.t_to_sigma(x)).collect();
        assert_close(&format!("{name} t_to_sigma"), &got, &floats(&t, &format!("flow {name} t_to_sigma")), MAX_ULPS);
        let mut got = Vec::new();
        for s in [0.001f32, 0.0285, 0.3, 0.5, 0.75, 0.999, 1.0] {
            let sc = Scalings::flow(s);
            got.extend([f.sigma_to_t(s), sc.c_skip, sc.c_out, sc.c_in]);
        }
        let head = format!("flow {name} sigma_to_t_scalings");
        assert_close(&head, &got, &floats(&t, &head), MAX_ULPS);
        assert!(f.is_flow());
    }
    // The defaults the reference picks for FLUX.1: 1.15 with a guidance embedding (dev), else 1.
    assert_eq!(FlowSchedule::exponential(1.0).with_shift(3.0), FlowSchedule::exponential(3.0));
    assert!(!NoiseSchedule::is_flow(&DiscreteSchedule::sd()));
}

/// Every scheduler but AYS (which has no FLUX noise levels) on the flow schedules, through the
/// same `Scheduler::sigmas` as the discrete one.
#[test]
fn schedulers_on_flow_schedules_match_reference() {
    let t = reference();
    let mut checked = 0;
    for (name, f) in flows() {
        let as_schedule = Schedule::from(f);
        for sched in Scheduler::ALL {
            for n in [1usize, 2, 4, 10, 20, 28] {
                let head = format!("flow {name} schedule {} {n}", sched.name());
                let Some(_) = t.get(&head) else { continue };
                let ctx = ScheduleContext { ays: AysLevels::Unpublished("FLUX"), image_seq_len: 0 };
                let want = floats(&t, &head);
                assert_close(&head, &sched.sigmas_for(n, &f, &ctx).unwrap(), &want, MAX_ULPS);
                assert_close(&head, &sched.sigmas_for(n, &as_schedule, &ctx).unwrap(), &want, MAX_ULPS);
                checked += 1;
            }
        }
    }
    assert!(checked >= 150, "only {checked} flow schedules compared");
    let ctx = ScheduleContext { ays: AysLevels::Unpublished("FLUX"), image_seq_len: 0 };
    let e = Scheduler::Ays.sigmas_for(4, &FlowSchedule::exponential(1.0), &ctx).unwrap_err().to_string();
    assert!(e.contains("ays") && e.contains("FLUX"), "{e}");
    assert_eq!(SampleMethod::Euler.default_scheduler(), Scheduler::Discrete);
}

/// Every sampler on a flow schedule, on the analytic denoiser, from the flow noising of a zero
/// latent: outputs and call sigmas to the bit (euler_a, ddim_trailing, res_multistep, res_2s and
/// euler_ge take the flow ancestral step, lcm rescales before re-noising, dpm++2s_a and er_sde run
/// their flow variants; eta 2 is clamped to 1 as in the reference).
#[test]
fn samplers_on_flow_schedules_match_reference() {
    let t = reference();
    let methods = [
        ("euler", SampleMethod::Euler, 0.0),
        ("euler_a", SampleMethod::EulerA, 1.0),
        ("euler_a_eta05", SampleMethod::EulerA, 0.5),
        ("euler_a_eta2", SampleMethod::EulerA, 2.0),
        ("heun", SampleMethod::Heun, 0.0),
        ("dpm2", SampleMethod::Dpm2, 0.0),
        ("dpm++2m", SampleMethod::DpmPp2m, 0.0),
        ("dpm++2mv2", SampleMethod::DpmPp2mV2, 0.0),
        ("ipndm", SampleMethod::Ipndm, 0.0),
        ("ipndm_v", SampleMethod::IpndmV, 0.0),
        ("lcm", SampleMethod::Lcm, 0.0),
        ("ddim_trailing", SampleMethod::DdimTrailing, 0.0),
        ("ddim_trailing_eta1", SampleMethod::DdimTrailing, 1.0),
        ("tcd", SampleMethod::Tcd, 0.0),
        ("euler_cfg_pp", SampleMethod::EulerCfgPp, 0.0),
        ("euler_a_cfg_pp", SampleMethod::EulerACfgPp, 1.0),
        ("dpm++2s_a", SampleMethod::DpmPp2sA, 1.0),
        ("dpm++2s_a_eta0", SampleMethod::DpmPp2sA, 0.0),
        ("res_multistep", SampleMethod::ResMultistep, 1.0),
        ("res_multistep_eta0", SampleMethod::ResMultistep, 0.0),
        ("res_2s", SampleMethod::Res2s, 1.0),
        ("er_sde", SampleMethod::ErSde, 1.0),
        ("er_sde_eta0", SampleMethod::ErSde, 0.0),
        ("euler_ge", SampleMethod::EulerGe, 1.0),
        ("euler_ge_eta0", SampleMethod::EulerGe, 0.0),
    ];
    for m in SampleMethod::ALL {
        assert!(methods.iter().any(|c| c.1 == m), "{m} is not compared with the reference");
    }
    let runs = [
        ("flux1", FlowSchedule::exponential(1.0), Scheduler::Discrete, 4, 42u64, 16usize),
        ("flux1.15", FlowSchedule::exponential(1.15), Scheduler::Simple, 6, 7, 13),
        ("sd3_3", FlowSchedule::linear(3.0), Scheduler::Discrete, 5, 3, 16),
    ];
    for (label, method, eta) in methods {
        for (flow_name, f, sched, steps, seed, numel) in runs {
            let tail = format!("{label} {flow_name} {} {steps} {seed} {numel}", sched.name());
            let sigmas = sched.sigmas(steps, &f).unwrap();
            let mut rng = RngKind::Cuda.seeded(seed);
            let x = f.noised_latent(&vec![0.0; numel], &rng.randn(numel), sigmas[0]).unwrap();
            let mut calls = Vec::new();
            let mut den = |x: &[f32], sigma: f32, _: Step| {
                calls.push(sigma);
                let uncond = method.needs_uncond_denoised().then(|| analytic_denoise_uncond(x, sigma));
                Ok::<_, SamplingError>(Denoised { pred: analytic_denoise(x, sigma), uncond })
            };
            let out = sample_flow(method, &mut den, x, &sigmas, rng.as_mut(), eta).unwrap();
            assert_close(&format!("flowsample {tail}"), &out, &floats(&t, &format!("flowsample {tail}")), MAX_ULPS);
            assert_close(&format!("flowcalls {tail}"), &calls, &floats(&t, &format!("flowcalls {tail}")), MAX_ULPS);
        }
    }
    // The flow ancestral step differs from the discrete one (so the comparison above can fail).
    let s = FlowSchedule::exponential(1.0);
    let sigmas = Scheduler::Discrete.sigmas(4, &s).unwrap();
    let run = |flow: bool| {
        let mut rng = RngKind::Cuda.seeded(42);
        let x = s.noised_latent(&[0.0; 16], &rng.randn(16), sigmas[0]).unwrap();
        let mut den = |x: &[f32], sigma: f32, _: Step| Ok::<_, SamplingError>(analytic_denoise(x, sigma));
        let f = if flow { sample_flow } else { sample };
        f(SampleMethod::EulerA, &mut den, x, &sigmas, rng.as_mut(), 1.0).unwrap()
    };
    assert_ne!(run(true), run(false));
}

/// The flow noising `(1 - sigma) x0 + sigma noise` and the FLUX.1 dev denoiser composition (flow
/// scalings, timestep = sigma, CFG) against the reference's pieces.
#[test]
fn flow_guided_denoiser_matches_reference_composition() {
    let t = reference();
    let f = FlowSchedule::exponential(1.15);
    for cfg in [1.0_f32, 3.5] {
        let sigma = 0.7_f32;
        let x: Vec<f32> = PhiloxRng::new(5).randn(12).iter().map(|v| v * 2.0).collect();
        // The prediction is not read on a flow schedule: V would change every value otherwise.
        let mut den = GuidedDenoiser::new(&f, Prediction::V, cfg, |m: ModelInput<'_>| {
            let t = m.timestep;
            let cond = m.x.iter().enumerate().map(|(i, &v)| 0.3 * v + 0.001 * t * (i + 1) as f32).collect();
            let uncond = m.x.iter().enumerate().map(|(i, &v)| 0.2 * v - 0.01 * i as f32).collect();
            Ok::<_, SamplingError>(ModelOutput {
                cond,
                uncond: m.uncond.then_some(uncond),
                skipped: None,
                img_uncond: None,
            })
        });
        let got = den.denoise(&x, sigma, Step { index: 0, count: 1, last_eval: true, leading: false }).unwrap();
        let head = t.keys().find(|k| k.starts_with(&format!("flowguided flux1.15 {cfg} "))).expect("line").clone();
        let want_t: f32 = head.split_whitespace().nth(4).unwrap().parse().unwrap();
        assert_eq!(f.sigma_to_t(sigma).to_bits(), want_t.to_bits(), "{head}: timestep");
        assert_close(&head, &got, &floats(&t, &head), MAX_ULPS);
    }
    let n = f.noised_latent(&[1.0, -2.0], &[0.5, 0.25], 0.25).unwrap();
    assert_eq!(n, vec![1.0 * 0.75 + 0.5 * 0.25, -2.0 * 0.75 + 0.25 * 0.25]);
    assert!(f.noised_latent(&[1.0], &[0.5, 0.25], 0.25).is_err());
}

/// FLUX.2's time shift: `mu` from the steps and the latent positions (the reference's
/// `compute_empirical_mu`, recomputed here in f64), resolved per image; `--flow-shift` does
/// not move it, as in the reference (its `get_sigmas` sets the shift again).
#[test]
fn empirical_mu_follows_steps_and_image_size() {
    let mu64 = |n: f64, seq: f64| {
        let (a1, b1, a2, b2) = (8.73809524e-05, 1.89833333, 0.00016927, 0.45666666);
        if seq > 4300.0 {
            return a2 * seq + b2;
        }
        let (m200, m10) = (a2 * seq + b2, a1 * seq + b1);
        let a = (m200 - m10) / 190.0;
        a * n + (m200 - 200.0 * a)
    };
    for (steps, seq) in [(4u32, 256usize), (1, 16), (28, 1024), (50, 4096), (4, 4301), (20, 16384)] {
        let got = empirical_mu(steps, seq) as f64;
        let want = mu64(steps as f64, seq as f64);
        assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "{steps} steps, {seq}: {got} vs {want}");
    }
    // More steps shift less at a small size, and past 4300 positions the steps do not matter.
    assert!(empirical_mu(4, 256) > empirical_mu(40, 256));
    assert_eq!(empirical_mu(4, 5000), empirical_mu(40, 5000));
    let f = FlowSchedule::empirical();
    assert_eq!(f.with_shift(3.0), f);
    assert_eq!(f.for_image(4, 256), FlowSchedule::exponential(empirical_mu(4, 256)));
    assert_eq!(FlowSchedule::linear(3.0).for_image(4, 256), FlowSchedule::linear(3.0));
    let resolved = Schedule::from(f).for_image(8, 1024);
    assert!(matches!(resolved, Schedule::Flow(r) if r.kind() == FlowShift::Exponential));
    // Unresolved, it runs as the exponential shift with its own value.
    assert_eq!(f.t_to_sigma(500.0), FlowSchedule::exponential(1.0).t_to_sigma(500.0));
}

/// Skip-layer guidance applies where the reference's does: evaluations numbered from 1, a
/// leading one (heun's first) negative, strictly between start and end of steps + 1, each cut
/// to an integer; and it moves the guided prediction by `scale (cond - skipped)`.
#[test]
fn skip_layer_guidance_applies_on_the_reference_steps_and_adds_its_term() {
    use crate::SkipLayerGuidance;
    let slg = SkipLayerGuidance { scale: 2.5, layers: vec![7, 8, 9], start: 0.01, end: 0.2 };
    let at = |index, count, leading| slg.applies(Step { index, count, last_eval: true, leading });
    // 20 steps: 21 sigmas, 0.21 -> 0 and 4.2 -> 4: evaluations 1, 2 and 3.
    let on: Vec<usize> = (0..20).filter(|&i| at(i, 20, false)).collect();
    assert_eq!(on, [0, 1, 2]);
    assert!((0..20).all(|i| !at(i, 20, true)), "a leading evaluation is never guided");
    // 2 steps: 0.6 -> 0, nothing; up to the end (1.0: 3) both.
    assert!(!at(0, 2, false) && !at(1, 2, false));
    let whole = SkipLayerGuidance { end: 1.0, ..slg.clone() };
    assert!(whole.applies(Step { index: 1, count: 2, last_eval: true, leading: false }));
    assert!(!SkipLayerGuidance { scale: 0.0, ..whole.clone() }.applies(Step {
        index: 1,
        count: 2,
        last_eval: true,
        leading: false
    }));

    let schedule = FlowSchedule::linear(3.0);
    let x = [0.5_f32, -1.0, 2.0];
    let (cond, uncond, skipped) = ([1.0_f32, 2.0, 3.0], [0.5_f32, 0.5, 0.5], [0.0_f32, 1.0, 5.0]);
    let mut asked = Vec::new();
    let mut den = GuidedDenoiser::new(&schedule, Prediction::Eps, 4.0, |m: ModelInput<'_>| {
        asked.push(m.skip_layers.map(<[usize]>::to_vec));
        Ok::<_, SamplingError>(ModelOutput {
            cond: cond.to_vec(),
            uncond: Some(uncond.to_vec()),
            skipped: m.skip_layers.map(|_| skipped.to_vec()),
            img_uncond: None,
        })
    })
    .with_skip_layer_guidance(Some(whole.clone()));
    let sigma = 0.5_f32;
    let got = den.denoise(&x, sigma, Step { index: 1, count: 2, last_eval: true, leading: false }).unwrap();
    let plain = den.denoise(&x, sigma, Step { index: 1, count: 2, last_eval: true, leading: true }).unwrap();
    drop(den);
    assert_eq!(asked, [Some(vec![7, 8, 9]), None]);
    for i in 0..3 {
        let guided = uncond[i] + 4.0 * (cond[i] - uncond[i]);
        let want = |p: f32| x[i] - sigma * p;
        assert!((got[i] - want(guided + 2.5 * (cond[i] - skipped[i]))).abs() < 1e-5, "{got:?}");
        assert!((plain[i] - want(guided)).abs() < 1e-5, "{plain:?}");
    }
}

/// The image guidance scale, as the reference's `ClassifierFreeGuidance`: with both negative
/// passes `iu + img_cfg (u - iu) + cfg (c - u)`; with img_cfg = cfg only the image-unconditional
/// pass (`iu + cfg (c - iu)`); at 1 the two-pass guidance as before.
#[test]
fn image_guidance_takes_the_passes_the_reference_takes() {
    let schedule = FlowSchedule::linear(3.0);
    let x = [0.5_f32, -1.0, 2.0];
    let (c, u, iu) = ([1.0_f32, 2.0, 3.0], [0.5_f32, 0.25, -0.5], [0.0_f32, 1.0, 4.0]);
    let sigma = 0.5_f32;
    let step = Step { index: 0, count: 1, last_eval: true, leading: false };
    let run = |cfg: f32, img_cfg: f32| {
        let mut asked = None;
        let got = GuidedDenoiser::new(&schedule, Prediction::Eps, cfg, |m: ModelInput<'_>| {
            asked = Some((m.uncond, m.img_uncond));
            Ok::<_, SamplingError>(ModelOutput {
                cond: c.to_vec(),
                uncond: m.uncond.then(|| u.to_vec()),
                skipped: None,
                img_uncond: m.img_uncond.then(|| iu.to_vec()),
            })
        })
        .with_image_guidance(img_cfg)
        .denoise(&x, sigma, step)
        .unwrap();
        (got, asked.unwrap())
    };
    let check = |got: &[f32], pred: &dyn Fn(usize) -> f32| {
        for i in 0..3 {
            assert!((got[i] - (x[i] - sigma * pred(i))).abs() < 1e-5, "{got:?}");
        }
    };
    let (got, asked) = run(3.0, 2.0);
    assert_eq!(asked, (true, true));
    check(&got, &|i| iu[i] + 2.0 * (u[i] - iu[i]) + 3.0 * (c[i] - u[i]));
    let (got, asked) = run(3.0, 3.0);
    assert_eq!(asked, (false, true));
    check(&got, &|i| iu[i] + 3.0 * (c[i] - iu[i]));
    let (got, asked) = run(3.0, 1.0);
    assert_eq!(asked, (true, false));
    check(&got, &|i| u[i] + 3.0 * (c[i] - u[i]));
    let (got, asked) = run(1.0, 1.0);
    assert_eq!(asked, (false, false));
    check(&got, &|i| c[i]);
}
