//! Integer matmul kernels for block-quantized weights (q8_0 and q4_0: 32 weights a block, one f16
//! scale each, GGML's formats) against activations quantized per row and per 32-block to int8
//! (llama.cpp's q8_0 × q8_0 and q8_0 × q4_0 `vec_dot`). Each 32-block's products are summed in
//! int32 (exact), and the scales are applied once per block.
//!
//! **Batch invariance by construction.** Output (t, r) is always the chain
//!
//! ```text
//! acc = 0;  for b in 0..blocks { acc = fma(f32(isum(t, r, b)), f32(dw[r, b]) · dx[t, b], acc) }
//! ```
//!
//! over the blocks in order, where `isum` is the exact integer dot product of the block (any
//! order of integer additions gives the same value) and `dw · dx` is rounded to f32 before the
//! fma. Every SIMD level, tile shape, batch size and thread split computes this very chain, so
//! a token's outputs are the same bits alone or beside others, and the same on every level.
//!
//! SIMD levels (picked at run time, `int_level`): AVX-512 VNNI (`vpdpbusd`: unsigned weight bytes
//! times signed activation bytes, four products a lane a step), AVX2 (`vpmaddubsw`, with
//! llama.cpp's sign trick for q8_0 so that no pair sum saturates), and portable code.
//!
//! Layout (`PackedQ`): rows in groups of 32 (two panels of 16 rows: one zmm of int32 sums each),
//! each group's blocks in order, a group-block = 32 f16 scales (64 bytes) then the quants, so a
//! group streams as one run. Inside a group-block the quants are k-major in steps of 4: step s
//! (k = 4s..4s+3 of the block) holds panel 0's 16 rows × 4 bytes, then panel 1's (64 bytes
//! each: one `vpdpbusd` operand). q8_0 stores q + 128 (1..=255, unsigned); q4_0 packs two steps
//! per 64 bytes: the low nibbles are step 2j, the high nibbles step 2j + 1 (q + 8, 0..=15, as
//! GGML's q4_0 stores them). The unsigned offset is undone with the activations' block sums:
//! Σ x·(w + o) − o·Σ x.

use crate::kernels::{Par, SyncPtr};
use half::f16;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

/// Weights (and activations) per block: GGML's QK8_0 = QK4_0 = 32.
pub const QK: usize = 32;
/// Output rows per panel (one zmm of int32 sums).
const PANEL: usize = 16;
/// Output rows per group (two panels): the unit a thread takes and a register tile covers.
pub const GROUP: usize = 32;
/// Bytes of a group-block's scales (GROUP f16).
const SCALE_BYTES: usize = GROUP * 2;
/// Token rows per register tile.
pub const TILE: usize = 6;
/// Weight bytes of one group × one k chunk that the token tiles share while it sits in L1.
const CHUNK_BYTES: usize = 16 << 10;
/// Groups a one-token matmul (decode) streams at once on AVX-512: that many sequential streams
/// for the hardware prefetchers.
const GEMV_GROUPS: usize = 4;
/// Token rows that run over every group before the next rows start (a multiple of TILE): their
/// quantized activations stay in L2 across the groups, and the outputs they write touch few pages.
const TOKEN_BLOCK: usize = 60;

/// How one block of 32 weights is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockKind {
    /// 8-bit: w = d · q, q in [-127, 127], d = max|w| / 127 (GGML q8_0).
    Q8_0,
    /// 4-bit: w = d · (q − 8), q in [0, 15], d = (the w of largest |w|) / −8 (GGML q4_0).
    Q4_0,
}

impl BlockKind {
    /// GGML's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Q8_0 => "q8_0",
            BlockKind::Q4_0 => "q4_0",
        }
    }

    /// Bytes of quants in one group-block.
    const fn quant_bytes(self) -> usize {
        match self {
            BlockKind::Q8_0 => GROUP * QK,
            BlockKind::Q4_0 => GROUP * QK / 2,
        }
    }

    /// Bytes from one block of a group to the next.
    pub const fn block_stride(self) -> usize {
        SCALE_BYTES + self.quant_bytes()
    }

    /// The kind a kernel's `Q4` parameter names.
    const fn of<const Q4: bool>() -> Self {
        if Q4 {
            BlockKind::Q4_0
        } else {
            BlockKind::Q8_0
        }
    }

    /// The unsigned offset of the stored quants (stored = q + offset for q8_0, the nibble for q4_0).
    const fn offset(self) -> i32 {
        match self {
            BlockKind::Q8_0 => 128,
            BlockKind::Q4_0 => 8,
        }
    }

    /// Bits a weight costs in memory, scales included (8.5 or 4.5).
    pub fn bits_per_weight(self) -> f64 {
        (self.block_stride() * 8) as f64 / (GROUP * QK) as f64
    }
}

