//! Integer matmul kernels for block-quantized weights (GGML's q8_0, q4_0 and q4_K, quantized by
//! `qblocks`) against activations quantized per row and per 32-block to int8 (llama.cpp's
//! q8_0 × q8_0, q8_0 × q4_0 and q8_K × q4_K `vec_dot`). Each 32-block's products are summed in
//! int32 (exact), and the scales are applied once per block.
//!
//! **Batch invariance by construction.** Output (t, r) is always the chain, over the 32-blocks b
//! of the row in order, starting from 0:
//!
//! ```text
//! q8_0, q4_0:  acc = fma(f32(isum), dw·dx, acc)
//! q4_K:        acc = fma(f32(isum), ds·dx, acc);  acc = fma(−f32(sx), dm·dx, acc)
//! ```
//!
//! where `isum` is the exact integer dot product of the block's weight quants (q8_0: q; q4_0:
//! q − 8; q4_K: q in 0..=15) and activation quants (any order of integer additions gives the
//! same value), `sx` their sum Σ xq, `dx` the activations' scale, dw the block's scale, ds =
//! d·sc and dm = dmin·m (q4_K: exact products in f32), and every product of two scales is
//! rounded to f32 before its fma. Every SIMD level, tile shape, batch size and thread split
//! computes this very chain, so a token's outputs are the same bits alone or beside others, and
//! the same on every level.
//!
//! SIMD levels (picked at run time, `int_level`): AVX-512 VNNI (`vpdpbusd`: unsigned weight bytes
//! times signed activation bytes, four products a lane a step), AVX2 (`vpmaddubsw`, with
//! llama.cpp's sign trick for q8_0 so that no pair sum saturates), and portable code.
//!
//! Layout (`PackedQ`): rows in groups of 32 (two panels of 16 rows: one zmm of int32 sums each);
//! each group's *units* in order (a unit: one block of 32 for q8_0 and q4_0, a super-block of 256
//! for q4_K), so a group streams as one run. A unit is a header of scales, then per 32-block the
//! quants, k-major in steps of 4: step s (k = 4s..4s+3 of the block) holds panel 0's 16 rows ×
//! 4 bytes, then panel 1's (64 bytes each: one `vpdpbusd` operand).
//!
//! * q8_0: header 32 f16 scales (one a row); quants q + 128 (1..=255, unsigned), 1024 bytes.
//! * q4_0: header 32 f16 scales; quants 512 bytes, two steps per 64 bytes: the low nibbles are
//!   step 2j, the high nibbles step 2j + 1 (q + 8, 0..=15, as GGML stores them).
//! * q4_K: header 32 f16 d, 32 f16 dmin, then 8 × 32 scales and 8 × 32 mins (one byte each, 6
//!   bits used; row r of sub-block j at 32·j + r), 640 bytes; then 8 sub-blocks of quants laid
//!   out as q4_0's (q, 0..=15).
//!
//! The unsigned offsets of q8_0 and q4_0 are undone with the activations' block sums:
//! Σ x·(w + o) = Σ x·w + o·Σ x.
//!
//! Modules: `layout` (the packed units, `Tile`), `level` (the SIMD level per CPU), `rows` (the
//! quantized activations), `portable` and `x86` (the register tiles), `amx` (AMX-INT8 tiles).

#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod layout;
pub mod level;
pub mod portable;
pub mod rows;
#[cfg(target_arch = "x86_64")]
mod x86;

use super::par::{with_scratch, Par, SyncPtr};
use super::qblocks;
#[cfg(test)]
use super::qblocks::QK_K;
pub use super::qblocks::{BlockKind, QK};
use half::f16;
pub use layout::bits_per_weight;
use layout::{
    nibble, put_nibbles, quant_at, Layout, Tile, GROUP, K_DMIN, K_HEADER, K_M, K_SC, Q4_BYTES, Q8_BYTES, SCALES,
};
pub use level::{gemv_groups, int_level, int_levels, IntLevel};
use portable::tile_generic;
use rows::Shared;
pub use rows::{quantize_row, quantize_row_portable, QuantRows};
use std::cell::RefCell;
use std::ops::Range;

/// Token rows per register tile.
pub const TILE: usize = 6;
/// Weight bytes of one group × one k chunk that the token tiles share while it sits in L1.
const CHUNK_BYTES: usize = 16 << 10;
/// Tokens from which a matmul at level Amx runs AMX tiles (fewer: the AVX-512 VNNI tiles, which
/// were as fast or faster up to 16–24 tokens in `bench_decode linear`: AMX computes whole tiles of
/// 16 tokens and unpacks q4_0 per group).
pub const AMX_MIN_TOKENS: usize = 32;
/// AMX: token rows that run over every group before the next rows start (a multiple of 16).
const AMX_TOKEN_BLOCK: usize = 64;
/// AMX: weight bytes of one group × one k chunk that the token tiles share (from L2).
const AMX_CHUNK_BYTES: usize = 160 << 10;
/// Token rows that run over every group before the next rows start (a multiple of TILE): their
/// quantized activations stay in L2 across the groups, and the outputs they write touch few pages.
const TOKEN_BLOCK: usize = 60;

