//! The Llama forward: weights loaded from a Shalik bundle (Hugging Face names), a per-sequence
//! KV cache kept in plain Vecs (token-major, KV-head count, grown by doubling, never `cat`), and
//! one forward that serves both prefill (m tokens: GEMM through the `gemm` crate, or candle's
//! q8_0 QMatMul) and decode (m = 1: our GEMV, or candle's repacked q8_0 GEMV).
//!
//! Layout follows transformers' `LlamaForCausalLM` exactly: RMSNorm in f32, rotate-half RoPE with
//! the inverse frequencies and angles rounded to f32 as transformers does, q·kᵀ·head_dim^-½,
//! f32 softmax, SiLU MLP, tied or untied lm_head, no biases.

use crate::config::Config;
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, Par, SyncPtr};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Storage, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantize {
    None,
    Q8_0,
}

impl Quantize {
    pub fn parse(s: Option<&str>) -> Result<Self> {
        match s.map(|s| s.trim().to_ascii_lowercase()) {
            None => Ok(Quantize::None),
            Some(s) if s.is_empty() || s == "none" || s == "f32" || s == "float32" => Ok(Quantize::None),
            Some(s) if s == "int8" || s == "q8_0" || s == "q8" => Ok(Quantize::Q8_0),
            Some(s) => Err(Error::arg(format!("quantize is {s:?}; expected None, \"none\" or \"int8\""))),
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            Quantize::None => "none",
            Quantize::Q8_0 => "int8",
        }
    }
}

/// A weight matrix (out × in, the nn.Linear layout) in f32 or q8_0.
pub enum Linear {
    F32 {
        w: Arc<Vec<f32>>,
        out: usize,
        inp: usize,
    },
    /// q8_0, split by rows into shards that run in parallel (one per thread, more for big
    /// matrices); each shard is a candle QMatMul run on one thread.
    Q8 {
        shards: Vec<Q8Shard>,
        out: usize,
        inp: usize,
    },
}

pub struct Q8Shard {
    mm: QMatMul,
    row0: usize,
    rows: usize,
}

impl Linear {
    fn new(w: Arc<Vec<f32>>, out: usize, inp: usize, q: Quantize, threads: usize, name: &str) -> Result<Self> {
        match q {
            Quantize::None => Ok(Linear::F32 { w, out, inp }),
            Quantize::Q8_0 => {
                if inp % 32 != 0 {
                    return Err(Error::format(format!(
                        "{name}: int8 (q8_0) needs an input dimension that is a multiple of 32, \
                         got {inp}"
                    )));
                }
                let n_shards = if threads <= 1 {
                    1
                } else if out * inp >= 1 << 20 {
                    2 * threads
                } else {
                    threads
                };
                // rows per shard: a multiple of 16 (candle's repacked q8_0 kernels need n % 16 == 0)
                let per = (out.div_ceil(n_shards)).div_ceil(16) * 16;
                let mut shards = Vec::new();
                let mut row0 = 0;
                while row0 < out {
                    let rows = per.min(out - row0);
                    let t = Tensor::from_slice(&w[row0 * inp..(row0 + rows) * inp], (rows, inp), &Device::Cpu)
                        .ctx(|| format!("{name}: building the tensor to quantize"))?;
                    let qt = QTensor::quantize(&t, GgmlDType::Q8_0).ctx(|| format!("{name}: q8_0 quantization"))?;
                    let mm = QMatMul::from_qtensor(qt).ctx(|| format!("{name}: q8_0 matmul"))?;
                    shards.push(Q8Shard { mm, row0, rows });
                    row0 += rows;
                }
                Ok(Linear::Q8 { shards, out, inp })
            }
        }
    }

    pub fn out_features(&self) -> usize {
        match self {
            Linear::F32 { out, .. } | Linear::Q8 { out, .. } => *out,
        }
    }