/// The integer kernels' SIMD level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntLevel {
    /// AVX-512 F + BW + VNNI (`vpdpbusd`) and F16C.
    Avx512Vnni,
    /// AVX2 + FMA + F16C (`vpmaddubsw`).
    Avx2,
    Generic,
}

/// The level the CPU runs, detected once. `SHALIK_RUST_SIMD=avx2` or `=generic` caps it (as for
/// the f32 kernels).
pub fn int_level() -> IntLevel {
    static LEVEL: OnceLock<IntLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = std::env::var("SHALIK_RUST_SIMD").unwrap_or_default();
        let all = int_levels();
        match cap.as_str() {
            "generic" => IntLevel::Generic,
            "avx2" => *all.iter().find(|l| **l != IntLevel::Avx512Vnni).unwrap_or(&IntLevel::Generic),
            _ => all[0],
        }
    })
}

/// Every level this CPU can run, fastest first (the tests run each one).
pub fn int_levels() -> Vec<IntLevel> {
    let mut v = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") && has!("f16c") && has!("fma") {
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

/// A weight matrix W (`out` × `inp`, the nn.Linear layout) in blocks of 32 along `inp`, packed
/// for the integer kernels (see the module's layout). The last group is padded with zero rows.
pub struct PackedQ {
    pub kind: BlockKind,
    pub out: usize,
    pub inp: usize,
    /// Blocks per row (inp / 32).
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
    /// Quantize row-major `w` (out × inp) to `kind` with GGML's rounding (as gguf-py's
    /// `quants.quantize` and llama.cpp's `quantize_row_*_ref`): q8_0 d = max|w| / 127, q =
    /// round-half-away(w / d); q4_0 d = w_max / −8 where w_max has the largest |w|, q =
    /// trunc(w / d + 8.5) clamped to 0..=15; d stored as f16, q computed with the f32 1/d.
    ///
    /// Errors (`Err(message)`) when `inp` is not a multiple of 32 (a block would need padding)
    /// or a weight is NaN or infinite; `w.len()` must be out × inp.
    pub fn quantize(kind: BlockKind, w: &[f32], out: usize, inp: usize) -> Result<Self, String> {
        if w.len() != out * inp {
            return Err(format!("{} weights for a {out} × {inp} matrix", w.len()));
        }
        if inp % QK != 0 || inp == 0 {
            return Err(format!(
                "shape [{out}, {inp}]: {} needs in_features to be a positive multiple of {QK} (its block size)",
                kind.name()
            ));
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(format!("shape [{out}, {inp}]: weight [{}, {}] is {}", i / inp, i % inp, w[i]));
        }
        let nb = inp / QK;
        let groups = out.div_ceil(GROUP);
        let len = groups * nb * kind.block_stride();
        let mut buf = vec![0u8; len + 64];
        let off = buf.as_ptr().align_offset(64).min(64);
        let data = &mut buf[off..off + len];
        // padding rows: scale 0 and quants that mean 0
        let zero = match kind {
            BlockKind::Q8_0 => 128u8,
            BlockKind::Q4_0 => 0x88,
        };
        for gb in data.chunks_exact_mut(kind.block_stride()) {
            gb[SCALE_BYTES..].fill(zero);
        }
        let mut q = [0u8; QK];
        for r in 0..out {
            let (g, rr) = (r / GROUP, r % GROUP);
            let (p, lane) = (rr / PANEL, rr % PANEL);
            for b in 0..nb {
                let src = &w[r * inp + b * QK..r * inp + (b + 1) * QK];
                let d = quantize_block(kind, src, &mut q);
                let gb = &mut data[(g * nb + b) * kind.block_stride()..][..kind.block_stride()];
                gb[rr * 2..rr * 2 + 2].copy_from_slice(&d.to_le_bytes());
                let quants = &mut gb[SCALE_BYTES..];
                match kind {
                    BlockKind::Q8_0 => {
                        for (i, &v) in q.iter().enumerate() {
                            let (s, j) = (i / 4, i % 4);
                            quants[s * GROUP * 4 + p * PANEL * 4 + lane * 4 + j] = v;
                        }
                    }
                    BlockKind::Q4_0 => {
                        for i in 0..QK {
                            // step s = i / 4 lives in pair s / 2, low nibble when s is even
                            let (s, j) = (i / 4, i % 4);
                            let at = (s / 2) * GROUP * 4 + p * PANEL * 4 + lane * 4 + j;
                            if s % 2 == 0 {
                                quants[at] = (quants[at] & 0xF0) | q[i];
                            } else {
                                quants[at] = (quants[at] & 0x0F) | (q[i] << 4);
                            }
                        }
                    }
                }
            }
        }
        Ok(PackedQ { kind, out, inp, nb, buf, off })
    }

    fn data(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.out.div_ceil(GROUP) * self.nb * self.kind.block_stride()]
    }

    /// Bytes the packed matrix occupies (what a matmul streams).
    pub fn bytes(&self) -> usize {
        self.data().len()
    }

    /// Row `r` dequantized (w = d · q) into `dst[..inp]`: the embedding lookup of a quantized table.
    pub fn row(&self, r: usize, dst: &mut [f32]) {
        let (g, rr) = (r / GROUP, r % GROUP);
        let (p, lane) = (rr / PANEL, rr % PANEL);
        let data = self.data();
        for b in 0..self.nb {
            let gb = &data[(g * self.nb + b) * self.kind.block_stride()..][..self.kind.block_stride()];
            let d = f16::from_le_bytes([gb[rr * 2], gb[rr * 2 + 1]]).to_f32();
            let quants = &gb[SCALE_BYTES..];
            for i in 0..QK {
                let (s, j) = (i / 4, i % 4);
                let q = match self.kind {
                    BlockKind::Q8_0 => quants[s * GROUP * 4 + p * PANEL * 4 + lane * 4 + j] as i32 - 128,
                    BlockKind::Q4_0 => {
                        let v = quants[(s / 2) * GROUP * 4 + p * PANEL * 4 + lane * 4 + j];
                        (if s % 2 == 0 { v & 0x0F } else { v >> 4 }) as i32 - 8
                    }
                };
                dst[b * QK + i] = d * q as f32;
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
        let (m, out, nb, kind) = (x.m, self.out, self.nb, self.kind);
        let stride = kind.block_stride();
        let data = self.data();
        let group_bytes = nb * stride;
        #[cfg(target_arch = "x86_64")]
        if m == 1 && level == IntLevel::Avx512Vnni {
            // decode: up to GEMV_GROUPS whole groups at once, straight into y; a partial last
            // group goes through the tiles below
            let whole = (out / GROUP).min(range.end);
            let mut g = range.start;
            while g < whole {
                let n = (whole - g).min(GEMV_GROUPS);
                let (w, yy) = (data.as_ptr().add(g * group_bytes), y.add(g * GROUP));
                match (kind, n) {
                    (BlockKind::Q8_0, 1) => x86::gemv_vnni::<false, 1>(w, group_bytes, x, nb, yy),
                    (BlockKind::Q8_0, 2) => x86::gemv_vnni::<false, 2>(w, group_bytes, x, nb, yy),
                    (BlockKind::Q8_0, 3) => x86::gemv_vnni::<false, 3>(w, group_bytes, x, nb, yy),
                    (BlockKind::Q8_0, _) => x86::gemv_vnni::<false, 4>(w, group_bytes, x, nb, yy),
                    (BlockKind::Q4_0, 1) => x86::gemv_vnni::<true, 1>(w, group_bytes, x, nb, yy),
                    (BlockKind::Q4_0, 2) => x86::gemv_vnni::<true, 2>(w, group_bytes, x, nb, yy),
                    (BlockKind::Q4_0, 3) => x86::gemv_vnni::<true, 3>(w, group_bytes, x, nb, yy),
                    (BlockKind::Q4_0, _) => x86::gemv_vnni::<true, 4>(w, group_bytes, x, nb, yy),
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
        let (m, out, nb, kind) = (x.m, self.out, self.nb, self.kind);
        let stride = kind.block_stride();
        let data = self.data();
        let group_bytes = nb * stride;
        // one token tile: k whole; more: k in chunks that stay in L1 while every tile of the
        // token block runs over them
        let chunk = if m <= TILE { nb } else { (CHUNK_BYTES / stride).clamp(1, nb) };
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
                            let tile = Tile {
                                w: gw.add(b0 * stride),
                                stride,
                                x: x.q.as_ptr().add(t * x.kp + b0 * QK),
                                xs: x.kp,
                                sx: x.s.as_ptr().add(t * nb + b0),
                                dx: x.d.as_ptr().add(t * nb + b0),
                                ds: nb,
                                blocks: chunk.min(nb - b0),
                                y: acc.as_mut_ptr().add(t0 * GROUP),
                                resume: b0 > 0,
                            };
                            run_tile(level, kind, TILE.min(tn - t0), &tile);
                        }
                    }
                    let rows = GROUP.min(out - g * GROUP);
                    for t in 0..tn {
                        let (src, dst) = (acc.as_ptr().add(t * GROUP), y.add((tb + t) * ys + g * GROUP));
                        if rows == GROUP {
                            std::ptr::copy_nonoverlapping(src, dst, GROUP);
                        } else {
                            std::ptr::copy_nonoverlapping(src, dst, rows);
                        }
                    }
                }
            }
        });
    }
}

