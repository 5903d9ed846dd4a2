//! One sequence's KV cache: per layer, K and V as token-major rows of n_kv·head_dim floats
//! (the KV-head count, never expanded for GQA). Capacity grows by doubling up to the context and
//! is kept across `reset`; `fork` copies it for the choices of an n > 1 request.

use crate::config::Config;

#[derive(Clone)]
pub struct KvCache {
    pub(crate) k: Vec<Vec<f32>>,
    pub(crate) v: Vec<Vec<f32>>,
    pub(crate) len: usize,
    pub(crate) kv_dim: usize,
    max_pos: usize,
}

impl KvCache {
    pub fn new(cfg: &Config) -> Self {
        let kv_dim = cfg.num_key_value_heads * cfg.head_dim;
        let reserve = cfg.max_position_embeddings.min(64) * kv_dim;
        KvCache {
            k: (0..cfg.num_hidden_layers).map(|_| Vec::with_capacity(reserve)).collect(),
            v: (0..cfg.num_hidden_layers).map(|_| Vec::with_capacity(reserve)).collect(),
            len: 0,
            kv_dim,
            max_pos: cfg.max_position_embeddings,
        }
    }

    /// Number of cached tokens (= the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn reset(&mut self) {
        self.len = 0;
        for b in self.k.iter_mut().chain(self.v.iter_mut()) {
            b.clear();
        }
    }

    /// An independent copy holding the same `len` tokens (what lies past `len` is dropped).
    pub fn fork(&self) -> Self {
        let keep = self.len * self.kv_dim;
        let cut = |b: &Vec<Vec<f32>>| b.iter().map(|l| l[..keep.min(l.len())].to_vec()).collect();
        KvCache { k: cut(&self.k), v: cut(&self.v), len: self.len, kv_dim: self.kv_dim, max_pos: self.max_pos }
    }

    /// Drop anything past `len` (left by a failed forward) and make room for `total` tokens.
    pub(crate) fn prepare(&mut self, total: usize) {
        let need = total * self.kv_dim;
        let keep = self.len * self.kv_dim;
        for b in self.k.iter_mut().chain(self.v.iter_mut()) {
            b.truncate(keep);
            if b.capacity() < need {
                let target = (total.max(2 * self.len).min(self.max_pos).max(total)) * self.kv_dim;
                b.reserve_exact(target - b.len());
            }
        }
    }
}
