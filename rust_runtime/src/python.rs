//! The Python module `rust_runtime` (pyo3 0.30, abi3 ≥ 3.10).
//!
//! Every entry point releases the GIL while computing (`py.detach`) and runs inside
//! `catch_panic`, so a bug surfaces as `RuntimeError`, never as pyo3's `PanicException`
//! (a BaseException). Errors map to: bad argument → ValueError; missing / unreadable file →
//! OSError (FileNotFoundError when missing); malformed bundle, numerical failure → RuntimeError.

use crate::error::{catch_panic, Error, Result};
use crate::generate::{generate_all, Generator};
use crate::model::{KvCache, Model, Quantize};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tok;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::InvalidArgument(_) => PyValueError::new_err(msg),
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                PyFileNotFoundError::new_err(msg)
            }
            Error::Io { .. } => PyOSError::new_err(msg),
            _ => PyRuntimeError::new_err(msg),
        }
    }
}

/// Default compute threads: RAYON_NUM_THREADS if set, else the number of physical cores.
fn default_threads() -> usize {
    candle_core::utils::get_num_threads().max(1)
}

struct Inner {
    model: Model,
    tok: Tok,
    eot: Option<u32>,
    dir: PathBuf,
}

fn detach<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T> + Send) -> PyResult<T> {
    py.detach(|| catch_panic(f)).map_err(PyErr::from)
}

fn logits_array<'py>(py: Python<'py>, v: Vec<f32>, rows: usize, vocab: usize) -> PyResult<Bound<'py, PyArray2<f32>>> {
    v.into_pyarray(py).reshape([rows, vocab])
}

/// A loaded bundle: weights, tokenizer and generation.
#[pyclass(module = "rust_runtime", name = "Model", frozen)]
pub struct PyModel {
    inner: Arc<Inner>,
}

