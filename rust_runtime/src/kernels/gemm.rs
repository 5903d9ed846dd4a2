//! The packed, batch-invariant f32 matmul (`PackedF32`: AVX-512 or AVX2+FMA picked at run time, so
//! a portable build is as fast as a `target-cpu=native` one) and the panel product that attention
//! runs on the KV cache with the same register tiles (`panel_product`).

use super::par::{with_scratch, Par, SyncPtr};
use super::simd::{simd_level, SimdLevel};
use std::cell::RefCell;
use std::ops::Range;

// ---------------------------------------------------------------- x86 register tiles

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// One register tile of the packed matmul on AVX2: T tokens × one 16-row panel in 2·T ymm
    /// accumulators (+ 2 weight registers + 1 broadcast ≤ 16), over `kc` k steps. `w`: the panel
    /// at the block's first k step (16 floats, the next step `ss` floats on); `x`: the packed
    /// token tile at that step (T floats a step); `y`: the tile's outputs, row t at `y + t·ys`, 16
    /// floats. `resume`: start from the partial sums in `y` (else from 0). Each output lane is the
    /// chain acc = fma(w, x, acc) over the k steps in order. `PF`: prefetch the weights
    /// PREFETCH_STEPS steps ahead (for a pass that streams them from memory rather than L1);
    /// `pf`: lines of another region to prefetch, a few a step (see `Region`).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)]
    pub unsafe fn tile_avx2<const T: usize, const PF: bool>(
        w: *const f32,
        ss: usize,
        x: *const f32,
        kc: usize,
        y: *mut f32,
        ys: usize,
        resume: bool,
        pf: super::Region,
    ) {
        let mut a0 = [_mm256_setzero_ps(); T];
        let mut a1 = [_mm256_setzero_ps(); T];
        if resume {
            for t in 0..T {
                a0[t] = _mm256_loadu_ps(y.add(t * ys));
                a1[t] = _mm256_loadu_ps(y.add(t * ys + 8));
            }
        }
        let _ = pf; // the AVX2 path streams with PF instead (a sliver is one panel of a group)
        for i in 0..kc {
            if PF {
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add((i + super::PREFETCH_STEPS) * ss).cast());
            }
            let w0 = _mm256_loadu_ps(w.add(i * ss));
            let w1 = _mm256_loadu_ps(w.add(i * ss + 8));
            for t in 0..T {
                let xb = _mm256_broadcast_ss(&*x.add(i * T + t));
                a0[t] = _mm256_fmadd_ps(w0, xb, a0[t]);
                a1[t] = _mm256_fmadd_ps(w1, xb, a1[t]);
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(y.add(t * ys), a0[t]);
            _mm256_storeu_ps(y.add(t * ys + 8), a1[t]);
        }
    }

    /// One token against G whole groups at once (G·4 zmm accumulators): y[64·g + r] = Σ_i
    /// w_g[i·64 + r]·x[i], group g at `w + g·gs`. The same per-lane chain as `tile_avx512`; it
    /// exists for decode, where the weights stream from memory: G groups are G sequential
    /// streams, which the hardware prefetchers fetch in parallel (one stream per core keeps too
    /// few lines in flight).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)]
    pub unsafe fn gemv_avx512<const G: usize>(w: *const f32, gs: usize, x: *const f32, k: usize, y: *mut f32) {
        let mut a = [[_mm512_setzero_ps(); 4]; G];
        for i in 0..k {
            let xb = _mm512_set1_ps(*x.add(i));
            for g in 0..G {
                let wg = w.add(g * gs + i * super::GROUP);
                for p in 0..4 {
                    a[g][p] = _mm512_fmadd_ps(_mm512_loadu_ps(wg.add(p * 16)), xb, a[g][p]);
                }
            }
        }
        for g in 0..G {
            for p in 0..4 {
                _mm512_storeu_ps(y.add(g * super::GROUP + p * 16), a[g][p]);
            }
        }
    }

    /// One register tile on AVX-512: T tokens × P panels (16·P rows, one zmm each) in P·T zmm
    /// accumulators (4 × 6 = 24, + 4 weight registers + 1 broadcast ≤ 32): per k step P weight
    /// loads (adjacent: a group's panels interleave) and T broadcasts feed P·T FMAs. Panel p
    /// starts at `w + 16·p`, k step i at `w + ss·i`; otherwise as `tile_avx2` (the same chain per output lane, so the
    /// same bits as any other tile shape).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // register tiles: a[t][p] reads clearer than zipped iterators
    pub unsafe fn tile_avx512<const P: usize, const T: usize, const PF: bool>(
        w: *const f32,
        ss: usize,
        x: *const f32,
        kc: usize,
        y: *mut f32,
        ys: usize,
        resume: bool,
        pf: super::Region,
    ) {
        let mut a = [[_mm512_setzero_ps(); P]; T];
        if resume {
            for t in 0..T {
                for p in 0..P {
                    a[t][p] = _mm512_loadu_ps(y.add(t * ys + p * 16));
                }
            }
        }
        macro_rules! step {
            ($i:expr) => {{
                let i = $i;
                if PF {
                    for p in 0..P {
                        _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add((i + super::PREFETCH_STEPS) * ss + p * 16).cast());
                    }
                }
                let mut wv = [_mm512_setzero_ps(); P];
                for p in 0..P {
                    wv[p] = _mm512_loadu_ps(w.add(i * ss + p * 16));
                }
                for t in 0..T {
                    let xb = _mm512_set1_ps(*x.add(i * T + t));
                    for p in 0..P {
                        a[t][p] = _mm512_fmadd_ps(wv[p], xb, a[t][p]);
                    }
                }
            }};
        }
        // the region's prefetches ride on the first steps only, so the rest of the loop stays bare
        let npf = pf.steps().min(kc);
        for i in 0..npf {
            pf.step(i);
            step!(i);
        }
        for i in npf..kc {
            step!(i);
        }
        for t in 0..T {
            for p in 0..P {
                _mm512_storeu_ps(y.add(t * ys + p * 16), a[t][p]);
            }
        }
    }
}

