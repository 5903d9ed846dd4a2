//! The activations of an integer matmul: rows quantized per 32-block to int8 with their block sums
//! and scales (`QuantRows`), in portable code or AVX-512 (the same bits).

use super::layout::{Tile, QK};
use super::level::{int_level, IntLevel};
use crate::kernels::par::Par;
use std::ops::Range;

/// m rows of k activations quantized per 32-block to int8 (q8_0 with an f32 scale): x ≈ d · q,
/// d = max|x| / 127, q = round-half-even(x · 127 / max|x|) in [-127, 127], and the block sums
/// Σ q that undo the weights' unsigned offset. A row or block with a NaN or infinite value gets
/// d = NaN, so its outputs are NaN (as the f32 path would give), never a silent finite value.
#[derive(Default)]
pub struct QuantRows {
    pub m: usize,
    pub k: usize,
    /// bytes per row of `q` (k, rounded up to a multiple of 64)
    pub(super) kp: usize,
    pub(super) q: Vec<i8>,
    /// where the rows start in `q` (a 64-byte boundary)
    pub(super) qo: usize,
    pub(super) s: Vec<i32>,
    pub(super) d: Vec<f32>,
}

impl QuantRows {
    /// The first row's quants (row t at `+ t·kp`).
    pub(super) fn quants(&self) -> *const i8 {
        self.q[self.qo..].as_ptr()
    }

    /// Quantize x (m × k, row-major; k a multiple of 32), each row on its own (per-row work:
    /// the result for a row does not depend on the others), split over `par`'s threads when large.
    pub fn quantize(&mut self, par: &Par, x: &[f32], m: usize, k: usize) {
        assert!(k % QK == 0 && x.len() >= m * k, "quantize rows: {m} × {k} from {} floats", x.len());
        let nb = k / QK;
        let kp = k.div_ceil(64) * 64;
        self.m = m;
        self.k = k;
        self.kp = kp;
        // whole 16-row tiles readable (AMX's A tiles read 16 token rows; the rows past m are not
        // used), from a 64-byte boundary (a row a whole number of cache lines)
        self.q.resize(m.div_ceil(16) * 16 * kp + 128, 0);
        self.qo = self.q.as_ptr().align_offset(64);
        self.s.resize(m * nb, 0);
        self.d.resize(m * nb, 0.0);
        let (qp, sp, dp) =
            (Shared(self.q[self.qo..].as_mut_ptr()), Shared(self.s.as_mut_ptr()), Shared(self.d.as_mut_ptr()));
        let body = |rows: Range<usize>| {
            let (qp, sp, dp) = (qp, sp, dp);
            for t in rows {
                // SAFETY: row t's slices of q, s and d are written by this unit only.
                let (q, s, d) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(qp.0.add(t * kp), k),
                        std::slice::from_raw_parts_mut(sp.0.add(t * nb), nb),
                        std::slice::from_raw_parts_mut(dp.0.add(t * nb), nb),
                    )
                };
                quantize_row(&x[t * k..(t + 1) * k], q, s, d);
            }
        };
        if par.threads > 1 && m * k >= 1 << 16 {
            par.run(m, body);
        } else {
            body(0..m);
        }
    }
}

