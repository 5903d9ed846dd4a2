//! One sequence's KV cache, per layer and per KV head (the KV-head count, never expanded for GQA),
//! in the panel layouts that `kernels::panel_product` reads, so that attention runs as small
//! matrix products with the same per-element fma chain for one query (decode) or a block of them
//! (prefill):
//!
//! * **K** of head h: positions in chunks of `CHUNK` (64), each chunk k-major —
//!   `k[layer][h·cap·hd + (t / 64)·hd·64 + i·64 + t % 64]` for position t, dimension i. Scores
//!   q·k_t for 64 positions are one panel product over hd steps.
//! * **V** of head h: token-major rows padded to `hd_pad` (a multiple of 16) —
//!   `v[layer][h·cap·hd_pad + t·hd_pad + d]`. Σ_t p_t·v_t is one panel product over t.
//!
//! `cap` (positions per head, a multiple of 64) grows by doubling up to the context, relaying out
//! what is cached, and is kept across `reset`; `fork` copies the cache for the choices of an n > 1
//! request. Positions at or past `len` hold stale values that no computation reads.

use crate::config::Config;

/// Positions per K chunk: one group of packed rows (`kernels::GROUP`).
pub const CHUNK: usize = 64;

#[derive(Clone)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    pub(crate) len: usize,
    cap: usize,
    n_kv: usize,
    hd: usize,
    hd_pad: usize,
    max_pos: usize,
}

impl KvCache {
    pub fn new(cfg: &Config) -> Self {
        let hd = cfg.head_dim;
        let mut c = KvCache {
            k: vec![Vec::new(); cfg.num_hidden_layers],
            v: vec![Vec::new(); cfg.num_hidden_layers],
            len: 0,
            cap: 0,
            n_kv: cfg.num_key_value_heads,
            hd,
            hd_pad: hd.div_ceil(16) * 16,
            max_pos: cfg.max_position_embeddings,
        };
        c.grow(CHUNK.min(cfg.max_position_embeddings.max(1)));
        c
    }

    /// Number of cached tokens (= the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// KV heads held per layer (the model's num_key_value_heads; GQA is never expanded here).
    pub fn kv_heads(&self) -> usize {
        self.n_kv
    }

    /// Floats per token and layer in K and V each: n_kv · head_dim (the model checks it).
    pub(crate) fn kv_dim(&self) -> usize {
        self.n_kv * self.hd
    }

    pub(crate) fn layers(&self) -> usize {
        self.k.len()
    }

    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// An independent copy holding the same `len` tokens (room for at least one more chunk).
    pub fn fork(&self) -> Self {
        let mut c = self.empty_like();
        c.relayout_from(self, self.len.max(1));
        c
    }

    /// The same shape (layers, heads, head_dim, context) with nothing allocated.
    fn empty_like(&self) -> Self {
        KvCache { k: vec![Vec::new(); self.k.len()], v: vec![Vec::new(); self.v.len()], len: 0, cap: 0, ..*self }
    }

    /// Make room for `total` tokens (what lies at or past `len` is dropped).
    pub(crate) fn prepare(&mut self, total: usize) {
        if total > self.cap {
            self.grow(total.max(2 * self.len).min(self.max_pos).max(total));
        }
    }

    /// Reallocate for at least `positions` (rounded up to whole chunks), keeping `len` tokens.
    fn grow(&mut self, positions: usize) {
        let old = std::mem::replace(self, self.empty_like());
        self.relayout_from(&old, positions);
    }

    /// Allocate room for `positions` and copy `src`'s first `src.len` tokens into it.
    fn relayout_from(&mut self, src: &KvCache, positions: usize) {
        let cap = positions.max(src.len).div_ceil(CHUNK) * CHUNK;
        let (hd, hp, n_kv) = (self.hd, self.hd_pad, self.n_kv);
        let chunks_used = src.len.div_ceil(CHUNK);
        for (layer, (k, v)) in self.k.iter_mut().zip(self.v.iter_mut()).enumerate() {
            *k = vec![0f32; n_kv * cap * hd];
            *v = vec![0f32; n_kv * cap * hp];
            if src.len == 0 {
                continue;
            }
            for h in 0..n_kv {
                let n = chunks_used * CHUNK * hd;
                k[h * cap * hd..h * cap * hd + n].copy_from_slice(&src.k[layer][h * src.cap * hd..][..n]);
                let n = src.len * hp;
                v[h * cap * hp..h * cap * hp + n].copy_from_slice(&src.v[layer][h * src.cap * hp..][..n]);
            }
        }
        self.cap = cap;
        self.len = src.len;
    }

    /// Store position `pos` (< the prepared capacity) of `layer`: `k_row` and `v_row` hold
    /// n_kv · head_dim floats each, head-major (the q/k/v projection's layout).
    pub(crate) fn write(&mut self, layer: usize, pos: usize, k_row: &[f32], v_row: &[f32]) {
        let (hd, hp, cap) = (self.hd, self.hd_pad, self.cap);
        assert!(pos < cap && k_row.len() >= self.n_kv * hd && v_row.len() >= self.n_kv * hd);
        let (k, v) = (&mut self.k[layer], &mut self.v[layer]);
        for h in 0..self.n_kv {
            let base = h * cap * hd + (pos / CHUNK) * hd * CHUNK + pos % CHUNK;
            for (i, &x) in k_row[h * hd..(h + 1) * hd].iter().enumerate() {
                k[base + i * CHUNK] = x;
            }
            v[h * cap * hp + pos * hp..][..hd].copy_from_slice(&v_row[h * hd..(h + 1) * hd]);
        }
    }

    /// K of one head in chunks (see the module docs): cap · head_dim floats.
    pub(crate) fn k_head(&self, layer: usize, h: usize) -> &[f32] {
        let n = self.cap * self.hd;
        &self.k[layer][h * n..(h + 1) * n]
    }

    /// V of one head, rows of `hd_pad` floats: cap · hd_pad floats.
    pub(crate) fn v_head(&self, layer: usize, h: usize) -> &[f32] {
        let n = self.cap * self.hd_pad;
        &self.v[layer][h * n..(h + 1) * n]
    }

    /// Floats held for K and for V in `layer` (all heads, the whole capacity): what the tests
    /// check to see that GQA heads are not expanded.
    #[cfg(test)]
    pub(crate) fn layer_floats(&self, layer: usize) -> (usize, usize) {
        (self.k[layer].len(), self.v[layer].len())
    }

    /// The row stride of `v_head`.
    pub(crate) fn hd_pad(&self) -> usize {
        self.hd_pad
    }
}