    /// y (m × out) = x (m × in) · Wᵀ.
    pub fn forward(&self, par: &Par, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        match self {
            Linear::F32 { w, out, inp } => {
                let (out, inp) = (*out, *inp);
                if x.len() < m * inp || y.len() < m * out || w.len() != out * inp {
                    return Err(Error::Internal(format!(
                        "linear: shapes x {} y {} w {} for m {m} out {out} in {inp}",
                        x.len(),
                        y.len(),
                        w.len()
                    )));
                }
                if m == 1 {
                    kernels::gemv(par, w, &x[..inp], &mut y[..out], inp);
                } else {
                    let parallelism =
                        if par.threads > 1 { gemm::Parallelism::Rayon(par.threads) } else { gemm::Parallelism::None };
                    // SAFETY: dst is m×out row-major (rs = out, cs = 1), lhs is m×inp row-major,
                    // rhs = Wᵀ is inp×out read from W (out×inp row-major): rs = 1, cs = inp.
                    // All lengths were checked above.
                    unsafe {
                        gemm::gemm(
                            m,
                            out,
                            inp,
                            y.as_mut_ptr(),
                            1,
                            out as isize,
                            false,
                            x.as_ptr(),
                            1,
                            inp as isize,
                            w.as_ptr(),
                            inp as isize,
                            1,
                            0.0f32,
                            1.0f32,
                            false,
                            false,
                            false,
                            parallelism,
                        )
                    }
                }
                Ok(())
            }
            Linear::Q8 { shards, out, inp } => {
                let (out, inp) = (*out, *inp);
                if x.len() < m * inp || y.len() < m * out {
                    return Err(Error::Internal(format!("q8_0 linear: shapes x {} y {}", x.len(), y.len())));
                }
                let xt = Tensor::from_slice(&x[..m * inp], (m, inp), &Device::Cpu)
                    .ctx(|| "q8_0 linear: input".to_string())?;
                let yp = SyncPtr(y.as_mut_ptr());
                par.try_each(shards.len(), |s| {
                    let sh = &shards[s];
                    let yt = sh.mm.forward(&xt).ctx(|| format!("q8_0 matmul ({m}×{inp} · {inp}×{})", sh.rows))?;
                    let yp = yp;
                    with_tensor_data(&yt, m * sh.rows, |src| {
                        for i in 0..m {
                            // SAFETY: shard s owns columns [row0, row0 + rows) of every output row.
                            let dst = unsafe { std::slice::from_raw_parts_mut(yp.0.add(i * out + sh.row0), sh.rows) };
                            dst.copy_from_slice(&src[i * sh.rows..(i + 1) * sh.rows]);
                        }
                    })
                })
            }
        }
    }
}

/// Borrow the f32 data of a contiguous CPU tensor of `len` elements.
fn with_tensor_data(t: &Tensor, len: usize, f: impl FnOnce(&[f32])) -> Result<()> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cs) => {
            let s = cs.as_slice::<f32>().ctx(|| "q8_0 matmul output".to_string())?;
            let o = layout.start_offset();
            if !layout.is_contiguous() || s.len() < o + len {
                return Err(Error::Internal("q8_0 matmul output has an unexpected layout".into()));
            }
            f(&s[o..o + len]);
            Ok(())
        }
        _ => Err(Error::Internal("q8_0 matmul output is not on the CPU".into())),
    }
}

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

pub struct Model {
    pub cfg: Config,
    pub quantize: Quantize,
    pub par: Par,
    embed: Arc<Vec<f32>>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    /// [max_pos][head_dim/2] each
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// One sequence's KV cache: per layer, K and V as token-major rows of n_kv·head_dim floats.
/// Capacity grows by doubling (up to the context) and is kept across `reset`.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    kv_dim: usize,
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

