//! A small, portable, seedable generator (xoshiro256++ seeded through SplitMix64) so the
//! synthetic models are byte-identical for a seed on every platform and rand version. Each
//! tensor chunk gets its own stream derived from `(seed, tensor name, chunk)`, which lets
//! chunks be generated in parallel and in any order.

/// xoshiro256++.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a over a name, for stream derivation.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        Rng { s: [splitmix(&mut x), splitmix(&mut x), splitmix(&mut x), splitmix(&mut x)] }
    }

    /// The stream of chunk `chunk` of tensor `name` under model seed `seed`.
    pub fn from_parts(seed: u64, name: &str, chunk: u64) -> Self {
        let mut x = seed ^ 0x6b33_2d73_796e_7468;
        let a = splitmix(&mut x);
        let mut y = a ^ fnv1a(name);
        let b = splitmix(&mut y);
        Rng::new(b ^ chunk.wrapping_mul(0xD6E8_FEB8_6659_FD93))
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let r = (s[0].wrapping_add(s[3])).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }
}

/// Tables of the 128-layer ziggurat for the standard normal (Marsaglia & Tsang, 2000).
struct Ziggurat {
    k: [u32; 128],
    w: [f32; 128],
    f: [f32; 128],
}

/// Right edge of the base layer and the common layer area.
const ZIG_R: f64 = 3.442_619_855_899;
const ZIG_V: f64 = 9.912_563_035_262_17e-3;

fn ziggurat() -> &'static Ziggurat {
    static TABLES: std::sync::OnceLock<Ziggurat> = std::sync::OnceLock::new();
    TABLES.get_or_init(|| {
        let m = 2f64.powi(31);
        let mut z = Ziggurat { k: [0; 128], w: [0.0; 128], f: [0.0; 128] };
        let mut dn = ZIG_R;
        let mut tn = dn;
        let q = ZIG_V / (-0.5 * dn * dn).exp();
        z.k[0] = ((dn / q) * m) as u32;
        z.k[1] = 0;
        z.w[0] = (q / m) as f32;
        z.w[127] = (dn / m) as f32;
        z.f[0] = 1.0;
        z.f[127] = (-0.5 * dn * dn).exp() as f32;
        for i in (1..=126).rev() {
            dn = (-2.0 * (ZIG_V / dn + (-0.5 * dn * dn).exp()).ln()).sqrt();
            z.k[i + 1] = ((dn / tn) * m) as u32;
            tn = dn;
            z.f[i] = (-0.5 * dn * dn).exp() as f32;
            z.w[i] = (dn / m) as f32;
        }
        z
    })
}

impl Rng {
    /// Uniform in (0, 1], never 0 (safe under `ln`).
    #[inline]
    fn open01(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal sample (ziggurat; about one 32-bit draw per sample).
    #[inline]
    pub fn normal(&mut self) -> f32 {
        let z = ziggurat();
        loop {
            let hz = self.next_u64() as u32 as i32;
            let iz = (hz & 127) as usize;
            if hz.unsigned_abs() < z.k[iz] {
                return hz as f32 * z.w[iz];
            }
            if let Some(x) = self.normal_tail(hz, iz, z) {
                return x;
            }
        }
    }

    #[cold]
    fn normal_tail(&mut self, hz: i32, iz: usize, z: &Ziggurat) -> Option<f32> {
        if iz == 0 {
            // The base strip's tail beyond r (Marsaglia's exponential method).
            loop {
                let x = -self.open01().ln() / ZIG_R;
                let y = -self.open01().ln();
                if y + y >= x * x {
                    let v = (ZIG_R + x) as f32;
                    return Some(if hz > 0 { v } else { -v });
                }
            }
        }
        let x = hz as f32 * z.w[iz];
        let u = self.open01() as f32;
        if z.f[iz] + u * (z.f[iz - 1] - z.f[iz]) < (-0.5 * x * x).exp() {
            return Some(x);
        }
        None
    }
}

impl rand::RngCore for Rng {
    fn next_u32(&mut self) -> u32 {
        (Rng::next_u64(self) >> 32) as u32
    }
    fn next_u64(&mut self) -> u64 {
        Rng::next_u64(self)
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        for c in dest.chunks_mut(8) {
            let v = Rng::next_u64(self).to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_samples_have_normal_moments() {
        let mut r = Rng::new(42);
        let n = 2_000_000;
        let (mut s1, mut s2, mut s4, mut tail3, mut tail_r) = (0f64, 0f64, 0f64, 0usize, 0usize);
        for _ in 0..n {
            let x = r.normal() as f64;
            s1 += x;
            s2 += x * x;
            s4 += x.powi(4);
            tail3 += (x.abs() > 3.0) as usize;
            tail_r += (x.abs() > ZIG_R) as usize;
        }
        let n = n as f64;
        assert!((s1 / n).abs() < 3e-3, "mean {}", s1 / n);
        assert!((s2 / n - 1.0).abs() < 5e-3, "variance {}", s2 / n);
        assert!((s4 / n - 3.0).abs() < 0.05, "fourth moment {}", s4 / n);
        // P(|x| > 3) = 2.70e-3, P(|x| > 3.4426) = 5.76e-4: the tails are drawn too.
        assert!((tail3 as f64 / n - 2.70e-3).abs() < 2.5e-4, "P(|x|>3) = {}", tail3 as f64 / n);
        assert!((tail_r as f64 / n - 5.76e-4).abs() < 1e-4, "P(|x|>r) = {}", tail_r as f64 / n);
    }

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::from_parts(7, "x", 0);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::from_parts(7, "x", 0);
                move |_| r.next_u64()
            })
            .collect();
        let c: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::from_parts(7, "x", 1);
                move |_| r.next_u64()
            })
            .collect();
        let d: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::from_parts(8, "x", 0);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        // Reference value of xoshiro256++ seeded with SplitMix64(0): pins the algorithm.
        let mut r = Rng::new(0);
        assert_eq!(r.next_u64(), 0x53175d61490b23df);
    }
}
