//! Intel AMX-INT8 tiles for the integer matmul's token tiles (`kernels::int`, level `Amx`).
//!
//! AMX (Advanced Matrix Extensions, Sapphire Rapids on) multiplies tiles held in eight 1 KB tile
//! registers: `tdpbsud` adds to C (16 × 16 int32) the products of A (16 rows × K signed bytes) and
//! B (K/4 rows × 16 columns × 4 unsigned bytes, "VNNI" layout), each C element the exact integer
//! Σₖ A[m][k]·B[k/4][4n + k%4] (Intel® 64 and IA-32 Architectures Software Developer's Manual,
//! vol. 2, TDPBSUD; Optimization Reference Manual, ch. 20, "Intel AMX").
//!
//! Here one `tdpbsud` is one 32-block of 16 tokens × one 16-row panel: A is the tokens' int8
//! activations (16 rows of 32 bytes, `QuantRows`' row stride), B the panel's quants exactly as
//! `kernels::int` packs them for `vpdpbusd` (block step s, the panel's 16 rows × 4 bytes at
//! `s·128 + panel·64`: B's rows at a 128-byte stride), and C the block's integer dot products,
//! which the AVX-512 epilogue turns into the module's chain: acc = fma(f32(isum − offset·Σx),
//! dw·dx, acc). The integers are exact, so the outputs are the bits of every other level. q4_0's
//! nibbles are unpacked to bytes once per group chunk (`unpack_q4`) and shared by every token tile.
//!
//! The tile registers are per thread: `configure` loads this module's shapes (`ldtilecfg`) before
//! a thread's tiles and `release` (`tilerelease`) frees them after. Linux hands the tile data
//! state to a process only when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`,
//! kernel 5.16+, Documentation/arch/x86/xstate.rst); `available` asks once. Rust has no stable AMX
//! intrinsics, so the tile instructions are inline assembly.

use super::layout::{Tile, GROUP, Q8_BYTES, QK, SCALES};
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Token rows of one tile (A's and C's rows).
pub const TOKENS: usize = 16;
/// Blocks whose C tiles are stored before the epilogue reads them back (2 KB each).
pub const SUB: usize = 4;

/// Whether this CPU has AMX-TILE and AMX-INT8 (CPUID.(EAX=7,ECX=0):EDX bits 24 and 25) and the OS
/// lets this process use the tile data (asked once; false where the kernel refuses, e.g. before
/// Linux 5.16, and on other systems).
pub fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // leaf 7 is read only where the max leaf covers it
        let cpu = __get_cpuid_max(0).0 >= 7 && (__cpuid_count(7, 0).edx >> 24) & 3 == 3;
        cpu && request_tile_data()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments; it fails cleanly where unsupported.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The 64-byte tile configuration of `ldtilecfg` (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Load this module's tile shapes on the calling thread: tmm0 and tmm1 the two panels' C (16 ×
/// 64 bytes), tmm2 A (16 × 32 bytes), tmm3 and tmm4 the two panels' B (8 × 64 bytes).
///
/// Safety: `available()` must be true.
pub unsafe fn configure() {
    let mut c = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    for (i, (rows, colsb)) in [(16, 64), (16, 64), (16, 32), (8, 64), (8, 64)].into_iter().enumerate() {
        c.rows[i] = rows;
        c.colsb[i] = colsb;
    }
    asm!("ldtilecfg [{}]", in(reg) &c as *const TileConfig, options(nostack, readonly, preserves_flags));
}

/// Free the calling thread's tile registers (back to the initial state, so that context switches
/// stop saving them).
///
/// Safety: `available()` must be true.
pub unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem, preserves_flags));
}

/// Unpack `blocks` q4_0 units of one group (the first at `w`, the next `stride` bytes on) to the
/// q8_0 byte layout at `dst` (Q8_BYTES a block): the low nibbles of a 64-byte step pair are
/// step 2j, the high ones step 2j + 1 (the values q + 8, 0..=15).
///
/// Safety: `w` must cover the units and `dst` blocks · Q8_BYTES bytes.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn unpack_q4(w: *const u8, stride: usize, blocks: usize, dst: *mut u8) {
    let low = _mm512_set1_epi8(0x0F);
    for b in 0..blocks {
        let (q, d) = (w.add(b * stride + SCALES), dst.add(b * Q8_BYTES));
        for j in 0..4 {
            for p in 0..2 {
                let v = _mm512_loadu_si512(q.add(j * GROUP * 4 + p * 64).cast());
                _mm512_storeu_si512(d.add(2 * j * GROUP * 4 + p * 64).cast(), _mm512_and_si512(v, low));
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                _mm512_storeu_si512(d.add((2 * j + 1) * GROUP * 4 + p * 64).cast(), hi);
            }
        }
    }
}

