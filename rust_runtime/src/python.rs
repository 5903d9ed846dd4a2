//! The Python module `rust_runtime` (pyo3 0.30, abi3 ≥ 3.10).
//!
//! Every entry point releases the GIL while computing (`py.detach`) and runs inside
//! `catch_panic`, so a bug surfaces as `RuntimeError`, never as pyo3's `PanicException`
//! (a BaseException). Errors map to: bad argument → ValueError; missing / unreadable file →
//! OSError (FileNotFoundError when missing); malformed bundle, numerical failure → RuntimeError.

use crate::cache::KvCache;
use crate::engine::{Engine, Event, Finish, Request};
use crate::error::{catch_panic, Error, Result};
use crate::generate::{generate_all, Generator};
use crate::model::{Model, Quantize};
use crate::sampling::SamplingParams;
use crate::tokenizer::Tok;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
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

/// A list of integer ids from Python; the error names the argument (`name`) and the bad item:
/// ValueError for an integer outside i64 (pyo3's bare OverflowError said neither), TypeError else.
fn id_list(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected a list of integer token ids, got {}",
            obj.get_type().name()?
        )));
    }
    let iter = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name}: expected a list of integer token ids, got {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    let mut out = Vec::new();
    for item in iter {
        out.push(int_arg(&item?, name)?);
    }
    Ok(out)
}

/// One Python integer as i64; the error names the argument.
fn int_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    match obj.extract::<i64>() {
        Ok(v) if !obj.is_instance_of::<pyo3::types::PyBool>() => Ok(v),
        Ok(_) => Err(PyTypeError::new_err(format!("{name}: expected an integer, got a bool"))),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(PyValueError::new_err(format!(
            "{name}: {} is out of range (expected a 64-bit integer; token ids lie in [0, vocab_size))",
            obj.str().map(|s| s.to_string()).unwrap_or_default()
        ))),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name}: expected an integer, got {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))),
    }
}

/// A seed: any integer in [-2**63, 2**64) (negative ones are taken modulo 2**64), or None.
fn seed_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(None);
    }
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(Some(v));
    }
    match obj.extract::<i64>() {
        Ok(v) => Ok(Some(v as u64)),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(PyValueError::new_err(format!(
            "seed is {}; expected an integer in [-2**63, 2**64) or None",
            obj.str().map(|s| s.to_string()).unwrap_or_default()
        ))),
        Err(_) => Err(PyTypeError::new_err(format!(
            "seed: expected an integer or None, got {}",
            obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))),
    }
}

/// Default compute threads: RAYON_NUM_THREADS if set, else the number of physical cores.
fn default_threads() -> usize {
    candle_core::utils::get_num_threads().max(1)
}

