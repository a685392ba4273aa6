//! `cargo xtask bench --sizes 256,512,768,1024`: how each program's cost grows with the image.
//!
//! After the usual tables, one table per weight type: per-step time and peak RSS at each size
//! for every program, the exponent `k` of the least-squares fit `cost ∝ pixels^k` over the
//! sizes, and, for the diffusion model, its floating-point operations per step (counted by one
//! profiled `sd-cli --profile` run of one step per size: matrix products and attention, the
//! same math in both programs) divided by each program's step time, beside this machine's f32
//! FMA peak measured by [`fma_peak_gflops`] with the benchmark's thread count.

use std::hint::black_box;
use std::time::Instant;

/// The step count of a `--sizes` entry: 4 up to 256x256, 2 up to 512x512, else 1 (a step
/// at 1024x1024 takes minutes on two cores).
pub fn steps_for(side: u32) -> u32 {
    match side {
        0..=256 => 4,
        257..=512 => 2,
        _ => 1,
    }
}

/// `--sizes`: image sides that are multiples of 64 from 64 to 2048.
pub fn side(s: &str) -> Result<u32, String> {
    let n: u32 = s.trim().parse().map_err(|_| format!("'{s}' is not an image side (64, 128, ... 2048)"))?;
    if !(64..=2048).contains(&n) || !n.is_multiple_of(64) {
        return Err(format!("{n}: an image side is a multiple of 64 from 64 to 2048"));
    }
    Ok(n)
}

/// The exponent `k` of the least-squares fit `y = c x^k` through `(x, y)` points with positive
/// coordinates; `None` with fewer than two distinct `x`.
fn growth_exponent(points: &[(f64, f64)]) -> Option<f64> {
    let p: Vec<(f64, f64)> =
        points.iter().filter(|(x, y)| *x > 0.0 && *y > 0.0).map(|(x, y)| (x.ln(), y.ln())).collect();
    let n = p.len() as f64;
    let (mx, my) = (p.iter().map(|q| q.0).sum::<f64>() / n, p.iter().map(|q| q.1).sum::<f64>() / n);
    let sxx: f64 = p.iter().map(|q| (q.0 - mx).powi(2)).sum();
    if p.len() < 2 || sxx < 1e-12 {
        return None;
    }
    Some(p.iter().map(|q| (q.0 - mx) * (q.1 - my)).sum::<f64>() / sxx)
}

/// Independent accumulators per thread: enough to cover the FMA latency (4 cycles) on two
/// ports.
const LANES: usize = 16;

/// Rounds of the probe per thread (each `LANES` FMAs of one vector width).
const ROUNDS: u64 = 20_000_000;

/// This machine's f32 fused multiply-add throughput in GFLOP/s on `threads` threads (2 FLOP
/// per lane): each thread runs [`ROUNDS`] rounds of [`LANES`] independent FMAs, 16-wide with
/// AVX-512, 8-wide with AVX2+FMA, else scalar `mul_add`. The ceiling a GEMM can approach.
pub fn fma_peak_gflops(threads: u32) -> f64 {
    let threads = threads.max(1);
    // A warm-up round lets the cores reach their clock (and AVX-512 licence) first.
    per_thread_flops(ROUNDS / 10);
    let t = Instant::now();
    let flops: f64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|_| s.spawn(|| per_thread_flops(ROUNDS))).collect();
        hs.into_iter().map(|h| h.join().expect("FMA probe thread")).sum()
    });
    flops / t.elapsed().as_secs_f64() * 1e-9
}

/// Runs `rounds` rounds on this thread with the widest FMA the CPU has; returns the FLOPs done.
fn per_thread_flops(rounds: u64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked on the line above).
            unsafe { x86::fma_avx512(rounds) };
            return (rounds * LANES as u64 * 16 * 2) as f64;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked on the line above).
            unsafe { x86::fma_avx2(rounds) };
            return (rounds * LANES as u64 * 8 * 2) as f64;
        }
    }
    let mut acc = [1.0f32; LANES];
    let (a, b) = (black_box(0.999_999f32), black_box(1e-7f32));
    for _ in 0..rounds {
        for v in acc.iter_mut() {
            *v = v.mul_add(a, b);
        }
    }
    black_box(acc);
    (rounds * LANES as u64 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::LANES;
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// `rounds` rounds of [`LANES`] independent 16-wide FMAs.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma_avx512(rounds: u64) {
        let (a, b) = (_mm512_set1_ps(black_box(0.999_999)), _mm512_set1_ps(black_box(1e-7)));
        let mut acc = [_mm512_set1_ps(1.0); LANES];
        for _ in 0..rounds {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        black_box(acc);
    }

    /// `rounds` rounds of [`LANES`] independent 8-wide FMAs.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_avx2(rounds: u64) {
        let (a, b) = (_mm256_set1_ps(black_box(0.999_999)), _mm256_set1_ps(black_box(1e-7)));
        let mut acc = [_mm256_set1_ps(1.0); LANES];
        for _ in 0..rounds {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        black_box(acc);
    }
}

