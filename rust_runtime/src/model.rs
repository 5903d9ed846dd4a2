//! The Llama forward over a ragged batch: several sequences, each with its own KV cache and
//! positions, in one pass whose matmuls read every weight once for all of them. Prefill (many
//! tokens of one sequence), decode (one token) and any mix of the two are the same call.
//!
//! Layout follows transformers' `LlamaForCausalLM` exactly: RMSNorm in f32, rotate-half RoPE with
//! the inverse frequencies and angles rounded to f32 as transformers does, q·kᵀ·head_dim^-½,
//! f32 softmax, SiLU MLP, tied or untied lm_head, no biases.
//!
//! Batch invariance: every per-token operation (norms, RoPE, SiLU) works on its own row, every
//! f32 matmul computes each output element with one fixed fma chain (`kernels::PackedF32`), and
//! attention runs per sequence over that sequence's cache only. So a sequence's logits are the
//! same bits alone, beside other sequences, or with its prompt split into chunks.

use crate::cache::{KvCache, CHUNK};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernels::int::{BlockKind, PackedQ};
use crate::kernels::{self, Panels, Par, SyncPtr};
use crate::linear::{Linear, Part};
use crate::loader::{layer_tensor, Loader};
pub use crate::quant::Quantize;
use crate::quant::Role;
use std::path::Path;

pub struct Layer {
    attn_norm: Vec<f32>,
    mlp_norm: Vec<f32>,
    /// rows: q (n_heads·hd) then k (n_kv·hd) then v (n_kv·hd)
    qkv: Linear,
    o: Linear,
    /// rows: gate (inter) then up (inter)
    gate_up: Linear,
    down: Linear,
}

/// Where the embedding rows live: the lm_head it is tied to (one copy of the matrix, f32 or
/// quantized), or a table of its own (untied): f32 rows, or blocks dequantized on lookup.
enum Embedding {
    Tied,
    F32(Vec<f32>),
    Quant(PackedQ),
}

pub struct Model {
    pub cfg: Config,
    pub quantize: Quantize,
    pub par: Par,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    /// [max_pos][head_dim/2] each
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Which logits a batch item wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// One sequence's part of a batched forward: `ids` are appended to `cache`.
pub struct BatchItem<'a> {
    pub cache: &'a mut KvCache,
    pub ids: &'a [u32],
    pub logits: Logits,
}