/// Quantize one block: the f16 scale and the stored quants (q8_0: q + 128; q4_0: the nibble).
fn quantize_block(kind: BlockKind, src: &[f32], q: &mut [u8; QK]) -> f16 {
    match kind {
        BlockKind::Q8_0 => {
            let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (o, &v) in q.iter_mut().zip(src) {
                *o = ((v * id).round().clamp(-127.0, 127.0) as i32 + 128) as u8;
            }
            f16::from_f32(d)
        }
        BlockKind::Q4_0 => {
            let mut wmax = 0f32;
            for &v in src {
                if v.abs() > wmax.abs() {
                    wmax = v;
                }
            }
            let d = wmax / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (o, &v) in q.iter_mut().zip(src) {
                *o = ((v * id + 8.5).trunc().clamp(0.0, 15.0)) as u8;
            }
            f16::from_f32(d)
        }
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
    s: Vec<i32>,
    d: Vec<f32>,
}

impl QuantRows {
    /// Quantize x (m × k, row-major; k a multiple of 32), each row on its own (per-row work:
    /// the result for a row does not depend on the others), split over `par`'s threads when large.
    pub fn quantize(&mut self, par: &Par, x: &[f32], m: usize, k: usize) {
        assert!(k % QK == 0 && x.len() >= m * k, "quantize rows: {m} × {k} from {} floats", x.len());
        let nb = k / QK;
        let kp = k.div_ceil(64) * 64;
        self.m = m;
        self.k = k;
        self.kp = kp;
        self.q.resize(m * kp + 64, 0);
        self.s.resize(m * nb, 0);
        self.d.resize(m * nb, 0.0);
        let (qp, sp, dp) = (Shared(self.q.as_mut_ptr()), Shared(self.s.as_mut_ptr()), Shared(self.d.as_mut_ptr()));
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

/// One row: per 32-block the int8 quants, their sum and the scale (see `QuantRows`). Written so
/// that it vectorizes (lane-wise max, rounding with the 1.5·2²³ trick, which rounds half to even
/// for |v| < 2²²), and the same code serves every SIMD level.
pub fn quantize_row(x: &[f32], q: &mut [i8], s: &mut [i32], d: &mut [f32]) {
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

/// One register tile's operands: n ≤ TILE token rows × one group (32 rows), over `blocks`
/// blocks starting at the group-block `w`; token t's quants at `x + t·xs`, its block sums and
/// scales at `sx + t·ds`, `dx + t·ds`; outputs (32 floats a token) at `y + t·GROUP`, resumed
/// from the partial sums there when `resume`.
#[derive(Clone, Copy)]
struct Tile {
    w: *const u8,
    stride: usize,
    x: *const i8,
    xs: usize,
    sx: *const i32,
    dx: *const f32,
    ds: usize,
    blocks: usize,
    y: *mut f32,
    resume: bool,
}

/// Run one tile of n tokens at `level`.
///
/// Safety: the pointers of `tile` must cover n tokens × `blocks` blocks (see `Tile`).
unsafe fn run_tile(level: IntLevel, kind: BlockKind, n: usize, tile: &Tile) {
    macro_rules! by_n {
        ($f:ident, $q4:literal) => {
            match n {
                1 => $f::<$q4, 1>(tile),
                2 => $f::<$q4, 2>(tile),
                3 => $f::<$q4, 3>(tile),
                4 => $f::<$q4, 4>(tile),
                5 => $f::<$q4, 5>(tile),
                _ => $f::<$q4, 6>(tile),
            }
        };
    }
    match (level, kind) {
        #[cfg(target_arch = "x86_64")]
        (IntLevel::Avx512Vnni, BlockKind::Q8_0) => {
            use x86::tile_vnni;
            by_n!(tile_vnni, false)
        }
        #[cfg(target_arch = "x86_64")]
        (IntLevel::Avx512Vnni, BlockKind::Q4_0) => {
            use x86::tile_vnni;
            by_n!(tile_vnni, true)
        }
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
                    }
                }
                t0 += nn;
            }
        }
        (_, BlockKind::Q8_0) => tile_generic::<false>(tile, n),
        (_, BlockKind::Q4_0) => tile_generic::<true>(tile, n),
    }
}

