//! Shalik's CPU runtime: reads a Shalik bundle (Hugging Face Llama safetensors + config.json +
//! tokenizer.json) and generates with no Python in the token loop. The Rust API (`model`,
//! `sampling`, `generate`, `tokenizer`) is usable on its own; the Python module `rust_runtime`
//! (feature `python`, turned on by maturin) wraps it.

pub mod config;
pub mod error;
pub mod generate;
pub mod kernels;
pub mod model;
pub mod sampling;
pub mod tokenizer;

#[cfg(feature = "python")]
mod python;

pub use config::Config;
pub use error::{Error, Result};
pub use model::{KvCache, Model, Quantize};
