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

use crate::kernels::{with_scratch, Par, SimdCap, SyncPtr};
use crate::qblocks;
#[cfg(test)]
use crate::qblocks::QK_K;
pub use crate::qblocks::{BlockKind, QK};
use half::f16;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

/// Output rows per panel (one zmm of int32 sums).
const PANEL: usize = 16;
/// Output rows per group (two panels): the unit a thread takes and a register tile covers.
pub const GROUP: usize = 32;
/// Token rows per register tile.
pub const TILE: usize = 6;
/// Weight bytes of one group × one k chunk that the token tiles share while it sits in L1.
const CHUNK_BYTES: usize = 16 << 10;
/// Groups a one-token matmul (decode) streams at once on AVX-512: that many sequential streams
/// for the hardware prefetchers.
const GEMV_GROUPS: usize = 4;
/// Whether the decode kernels (`x86::gemv_vnni`) add a software prefetch a few blocks ahead of
/// each of their streams: yes on Intel, where they were tuned with it; no on AMD, where the
/// hardware prefetchers alone stream faster (Zen 4, `bench_decode` `small`, interleaved: q4_mix
/// decode +7 % at one thread and +8 % at two, q4_0 +15 % at two). The results are the same
/// either way.
pub fn gemv_prefetch() -> bool {
    static PREFETCH: OnceLock<bool> = OnceLock::new();
    *PREFETCH.get_or_init(|| prefetch_for_vendor(&cpu_vendor()))
}

/// The software-prefetch choice of `gemv_prefetch` for a CPUID vendor string.
fn prefetch_for_vendor(vendor: &str) -> bool {
    vendor != "AuthenticAMD"
}

/// The CPUID vendor string ("GenuineIntel", "AuthenticAMD", …; "" off x86-64).
pub fn cpu_vendor() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(0); // leaf 0 exists on every x86-64 CPU
        let bytes: Vec<u8> = [r.ebx, r.edx, r.ecx].iter().flat_map(|v| v.to_le_bytes()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    #[cfg(not(target_arch = "x86_64"))]
    String::new()
}

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
/// Bytes of a q8_0 / q4_0 unit's header, and of one 32-block's quants of a group.
pub(crate) const SCALES: usize = GROUP * 2;
/// (q8_0's quants of a group's block: also the bytes AMX reads q4_0 unpacked to)
pub(crate) const Q8_BYTES: usize = GROUP * QK;
const Q4_BYTES: usize = GROUP * QK / 2;
/// q4_K header: d, dmin (f16 a row), then the 8 sub-blocks' scales and mins (a byte a row).
const K_DMIN: usize = GROUP * 2;
const K_SC: usize = GROUP * 4;
const K_M: usize = K_SC + 8 * GROUP;
const K_HEADER: usize = K_M + 8 * GROUP;

/// Layout facts of a block kind (see the module's doc).
trait Layout {
    /// 32-blocks per unit.
    fn unit_blocks(self) -> usize;
    /// Bytes of one group's unit.
    fn unit_bytes(self) -> usize;
    /// The unsigned offset of the stored quants that the activations' sums undo (0: none).
    fn offset(self) -> i32;
}

impl Layout for BlockKind {
    fn unit_blocks(self) -> usize {
        self.block() / QK
    }
    fn unit_bytes(self) -> usize {
        match self {
            BlockKind::Q8_0 => SCALES + Q8_BYTES,
            BlockKind::Q4_0 => SCALES + Q4_BYTES,
            BlockKind::Q4K => K_HEADER + 8 * Q4_BYTES,
        }
    }
    fn offset(self) -> i32 {
        match self {
            BlockKind::Q8_0 => 128,
            BlockKind::Q4_0 => 8,
            BlockKind::Q4K => 0,
        }
    }
}

/// Bits a weight costs in memory, scales included: q8_0 8.5, q4_0 4.5, q4_K 4.625 (GGML's q4_K packs
/// its 6-bit scales into 4.5).
pub fn bits_per_weight(kind: BlockKind) -> f64 {
    (kind.unit_bytes() * 8) as f64 / (GROUP * kind.block()) as f64
}

/// The integer kernels' SIMD level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntLevel {
    /// Intel AMX-INT8 tiles (`crate::amx`) for q8_0 and q4_0 at `AMX_MIN_TOKENS` tokens or more,
    /// AVX-512 VNNI otherwise (this level implies it).
    Amx,
    /// AVX-512 F + BW + VNNI (`vpdpbusd`) and F16C.
    Avx512Vnni,
    /// AVX2 + FMA + F16C (`vpmaddubsw`).
    Avx2,
    Generic,
}

