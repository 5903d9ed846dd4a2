//! The bundle contract, Rust side: the names of the files this runtime reads, the manifest's
//! format and major version, and the end-of-text token. The owner is Python's `contract/bundle.py`
//! (docs/design.md "The bundle"); these constants mirror it, and tests/test_bundle_contract.py
//! checks that they are equal and that no other Rust source spells a bundle file name.

/// Hugging Face LlamaConfig.
pub const CONFIG: &str = "config.json";
/// The weights (Hugging Face Llama names; a tied lm_head is not stored).
pub const WEIGHTS: &str = "model.safetensors";
/// The tokenizer (Hugging Face `tokenizers` JSON).
pub const TOKENIZER: &str = "tokenizer.json";
/// Written last by the exporter: `{format, format_version, files: {name: {sha256, bytes}}, ...}`.
pub const MANIFEST: &str = "manifest.json";
/// The manifest's `format`.
pub const FORMAT: &str = "shalik-bundle";
/// The newest manifest `format_version` (major) this runtime reads; a newer one is refused.
pub const FORMAT_VERSION: u64 = 1;
/// The manifest's minor version (`format_minor`, absent: 0); an older one's names are read as today's
/// (`integrity::upgrade`, as `contract/bundle.py`'s `upgrade`).
pub const FORMAT_MINOR: u64 = 1;
/// The files of a bundle that `Model::load` and the tokenizer read (what `integrity` verifies).
pub const CHECKED_FILES: [&str; 3] = [CONFIG, WEIGHTS, TOKENIZER];
/// How a reader skips the sha256 check, as every message says it: the Python argument, the CLIs' flag,
/// the HTTP server's variable.
pub const SKIP_VERIFY: &str = "verify=False (--no-verify, SHALIK_VERIFY=0)";
/// Every prompt starts with it; generation stops at it.
pub const EOT: &str = "<|endoftext|>";