// ---------------------------------------------------------------- weights

/// A weight matrix W (`out` × `inp`, the nn.Linear layout) block-quantized and packed for the
/// integer kernels (see the module's layout). The last group is padded with zero rows.
pub struct PackedQ {
    pub kind: BlockKind,
    pub out: usize,
    pub inp: usize,
    /// 32-blocks per row (inp / 32).
    nb: usize,
    /// The groups start at `buf[off]`, a 64-byte boundary.
    buf: Vec<u8>,
    off: usize,
}

impl std::fmt::Debug for PackedQ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedQ {{ {} [{}, {}] }}", self.kind.name(), self.out, self.inp)
    }
}

impl PackedQ {
    /// Quantize row-major `w` (out × inp) to `kind` with GGML's rounding (`qblocks`), groups split
    /// over `par`'s threads.
    ///
    /// Errors (`Err(message)`) when `inp` is not a multiple of the kind's block (32, or 256 for
    /// q4_K: nothing is padded) or a weight is NaN or infinite; `w.len()` must be out × inp.
    pub fn quantize(kind: BlockKind, w: &[f32], out: usize, inp: usize, par: &Par) -> Result<Self, String> {
        if w.len() != out * inp {
            return Err(format!("{} weights for a {out} × {inp} matrix", w.len()));
        }
        if inp % kind.block() != 0 || inp == 0 {
            return Err(format!(
                "shape [{out}, {inp}]: {} needs in_features to be a positive multiple of its block size {}",
                kind.name(),
                kind.block()
            ));
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(format!("shape [{out}, {inp}]: weight [{}, {}] is {}", i / inp, i % inp, w[i]));
        }
        let nb = inp / QK;
        let units = nb / kind.unit_blocks();
        let ub = kind.unit_bytes();
        let len = out.div_ceil(GROUP) * units * ub;
        let mut buf = vec![0u8; len + 64];
        let off = buf.as_ptr().align_offset(64).min(64);
        let data = &mut buf[off..off + len];
        // padding rows: zero scales, and quants that mean 0 where there is an offset
        let zero = match kind {
            BlockKind::Q8_0 => 128u8,
            _ => 0x88,
        };
        for unit in data.chunks_exact_mut(ub) {
            let header = if kind == BlockKind::Q4K { K_HEADER } else { SCALES };
            unit[header..].fill(zero);
        }
        let dp = Shared(data.as_mut_ptr());
        let fill = |groups: Range<usize>| {
            let dp = dp;
            for g in groups {
                // SAFETY: group g's units are written by this unit of work only.
                let gdata = unsafe { std::slice::from_raw_parts_mut(dp.0.add(g * units * ub), units * ub) };
                for r in g * GROUP..out.min((g + 1) * GROUP) {
                    quantize_row_into(kind, &w[r * inp..(r + 1) * inp], r % GROUP, gdata);
                }
            }
        };
        if par.threads > 1 && out * inp >= 1 << 16 {
            par.install(|| par.run(out.div_ceil(GROUP), fill));
        } else {
            fill(0..out.div_ceil(GROUP));
        }
        Ok(PackedQ { kind, out, inp, nb, buf, off })
    }

    fn data(&self) -> &[u8] {
        let units = self.nb / self.kind.unit_blocks();
        &self.buf[self.off..self.off + self.out.div_ceil(GROUP) * units * self.kind.unit_bytes()]
    }

    /// Bytes the packed matrix occupies (what a matmul streams).
    pub fn bytes(&self) -> usize {
        self.data().len()
    }

    /// Row `r` dequantized into `dst[..inp]` (q8_0 / q4_0: d·q; q4_K: (d·sc)·q − dmin·m): the
    /// embedding lookup of a quantized table.
    pub fn row(&self, r: usize, dst: &mut [f32]) {
        let (g, rr) = (r / GROUP, r % GROUP);
        let (kind, ub) = (self.kind, self.kind.unit_bytes());
        let units = self.nb / kind.unit_blocks();
        let data = self.data();
        let f16_at = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        for u in 0..units {
            let unit = &data[(g * units + u) * ub..][..ub];
            for i in 0..kind.block() {
                let (j, ii) = (i / QK, i % QK);
                dst[u * kind.block() + i] = match kind {
                    BlockKind::Q8_0 => {
                        f16_at(unit, rr * 2) * (unit[SCALES + quant_at(rr, ii, false).0] as i32 - 128) as f32
                    }
                    BlockKind::Q4_0 => f16_at(unit, rr * 2) * (nibble(&unit[SCALES..], rr, ii) as i32 - 8) as f32,
                    BlockKind::Q4K => {
                        let ds = f16_at(unit, rr * 2) * unit[K_SC + j * GROUP + rr] as f32;
                        let dm = f16_at(unit, K_DMIN + rr * 2) * unit[K_M + j * GROUP + rr] as f32;
                        ds * nibble(&unit[K_HEADER + j * Q4_BYTES..], rr, ii) as f32 - dm
                    }
                };
            }
        }
    }

