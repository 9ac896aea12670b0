//! Locations of the golden reference sets copied into this repository (`tests/golden/`), and
//! the relative error the comparisons against them use.

use std::path::PathBuf;

/// `tests/golden/<name>` of this workspace.
pub fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("tests").join("golden").join(name)
}

/// `tests/golden/tiny-a/golden.safetensors`.
pub fn tiny_a_golden() -> PathBuf {
    golden_dir("tiny-a").join("golden.safetensors")
}

/// `‖a − b‖ / ‖b‖` with f64 sums, the relative error every golden comparison uses; `‖a‖` when
/// `b` is all zeros, `+inf` when either side holds a non-finite value.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_l2: lengths differ ({} vs {})", a.len(), b.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return f64::INFINITY;
        }
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::rel_l2;

    #[test]
    fn rel_l2_is_relative_and_strict() {
        assert!((rel_l2(&[1.0, 2.0], &[1.0, 1.0]) - (0.5f64).sqrt()).abs() < 1e-12);
        assert_eq!(rel_l2(&[3.0, 4.0], &[0.0, 0.0]), 5.0);
        assert_eq!(rel_l2(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(rel_l2(&[1.0], &[f32::INFINITY]), f64::INFINITY);
    }
}