/// The level the CPU runs, detected once, under `kernels::simd_cap` (`SHALIK_RUST_SIMD`; `avx512`:
/// no AMX).
pub fn int_level() -> IntLevel {
    static LEVEL: OnceLock<IntLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = match crate::kernels::simd_cap() {
            SimdCap::Generic => IntLevel::Generic,
            SimdCap::Avx2 => IntLevel::Avx2,
            SimdCap::Avx512 => IntLevel::Avx512Vnni,
            SimdCap::None => IntLevel::Amx,
        };
        // int_levels() is fastest first and the enum's order is the same
        *int_levels().iter().find(|l| **l as u8 >= cap as u8).unwrap_or(&IntLevel::Generic)
    })
}

/// Every level this CPU can run, fastest first (the tests run each one).
pub fn int_levels() -> Vec<IntLevel> {
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") && has!("f16c") && has!("fma") {
            if crate::amx::available() {
                v.push(IntLevel::Amx);
            }
            v.push(IntLevel::Avx512Vnni);
        }
        if has!("avx2") && has!("fma") && has!("f16c") {
            v.push(IntLevel::Avx2);
        }
    }
    v.push(IntLevel::Generic);
    v
}

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

/// Where row `rr` (0..32) of a group, at position i of a 32-block, sits among the block's quant
/// bytes: step s = i / 4 of panel rr / 16, lane rr % 16, byte i % 4 (q4: the pair of steps, and
/// whether it is the high nibble).
fn quant_at(rr: usize, i: usize, four_bit: bool) -> (usize, bool) {
    let (p, lane, s, j) = (rr / PANEL, rr % PANEL, i / 4, i % 4);
    if four_bit {
        ((s / 2) * GROUP * 4 + p * PANEL * 4 + lane * 4 + j, s % 2 == 1)
    } else {
        (s * GROUP * 4 + p * PANEL * 4 + lane * 4 + j, false)
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
            // decode: up to GEMV_GROUPS whole groups at once, straight into y; a partial last
            // group goes through the tiles
            let units = self.nb / self.kind.unit_blocks();
            let gb = units * self.kind.unit_bytes();
            let data = self.data();
            let whole = (self.out / GROUP).min(range.end);
            let mut g = range.start;
            while g < whole {
                let n = (whole - g).min(GEMV_GROUPS);
                let (w, yy) = (data.as_ptr().add(g * gb), y.add(g * GROUP));
                macro_rules! gemv {
                    ($f:ident $(, $q4:literal)?) => {
                        match n {
                            1 => x86::$f::<$($q4,)? 1>(w, gb, x, units, yy),
                            2 => x86::$f::<$($q4,)? 2>(w, gb, x, units, yy),
                            3 => x86::$f::<$($q4,)? 3>(w, gb, x, units, yy),
                            _ => x86::$f::<$($q4,)? 4>(w, gb, x, units, yy),
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
                            let (w, blocks, y) = (gw.add(b0 / ubl * ub), chunk.min(nb - b0), acc.as_mut_ptr().add(t0 * GROUP));
                            let tile = Tile::of(x, w, ub, t, b0, blocks, y);
                            run_tile(level, kind, TILE.min(tn - t0), &tile);
                        }
                    }
                    store_group(acc, tn, out, g, y.add(tb * ys), ys);
                }
            }
        });
    }

    /// Groups `range` through AMX tiles of 16 tokens (`crate::amx`; q8_0 and q4_0): per token
    /// block and group, k in chunks that stay in L2 (q4_0's unpacked once a chunk), every token
    /// tile over each chunk.
    ///
    /// Safety: as `groups`; `amx::available()`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tiles_amx(&self, x: &QuantRows, range: Range<usize>, y: *mut f32, ys: usize) {
        use crate::amx;
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

/// Store the 4-bit quants `q` of row `rr` of a group's 32-block at `quants` (see `quant_at`).
fn put_nibbles(quants: &mut [u8], rr: usize, q: &[u8; QK]) {
    for (i, &v) in q.iter().enumerate() {
        let (at, high) = quant_at(rr, i, true);
        quants[at] = if high { (quants[at] & 0x0F) | (v << 4) } else { (quants[at] & 0xF0) | (v & 0x0F) };
    }
}

