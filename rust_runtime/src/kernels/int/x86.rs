//! The integer register tiles and decode kernels on x86-64: AVX-512 VNNI (`vpdpbusd`) and AVX2
//! (`vpmaddubsw`), each computing the chain of `kernels::int`.

use super::layout::{BlockKind, Layout, Tile, GROUP, K_DMIN, K_HEADER, K_M, K_SC, PANEL, Q4_BYTES, QK, SCALES};
use super::rows::QuantRows;
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn bcast4(p: *const i8) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

#[inline(always)]
unsafe fn bcast4y(p: *const i8) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// 16 f16 at `p` as f32.
#[inline(always)]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}

/// 16 bytes at `p` (0..=255) as f32.
#[inline(always)]
unsafe fn u8x16(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())))
}

/// One block's 4-bit quants of the two panels × T tokens into `acc` (4 loads a panel, split
/// into low and high nibbles: 8 `vpdpbusd` steps).
#[inline(always)]
unsafe fn dot4<const T: usize>(acc: &mut [[__m512i; 2]; T], q: *const u8, x: *const i8, xs: usize) {
    let low = _mm512_set1_epi8(0x0F);
    for j in 0..4 {
        for p in 0..2 {
            let v = _mm512_loadu_si512(q.add(j * GROUP * 4 + p * 64).cast());
            let lo = _mm512_and_si512(v, low);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
            for i in 0..T {
                let xp = x.add(i * xs + 8 * j);
                acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], lo, bcast4(xp));
                acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], hi, bcast4(xp.add(4)));
            }
        }
    }
}

/// One tile on AVX-512 VNNI, q8_0 or q4_0: T tokens × one group (2 panels) in 2·T int32
/// accumulators (one block) and 2·T f32 accumulators (the chains). Per block: the int
/// accumulators start at −offset · Σx (undoing the unsigned weights), 8 `vpdpbusd` steps
/// (q8_0: a 64-byte load a panel a step; q4_0: `dot4`), then per panel and token
/// acc = fma(cvt(isum), dw · dx, acc).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
#[allow(clippy::needless_range_loop)]
pub unsafe fn tile_vnni<const Q4: bool, const T: usize>(t: &Tile) {
    let mut accf = [[_mm512_setzero_ps(); 2]; T];
    if t.resume {
        for i in 0..T {
            for p in 0..2 {
                accf[i][p] = _mm512_loadu_ps(t.y.add(i * GROUP + p * PANEL));
            }
        }
    }
    let off = if Q4 { BlockKind::Q4_0 } else { BlockKind::Q8_0 }.offset();
    for b in 0..t.blocks {
        let gb = t.w.add(b * t.stride);
        let q = gb.add(SCALES);
        let mut acc = [[_mm512_setzero_si512(); 2]; T];
        for i in 0..T {
            let c = _mm512_set1_epi32(-off * *t.sx.add(i * t.ds + b));
            acc[i] = [c, c];
        }
        if Q4 {
            dot4::<T>(&mut acc, q, t.x.add(b * QK), t.xs);
        } else {
            for s in 0..8 {
                for p in 0..2 {
                    let v = _mm512_loadu_si512(q.add(s * GROUP * 4 + p * 64).cast());
                    for i in 0..T {
                        let xp = t.x.add(i * t.xs + b * QK + 4 * s);
                        acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], v, bcast4(xp));
                    }
                }
            }
        }
        let dw = [f16x16(gb), f16x16(gb.add(32))];
        for i in 0..T {
            let dx = _mm512_set1_ps(*t.dx.add(i * t.ds + b));
            for p in 0..2 {
                accf[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][p]), _mm512_mul_ps(dw[p], dx), accf[i][p]);
            }
        }
    }
    for i in 0..T {
        for p in 0..2 {
            _mm512_storeu_ps(t.y.add(i * GROUP + p * PANEL), accf[i][p]);
        }
    }
}