struct Inner {
    model: Arc<Model>,
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
    /// verify: check config.json, model.safetensors and tokenizer.json against the sha256 sums
    /// of the bundle's manifest.json (skipped when the bundle has no manifest.json).
    #[staticmethod]
    #[pyo3(signature = (path, threads=None, quantize=None, verify=true))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        threads: Option<i64>,
        quantize: Option<&str>,
        verify: bool,
    ) -> PyResult<Self> {
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
            if verify {
                crate::integrity::verify_bundle(dir)?;
            }
            let tok = Tok::from_file(&tok_path)?;
            let model = Model::load(dir, q, n)?;
            let eot = tok.token_to_id("<|endoftext|>").or(model.cfg.eos_token_id);
            Ok(Inner { model: Arc::new(model), tok, eot, dir: path.clone() })
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
    fn logits<'py>(&self, py: Python<'py>, ids: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids = id_list(ids, "ids")?;
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
    fn decode(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = id_list(ids, "ids")?;
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
        ids: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
        seed: Option<&Bound<'_, PyAny>>,
        stop_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(u32, f32)>> {
        let params =
            SamplingParams::new(temperature, top_k, top_p, presence_penalty, frequency_penalty, repetition_penalty)?;
        let inner = self.inner.clone();
        let ids = id_list(ids, "ids")?;
        let seed = seed_arg(seed)?;
        let stops = match stop_ids {
            Some(s) if !s.is_none() => id_list(s, "stop_ids")?,
            _ => vec![],
        };
        detach(py, move || {
            let mut g = Generator::new(&inner.model, &ids, max_new_tokens, params, seed, &stops, inner.eot)?;
            generate_all(&inner.model, &mut g)
        })
    }

    /// Like generate, but an iterator yielding (token id, log-prob) one token at a time.
    #[pyo3(signature = (ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, seed=None, stop_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        ids: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
        seed: Option<&Bound<'_, PyAny>>,
        stop_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyTokenStream> {
        let params =
            SamplingParams::new(temperature, top_k, top_p, presence_penalty, frequency_penalty, repetition_penalty)?;
        let ids = id_list(ids, "ids")?;
        let seed = seed_arg(seed)?;
        let stops = match stop_ids {
            Some(s) if !s.is_none() => id_list(s, "stop_ids")?,
            _ => vec![],
        };
        let g = catch_panic(|| {
            Generator::new(&self.inner.model, &ids, max_new_tokens, params, seed, &stops, self.inner.eot)
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
    fn prefill<'py>(
        &mut self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        all_logits: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = id_list(ids, "ids")?;
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
    fn decode<'py>(&mut self, py: Python<'py>, token_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let token_id = int_arg(token_id, "token_id")?;
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
    fn decode(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = id_list(ids, "ids")?;
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

/// The continuous-batching engine (see the crate's `engine` module): one scheduler thread,
/// outside the GIL, steps every running sequence together.
#[pyclass(module = "rust_runtime", name = "Engine", frozen)]
pub struct PyEngine {
    engine: Arc<Engine>,
}

#[pymethods]
impl PyEngine {
    /// Start an engine on a loaded model (its weights are shared, not copied).
    /// max_batch: sequences stepped together; token_budget: tokens per step (decode tokens plus
    /// chunks of pending prompts); prefill_chunk: at most this many prompt tokens in a step that
    /// also carries decoding sequences, so that a long prompt is spread over several steps
    /// instead of stalling the streams already decoding (a step with nothing decoding prefills
    /// up to token_budget). Each must be an integer >= 1 (ValueError otherwise).
    #[new]
    #[pyo3(signature = (model, max_batch=16, token_budget=256, prefill_chunk=crate::engine::DEFAULT_PREFILL_CHUNK as i64))]
    fn new(model: &PyModel, max_batch: i64, token_budget: i64, prefill_chunk: i64) -> PyResult<Self> {
        if !(1..=4096).contains(&max_batch) {
            return Err(PyValueError::new_err(format!("max_batch is {max_batch}; expected 1 <= max_batch <= 4096")));
        }
        if !(1..=1 << 20).contains(&token_budget) {
            return Err(PyValueError::new_err(format!("token_budget is {token_budget}; expected an integer >= 1")));
        }
        if !(1..=1 << 20).contains(&prefill_chunk) {
            return Err(PyValueError::new_err(format!("prefill_chunk is {prefill_chunk}; expected an integer >= 1")));
        }
        let inner = &model.inner;
        let engine = Engine::start(
            inner.model.clone(),
            inner.eot,
            max_batch as usize,
            token_budget as usize,
            prefill_chunk as usize,
        )?;
        Ok(PyEngine { engine: Arc::new(engine) })
    }

    /// Queue a request; returns an iterator of its events. Arguments as Model.generate, plus
    /// n (choices, one prefill), top_logprobs (alternatives reported per token) and timeout
    /// (seconds from now, then the choices end with "timeout").
    #[pyo3(signature = (ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0, seed=None, stop_ids=None, n=1,
                        top_logprobs=0, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        ids: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
        seed: Option<&Bound<'_, PyAny>>,
        stop_ids: Option<&Bound<'_, PyAny>>,
        n: i64,
        top_logprobs: i64,
        timeout: Option<f64>,
    ) -> PyResult<PyRequestStream> {
        let params =
            SamplingParams::new(temperature, top_k, top_p, presence_penalty, frequency_penalty, repetition_penalty)?;
        let ids = id_list(ids, "ids")?;
        let seed = seed_arg(seed)?;
        let stops = match stop_ids {
            Some(s) if !s.is_none() => id_list(s, "stop_ids")?,
            _ => vec![],
        };
        if max_new_tokens < 0 {
            return Err(PyValueError::new_err(format!("max_new_tokens is {max_new_tokens}; expected an integer >= 0")));
        }
        if n < 1 {
            return Err(PyValueError::new_err(format!("n is {n}; expected an integer >= 1")));
        }
        if !(0..=1000).contains(&top_logprobs) {
            return Err(PyValueError::new_err(format!(
                "top_logprobs is {top_logprobs}; expected 0 <= top_logprobs <= 1000"
            )));
        }
        let timeout = match timeout {
            None => None,
            Some(t) if t.is_finite() && t > 0.0 && t < 1e9 => Some(std::time::Duration::from_secs_f64(t)),
            Some(t) => return Err(PyValueError::new_err(format!("timeout is {t}; expected seconds > 0 or None"))),
        };
        let vocab = self.engine.model().cfg.vocab_size as i64;
        let to_u32 = |v: &[i64], what: &str| -> PyResult<Vec<u32>> {
            v.iter()
                .map(|&i| {
                    if (0..vocab).contains(&i) {
                        Ok(i as u32)
                    } else {
                        Err(PyValueError::new_err(format!(
                            "{what}: token id {i} is out of range: expected 0 <= id < vocab_size = {vocab}"
                        )))
                    }
                })
                .collect()
        };
        let req = Request {
            prompt: to_u32(&ids, "ids")?,
            max_new_tokens: max_new_tokens as usize,
            params,
            seed,
            stop_ids: to_u32(&stops, "stop_ids")?,
            n: n as usize,
            top_logprobs: top_logprobs as usize,
            timeout,
        };
        let n = req.n;
        let (id, rx) = self.engine.submit(req)?;
        Ok(PyRequestStream { engine: self.engine.clone(), id, rx: std::sync::Mutex::new(rx), open: n })
    }

    /// Make request `id` leave the batch before the next step.
    fn cancel(&self, id: u64) {
        self.engine.cancel(id);
    }

    /// Counters: steps, running, waiting, last_step_tokens, prefill_tokens, decode_tokens,
    /// queue_wait_s (summed over requests), admitted.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = self.engine.stats();
        let d = pyo3::types::PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("running", s.running)?;
        d.set_item("waiting", s.waiting)?;
        d.set_item("last_step_tokens", s.last_step_tokens)?;
        d.set_item("prefill_tokens", s.prefill_tokens)?;
        d.set_item("decode_tokens", s.decode_tokens)?;
        d.set_item("queue_wait_s", s.queue_wait_s)?;
        d.set_item("admitted", s.admitted)?;
        Ok(d)
    }

    #[getter]
    fn max_batch(&self) -> usize {
        self.engine.max_batch
    }
    #[getter]
    fn token_budget(&self) -> usize {
        self.engine.token_budget
    }
    #[getter]
    fn prefill_chunk(&self) -> usize {
        self.engine.prefill_chunk
    }

    /// Stop the scheduler thread (running requests end with "cancelled").
    fn close(&self, py: Python<'_>) {
        let e = self.engine.clone();
        py.detach(move || e.shutdown());
    }
}

/// The events of one request, from Engine.submit: tuples
/// (index, token_id, logprob, top_logprobs, finish_reason) — a token has finish_reason None;
/// the end of choice `index` has token_id None and finish_reason "stop" / "length" /
/// "cancelled" / "timeout" / "error: …". Iteration ends when every choice has ended.
/// Dropping the stream cancels the request.
#[pyclass(module = "rust_runtime", name = "RequestStream")]
pub struct PyRequestStream {
    engine: Arc<Engine>,
    #[pyo3(get)]
    id: u64,
    rx: std::sync::Mutex<std::sync::mpsc::Receiver<Event>>,
    open: usize,
}

type PyEvent = (usize, Option<u32>, f32, Vec<(u32, f32)>, Option<String>);

#[pymethods]
impl PyRequestStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<PyEvent>> {
        if self.open == 0 {
            return Ok(None);
        }
        loop {
            // wait with the GIL released, waking every 100 ms to let Ctrl-C through
            let rx = &self.rx;
            let got = py.detach(|| match rx.lock() {
                Ok(r) => r.recv_timeout(std::time::Duration::from_millis(100)),
                Err(_) => Err(std::sync::mpsc::RecvTimeoutError::Disconnected),
            });
            match got {
                Ok(Event::Token { index, id, logprob, top }) => return Ok(Some((index, Some(id), logprob, top, None))),
                Ok(Event::Finished { index, reason }) => {
                    self.open = self.open.saturating_sub(1);
                    let name = match &reason {
                        Finish::Error(m) => format!("error: {m}"),
                        r => r.name().to_string(),
                    };
                    return Ok(Some((index, None, f32::NAN, vec![], Some(name))));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    self.open = 0;
                    return Err(PyRuntimeError::new_err("the engine stopped before this request finished"));
                }
            }
        }
    }

    /// Ask the engine to drop this request before its next step.
    fn cancel(&self) {
        self.engine.cancel(self.id);
    }
}

impl Drop for PyRequestStream {
    fn drop(&mut self) {
        if self.open > 0 {
            self.engine.cancel(self.id);
        }
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
    m.add_class::<PyEngine>()?;
    m.add_class::<PyRequestStream>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("simd_level", format!("{:?}", crate::kernels::simd_level()))?;
    Ok(())
}
