//! Elementwise f32 ops of the forward and the sampler: RMSNorm, SiLU, RoPE, softmax and its parts,
//! and a libm-free e^x, each compiled for the SIMD level the CPU has (the same bits at every level).

use super::simd::{simd_level, SimdLevel};

/// Run `$body(args)` compiled for AVX-512 or AVX2 + FMA when `simd_level()` has them, else as
/// built (a portable build targets SSE2). For elementwise loops written to vectorize: the same
/// IEEE operations per element whatever the width (Rust never contracts a·b + c into an fma), so
/// every level gives the same bits.
macro_rules! simd_versions {
    ($body:ident ( $($arg:ident : $ty:ty),* )) => {
        simd_versions!($body ( $($arg : $ty),* ) -> ())
    };
    ($body:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,fma")]
            unsafe fn avx512($($arg: $ty),*) -> $ret { $body($($arg),*) }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) -> $ret { $body($($arg),*) }
            match simd_level() {
                // SAFETY: the level was detected on this CPU
                SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                SimdLevel::Avx2Fma => return unsafe { avx2($($arg),*) },
                SimdLevel::Generic => {}
            }
        }
        $body($($arg),*)
    }};
}

/// HF LlamaRMSNorm in f32: x * rsqrt(mean(x²) + eps) * weight. The mean is accumulated in f64,
/// in 8 lanes (lane j sums the squares at j, j + 8, …, then the lanes in a fixed tree), so that
/// the sum vectorizes; the order depends on the row's length only.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    simd_versions!(rms_norm_body(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]))
}

#[inline(always)]
fn rms_norm_body(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let mut lanes = [0f64; 8];
    let mut c = x.chunks_exact(8);
    for ch in &mut c {
        for j in 0..8 {
            lanes[j] += (ch[j] as f64) * (ch[j] as f64);
        }
    }
    for (j, &v) in c.remainder().iter().enumerate() {
        lanes[j] += (v as f64) * (v as f64);
    }
    let ss = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    let var = (ss / n as f64) as f32;
    let inv = 1.0f32 / (var + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// e^x in f32 without libm (Cephes' expf polynomial, ≤ 2 ulp on [-87, 88]); written
/// branch-free so loops over it vectorize. e^x for x < -87.3 (including -inf) is 0, NaN stays NaN.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding and subtracting rounds to an integer
    let xc = x.clamp(-87.3, 88.3);
    let t = xc * LOG2E + ROUND; // ROUND + n exactly, n an integer in [-126, 127]
    let n = t - ROUND;
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * r * r + r + 1.0;
    // 2^n from t's bits (ROUND's are 0x4B40_0000, n adds to them): integer operations only, so
    // the loop vectorizes (`n as i32`, a saturating conversion, did not)
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    let v = y * scale;
    if x < -87.3 {
        0.0
    } else if x.is_nan() {
        x
    } else {
        v
    }
}

/// out[i] = silu(gate[i]) * up[i].
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    simd_versions!(silu_mul_body(gate: &[f32], up: &[f32], out: &mut [f32]))
}

#[inline(always)]
fn silu_mul_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = (g / (1.0 + exp_approx(-g))) * u;
    }
}

/// Rotate-half RoPE (GPT-NeoX / Hugging Face layout) of one head vector in place:
/// out[i] = x[i]·cos[i] − x[i+h]·sin[i], out[i+h] = x[i+h]·cos[i] + x[i]·sin[i], h = len/2.
#[inline]
pub fn rope_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// max(x) (NaN ignored) and whether x holds a NaN or +inf, in one vectorizable pass.
pub fn max_and_bad(x: &[f32]) -> (f32, bool) {
    simd_versions!(max_and_bad_body(x: &[f32]) -> (f32, bool))
}

#[inline(always)]
fn max_and_bad_body(x: &[f32]) -> (f32, bool) {
    let mut m = [f32::NEG_INFINITY; 16];
    let mut bad = [false; 16];
    let mut c = x.chunks_exact(16);
    for ch in &mut c {
        for j in 0..16 {
            let v = ch[j];
            m[j] = if v > m[j] { v } else { m[j] };
            bad[j] |= !(v < f32::INFINITY);
        }
    }
    let mut mm = f32::NEG_INFINITY;
    let mut b = false;
    for &v in c.remainder() {
        mm = if v > mm { v } else { mm };
        b |= !(v < f32::INFINITY);
    }
    for j in 0..16 {
        mm = if m[j] > mm { m[j] } else { mm };
        b |= bad[j];
    }
    (mm, b)
}