/// Below this many floats of x, `PackedF32::matmul` repacks x on the calling thread.
const PACK_PAR_FLOATS: usize = 1 << 17;

/// Cache lines to prefetch into L2 while a tile runs, two at each of its first steps: a tile over
/// one weight block fetches its share of the next block, so that the block arrives spread over
/// all the token tiles instead of stalling the first (whose loads would otherwise wait on memory
/// with few lines in flight).
#[derive(Clone, Copy)]
pub(crate) struct Region {
    start: *const f32,
    lines: usize,
}

impl Region {
    const NONE: Region = Region { start: std::ptr::null(), lines: 0 };

    /// Steps that carry prefetches.
    #[inline(always)]
    fn steps(&self) -> usize {
        self.lines.div_ceil(2)
    }

    /// Issue step i's two prefetches (i < `steps()`; the second may fall one line past the
    /// region). A prefetch never faults, so the region may run past the end of the matrix.
    #[inline(always)]
    fn step(&self, i: usize) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch reads nothing architecturally; wrapping_add computes no out-of-bounds reference.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(self.start.wrapping_add(2 * i * LINE_FLOATS).cast());
            _mm_prefetch::<_MM_HINT_T1>(self.start.wrapping_add((2 * i + 1) * LINE_FLOATS).cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }
}

// ---------------------------------------------------------------- packed f32 matmul

/// Output rows per panel of a packed weight matrix (one zmm, two ymm registers).
pub const PANEL: usize = 16;
/// Panels per group: the packed layout interleaves a group's panels k step by k step, so one
/// step of a group is 64 adjacent floats (four cache lines) and a group streams as one run.
const GROUP_PANELS: usize = 4;
/// Output rows per group (the row stride of the packed layout, in floats per k step).
pub const GROUP: usize = PANEL * GROUP_PANELS;
/// How far ahead a streaming tile prefetches the weights into L2, in k steps: 128 steps of a
/// group are 32 KB, one k block, so the first token tile over a block fetches the next block
/// (measured: 16–64 steps ahead, or into L1, did no better on the decode shapes).
const PREFETCH_STEPS: usize = 128;
/// Groups a decode matmul (one token) streams at once on AVX-512 (`x86::gemv_avx512`).
const GEMV_GROUPS: usize = 4;
/// f32s per 64-byte cache line.
const LINE_FLOATS: usize = 16;
/// Tokens per register tile (the most rows one `panel_product` call takes).
pub const TILE: usize = 6;
/// Weight floats of one sliver × one k block when several token tiles share them (32 KB): they
/// stay in L1 (48 KB on this machine's cores) while every token tile runs over them, the packed x
/// streaming past from L2 (TILE floats a k step against a sliver's 16–64). So prefill reads each
/// weight from memory once per matmul and from L1 once per token tile. A block's partial sums are
/// parked in y and resumed from there, which leaves each output's fma chain unchanged (f32 stores
/// are exact).
const BLOCK_FLOATS: usize = 1 << 13;

