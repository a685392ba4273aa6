//! The forms a weight delta takes in LoRA-family files, their merge and their low-rank
//! factors.
//!
//! - LoRA: `up @ down` (`[out, r] x [r, inner]`).
//! - LyCORIS LoHa: `(w1_a @ w1_b) ⊙ (w2_a @ w2_b)`, the Hadamard product of two low-rank
//!   products of one shape.
//! - LyCORIS full (`diff`): the delta itself.
//! - LyCORIS LoKr: `kron(w1, w2)`, each factor stored whole or as a low-rank product
//!   (`w1_a @ w1_b`); for a convolution `w2` carries the kernel (`[b_out, b_in, kh, kw]`) and
//!   the product is LyCORIS's (`w1` taken as `[a_out, a_in, 1, 1]`), so that row
//!   `p * b_out + q` and input channel `s * b_in + t` of the delta are `w1[p, s] * w2[q, t]`.
//!
//! `inner` is a weight's row width: its input features, or for a convolution kernel input
//! channels x kernel height x kernel width, in that order.
//!
//! A merge ([`Form::add_rows`]) evaluates each form directly (a LoKr delta costs one product
//! per element, not a rank-sized sum). At run time every form is a low-rank product
//! ([`Form::up`], [`Form::down`]), exact in exact arithmetic, so the graph adds `up(down(x))` for all of
//! them: a LoHa delta is the product of the Khatri-Rao products of its factors (rank
//! `r1 * r2`: `up[o, i r2 + j] = w1_a[o, i] w2_a[o, j]`, `down[i r2 + j, k] = w1_b[i, k]
//! w2_b[j, k]`), a LoKr delta the Kronecker product of its factors' factorizations
//! (`kron(P1, P2) @ kron(Q1, Q2)`, a whole factor `M` taken as `M @ I` or `I @ M`, whichever
//! is of smaller rank; a `diff` is taken the same way, as one such factor).
//!
//! Tucker-decomposed convolutions (a LoCon's `lora_mid`, a LoHa's `hada_t1`/`hada_t2`) have their
//! core folded into `down` as they are read (`tucker_down` in the module above), so they are
//! low-rank products of the kernel's shape like any other.

use std::borrow::Cow;

/// One factor of a Kronecker product: `[rows, cols]`, whole or as `a @ b` (`[rows, rank]`,
/// `[rank, cols]`).
#[derive(Debug)]
pub(super) struct Factor {
    pub rows: usize,
    pub cols: usize,
    pub values: FactorValues,
}

#[derive(Debug)]
pub(super) enum FactorValues {
    Whole(Vec<f32>),
    LowRank { a: Vec<f32>, b: Vec<f32>, rank: usize },
}

impl Factor {
    /// The factor as one `[rows, cols]` matrix.
    fn dense(&self) -> Cow<'_, [f32]> {
        match &self.values {
            FactorValues::Whole(v) => Cow::Borrowed(v),
            FactorValues::LowRank { a, b, rank } => Cow::Owned(product(a, b, self.rows, *rank, self.cols)),
        }
    }

    /// The rank of [`Factor::pq`].
    fn rank(&self) -> usize {
        match &self.values {
            FactorValues::Whole(_) => self.rows.min(self.cols),
            FactorValues::LowRank { rank, .. } => *rank,
        }
    }

    /// `(P, Q)` with `P @ Q` the factor, `P` `[rows, rank]`, `Q` `[rank, cols]`.
    fn pq(&self) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        match &self.values {
            FactorValues::LowRank { a, b, .. } => (Cow::Borrowed(a), Cow::Borrowed(b)),
            FactorValues::Whole(m) if self.cols <= self.rows => (Cow::Borrowed(m), Cow::Owned(identity(self.cols))),
            FactorValues::Whole(m) => (Cow::Owned(identity(self.rows)), Cow::Borrowed(m)),
        }
    }
}

/// How one adapter's delta is stored.
#[derive(Debug)]
pub(super) enum Form {
    /// `up @ down`.
    LowRank { up: Vec<f32>, down: Vec<f32>, rank: usize },
    /// `(a1 @ b1) ⊙ (a2 @ b2)`.
    Hadamard { a1: Vec<f32>, b1: Vec<f32>, r1: usize, a2: Vec<f32>, b2: Vec<f32>, r2: usize },
    /// `kron(w1, w2)` (`w2`'s columns are the kernel's `b_in x kh x kw`).
    Kron { w1: Factor, w2: Factor },
    /// The whole delta (a `diff`), `[out, inner]`.
    Full(Factor),
}

/// `a @ b`, `[n, k] x [k, m]`, summed over `k` in order.
fn product(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * m];
    for (i, row) in out.chunks_exact_mut(m).enumerate() {
        product_row(&a[i * k..(i + 1) * k], b, m, row);
    }
    out
}