/// A raw pointer shared by threads that write disjoint ranges.
#[derive(Clone, Copy)]
pub(super) struct Shared<T>(pub(super) *mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

/// One row: per 32-block the int8 quants, their sum and the scale (see `QuantRows`): AVX-512
/// where the CPU has it (`x86::quantize_row_avx512`), else portable code (lane-wise max,
/// rounding with the 1.5·2²³ trick, which rounds half to even for |v| < 2²²). Both give the same
/// bits (max is exact in any order, the scale is the same division, and both round half to even).
pub fn quantize_row(x: &[f32], q: &mut [i8], s: &mut [i32], d: &mut [f32]) {
    let nb = x.len() / QK;
    assert!(
        q.len() >= nb * QK && s.len() >= nb && d.len() >= nb,
        "quantize_row: {} values into {} quants",
        x.len(),
        q.len()
    );
    #[cfg(target_arch = "x86_64")]
    if matches!(int_level(), IntLevel::Amx | IntLevel::Avx512Vnni) {
        // SAFETY: the level implies AVX-512 F + BW; the slices were checked above
        unsafe { x86::quantize_row_avx512(x.as_ptr(), nb, q.as_mut_ptr(), s.as_mut_ptr(), d.as_mut_ptr()) };
        return;
    }
    quantize_row_portable(x, q, s, d)
}

/// `quantize_row` in portable code (see there).
pub fn quantize_row_portable(x: &[f32], q: &mut [i8], s: &mut [i32], d: &mut [f32]) {
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let mut bad = [false; QK];
        for i in 0..QK {
            bad[i] = !(xb[i].abs() < f32::INFINITY); // NaN or ±inf
        }
        let finite = !bad.iter().any(|&v| v);
        // max |x| as a tree of lane-wise maxima (32 → 16 → … → 1)
        let mut mx = [0f32; QK];
        for i in 0..QK {
            mx[i] = xb[i].abs();
        }
        let mut w = QK / 2;
        while w > 0 {
            for i in 0..w {
                mx[i] = if mx[i + w] > mx[i] { mx[i + w] } else { mx[i] };
            }
            w /= 2;
        }
        let amax = mx[0];
        let id = if amax > 0.0 && finite { 127.0 / amax } else { 0.0 };
        let qb = &mut q[b * QK..(b + 1) * QK];
        let mut r = [0i32; QK];
        for i in 0..QK {
            // |xb·id| ≤ 127 (or NaN · 0 = NaN when not finite: then id is 0 and the lane is zeroed)
            let v = xb[i] * id;
            let v = if v.is_nan() { 0.0 } else { v };
            let rv = ((v + ROUND) - ROUND).clamp(-127.0, 127.0);
            // SAFETY: rv is an integer in [-127, 127] (finite: NaN was zeroed above)
            r[i] = unsafe { rv.to_int_unchecked::<i32>() };
        }
        let mut sum = 0i32;
        for i in 0..QK {
            qb[i] = r[i] as i8;
            sum += r[i];
        }
        s[b] = sum;
        d[b] = if finite { amax / 127.0 } else { f32::NAN };
    }
}

impl Tile {
    /// The tile of tokens from `t` over blocks b0..b0 + blocks of `x`, against the group's units from
    /// `w` (`stride` bytes apart), its outputs at `y`, resumed when b0 > 0.
    ///
    /// Safety: as `Tile`'s pointers (t and the blocks within x; w and y covering them).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn of(
        x: &QuantRows,
        w: *const u8,
        stride: usize,
        t: usize,
        b0: usize,
        blocks: usize,
        y: *mut f32,
    ) -> Tile {
        let nb = x.k / QK;
        Tile {
            w,
            stride,
            x: x.quants().add(t * x.kp + b0 * QK),
            xs: x.kp,
            sx: x.s.as_ptr().add(t * nb + b0),
            dx: x.d.as_ptr().add(t * nb + b0),
            ds: nb,
            blocks,
            y,
            resume: b0 > 0,
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::QK;
    use std::arch::x86_64::*;

    /// `super::quantize_row` of nb 32-blocks at `x` into `q` (nb·32 bytes), `s` and `d` (nb each).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_row_avx512(x: *const f32, nb: usize, q: *mut i8, s: *mut i32, d: *mut f32) {
        let inf = _mm512_set1_ps(f32::INFINITY);
        for b in 0..nb {
            let (x0, x1) = (_mm512_loadu_ps(x.add(b * QK)), _mm512_loadu_ps(x.add(b * QK + 16)));
            let (a0, a1) = (_mm512_abs_ps(x0), _mm512_abs_ps(x1));
            // |x| < inf is false for NaN and ±inf
            let finite =
                _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a0, inf) & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a1, inf) == 0xFFFF;
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            if !finite || amax <= 0.0 {
                std::ptr::write_bytes(q.add(b * QK), 0, QK);
                *s.add(b) = 0;
                *d.add(b) = if finite { amax / 127.0 } else { f32::NAN };
                continue;
            }
            // as the portable code: v = x·(127/amax), NaN (0·inf, amax below 127/f32::MAX) to 0,
            // clamped to ±127 as a float (inf too), then rounded half to even
            let id = _mm512_set1_ps(127.0 / amax);
            let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
            const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let round = |x: __m512| {
                let v = _mm512_mul_ps(x, id);
                let v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v), v);
                _mm512_cvt_roundps_epi32::<RNE>(_mm512_min_ps(_mm512_max_ps(v, lo), hi))
            };
            let (r0, r1) = (round(x0), round(x1));
            _mm_storeu_si128(q.add(b * QK).cast(), _mm512_cvtepi32_epi8(r0));
            _mm_storeu_si128(q.add(b * QK + 16).cast(), _mm512_cvtepi32_epi8(r1));
            *s.add(b) = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
            *d.add(b) = amax / 127.0;
        }
    }
}