/// A weight matrix W (`out` × `inp`, the nn.Linear layout) packed once at load into groups of
/// GROUP rows, k-major inside a group: element (r, i) lives at `(r / GROUP)·inp·GROUP + i·GROUP +
/// r % GROUP`, the last group padded with zero rows. A panel (PANEL rows, one SIMD register) of a
/// group is 16 adjacent floats per k step. Every matmul, prefill or decode, streams the same groups.
pub struct PackedF32 {
    /// The packed groups start at `buf[off]`, the first 64-byte boundary of `buf`: a k step of a
    /// panel is then exactly one cache line, so no SIMD load splits across two.
    buf: Vec<f32>,
    off: usize,
    pub out: usize,
    pub inp: usize,
}

impl PackedF32 {
    /// Pack row-major `w` (out × inp). Panics only on a length mismatch (checked by the loader).
    pub fn pack(w: &[f32], out: usize, inp: usize) -> Self {
        assert_eq!(w.len(), out * inp, "pack: shape mismatch");
        let groups = out.div_ceil(GROUP);
        let len = groups * inp * GROUP;
        let mut buf = vec![0f32; len + LINE_FLOATS];
        let off = buf.as_ptr().align_offset(LINE_FLOATS * 4).min(LINE_FLOATS);
        let data = &mut buf[off..off + len];
        for (r, src) in w.chunks_exact(inp.max(1)).enumerate().take(out) {
            let base = (r / GROUP) * inp * GROUP + r % GROUP;
            for (i, &v) in src.iter().enumerate() {
                data[base + i * GROUP] = v;
            }
        }
        PackedF32 { buf, off, out, inp }
    }

    /// The packed groups (see the type's layout).
    fn data(&self) -> &[f32] {
        &self.buf[self.off..self.off + self.out.div_ceil(GROUP) * self.inp * GROUP]
    }

    /// Copy row `r` (length inp) into `dst`: the embedding lookup of a tied lm_head.
    pub fn row(&self, r: usize, dst: &mut [f32]) {
        let base = (r / GROUP) * self.inp * GROUP + r % GROUP;
        let data = self.data();
        for (i, d) in dst[..self.inp].iter_mut().enumerate() {
            *d = data[base + i * GROUP];
        }
    }

    /// y (m × out, row-major) = x (m × inp, row-major) · Wᵀ.
    ///
    /// **Batch invariance by construction**: output element (t, r) is always the same chain
    /// `acc = fma(W[r, i], x[t, i], acc)` for i = 0, 1, …, inp−1 from acc = 0, in one SIMD lane,
    /// whatever m, whichever other tokens share the register tile and however the panels are
    /// split over threads. A token's logits are therefore bit-identical alone or in a batch, and
    /// whether its prompt is prefilled whole or in chunks.
    ///
    /// Blocking (none of it changes a chain; BLIS's loop order with the weights as the operand
    /// kept in L1): x is packed into tiles of TILE tokens (k-major, so a k step's broadcasts are
    /// adjacent); the output columns are split over threads in slivers (a group of 4 panels on
    /// AVX-512, one panel otherwise); each thread takes a sliver, cuts k into blocks of
    /// BLOCK_FLOATS weights, and runs every token tile over a block while it sits in L1, partial
    /// sums parked in y between k blocks. With one token tile there is no reuse to block for and
    /// k runs whole.
    pub fn matmul(&self, par: &Par, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_at(simd_level(), par, x, m, y)
    }