    /// Drop anything past `len` (left by a failed forward) and make room for `total` tokens.
    fn prepare(&mut self, total: usize) {
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

fn tensor_to_f32(view: &safetensors::tensor::TensorView<'_>, name: &str) -> Result<Vec<f32>> {
    use safetensors::Dtype;
    let data = view.data();
    let out: Vec<f32> = match view.dtype() {
        Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F16 => data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        other => return Err(Error::format(format!("tensor {name} has dtype {other:?}; expected F32, F16 or BF16"))),
    };
    let want: usize = view.shape().iter().product();
    if out.len() != want {
        return Err(Error::format(format!("tensor {name}: {} values for shape {:?}", out.len(), view.shape())));
    }
    Ok(out)
}

struct Loader<'a> {
    st: &'a candle_core::safetensors::MmapedSafetensors,
    views: HashMap<String, (safetensors::Dtype, Vec<usize>)>,
    file: String,
}

impl Loader<'_> {
    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        match self.views.get(name) {
            None => Err(Error::format(format!("{}: tensor {name} is missing (expected shape {shape:?})", self.file))),
            Some((dt, s)) => {
                use safetensors::Dtype;
                if !matches!(dt, Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                    return Err(Error::format(format!(
                        "{}: tensor {name} has dtype {dt:?}; expected F32, F16 or BF16",
                        self.file
                    )));
                }
                if s.as_slice() != shape {
                    return Err(Error::format(format!(
                        "{}: tensor {name} has shape {s:?}, expected {shape:?}",
                        self.file
                    )));
                }
                Ok(())
            }
        }
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.check(name, shape)?;
        let view = self.st.get(name).ctx(|| format!("{}: reading tensor {name}", self.file))?;
        tensor_to_f32(&view, name)
    }
}

fn concat_rows(parts: Vec<Vec<f32>>) -> Vec<f32> {
    let n = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(n);
    for p in parts {
        out.extend_from_slice(&p);
    }
    out
}

