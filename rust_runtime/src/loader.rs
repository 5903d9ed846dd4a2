//! Reading `model.safetensors`: the one list of tensor names and shapes a Llama bundle holds
//! (Hugging Face names), checked in full before anything is loaded, and widened to f32.

use crate::config::Config;
use crate::error::{CandleContext, Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// What one decoder layer holds, in the order of `layer_tensors`.
pub const LAYER_PARTS: [&str; 9] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
];

/// Name and shape of part `part` (an entry of LAYER_PARTS) of layer `l`.
pub fn layer_tensor(cfg: &Config, l: usize, part: &str) -> (String, Vec<usize>) {
    let (h, hd, nh, nkv, inter) =
        (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size);
    let shape = match part {
        "self_attn.q_proj.weight" => vec![nh * hd, h],
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![nkv * hd, h],
        "self_attn.o_proj.weight" => vec![h, nh * hd],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![inter, h],
        "mlp.down_proj.weight" => vec![h, inter],
        _ => vec![h], // the two norms
    };
    (format!("model.layers.{l}.{part}"), shape)
}

/// Every tensor the bundle must hold: embeddings, final norm, lm_head when untied, and each layer's.
pub fn expected_tensors(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
    let mut out = vec![("model.embed_tokens.weight".into(), vec![vocab, h]), ("model.norm.weight".into(), vec![h])];
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![vocab, h]));
    }
    for l in 0..cfg.num_hidden_layers {
        out.extend(LAYER_PARTS.iter().map(|part| layer_tensor(cfg, l, part)));
    }
    out
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

/// Drop the mapped pages wholly inside `data` from this process (MADV_DONTNEED on a read-only file
/// mapping: they stay in the page cache and would be faulted back in on a later read). Without
/// this, every tensor read stays resident after it is widened and packed, and the peak RSS at
/// load is the file plus the packed weights (2× the steady RSS for an f32 bundle).
fn release_pages(data: &[u8]) {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads a constant of the system.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => 4096,
        };
        let start = (data.as_ptr() as usize).div_ceil(page) * page;
        let end = (data.as_ptr() as usize + data.len()) / page * page;
        if end > start {
            // SAFETY: [start, end) lies inside the read-only mapping that `data` borrows from; no
            // reference into it is used again (each tensor is read once), and a re-read would fault
            // the same bytes back in from the file.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        }
    }
    #[cfg(not(unix))]
    let _ = data;
}

/// A memory-mapped model.safetensors whose tensors were checked against `expected_tensors`.
pub struct Loader {
    st: candle_core::safetensors::MmapedSafetensors,
    shapes: HashMap<String, Vec<usize>>,
    file: String,
}

impl Loader {
    /// Map `path` and check every expected name, shape and dtype (and that there is no bias).
    pub fn open(path: &Path, cfg: &Config) -> Result<Self> {
        std::fs::File::open(path).map_err(|e| Error::io(path, "cannot open the model weights", e))?;
        // SAFETY: the file is memory-mapped read-only; it must not be truncated while loading.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }
            .ctx(|| format!("{}: not a readable safetensors file", path.display()))?;
        let file = path.display().to_string();
        let views: HashMap<String, (safetensors::Dtype, Vec<usize>)> =
            st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec()))).collect();
        if let Some(b) = views.keys().find(|k| k.ends_with(".bias")) {
            return Err(Error::format(format!(
                "{file}: tensor {b} is a bias; this runtime implements Llama without biases"
            )));
        }
        let expected = expected_tensors(cfg);
        for (name, shape) in &expected {
            use safetensors::Dtype;
            match views.get(name) {
                None => {
                    return Err(Error::format(format!("{file}: tensor {name} is missing (expected shape {shape:?})")))
                }
                Some((dt, _)) if !matches!(dt, Dtype::F32 | Dtype::F16 | Dtype::BF16) => {
                    return Err(Error::format(format!(
                        "{file}: tensor {name} has dtype {dt:?}; expected F32, F16 or BF16"
                    )))
                }
                Some((_, s)) if s != shape => {
                    return Err(Error::format(format!("{file}: tensor {name} has shape {s:?}, expected {shape:?}")))
                }
                Some(_) => {}
            }
        }
        Ok(Loader { st, shapes: expected.into_iter().collect(), file })
    }

    /// The f32 values of an expected tensor (row-major).
    pub fn load(&self, name: &str) -> Result<Vec<f32>> {
        if !self.shapes.contains_key(name) {
            return Err(Error::Internal(format!("{name} is not in the tensor list")));
        }
        let view = self.st.get(name).ctx(|| format!("{}: reading tensor {name}", self.file))?;
        let out = tensor_to_f32(&view, name);
        release_pages(view.data());
        out
    }

    /// Layer `l`'s part `part` (an entry of LAYER_PARTS).
    pub fn layer(&self, cfg: &Config, l: usize, part: &str) -> Result<Vec<f32>> {
        self.load(&layer_tensor(cfg, l, part).0)
    }
}