    /// `matmul` with the kernels of `level`, which the CPU must support (the tests run each one).
    fn matmul_at(&self, level: SimdLevel, par: &Par, x: &[f32], m: usize, y: &mut [f32]) {
        let (out, k) = (self.out, self.inp);
        assert!(x.len() >= m * k && y.len() >= m * out, "matmul: shape mismatch");
        if m == 0 || out == 0 {
            return;
        }
        let split = par.threads > 1 && out.div_ceil(PANEL) * k * m >= 1 << 15;
        let kc = block_steps(level, m, k);
        if m == 1 {
            return self.tiles(level, par, &x[..k], 1, kc, y, split); // one token: the packed tile is x itself
        }
        thread_local! {
            /// This thread's packed-x scratch, kept between matmuls: a fresh one page-faults
            /// megabytes in every prefill matmul.
            static X_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        with_scratch(&X_SCRATCH, |buf| {
            // below PACK_PAR_FLOATS the copy is cheaper than handing it to the pool
            pack_tokens(par, &x[..m * k], m, k, kc, split && m * k > PACK_PAR_FLOATS, buf);
            self.tiles(level, par, buf, m, kc, y, split);
        })
    }

    /// The blocked loops of `matmul_at` over packed x (`xt`, see `pack_tokens`, k blocks of `kc`
    /// steps from `block_steps`).
    #[allow(clippy::too_many_arguments)]
    fn tiles(&self, level: SimdLevel, par: &Par, xt: &[f32], m: usize, kc: usize, y: &mut [f32], split: bool) {
        let (out, k) = (self.out, self.inp);
        let sp = sliver_panels(level);
        let panels = out.div_ceil(PANEL);
        let slivers = panels.div_ceil(sp);
        let tiles = m.div_ceil(TILE);
        let k_blocks = k.div_ceil(kc).max(1); // inp = 0: one empty block writes the zeros
        let data = self.data();
        let width = sp * PANEL;
        // the lines of a block, shared out over the token tiles that run over the block before it
        // (AVX-512, where a sliver is a whole group; AVX2 tiles prefetch ahead of themselves)
        let next_lines = if sp == GROUP_PANELS { kc * GROUP / LINE_FLOATS } else { 0 };
        let share = next_lines.div_ceil(tiles);
        let yp = SyncPtr(y.as_mut_ptr());
        thread_local! {
            /// This thread's sliver of y (m rows × one sliver's columns, contiguous) while its k
            /// blocks run: partial sums are parked and resumed in a few L2-resident pages instead
            /// of m rows `out` floats apart, then copied to y once.
            static Y_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        let body = |range: Range<usize>| {
            let yp = yp;
            let mut s = range.start;
            while s < range.end {
                #[cfg(target_arch = "x86_64")]
                if m == 1 && level == SimdLevel::Avx512 {
                    // decode on AVX-512: up to GEMV_GROUPS whole groups at once (slivers are groups)
                    let g = (range.end - s).min(GEMV_GROUPS).min(out / GROUP - s.min(out / GROUP));
                    if g > 1 {
                        let (w, gs) = (data[s * k * GROUP..].as_ptr(), k * GROUP);
                        // SAFETY: avx512f detected; groups s..s+g are whole (g·64 rows ≤ out − 64·s)
                        // and lie in `data`; slivers s..s+g own columns [64·s, 64·(s + g)) of y's one row.
                        unsafe {
                            let y = yp.0.add(s * GROUP);
                            match g {
                                2 => x86::gemv_avx512::<2>(w, gs, xt.as_ptr(), k, y),
                                3 => x86::gemv_avx512::<3>(w, gs, xt.as_ptr(), k, y),
                                _ => x86::gemv_avx512::<4>(w, gs, xt.as_ptr(), k, y),
                            }
                        }
                        s += g;
                        continue;
                    }
                }
                let p0 = s * sp;
                let np = sp.min(panels - p0);
                let (r0, rows) = (p0 * PANEL, (np * PANEL).min(out - p0 * PANEL));
                let base = (p0 / GROUP_PANELS) * k * GROUP + (p0 % GROUP_PANELS) * PANEL;
                if tiles == 1 {
                    // one token tile, k whole (kc = k): straight into y, prefetching the weights
                    let xs = &xt[..m * k];
                    // SAFETY: sliver s owns columns [r0, r0 + rows) of every output row.
                    unsafe {
                        tile(
                            level,
                            &data[base..],
                            GROUP,
                            np,
                            xs,
                            m,
                            k,
                            yp.0.add(r0),
                            out,
                            rows,
                            false,
                            true,
                            Region::NONE,
                        )
                    };
                    s += 1;
                    continue;
                }
                with_scratch(&Y_SCRATCH, |acc| {
                    acc.resize(m * width, 0.0);
                    for kb in 0..k_blocks {
                        let (i0, i1) = (kb * kc, ((kb + 1) * kc).min(k));
                        let w = &data[base + i0 * GROUP..];
                        // the next block follows this one in memory (the next k block of this
                        // group, or the next group's first)
                        let next = data.as_ptr().wrapping_add(base + i1 * GROUP);
                        for j in 0..tiles {
                            let t0 = j * TILE;
                            let n = TILE.min(m - t0);
                            let at = i0 * m + t0 * (i1 - i0);
                            let xs = &xt[at..at + n * (i1 - i0)];
                            // SAFETY: rows t0..t0+n of the scratch, np·PANEL ≤ width columns.
                            let dst = unsafe { acc.as_mut_ptr().add(t0 * width) };
                            let pf = Region {
                                start: next.wrapping_add(j * share * LINE_FLOATS),
                                lines: share.min(next_lines.saturating_sub(j * share)),
                            };
                            // without a region (AVX2), the first token tile prefetches ahead of itself
                            let ahead = j == 0 && next_lines == 0;
                            unsafe {
                                tile(level, w, GROUP, np, xs, n, i1 - i0, dst, width, np * PANEL, kb > 0, ahead, pf)
                            };
                        }
                    }
                    for t in 0..m {
                        // SAFETY: sliver s owns columns [r0, r0 + rows) of every output row.
                        let dst = unsafe { std::slice::from_raw_parts_mut(yp.0.add(t * out + r0), rows) };
                        dst.copy_from_slice(&acc[t * width..t * width + rows]);
                    }
                });
                s += 1;
            }
        };
        if split {
            par.run(slivers, body);
        } else {
            body(0..slivers);
        }
    }
}

/// A matrix W of `rows` rows laid out in panels: row r, step i at `w[(r / GROUP)·gs + r % GROUP +
/// i·ss]` (`PackedF32` is gs = inp·GROUP, ss = GROUP; the KV cache has its own strides, see
/// `cache.rs`).
#[derive(Clone, Copy)]
pub struct Panels<'a> {
    pub w: &'a [f32],
    pub gs: usize,
    pub ss: usize,
    pub rows: usize,
}

/// y = x · Wᵀ for n ≤ TILE rows of x and the first `kc` steps of W (`a`). `x`: packed, n floats
/// a step (x[i·n + t] is row t's value at step i). Row t of the result goes to
/// `y[t·ys..][..a.rows]`; with `resume` each output continues from the value found there, else
/// from 0.
///
/// Every output is the chain acc = fma(W[r, i], x[t, i], acc) over i in order, in one SIMD lane,
/// whatever n, the SIMD level or the other rows: the chain of `PackedF32::matmul`. Attention uses
/// it for q·kᵀ and p·V, so one query (decode) and a block of queries (prefill) get the same bits.
///
/// Panics when n is 0 or above TILE, or a slice is too short for its strides.
pub fn panel_product(a: &Panels<'_>, x: &[f32], n: usize, kc: usize, y: &mut [f32], ys: usize, resume: bool) {
    panel_product_at(simd_level(), a, x, n, kc, y, ys, resume)
}

/// `panel_product` with the kernels of `level`, which the CPU must support (the tests run each one).
#[allow(clippy::too_many_arguments)]
fn panel_product_at(
    level: SimdLevel,
    a: &Panels<'_>,
    x: &[f32],
    n: usize,
    kc: usize,
    y: &mut [f32],
    ys: usize,
    resume: bool,
) {
    let Panels { w, gs, ss, rows } = *a;
    assert!((1..=TILE).contains(&n) && x.len() >= kc * n, "panel_product: {n} rows, {} of x for {kc} steps", x.len());
    if rows == 0 {
        return;
    }
    assert!(y.len() >= (n - 1) * ys + rows, "panel_product: y holds {} floats", y.len());
    let sp = sliver_panels(level);
    let panels = rows.div_ceil(PANEL);
    let mut p0 = 0;
    while p0 < panels {
        // a call stays inside one group: its panels are adjacent there
        let np = sp.min(GROUP_PANELS - p0 % GROUP_PANELS).min(panels - p0);
        let r0 = p0 * PANEL;
        let off = (p0 / GROUP_PANELS) * gs + (p0 % GROUP_PANELS) * PANEL;
        // SAFETY: tile writes rows t < n, columns r0..r0 + r of y, inside y by the assert above;
        // it checks w's length against kc, ss and np itself.
        unsafe {
            tile(
                level,
                &w[off..],
                ss,
                np,
                x,
                n,
                kc,
                y.as_mut_ptr().add(r0),
                ys,
                (np * PANEL).min(rows - r0),
                resume,
                false,
                Region::NONE,
            )
        };
        p0 += np;
    }
}

/// Panels a thread's sliver (and a register tile) spans at `level`: a whole group on AVX-512,
/// one panel otherwise (the AVX2 and portable tiles hold one panel).
fn sliver_panels(level: SimdLevel) -> usize {
    if level == SimdLevel::Avx512 {
        GROUP_PANELS
    } else {
        1
    }
}

/// k steps per block of `PackedF32::tiles`: all of k with one token tile (nothing to reuse),
/// else BLOCK_FLOATS weights of one sliver.
fn block_steps(level: SimdLevel, m: usize, k: usize) -> usize {
    if m <= TILE {
        k.max(1)
    } else {
        BLOCK_FLOATS / (sliver_panels(level) * PANEL)
    }
}

/// x (m × k, row-major) repacked by k blocks of `kc` steps, and inside a block by tiles of TILE
/// tokens, k-major: block [i0, i1) occupies `packed[i0·m, i1·m)`, its tile of tokens t0..t0+n
/// (n ≤ TILE) starts at `i0·m + t0·(i1 − i0)` and holds (i, t) at `(i − i0)·n + t`. So one k
/// step's n values are adjacent, and the token tiles that run over one weight block read one
/// contiguous run (a single stream for the prefetcher). `packed` is resized to m·k and every
/// element overwritten.
fn pack_tokens(par: &Par, x: &[f32], m: usize, k: usize, kc: usize, split: bool, packed: &mut Vec<f32>) {
    packed.resize(m * k, 0.0);
    let pp = SyncPtr(packed.as_mut_ptr());
    let body = |range: Range<usize>| {
        let pp = pp;
        for j in range {
            let t0 = j * TILE;
            let n = TILE.min(m - t0);
            for i0 in (0..k).step_by(kc.max(1)) {
                let w = kc.min(k - i0);
                // SAFETY: tile j owns packed[i0·m + t0·w, i0·m + (t0 + n)·w) of every block.
                let dst = unsafe { std::slice::from_raw_parts_mut(pp.0.add(i0 * m + t0 * w), n * w) };
                for t in 0..n {
                    for (i, &v) in x[(t0 + t) * k + i0..(t0 + t) * k + i0 + w].iter().enumerate() {
                        dst[i * n + t] = v;
                    }
                }
            }
        }
    };
    if split {
        par.run(m.div_ceil(TILE), body);
    } else {
        body(0..m.div_ceil(TILE));
    }
}

/// One register tile: n ≤ TILE tokens (`x`, packed, n floats a k step, kc steps) × np panels of
/// one group (`w`: the first panel at this block's first k step; panel p at `w[16·p..]`, k step i
/// at `w[ss·i..]`: ss = GROUP for packed weights), into `rows` ≤ np·PANEL output columns at `y` (token t's at `y + t·ys`),
/// resumed from the sums there if `resume`, prefetching the weights ahead if `stream` (they come
/// from memory, not L1). A sliver whose last panel is partial goes through a full-width scratch
/// tile, so that a kernel never writes past `rows`.
///
/// Safety: `y + t·ys + c` must be writable for t < n, c < rows, and owned by this call.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    level: SimdLevel,
    w: &[f32],
    ss: usize,
    np: usize,
    x: &[f32],
    n: usize,
    kc: usize,
    y: *mut f32,
    ys: usize,
    rows: usize,
    resume: bool,
    stream: bool,
    pf: Region,
) {
    assert!((1..=TILE).contains(&n) && (1..=GROUP_PANELS).contains(&np) && x.len() >= kc * n && rows <= np * PANEL);
    assert!(kc == 0 || w.len() >= (kc - 1) * ss + np * PANEL);
    let width = np * PANEL;
    if rows < width {
        let mut scratch = [[0f32; GROUP]; TILE];
        if resume {
            for (t, row) in scratch[..n].iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(y.add(t * ys), row.as_mut_ptr(), rows);
            }
        }
        tile(level, w, ss, np, x, n, kc, scratch.as_mut_ptr().cast(), GROUP, width, resume, stream, pf);
        for (t, row) in scratch[..n].iter().enumerate() {
            std::ptr::copy_nonoverlapping(row.as_ptr(), y.add(t * ys), rows);
        }
        return;
    }
    let (w, x) = (w.as_ptr(), x.as_ptr());
    macro_rules! by_tokens {
        ($f:ident $(, $p:literal)?) => {
            match n {
                1 => $f::<$($p,)? 1>(w, ss, x, kc, y, ys, resume, stream, pf),
                2 => $f::<$($p,)? 2>(w, ss, x, kc, y, ys, resume, stream, pf),
                3 => $f::<$($p,)? 3>(w, ss, x, kc, y, ys, resume, stream, pf),
                4 => $f::<$($p,)? 4>(w, ss, x, kc, y, ys, resume, stream, pf),
                5 => $f::<$($p,)? 5>(w, ss, x, kc, y, ys, resume, stream, pf),
                _ => $f::<$($p,)? 6>(w, ss, x, kc, y, ys, resume, stream, pf),
            }
        };
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx512f was detected at run time; lengths checked above.
        SimdLevel::Avx512 => match np {
            1 => by_tokens!(tile512, 1),
            2 => by_tokens!(tile512, 2),
            3 => by_tokens!(tile512, 3),
            _ => by_tokens!(tile512, 4),
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: avx2 + fma were detected at run time; lengths checked above (np = 1).
        SimdLevel::Avx2Fma => by_tokens!(tile256),
        _ => by_tokens!(tile_generic),
    }
}

