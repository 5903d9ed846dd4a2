//! Shalik's own CPU kernels, one module per mechanism:
//!
//! * `simd`: the SIMD level of the f32 kernels, detected at run time, and its cap (`SHALIK_RUST_SIMD`);
//! * `par`: `Par`, the per-model thread pool (threads pinned to CPUs), and per-thread scratch;
//! * `gemm`: the packed, batch-invariant f32 matmul and attention's panel product;
//! * `elementwise`: RMSNorm, SiLU, RoPE, softmax, e^x;
//! * `qblocks`: GGML's block formats (q8_0, q4_0, q4_K) and their rounding rules;
//! * `int`: the integer matmul on block-quantized weights (portable, AVX2, AVX-512 VNNI, AMX-INT8).
//!
//! The f32 kernels' API is re-exported here (`kernels::Par`, `kernels::rms_norm`, …).

pub mod elementwise;
pub mod gemm;
pub mod int;
pub mod par;
pub mod qblocks;
pub mod simd;

pub use elementwise::{exp_approx, max_and_bad, rms_norm, rope_half, silu_mul, softmax_inplace, sum_exp_shifted};
pub use gemm::{panel_product, PackedF32, Panels, GROUP, PANEL, TILE};
pub(crate) use par::with_scratch;
pub use par::{Par, SyncPtr};
pub use simd::{simd_cap, simd_level, SimdCap, SimdLevel};