#[pymethods]
impl PyModel {
    /// Load a bundle directory (model.safetensors, config.json, tokenizer.json).
    /// quantize: None / "none" (f32) or "int8" (q8_0 for every linear incl. lm_head).
    /// threads: compute threads (default: the process-wide pool size, see README).
    #[staticmethod]
    #[pyo3(signature = (path, threads=None, quantize=None))]
    fn load(py: Python<'_>, path: PathBuf, threads: Option<i64>, quantize: Option<&str>) -> PyResult<Self> {
        let q = Quantize::parse(quantize)?;
        let req = match threads {
            None => None,
            Some(t) if t >= 1 && t <= 1024 => Some(t as usize),
            Some(t) => return Err(PyValueError::new_err(format!("threads is {t}; expected an integer >= 1"))),
        };
        let n = req.unwrap_or_else(default_threads);
        let inner = detach(py, move || {
            let dir: &Path = &path;
            let tok_path = dir.join("tokenizer.json");
            if !dir.is_dir() {
                return Err(Error::io(
                    dir,
                    "expected a bundle directory (model.safetensors, config.json, tokenizer.json)",
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                ));
            }
            let tok = Tok::from_file(&tok_path)?;
            let model = Model::load(dir, q, n)?;
            let eot = tok.token_to_id("<|endoftext|>").or(model.cfg.eos_token_id);
            Ok(Inner { model, tok, eot, dir: path.clone() })
        })?;
        Ok(PyModel { inner: Arc::new(inner) })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.model.cfg.vocab_size
    }
    #[getter]
    fn max_position_embeddings(&self) -> usize {
        self.inner.model.cfg.max_position_embeddings
    }
    #[getter]
    fn num_hidden_layers(&self) -> usize {
        self.inner.model.cfg.num_hidden_layers
    }
    #[getter]
    fn hidden_size(&self) -> usize {
        self.inner.model.cfg.hidden_size
    }
    #[getter]
    fn num_attention_heads(&self) -> usize {
        self.inner.model.cfg.num_attention_heads
    }
    #[getter]
    fn num_key_value_heads(&self) -> usize {
        self.inner.model.cfg.num_key_value_heads
    }
    #[getter]
    fn rope_theta(&self) -> f64 {
        self.inner.model.cfg.rope_theta
    }
    /// "none" or "int8".
    #[getter]
    fn quantize(&self) -> &'static str {
        self.inner.model.quantize.name()
    }
    /// The id of `<|endoftext|>` (generation stops there), or None.
    #[getter]
    fn eot_id(&self) -> Option<u32> {
        self.inner.eot
    }
    /// Threads this model computes with (each model with threads > 1 owns a pool of that size).
    #[getter]
    fn threads(&self) -> usize {
        self.inner.model.par.threads
    }
    #[getter]
    fn path(&self) -> String {
        self.inner.dir.display().to_string()
    }

    fn __repr__(&self) -> String {
        let c = &self.inner.model.cfg;
        format!(
            "rust_runtime.Model({:?}, layers={}, hidden={}, heads={}/{}, vocab={}, context={}, quantize={:?}, threads={})",
            self.inner.dir.display().to_string(),
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.vocab_size,
            c.max_position_embeddings,
            self.inner.model.quantize.name(),
            self.inner.model.par.threads
        )
    }

    /// Stateless full forward: float32 logits [len(ids), vocab] for every position.
    fn logits<'py>(&self, py: Python<'py>, ids: Vec<i64>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let inner = self.inner.clone();
        let n = ids.len();
        let v = detach(py, move || {
            let ids = inner.model.check_ids(&ids, 0)?;
            let mut cache = inner.model.new_cache();
            inner.model.forward(&mut cache, &ids, true)
        })?;
        logits_array(py, v, n, self.inner.model.cfg.vocab_size)
    }

    /// An empty KV cache (position 0) for step-by-step use (serve.backends' Sequence).
    fn new_sequence(&self) -> PySequence {
        PySequence { inner: self.inner.clone(), cache: self.inner.model.new_cache() }
    }

    /// Token ids of `text` (the bundle's tokenizer.json, no special tokens added).
    fn tokenize(&self, py: Python<'_>, text: String) -> PyResult<Vec<u32>> {
        let inner = self.inner.clone();
        detach(py, move || inner.tok.encode(&text))
    }

    /// Text of `ids` (special tokens kept unless skip_special_tokens).
    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn decode(&self, py: Python<'_>, ids: Vec<i64>, skip_special_tokens: bool) -> PyResult<String> {
        let inner = self.inner.clone();
        detach(py, move || inner.tok.decode(&ids, skip_special_tokens))
    }

    /// Generate up to max_new_tokens after `ids`; returns [(token id, log-prob under the model's
    /// unmodified distribution)]. Stops at <|endoftext|> (not included), any stop id, or
    /// max_new_tokens. prompt + max_new_tokens must fit in max_position_embeddings.
    #[pyo3(signature = (ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, seed=None, stop_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        ids: Vec<i64>,
        max_new_tokens: i64,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
        seed: Option<i64>,
        stop_ids: Option<Vec<i64>>,
    ) -> PyResult<Vec<(u32, f32)>> {
        let params =
            SamplingParams::new(temperature, top_k, top_p, presence_penalty, frequency_penalty, repetition_penalty)?;
        let inner = self.inner.clone();
        let stops = stop_ids.unwrap_or_default();
        detach(py, move || {
            let mut g =
                Generator::new(&inner.model, &ids, max_new_tokens, params, seed.map(|s| s as u64), &stops, inner.eot)?;
            generate_all(&inner.model, &mut g)
        })
    }

    /// Like generate, but an iterator yielding (token id, log-prob) one token at a time.
    #[pyo3(signature = (ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, seed=None, stop_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        ids: Vec<i64>,
        max_new_tokens: i64,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
        seed: Option<i64>,
        stop_ids: Option<Vec<i64>>,
    ) -> PyResult<PyTokenStream> {
        let params =
            SamplingParams::new(temperature, top_k, top_p, presence_penalty, frequency_penalty, repetition_penalty)?;
        let stops = stop_ids.unwrap_or_default();
        let g = catch_panic(|| {
            Generator::new(
                &self.inner.model,
                &ids,
                max_new_tokens,
                params,
                seed.map(|s| s as u64),
                &stops,
                self.inner.eot,
            )
        })?;
        Ok(PyTokenStream { inner: self.inner.clone(), gen: g })
    }
}