#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
unsafe fn tile512<const P: usize, const T: usize>(w: *const f32, ss: usize, x: *const f32, kc: usize, y: *mut f32, ys: usize, resume: bool, stream: bool, pf: Region) {
    if stream {
        x86::tile_avx512::<P, T, true>(w, ss, x, kc, y, ys, resume, pf)
    } else {
        x86::tile_avx512::<P, T, false>(w, ss, x, kc, y, ys, resume, pf)
    }
}

#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
unsafe fn tile256<const T: usize>(w: *const f32, ss: usize, x: *const f32, kc: usize, y: *mut f32, ys: usize, resume: bool, stream: bool, pf: Region) {
    if stream {
        x86::tile_avx2::<T, true>(w, ss, x, kc, y, ys, resume, pf)
    } else {
        x86::tile_avx2::<T, false>(w, ss, x, kc, y, ys, resume, pf)
    }
}

/// The same per-lane fma chain as the SIMD kernels, in portable code (one panel).
#[rustfmt::skip]
unsafe fn tile_generic<const T: usize>(w: *const f32, ss: usize, x: *const f32, kc: usize, y: *mut f32, ys: usize, resume: bool, _stream: bool, _pf: Region) {
    let mut acc = [[0f32; PANEL]; T];
    if resume {
        for (t, a) in acc.iter_mut().enumerate() {
            std::ptr::copy_nonoverlapping(y.add(t * ys), a.as_mut_ptr(), PANEL);
        }
    }
    let x = std::slice::from_raw_parts(x, kc * T);
    for i in 0..kc {
        let wv = std::slice::from_raw_parts(w.add(i * ss), PANEL);
        for (t, a) in acc.iter_mut().enumerate() {
            let xv = x[i * T + t];
            for l in 0..PANEL {
                a[l] = wv[l].mul_add(xv, a[l]);
            }
        }
    }
    for (t, a) in acc.iter().enumerate() {
        std::ptr::copy_nonoverlapping(a.as_ptr(), y.add(t * ys), PANEL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(w: &[f32], x: &[f32], rows: usize, k: usize) -> Vec<f32> {
        (0..rows).map(|r| (0..k).map(|i| w[r * k + i] as f64 * x[i] as f64).sum::<f64>() as f32).collect()
    }

    #[test]
    fn packed_matmul_matches_naive_and_is_batch_invariant() {
        for &(rows, k) in &[(1, 1), (3, 7), (5, 16), (17, 33), (64, 64), (130, 250), (17, 1280)] {
            let w: Vec<f32> = (0..rows * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
            let m = 13; // two full tiles of 6 and a tail of 1
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 104729 % 1000) as f32 / 500.0) - 1.0).collect();
            let p = PackedF32::pack(&w, rows, k);
            let mut row = vec![0f32; k];
            p.row(rows - 1, &mut row);
            assert_eq!(row, w[(rows - 1) * k..]);
            let serial = Par::new(1).unwrap();
            let mut all = vec![0f32; m * rows];
            p.matmul(&serial, &x, m, &mut all);
            for t in 0..m {
                let want = naive(&w, &x[t * k..(t + 1) * k], rows, k);
                for (a, b) in all[t * rows..(t + 1) * rows].iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{rows}x{k}: {a} vs {b}");
                }
                // the same token alone, or at another place in a smaller batch: the same bits
                let mut one = vec![0f32; rows];
                p.matmul(&serial, &x[t * k..(t + 1) * k], 1, &mut one);
                assert_eq!(one, all[t * rows..(t + 1) * rows], "{rows}x{k} token {t} alone");
            }
            let mut tail = vec![0f32; 4 * rows];
            p.matmul(&serial, &x[5 * k..9 * k], 4, &mut tail);
            assert_eq!(tail, all[5 * rows..9 * rows]);
            let par = Par::new(2).unwrap();
            let mut threaded = vec![0f32; m * rows];
            par.install(|| p.matmul(&par, &x, m, &mut threaded));
            assert_eq!(threaded, all, "{rows}x{k}: threads change the result");
        }
    }

    /// The SIMD levels this CPU can run.
    fn levels() -> Vec<SimdLevel> {
        let mut v = vec![SimdLevel::Generic];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                v.push(SimdLevel::Avx2Fma);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(SimdLevel::Avx512);
            }
        }
        v
    }

    #[test]
    fn every_tile_shape_is_batch_invariant_at_every_simd_level() {
        // out: partial last panel, partial last 4-panel sliver, exact; inp: odd, across k blocks
        // (KC = 256: 1000 = 3 full blocks + 232), below one block, and exactly two
        for &(rows, k) in &[(200, 1000), (77, 257), (64, 512), (16, 3), (1, 300)] {
            let w: Vec<f32> = (0..rows * k).map(|i| ((i * 7919 % 2003) as f32 / 1001.0) - 1.0).collect();
            let mmax = 40;
            let x: Vec<f32> = (0..mmax * k).map(|i| ((i * 104729 % 1999) as f32 / 999.0) - 1.0).collect();
            let p = PackedF32::pack(&w, rows, k);
            let serial = Par::new(1).unwrap();
            let par = Par::new(2).unwrap();
            let mut first_level: Option<Vec<f32>> = None;
            for level in levels() {
                // every token alone (m = 1): the reference bits of this level
                let mut alone = vec![0f32; mmax * rows];
                for t in 0..mmax {
                    p.matmul_at(level, &serial, &x[t * k..(t + 1) * k], 1, &mut alone[t * rows..(t + 1) * rows]);
                    let xt = &x[t * k..(t + 1) * k];
                    let want = naive(&w, xt, rows, k);
                    for (r, (a, b)) in alone[t * rows..(t + 1) * rows].iter().zip(&want).enumerate() {
                        // f32 rounding of a k-term chain, far below the bound k·2⁻²⁴·Σ|w·x|
                        let mag: f32 = (0..k).map(|i| (w[r * k + i] * xt[i]).abs()).sum();
                        assert!((a - b).abs() <= 1e-6 * mag + 1e-7, "{level:?} {rows}x{k}: {a} vs {b}");
                    }
                }
                for m in 1..=mmax {
                    // a batch of m tokens starting at token (m·7) % (mmax − m + 1), so that each
                    // token meets other neighbours and tile positions
                    let s = (m * 7) % (mmax - m + 1);
                    let want = &alone[s * rows..(s + m) * rows];
                    let mut got = vec![f32::NAN; m * rows];
                    p.matmul_at(level, &serial, &x[s * k..(s + m) * k], m, &mut got);
                    assert!(got == want, "{level:?} {rows}x{k}: m = {m} differs from the tokens alone");
                    let mut threaded = vec![f32::NAN; m * rows];
                    par.install(|| p.matmul_at(level, &par, &x[s * k..(s + m) * k], m, &mut threaded));
                    assert!(threaded == want, "{level:?} {rows}x{k}: m = {m} on 2 threads differs");
                }
                // every level runs the same chains: the same bits
                match &first_level {
                    None => first_level = Some(alone),
                    Some(f) => assert!(*f == alone, "{level:?} {rows}x{k}: other bits than {:?}", levels()[0]),
                }
            }
        }
    }

    #[test]
    fn panel_product_matches_naive_and_resumes_exactly_at_every_simd_level() {
        // rows across groups with a partial last panel; strides of the K and V caches and of packed weights
        for &(rows, kc, gs, ss) in
            &[(150usize, 37usize, 37 * 64, 64usize), (80, 70, 64, 80), (6, 9, 64, 16), (64, 5, 320, 64)]
        {
            let groups = rows.div_ceil(GROUP);
            let len = (groups - 1) * gs + (kc - 1) * ss + GROUP;
            let w: Vec<f32> = (0..len).map(|i| ((i * 7919 % 2003) as f32 / 1001.0) - 1.0).collect();
            let at = |r: usize, i: usize| w[(r / GROUP) * gs + r % GROUP + i * ss];
            for level in levels() {
                for n in 1..=TILE {
                    let x: Vec<f32> = (0..kc * n).map(|i| ((i * 104729 % 1999) as f32 / 999.0) - 1.0).collect();
                    let ys = rows + 3;
                    let mut y = vec![f32::NAN; (n - 1) * ys + rows];
                    panel_product_at(level, &Panels { w: &w, gs, ss, rows }, &x, n, kc, &mut y, ys, false);
                    for t in 0..n {
                        for r in 0..rows {
                            let want: f64 = (0..kc).map(|i| at(r, i) as f64 * x[i * n + t] as f64).sum();
                            let got = y[t * ys + r];
                            assert!((got as f64 - want).abs() < 1e-4, "{level:?} {rows}x{kc} n {n}: {got} vs {want}");
                        }
                    }
                    // the first 3 steps, then the rest resumed from y: the same bits as all at once
                    let split = 3.min(kc);
                    let head: Vec<f32> =
                        (0..split).flat_map(|i| (0..n).map(move |t| (i, t))).map(|(i, t)| x[i * n + t]).collect();
                    let mut y2 = vec![f32::NAN; y.len()];
                    panel_product_at(level, &Panels { w: &w, gs, ss, rows }, &head, n, split, &mut y2, ys, false);
                    let rest = Panels { w: &w[split * ss..], gs, ss, rows };
                    panel_product_at(level, &rest, &x[split * n..], n, kc - split, &mut y2, ys, true);
                    for t in 0..n {
                        assert_eq!(y[t * ys..t * ys + rows], y2[t * ys..t * ys + rows], "{level:?} resumed");
                    }
                    // row t alone (n = 1) gives the same bits as inside the tile
                    for t in 0..n {
                        let xt: Vec<f32> = (0..kc).map(|i| x[i * n + t]).collect();
                        let mut one = vec![f32::NAN; rows];
                        panel_product_at(level, &Panels { w: &w, gs, ss, rows }, &xt, 1, kc, &mut one, rows, false);
                        assert_eq!(one[..], y[t * ys..t * ys + rows], "{level:?} {rows}x{kc}: row {t} alone");
                    }
                }
            }
        }
    }
}
