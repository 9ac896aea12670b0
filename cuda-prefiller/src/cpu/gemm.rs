//! Dense matrix products in f32: `x · Wᵀ` with `W` stored `[out, in]` (checkpoint layout).

use rayon::prelude::*;

/// Dot product with eight independent f32 lanes (vectorises; summation order fixed).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let full = n / 8 * 8;
    let mut acc = [0.0f32; 8];
    let mut i = 0;
    while i < full {
        let x: &[f32; 8] = a[i..i + 8].try_into().unwrap();
        let y: &[f32; 8] = b[i..i + 8].try_into().unwrap();
        fma8(&mut acc, x, y);
        i += 8;
    }
    let tail = (full..n).map(|j| a[j] * b[j]).fold(0.0f32, |s, v| s + v);
    hsum8(&acc) + tail
}

/// `acc[l] += x[l] * w[l]` over one 8-lane group (fixed size: unrolled and vectorised).
#[inline(always)]
fn fma8(acc: &mut [f32; 8], x: &[f32; 8], w: &[f32; 8]) {
    for l in 0..8 {
        acc[l] += x[l] * w[l];
    }
}

/// Reduction of the eight lanes, in the same order as [`dot`].
#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// A 4-row × 2-output register block: eight dot products sharing every load. Same summation
/// order as [`dot`], so every path gives bit-identical results.
#[inline(always)]
fn dot4x2(x: [&[f32]; 4], w0: &[f32], w1: &[f32]) -> [[f32; 2]; 4] {
    let n = w0.len();
    let full = n / 8 * 8;
    let (mut a00, mut a01, mut a10, mut a11) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    let (mut a20, mut a21, mut a30, mut a31) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    let g = |s: &[f32], i: usize| -> [f32; 8] { s[i..i + 8].try_into().unwrap() };
    let mut i = 0;
    while i < full {
        let (c0, c1) = (g(w0, i), g(w1, i));
        let (r0, r1, r2, r3) = (g(x[0], i), g(x[1], i), g(x[2], i), g(x[3], i));
        fma8(&mut a00, &r0, &c0);
        fma8(&mut a01, &r0, &c1);
        fma8(&mut a10, &r1, &c0);
        fma8(&mut a11, &r1, &c1);
        fma8(&mut a20, &r2, &c0);
        fma8(&mut a21, &r2, &c1);
        fma8(&mut a30, &r3, &c0);
        fma8(&mut a31, &r3, &c1);
        i += 8;
    }
    let tail = |r: usize, w: &[f32]| -> f32 { (full..n).map(|j| x[r][j] * w[j]).fold(0.0, |s, v| s + v) };
    [
        [hsum8(&a00) + tail(0, w0), hsum8(&a01) + tail(0, w1)],
        [hsum8(&a10) + tail(1, w0), hsum8(&a11) + tail(1, w1)],
        [hsum8(&a20) + tail(2, w0), hsum8(&a21) + tail(2, w1)],
        [hsum8(&a30) + tail(3, w0), hsum8(&a31) + tail(3, w1)],
    ]
}

/// Outputs per cache block: `OB` weight rows stay in L2 while every row group of the task
/// passes over them.
const OB: usize = 64;

/// Rows of `x` against output features `o0..o1`, written to `out` (`[rows, o1-o0]`).
#[inline(always)]
fn block_body(x: &[f32], rows: usize, k: usize, w: &[f32], o0: usize, o1: usize, out: &mut [f32], kern: impl Fn([&[f32]; 4], &[f32], &[f32]) -> [[f32; 2]; 4]) {
    let nb = o1 - o0;
    let row = |r: usize| &x[r * k..(r + 1) * k];
    let wr = |o: usize| &w[o * k..(o + 1) * k];
    let mut b0 = o0;
    while b0 < o1 {
        let b1 = (b0 + OB).min(o1);
        let mut r = 0;
        while r + 4 <= rows {
            let xs = [row(r), row(r + 1), row(r + 2), row(r + 3)];
            let mut o = b0;
            while o + 2 <= b1 {
                let d = kern(xs, wr(o), wr(o + 1));
                for (j, dj) in d.iter().enumerate() {
                    out[(r + j) * nb + (o - o0)] = dj[0];
                    out[(r + j) * nb + (o + 1 - o0)] = dj[1];
                }
                o += 2;
            }
            if o < b1 {
                for j in 0..4 {
                    out[(r + j) * nb + (o - o0)] = dot(xs[j], wr(o));
                }
            }
            r += 4;
        }
        while r < rows {
            for o in b0..b1 {
                out[r * nb + (o - o0)] = dot(row(r), wr(o));
            }
            r += 1;
        }
        b0 = b1;
    }
}