/// `row = a_row @ b` (`b` `[a_row.len(), m]`), each element summed over the rank in order.
fn product_row(a_row: &[f32], b: &[f32], m: usize, row: &mut [f32]) {
    for (c, x) in row.iter_mut().enumerate() {
        let mut s = 0f32;
        for (r, u) in a_row.iter().enumerate() {
            s += u * b[r * m + c];
        }
        *x = s;
    }
}

fn identity(n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    v
}

/// `kron(a, b)` of `[n1, m1]` and `[n2, m2]` matrices: `[n1 n2, m1 m2]`.
fn kron(a: &[f32], (n1, m1): (usize, usize), b: &[f32], (n2, m2): (usize, usize)) -> Vec<f32> {
    let cols = m1 * m2;
    let mut out = vec![0f32; n1 * n2 * cols];
    for p in 0..n1 {
        for q in 0..n2 {
            let row = &mut out[(p * n2 + q) * cols..(p * n2 + q + 1) * cols];
            for s in 0..m1 {
                let x = a[p * m1 + s];
                for (t, y) in b[q * m2..(q + 1) * m2].iter().enumerate() {
                    row[s * m2 + t] = x * y;
                }
            }
        }
    }
    out
}

impl Form {
    /// The rank of [`Form::up`] and [`Form::down`].
    pub fn rank(&self) -> usize {
        match self {
            Form::LowRank { rank, .. } => *rank,
            Form::Hadamard { r1, r2, .. } => r1 * r2,
            Form::Kron { w1, w2 } => w1.rank() * w2.rank(),
            Form::Full(f) => f.rank(),
        }
    }

