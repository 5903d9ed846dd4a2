//! One error type for the whole crate. Every variant names the thing that failed and what was
//! expected; the Python layer maps `InvalidArgument` to `ValueError`, `Io` to `OSError` (with
//! `FileNotFoundError` for missing files) and everything else to `RuntimeError`.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bad argument from the caller: id out of range, empty prompt, NaN temperature,
    /// position past the context, ... (Python: ValueError)
    #[error("{0}")]
    InvalidArgument(String),

    /// A file that is missing or unreadable. (Python: OSError / FileNotFoundError)
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// A bundle whose content does not match the contract: missing or mis-shaped tensor,
    /// unsupported dtype, bad config.json, unreadable tokenizer.json. (Python: RuntimeError)
    #[error("{0}")]
    Format(String),

    /// The model produced something unusable (NaN logits, ...). (Python: RuntimeError)
    #[error("{0}")]
    Numerical(String),

    /// An error from candle with some context. (Python: RuntimeError)
    #[error("{context}: {source}")]
    Candle {
        context: String,
        #[source]
        source: candle_core::Error,
    },

    /// A bug: a panic caught inside the crate. (Python: RuntimeError)
    #[error("internal error in rust_runtime (please report): {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn arg(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
    pub fn format(msg: impl Into<String>) -> Self {
        Error::Format(msg.into())
    }
    pub fn io(path: &Path, what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { path: path.to_path_buf(), what: what.into(), source }
    }
}

/// Attach context to candle results: `x.ctx("loading model.norm.weight")?`.
pub trait CandleContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> CandleContext<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Candle { context: context(), source })
    }
}

/// Run `f`, turning a panic (a bug: every input-dependent failure is an `Error`) into
/// `Error::Internal`, so that nothing ever unwinds into Python.
pub fn catch_panic<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "unknown panic payload".to_string()
            };
            Err(Error::Internal(msg))
        }
    }
}