/// Σ e^(x[i] − m), accumulated in 16 f32 lanes and summed in f64.
pub fn sum_exp_shifted(x: &[f32], m: f32) -> f64 {
    simd_versions!(sum_exp_shifted_body(x: &[f32], m: f32) -> f64)
}

#[inline(always)]
fn sum_exp_shifted_body(x: &[f32], m: f32) -> f64 {
    let mut acc = [0f32; 16];
    let mut c = x.chunks_exact(16);
    for ch in &mut c {
        for j in 0..16 {
            acc[j] += exp_approx(ch[j] - m);
        }
    }
    let mut s: f64 = c.remainder().iter().map(|&v| exp_approx(v - m) as f64).sum();
    for a in acc {
        s += a as f64;
    }
    s
}

/// In-place softmax over `x` (max-subtracted; the exps in one vectorized pass, summed in 16 lanes).
pub fn softmax_inplace(x: &mut [f32]) {
    simd_versions!(softmax_inplace_body(x: &mut [f32]))
}

#[inline(always)]
fn softmax_inplace_body(x: &mut [f32]) {
    let (m, _) = max_and_bad_body(x);
    for v in x.iter_mut() {
        *v = exp_approx(*v - m);
    }
    let mut acc = [0f32; 16];
    let mut c = x.chunks_exact(16);
    for ch in &mut c {
        for j in 0..16 {
            acc[j] += ch[j];
        }
    }
    let s = acc.iter().sum::<f32>() + c.remainder().iter().sum::<f32>();
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_is_rotate_half_and_matches_candle_nn() {
        use candle_core::{Device, Tensor};
        // (b=1, h=2, t=3, d=8) against candle_nn::rotary_emb::rope (the rotate-half variant)
        let (h, t, d) = (2usize, 3usize, 8usize);
        let xs: Vec<f32> = (0..h * t * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let cos: Vec<f32> = (0..t * d / 2).map(|i| (i as f32 * 0.11).cos()).collect();
        let sin: Vec<f32> = (0..t * d / 2).map(|i| (i as f32 * 0.11).sin()).collect();
        let xt = Tensor::from_vec(xs.clone(), (1, h, t, d), &Device::Cpu).unwrap();
        let ct = Tensor::from_vec(cos.clone(), (t, d / 2), &Device::Cpu).unwrap();
        let st = Tensor::from_vec(sin.clone(), (t, d / 2), &Device::Cpu).unwrap();
        let want: Vec<f32> =
            candle_nn::rotary_emb::rope(&xt, &ct, &st).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let interleaved: Vec<f32> =
            candle_nn::rotary_emb::rope_i(&xt, &ct, &st).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let mut got = xs.clone();
        for hh in 0..h {
            for tt in 0..t {
                let o = (hh * t + tt) * d;
                rope_half(&mut got[o..o + d], &cos[tt * d / 2..(tt + 1) * d / 2], &sin[tt * d / 2..(tt + 1) * d / 2]);
            }
        }
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6);
        }
        // and it is not the interleaved variant
        assert!(got.iter().zip(&interleaved).any(|(a, b)| (a - b).abs() > 1e-3));
    }

    #[test]
    fn exp_approx_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_approx(-1000.0), 0.0);
        assert_eq!(exp_approx(0.0), 1.0);
        assert!(exp_approx(f32::NAN).is_nan());
        let v = [1.0f32, f32::NEG_INFINITY, 3.0, 2.5];
        let (m, bad) = max_and_bad(&v);
        assert_eq!((m, bad), (3.0, false));
        assert!(max_and_bad(&[1.0, f32::NAN]).1);
        assert!(max_and_bad(&[1.0, f32::INFINITY]).1);
        let big: Vec<f32> = (0..100).map(|i| i as f32 * 0.1).collect();
        let want: f64 = big.iter().map(|&v| ((v - 9.9) as f64).exp()).sum();
        assert!((sum_exp_shifted(&big, 9.9) - want).abs() < 1e-6 * want);
    }

    #[test]
    fn rms_norm_and_softmax() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        let inv = 1.0 / (ms + 1e-5).sqrt();
        for i in 0..4 {
            assert!((out[i] - x[i] * inv * w[i]).abs() < 1e-6);
        }
        let mut s = [1.0f32, 2.0, 3.0];
        softmax_inplace(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[2] > s[1] && s[1] > s[0]);
    }
}
