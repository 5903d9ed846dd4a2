//! Small f32 kernels: the packed, batch-invariant matmul (`PackedF32`: AVX2+FMA picked at run
//! time, so a portable build is as fast as a `target-cpu=native` one), dot products, RMSNorm,
//! SiLU, RoPE, softmax, and `Par`, the per-model rayon pool that splits work by ranges.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimdLevel {
    Avx512,
    Avx2Fma,
    Generic,
}

pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var("SHALIK_RUST_SIMD").as_deref() == Ok("generic") {
                return SimdLevel::Generic;
            }
            if std::env::var("SHALIK_RUST_SIMD").as_deref() != Ok("avx2")
                && std::arch::is_x86_feature_detected!("avx512f")
            {
                return SimdLevel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return SimdLevel::Avx2Fma;
            }
        }
        SimdLevel::Generic
    })
}

// ---------------------------------------------------------------- dot products / GEMV

/// Portable dot product with 16 independent partial sums (vectorizes at any target level).
#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..16 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    // pairwise reduction of the partial sums
    let mut w = 8;
    while w > 0 {
        for j in 0..w {
            acc[j] += acc[j + w];
        }
        w /= 2;
    }
    acc[0] + s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        let mut i = 0;
        while i + 32 <= n {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16)), _mm512_loadu_ps(pb.add(i + 16)), acc1);
            i += 32;
        }
        if i + 16 <= n {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
            i += 16;
        }
        if i < n {
            let mask: __mmask16 = ((1u32 << (n - i)) - 1) as __mmask16;
            acc1 =
                _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, pa.add(i)), _mm512_maskz_loadu_ps(mask, pb.add(i)), acc1);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
            i += 16;
        }
        let mut s = hsum256(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }

    /// One register tile of the packed matmul on AVX2: T tokens × one 16-row panel in 2·T ymm
    /// accumulators (+ 2 weight registers + 1 broadcast ≤ 16), over `kc` k steps. `w`: the panel
    /// at the block's first k step (16 floats a step); `x`: the packed token tile at that step (T
    /// floats a step); `y`: the tile's outputs, row t at `y + t·ys`, 16 floats. `resume`: start
    /// from the partial sums in `y` (else from 0). Each output lane is the chain
    /// acc = fma(w, x, acc) over the k steps in order.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)]
    pub unsafe fn tile_avx2<const T: usize>(
        w: *const f32,
        x: *const f32,
        kc: usize,
        y: *mut f32,
        ys: usize,
        resume: bool,
    ) {
        let mut a0 = [_mm256_setzero_ps(); T];
        let mut a1 = [_mm256_setzero_ps(); T];
        if resume {
            for t in 0..T {
                a0[t] = _mm256_loadu_ps(y.add(t * ys));
                a1[t] = _mm256_loadu_ps(y.add(t * ys + 8));
            }
        }
        for i in 0..kc {
            let w0 = _mm256_loadu_ps(w.add(i * 16));
            let w1 = _mm256_loadu_ps(w.add(i * 16 + 8));
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

    /// One register tile on AVX-512: T tokens × P panels (16·P rows, one zmm each) in P·T zmm
    /// accumulators (4 × 6 = 24, + 4 weight registers + 1 broadcast ≤ 32): per k step P weight
    /// loads and T broadcasts feed P·T FMAs. Panel p starts at `w + p·ws`; otherwise as
    /// `tile_avx2` (the same chain per output lane, so the same bits as any other tile shape).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)] // register tiles: a[t][p] reads clearer than zipped iterators
    pub unsafe fn tile_avx512<const P: usize, const T: usize>(
        w: *const f32,
        ws: usize,
        x: *const f32,
        kc: usize,
        y: *mut f32,
        ys: usize,
        resume: bool,
    ) {
        let mut a = [[_mm512_setzero_ps(); P]; T];
        if resume {
            for t in 0..T {
                for p in 0..P {
                    a[t][p] = _mm512_loadu_ps(y.add(t * ys + p * 16));
                }
            }
        }
        for i in 0..kc {
            let mut wv = [_mm512_setzero_ps(); P];
            for p in 0..P {
                wv[p] = _mm512_loadu_ps(w.add(p * ws + i * 16));
            }
            for t in 0..T {
                let xb = _mm512_set1_ps(*x.add(i * T + t));
                for p in 0..P {
                    a[t][p] = _mm512_fmadd_ps(wv[p], xb, a[t][p]);
                }
            }
        }
        for t in 0..T {
            for p in 0..P {
                _mm512_storeu_ps(y.add(t * ys + p * 16), a[t][p]);
            }
        }
    }

    /// Lane sums of 16 vectors: lane j of the result = Σ lanes of v[j] (a transpose-and-add tree,
    /// 3 operations a vector instead of a full horizontal reduction each).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn sum_lanes16(v: &[__m512; 16]) -> __m512 {
        // pairs: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3]
        let mut w = [_mm512_setzero_ps(); 8];
        for j in 0..8 {
            let (a, b) = (v[2 * j], v[2 * j + 1]);
            w[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // quads: per 128-bit lane the partial sums of 4 vectors, in order
        let mut x = [_mm512_setzero_ps(); 4];
        for j in 0..4 {
            let (a, b) = (w[2 * j], w[2 * j + 1]);
            x[j] = _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b));
        }
        // add the 128-bit lanes: lane group g of the result holds vectors 4g..4g+3
        let y0 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x[0], x[1]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x[0], x[1]),
        );
        let y1 = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x[2], x[3]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x[2], x[3]),
        );
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(y0, y1), _mm512_shuffle_f32x4::<0b11_01_11_01>(y0, y1))
    }

    /// out[t] = scale · q·k_t for t < n, k_t = the hd floats at `k + t·stride`; hd % 16 == 0.
    /// 16 keys at a time, each one fma chain over hd in 16 lanes, lane-summed together.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_avx512(q: *const f32, hd: usize, k: *const f32, stride: usize, n: usize, scale: f32, out: *mut f32) {
        let sc = _mm512_set1_ps(scale);
        let mut t0 = 0;
        while t0 < n {
            let nb = (n - t0).min(16);
            let mut acc = [_mm512_setzero_ps(); 16];
            for (j, a) in acc[..nb].iter_mut().enumerate() {
                let kp = k.add((t0 + j) * stride);
                let mut s = _mm512_setzero_ps();
                for c in (0..hd).step_by(16) {
                    s = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(c)), _mm512_loadu_ps(kp.add(c)), s);
                }
                *a = s;
            }
            let mask = ((1u32 << nb) - 1) as __mmask16;
            _mm512_mask_storeu_ps(out.add(t0), mask, _mm512_mul_ps(sum_lanes16(&acc), sc));
            t0 += 16;
        }
    }

    /// out (hd floats) = Σ_t w[t] · v_t for t < n, v_t = the hd floats at `v + t·stride`;
    /// hd % 16 == 0. Accumulated in registers, even and odd t apart (two chains, then added).
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::needless_range_loop)]
    pub unsafe fn weighted_sum_avx512(w: *const f32, n: usize, v: *const f32, stride: usize, hd: usize, out: *mut f32) {
        let mut c = 0;
        while c < hd {
            let width = if hd - c >= 64 { 4 } else { 1 };
            let mut a = [_mm512_setzero_ps(); 8];
            let mut t = 0;
            while t + 2 <= n {
                let (w0, w1) = (_mm512_set1_ps(*w.add(t)), _mm512_set1_ps(*w.add(t + 1)));
                let (p0, p1) = (v.add(t * stride + c), v.add((t + 1) * stride + c));
                for j in 0..width {
                    a[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(p0.add(16 * j)), a[j]);
                    a[4 + j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(p1.add(16 * j)), a[4 + j]);
                }
                t += 2;
            }
            if t < n {
                let w0 = _mm512_set1_ps(*w.add(t));
                let p0 = v.add(t * stride + c);
                for j in 0..width {
                    a[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(p0.add(16 * j)), a[j]);
                }
            }
            for j in 0..width {
                _mm512_storeu_ps(out.add(c + 16 * j), _mm512_add_ps(a[j], a[4 + j]));
            }
            c += 16 * width;
        }
    }
}