/// One tile on AVX-512 VNNI, q4_K: as `tile_vnni` with the nibbles as they are (no offset),
/// and per sub-block j the scales ds = d·sc and dm = dmin·m of its unit:
/// acc = fma(cvt(isum), ds·dx, acc), then acc = acc − Σx·(dm·dx).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
#[allow(clippy::needless_range_loop)]
pub unsafe fn tile_vnni_k<const T: usize>(t: &Tile) {
    let mut accf = [[_mm512_setzero_ps(); 2]; T];
    if t.resume {
        for i in 0..T {
            for p in 0..2 {
                accf[i][p] = _mm512_loadu_ps(t.y.add(i * GROUP + p * PANEL));
            }
        }
    }
    for u in 0..t.blocks / 8 {
        let ub = t.w.add(u * t.stride);
        let d = [f16x16(ub), f16x16(ub.add(32))];
        let dmin = [f16x16(ub.add(K_DMIN)), f16x16(ub.add(K_DMIN + 32))];
        for j in 0..8 {
            let b = u * 8 + j;
            let mut acc = [[_mm512_setzero_si512(); 2]; T];
            dot4::<T>(&mut acc, ub.add(K_HEADER + j * Q4_BYTES), t.x.add(b * QK), t.xs);
            let mut ds = [_mm512_setzero_ps(); 2];
            let mut dm = [_mm512_setzero_ps(); 2];
            for p in 0..2 {
                ds[p] = _mm512_mul_ps(d[p], u8x16(ub.add(K_SC + j * GROUP + p * PANEL)));
                dm[p] = _mm512_mul_ps(dmin[p], u8x16(ub.add(K_M + j * GROUP + p * PANEL)));
            }
            for i in 0..T {
                let dx = _mm512_set1_ps(*t.dx.add(i * t.ds + b));
                let sx = _mm512_set1_ps(*t.sx.add(i * t.ds + b) as f32);
                for p in 0..2 {
                    let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][p]), _mm512_mul_ps(ds[p], dx), accf[i][p]);
                    accf[i][p] = _mm512_fnmadd_ps(sx, _mm512_mul_ps(dm[p], dx), a);
                }
            }
        }
    }
    for i in 0..T {
        for p in 0..2 {
            _mm512_storeu_ps(t.y.add(i * GROUP + p * PANEL), accf[i][p]);
        }
    }
}

/// One token against G whole groups at once (decode), q8_0 or q4_0: the chain of
/// `tile_vnni`, the G groups read as G sequential streams (group g at `w + g·gs`), outputs
/// to `y[32·g ..]`; with a software prefetch a few blocks ahead where `gemv_prefetch` says so.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
#[allow(clippy::needless_range_loop)]
pub unsafe fn gemv_vnni<const Q4: bool, const G: usize>(
    w: *const u8,
    gs: usize,
    x: &QuantRows,
    nb: usize,
    y: *mut f32,
) {
    let kind = if Q4 { BlockKind::Q4_0 } else { BlockKind::Q8_0 };
    let (stride, off) = (kind.unit_bytes(), kind.offset());
    let low = _mm512_set1_epi8(0x0F);
    let mut accf = [[_mm512_setzero_ps(); 2]; G];
    let xq = x.quants();
    let prefetch = super::level::gemv_prefetch();
    for b in 0..nb {
        let c = _mm512_set1_epi32(-off * x.s[b]);
        let mut acc = [[c; 2]; G];
        let xb = xq.add(b * QK);
        if prefetch {
            for g in 0..G {
                // a few blocks ahead (a prefetch never faults, so it may run past the matrix)
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(g * gs + (b + 4) * stride).cast());
            }
        }
        if Q4 {
            for j in 0..4 {
                let x0 = bcast4(xb.add(8 * j));
                let x1 = bcast4(xb.add(8 * j + 4));
                for g in 0..G {
                    let q = w.add(g * gs + b * stride + SCALES);
                    for p in 0..2 {
                        let v = _mm512_loadu_si512(q.add(j * GROUP * 4 + p * 64).cast());
                        let lo = _mm512_and_si512(v, low);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        acc[g][p] = _mm512_dpbusd_epi32(acc[g][p], lo, x0);
                        acc[g][p] = _mm512_dpbusd_epi32(acc[g][p], hi, x1);
                    }
                }
            }
        } else {
            for s in 0..8 {
                let x0 = bcast4(xb.add(4 * s));
                for g in 0..G {
                    let q = w.add(g * gs + b * stride + SCALES);
                    for p in 0..2 {
                        let v = _mm512_loadu_si512(q.add(s * GROUP * 4 + p * 64).cast());
                        acc[g][p] = _mm512_dpbusd_epi32(acc[g][p], v, x0);
                    }
                }
            }
        }
        let dx = _mm512_set1_ps(x.d[b]);
        for g in 0..G {
            let gb = w.add(g * gs + b * stride);
            for p in 0..2 {
                let dw = f16x16(gb.add(p * 32));
                accf[g][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][p]), _mm512_mul_ps(dw, dx), accf[g][p]);
            }
        }
    }
    for g in 0..G {
        for p in 0..2 {
            _mm512_storeu_ps(y.add(g * GROUP + p * PANEL), accf[g][p]);
        }
    }
}