/// [`dot4x2`] with explicit AVX2 vectors: the same lanes and the same summation order
/// (separate multiply and add, no FMA), hence bit-identical results.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot4x2_avx2(x: [&[f32]; 4], w0: &[f32], w1: &[f32]) -> [[f32; 2]; 4] {
    use std::arch::x86_64::*;
    let n = w0.len();
    assert!(w1.len() >= n && x.iter().all(|r| r.len() >= n), "dot4x2: operand shorter than the weight row");
    let full = n / 8 * 8;
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i < full {
        // SAFETY: i + 8 <= full <= n <= every operand's length (asserted above).
        let c0 = _mm256_loadu_ps(w0.as_ptr().add(i));
        let c1 = _mm256_loadu_ps(w1.as_ptr().add(i));
        for r in 0..4 {
            let xr = _mm256_loadu_ps(x[r].as_ptr().add(i));
            acc[2 * r] = _mm256_add_ps(acc[2 * r], _mm256_mul_ps(xr, c0));
            acc[2 * r + 1] = _mm256_add_ps(acc[2 * r + 1], _mm256_mul_ps(xr, c1));
        }
        i += 8;
    }
    let mut out = [[0.0f32; 2]; 4];
    for r in 0..4 {
        for c in 0..2 {
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[2 * r + c]);
            let w = if c == 0 { w0 } else { w1 };
            let tail = (full..n).map(|j| x[r][j] * w[j]).fold(0.0f32, |s, v| s + v);
            out[r][c] = hsum8(&lanes) + tail;
        }
    }
    out
}

fn block(x: &[f32], rows: usize, k: usize, w: &[f32], o0: usize, o1: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return block_body(x, rows, k, w, o0, o1, out, |xs, a, b| unsafe { dot4x2_avx2(xs, a, b) });
        }
    }
    block_body(x, rows, k, w, o0, o1, out, dot4x2)
}

/// `x [rows, k] · w[n, k]ᵀ → [rows, n]`, f32 accumulation, multi-threaded.
///
/// Work is split over blocks of rows when there are many rows, over blocks of output
/// features otherwise (decode, small batches), so both shapes use every core.
pub fn gemm(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), rows * k, "gemm: x is not [rows, k]");
    assert_eq!(w.len(), n * k, "gemm: w is not [n, k]");
    let mut out = vec![0.0f32; rows * n];
    if rows == 0 || n == 0 {
        return out;
    }
    let threads = rayon::current_num_threads().max(1);
    let work = rows * n * k;
    if work < 1 << 16 {
        block(x, rows, k, w, 0, n, &mut out);
        return out;
    }
    if rows >= 16 * threads {
        // Row blocks of 16: each task keeps its rows in cache and passes over W once.
        out.par_chunks_mut(16 * n).enumerate().for_each(|(b, o)| {
            let r0 = b * 16;
            let nr = o.len() / n;
            block(&x[r0 * k..(r0 + nr) * k], nr, k, w, 0, n, o);
        });
    } else {
        // Feature blocks: every task computes all rows for a slice of the outputs.
        let nb = n.div_ceil(threads * 4).max(16);
        let parts: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(nb))
            .into_par_iter()
            .map(|b| {
                let o0 = b * nb;
                let o1 = (o0 + nb).min(n);
                let mut part = vec![0.0f32; rows * (o1 - o0)];
                block(x, rows, k, w, o0, o1, &mut part);
                (o0, part)
            })
            .collect();
        for (o0, part) in parts {
            let w_ = part.len() / rows;
            for r in 0..rows {
                out[r * n + o0..r * n + o0 + w_].copy_from_slice(&part[r * w_..(r + 1) * w_]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], rows: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut o = vec![0.0f32; rows * n];
        for r in 0..rows {
            for j in 0..n {
                o[r * n + j] = (0..k).map(|i| x[r * k + i] as f64 * w[j * k + i] as f64).sum::<f64>() as f32;
            }
        }
        o
    }

    #[test]
    fn matches_naive_on_odd_shapes() {
        for &(rows, k, n) in &[(1, 7, 3), (5, 33, 17), (70, 129, 65), (3, 300, 500), (200, 64, 40)] {
            let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0).collect();
            let a = gemm(&x, rows, k, &w, n);
            let b = naive(&x, rows, k, &w, n);
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{rows}x{k}x{n}: {p} vs {q}");
            }
        }
    }
}
