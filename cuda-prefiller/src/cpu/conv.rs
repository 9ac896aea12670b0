//! KDA short causal depthwise convolution with its carried window (spec §3.3 step 2).

use crate::act::silu;

/// `y_t[c] = SiLU(Σ_{j<K} w[c, j] · x̂_{t−(K−1)+j}[c])` over `x [rows, c]`, where `x̂` is
/// `window ++ x` and `window [K-1, c]` holds the previous pre-conv inputs, oldest first.
/// Returns `(y, new_window)`: the last K-1 rows of `window ++ x`.
pub fn short_conv_silu(x: &[f32], c: usize, w: &[f32], kernel: usize, window: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / c.max(1);
    let win = kernel - 1;
    assert_eq!(x.len(), rows * c, "short_conv: x is not [rows, c]");
    assert_eq!(w.len(), c * kernel, "short_conv: weight is not [c, kernel]");
    assert_eq!(window.len(), win * c, "short_conv: window is not [kernel-1, c]");
    // Row τ of window ++ x.
    let at = |tau: usize| -> &[f32] {
        if tau < win {
            &window[tau * c..(tau + 1) * c]
        } else {
            &x[(tau - win) * c..(tau - win + 1) * c]
        }
    };
    let mut y = vec![0.0f32; rows * c];
    for t in 0..rows {
        let yt = &mut y[t * c..(t + 1) * c];
        for j in 0..kernel {
            let src = at(t + j); // = x̂ at t − (K−1) + j in the shifted indexing
            for ch in 0..c {
                yt[ch] += w[ch * kernel + j] * src[ch];
            }
        }
        for v in yt.iter_mut() {
            *v = silu(*v);
        }
    }
    let total = win + rows;
    let mut new_window = vec![0.0f32; win * c];
    for i in 0..win {
        new_window[i * c..(i + 1) * c].copy_from_slice(at(total - win + i));
    }
    (y, new_window)
}