/// `gemv_vnni` for q4_K (the chain of `tile_vnni_k`); `units`: super-blocks per row.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
#[allow(clippy::needless_range_loop)]
pub unsafe fn gemv_vnni_k<const G: usize>(w: *const u8, gs: usize, x: &QuantRows, units: usize, y: *mut f32) {
    let stride = BlockKind::Q4K.unit_bytes();
    let low = _mm512_set1_epi8(0x0F);
    let mut accf = [[_mm512_setzero_ps(); 2]; G];
    let xq = x.quants();
    for u in 0..units {
        for g in 0..G {
            for l in 0..stride / 64 / 8 {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(g * gs + (u + 1) * stride + l * 512).cast());
            }
        }
        for j in 0..8 {
            let b = u * 8 + j;
            let xb = xq.add(b * QK);
            let mut acc = [[_mm512_setzero_si512(); 2]; G];
            for jj in 0..4 {
                let x0 = bcast4(xb.add(8 * jj));
                let x1 = bcast4(xb.add(8 * jj + 4));
                for g in 0..G {
                    let q = w.add(g * gs + u * stride + K_HEADER + j * Q4_BYTES);
                    for p in 0..2 {
                        let v = _mm512_loadu_si512(q.add(jj * GROUP * 4 + p * 64).cast());
                        let lo = _mm512_and_si512(v, low);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        acc[g][p] = _mm512_dpbusd_epi32(acc[g][p], lo, x0);
                        acc[g][p] = _mm512_dpbusd_epi32(acc[g][p], hi, x1);
                    }
                }
            }
            let dx = _mm512_set1_ps(x.d[b]);
            let sx = _mm512_set1_ps(x.s[b] as f32);
            for g in 0..G {
                let ub = w.add(g * gs + u * stride);
                for p in 0..2 {
                    let ds = _mm512_mul_ps(f16x16(ub.add(p * 32)), u8x16(ub.add(K_SC + j * GROUP + p * PANEL)));
                    let dm = _mm512_mul_ps(f16x16(ub.add(K_DMIN + p * 32)), u8x16(ub.add(K_M + j * GROUP + p * PANEL)));
                    let a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][p]), _mm512_mul_ps(ds, dx), accf[g][p]);
                    accf[g][p] = _mm512_fnmadd_ps(sx, _mm512_mul_ps(dm, dx), a);
                }
            }
        }
    }
    for g in 0..G {
        for p in 0..2 {
            _mm512_storeu_ps(y.add(g * GROUP + p * PANEL), accf[g][p]);
        }
    }
}

/// 8 f16 at `p` as f32.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// One block's 4-bit quants of panel half `h` (8 rows) × T tokens (`vpmaddubsw`: nibbles ≤ 15
/// times |x| ≤ 127 never saturate a pair) added to `acc`.
#[inline(always)]
unsafe fn dot4_avx2<const T: usize>(acc: &mut [[__m256i; 2]; T], q: *const u8, x: *const i8, xs: usize) {
    let ones = _mm256_set1_epi16(1);
    let low = _mm256_set1_epi8(0x0F);
    for j in 0..4 {
        for h in 0..2 {
            let v = _mm256_loadu_si256(q.add(j * GROUP * 4 + h * 32).cast());
            let lo = _mm256_and_si256(v, low);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
            for i in 0..T {
                let xp = x.add(i * xs + 8 * j);
                let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, bcast4y(xp)), ones);
                let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, bcast4y(xp.add(4))), ones);
                acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_add_epi32(p0, p1));
            }
        }
    }
}