/// a · b over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    match simd_level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU feature was detected at run time.
        SimdLevel::Avx512 => unsafe { x86::dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2Fma => unsafe { x86::dot_avx2(a, b) },
        _ => dot_generic(a, b),
    }
}

// ---------------------------------------------------------------- threads

/// How a model splits work. `threads == 1`: everything runs on the calling thread (so two
/// Python threads generating at once really run in parallel). `threads > 1`: the model owns a
/// rayon pool of that size; a whole forward runs inside it (`install`, one hand-off per call)
/// and row ranges are split with rayon's work stealing, so a worker that the OS has descheduled
/// (2 shared cores!) costs little: the thread that is running takes the remaining chunks.
/// (candle's own spin-barrier pool is kept at 1 thread by the Python module: a spinning barrier
/// waiting on a preempted worker made 2-thread decode 20× slower on a loaded 2-core VM.)
#[derive(Clone)]
pub struct Par {
    pub threads: usize,
    pool: Option<std::sync::Arc<rayon::ThreadPool>>,
}

impl std::fmt::Debug for Par {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Par {{ threads: {} }}", self.threads)
    }
}

impl Par {
    pub fn new(threads: usize) -> crate::error::Result<Self> {
        let threads = threads.max(1);
        let pool = if threads > 1 {
            let p = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("rust_runtime-{i}"))
                .build()
                .map_err(|e| crate::error::Error::format(format!("cannot start {threads} compute threads: {e}")))?;
            Some(std::sync::Arc::new(p))
        } else {
            None
        };
        Ok(Par { threads, pool })
    }

    /// Run `f` inside this model's pool (or inline with one thread).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// Run `f` over `0..n_units` split into ranges, possibly on several threads. Call only from
    /// inside `install`. `f` must only write to memory owned by its own units.
    pub fn run(&self, n_units: usize, f: impl Fn(Range<usize>) + Sync + Send) {
        if n_units == 0 {
            return;
        }
        if self.pool.is_none() || n_units == 1 {
            f(0..n_units);
            return;
        }
        use rayon::prelude::*;
        let chunks = n_units.min(self.threads * 4);
        (0..chunks).into_par_iter().for_each(|c| f(c * n_units / chunks..(c + 1) * n_units / chunks));
    }

    /// Like `run` with one unit per item and a fallible body; the first error wins.
    pub fn try_each<E: Send>(&self, n: usize, f: impl Fn(usize) -> Result<(), E> + Sync + Send) -> Result<(), E> {
        if self.pool.is_none() || n <= 1 {
            return (0..n).try_for_each(f);
        }
        use rayon::prelude::*;
        (0..n).into_par_iter().try_for_each(f)
    }
}