impl Model {
    /// Load `model.safetensors` + `config.json` from a bundle directory.
    pub fn load(dir: &Path, quantize: Quantize, threads: usize) -> Result<Self> {
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, "cannot open the bundle directory", e))?;
        if !meta.is_dir() {
            return Err(Error::io(
                dir,
                "expected a bundle directory (model.safetensors, config.json, tokenizer.json)",
                std::io::Error::from(std::io::ErrorKind::NotADirectory),
            ));
        }
        let cfg = Config::from_file(&dir.join("config.json"))?;
        let st_path = dir.join("model.safetensors");
        std::fs::File::open(&st_path).map_err(|e| Error::io(&st_path, "cannot open the model weights", e))?;
        // SAFETY: the file is memory-mapped read-only; it must not be truncated while loading.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&st_path) }
            .ctx(|| format!("{}: not a readable safetensors file", st_path.display()))?;
        let views =
            st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec()))).collect::<HashMap<_, _>>();
        let ld = Loader { st: &st, views, file: st_path.display().to_string() };
        Self::from_loader(&ld, cfg, quantize, threads)
    }

    fn from_loader(ld: &Loader<'_>, cfg: Config, quantize: Quantize, threads: usize) -> Result<Self> {
        let (h, hd, nh, nkv, inter, vocab) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
            cfg.vocab_size,
        );
        if let Some(b) = ld.views.keys().find(|k| k.ends_with(".bias")) {
            return Err(Error::format(format!(
                "{}: tensor {b} is a bias; this runtime implements Llama without biases",
                ld.file
            )));
        }
        // Validate every name and shape before loading anything: one clear error, no panic.
        let mut expected: Vec<(String, Vec<usize>)> =
            vec![("model.embed_tokens.weight".into(), vec![vocab, h]), ("model.norm.weight".into(), vec![h])];
        if !cfg.tie_word_embeddings {
            expected.push(("lm_head.weight".into(), vec![vocab, h]));
        }
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            expected.extend([
                (format!("{p}.self_attn.q_proj.weight"), vec![nh * hd, h]),
                (format!("{p}.self_attn.k_proj.weight"), vec![nkv * hd, h]),
                (format!("{p}.self_attn.v_proj.weight"), vec![nkv * hd, h]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, nh * hd]),
                (format!("{p}.mlp.gate_proj.weight"), vec![inter, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![inter, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, inter]),
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            ]);
        }
        for (n, s) in &expected {
            ld.check(n, s)?;
        }

        let embed = Arc::new(ld.load("model.embed_tokens.weight", &[vocab, h])?);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let q = ld.load(&format!("{p}.self_attn.q_proj.weight"), &[nh * hd, h])?;
            let k = ld.load(&format!("{p}.self_attn.k_proj.weight"), &[nkv * hd, h])?;
            let v = ld.load(&format!("{p}.self_attn.v_proj.weight"), &[nkv * hd, h])?;
            let qkv = Linear::new(
                Arc::new(concat_rows(vec![q, k, v])),
                (nh + 2 * nkv) * hd,
                h,
                quantize,
                threads,
                &format!("{p}.self_attn.qkv"),
            )?;
            let o = ld.load(&format!("{p}.self_attn.o_proj.weight"), &[h, nh * hd])?;
            let o = Linear::new(Arc::new(o), h, nh * hd, quantize, threads, &format!("{p}.self_attn.o_proj"))?;
            let g = ld.load(&format!("{p}.mlp.gate_proj.weight"), &[inter, h])?;
            let u = ld.load(&format!("{p}.mlp.up_proj.weight"), &[inter, h])?;
            let gate_up = Linear::new(
                Arc::new(concat_rows(vec![g, u])),
                2 * inter,
                h,
                quantize,
                threads,
                &format!("{p}.mlp.gate_up"),
            )?;
            let d = ld.load(&format!("{p}.mlp.down_proj.weight"), &[h, inter])?;
            let down = Linear::new(Arc::new(d), h, inter, quantize, threads, &format!("{p}.mlp.down_proj"))?;
            layers.push(Layer {
                attn_norm: ld.load(&format!("{p}.input_layernorm.weight"), &[h])?,
                mlp_norm: ld.load(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                qkv,
                o,
                gate_up,
                down,
            });
        }
        let norm = ld.load("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings {
            // transformers ties lm_head to embed_tokens (an lm_head.weight in the file is ignored)
            Linear::new(embed.clone(), vocab, h, quantize, threads, "lm_head (tied to model.embed_tokens)")?
        } else {
            let w = ld.load("lm_head.weight", &[vocab, h])?;
            Linear::new(Arc::new(w), vocab, h, quantize, threads, "lm_head")?
        };
        let (cos, sin) = rope_tables(&cfg);
        let model = Model { cfg, quantize, par: Par::new(threads)?, embed, layers, norm, lm_head, cos, sin };
        if quantize == Quantize::Q8_0 {
            // Warm up: candle repacks q8_0 weights for its VNNI kernels on first use.
            let mut cache = KvCache::new(&model.cfg);
            model.forward(&mut cache, &[0], false)?;
            let n = model.cfg.max_position_embeddings.min(4);
            if n > 1 {
                cache.reset();
                model.forward(&mut cache, &vec![0; n], false)?;
            }
        }
        Ok(model)
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
        self.par.install(|| self.forward_impl(cache, ids, all_logits))
    }

    fn forward_impl(&self, cache: &mut KvCache, ids: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let m = ids.len();
        let pos0 = cache.len;
        if m == 0 {
            return Err(Error::arg("token ids: expected at least one id, got an empty list"));
        }
        if pos0 + m > c.max_position_embeddings {
            return Err(Error::arg(format!(
                "sequence too long: {pos0} cached + {m} new = {} tokens exceeds the context \
                 length {}",
                pos0 + m,
                c.max_position_embeddings
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= c.vocab_size) {
            return Err(Error::arg(format!(
                "token id {bad} is out of range: expected 0 <= id < vocab_size = {}",
                c.vocab_size
            )));
        }
        if cache.k.len() != c.num_hidden_layers || cache.kv_dim != c.num_key_value_heads * c.head_dim {
            return Err(Error::arg("this sequence belongs to a different model"));
        }
        cache.prepare(pos0 + m);

        let (h, hd, nh, nkv, inter) =
            (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size);
        let q_dim = nh * hd;
        let kv_dim = nkv * hd;
        let qkv_dim = q_dim + 2 * kv_dim;
        let half = hd / 2;
        let eps = c.rms_norm_eps as f32;
        let par = &self.par;

        let mut x = vec![0f32; m * h];
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            x[i * h..(i + 1) * h].copy_from_slice(&self.embed[id * h..(id + 1) * h]);
        }
        let mut hbuf = vec![0f32; m * h];
        let mut qkv = vec![0f32; m * qkv_dim];
        let mut attn = vec![0f32; m * q_dim];
        let mut gu = vec![0f32; m * 2 * inter];
        let mut act = vec![0f32; m * inter];
        let scale = (hd as f64).powf(-0.5) as f32;

        for (li, layer) in self.layers.iter().enumerate() {
            for i in 0..m {
                kernels::rms_norm(&x[i * h..(i + 1) * h], &layer.attn_norm, eps, &mut hbuf[i * h..(i + 1) * h]);
            }
            layer.qkv.forward(par, &hbuf, m, &mut qkv)?;
            // RoPE on q and k, then append k and v to the cache.
            for i in 0..m {
                let p = pos0 + i;
                let (cs, sn) = (&self.cos[p * half..(p + 1) * half], &self.sin[p * half..(p + 1) * half]);
                let row = &mut qkv[i * qkv_dim..(i + 1) * qkv_dim];
                for head in 0..nh + nkv {
                    kernels::rope_half(&mut row[head * hd..(head + 1) * hd], cs, sn);
                }
                cache.k[li].extend_from_slice(&row[q_dim..q_dim + kv_dim]);
                cache.v[li].extend_from_slice(&row[q_dim + kv_dim..]);
            }
            self.attention(&qkv, m, pos0, &cache.k[li], &cache.v[li], &mut attn, scale);
            layer.o.forward(par, &attn, m, &mut hbuf)?;
            for (xv, o) in x.iter_mut().zip(&hbuf) {
                *xv += *o;
            }
            for i in 0..m {
                kernels::rms_norm(&x[i * h..(i + 1) * h], &layer.mlp_norm, eps, &mut hbuf[i * h..(i + 1) * h]);
            }
            layer.gate_up.forward(par, &hbuf, m, &mut gu)?;
            for i in 0..m {
                let row = &gu[i * 2 * inter..(i + 1) * 2 * inter];
                kernels::silu_mul(&row[..inter], &row[inter..], &mut act[i * inter..(i + 1) * inter]);
            }
            layer.down.forward(par, &act, m, &mut hbuf)?;
            for (xv, o) in x.iter_mut().zip(&hbuf) {
                *xv += *o;
            }
        }

        let first = if all_logits { 0 } else { m - 1 };
        let rows = m - first;
        for i in first..m {
            kernels::rms_norm(&x[i * h..(i + 1) * h], &self.norm, eps, &mut hbuf[(i - first) * h..(i - first + 1) * h]);
        }
        let mut logits = vec![0f32; rows * self.cfg.vocab_size];
        self.lm_head.forward(par, &hbuf[..rows * h], rows, &mut logits)?;
        cache.len = pos0 + m;
        Ok(logits)
    }

    /// Causal attention of the m new queries (at positions pos0..pos0+m) over the cache.
    #[allow(clippy::too_many_arguments)]
    fn attention(&self, qkv: &[f32], m: usize, pos0: usize, kc: &[f32], vc: &[f32], out: &mut [f32], scale: f32) {
        let c = &self.cfg;
        let (hd, nh, nkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        let q_dim = nh * hd;
        let qkv_dim = q_dim + 2 * nkv * hd;
        let kv_dim = nkv * hd;
        let group = nh / nkv;
        let op = SyncPtr(out.as_mut_ptr());
        let unit = |u: usize, scores: &mut Vec<f32>| {
            let (i, head) = (u / nh, u % nh);
            let kvh = head / group; // GQA: q head h reads kv head h / group
            let q = &qkv[i * qkv_dim + head * hd..i * qkv_dim + (head + 1) * hd];
            let t_len = pos0 + i + 1;
            scores.clear();
            for t in 0..t_len {
                let k = &kc[t * kv_dim + kvh * hd..t * kv_dim + (kvh + 1) * hd];
                scores.push(kernels::dot(q, k) * scale);
            }
            kernels::softmax_inplace(scores);
            let op = op;
            // SAFETY: each (i, head) unit writes its own hd-long slice of `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(op.0.add(i * q_dim + head * hd), hd) };
            o.fill(0.0);
            for (t, &p) in scores.iter().enumerate() {
                let v = &vc[t * kv_dim + kvh * hd..t * kv_dim + (kvh + 1) * hd];
                for (ov, &vv) in o.iter_mut().zip(v) {
                    *ov += p * vv;
                }
            }
        };
        let n_units = m * nh;
        let work = n_units * (pos0 + m) * hd;
        if self.par.threads > 1 && work > 1 << 16 {
            self.par.run(n_units, |range| {
                let mut scores = Vec::with_capacity(pos0 + m);
                for u in range {
                    unit(u, &mut scores);
                }
            });
        } else {
            let mut scores = Vec::with_capacity(pos0 + m);
            for u in 0..n_units {
                unit(u, &mut scores);
            }
        }
    }
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
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::generate::{generate_all, Generator};
    use crate::sampling::SamplingParams;
    use std::path::PathBuf;

    /// A random tiny Llama bundle written with the safetensors crate (no Python needed).
    struct Fixture {
        dir: PathBuf,
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

    fn tensors(kv: usize, skip: Option<&str>, reshape: Option<&str>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let (h, nh, hd, inter, vocab, layers) = (64usize, 4usize, 16usize, 128usize, 96usize, 2usize);
        let mut seed = 42u64;
        let mut out = vec![];
        let mut add = |name: String, shape: Vec<usize>, norm: bool| {
            let n: usize = shape.iter().product();
            let data = (0..n).map(|_| if norm { 1.0 + lcg(&mut seed) } else { lcg(&mut seed) }).collect();
            out.push((name, shape, data));
        };
        add("model.embed_tokens.weight".into(), vec![vocab, h], false);
        add("model.norm.weight".into(), vec![h], true);
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            add(format!("{p}.self_attn.q_proj.weight"), vec![nh * hd, h], false);
            add(format!("{p}.self_attn.k_proj.weight"), vec![kv * hd, h], false);
            add(format!("{p}.self_attn.v_proj.weight"), vec![kv * hd, h], false);
            add(format!("{p}.self_attn.o_proj.weight"), vec![h, nh * hd], false);
            add(format!("{p}.mlp.gate_proj.weight"), vec![inter, h], false);
            add(format!("{p}.mlp.up_proj.weight"), vec![inter, h], false);
            add(format!("{p}.mlp.down_proj.weight"), vec![h, inter], false);
            add(format!("{p}.input_layernorm.weight"), vec![h], true);
            add(format!("{p}.post_attention_layernorm.weight"), vec![h], true);
        }
        out.retain(|(n, _, _)| Some(n.as_str()) != skip);
        for t in out.iter_mut() {
            if Some(t.0.as_str()) == reshape {
                t.1 = vec![t.1.iter().product::<usize>() / 2, 2];
            }
        }
        out
    }

    fn fixture(name: &str, kv: usize, skip: Option<&str>, reshape: Option<&str>) -> Fixture {
        let dir = std::env::temp_dir().join(format!("rust_runtime_test_{}_{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": kv, "intermediate_size": 128, "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5, "vocab_size": 96, "tie_word_embeddings": true, "rope_theta": 50000.0,
            "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}
        });
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let ts = tensors(kv, skip, reshape);
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
            // the cache holds n_kv heads per token, not n_heads
            assert_eq!(c.k[0].len(), 12 * kv * 16);
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

    #[test]
    fn q8_is_close_to_f32() {
        let fx = fixture("q8", 2, None, None);
        let f = Model::load(&fx.dir, Quantize::None, 1).unwrap();
        let ids: Vec<u32> = (0..16).map(|i| (i * 5 + 1) % 96).collect();
        let a = f.forward(&mut f.new_cache(), &ids, true).unwrap();
        for threads in [1, 2] {
            let q = Model::load(&fx.dir, Quantize::Q8_0, threads).unwrap();
            let b = q.forward(&mut q.new_cache(), &ids, true).unwrap();
            let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
            let den: f32 = a.iter().map(|x| x * x).sum();
            assert!((num / den).sqrt() < 0.1, "relative error {}", (num / den).sqrt());
        }
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
        assert_eq!(Quantize::parse(Some("int8")).unwrap(), Quantize::Q8_0);
        assert_eq!(Quantize::parse(None).unwrap(), Quantize::None);
    }
}
