//! A weight matrix y = x·Wᵀ (W out × in, the nn.Linear layout), f32 or block-quantized.
//!
//! f32 weights are packed once at load (`kernels::PackedF32`); quantized ones are packed for the
//! integer kernels (`kernels::int::PackedQ`: q8_0, q4_0 or q4_K), possibly in row ranges of different
//! kinds (the fused q/k/v matrix keeps v at 8 bits under `q4_mix`). Either way each output
//! element is one fixed chain, so results do not depend on the batch.

use crate::error::{Error, Result};
use crate::kernels::int::{BlockKind, PackedQ, QuantRows};
use crate::kernels::{with_scratch, PackedF32, Par};
use std::cell::RefCell;

pub use crate::quant::Quantize;

/// One tensor's rows of a fused matrix, and how to store them (`None`: f32).
pub struct Part {
    /// The tensor's name (for errors).
    pub name: String,
    /// Row-major, rows × in.
    pub w: Vec<f32>,
    pub rows: usize,
    pub kind: Option<BlockKind>,
}

pub enum Linear {
    F32(PackedF32),
    /// Row ranges, each packed in its block kind; `parts[i].0` is the first output row of part i.
    Quant {
        parts: Vec<(usize, PackedQ)>,
        out: usize,
        inp: usize,
    },
}

impl Linear {
    /// Build one matrix from tensors stacked by rows (q, k, v → qkv), each `inp` wide. Adjacent
    /// parts of the same kind are packed together (quantized on `par`'s threads). Errors name the tensor: a length that is not
    /// rows × inp, an f32 part beside a quantized one, an `inp` that a block kind cannot cover
    /// (not a multiple of 32), a NaN or infinite weight.
    pub fn new(parts: Vec<Part>, inp: usize, par: &Par) -> Result<Self> {
        for p in &parts {
            if p.w.len() != p.rows * inp {
                return Err(Error::Internal(format!("{}: {} weights for {} × {inp}", p.name, p.w.len(), p.rows)));
            }
            if let Some(kind) = p.kind {
                if inp % kind.block() != 0 {
                    return Err(Error::format(format!(
                        "{}: shape [{}, {inp}] cannot be stored as {}: its in_features must be a multiple of the \
                         block size {}; load this model with quantize=\"none\"",
                        p.name,
                        p.rows,
                        kind.name(),
                        kind.block()
                    )));
                }
            }
        }
        let out: usize = parts.iter().map(|p| p.rows).sum();
        if parts.iter().all(|p| p.kind.is_none()) {
            let w = concat(parts.into_iter().map(|p| p.w).collect());
            return Ok(Linear::F32(PackedF32::pack(&w, out, inp)));
        }
        if let Some(p) = parts.iter().find(|p| p.kind.is_none()) {
            return Err(Error::Internal(format!("{}: an f32 part in a quantized matrix", p.name)));
        }
        // runs of adjacent parts of one kind
        let mut packed = Vec::new();
        let mut row0 = 0;
        let mut it = parts.into_iter().peekable();
        while let Some(first) = it.next() {
            let kind = first.kind.unwrap_or(BlockKind::Q8_0);
            let mut names = vec![first.name];
            let mut rows = first.rows;
            let mut ws = vec![first.w];
            while let Some(next) = it.next_if(|p| p.kind == Some(kind)) {
                names.push(next.name);
                rows += next.rows;
                ws.push(next.w);
            }
            let w = concat(ws);
            let q = PackedQ::quantize(kind, &w, rows, inp, par)
                .map_err(|e| Error::format(format!("{}: {e}", names.join(" + "))))?;
            packed.push((row0, q));
            row0 += rows;
        }
        Ok(Linear::Quant { parts: packed, out, inp })
    }

    pub fn out_features(&self) -> usize {
        match self {
            Linear::F32(p) => p.out,
            Linear::Quant { out, .. } => *out,
        }
    }

    /// Bytes of weights a matmul reads (scales included).
    pub fn bytes(&self) -> usize {
        match self {
            Linear::F32(p) => p.out * p.inp * 4,
            Linear::Quant { parts, .. } => parts.iter().map(|(_, q)| q.bytes()).sum(),
        }
    }

    /// Row `r` of W (dequantized when quantized) into `dst[..in]`: a tied embedding's lookup.
    pub fn row(&self, r: usize, dst: &mut [f32]) {
        match self {
            Linear::F32(p) => p.row(r, dst),
            Linear::Quant { parts, .. } => {
                if let Some((row0, q)) = parts.iter().rev().find(|(row0, _)| *row0 <= r) {
                    q.row(r - row0, dst);
                }
            }
        }
    }

    /// y (m × out) = x (m × in) · Wᵀ. Quantized: x is quantized per row and 32-block to int8
    /// first (`kernels::int::QuantRows`), once for all parts.
    pub fn forward(&self, par: &Par, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        let (out, inp) = match self {
            Linear::F32(p) => (p.out, p.inp),
            Linear::Quant { out, inp, .. } => (*out, *inp),
        };
        if x.len() < m * inp || y.len() < m * out {
            return Err(Error::Internal(format!(
                "linear: shapes x {} y {} for m {m} out {out} in {inp}",
                x.len(),
                y.len()
            )));
        }
        match self {
            Linear::F32(p) => p.matmul(par, x, m, y),
            Linear::Quant { parts, .. } => {
                thread_local! {
                    /// This thread's quantized activations, kept between matmuls.
                    static XQ: RefCell<QuantRows> = RefCell::new(QuantRows::default());
                }
                with_scratch(&XQ, |xq| {
                    xq.quantize(par, x, m, inp);
                    for (row0, q) in parts {
                        q.matmul(par, xq, &mut y[*row0..], out);
                    }
                });
            }
        }
        Ok(())
    }
}

fn concat(parts: Vec<Vec<f32>>) -> Vec<f32> {
    if parts.len() == 1 {
        return parts.into_iter().next().unwrap_or_default();
    }
    let n = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(n);
    for p in parts {
        out.extend_from_slice(&p);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_width_a_block_cannot_cover_is_refused_naming_the_tensor_and_the_block() {
        let par = Par::new(1).unwrap();
        for (kind, inp, block) in [(BlockKind::Q4K, 64, 256), (BlockKind::Q4_0, 48, 32), (BlockKind::Q8_0, 40, 32)] {
            let part = Part {
                name: "model.layers.0.self_attn.q_proj.weight".into(),
                w: vec![0.5; 8 * inp],
                rows: 8,
                kind: Some(kind),
            };
            let msg = Linear::new(vec![part], inp, &par).err().unwrap().to_string();
            assert!(msg.contains("q_proj.weight") && msg.contains(&format!("[8, {inp}]")), "{msg}");
            assert!(msg.contains(kind.name()) && msg.contains(&format!("block size {block};")), "{msg}");
        }
    }
}