    /// y = x · Wᵀ for the m rows of `x` (quantized by `QuantRows::quantize`): row t's outputs go
    /// to `y[t·ys..][..out]` (ys ≥ out, so that several matrices can fill one row). Every output
    /// is the chain of the module's doc, whatever m and the thread split.
    pub fn matmul(&self, par: &Par, x: &QuantRows, y: &mut [f32], ys: usize) {
        self.matmul_at(int_level(), par, x, y, ys)
    }

    /// `matmul` with the kernels of `level`, which the CPU must support.
    pub fn matmul_at(&self, level: IntLevel, par: &Par, x: &QuantRows, y: &mut [f32], ys: usize) {
        let m = x.m;
        if m == 0 || self.out == 0 {
            return;
        }
        assert!(
            x.k == self.inp && ys >= self.out && y.len() >= (m - 1) * ys + self.out,
            "int matmul: {m} × {} into {} floats (row stride {ys}) for {} × {}",
            x.k,
            y.len(),
            self.out,
            self.inp
        );
        let groups = self.out.div_ceil(GROUP);
        let split = par.threads > 1 && self.bytes() * m.min(8) >= 1 << 16;
        let yp = SyncPtr(y.as_mut_ptr());
        let body = |range: Range<usize>| {
            let yp = yp;
            // SAFETY: groups in `range` own columns [32·range.start, 32·range.end) ∩ [0, out) of every row.
            unsafe { self.groups(level, x, range, yp.0, ys) };
        };
        if split {
            par.run(groups, body);
        } else {
            body(0..groups);
        }
    }

    /// Groups `range` of the matmul into y (row t, column r at `y + t·ys + r`).
    ///
    /// Safety: y must hold (m − 1)·ys + out floats, and this call must own those groups' columns.
    unsafe fn groups(&self, level: IntLevel, x: &QuantRows, range: Range<usize>, y: *mut f32, ys: usize) {
        #[cfg(target_arch = "x86_64")]
        if x.m == 1 && matches!(level, IntLevel::Avx512Vnni | IntLevel::Amx) {
            // decode: up to `gemv_groups()` whole groups at once, straight into y; a partial last
            // group goes through the tiles
            let units = self.nb / self.kind.unit_blocks();
            let gb = units * self.kind.unit_bytes();
            let data = self.data();
            let whole = (self.out / GROUP).min(range.end);
            let mut g = range.start;
            while g < whole {
                let n = (whole - g).min(gemv_groups());
                let (w, yy) = (data.as_ptr().add(g * gb), y.add(g * GROUP));
                macro_rules! gemv {
                    ($f:ident $(, $q4:literal)?) => {
                        match n {
                            1 => x86::$f::<$($q4,)? 1>(w, gb, x, units, yy),
                            2 => x86::$f::<$($q4,)? 2>(w, gb, x, units, yy),
                            3 => x86::$f::<$($q4,)? 3>(w, gb, x, units, yy),
                            4 => x86::$f::<$($q4,)? 4>(w, gb, x, units, yy),
                            5 => x86::$f::<$($q4,)? 5>(w, gb, x, units, yy),
                            6 => x86::$f::<$($q4,)? 6>(w, gb, x, units, yy),
                            7 => x86::$f::<$($q4,)? 7>(w, gb, x, units, yy),
                            _ => x86::$f::<$($q4,)? 8>(w, gb, x, units, yy),
                        }
                    };
                }
                match self.kind {
                    BlockKind::Q8_0 => gemv!(gemv_vnni, false),
                    BlockKind::Q4_0 => gemv!(gemv_vnni, true),
                    BlockKind::Q4K => gemv!(gemv_vnni_k),
                }
                g += n;
            }
            if g < range.end {
                self.tiles(level, x, g..range.end, y, ys);
            }
            return;
        }
        self.tiles(level, x, range, y, ys)
    }

