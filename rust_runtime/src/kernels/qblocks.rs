//! How one block of weights is quantized: GGML's q8_0, q4_0 and q4_K rounding rules, as
//! llama.cpp's `quantize_row_*_ref` and gguf-py's `quants.quantize` apply them, so that a matrix
//! quantized here holds the numbers a GGUF of that type holds. The packed layouts that the
//! kernels read are `kernels::int`'s; this module only decides the numbers.

use half::f16;

/// Weights per block of q8_0 and q4_0, and per sub-block of q4_K (GGML's QK8_0 = QK4_0 = 32).
pub const QK: usize = 32;
/// Weights per q4_K super-block (GGML's QK_K).
pub const QK_K: usize = 256;

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// 8-bit: w = d · q, q in [-127, 127], d = max|w| / 127 (f16), 32 weights a block.
    Q8_0,
    /// 4-bit: w = d · (q − 8), q in [0, 15], d = (the w of largest |w|) / −8 (f16), 32 weights a block.
    Q4_0,
    /// 4-bit K-quant: super-blocks of 256 = 8 sub-blocks of 32, w = d·sc·q − dmin·m with q in
    /// [0, 15] and a 6-bit scale sc and min m per sub-block, d and dmin f16 per super-block; the
    /// scales and mins minimize a weighted squared error (GGML's q4_K).
    Q4K,
}

impl BlockKind {
    /// GGML's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Q8_0 => "q8_0",
            BlockKind::Q4_0 => "q4_0",
            BlockKind::Q4K => "q4_k",
        }
    }

    /// Weights along a row that one scale unit covers: the in_features must be a multiple.
    pub const fn block(self) -> usize {
        match self {
            BlockKind::Q8_0 | BlockKind::Q4_0 => QK,
            BlockKind::Q4K => QK_K,
        }
    }
}