impl Model {
    /// Load `model.safetensors` + `config.json` from a bundle directory. f32 weights are packed
    /// here, once; each unpacked tensor is dropped as soon as it is packed.
    pub fn load(dir: &Path, quantize: Quantize, threads: usize) -> Result<Self> {
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, "cannot open the bundle directory", e))?;
        if !meta.is_dir() {
            return Err(Error::io(
                dir,
                "expected a bundle directory (model.safetensors, config.json, tokenizer.json)",
                std::io::Error::from(std::io::ErrorKind::NotADirectory),
            ));
        }
        let cfg = Config::from_file(&dir.join(crate::bundle::CONFIG))?;
        let ld = Loader::open(&dir.join(crate::bundle::WEIGHTS), &cfg)?;
        let (h, hd, nh, nkv, inter, vocab) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
            cfg.vocab_size,
        );
        let par = Par::new(threads)?;
        // one matrix from tensors stacked by rows, each stored as `quantize` says for its role
        let lin = |inp: usize, parts: Vec<(String, Vec<f32>, usize, Option<BlockKind>)>| {
            let parts = parts.into_iter().map(|(name, w, rows, kind)| Part { name, w, rows, kind }).collect();
            Linear::new(parts, inp, &par)
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let part = |p: &str, rows: usize, role: Role| -> Result<(String, Vec<f32>, usize, Option<BlockKind>)> {
                let name = layer_tensor(&cfg, l, p).0;
                Ok((name, ld.layer(&cfg, l, p)?, rows, quantize.storage(role)))
            };
            layers.push(Layer {
                qkv: lin(
                    h,
                    vec![
                        part("self_attn.q_proj.weight", nh * hd, Role::QProj)?,
                        part("self_attn.k_proj.weight", nkv * hd, Role::KProj)?,
                        part("self_attn.v_proj.weight", nkv * hd, Role::VProj)?,
                    ],
                )?,
                o: lin(nh * hd, vec![part("self_attn.o_proj.weight", h, Role::OProj)?])?,
                gate_up: lin(
                    h,
                    vec![
                        part("mlp.gate_proj.weight", inter, Role::GateProj)?,
                        part("mlp.up_proj.weight", inter, Role::UpProj)?,
                    ],
                )?,
                down: lin(inter, vec![part("mlp.down_proj.weight", h, Role::DownProj)?])?,
                attn_norm: ld.layer(&cfg, l, "input_layernorm.weight")?,
                mlp_norm: ld.layer(&cfg, l, "post_attention_layernorm.weight")?,
            });
        }
        let norm = ld.load("model.norm.weight")?;
        let embed_name = "model.embed_tokens.weight".to_string();
        let embed_w = ld.load(&embed_name)?;
        let (embed, lm_head) = if cfg.tie_word_embeddings {
            // transformers ties lm_head to embed_tokens (an lm_head.weight in the file is ignored);
            // the embedding rows are read from the head, f32 or quantized
            (Embedding::Tied, lin(h, vec![(embed_name, embed_w, vocab, quantize.tied_storage())])?)
        } else {
            let embed = match quantize.storage(Role::EmbedTokens) {
                None => Embedding::F32(embed_w),
                Some(kind) => Embedding::Quant(
                    PackedQ::quantize(kind, &embed_w, vocab, h, &par)
                        .map_err(|e| Error::format(format!("{embed_name}: {e}")))?,
                ),
            };
            let head = ld.load("lm_head.weight")?;
            (embed, lin(h, vec![("lm_head.weight".into(), head, vocab, quantize.storage(Role::LmHead))])?)
        };
        let (cos, sin) = rope_tables(&cfg);
        Ok(Model { cfg, quantize, par, embed, layers, norm, lm_head, cos, sin })
    }

    /// Bytes of weights one forward reads (every matrix once, the lm_head included; norms and an
    /// untied embedding table not counted).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize =
            self.layers.iter().map(|l| l.qkv.bytes() + l.o.bytes() + l.gate_up.bytes() + l.down.bytes()).sum();
        layers + self.lm_head.bytes()
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.cfg)
    }

    /// Check ids about to enter `cache`: non-empty, in [0, vocab), and within the context.
    pub fn check_ids(&self, ids: &[i64], position: usize) -> Result<Vec<u32>> {
        if ids.is_empty() {
            return Err(Error::arg("token ids: expected at least one id, got an empty list"));
        }
        let vocab = self.cfg.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&i| i < 0 || i >= vocab as i64) {
            return Err(Error::arg(format!("token id {bad} is out of range: expected 0 <= id < vocab_size = {vocab}")));
        }
        let ctx = self.cfg.max_position_embeddings;
        if position + ids.len() > ctx {
            return Err(Error::arg(format!(
                "sequence too long: {position} cached + {} new = {} tokens exceeds the context \
                 length {ctx} (max_position_embeddings)",
                ids.len(),
                position + ids.len()
            )));
        }
        Ok(ids.iter().map(|&i| i as u32).collect())
    }

    /// Append `ids` to `cache` and return logits: m × vocab (all_logits) or the last row.
    /// On error the cache is left as it was.
    pub fn forward(&self, cache: &mut KvCache, ids: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        let logits = if all_logits { Logits::All } else { Logits::Last };
        let mut items = [BatchItem { cache, ids, logits }];
        Ok(self.forward_batch(&mut items)?.pop().unwrap_or_default())
    }

    /// One forward over every item at once (each appends its ids to its own cache); returns per
    /// item the logits it asked for (len(ids) × vocab, the last row, or nothing). Errors before
    /// any compute for an empty item, an id outside the vocabulary or a sequence past the
    /// context; on any error every cache is left as it was.
    pub fn forward_batch(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        for it in items.iter() {
            let (m, pos0) = (it.ids.len(), it.cache.len);
            if m == 0 {
                return Err(Error::arg("token ids: expected at least one id, got an empty list"));
            }
            if pos0 + m > c.max_position_embeddings {
                return Err(Error::arg(format!(
                    "sequence too long: {pos0} cached + {m} new = {} tokens exceeds the context length {}",
                    pos0 + m,
                    c.max_position_embeddings
                )));
            }
            if let Some(&bad) = it.ids.iter().find(|&&i| i as usize >= c.vocab_size) {
                return Err(Error::arg(format!(
                    "token id {bad} is out of range: expected 0 <= id < vocab_size = {}",
                    c.vocab_size
                )));
            }
            if it.cache.layers() != c.num_hidden_layers || it.cache.kv_dim() != c.num_key_value_heads * c.head_dim {
                return Err(Error::arg("this sequence belongs to a different model"));
            }
        }
        self.par.install(|| self.forward_impl(items))
    }

    fn embed_row(&self, id: usize, dst: &mut [f32]) {
        let h = self.cfg.hidden_size;
        match &self.embed {
            Embedding::Tied => self.lm_head.row(id, dst),
            Embedding::F32(t) => dst.copy_from_slice(&t[id * h..(id + 1) * h]),
            Embedding::Quant(q) => q.row(id, dst),
        }
    }

    fn forward_impl(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let (h, hd, nh, nkv, inter) =
            (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size);
        let q_dim = nh * hd;
        let kv_dim = nkv * hd;
        let qkv_dim = q_dim + 2 * kv_dim;
        let half = hd / 2;
        let eps = c.rms_norm_eps as f32;
        let par = &self.par;
        // row r of the batch: (item, position); item b's rows are spans[b] = (first row, count, position of the first)
        let mut rows: Vec<(usize, usize)> = Vec::new();
        let mut spans: Vec<(usize, usize, usize)> = Vec::new();
        for (b, it) in items.iter_mut().enumerate() {
            let pos0 = it.cache.len;
            it.cache.prepare(pos0 + it.ids.len());
            spans.push((rows.len(), it.ids.len(), pos0));
            rows.extend((0..it.ids.len()).map(|i| (b, pos0 + i)));
        }
        let m = rows.len();

        let mut x = vec![0f32; m * h];
        let mut r = 0;
        for it in items.iter() {
            for &id in it.ids {
                self.embed_row(id as usize, &mut x[r * h..(r + 1) * h]);
                r += 1;
            }
        }
        let mut hbuf = vec![0f32; m * h];
        let mut qkv = vec![0f32; m * qkv_dim];
        let mut attn = vec![0f32; m * q_dim];
        let mut gu = vec![0f32; m * 2 * inter];
        let mut act = vec![0f32; m * inter];
        let scale = (hd as f64).powf(-0.5) as f32;

        for (li, layer) in self.layers.iter().enumerate() {
            par.rows(&mut hbuf, h, |i, o| kernels::rms_norm(&x[i * h..(i + 1) * h], &layer.attn_norm, eps, o));
            layer.qkv.forward(par, &hbuf, m, &mut qkv)?;
            // RoPE on q and k, then append k and v to each sequence's cache.
            par.rows(&mut qkv, qkv_dim, |i, row| {
                let p = rows[i].1;
                let (cs, sn) = (&self.cos[p * half..(p + 1) * half], &self.sin[p * half..(p + 1) * half]);
                for head in 0..nh + nkv {
                    kernels::rope_half(&mut row[head * hd..(head + 1) * hd], cs, sn);
                }
            });
            for (i, &(b, p)) in rows.iter().enumerate() {
                let row = &qkv[i * qkv_dim..(i + 1) * qkv_dim];
                items[b].cache.write(li, p, &row[q_dim..q_dim + kv_dim], &row[q_dim + kv_dim..]);
            }
            {
                let caches: Vec<&KvCache> = items.iter().map(|it| &*it.cache).collect();
                self.attention(li, &qkv, &spans, &caches, &mut attn, scale);
            }
            layer.o.forward(par, &attn, m, &mut hbuf)?;
            par.rows(&mut x, h, |i, xr| add_assign(xr, &hbuf[i * h..(i + 1) * h]));
            par.rows(&mut hbuf, h, |i, o| kernels::rms_norm(&x[i * h..(i + 1) * h], &layer.mlp_norm, eps, o));
            layer.gate_up.forward(par, &hbuf, m, &mut gu)?;
            par.rows(&mut act, inter, |i, o| {
                let row = &gu[i * 2 * inter..(i + 1) * 2 * inter];
                kernels::silu_mul(&row[..inter], &row[inter..], o)
            });
            layer.down.forward(par, &act, m, &mut hbuf)?;
            par.rows(&mut x, h, |i, xr| add_assign(xr, &hbuf[i * h..(i + 1) * h]));
        }

        // the rows whose logits were asked for, normed and sent through the lm_head together
        let mut want: Vec<usize> = Vec::new();
        let mut r0 = 0;
        for it in items.iter() {
            let n = it.ids.len();
            match it.logits {
                Logits::None => {}
                Logits::Last => want.push(r0 + n - 1),
                Logits::All => want.extend(r0..r0 + n),
            }
            r0 += n;
        }
        let vocab = c.vocab_size;
        for (j, &i) in want.iter().enumerate() {
            kernels::rms_norm(&x[i * h..(i + 1) * h], &self.norm, eps, &mut hbuf[j * h..(j + 1) * h]);
        }
        let mut logits = vec![0f32; want.len() * vocab];
        if !want.is_empty() {
            self.lm_head.forward(par, &hbuf[..want.len() * h], want.len(), &mut logits)?;
        }
        let mut out = Vec::with_capacity(items.len());
        let mut j = 0;
        for it in items.iter_mut() {
            let n = match it.logits {
                Logits::None => 0,
                Logits::Last => 1,
                Logits::All => it.ids.len(),
            };
            out.push(logits[j * vocab..(j + n) * vocab].to_vec());
            j += n;
            it.cache.len += it.ids.len();
        }
        Ok(out)
    }

    /// Causal attention of every batch row over its own item's cache (which already holds the
    /// row's position); `spans[b]` = (first row, rows, position of the first) of item b.
    ///
    /// An item's rows (consecutive positions) are taken in blocks of up to `kernels::TILE` per
    /// query head, and a block runs as panel products over the cache's layouts (`cache.rs`):
    /// scores = q·Kᵀ over the keys up to the block's last position, a softmax per row over its own
    /// positions, then out = p·V, for the whole block up to its first position and row by row
    /// after that. Every score and every output element is thus the same fma chain as for that
    /// row alone (a decode step), so a token's logits do not depend on the batch or on how its
    /// prompt was chunked; and a prefill block reads each key and value once for TILE queries.
    fn attention(
        &self,
        layer: usize,
        qkv: &[f32],
        spans: &[(usize, usize, usize)],
        caches: &[&KvCache],
        out: &mut [f32],
        scale: f32,
    ) {
        let c = &self.cfg;
        let (hd, nh, nkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let q_dim = nh * hd;
        let qkv_dim = q_dim + 2 * nkv * hd;
        let group = nh / nkv;
        let tile = kernels::TILE;
        // units: (item, first row of the block, rows in it t, first query head h0, heads hn): the
        // tile's rows are (row j, head h0 + g) for j < t, g < hn. A block of prefill rows takes one
        // head; a decode row (an item with one row) the `group` query heads of one kv head when they
        // fit a tile, which then read its keys and values once. Each row's scores and outputs are
        // the same chains whatever the tile's other rows.
        let by_kv = group > 1 && group <= tile;
        let mut units: Vec<(usize, usize, usize, usize, usize)> = Vec::new();
        let mut work = 0usize;
        let mut max_ctx = 0usize;
        for (b, &(r0, n, pos0)) in spans.iter().enumerate() {
            for j in (0..n).step_by(tile) {
                let t = tile.min(n - j);
                if n == 1 && by_kv {
                    units.extend((0..nkv).map(|kvh| (b, r0, 1, kvh * group, group)));
                } else {
                    units.extend((0..nh).map(|head| (b, r0 + j, t, head, 1)));
                }
                work += nh * t * (pos0 + j + t) * hd;
            }
            max_ctx = max_ctx.max(pos0 + n);
        }
        let op = SyncPtr(out.as_mut_ptr());
        let unit = |u: usize, buf: &mut AttnScratch| {
            let (b, r0, t, h0, hn) = units[u];
            let rows = t * hn; // tile row k: (row k / hn, head h0 + k % hn)
            let (row0, _, pos0) = spans[b];
            let p0 = pos0 + (r0 - row0); // position of the block's first row
            let n = p0 + t; // keys the block's last row sees
            let cache = caches[b];
            let kvh = h0 / group; // GQA: q head h reads kv head h / group
            let (kh, vh, hp) = (cache.k_head(layer, kvh), cache.v_head(layer, kvh), cache.hd_pad());
            buf.q.clear();
            for i in 0..hd {
                buf.q.extend((0..rows).map(|k| qkv[(r0 + k / hn) * qkv_dim + (h0 + k % hn) * hd + i]));
            }
            buf.scores.resize(rows * n, 0.0);
            let keys = Panels { w: kh, gs: hd * CHUNK, ss: CHUNK, rows: n };
            kernels::panel_product(&keys, &buf.q, rows, hd, &mut buf.scores, n, false);
            for k in 0..rows {
                let s = &mut buf.scores[k * n..k * n + p0 + k / hn + 1];
                for v in s.iter_mut() {
                    *v *= scale;
                }
                kernels::softmax_inplace(s);
            }
            buf.p.clear();
            for tt in 0..=p0 {
                buf.p.extend((0..rows).map(|k| buf.scores[k * n + tt]));
            }
            buf.out.resize(rows * hd, 0.0);
            let values = Panels { w: vh, gs: CHUNK, ss: hp, rows: hd };
            kernels::panel_product(&values, &buf.p, rows, p0 + 1, &mut buf.out, hd, false);
            for k in hn..rows {
                // row j = k / hn's positions past p0, continuing its own chains
                let j = k / hn;
                let pj = &buf.scores[k * n + p0 + 1..k * n + p0 + 1 + j];
                let later = Panels { w: &vh[(p0 + 1) * hp..], ..values };
                kernels::panel_product(&later, pj, 1, j, &mut buf.out[k * hd..], hd, true);
            }
            let op = op;
            for k in 0..rows {
                // SAFETY: each (row, head) writes its own hd-long slice of `out`.
                let at = (r0 + k / hn) * q_dim + (h0 + k % hn) * hd;
                let o = unsafe { std::slice::from_raw_parts_mut(op.0.add(at), hd) };
                o.copy_from_slice(&buf.out[k * hd..(k + 1) * hd]);
            }
        };
        let scratch = || AttnScratch {
            q: Vec::with_capacity(hd * tile),
            scores: Vec::with_capacity(tile * max_ctx),
            p: Vec::with_capacity(tile * max_ctx),
            out: Vec::with_capacity(tile * hd),
        };
        if self.par.threads > 1 && work > 1 << 16 {
            self.par.run(units.len(), |range| {
                let mut buf = scratch();
                for u in range {
                    unit(u, &mut buf);
                }
            });
        } else {
            let mut buf = scratch();
            for u in 0..units.len() {
                unit(u, &mut buf);
            }
        }
    }
}