    /// Groups `range` through the register tiles (see `groups`).
    unsafe fn tiles(&self, level: IntLevel, x: &QuantRows, range: Range<usize>, y: *mut f32, ys: usize) {
        #[cfg(target_arch = "x86_64")]
        if level == IntLevel::Amx && self.kind != BlockKind::Q4K && x.m >= AMX_MIN_TOKENS {
            return self.tiles_amx(x, range, y, ys);
        }
        let (m, out, nb, kind) = (x.m, self.out, self.nb, self.kind);
        let (ubl, ub) = (kind.unit_blocks(), kind.unit_bytes());
        let data = self.data();
        let group_bytes = nb / ubl * ub;
        // one token tile: k whole; more: k in chunks (whole units) that stay in L1 while every
        // tile of the token block runs over them
        let chunk = if m <= TILE { nb } else { ((CHUNK_BYTES / ub).max(1) * ubl).min(nb) };
        let mc = m.min(TOKEN_BLOCK);
        thread_local! {
            /// This thread's partial sums of one group and token block (TOKEN_BLOCK × 32), parked between k chunks.
            static ACC: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        with_acc(&ACC, mc * GROUP, |acc| {
            for tb in (0..m).step_by(mc) {
                let tn = mc.min(m - tb);
                for g in range.clone() {
                    let gw = data.as_ptr().add(g * group_bytes);
                    for b0 in (0..nb).step_by(chunk) {
                        for t0 in (0..tn).step_by(TILE) {
                            let t = tb + t0;
                            let (w, blocks, y) =
                                (gw.add(b0 / ubl * ub), chunk.min(nb - b0), acc.as_mut_ptr().add(t0 * GROUP));
                            let tile = Tile::of(x, w, ub, t, b0, blocks, y);
                            run_tile(level, kind, TILE.min(tn - t0), &tile);
                        }
                    }
                    store_group(acc, tn, out, g, y.add(tb * ys), ys);
                }
            }
        });
    }

    /// Groups `range` through AMX tiles of 16 tokens (`amx`; q8_0 and q4_0): per token
    /// block and group, k in chunks that stay in L2 (q4_0's unpacked once a chunk), every token
    /// tile over each chunk.
    ///
    /// Safety: as `groups`; `amx::available()`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tiles_amx(&self, x: &QuantRows, range: Range<usize>, y: *mut f32, ys: usize) {
        let (m, out, nb, kind) = (x.m, self.out, self.nb, self.kind);
        let ub = kind.unit_bytes(); // one 32-block a unit
        let data = self.data();
        let chunk = (AMX_CHUNK_BYTES / ub).clamp(1, nb);
        let mc = m.min(AMX_TOKEN_BLOCK);
        thread_local! {
            /// This thread's partial sums (AMX_TOKEN_BLOCK × 32), C tiles and unpacked q4_0 chunk.
            static SCRATCH: RefCell<(Vec<f32>, Vec<i32>, Vec<u8>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
        }
        with_scratch(&SCRATCH, |(acc, c, unpacked)| {
            // every buffer from a 64-byte boundary (tile rows whole cache lines)
            let q4 = kind == BlockKind::Q4_0;
            let acc = aligned(acc, mc * GROUP);
            let c = aligned(c, 2 * amx::RUN_INTS);
            let unpacked = aligned(unpacked, if q4 { chunk * Q8_BYTES } else { 0 });
            amx::configure();
            for tb in (0..m).step_by(mc) {
                let tn = mc.min(m - tb);
                for g in range.clone() {
                    let gw = data.as_ptr().add(g * nb * ub);
                    for b0 in (0..nb).step_by(chunk) {
                        let (w, blocks) = (gw.add(b0 * ub), chunk.min(nb - b0));
                        let (bq, bqs) = if q4 {
                            amx::unpack_q4(w, ub, blocks, unpacked.as_mut_ptr());
                            (unpacked.as_ptr(), Q8_BYTES)
                        } else {
                            (w.add(SCALES), ub)
                        };
                        // the weights after this chunk (the next chunk, or the next group's first)
                        let next = (g * nb + b0 + blocks) * ub;
                        let pf_bytes = (chunk * ub).min((range.end * nb * ub).saturating_sub(next));
                        for t0 in (0..tn).step_by(amx::TOKENS) {
                            let t = tb + t0;
                            let tile = Tile::of(x, w, ub, t, b0, blocks, acc.as_mut_ptr().add(t0 * GROUP));
                            // each token tile fetches its share of the next chunk into L2
                            let tiles = tn.div_ceil(amx::TOKENS);
                            let share = pf_bytes.div_ceil(tiles).next_multiple_of(64);
                            let from = (t0 / amx::TOKENS * share).min(pf_bytes);
                            let (pf, pf_bytes) = (data.as_ptr().add(next + from), share.min(pf_bytes - from));
                            let n = amx::TOKENS.min(tn - t0);
                            amx::tile(&tile, n, kind.offset(), bq, bqs, c.as_mut_ptr(), pf, pf_bytes);
                        }
                    }
                    store_group(acc, tn, out, g, y.add(tb * ys), ys);
                }
            }
            amx::release();
        });
    }
}

/// At least `len` elements of `v` (grown with zeros when shorter) from a 64-byte boundary.
fn aligned<T: Copy + Default>(v: &mut Vec<T>, len: usize) -> &mut [T] {
    let pad = 64 / std::mem::size_of::<T>();
    if v.len() < len + pad {
        v.resize(len + pad, T::default());
    }
    let o = v.as_ptr().align_offset(64);
    &mut v[o..]
}

/// Copy a group's outputs of tn tokens (32 floats a token in `acc`) to columns [32·g, 32·g + 32) ∩
/// [0, out) of rows 0..tn of y (row t at `y + t·ys`).
///
/// Safety: y must cover those rows and columns.
unsafe fn store_group(acc: &[f32], tn: usize, out: usize, g: usize, y: *mut f32, ys: usize) {
    let rows = GROUP.min(out - g * GROUP);
    for t in 0..tn {
        std::ptr::copy_nonoverlapping(acc.as_ptr().add(t * GROUP), y.add(t * ys + g * GROUP), rows);
    }
}

/// Quantize one row (`w`: in_features weights) into row `rr` of its group's units `gdata`.
fn quantize_row_into(kind: BlockKind, w: &[f32], rr: usize, gdata: &mut [u8]) {
    let ub = kind.unit_bytes();
    for (u, src) in w.chunks_exact(kind.block()).enumerate() {
        let unit = &mut gdata[u * ub..(u + 1) * ub];
        match kind {
            BlockKind::Q8_0 => {
                let mut q = [0i8; QK];
                let d = qblocks::q8_0(src.try_into().expect("a block"), &mut q);
                unit[rr * 2..rr * 2 + 2].copy_from_slice(&d.to_le_bytes());
                for (i, &v) in q.iter().enumerate() {
                    unit[SCALES + quant_at(rr, i, false).0] = (v as i32 + 128) as u8;
                }
            }
            BlockKind::Q4_0 => {
                let mut q = [0u8; QK];
                let d = qblocks::q4_0(src.try_into().expect("a block"), &mut q);
                unit[rr * 2..rr * 2 + 2].copy_from_slice(&d.to_le_bytes());
                put_nibbles(&mut unit[SCALES..], rr, &q);
            }
            BlockKind::Q4K => {
                let b = qblocks::q4_k(src.try_into().expect("a super-block"));
                unit[rr * 2..rr * 2 + 2].copy_from_slice(&b.d.to_le_bytes());
                unit[K_DMIN + rr * 2..K_DMIN + rr * 2 + 2].copy_from_slice(&b.dmin.to_le_bytes());
                for j in 0..8 {
                    unit[K_SC + j * GROUP + rr] = b.sc[j];
                    unit[K_M + j * GROUP + rr] = b.m[j];
                    let q: &[u8; QK] = b.q[j * QK..(j + 1) * QK].try_into().expect("a sub-block");
                    put_nibbles(&mut unit[K_HEADER + j * Q4_BYTES..], rr, q);
                }
            }
        }
    }
}

/// Run one tile of n tokens at `level`.
///
/// Safety: the pointers of `tile` must cover n tokens × `blocks` blocks (see `Tile`).
unsafe fn run_tile(level: IntLevel, kind: BlockKind, n: usize, tile: &Tile) {
    let level = if level == IntLevel::Amx { IntLevel::Avx512Vnni } else { level };
    macro_rules! by_n {
        ($m:ident :: $f:ident $(, $q4:literal)?) => {
            match n {
                1 => $m::$f::<$($q4,)? 1>(tile),
                2 => $m::$f::<$($q4,)? 2>(tile),
                3 => $m::$f::<$($q4,)? 3>(tile),
                4 => $m::$f::<$($q4,)? 4>(tile),
                5 => $m::$f::<$($q4,)? 5>(tile),
                _ => $m::$f::<$($q4,)? 6>(tile),
            }
        };
    }
    match (level, kind) {
        #[cfg(target_arch = "x86_64")]
        (IntLevel::Avx512Vnni, BlockKind::Q8_0) => by_n!(x86::tile_vnni, false),
        #[cfg(target_arch = "x86_64")]
        (IntLevel::Avx512Vnni, BlockKind::Q4_0) => by_n!(x86::tile_vnni, true),
        #[cfg(target_arch = "x86_64")]
        (IntLevel::Avx512Vnni, BlockKind::Q4K) => by_n!(x86::tile_vnni_k),
        #[cfg(target_arch = "x86_64")]
        (IntLevel::Avx2, _) => {
            // one panel at a time, at most 3 tokens (16 ymm registers)
            let mut t0 = 0;
            while t0 < n {
                let nn = 3.min(n - t0);
                for p in 0..2 {
                    let sub = Tile {
                        x: tile.x.add(t0 * tile.xs),
                        sx: tile.sx.add(t0 * tile.ds),
                        dx: tile.dx.add(t0 * tile.ds),
                        y: tile.y.add(t0 * GROUP),
                        ..*tile
                    };
                    match (kind, nn) {
                        (BlockKind::Q8_0, 1) => x86::tile_avx2::<false, 1>(&sub, p),
                        (BlockKind::Q8_0, 2) => x86::tile_avx2::<false, 2>(&sub, p),
                        (BlockKind::Q8_0, _) => x86::tile_avx2::<false, 3>(&sub, p),
                        (BlockKind::Q4_0, 1) => x86::tile_avx2::<true, 1>(&sub, p),
                        (BlockKind::Q4_0, 2) => x86::tile_avx2::<true, 2>(&sub, p),
                        (BlockKind::Q4_0, _) => x86::tile_avx2::<true, 3>(&sub, p),
                        (BlockKind::Q4K, 1) => x86::tile_avx2_k::<1>(&sub, p),
                        (BlockKind::Q4K, 2) => x86::tile_avx2_k::<2>(&sub, p),
                        (BlockKind::Q4K, _) => x86::tile_avx2_k::<3>(&sub, p),
                    }
                }
                t0 += nn;
            }
        }
        _ => tile_generic(kind, tile, n),
    }
}

/// Run `f` on this thread's scratch of at least `len` floats (`par::with_scratch`, grown here).
fn with_acc<R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    with_scratch(key, |buf| {
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [BlockKind; 3] = [BlockKind::Q8_0, BlockKind::Q4_0, BlockKind::Q4K];

    fn weights(rows: usize, k: usize, seed: usize) -> Vec<f32> {
        // a spread of magnitudes per block, offsets (where q4_K's mins pay), and an all-zero block now and then
        (0..rows * k)
            .map(|i| {
                let v = ((i * 7919 + seed) % 2003) as f32 / 1001.0 - 1.0;
                match (i / QK) % 17 {
                    3 => 0.0,
                    5 | 11 => 0.5 + v * 0.25,
                    b => v * (1.0 + (b % 5) as f32),
                }
            })
            .collect()
    }

    fn acts(m: usize, k: usize) -> Vec<f32> {
        (0..m * k)
            .map(|i| {
                let v = ((i * 104729) % 1999) as f32 / 999.0 - 1.0;
                // an outlier feature now and then, as activations have
                if i % 97 == 5 {
                    v * 20.0
                } else {
                    v
                }
            })
            .collect()
    }

    fn dequantized(p: &PackedQ) -> Vec<f32> {
        let mut w = vec![0f32; p.out * p.inp];
        for r in 0..p.out {
            p.row(r, &mut w[r * p.inp..(r + 1) * p.inp]);
        }
        w
    }

    /// The chain's value in f64 from the same quantized operands (dequantized weights and activations).
    fn reference(w: &[f32], rows: usize, x: &QuantRows, t: usize) -> Vec<f64> {
        let (k, nb) = (x.k, x.k / QK);
        (0..rows)
            .map(|r| {
                (0..k)
                    .map(|i| w[r * k + i] as f64 * x.q[x.qo + t * x.kp + i] as f64 * x.d[t * nb + i / QK] as f64)
                    .sum()
            })
            .collect()
    }

    #[test]
    fn packing_round_trips_the_quantized_values() {
        let w = weights(40, 512, 3);
        for kind in KINDS {
            let p = PackedQ::quantize(kind, &w, 40, 512, &Par::new(2).unwrap()).unwrap();
            let got = dequantized(&p);
            for r in [0, 17, 31, 32, 39] {
                for b in 0..512 / kind.block() {
                    let src = &w[r * 512 + b * kind.block()..][..kind.block()];
                    let want: Vec<f32> = match kind {
                        BlockKind::Q8_0 => {
                            let mut q = [0i8; QK];
                            let d = qblocks::q8_0(src.try_into().unwrap(), &mut q).to_f32();
                            q.iter().map(|&v| d * v as f32).collect()
                        }
                        BlockKind::Q4_0 => {
                            let mut q = [0u8; QK];
                            let d = qblocks::q4_0(src.try_into().unwrap(), &mut q).to_f32();
                            q.iter().map(|&v| d * (v as i32 - 8) as f32).collect()
                        }
                        BlockKind::Q4K => {
                            let qb = qblocks::q4_k(src.try_into().unwrap());
                            (0..QK_K).map(|i| qb.weight(i)).collect()
                        }
                    };
                    assert_eq!(
                        got[r * 512 + b * kind.block()..][..kind.block()],
                        want[..],
                        "{kind:?} row {r} block {b}"
                    );
                }
            }
        }
        let e = PackedQ::quantize(BlockKind::Q4_0, &[0.0; 48], 1, 48, &Par::new(1).unwrap()).unwrap_err();
        assert!(e.contains("[1, 48]") && e.contains("multiple of its block size 32"), "{e}");
        let e = PackedQ::quantize(BlockKind::Q4K, &[0.0; 96], 1, 96, &Par::new(1).unwrap()).unwrap_err();
        assert!(e.contains("q4_k") && e.contains("256"), "{e}");
        let e = PackedQ::quantize(BlockKind::Q8_0, &[f32::NAN; 32], 1, 32, &Par::new(1).unwrap()).unwrap_err();
        assert!(e.contains("NaN") && e.contains("[0, 0]"), "{e}");
        assert_eq!(bits_per_weight(BlockKind::Q4_0), 4.5);
        assert_eq!(bits_per_weight(BlockKind::Q8_0), 8.5);
        assert_eq!(bits_per_weight(BlockKind::Q4K), 4.625);
    }

    #[test]
    fn activations_quantize_per_block_and_nan_propagates() {
        let mut x: Vec<f32> = acts(1, 64);
        let (mut q, mut s, mut d) = (vec![0i8; 64], vec![0i32; 2], vec![0f32; 2]);
        quantize_row(&x, &mut q, &mut s, &mut d);
        for b in 0..2 {
            let amax = x[b * 32..(b + 1) * 32].iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(d[b], amax / 127.0);
            assert_eq!(s[b], q[b * 32..(b + 1) * 32].iter().map(|&v| v as i32).sum::<i32>());
            assert!(q[b * 32..(b + 1) * 32].iter().any(|&v| v.abs() == 127));
            for i in 0..32 {
                assert!((q[b * 32 + i] as f32 * d[b] - x[b * 32 + i]).abs() <= d[b] * 0.5 + 1e-7);
            }
        }
        x[40] = f32::NAN;
        quantize_row(&x, &mut q, &mut s, &mut d);
        assert!(d[1].is_nan() && !d[0].is_nan());
        let mut x = acts(1, 256);
        x[200] = f32::INFINITY;
        let mut xr = QuantRows::default();
        xr.quantize(&Par::new(1).unwrap(), &x, 1, 256);
        for kind in KINDS {
            let p = PackedQ::quantize(kind, &weights(3, 256, 1), 3, 256, &Par::new(1).unwrap()).unwrap();
            for level in int_levels() {
                let mut y = vec![0f32; 3];
                p.matmul_at(level, &Par::new(1).unwrap(), &xr, &mut y, 3);
                assert!(y.iter().all(|v| v.is_nan()), "{kind:?} {level:?}: {y:?}");
            }
        }
    }

    #[test]
    fn activation_quantization_has_the_same_bits_on_every_path() {
        // halfway products (x·127/amax = k + ½), zeros, a zero block, denormal and huge blocks, NaN, inf
        let mut x: Vec<f32> = acts(1, 32 * 12);
        for (i, v) in x[..32].iter_mut().enumerate() {
            *v = i as f32 - 16.5; // k + ½: rounding half to even decides
        }
        x[0] = 127.0; // amax 127: the scale is 1
        x[32..64].iter_mut().for_each(|v| *v = 0.0);
        x[64..96].iter_mut().enumerate().for_each(|(i, v)| *v = f32::from_bits(1 + i as u32)); // denormal
        x[96..128].iter_mut().enumerate().for_each(|(i, v)| *v = f32::MAX / (1.0 + i as f32));
        x[130] = f32::NAN;
        x[170] = f32::NEG_INFINITY;
        x[200] = 1e-39; // one denormal among normal values
        for v in x[224..256].iter_mut().step_by(2) {
            *v = -*v;
        }
        let nb = x.len() / 32;
        let (mut q, mut s, mut d) = (vec![0i8; x.len()], vec![0i32; nb], vec![0f32; nb]);
        let (mut q2, mut s2, mut d2) = (vec![1i8; x.len()], vec![1i32; nb], vec![1f32; nb]);
        quantize_row(&x, &mut q, &mut s, &mut d);
        quantize_row_portable(&x, &mut q2, &mut s2, &mut d2);
        assert_eq!(q, q2);
        assert_eq!(s, s2);
        assert_eq!(
            d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            d2.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert!(d[4].is_nan() && d[5].is_nan() && !d[6].is_nan() && q[64..96].iter().any(|&v| v != 0));
    }

    #[test]
    fn int_matmul_is_batch_invariant_at_every_simd_level_and_matches_f64() {
        let serial = Par::new(1).unwrap();
        let par = Par::new(2).unwrap();
        let mmax = 40;
        // out: partial group, partial panel (and more whole groups than a decode streams at once),
        // exact, one row; k: one unit, several, across k chunks (q8_0: 15 blocks a chunk, q4_0: 28,
        // q4_K: 3 super-blocks), rows not a multiple of 64 bytes
        for &(rows, k) in &[(300, 1280), (77, 256), (64, 768), (1, 1792), (45, 2048)] {
            let w = weights(rows, k, rows);
            let x = acts(mmax, k);
            let mut xa = QuantRows::default();
            xa.quantize(&serial, &x, mmax, k);
            for kind in KINDS {
                let p = PackedQ::quantize(kind, &w, rows, k, &serial).unwrap();
                let wq = dequantized(&p);
                let mut first: Option<Vec<f32>> = None;
                for level in int_levels() {
                    // every token alone (m = 1): the reference bits of this level
                    let mut alone = vec![0f32; mmax * rows];
                    for t in 0..mmax {
                        let mut xt = QuantRows::default();
                        xt.quantize(&serial, &x[t * k..(t + 1) * k], 1, k);
                        p.matmul_at(level, &serial, &xt, &mut alone[t * rows..(t + 1) * rows], rows);
                        let want = reference(&wq, rows, &xa, t);
                        for (r, (&a, &b)) in alone[t * rows..(t + 1) * rows].iter().zip(&want).enumerate() {
                            // f32 rounding of k/32 fmas: far below 1e-5 of Σ|w·x|
                            let mag: f64 = (0..k).map(|i| (wq[r * k + i] as f64 * x[t * k + i] as f64).abs()).sum();
                            assert!(
                                ((a as f64) - b).abs() <= 1e-5 * mag + 1e-6,
                                "{kind:?} {level:?} {rows}x{k} t{t} r{r}: {a} vs {b}"
                            );
                        }
                    }
                    for m in 1..=mmax {
                        // m tokens from token (7m) mod (mmax − m + 1): each meets other neighbours and tile slots
                        let s = (m * 7) % (mmax - m + 1);
                        let want = &alone[s * rows..(s + m) * rows];
                        let mut xm = QuantRows::default();
                        xm.quantize(&serial, &x[s * k..(s + m) * k], m, k);
                        let mut got = vec![f32::NAN; m * rows];
                        p.matmul_at(level, &serial, &xm, &mut got, rows);
                        assert!(got == want, "{kind:?} {level:?} {rows}x{k}: m = {m} differs from the tokens alone");
                        let mut threaded = vec![f32::NAN; m * rows];
                        par.install(|| {
                            xm.quantize(&par, &x[s * k..(s + m) * k], m, k);
                            p.matmul_at(level, &par, &xm, &mut threaded, rows)
                        });
                        assert!(threaded == want, "{kind:?} {level:?} {rows}x{k}: m = {m} on 2 threads differs");
                    }
                    match &first {
                        None => first = Some(alone),
                        Some(f) => {
                            assert!(*f == alone, "{kind:?} {level:?} {rows}x{k}: other bits than {:?}", int_levels()[0])
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn int_matmul_is_close_to_the_unquantized_product() {
        // |Σ w·x − Σ w'·x'| ≤ Σ |w − w'|·|x| + Σ |w'|·dx/2, w' and x' the quantized values
        let (rows, k, m) = (70, 512, 3);
        let w = weights(rows, k, 5);
        let x = acts(m, k);
        let mut xq = QuantRows::default();
        xq.quantize(&Par::new(1).unwrap(), &x, m, k);
        let mut errs = Vec::new();
        for kind in KINDS {
            let p = PackedQ::quantize(kind, &w, rows, k, &Par::new(1).unwrap()).unwrap();
            let wq = dequantized(&p);
            let mut y = vec![0f32; m * rows];
            p.matmul(&Par::new(1).unwrap(), &xq, &mut y, rows);
            let mut total = 0f64;
            for t in 0..m {
                for r in 0..rows {
                    let exact: f64 = (0..k).map(|i| w[r * k + i] as f64 * x[t * k + i] as f64).sum();
                    let bound: f64 = (0..k)
                        .map(|i| {
                            let dx = xq.d[t * (k / QK) + i / QK] as f64;
                            ((w[r * k + i] - wq[r * k + i]) as f64).abs() * (x[t * k + i] as f64).abs()
                                + (wq[r * k + i] as f64).abs() * dx / 2.0
                        })
                        .sum();
                    let err = (y[t * rows + r] as f64 - exact).abs();
                    assert!(err <= bound + 1e-4, "{kind:?} t{t} r{r}: {} vs {exact} (bound {bound})", y[t * rows + r]);
                    total += err * err;
                }
            }
            errs.push(total);
        }
        // 8 bits beat q4_K, which beats q4_0 on these offset blocks
        assert!(errs[0] < errs[2] && errs[2] < errs[1], "{errs:?}");
    }
}
