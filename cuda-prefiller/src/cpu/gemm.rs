//! Dense matrix products in f32: `x · Wᵀ` with `W` stored `[out, in]` (checkpoint layout).

use rayon::prelude::*;

/// Dot product with eight independent f32 lanes (vectorises; summation order fixed).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Four dot products of four rows against one weight row, sharing the weight loads.
#[inline]
fn dot4(x: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    let n = w.len();
    let mut acc = [[0.0f32; 8]; 4];
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        let wv = &w[i..i + 8];
        for r in 0..4 {
            let xv = &x[r][i..i + 8];
            for l in 0..8 {
                acc[r][l] += xv[l] * wv[l];
            }
        }
        i += 8;
    }
    let mut out = [0.0f32; 4];
    for r in 0..4 {
        let a = &acc[r];
        let mut tail = 0.0f32;
        for j in full..n {
            tail += x[r][j] * w[j];
        }
        out[r] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + tail;
    }
    out
}

/// Rows of `x` computed against output features `o0..o1`, written to `out` (`[rows, o1-o0]`).
fn block(x: &[f32], rows: usize, k: usize, w: &[f32], o0: usize, o1: usize, out: &mut [f32]) {
    let nb = o1 - o0;
    let mut r = 0;
    while r + 4 <= rows {
        let xs = [&x[r * k..(r + 1) * k], &x[(r + 1) * k..(r + 2) * k], &x[(r + 2) * k..(r + 3) * k], &x[(r + 3) * k..(r + 4) * k]];
        for o in o0..o1 {
            let d = dot4(xs, &w[o * k..(o + 1) * k]);
            for (j, v) in d.iter().enumerate() {
                out[(r + j) * nb + (o - o0)] = *v;
            }
        }
        r += 4;
    }
    while r < rows {
        let xr = &x[r * k..(r + 1) * k];
        for o in o0..o1 {
            out[r * nb + (o - o0)] = dot(xr, &w[o * k..(o + 1) * k]);
        }
        r += 1;
    }
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
        // Row blocks of 16: each task reads its rows once and streams all of W.
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