/// The 4-bit quant of row `rr` at position i of a group's 32-block at `quants`.
fn nibble(quants: &[u8], rr: usize, i: usize) -> u8 {
    let (at, high) = quant_at(rr, i, true);
    if high {
        quants[at] >> 4
    } else {
        quants[at] & 0x0F
    }
}

// ---------------------------------------------------------------- activations

/// m rows of k activations quantized per 32-block to int8 (q8_0 with an f32 scale): x ≈ d · q,
/// d = max|x| / 127, q = round-half-even(x · 127 / max|x|) in [-127, 127], and the block sums
/// Σ q that undo the weights' unsigned offset. A row or block with a NaN or infinite value gets
/// d = NaN, so its outputs are NaN (as the f32 path would give), never a silent finite value.
#[derive(Default)]
pub struct QuantRows {
    pub m: usize,
    pub k: usize,
    /// bytes per row of `q` (k, rounded up to a multiple of 64)
    kp: usize,
    q: Vec<i8>,
    /// where the rows start in `q` (a 64-byte boundary)
    qo: usize,
    s: Vec<i32>,
    d: Vec<f32>,
}

impl QuantRows {
    /// The first row's quants (row t at `+ t·kp`).
    fn quants(&self) -> *const i8 {
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
        let (qp, sp, dp) = (Shared(self.q[self.qo..].as_mut_ptr()), Shared(self.s.as_mut_ptr()), Shared(self.d.as_mut_ptr()));
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
struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

/// One row: per 32-block the int8 quants, their sum and the scale (see `QuantRows`): AVX-512
/// where the CPU has it (`x86::quantize_row_avx512`), else portable code (lane-wise max,
/// rounding with the 1.5·2²³ trick, which rounds half to even for |v| < 2²²). Both give the same
/// bits (max is exact in any order, the scale is the same division, and both round half to even).
pub fn quantize_row(x: &[f32], q: &mut [i8], s: &mut [i32], d: &mut [f32]) {
    let nb = x.len() / QK;
    assert!(q.len() >= nb * QK && s.len() >= nb && d.len() >= nb, "quantize_row: {} values into {} quants", x.len(), q.len());
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
            let v = if v == v { v } else { 0.0 };
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

// ---------------------------------------------------------------- tiles
// ---------------------------------------------------------------- tiles

/// One register tile's operands: n ≤ TILE token rows × one group (32 rows), over `blocks`
/// 32-blocks (whole units) starting at the group's unit `w` (the next unit `stride` bytes on);
/// token t's quants at `x + t·xs`, its block sums and scales at `sx + t·ds`, `dx + t·ds`;
/// outputs (32 floats a token) at `y + t·GROUP`, resumed from the partial sums there when `resume`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub(crate) w: *const u8,
    pub(crate) stride: usize,
    pub(crate) x: *const i8,
    pub(crate) xs: usize,
    pub(crate) sx: *const i32,
    pub(crate) dx: *const f32,
    pub(crate) ds: usize,
    pub(crate) blocks: usize,
    pub(crate) y: *mut f32,
    pub(crate) resume: bool,
}

impl Tile {
    /// The tile of tokens from `t` over blocks b0..b0 + blocks of `x`, against the group's units from
    /// `w` (`stride` bytes apart), its outputs at `y`, resumed when b0 > 0.
    ///
    /// Safety: as `Tile`'s pointers (t and the blocks within x; w and y covering them).
    #[allow(clippy::too_many_arguments)]
    unsafe fn of(x: &QuantRows, w: *const u8, stride: usize, t: usize, b0: usize, blocks: usize, y: *mut f32) -> Tile {
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

/// The chain in portable code: per block the exact integer dot product, then the fma(s).
unsafe fn tile_generic(kind: BlockKind, t: &Tile, n: usize) {
    let ubl = kind.unit_blocks();
    let f16_at = |p: *const u8| f16::from_le_bytes([*p, *p.add(1)]).to_f32();
    for tok in 0..n {
        let y = t.y.add(tok * GROUP);
        for rr in 0..GROUP {
            let mut acc = if t.resume { *y.add(rr) } else { 0.0 };
            for b in 0..t.blocks {
                let unit = t.w.add(b / ubl * t.stride);
                let j = b % ubl;
                let quants = match kind {
                    BlockKind::Q4K => std::slice::from_raw_parts(unit.add(K_HEADER + j * Q4_BYTES), Q4_BYTES),
                    BlockKind::Q4_0 => std::slice::from_raw_parts(unit.add(SCALES), Q4_BYTES),
                    BlockKind::Q8_0 => std::slice::from_raw_parts(unit.add(SCALES), Q8_BYTES),
                };
                let xb = std::slice::from_raw_parts(t.x.add(tok * t.xs + b * QK), QK);
                let mut isum = 0i32;
                for (i, &xv) in xb.iter().enumerate() {
                    let w = match kind {
                        BlockKind::Q8_0 => quants[quant_at(rr, i, false).0] as i32 - 128,
                        BlockKind::Q4_0 => nibble(quants, rr, i) as i32 - 8,
                        BlockKind::Q4K => nibble(quants, rr, i) as i32,
                    };
                    isum += w * xv as i32;
                }
                let dx = *t.dx.add(tok * t.ds + b);
                match kind {
                    BlockKind::Q4K => {
                        let ds = f16_at(unit.add(rr * 2)) * *unit.add(K_SC + j * GROUP + rr) as f32;
                        let dm = f16_at(unit.add(K_DMIN + rr * 2)) * *unit.add(K_M + j * GROUP + rr) as f32;
                        let sx = *t.sx.add(tok * t.ds + b) as f32;
                        acc = (isum as f32).mul_add(ds * dx, acc);
                        acc = (-sx).mul_add(dm * dx, acc);
                    }
                    _ => acc = (isum as f32).mul_add(f16_at(unit.add(rr * 2)) * dx, acc),
                }
            }
            *y.add(rr) = acc;
        }
    }
}

/// Run `f` on this thread's scratch of at least `len` floats (kernels::with_scratch, grown here).
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Layout, QuantRows, Tile, GROUP, K_DMIN, K_HEADER, K_M, K_SC, PANEL, Q4_BYTES, QK, SCALES};
    use crate::qblocks::BlockKind;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn bcast4(p: *const i8) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
    }

    #[inline(always)]
    unsafe fn bcast4y(p: *const i8) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
    }