/// One sequence's KV cache (lives in Rust). Matches serve.backends.base.Sequence.
#[pyclass(module = "rust_runtime", name = "Sequence")]
pub struct PySequence {
    inner: Arc<Inner>,
    cache: KvCache,
}

#[pymethods]
impl PySequence {
    /// Append ids; float32 logits [len(ids), vocab] (all_logits) or [vocab] (the last).
    #[pyo3(signature = (ids, all_logits=false))]
    fn prefill<'py>(&mut self, py: Python<'py>, ids: Vec<i64>, all_logits: bool) -> PyResult<Bound<'py, PyAny>> {
        let n = ids.len();
        let inner = self.inner.clone();
        let cache = &mut self.cache;
        let v = detach(py, move || {
            let ids = inner.model.check_ids(&ids, cache.len())?;
            inner.model.forward(cache, &ids, all_logits)
        })?;
        let vocab = self.inner.model.cfg.vocab_size;
        if all_logits {
            Ok(logits_array(py, v, n, vocab)?.into_any())
        } else {
            Ok(v.into_pyarray(py).into_any())
        }
    }

    /// Append one token; float32 logits [vocab] for the next position.
    fn decode<'py>(&mut self, py: Python<'py>, token_id: i64) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner.clone();
        let cache = &mut self.cache;
        let v = detach(py, move || {
            let ids = inner.model.check_ids(&[token_id], cache.len())?;
            inner.model.forward(cache, &ids, false)
        })?;
        Ok(v.into_pyarray(py).into_any())
    }

    /// How many tokens the cache holds.
    #[getter]
    fn position(&self) -> usize {
        self.cache.len()
    }

    /// Empty the cache (position 0), keeping its memory.
    fn reset(&mut self) {
        self.cache.reset();
    }

    fn __repr__(&self) -> String {
        format!("rust_runtime.Sequence(position={})", self.cache.len())
    }
}

/// Iterator returned by Model.stream: yields (token id, log-prob).
#[pyclass(module = "rust_runtime", name = "TokenStream")]
pub struct PyTokenStream {
    inner: Arc<Inner>,
    gen: Generator,
}

#[pymethods]
impl PyTokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(mut slf: PyRefMut<'_, Self>, py: Python<'_>) -> PyResult<Option<(u32, f32)>> {
        let this = &mut *slf;
        let inner = this.inner.clone();
        let gen = &mut this.gen;
        detach(py, move || gen.next_token(&inner.model))
    }
}

/// A tokenizer.json on its own (same code path as Model.tokenize / Model.decode).
#[pyclass(module = "rust_runtime", name = "Tokenizer", frozen)]
pub struct PyTokenizer {
    tok: Arc<Tok>,
}

#[pymethods]
impl PyTokenizer {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let tok = detach(py, move || Tok::from_file(&path))?;
        Ok(PyTokenizer { tok: Arc::new(tok) })
    }
    fn encode(&self, py: Python<'_>, text: String) -> PyResult<Vec<u32>> {
        let tok = self.tok.clone();
        detach(py, move || tok.encode(&text))
    }
    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn decode(&self, py: Python<'_>, ids: Vec<i64>, skip_special_tokens: bool) -> PyResult<String> {
        let tok = self.tok.clone();
        detach(py, move || tok.decode(&ids, skip_special_tokens))
    }
    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }
    #[getter]
    fn vocab_size(&self) -> usize {
        self.tok.vocab_size()
    }
}

#[pymodule]
fn rust_runtime(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Our parallelism is per model (rayon pools, see kernels::Par). candle's own spin-barrier
    // pool, used inside its q8_0 kernels, must stay at one thread: its pool is sized once per
    // process, and its spinning waits collapse on a loaded 2-core machine. Set before any
    // candle op; a value the user exported is kept.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    m.add_class::<PyModel>()?;
    m.add_class::<PySequence>()?;
    m.add_class::<PyTokenStream>()?;
    m.add_class::<PyTokenizer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("simd_level", format!("{:?}", crate::kernels::simd_level()))?;
    Ok(())
}