/// The chain in portable code: per block the exact integer dot product, then one fma.
unsafe fn tile_generic<const Q4: bool>(t: &Tile, n: usize) {
    for tok in 0..n {
        let y = t.y.add(tok * GROUP);
        for rr in 0..GROUP {
            let (p, lane) = (rr / PANEL, rr % PANEL);
            let mut acc = if t.resume { *y.add(rr) } else { 0.0 };
            for b in 0..t.blocks {
                let gb = t.w.add(b * t.stride);
                let d = f16::from_le_bytes([*gb.add(rr * 2), *gb.add(rr * 2 + 1)]).to_f32();
                let quants = gb.add(SCALE_BYTES);
                let xb = t.x.add(tok * t.xs + b * QK);
                let mut isum = 0i32;
                for i in 0..QK {
                    let (s, j) = (i / 4, i % 4);
                    let w = if Q4 {
                        let v = *quants.add((s / 2) * GROUP * 4 + p * PANEL * 4 + lane * 4 + j);
                        (if s % 2 == 0 { v & 0x0F } else { v >> 4 }) as i32 - 8
                    } else {
                        *quants.add(s * GROUP * 4 + p * PANEL * 4 + lane * 4 + j) as i32 - 128
                    };
                    isum += w * *xb.add(i) as i32;
                }
                let dx = *t.dx.add(tok * t.ds + b);
                acc = (isum as f32).mul_add(d * dx, acc);
            }
            *y.add(rr) = acc;
        }
    }
}