    /// `super::quantize_row` of nb 32-blocks at `x` into `q` (nb·32 bytes), `s` and `d` (nb each).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_row_avx512(x: *const f32, nb: usize, q: *mut i8, s: *mut i32, d: *mut f32) {
        let inf = _mm512_set1_ps(f32::INFINITY);
        for b in 0..nb {
            let (x0, x1) = (_mm512_loadu_ps(x.add(b * QK)), _mm512_loadu_ps(x.add(b * QK + 16)));
            let (a0, a1) = (_mm512_abs_ps(x0), _mm512_abs_ps(x1));
            // |x| < inf is false for NaN and ±inf
            let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a0, inf) & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a1, inf) == 0xFFFF;
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
        let prefetch = super::gemv_prefetch();
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
                        let dm =
                            _mm512_mul_ps(f16x16(ub.add(K_DMIN + p * 32)), u8x16(ub.add(K_M + j * GROUP + p * PANEL)));
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
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [BlockKind; 3] = [BlockKind::Q8_0, BlockKind::Q4_0, BlockKind::Q4K];

    #[test]
    fn the_decode_prefetch_is_left_to_the_hardware_on_amd_only() {
        assert!(!prefetch_for_vendor("AuthenticAMD"));
        assert!(prefetch_for_vendor("GenuineIntel"));
        #[cfg(target_arch = "x86_64")]
        {
            let v = cpu_vendor();
            assert_eq!(v.len(), 12, "{v:?}");
            assert_eq!(gemv_prefetch(), v != "AuthenticAMD");
        }
    }

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
            .map(|r| (0..k).map(|i| w[r * k + i] as f64 * x.q[x.qo + t * x.kp + i] as f64 * x.d[t * nb + i / QK] as f64).sum())
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
        assert_eq!(d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), d2.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert!(d[4].is_nan() && d[5].is_nan() && !d[6].is_nan() && q[64..96].iter().any(|&v| v != 0));
    }

    #[test]
    fn int_matmul_is_batch_invariant_at_every_simd_level_and_matches_f64() {
        let serial = Par::new(1).unwrap();
        let par = Par::new(2).unwrap();
        let mmax = 40;
        // out: partial group, partial panel, exact, one row; k: one unit, several, across k chunks
        // (q8_0: 15 blocks a chunk, q4_0: 28, q4_K: 3 super-blocks), rows not a multiple of 64 bytes
        for &(rows, k) in &[(200, 1280), (77, 256), (64, 768), (1, 1792), (45, 2048)] {
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