/// x += o, elementwise (the residual connection).
fn add_assign(x: &mut [f32], o: &[f32]) {
    for (xv, ov) in x.iter_mut().zip(o) {
        *xv += *ov;
    }
}

/// One thread's buffers for `Model::attention`: a block's packed queries, scores (then weights),
/// packed weights and outputs.
struct AttnScratch {
    q: Vec<f32>,
    scores: Vec<f32>,
    p: Vec<f32>,
    out: Vec<f32>,
}

/// cos/sin tables [max_pos][head_dim/2], rounded like transformers' default RoPE:
/// inv_freq = 1 / theta^(2i/d) in f32; angle = f32(pos) · inv_freq in f32; cos/sin of that f32.
fn rope_tables(cfg: &Config) -> (Vec<f32>, Vec<f32>) {
    let d = cfg.head_dim;
    let half = d / 2;
    let theta = cfg.rope_theta as f32;
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            let e = (2 * i) as f32 / d as f32;
            1.0f32 / ((theta as f64).powf(e as f64) as f32)
        })
        .collect();
    let n = cfg.max_position_embeddings;
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in 0..n {
        for &f in &inv {
            let a = (p as f32) * f;
            cos.push((a as f64).cos() as f32);
            sin.push((a as f64).sin() as f32);
        }
    }
    (cos, sin)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::error::Error;
    use crate::generate::{generate_all, Generator};
    use crate::sampling::SamplingParams;
    use std::path::PathBuf;

    /// A random tiny Llama bundle written with the safetensors crate (no Python needed).
    pub(crate) struct Fixture {
        pub(crate) dir: PathBuf,
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.6
    }

    fn config_json(kv: usize) -> serde_json::Value {
        config_json_ctx(kv, 32)
    }

    fn config_json_ctx(kv: usize, ctx: usize) -> serde_json::Value {
        serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": kv, "intermediate_size": 128, "max_position_embeddings": ctx,
            "rms_norm_eps": 1e-5, "vocab_size": 96, "tie_word_embeddings": true, "rope_theta": 50000.0,
            "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}
        })
    }

    /// Random values for every tensor of the one list (`loader::expected_tensors`) of `cfg`.
    fn tensors(
        cfg: &serde_json::Value,
        skip: Option<&str>,
        reshape: Option<&str>,
    ) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let cfg = Config::from_json_str(&cfg.to_string()).unwrap();
        let mut seed = 42u64;
        let mut out: Vec<(String, Vec<usize>, Vec<f32>)> = crate::loader::expected_tensors(&cfg)
            .into_iter()
            .map(|(name, shape)| {
                let norm = shape.len() == 1;
                let n: usize = shape.iter().product();
                let data = (0..n).map(|_| if norm { 1.0 + lcg(&mut seed) } else { lcg(&mut seed) }).collect();
                (name, shape, data)
            })
            .collect();
        out.retain(|(n, _, _)| Some(n.as_str()) != skip);
        for t in out.iter_mut() {
            if Some(t.0.as_str()) == reshape {
                t.1 = vec![t.1.iter().product::<usize>() / 2, 2];
            }
        }
        out
    }

    pub(crate) fn fixture(name: &str, kv: usize, skip: Option<&str>, reshape: Option<&str>) -> Fixture {
        fixture_ctx(name, kv, skip, reshape, 32)
    }

    /// `fixture` with a context of `ctx` positions.
    fn fixture_ctx(name: &str, kv: usize, skip: Option<&str>, reshape: Option<&str>, ctx: usize) -> Fixture {
        fixture_cfg(name, &config_json_ctx(kv, ctx), skip, reshape)
    }

    /// hidden 256, intermediate 512 (whole q4_K super-blocks), 4 heads of 64 / 2 KV heads, a context of 80.
    fn wide_config() -> serde_json::Value {
        let mut c = config_json_ctx(2, 80);
        c["hidden_size"] = serde_json::json!(256);
        c["intermediate_size"] = serde_json::json!(512);
        c
    }

    /// A bundle of config `cfg` with random weights (`tensors`).
    fn fixture_cfg(name: &str, cfg: &serde_json::Value, skip: Option<&str>, reshape: Option<&str>) -> Fixture {
        let dir = std::env::temp_dir().join(format!("rust_runtime_test_{}_{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let ts = tensors(cfg, skip, reshape);
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
            ts.into_iter().map(|(n, s, d)| (n, s, d.iter().flat_map(|v| v.to_le_bytes()).collect())).collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
            })
            .collect();
        safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        Fixture { dir }
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn prefill_equals_stepwise_decode_and_threads_agree() {
        for kv in [2, 1, 4] {
            let fx = fixture(&format!("consistency{kv}"), kv, None, None);
            let m = Model::load(&fx.dir, Quantize::None, 1).unwrap();
            let ids: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 96).collect();
            let mut c = m.new_cache();
            let all = m.forward(&mut c, &ids, true).unwrap();
            assert_eq!(all.len(), 12 * 96);
            assert_eq!(c.len(), 12);
            // the cache holds n_kv heads per token, not n_heads: capacity 64 positions × head_dim 16
            assert_eq!(c.kv_heads(), kv);
            assert_eq!(c.layer_floats(0), (kv * 64 * 16, kv * 64 * 16));
            let mut c2 = m.new_cache();
            let first = m.forward(&mut c2, &ids[..5], true).unwrap();
            assert!(max_diff(&first, &all[..5 * 96]) < 1e-5);
            for (i, &id) in ids.iter().enumerate().skip(5) {
                let step = m.forward(&mut c2, &[id], false).unwrap();
                assert!(max_diff(&step, &all[i * 96..(i + 1) * 96]) < 1e-5, "kv {kv} step {i}");
            }
            // chunked prefill: 5 then 7 tokens with all logits
            let mut c5 = m.new_cache();
            m.forward(&mut c5, &ids[..5], false).unwrap();
            let rest = m.forward(&mut c5, &ids[5..], true).unwrap();
            assert!(max_diff(&rest, &all[5 * 96..]) < 1e-5);
            let m2 = Model::load(&fx.dir, Quantize::None, 2).unwrap();
            let mut c3 = m2.new_cache();
            assert!(max_diff(&m2.forward(&mut c3, &ids, true).unwrap(), &all) < 1e-5);
            // without positions, attention is blind to the order of the context: with RoPE,
            // swapping the first two tokens changes the last position's logits
            let x = m.forward(&mut m.new_cache(), &[3, 7, 11], false).unwrap();
            let y = m.forward(&mut m.new_cache(), &[7, 3, 11], false).unwrap();
            assert!(max_diff(&x, &y) > 1e-3);
        }
    }

    /// A sequence's logits are the same bits alone, beside 15 others (each at its own
    /// position, some prefilling, some decoding), and with its prompt prefilled in chunks.
    #[test]
    fn long_contexts_are_bit_identical_across_chunks_steps_forks_and_cache_growth() {
        // 150 positions: three K chunks of 64 and two cache growths (64 → 128 → 200); prefill
        // blocks of 6 queries start at positions that are not multiples of 6 or 64
        let fx = fixture_ctx("longctx", 2, None, None, 200);
        let ids: Vec<u32> = (0..150).map(|i| (i * 29 + 11) % 96).collect();
        for threads in [1, 2] {
            let m = Model::load(&fx.dir, Quantize::None, threads).unwrap();
            let alone = m.forward(&mut m.new_cache(), &ids, true).unwrap();
            let mut c = m.new_cache();
            let mut chunked = m.forward(&mut c, &ids[..70], true).unwrap();
            chunked.extend(m.forward(&mut c, &ids[70..71], true).unwrap());
            chunked.extend(m.forward(&mut c, &ids[71..], true).unwrap());
            assert!(chunked == alone, "threads {threads}: chunked prefill differs");
            let mut s = m.new_cache();
            let mut stepped = m.forward(&mut s, &ids[..60], true).unwrap();
            let mut fork = None;
            for (i, &id) in ids.iter().enumerate().skip(60) {
                stepped.extend(m.forward(&mut s, &[id], false).unwrap());
                if i == 99 {
                    fork = Some(s.fork());
                }
            }
            assert!(stepped == alone, "threads {threads}: decode steps differ from the prefill");
            let mut f = fork.unwrap();
            assert_eq!(f.len(), 100);
            let rest = m.forward(&mut f, &ids[100..], true).unwrap();
            assert!(rest[..] == alone[100 * 96..], "threads {threads}: the fork differs");
            assert!(max_diff(&alone, &m.forward(&mut m.new_cache(), &ids, true).unwrap()) == 0.0);
        }
    }

    #[test]
    fn batched_forward_is_bit_identical_to_alone_and_to_chunked() {
        let fx = fixture("invariance", 2, None, None);
        for threads in [1, 2] {
            let m = Model::load(&fx.dir, Quantize::None, threads).unwrap();
            let ids: Vec<u32> = (0..11).map(|i| (i * 13 + 5) % 96).collect();
            let alone = m.forward(&mut m.new_cache(), &ids, true).unwrap();
            // chunked: 4 + 1 + 6 tokens
            let mut c = m.new_cache();
            let mut chunked = m.forward(&mut c, &ids[..4], true).unwrap();
            chunked.extend(m.forward(&mut c, &ids[4..5], true).unwrap());
            chunked.extend(m.forward(&mut c, &ids[5..], true).unwrap());
            assert_eq!(chunked, alone, "threads {threads}: chunked prefill differs");
            // 15 others with caches at different lengths
            let mut others: Vec<(KvCache, Vec<u32>)> = (0..15)
                .map(|j| {
                    let mut oc = m.new_cache();
                    let pre: Vec<u32> = (0..(j % 5) + 1).map(|i| ((i * 7 + j * 3) % 96) as u32).collect();
                    m.forward(&mut oc, &pre, false).unwrap();
                    let next: Vec<u32> = (0..(j % 3) + 1).map(|i| ((i + j) % 96) as u32).collect();
                    (oc, next)
                })
                .collect();
            let mut mine = m.new_cache();
            let mut items: Vec<BatchItem<'_>> = Vec::new();
            let (first, rest) = others.split_at_mut(7);
            for (oc, next) in first.iter_mut() {
                items.push(BatchItem { cache: oc, ids: next, logits: Logits::Last });
            }
            items.push(BatchItem { cache: &mut mine, ids: &ids, logits: Logits::All });
            for (oc, next) in rest.iter_mut() {
                items.push(BatchItem { cache: oc, ids: next, logits: Logits::All });
            }
            let out = m.forward_batch(&mut items).unwrap();
            assert_eq!(out[7], alone, "threads {threads}: batched logits differ from alone");
            assert_eq!(mine.len(), 11);
            // and a decode step after it, batched vs alone
            let mut solo = m.new_cache();
            m.forward(&mut solo, &ids, false).unwrap();
            let step_alone = m.forward(&mut solo, &[17], false).unwrap();
            let mut items: Vec<BatchItem<'_>> = others
                .iter_mut()
                .map(|(oc, next)| BatchItem { cache: oc, ids: &next[..1], logits: Logits::Last })
                .collect();
            items.insert(3, BatchItem { cache: &mut mine, ids: &[17], logits: Logits::Last });
            let out = m.forward_batch(&mut items).unwrap();
            assert_eq!(out[3], step_alone, "threads {threads}: batched decode differs");
        }
    }

    /// Relative RMS of b against a.
    fn rel_rms(a: &[f32], b: &[f32]) -> f32 {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = a.iter().map(|x| x * x).sum();
        (num / den).sqrt()
    }

    #[test]
    fn quantized_models_are_close_to_f32() {
        let fx = fixture_cfg("qclose", &wide_config(), None, None);
        let f = Model::load(&fx.dir, Quantize::None, 1).unwrap();
        let ids: Vec<u32> = (0..16).map(|i| (i * 5 + 1) % 96).collect();
        let a = f.forward(&mut f.new_cache(), &ids, true).unwrap();
        // relative RMS of the logits on this random model (uniform weights, 2 layers): measured
        // q8_0 5.2 %, q4_mix 41 %, q4_0 50 %
        let mut errs = Vec::new();
        for (q, limit) in [(Quantize::Q8_0, 0.08), (Quantize::Q4Mix, 0.5), (Quantize::Q4_0, 0.6)] {
            for threads in [1, 2] {
                let m = Model::load(&fx.dir, q, threads).unwrap();
                let b = m.forward(&mut m.new_cache(), &ids, true).unwrap();
                let e = rel_rms(&a, &b);
                assert!(e < limit && e > 0.0, "{q:?}: relative error {e}");
                errs.push(e);
            }
        }
        // 8 bits beat the mix, which beats 4 bits everywhere
        assert!(errs[0] < errs[2] && errs[2] < errs[4], "{errs:?}");
        // per layer: q + k 384 × 256, v 128 × 256, o 256 × 256, gate + up 1024 × 256, down 256 × 512; a tied
        // head of 96 × 256: q8_0 is 34 bytes a block of 32, q4_0 18
        let (qk, v, o, gu, down, head) =
            (2 * 384 * 256, 2 * 128 * 256, 2 * 256 * 256, 2 * 1024 * 256, 2 * 256 * 512, 96 * 256);
        let all = qk + v + o + gu + down + head;
        let bytes = |q: Quantize| Model::load(&fx.dir, q, 1).unwrap().weight_bytes();
        assert_eq!(bytes(Quantize::None), all * 4);
        assert_eq!(bytes(Quantize::Q8_0), all / 32 * 34);
        assert_eq!(bytes(Quantize::Q4_0), all / 32 * 18);
        assert_eq!(bytes(Quantize::Q4Mix), (qk + o + gu) / 32 * 18 + (v + down + head) / 32 * 34);
    }

    /// The integer kernels keep a sequence's logits the same bits alone, beside others
    /// (decoding or prefilling) and with its prompt in chunks, as the f32 path does.
    #[test]
    fn quantized_forward_is_bit_identical_alone_batched_and_chunked() {
        let fx = fixture_cfg("qinvariance", &wide_config(), None, None);
        let ids: Vec<u32> = (0..70).map(|i| (i * 13 + 5) % 96).collect();
        for q in [Quantize::Q8_0, Quantize::Q4_0, Quantize::Q4Mix] {
            for threads in [1, 2] {
                let m = Model::load(&fx.dir, q, threads).unwrap();
                let alone = m.forward(&mut m.new_cache(), &ids, true).unwrap();
                let mut c = m.new_cache();
                let mut chunked = m.forward(&mut c, &ids[..9], true).unwrap();
                chunked.extend(m.forward(&mut c, &ids[9..10], true).unwrap());
                for &id in &ids[10..20] {
                    chunked.extend(m.forward(&mut c, &[id], true).unwrap());
                }
                chunked.extend(m.forward(&mut c, &ids[20..], true).unwrap());
                assert!(chunked == alone, "{q:?} threads {threads}: chunked prefill / decode differs");
                // beside 9 others, some prefilling, some decoding
                let mut others: Vec<(KvCache, Vec<u32>)> = (0..9)
                    .map(|j| {
                        let mut oc = m.new_cache();
                        m.forward(&mut oc, &[(j * 7 % 96) as u32, 3], false).unwrap();
                        (oc, (0..(j % 4) * 5 + 1).map(|i| ((i * 11 + j) % 96) as u32).collect())
                    })
                    .collect();
                let mut mine = m.new_cache();
                let mut items: Vec<BatchItem<'_>> = others
                    .iter_mut()
                    .map(|(oc, next)| BatchItem { cache: oc, ids: next, logits: Logits::All })
                    .collect();
                items.insert(4, BatchItem { cache: &mut mine, ids: &ids, logits: Logits::All });
                let out = m.forward_batch(&mut items).unwrap();
                assert!(out[4] == alone, "{q:?} threads {threads}: batched logits differ from alone");
            }
        }
    }

    #[test]
    fn a_shape_a_block_cannot_cover_is_refused_naming_the_tensor() {
        // hidden 48: in_features 48 is not a multiple of 32
        let mut cfg = config_json(2);
        cfg["hidden_size"] = serde_json::json!(48);
        let fx = fixture_cfg("block48", &cfg, None, None);
        for (q, block) in [(Quantize::Q8_0, 32), (Quantize::Q4_0, 32), (Quantize::Q4Mix, 32)] {
            let e = Model::load(&fx.dir, q, 1).err().unwrap();
            let msg = e.to_string();
            assert!(matches!(e, Error::Format(_)), "{msg}");
            assert!(msg.contains("model.layers.0.self_attn.q_proj.weight") && msg.contains("[48, 48]"), "{msg}");
            assert!(
                msg.contains(&format!("multiple of the block size {block};")) && msg.contains("quantize=\"none\""),
                "{msg}"
            );
        }
        assert!(Model::load(&fx.dir, Quantize::None, 1).is_ok());
    }

    #[test]
    fn bad_inputs_are_errors_and_leave_the_cache_alone() {
        let fx = fixture("errors", 2, None, None);
        let m = Model::load(&fx.dir, Quantize::None, 1).unwrap();
        let mut c = m.new_cache();
        m.forward(&mut c, &[1, 2, 3], false).unwrap();
        assert!(matches!(m.forward(&mut c, &[96], false), Err(Error::InvalidArgument(_))));
        assert!(matches!(m.forward(&mut c, &[], false), Err(Error::InvalidArgument(_))));
        assert!(matches!(m.forward(&mut c, &[1; 30], false), Err(Error::InvalidArgument(_))));
        assert_eq!(c.len(), 3);
        assert!(matches!(m.check_ids(&[-1], 0), Err(Error::InvalidArgument(_))));
        assert!(m.check_ids(&[1; 29], 3).is_ok());
        let e = m.check_ids(&[1; 30], 3).unwrap_err().to_string();
        assert!(e.contains("32"), "{e}");
        // generation: the context limit is checked before anything runs
        let g = Generator::new(&m, &[1; 30], 3, SamplingParams::default(), Some(0), &[], Some(0));
        let e = g.err().unwrap().to_string();
        assert!(e.contains("30") && e.contains("32"), "{e}");
        let mut g = Generator::new(&m, &[1; 30], 2, SamplingParams::default(), Some(0), &[], None).unwrap();
        assert!(generate_all(&m, &mut g).unwrap().len() <= 2);
        let mut g = Generator::new(&m, &[1, 2], 0, SamplingParams::default(), Some(0), &[], None).unwrap();
        assert!(generate_all(&m, &mut g).unwrap().is_empty());
        assert!(Generator::new(&m, &[], 3, SamplingParams::default(), None, &[], None).is_err());
        assert!(Generator::new(&m, &[1], 3, SamplingParams::default(), None, &[96], None).is_err());
        // same seed, same tokens; greedy equals the argmax of the logits
        let p = SamplingParams { temperature: 0.9, top_p: 0.9, ..Default::default() };
        let run = |seed| {
            let mut g = Generator::new(&m, &[1, 2, 3], 8, p.clone(), Some(seed), &[], None).unwrap();
            generate_all(&m, &mut g).unwrap()
        };
        assert_eq!(run(7), run(7));
        let greedy = SamplingParams { temperature: 0.0, ..Default::default() };
        let mut g = Generator::new(&m, &[1, 2, 3], 1, greedy, None, &[], None).unwrap();
        let (tok, lp) = generate_all(&m, &mut g).unwrap()[0];
        let lg = m.forward(&mut m.new_cache(), &[1, 2, 3], false).unwrap();
        assert_eq!(Some(tok as usize), crate::sampling::argmax(&lg));
        assert!((lp as f64 - crate::sampling::log_prob(&lg, tok as usize)).abs() < 1e-6);
    }

    #[test]
    fn malformed_bundles_are_errors() {
        let fx = fixture("missing", 2, Some("model.layers.1.mlp.up_proj.weight"), None);
        let e = Model::load(&fx.dir, Quantize::None, 1).err().unwrap();
        assert!(matches!(e, Error::Format(_)) && e.to_string().contains("model.layers.1.mlp.up_proj.weight"), "{e}");
        let fx = fixture("shape", 2, None, Some("model.layers.0.self_attn.k_proj.weight"));
        let e = Model::load(&fx.dir, Quantize::None, 1).err().unwrap().to_string();
        assert!(e.contains("k_proj") && e.contains("[1024, 2]") && e.contains("[32, 64]"), "{e}");
        let e = Model::load(Path::new("/nonexistent/bundle"), Quantize::None, 1).err().unwrap();
        assert!(matches!(e, Error::Io { .. }), "{e}");
        let fx = fixture("noconfig", 2, None, None);
        std::fs::remove_file(fx.dir.join("config.json")).unwrap();
        let e = Model::load(&fx.dir, Quantize::None, 1).err().unwrap();
        assert!(matches!(&e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound), "{e}");
        let fx = fixture("corrupt", 2, None, None);
        std::fs::write(fx.dir.join("model.safetensors"), b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage").unwrap();
        assert!(Model::load(&fx.dir, Quantize::None, 1).is_err());
        assert!(Quantize::parse(Some("int4")).is_err());
        assert_eq!(Quantize::parse(Some("q8_0")).unwrap(), Quantize::Q8_0);
        assert_eq!(Quantize::parse(Some("int8")).unwrap(), Quantize::Q8_0);
        assert_eq!(Quantize::parse(Some("q4_0")).unwrap(), Quantize::Q4_0);
        assert_eq!(Quantize::parse(None).unwrap(), Quantize::None);
    }
}
