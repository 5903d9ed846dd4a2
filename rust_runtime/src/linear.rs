//! A weight matrix y = x·Wᵀ (W out × in, the nn.Linear layout) in f32 or q8_0.
//!
//! f32 weights are packed once at load (`kernels::PackedF32`) and the same panels serve prefill
//! and decode; each output element is one fixed fma chain, so results do not depend on the batch.
//! q8_0 is candle's `QMatMul`, split by rows into shards that run on our own threads.

use crate::error::{CandleContext, Error, Result};
use crate::kernels::{PackedF32, Par, SyncPtr};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Storage, Tensor};

/// How a weight matrix is stored: f32 (packed panels) or q8_0 (candle's 8-bit blocks, 32 weights a block).
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

pub enum Linear {
    F32(PackedF32),
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
    /// Build from row-major `w` (out × inp); `name` appears in errors.
    pub fn new(w: &[f32], out: usize, inp: usize, q: Quantize, threads: usize, name: &str) -> Result<Self> {
        if w.len() != out * inp {
            return Err(Error::Internal(format!("{name}: {} weights for {out} × {inp}", w.len())));
        }
        match q {
            Quantize::None => Ok(Linear::F32(PackedF32::pack(w, out, inp))),
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
            Linear::F32(p) => p.out,
            Linear::Q8 { out, .. } => *out,
        }
    }

    /// y (m × out) = x (m × in) · Wᵀ.
    pub fn forward(&self, par: &Par, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        match self {
            Linear::F32(p) => {
                if x.len() < m * p.inp || y.len() < m * p.out {
                    return Err(Error::Internal(format!(
                        "linear: shapes x {} y {} for m {m} out {} in {}",
                        x.len(),
                        y.len(),
                        p.out,
                        p.inp
                    )));
                }
                p.matmul(par, x, m, y);
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
