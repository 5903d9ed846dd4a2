//! The bundle's `tokenizer.json` through the `tokenizers` crate (the same file and the same
//! normalizer / pre-tokenizer / BPE as Python's `tokenizers`). No special tokens are added.

use crate::error::{Error, Result};
use std::path::Path;

pub struct Tok {
    inner: tokenizers::Tokenizer,
}

impl Tok {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(path, "cannot read the tokenizer (tokenizer.json)", e))?;
        let inner = tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| {
            Error::format(format!(
                "{}: not a Hugging Face tokenizers file the tokenizers crate 0.23 can read: {e}",
                path.display()
            ))
        })?;
        Ok(Tok { inner })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::format(format!("tokenizer failed to encode the text: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let n = self.vocab_size();
        let mut v = Vec::with_capacity(ids.len());
        for &i in ids {
            if i < 0 || i >= n as i64 {
                return Err(Error::arg(format!(
                    "token id {i} is out of range for the tokenizer: expected 0 <= id < {n}"
                )));
            }
            v.push(i as u32);
        }
        self.inner
            .decode(&v, skip_special_tokens)
            .map_err(|e| Error::format(format!("tokenizer failed to decode the ids: {e}")))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}