/// One tile: n ≤ 16 tokens of `t` (whose activation rows are read 16 at a time: the rows past n
/// must be readable) × one group of q8_0 or q4_0 (`offset`: 128 or 8) over `t.blocks` blocks, the
/// quants of block b as bytes at `bq + b·bqs` (q8_0: the units themselves; q4_0: `unpack_q4`'s
/// bytes), the scales at `t.w + b·t.stride`. The blocks go in runs of SUB: a run's C tiles are
/// stored to one half of `c` (2 · SUB · 512 int32) while the epilogue reads the other run's from the
/// other half (software pipelining: the tile unit and the vector units overlap, and no load waits
/// on a tile store just issued). The epilogue, per token and panel: acc = fma(f32(isum −
/// offset·Σx), dw·dx, acc), acc in `t.y` (resumed from there when `t.resume`).
///
/// `pf`: `pf_bytes` bytes (the weights the next tiles will read) to prefetch to L2, spread over the
/// runs: without it a 64-token q8_0 prefill of base-400m took 83 ms instead of 69 (2 threads).
///
/// Safety: `configure` ran on this thread; the pointers cover what is described.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile(
    t: &Tile,
    n: usize,
    offset: i32,
    bq: *const u8,
    bqs: usize,
    c: *mut i32,
    pf: *const u8,
    pf_bytes: usize,
) {
    let runs = t.blocks.div_ceil(SUB);
    let pf_run = pf_bytes.div_ceil(runs).next_multiple_of(64);
    products(t, bq, bqs, 0, c);
    for r in 0..runs {
        for off in (r * pf_run..((r + 1) * pf_run).min(pf_bytes)).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(pf.add(off).cast());
        }
        if r + 1 < runs {
            products(t, bq, bqs, (r + 1) * SUB, c.add(((r + 1) % 2) * RUN_INTS));
        }
        let (b0, cr) = (r * SUB, c.add((r % 2) * RUN_INTS));
        if t.blocks - b0 >= SUB {
            epilogue::<SUB>(t, n, offset, b0, cr);
        } else {
            // the last, partial run: a block at a time
            for j in 0..t.blocks - b0 {
                epilogue::<1>(t, n, offset, b0 + j, cr.add(j * 2 * TOKENS * 16));
            }
        }
    }
}

/// int32 of one run's C tiles (SUB blocks × 2 panels × 16 × 16).
pub const RUN_INTS: usize = SUB * 2 * TOKENS * 16;

/// The C tiles of blocks b0.. (up to SUB, within `t.blocks`) to `c`: block j's panel p at
/// `c + (2j + p)·256`, row i (token) 16 int32.
#[inline(always)]
unsafe fn products(t: &Tile, bq: *const u8, bqs: usize, b0: usize, c: *mut i32) {
    for b in b0..(b0 + SUB).min(t.blocks) {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tileloadd tmm2, [{a} + {xs}*1]",
            "tileloadd tmm3, [{w} + {ws}*1]",
            "tileloadd tmm4, [{w} + {ws}*1 + 64]",
            "tdpbsud tmm0, tmm2, tmm3",
            "tdpbsud tmm1, tmm2, tmm4",
            "tilestored [{c} + {cs}*1], tmm0",
            "tilestored [{c} + {cs}*1 + 1024], tmm1",
            a = in(reg) t.x.add(b * QK),
            xs = in(reg) t.xs,
            w = in(reg) bq.add(b * bqs),
            ws = in(reg) GROUP * 4,
            c = in(reg) c.add((b - b0) * 2 * TOKENS * 16),
            cs = in(reg) 64usize,
            options(nostack, preserves_flags),
        );
    }
}

/// The chain's steps of blocks b0..b0 + SB for n tokens, from their C tiles at `c`.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn epilogue<const SB: usize>(t: &Tile, n: usize, offset: i32, b0: usize, c: *const i32) {
    let mut dw = [[_mm512_setzero_ps(); 2]; SB];
    for j in 0..SB {
        let gb = t.w.add((b0 + j) * t.stride);
        for p in 0..2 {
            dw[j][p] = _mm512_cvtph_ps(_mm256_loadu_si256(gb.add(p * 32).cast()));
        }
    }
    for i in 0..n {
        let y = t.y.add(i * GROUP);
        let (mut a0, mut a1) = if b0 > 0 || t.resume {
            (_mm512_loadu_ps(y), _mm512_loadu_ps(y.add(16)))
        } else {
            (_mm512_setzero_ps(), _mm512_setzero_ps())
        };
        for j in 0..SB {
            let b = b0 + j;
            let corr = _mm512_set1_epi32(-offset * *t.sx.add(i * t.ds + b));
            let dx = _mm512_set1_ps(*t.dx.add(i * t.ds + b));
            let cj = c.add(j * 2 * TOKENS * 16 + i * 16);
            let s0 = _mm512_add_epi32(_mm512_loadu_si512(cj.cast()), corr);
            let s1 = _mm512_add_epi32(_mm512_loadu_si512(cj.add(TOKENS * 16).cast()), corr);
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(dw[j][0], dx), a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(dw[j][1], dx), a1);
        }
        _mm512_storeu_ps(y, a0);
        _mm512_storeu_ps(y.add(16), a1);
    }
}