    /// The `[out, rank]` factor of the delta at run time (`up @ down` is the delta).
    pub fn up(&self, out: usize) -> Cow<'_, [f32]> {
        match self {
            Form::LowRank { up, .. } => Cow::Borrowed(up),
            Form::Hadamard { a1, r1, a2, r2, .. } => {
                let (r1, r2) = (*r1, *r2);
                let mut up = vec![0f32; out * r1 * r2];
                for o in 0..out {
                    for i in 0..r1 {
                        for j in 0..r2 {
                            up[o * r1 * r2 + i * r2 + j] = a1[o * r1 + i] * a2[o * r2 + j];
                        }
                    }
                }
                Cow::Owned(up)
            }
            Form::Kron { w1, w2 } => {
                let (p1, p2) = (w1.pq().0, w2.pq().0);
                Cow::Owned(kron(&p1, (w1.rows, w1.rank()), &p2, (w2.rows, w2.rank())))
            }
            Form::Full(f) => Cow::Owned(f.pq().0.into_owned()),
        }
    }

    /// The `[rank, inner]` factor of the delta at run time.
    pub fn down(&self, inner: usize) -> Cow<'_, [f32]> {
        match self {
            Form::LowRank { down, .. } => Cow::Borrowed(down),
            Form::Hadamard { b1, r1, b2, r2, .. } => {
                let (r1, r2) = (*r1, *r2);
                let mut down = vec![0f32; r1 * r2 * inner];
                for i in 0..r1 {
                    for j in 0..r2 {
                        let row = &mut down[(i * r2 + j) * inner..(i * r2 + j + 1) * inner];
                        for (k, x) in row.iter_mut().enumerate() {
                            *x = b1[i * inner + k] * b2[j * inner + k];
                        }
                    }
                }
                Cow::Owned(down)
            }
            Form::Kron { w1, w2 } => {
                let (q1, q2) = (w1.pq().1, w2.pq().1);
                Cow::Owned(kron(&q1, (w1.rank(), w1.cols), &q2, (w2.rank(), w2.cols)))
            }
            Form::Full(f) => Cow::Owned(f.pq().1.into_owned()),
        }
    }

    /// Adds `scale` times the delta (`[out, inner]`) to `w`'s rows `offset..offset + out`
    /// (`w` row-major, rows of `inner`), in f32: each element of the delta is computed whole
    /// (a product summed over the rank in order; LoHa's two products multiplied; LoKr's factors
    /// multiplied), then scaled and added.
    pub fn add_rows(&self, w: &mut [f32], out: usize, inner: usize, offset: usize, scale: f32) {
        let rows = &mut w[offset * inner..(offset + out) * inner];
        match self {
            Form::LowRank { up, down, rank } => {
                let mut d = vec![0f32; inner];
                for (o, dst) in rows.chunks_exact_mut(inner).enumerate() {
                    product_row(&up[o * rank..(o + 1) * rank], down, inner, &mut d);
                    dst.iter_mut().zip(&d).for_each(|(x, s)| *x += s * scale);
                }
            }
            Form::Hadamard { a1, b1, r1, a2, b2, r2 } => {
                let (mut d1, mut d2) = (vec![0f32; inner], vec![0f32; inner]);
                for (o, dst) in rows.chunks_exact_mut(inner).enumerate() {
                    product_row(&a1[o * r1..(o + 1) * r1], b1, inner, &mut d1);
                    product_row(&a2[o * r2..(o + 1) * r2], b2, inner, &mut d2);
                    for ((x, u), v) in dst.iter_mut().zip(&d1).zip(&d2) {
                        *x += u * v * scale;
                    }
                }
            }
            Form::Full(f) => {
                let m = f.dense();
                for (x, d) in rows.iter_mut().zip(m.iter()) {
                    *x += d * scale;
                }
            }
            Form::Kron { w1, w2 } => {
                let (m1, m2) = (w1.dense(), w2.dense());
                for (r, dst) in rows.chunks_exact_mut(inner).enumerate() {
                    let (p, q) = (r / w2.rows, r % w2.rows);
                    let b = &m2[q * w2.cols..(q + 1) * w2.cols];
                    for s in 0..w1.cols {
                        let a = m1[p * w1.cols + s];
                        for (x, y) in dst[s * w2.cols..(s + 1) * w2.cols].iter_mut().zip(b) {
                            *x += a * y * scale;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, k: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.37 + k).sin()).collect()
    }

    /// The dense delta of a form, by its merge.
    fn merged(f: &Form, out: usize, inner: usize) -> Vec<f32> {
        let mut w = vec![0f32; out * inner];
        f.add_rows(&mut w, out, inner, 0, 1.0);
        w
    }

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 1e-4 * (1.0 + x.abs()), "element {i}: {x} vs {y}");
        }
    }

    #[test]
    fn loha_merge_is_the_hadamard_product_and_its_factors_reproduce_it() {
        let (out, inner, r1, r2) = (6, 5, 2, 3);
        let f = Form::Hadamard {
            a1: seq(out * r1, 1.0),
            b1: seq(r1 * inner, 2.0),
            r1,
            a2: seq(out * r2, 3.0),
            b2: seq(r2 * inner, 4.0),
            r2,
        };
        let Form::Hadamard { a1, b1, a2, b2, .. } = &f else { unreachable!() };
        let (d1, d2) = (product(a1, b1, out, r1, inner), product(a2, b2, out, r2, inner));
        let want: Vec<f32> = d1.iter().zip(&d2).map(|(x, y)| x * y).collect();
        close(&merged(&f, out, inner), &want);
        assert_eq!(f.rank(), 6);
        let (up, down) = (f.up(out), f.down(inner));
        close(&product(&up, &down, out, f.rank(), inner), &want);
    }

    #[test]
    fn lokr_merge_is_the_kronecker_product_for_every_factor_form() {
        // w1 [2, 3] whole; w2 [4, 5] whole, then as a rank-2 product; w1 as a rank-1 product.
        let (a_o, a_i, b_o, b_i) = (2, 3, 4, 5);
        let w1 = seq(a_o * a_i, 0.5);
        let w2 = seq(b_o * b_i, 1.5);
        let w2a = seq(b_o * 2, 2.5);
        let w2b = seq(2 * b_i, 3.5);
        let w1a = seq(a_o, 4.5);
        let w1b = seq(a_i, 5.5);
        let whole = |v: &Vec<f32>, rows, cols| Factor { rows, cols, values: FactorValues::Whole(v.clone()) };
        let low = |a: &Vec<f32>, b: &Vec<f32>, rows, rank, cols| Factor {
            rows,
            cols,
            values: FactorValues::LowRank { a: a.clone(), b: b.clone(), rank },
        };
        let (out, inner) = (a_o * b_o, a_i * b_i);
        for (f, m1, m2) in [
            (Form::Kron { w1: whole(&w1, a_o, a_i), w2: whole(&w2, b_o, b_i) }, w1.clone(), w2.clone()),
            (
                Form::Kron { w1: whole(&w1, a_o, a_i), w2: low(&w2a, &w2b, b_o, 2, b_i) },
                w1.clone(),
                product(&w2a, &w2b, b_o, 2, b_i),
            ),
            (
                Form::Kron { w1: low(&w1a, &w1b, a_o, 1, a_i), w2: whole(&w2, b_o, b_i) },
                product(&w1a, &w1b, a_o, 1, a_i),
                w2.clone(),
            ),
        ] {
            // torch.kron: element [p b_o + q, s b_i + t] = m1[p, s] m2[q, t].
            let mut want = vec![0f32; out * inner];
            for p in 0..a_o {
                for q in 0..b_o {
                    for s in 0..a_i {
                        for t in 0..b_i {
                            want[(p * b_o + q) * inner + s * b_i + t] = m1[p * a_i + s] * m2[q * b_i + t];
                        }
                    }
                }
            }
            close(&merged(&f, out, inner), &want);
            let (up, down) = (f.up(out), f.down(inner));
            assert!(f.rank() <= out.min(inner), "rank {}", f.rank());
            close(&product(&up, &down, out, f.rank(), inner), &want);
        }
    }

    #[test]
    fn a_merge_adds_scaled_rows_at_its_offset_only() {
        let f = Form::LowRank { up: vec![1.0, 2.0], down: vec![3.0, 4.0, 5.0], rank: 1 };
        let mut w = vec![1f32; 4 * 3];
        f.add_rows(&mut w, 2, 3, 1, 0.5);
        assert_eq!(w, [1.0, 1.0, 1.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 1.0, 1.0, 1.0]);
    }
}