/// A raw pointer that may be shared between threads that write disjoint ranges.
#[derive(Clone, Copy)]
pub struct SyncPtr(pub *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

// ---------------------------------------------------------------- packed f32 matmul

/// Output rows per panel of a packed weight matrix (one zmm, two ymm registers).
pub const PANEL: usize = 16;
/// Tokens per register tile.
const TILE: usize = 6;
/// Panels per register tile on AVX-512 (4 zmm = 64 rows; see `x86::tile_avx512`).
const PANELS_512: usize = 4;
/// k steps per block when several token tiles share the weights: the tile's x (KC × TILE, 6 KB)
/// stays in L1 while the weights of a row block pass under it; a block's partial sums are stored
/// in y and resumed from there, which leaves each output's fma chain unchanged (f32 stores are exact).
const KC: usize = 256;
/// Weight floats of a row block × one k block (1 MB): they stay in L2 while every token tile
/// runs over them, so prefill streams each weight from memory once.
const BLOCK_FLOATS: usize = 1 << 18;

/// A weight matrix W (`out` × `inp`, the nn.Linear layout) packed once at load into panels of
/// PANEL rows: element (r, i) lives at `(r / PANEL)·inp·PANEL + i·PANEL + r % PANEL`, the last
/// panel padded with zeros. Every matmul, prefill or decode, streams the same panels.
pub struct PackedF32 {
    data: Vec<f32>,
    pub out: usize,
    pub inp: usize,
}

impl PackedF32 {
    /// Pack row-major `w` (out × inp). Panics only on a length mismatch (checked by the loader).
    pub fn pack(w: &[f32], out: usize, inp: usize) -> Self {
        assert_eq!(w.len(), out * inp, "pack: shape mismatch");
        let panels = out.div_ceil(PANEL);
        let mut data = vec![0f32; panels * inp * PANEL];
        for r in 0..out {
            let (p, l) = (r / PANEL, r % PANEL);
            let base = p * inp * PANEL + l;
            for (i, &v) in w[r * inp..(r + 1) * inp].iter().enumerate() {
                data[base + i * PANEL] = v;
            }
        }
        PackedF32 { data, out, inp }
    }

    /// Copy row `r` (length inp) into `dst`: the embedding lookup of a tied lm_head.
    pub fn row(&self, r: usize, dst: &mut [f32]) {
        let (p, l) = (r / PANEL, r % PANEL);
        let base = p * self.inp * PANEL + l;
        for (i, d) in dst[..self.inp].iter_mut().enumerate() {
            *d = self.data[base + i * PANEL];
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
    /// Blocking (none of it changes a chain): x is packed into tiles of TILE tokens (k-major, so a
    /// k step's broadcasts are adjacent); the output columns are split over threads in slivers
    /// (PANELS_512 panels on AVX-512, one panel otherwise); each thread walks its slivers in row
    /// blocks of about BLOCK_FLOATS weights per KC k steps, and inside a block every token tile
    /// meets every sliver, partial sums parked in y between k blocks. With one token tile there
    /// is no reuse to block for and k runs whole.
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
        if m == 1 {
            return self.tiles(level, par, &x[..k], 1, y, split); // one token: the packed tile is x itself
        }
        thread_local! {
            /// This thread's packed-x scratch, kept between matmuls: a fresh one page-faults
            /// megabytes in every prefill matmul.
            static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|cell| {
            // busy only if a rayon job stolen while this matmul waits runs another one here
            let mut fresh = Vec::new();
            let mut kept = cell.try_borrow_mut();
            let buf = match kept.as_deref_mut() {
                Ok(b) => b,
                Err(_) => &mut fresh,
            };
            pack_tokens(par, &x[..m * k], m, k, split, buf);
            self.tiles(level, par, buf, m, y, split);
        })
    }

    /// The blocked loops of `matmul_at` over packed x (`xt`, see `pack_tokens`).
    fn tiles(&self, level: SimdLevel, par: &Par, xt: &[f32], m: usize, y: &mut [f32], split: bool) {
        let (out, k) = (self.out, self.inp);
        let sp = if level == SimdLevel::Avx512 { PANELS_512 } else { 1 };
        let panels = out.div_ceil(PANEL);
        let slivers = panels.div_ceil(sp);
        let tiles = m.div_ceil(TILE);
        let kc = if tiles == 1 { k.max(1) } else { KC };
        let k_blocks = k.div_ceil(kc).max(1); // inp = 0: one empty block writes the zeros
        let block_slivers = (BLOCK_FLOATS / (sp * PANEL * kc)).max(1);
        let yp = SyncPtr(y.as_mut_ptr());
        let body = |range: Range<usize>| {
            let yp = yp;
            let mut s0 = range.start;
            while s0 < range.end {
                let s1 = (s0 + block_slivers).min(range.end);
                for kb in 0..k_blocks {
                    let (i0, i1) = (kb * kc, ((kb + 1) * kc).min(k));
                    for j in 0..tiles {
                        let t0 = j * TILE;
                        let n = TILE.min(m - t0);
                        let xs = &xt[t0 * k + i0 * n..t0 * k + i1 * n];
                        for s in s0..s1 {
                            let p0 = s * sp;
                            let np = sp.min(panels - p0);
                            let (r0, rows) = (p0 * PANEL, (np * PANEL).min(out - p0 * PANEL));
                            let w = &self.data[p0 * k * PANEL + i0 * PANEL..];
                            // SAFETY: sliver s owns columns [r0, r0 + rows) of every output row,
                            // and this call touches rows t0..t0+n of them only.
                            let dst = unsafe { yp.0.add(t0 * out + r0) };
                            unsafe { tile(level, w, k * PANEL, np, xs, n, i1 - i0, dst, out, rows, kb > 0) };
                        }
                    }
                }
                s0 = s1;
            }
        };
        if split {
            par.run(slivers, body);
        } else {
            body(0..slivers);
        }
    }
}

/// x (m × k, row-major) repacked into tiles of TILE tokens: the tile of tokens t0..t0+n (n ≤
/// TILE) starts at t0·k and holds (i, t) at i·n + t, so one k step's n values are adjacent.
/// `packed` is resized to m·k and every element overwritten.
fn pack_tokens(par: &Par, x: &[f32], m: usize, k: usize, split: bool, packed: &mut Vec<f32>) {
    packed.resize(m * k, 0.0);
    let pp = SyncPtr(packed.as_mut_ptr());
    let body = |range: Range<usize>| {
        let pp = pp;
        for j in range {
            let t0 = j * TILE;
            let n = TILE.min(m - t0);
            // SAFETY: tile j owns packed[t0·k, (t0 + n)·k).
            let dst = unsafe { std::slice::from_raw_parts_mut(pp.0.add(t0 * k), n * k) };
            for t in 0..n {
                for (i, &v) in x[(t0 + t) * k..(t0 + t + 1) * k].iter().enumerate() {
                    dst[i * n + t] = v;
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

/// One register tile: n ≤ TILE tokens (`x`, packed, n floats a k step, kc steps) × np panels
/// (`w`: panel 0 at this block's first k step, panel p at `w[p·ws..]`), into `rows` ≤ np·PANEL
/// output columns at `y` (token t's at `y + t·ys`), resumed from the sums there if `resume`. A
/// sliver whose last panel is partial goes through a full-width scratch tile, so that a kernel
/// never writes past `rows`.
///
/// Safety: `y + t·ys + c` must be writable for t < n, c < rows, and owned by this call.
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    level: SimdLevel,
    w: &[f32],
    ws: usize,
    np: usize,
    x: &[f32],
    n: usize,
    kc: usize,
    y: *mut f32,
    ys: usize,
    rows: usize,
    resume: bool,
) {
    assert!((1..=TILE).contains(&n) && (1..=PANELS_512).contains(&np) && x.len() >= kc * n && rows <= np * PANEL);
    assert!(w.len() >= (np - 1) * ws + kc * PANEL);
    let width = np * PANEL;
    if rows < width {
        let mut scratch = [[0f32; PANELS_512 * PANEL]; TILE];
        if resume {
            for (t, row) in scratch[..n].iter_mut().enumerate() {
                std::ptr::copy_nonoverlapping(y.add(t * ys), row.as_mut_ptr(), rows);
            }
        }
        tile(level, w, ws, np, x, n, kc, scratch.as_mut_ptr().cast(), PANELS_512 * PANEL, width, resume);
        for (t, row) in scratch[..n].iter().enumerate() {
            std::ptr::copy_nonoverlapping(row.as_ptr(), y.add(t * ys), rows);
        }
        return;
    }
    let (w, x) = (w.as_ptr(), x.as_ptr());
    macro_rules! by_tokens {
        ($f:ident $(, $p:literal)?) => {
            match n {
                1 => $f::<$($p,)? 1>(w, ws, x, kc, y, ys, resume),
                2 => $f::<$($p,)? 2>(w, ws, x, kc, y, ys, resume),
                3 => $f::<$($p,)? 3>(w, ws, x, kc, y, ys, resume),
                4 => $f::<$($p,)? 4>(w, ws, x, kc, y, ys, resume),
                5 => $f::<$($p,)? 5>(w, ws, x, kc, y, ys, resume),
                _ => $f::<$($p,)? 6>(w, ws, x, kc, y, ys, resume),
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
unsafe fn tile512<const P: usize, const T: usize>(
    w: *const f32,
    ws: usize,
    x: *const f32,
    kc: usize,
    y: *mut f32,
    ys: usize,
    resume: bool,
) {
    x86::tile_avx512::<P, T>(w, ws, x, kc, y, ys, resume)
}

#[cfg(target_arch = "x86_64")]
unsafe fn tile256<const T: usize>(
    w: *const f32,
    _ws: usize,
    x: *const f32,
    kc: usize,
    y: *mut f32,
    ys: usize,
    resume: bool,
) {
    x86::tile_avx2::<T>(w, x, kc, y, ys, resume)
}

/// The same per-lane fma chain as the SIMD kernels, in portable code (one panel).
unsafe fn tile_generic<const T: usize>(
    w: *const f32,
    _ws: usize,
    x: *const f32,
    kc: usize,
    y: *mut f32,
    ys: usize,
    resume: bool,
) {
    let mut acc = [[0f32; PANEL]; T];
    if resume {
        for (t, a) in acc.iter_mut().enumerate() {
            std::ptr::copy_nonoverlapping(y.add(t * ys), a.as_mut_ptr(), PANEL);
        }
    }
    let (w, x) = (std::slice::from_raw_parts(w, kc * PANEL), std::slice::from_raw_parts(x, kc * T));
    for i in 0..kc {
        let wv = &w[i * PANEL..(i + 1) * PANEL];
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

/// One query head's causal attention over `n` cached positions: out (hd = q.len() floats) =
/// Σ_t softmax_t(scale · q·k_t) · v_t, with k_t = `k[t·stride..][..hd]` and v_t likewise in `v`
/// (token-major caches, the head's offset already applied). `scores` is scratch (left holding the
/// weights). Depends on this query and these n positions only, never on other rows of a batch.
pub fn attend(q: &[f32], k: &[f32], v: &[f32], stride: usize, n: usize, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
    let hd = q.len();
    assert!(n >= 1 && out.len() >= hd && k.len() >= (n - 1) * stride + hd && v.len() >= (n - 1) * stride + hd);
    scores.clear();
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 && hd % 16 == 0 {
        scores.resize(n, 0.0);
        // SAFETY: avx512f detected; every read lies in k/v by the assert above, scores has n floats.
        unsafe { x86::scores_avx512(q.as_ptr(), hd, k.as_ptr(), stride, n, scale, scores.as_mut_ptr()) };
        softmax_inplace(scores);
        unsafe { x86::weighted_sum_avx512(scores.as_ptr(), n, v.as_ptr(), stride, hd, out.as_mut_ptr()) };
        return;
    }
    scores.extend((0..n).map(|t| dot(q, &k[t * stride..t * stride + hd]) * scale));
    softmax_inplace(scores);
    let o = &mut out[..hd];
    o.fill(0.0);
    for (t, &w) in scores.iter().enumerate() {
        for (ov, &vv) in o.iter_mut().zip(&v[t * stride..t * stride + hd]) {
            *ov += w * vv;
        }
    }
}

/// HF LlamaRMSNorm in f32: x * rsqrt(mean(x²) + eps) * weight. The mean is accumulated in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
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
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
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
    let (m, _) = max_and_bad(x);
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
            let want = naive(&w, &x[..k], 1, k)[0];
            assert!((dot(&w[..k], &x[..k]) - want).abs() <= 1e-4 * (1.0 + want.abs()));
            assert!((dot_generic(&w[..k], &x[..k]) - want).abs() <= 1e-4 * (1.0 + want.abs()));
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
    fn attend_matches_a_naive_softmax_attention() {
        for &(hd, n) in &[(64usize, 1usize), (64, 15), (64, 16), (64, 37), (80, 5), (16, 33), (6, 9)] {
            let stride = 3 * hd + 5;
            let q: Vec<f32> = (0..hd).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
            let k: Vec<f32> = (0..n * stride).map(|i| ((i * 7919 % 997) as f32 / 500.0) - 1.0).collect();
            let v: Vec<f32> = (0..n * stride).map(|i| ((i * 104729 % 991) as f32 / 400.0) - 1.2).collect();
            let scale = 0.125;
            let s: Vec<f64> = (0..n)
                .map(|t| (0..hd).map(|i| q[i] as f64 * k[t * stride + i] as f64).sum::<f64>() * scale as f64)
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
            let want: Vec<f64> =
                (0..hd).map(|i| (0..n).map(|t| (s[t] - mx).exp() / z * v[t * stride + i] as f64).sum()).collect();
            let mut out = vec![f32::NAN; hd];
            let mut scores = Vec::new();
            attend(&q, &k, &v, stride, n, scale, &mut scores, &mut out);
            for (a, b) in out.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "hd {hd} n {n}: {a} vs {b}");
            }
            for (t, w) in scores.iter().enumerate() {
                assert!((*w as f64 - (s[t] - mx).exp() / z).abs() < 1e-6, "hd {hd} n {n}: weight {t}");
            }
        }
    }

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