/// Run `f` on this thread's scratch of at least `len` floats, or a fresh one if the kept one is
/// busy (a rayon job stolen while this thread waits can run another matmul here).
fn with_acc<R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    key.with(|cell| {
        let mut fresh = Vec::new();
        let mut kept = cell.try_borrow_mut();
        let buf = match kept.as_deref_mut() {
            Ok(b) => b,
            Err(_) => &mut fresh,
        };
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockKind, QuantRows, Tile, GROUP, PANEL, QK, SCALE_BYTES};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn bcast4(p: *const i8) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
    }

    /// One tile on AVX-512 VNNI: T tokens × one group (2 panels) in 2·T int32 accumulators (one
    /// block) and 2·T f32 accumulators (the chains). Per block: the int accumulators start at
    /// −offset · Σx (undoing the unsigned weights), 8 `vpdpbusd` steps (q8_0: a 64-byte load a
    /// panel a step; q4_0: one load a panel per two steps, split into low and high nibbles),
    /// then per panel and token acc = fma(cvt(isum), dw · dx, acc).
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
        let off = BlockKind::of::<Q4>().offset();
        let low = _mm512_set1_epi8(0x0F);
        for b in 0..t.blocks {
            let gb = t.w.add(b * t.stride);
            let q = gb.add(SCALE_BYTES);
            let mut acc = [[_mm512_setzero_si512(); 2]; T];
            for i in 0..T {
                let c = _mm512_set1_epi32(-off * *t.sx.add(i * t.ds + b));
                acc[i] = [c, c];
            }
            if Q4 {
                for j in 0..4 {
                    for p in 0..2 {
                        let v = _mm512_loadu_si512(q.add(j * GROUP * 4 + p * 64).cast());
                        let lo = _mm512_and_si512(v, low);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        for i in 0..T {
                            let xp = t.x.add(i * t.xs + b * QK + 8 * j);
                            acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], lo, bcast4(xp));
                            acc[i][p] = _mm512_dpbusd_epi32(acc[i][p], hi, bcast4(xp.add(4)));
                        }
                    }
                }
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
            let dw = [
                _mm512_cvtph_ps(_mm256_loadu_si256(gb.cast())),
                _mm512_cvtph_ps(_mm256_loadu_si256(gb.add(32).cast())),
            ];
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

    /// One token against G whole groups at once (decode): the chain of `tile_vnni`, the G groups
    /// read as G sequential streams (group g at `w + g·gs`), outputs to `y[32·g ..]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c,fma")]
    #[allow(clippy::needless_range_loop)]
    pub unsafe fn gemv_vnni<const Q4: bool, const G: usize>(
        w: *const u8,
        gs: usize,
        x: &QuantRows,
        nb: usize,
        y: *mut f32,
    ) {
        let (stride, off) = (BlockKind::of::<Q4>().block_stride(), BlockKind::of::<Q4>().offset());
        let low = _mm512_set1_epi8(0x0F);
        let mut accf = [[_mm512_setzero_ps(); 2]; G];
        let xq = x.q.as_ptr();
        for b in 0..nb {
            let c = _mm512_set1_epi32(-off * x.s[b]);
            let mut acc = [[c; 2]; G];
            let xb = xq.add(b * QK);
            for g in 0..G {
                // a few blocks ahead (a prefetch never faults, so it may run past the matrix)
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(g * gs + (b + 4) * stride).cast());
            }
            if Q4 {
                for j in 0..4 {
                    let x0 = bcast4(xb.add(8 * j));
                    let x1 = bcast4(xb.add(8 * j + 4));
                    for g in 0..G {
                        let q = w.add(g * gs + b * stride + SCALE_BYTES);
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
                        let q = w.add(g * gs + b * stride + SCALE_BYTES);
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
                    let dw = _mm512_cvtph_ps(_mm256_loadu_si256(gb.add(p * 32).cast()));
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

    /// One tile on AVX2: T ≤ 3 tokens × panel `p` (16 rows, two ymm halves of 8). q8_0 uses
    /// llama.cpp's sign trick (|w| · sign(x, w), so that `vpmaddubsw`'s pair sums stay below
    /// 2·127·127 and never saturate) and needs no offset; q4_0 multiplies the nibbles (≤ 15)
    /// directly and starts from −8 · Σx. Then the same fma per block as every level.
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
        let low = _mm256_set1_epi8(0x0F);
        let flip = _mm256_set1_epi8(-128);
        for b in 0..t.blocks {
            let gb = t.w.add(b * t.stride);
            let q = gb.add(SCALE_BYTES + p * 64);
            let mut acc = [[_mm256_setzero_si256(); 2]; T];
            if Q4 {
                for i in 0..T {
                    let c = _mm256_set1_epi32(-BlockKind::Q4_0.offset() * *t.sx.add(i * t.ds + b));
                    acc[i] = [c, c];
                }
                for j in 0..4 {
                    for h in 0..2 {
                        let v = _mm256_loadu_si256(q.add(j * GROUP * 4 + h * 32).cast());
                        let lo = _mm256_and_si256(v, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        for i in 0..T {
                            let xp = t.x.add(i * t.xs + b * QK + 8 * j);
                            let x0 = _mm256_set1_epi32(std::ptr::read_unaligned(xp as *const i32));
                            let x1 = _mm256_set1_epi32(std::ptr::read_unaligned(xp.add(4) as *const i32));
                            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones);
                            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones);
                            acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_add_epi32(p0, p1));
                        }
                    }
                }
            } else {
                for s in 0..8 {
                    for h in 0..2 {
                        let v = _mm256_loadu_si256(q.add(s * GROUP * 4 + h * 32).cast());
                        let ws = _mm256_xor_si256(v, flip); // q + 128 → q (signed)
                        let aw = _mm256_sign_epi8(ws, ws);
                        for i in 0..T {
                            let xp = t.x.add(i * t.xs + b * QK + 4 * s);
                            let xv = _mm256_set1_epi32(std::ptr::read_unaligned(xp as *const i32));
                            let sx = _mm256_sign_epi8(xv, ws);
                            let p16 = _mm256_maddubs_epi16(aw, sx);
                            acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(p16, ones));
                        }
                    }
                }
            }
            let dw = [
                _mm256_cvtph_ps(_mm_loadu_si128(gb.add(p * 32).cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(gb.add(p * 32 + 16).cast())),
            ];
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(rows: usize, k: usize, seed: usize) -> Vec<f32> {
        // a spread of magnitudes per block, and some exact zeros (an all-zero block among them)
        (0..rows * k)
            .map(|i| {
                let v = ((i * 7919 + seed) % 2003) as f32 / 1001.0 - 1.0;
                if (i / QK) % 17 == 3 {
                    0.0
                } else {
                    v * (1.0 + ((i / QK) % 5) as f32)
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

    /// The chain's value in f64 from the same quantized operands (dequantized weights and activations).
    fn reference(p: &PackedQ, x: &QuantRows, t: usize) -> Vec<f64> {
        let (k, nb) = (p.inp, p.nb);
        let mut row = vec![0f32; k];
        (0..p.out)
            .map(|r| {
                p.row(r, &mut row);
                (0..nb)
                    .map(|b| {
                        let dx = x.d[t * nb + b] as f64;
                        (0..QK).map(|i| row[b * QK + i] as f64 * x.q[t * x.kp + b * QK + i] as f64 * dx).sum::<f64>()
                    })
                    .sum()
            })
            .collect()
    }

    #[test]
    fn packing_round_trips_and_matches_ggml_rounding() {
        // q8_0: d = max|w|/127, q = round-half-away(w/d); q4_0: d = w_max/−8, q = trunc(w/d + 8.5)
        let w: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.37).collect();
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            let p = PackedQ::quantize(kind, &w, 2, 32).unwrap();
            for r in 0..2 {
                let src = &w[r * 32..(r + 1) * 32];
                let mut got = vec![0f32; 32];
                p.row(r, &mut got);
                let mut q = [0u8; QK];
                let d = quantize_block(kind, src, &mut q).to_f32();
                for i in 0..32 {
                    let want = match kind {
                        BlockKind::Q8_0 => d * (q[i] as i32 - 128) as f32,
                        BlockKind::Q4_0 => d * (q[i] as i32 - 8) as f32,
                    };
                    assert_eq!(got[i], want);
                    // within half a step (q4_0: a step, at the clamped end)
                    assert!((got[i] - src[i]).abs() <= d.abs() * 0.51 + 1e-3, "{kind:?} {} vs {}", got[i], src[i]);
                }
            }
            let amax = w[32..].iter().fold(0f32, |a, v| a.max(v.abs()));
            let mut q = [0u8; QK];
            let d = quantize_block(kind, &w[32..], &mut q).to_f32();
            match kind {
                BlockKind::Q8_0 => assert_eq!(d, f16::from_f32(amax / 127.0).to_f32()),
                BlockKind::Q4_0 => assert_eq!(d, f16::from_f32(amax / -8.0).to_f32()), // the max is positive here
            }
        }
        assert!(PackedQ::quantize(BlockKind::Q4_0, &[0.0; 48], 1, 48).unwrap_err().contains("multiple of 32"));
        let e = PackedQ::quantize(BlockKind::Q8_0, &[f32::NAN; 32], 1, 32).unwrap_err();
        assert!(e.contains("NaN") && e.contains("[0, 0]"), "{e}");
        assert_eq!(BlockKind::Q4_0.bits_per_weight(), 4.5);
        assert_eq!(BlockKind::Q8_0.bits_per_weight(), 8.5);
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
        let p = PackedQ::quantize(BlockKind::Q8_0, &weights(3, 64, 1), 3, 64).unwrap();
        let mut xr = QuantRows::default();
        xr.quantize(&Par::new(1).unwrap(), &x, 1, 64);
        for level in int_levels() {
            let mut y = vec![0f32; 3];
            p.matmul_at(level, &Par::new(1).unwrap(), &xr, &mut y, 3);
            assert!(y.iter().all(|v| v.is_nan()), "{level:?}: {y:?}");
        }
    }

    #[test]
    fn int_matmul_is_batch_invariant_at_every_simd_level_and_matches_f64() {
        let serial = Par::new(1).unwrap();
        let par = Par::new(2).unwrap();
        let mmax = 40;
        // out: partial group, partial panel, exact, one row; k: one block, several, across k
        // chunks (q8_0: 15 blocks a chunk, q4_0: 28), not a multiple of 64 bytes
        for &(rows, k) in &[(200, 1280), (77, 96), (64, 32), (1, 992), (45, 2048)] {
            let w = weights(rows, k, rows);
            let x = acts(mmax, k);
            let mut xa = QuantRows::default();
            xa.quantize(&serial, &x, mmax, k);
            for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
                let p = PackedQ::quantize(kind, &w, rows, k).unwrap();
                let mut first: Option<Vec<f32>> = None;
                for level in int_levels() {
                    // every token alone (m = 1): the reference bits of this level
                    let mut alone = vec![0f32; mmax * rows];
                    for t in 0..mmax {
                        let mut xt = QuantRows::default();
                        xt.quantize(&serial, &x[t * k..(t + 1) * k], 1, k);
                        p.matmul_at(level, &serial, &xt, &mut alone[t * rows..(t + 1) * rows], rows);
                        let want = reference(&p, &xa, t);
                        for (r, (&a, &b)) in alone[t * rows..(t + 1) * rows].iter().zip(&want).enumerate() {
                            // f32 rounding of nb fmas over terms of at most 32·127²·|dw·dx| each
                            let nb = k / QK;
                            let mag: f64 = (0..nb)
                                .map(|b| {
                                    let mut row = vec![0f32; k];
                                    p.row(r, &mut row);
                                    (0..QK)
                                        .map(|i| (row[b * QK + i] as f64 * x[t * k + b * QK + i] as f64).abs())
                                        .sum::<f64>()
                                })
                                .sum::<f64>()
                                + 1e-3;
                            assert!(
                                ((a as f64) - b).abs() <= 1e-5 * mag,
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
        // the quantization error alone: |Δ| ≤ Σ |w|·dx/2 + |x|·|dw| (+ the cross term), per block
        let (rows, k, m) = (70, 256, 3);
        let w = weights(rows, k, 5);
        let x = acts(m, k);
        let mut xq = QuantRows::default();
        xq.quantize(&Par::new(1).unwrap(), &x, m, k);
        for kind in [BlockKind::Q8_0, BlockKind::Q4_0] {
            let p = PackedQ::quantize(kind, &w, rows, k).unwrap();
            let mut y = vec![0f32; m * rows];
            p.matmul(&Par::new(1).unwrap(), &xq, &mut y, rows);
            let mut worst = 0f64;
            for t in 0..m {
                for r in 0..rows {
                    let exact: f64 = (0..k).map(|i| w[r * k + i] as f64 * x[t * k + i] as f64).sum();
                    let mut bound = 0f64;
                    for b in 0..k / QK {
                        let mut q = [0u8; QK];
                        let dw = quantize_block(kind, &w[r * k + b * QK..r * k + (b + 1) * QK], &mut q).to_f32().abs()
                            as f64;
                        let dx = xq.d[t * (k / QK) + b] as f64;
                        for i in b * QK..(b + 1) * QK {
                            bound +=
                                (w[r * k + i] as f64).abs() * dx / 2.0 + (x[t * k + i] as f64).abs() * dw + dw * dx;
                        }
                    }
                    let err = (y[t * rows + r] as f64 - exact).abs();
                    assert!(err <= bound + 1e-4, "{kind:?} t{t} r{r}: {} vs {exact} (bound {bound})", y[t * rows + r]);
                    worst = worst.max(err / bound.max(1e-9));
                }
            }
            assert!(worst > 0.0);
        }
    }
}