/// q8_0: the f16 scale d = max|w| / 127 and q = round-half-away(w / d) in [-127, 127] (computed with
/// the f32 1/d, as GGML does).
pub fn q8_0(src: &[f32; QK], q: &mut [i8; QK]) -> f16 {
    let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(src) {
        *o = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
    f16::from_f32(d)
}

/// q4_0: d = w_max / −8 where w_max is the weight of largest |w|, q = trunc(w / d + 8.5) clamped
/// to [0, 15] (with the f32 1/d), d stored as f16; w ≈ d · (q − 8).
pub fn q4_0(src: &[f32; QK], q: &mut [u8; QK]) -> f16 {
    let mut wmax = 0f32;
    for &v in src {
        if v.abs() > wmax.abs() {
            wmax = v;
        }
    }
    let d = wmax / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(src) {
        *o = (v * id + 8.5).trunc().clamp(0.0, 15.0) as u8;
    }
    f16::from_f32(d)
}

/// One q4_K super-block: w[32·j + i] ≈ f32(d)·sc[j]·q[32·j + i] − f32(dmin)·m[j].
#[derive(Clone, Debug, PartialEq)]
pub struct Q4KBlock {
    pub d: f16,
    pub dmin: f16,
    /// 6-bit (0..=63) scale of each sub-block.
    pub sc: [u8; 8],
    /// 6-bit (0..=63) min of each sub-block.
    pub m: [u8; 8],
    pub q: [u8; QK_K],
}

impl Q4KBlock {
    /// The weight at `i` (0..256) as the kernels use it: (d·sc)·q − (dmin·m), each product exact in f32.
    pub fn weight(&self, i: usize) -> f32 {
        let j = i / QK;
        let ds = self.d.to_f32() * self.sc[j] as f32;
        let dm = self.dmin.to_f32() * self.m[j] as f32;
        ds * self.q[i] as f32 - dm
    }
}

/// The nearest integer, ties to even, as GGML's `nearest_int` computes it for |v| < 2²² (adding
/// and subtracting 1.5·2²³).
fn nearest(v: f32) -> i32 {
    const ROUND: f32 = 12_582_912.0;
    ((v + ROUND) - ROUND) as i32
}

/// GGML's q4_K quantization of one super-block of 256 weights: per sub-block of 32, a scale and a
/// min that minimize Σ wᵢ·(scale·q + min − x)² with weights wᵢ = rms(x) + |xᵢ| (`make_qkx2_quants`:
/// a start from the block's range, then 21 trial scales around it, each solved for the best
/// scale and min by least squares); the 8 scales and 8 mins are then quantized to 6 bits against
/// their largest (d = max scale / 63, dmin = max min / 63, both f16), and q is recomputed with the
/// rounded scales. Checked against llama.cpp's `quantize_row_q4_K_ref` (libggml-base 0.25.3, via
/// ctypes): the same bytes for 3995 of 4000 random super-blocks (normal, skewed, 1 % outliers ×30,
/// zeros); the 5 others hold outliers, where the 21-step search meets near-ties in float rounding.
pub fn q4_k(src: &[f32; QK_K]) -> Q4KBlock {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut q = [0u8; QK_K];
    for j in 0..8 {
        let x: &[f32; QK] = src[j * QK..(j + 1) * QK].try_into().expect("a sub-block");
        let av = (x.iter().map(|v| v * v).sum::<f32>() / QK as f32).sqrt();
        let w: [f32; QK] = std::array::from_fn(|i| av + x[i].abs());
        let (scale, min) = best_scale_min(x, &w, &mut q[j * QK..(j + 1) * QK]);
        scales[j] = scale;
        mins[j] = min;
    }
    // (a zero block's min is −0: starting at +0 and keeping only larger values leaves dmin +0)
    let max_scale = scales.iter().fold(0f32, |a, &v| if v > a { v } else { a });
    let max_min = mins.iter().fold(0f32, |a, &v| if v > a { v } else { a });
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        sc[j] = nearest(inv_scale * scales[j]).clamp(0, 63) as u8;
        m[j] = nearest(inv_min * mins[j]).clamp(0, 63) as u8;
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..8 {
        let ds = d.to_f32() * sc[j] as f32;
        if ds == 0.0 {
            continue; // q stays as found (any q times a zero scale is 0)
        }
        let dm = dmin.to_f32() * m[j] as f32;
        for i in 0..QK {
            q[j * QK + i] = nearest((src[j * QK + i] + dm) / ds).clamp(0, 15) as u8;
        }
    }
    Q4KBlock { d, dmin, sc, m, q }
}

/// `make_qkx2_quants(32, 15, x, w, L, &min, Laux, −1, 0.1, 20, false)`: the scale (≥ 0) and the
/// min (returned ≥ 0, meaning x ≈ scale·q − min) of one sub-block, and its quants in `l`.
fn best_scale_min(x: &[f32; QK], w: &[f32; QK], l: &mut [u8]) -> (f32, f32) {
    const NMAX: f32 = 15.0;
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = w[0] * x[0];
    for i in 1..QK {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..QK].fill(0);
        return (0.0, -min);
    }
    let mut iscale = NMAX / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..QK {
        let q = nearest(iscale * (x[i] - min)).clamp(0, 15);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best += w[i] * diff * diff;
    }
    let mut aux = [0u8; QK];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + NMAX) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..QK {
            let q = nearest(iscale * (x[i] - min)).clamp(0, 15);
            aux[i] = q as u8;
            let qf = q as f32;
            sum_l += w[i] * qf;
            sum_l2 += w[i] * qf * qf;
            sum_xl += w[i] * qf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut err = 0f32;
            for i in 0..QK {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                err += w[i] * diff * diff;
            }
            if err < best {
                l[..QK].copy_from_slice(&aux);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_and_q4_0_follow_ggml() {
        let x: [f32; QK] = std::array::from_fn(|i| (i as f32 - 20.0) * 0.37);
        let mut q8 = [0i8; QK];
        let d = q8_0(&x, &mut q8).to_f32();
        assert_eq!(d, f16::from_f32(20.0 * 0.37 / 127.0).to_f32()); // max |x| = |x[0]| = 7.4
        let mut q4 = [0u8; QK];
        let d4 = q4_0(&x, &mut q4).to_f32();
        assert_eq!(d4, f16::from_f32(-20.0 * 0.37 / -8.0).to_f32()); // w_max = x[0] = −7.4 → d > 0
        assert_eq!(q4[0], 0); // −7.4 / 0.925 + 8.5 = 0.5 → 0
        for i in 0..QK {
            assert!((q8[i] as f32 * d - x[i]).abs() <= d * 0.51);
            assert!(((q4[i] as f32 - 8.0) * d4 - x[i]).abs() <= d4 * 0.51 + 1e-3);
        }
        assert_eq!(q8_0(&[0.0; QK], &mut q8).to_f32(), 0.0);
        assert!(q8.iter().all(|&v| v == 0));
    }

    #[test]
    fn q4_k_beats_q4_0_and_uses_its_mins() {
        // skewed sub-blocks (all positive, offset): where a min pays off
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let x: [f32; QK_K] = std::array::from_fn(|i| if (i / QK) % 2 == 0 { 1.0 + rnd() } else { rnd() - 0.5 });
        let b = q4_k(&x);
        let err_k: f32 = (0..QK_K).map(|i| (b.weight(i) - x[i]).powi(2)).sum();
        let mut err_0 = 0f32;
        for j in 0..8 {
            let s: [f32; QK] = x[j * QK..(j + 1) * QK].try_into().unwrap();
            let mut q = [0u8; QK];
            let d = q4_0(&s, &mut q).to_f32();
            err_0 += (0..QK).map(|i| ((q[i] as f32 - 8.0) * d - s[i]).powi(2)).sum::<f32>();
        }
        assert!(err_k < 0.5 * err_0, "q4_K {err_k} vs q4_0 {err_0}");
        assert!(b.m.iter().any(|&m| m > 0) && b.sc.iter().all(|&s| s <= 63) && b.q.iter().all(|&q| q <= 15));
        // every weight within about one step of its value
        for i in 0..QK_K {
            let step = b.d.to_f32() * b.sc[i / QK] as f32;
            assert!((b.weight(i) - x[i]).abs() <= step * 1.01 + 0.02, "{i}: {} vs {}", b.weight(i), x[i]);
        }
        let z = q4_k(&[0.0; QK_K]);
        assert!((0..QK_K).all(|i| z.weight(i) == 0.0));
    }
}
