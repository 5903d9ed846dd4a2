//! Shalik's CPU runtime: reads a Shalik bundle (Hugging Face Llama safetensors + config.json +
//! tokenizer.json) and generates with no Python in the token loop. The Rust API (`model`,
//! `engine`, `policy`, `sampling`, `generate`, `tokenizer`) is usable on its own; the Python module `rust_runtime`
//! (feature `python`, turned on by maturin) wraps it.

pub mod bundle;
pub mod cache;
pub mod config;
pub mod engine;
pub mod error;
pub mod generate;
pub mod integrity;
pub mod kernels;
pub mod linear;
pub mod loader;
pub mod model;
pub mod policy;
pub mod quant;
pub mod sampling;
pub mod tokenizer;

#[cfg(feature = "python")]
mod python;

pub use cache::KvCache;
pub use config::Config;
pub use engine::Engine;
pub use error::{Error, Result};
pub use model::{BatchItem, Logits, Model, Quantize};