/// One tile on AVX2, q8_0 or q4_0: T ≤ 3 tokens × panel `p` (16 rows, two ymm halves of 8).
/// q8_0 uses llama.cpp's sign trick (|w| · sign(x, w), so that `vpmaddubsw`'s pair sums stay
/// below 2·127·127) and needs no offset; q4_0 multiplies the nibbles directly and starts
/// from −8 · Σx. Then the same fma per block as every level.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
pub unsafe fn tile_avx2<const Q4: bool, const T: usize>(t: &Tile, p: usize) {
    let mut accf = [[_mm256_setzero_ps(); 2]; T];
    if t.resume {
        for i in 0..T {
            for h in 0..2 {
                accf[i][h] = _mm256_loadu_ps(t.y.add(i * GROUP + p * PANEL + h * 8));
            }
        }
    }
    let ones = _mm256_set1_epi16(1);
    let flip = _mm256_set1_epi8(-128);
    for b in 0..t.blocks {
        let gb = t.w.add(b * t.stride);
        let q = gb.add(SCALES + p * 64);
        let mut acc = [[_mm256_setzero_si256(); 2]; T];
        if Q4 {
            for i in 0..T {
                let c = _mm256_set1_epi32(-BlockKind::Q4_0.offset() * *t.sx.add(i * t.ds + b));
                acc[i] = [c, c];
            }
            dot4_avx2::<T>(&mut acc, q, t.x.add(b * QK), t.xs);
        } else {
            for s in 0..8 {
                for h in 0..2 {
                    let v = _mm256_loadu_si256(q.add(s * GROUP * 4 + h * 32).cast());
                    let ws = _mm256_xor_si256(v, flip); // q + 128 → q (signed)
                    let aw = _mm256_sign_epi8(ws, ws);
                    for i in 0..T {
                        let xv = bcast4y(t.x.add(i * t.xs + b * QK + 4 * s));
                        let p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, ws));
                        acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(p16, ones));
                    }
                }
            }
        }
        let dw = [f16x8(gb.add(p * 32)), f16x8(gb.add(p * 32 + 16))];
        for i in 0..T {
            let dx = _mm256_set1_ps(*t.dx.add(i * t.ds + b));
            for h in 0..2 {
                accf[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), _mm256_mul_ps(dw[h], dx), accf[i][h]);
            }
        }
    }
    for i in 0..T {
        for h in 0..2 {
            _mm256_storeu_ps(t.y.add(i * GROUP + p * PANEL + h * 8), accf[i][h]);
        }
    }
}

/// `tile_avx2` for q4_K (the chain of `tile_vnni_k`).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)]
pub unsafe fn tile_avx2_k<const T: usize>(t: &Tile, p: usize) {
    let mut accf = [[_mm256_setzero_ps(); 2]; T];
    if t.resume {
        for i in 0..T {
            for h in 0..2 {
                accf[i][h] = _mm256_loadu_ps(t.y.add(i * GROUP + p * PANEL + h * 8));
            }
        }
    }
    let u8x8 = |q: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(q.cast())));
    for u in 0..t.blocks / 8 {
        let ub = t.w.add(u * t.stride);
        for j in 0..8 {
            let b = u * 8 + j;
            let mut acc = [[_mm256_setzero_si256(); 2]; T];
            dot4_avx2::<T>(&mut acc, ub.add(K_HEADER + j * Q4_BYTES + p * 64), t.x.add(b * QK), t.xs);
            for h in 0..2 {
                let r = p * PANEL + h * 8;
                let ds = _mm256_mul_ps(f16x8(ub.add(r * 2)), u8x8(ub.add(K_SC + j * GROUP + r)));
                let dm = _mm256_mul_ps(f16x8(ub.add(K_DMIN + r * 2)), u8x8(ub.add(K_M + j * GROUP + r)));
                for i in 0..T {
                    let dx = _mm256_set1_ps(*t.dx.add(i * t.ds + b));
                    let sx = _mm256_set1_ps(*t.sx.add(i * t.ds + b) as f32);
                    let a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), _mm256_mul_ps(ds, dx), accf[i][h]);
                    accf[i][h] = _mm256_fnmadd_ps(sx, _mm256_mul_ps(dm, dx), a);
                }
            }
        }
    }
    for i in 0..T {
        for h in 0..2 {
            _mm256_storeu_ps(t.y.add(i * GROUP + p * PANEL + h * 8), accf[i][h]);
        }
    }
}