/// One program's figures at one size.
#[derive(Clone, Copy, Debug, Default)]
pub struct Point {
    pub side: u32,
    pub step_s: Option<f64>,
    pub rss_mib: Option<f64>,
}

/// Prints the cost-against-size table of one weight type: `columns` are the programs' labels
/// and their points (one per size, in order), `flops` the diffusion model's FLOPs per step at
/// each size (`None` where the profile run failed), `peak` the FMA probe's GFLOP/s.
pub fn print(label: &str, ty: &str, threads: u32, columns: &[(&str, Vec<Point>)], flops: &[Option<f64>], peak: f64) {
    println!("\n### cost against size: {label}, {ty}, -t {threads} (FMA peak measured here: {peak:.0} GFLOP/s f32)\n");
    let mut head = String::from("| size | UNet GFLOP/step |");
    let mut rule = String::from("|---|---|");
    for (name, _) in columns {
        head += &format!(" {name} per step | {name} GFLOP/s (% of peak) | {name} peak RSS |");
        rule += "---|---|---|";
    }
    println!("{head}\n{rule}");
    let sizes: Vec<u32> = columns.first().map(|(_, p)| p.iter().map(|q| q.side).collect()).unwrap_or_default();
    for (i, side) in sizes.iter().enumerate() {
        let f = flops.get(i).copied().flatten();
        let mut line = format!("| {side}x{side} | {} |", f.map_or("?".into(), |f| format!("{:.0}", f * 1e-9)));
        for (_, points) in columns {
            let p = points[i];
            let rate = match (f, p.step_s) {
                (Some(f), Some(s)) if s > 0.0 => {
                    let g = f / s * 1e-9;
                    format!("{g:.0} ({:.0}%)", 100.0 * g / peak)
                }
                _ => "?".into(),
            };
            line += &format!(
                " {} | {rate} | {} |",
                p.step_s.map_or("?".into(), |s| format!("{s:.2} s")),
                p.rss_mib.map_or("?".into(), |m| format!("{m:.0} MiB"))
            );
        }
        println!("{line}");
    }
    let fit = |f: &dyn Fn(&Point) -> Option<f64>, points: &[Point]| {
        let xy: Vec<(f64, f64)> =
            points.iter().filter_map(|p| f(p).map(|y| (f64::from(p.side) * f64::from(p.side), y))).collect();
        growth_exponent(&xy).map_or("?".into(), |k| format!("{k:.2}"))
    };
    let mut line = String::from("| growth exponent k (cost ∝ pixels^k) | |");
    for (_, points) in columns {
        line += &format!(" {} | | {} |", fit(&|p| p.step_s, points), fit(&|p| p.rss_mib, points));
    }
    println!("{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_growth_exponent_of_a_power_law_is_its_power() {
        let pts: Vec<(f64, f64)> =
            [256.0f64, 512.0, 768.0, 1024.0].iter().map(|s| (s * s, 3.0 * (s * s).powf(1.3))).collect();
        assert!((growth_exponent(&pts).unwrap() - 1.3).abs() < 1e-9);
        // Noise around a linear law still fits close to 1.
        let noisy = [(1.0, 1.1), (2.0, 1.9), (4.0, 4.2), (8.0, 7.8)];
        let k = growth_exponent(&noisy).unwrap();
        assert!((k - 1.0).abs() < 0.1, "{k}");
        assert_eq!(growth_exponent(&[(4.0, 2.0)]), None);
        assert_eq!(growth_exponent(&[(4.0, 2.0), (4.0, 3.0)]), None);
        // Non-positive points are left out, not turned into NaN.
        assert!((growth_exponent(&[(0.0, 1.0), (1.0, 1.0), (2.0, 4.0)]).unwrap() - 2.0).abs() < 1e-9);
    }

    #[test]
    fn sizes_are_multiples_of_64_and_steps_shrink_with_them() {
        assert_eq!(side("768"), Ok(768));
        for bad in ["0", "100", "4096", "x", "-64"] {
            assert!(side(bad).is_err(), "{bad}");
        }
        assert_eq!([256, 512, 768, 1024].map(steps_for), [4, 2, 1, 1]);
    }

    #[test]
    fn the_fma_probe_measures_a_positive_finite_rate() {
        let flops = per_thread_flops(1000);
        assert!(flops >= 1000.0 * LANES as f64 * 2.0);
        let g = fma_peak_gflops(1);
        assert!(g.is_finite() && g > 0.1, "{g}");
    }
}
