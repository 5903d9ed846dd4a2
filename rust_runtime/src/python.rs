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
use crate::policy::{
    Limits, DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, DEFAULT_TOKEN_BUDGET, MAX_BATCH_LIMIT, MAX_TOKEN_BUDGET,
};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::Tok;
use numpy::{IntoPyArray, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// The most compute threads a model may be given: serve.loader.MAX_THREADS (tests/test_rust_runtime.py
/// checks they agree; exposed as `rust_runtime.MAX_THREADS`).
pub const MAX_THREADS: i64 = 1024;

/// An integer argument `name` whose rule is `want` ("expected an integer >= 0"): its value if it
/// lies in `ok`. TypeError naming it for a bool or a non-integer (pyo3's i64 took True as 1),
/// ValueError for an integer outside `ok`, also one past 64 bits (pyo3 said a bare "Python int
/// too large to convert to C long", naming nothing).
fn int_in(o: &Bound<'_, PyAny>, name: &str, ok: std::ops::RangeInclusive<i64>, want: &str) -> PyResult<i64> {
    let shown = || o.repr().map(|r| r.to_string()).unwrap_or_else(|_| "an integer past 64 bits".into());
    let index = o.call_method0("__index__").ok().filter(|_| !o.is_instance_of::<pyo3::types::PyBool>());
    let Some(i) = index else {
        let kind = o.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!("{name} is {} ({kind}); {want}", shown())));
    };
    match i.extract::<i64>() {
        Ok(v) if ok.contains(&v) => Ok(v),
        _ => Err(PyValueError::new_err(format!("{name} is {}; {want}", shown()))),
    }
}

/// An optional integer argument: `default` when it is absent or None, else [`int_in`]'s value in `ok`.
fn opt_int_in(
    o: Option<&Bound<'_, PyAny>>,
    name: &str,
    default: i64,
    ok: std::ops::RangeInclusive<i64>,
    want: &str,
) -> PyResult<i64> {
    match o.filter(|o| !o.is_none()) {
        None => Ok(default),
        Some(o) => int_in(o, name, ok, want),
    }
}

/// One of `Engine(...)`'s sizes: `default` when absent, else an int from 1 to `hi` ([`int_in`]'s errors;
/// [`Limits::new`] holds the same rule).
fn limit_arg(o: Option<&Bound<'_, PyAny>>, name: &str, default: usize, hi: usize) -> PyResult<i64> {
    opt_int_in(o, name, default as i64, 1..=hi as i64, &format!("expected an integer >= 1 (at most {hi})"))
}

/// `Model.load`'s threads: None (all cores) or an int from 1 to [`MAX_THREADS`], as serve.loader.load takes
/// it ([`int_in`]'s errors).
fn threads_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let Some(o) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
    let want = format!("expected an integer from 1 to {MAX_THREADS} or None (all cores)");
    Ok(Some(int_in(o, "threads", 1..=MAX_THREADS, &want)? as usize))
}

/// max_new_tokens of generate, stream and Engine.submit: an int >= 0 ([`int_in`]'s errors).
fn max_new_tokens_arg(o: &Bound<'_, PyAny>) -> PyResult<i64> {
    int_in(o, "max_new_tokens", 0..=i64::MAX, "expected an integer >= 0")
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
    /// quantize: None / "none" (f32), "q8_0" (q8_0 for every linear incl. lm_head), "q4_0" (4 bits everywhere) or
    /// "q4_mix" (4 bits, the embedding / lm_head / v / down at q8_0): `QUANTIZE_PLAN`; weights are quantized at load.
    /// An old name of `QUANTIZE_ALIASES` ("int8") loads the kind it names and logs that it is deprecated
    /// on the `rust_runtime` logger.
    /// threads: compute threads (default: the process-wide pool size, see README).
    /// verify: check config.json, model.safetensors and tokenizer.json against the sha256 sums
    /// of the bundle's manifest.json, refusing a bundle without one (False: skip the hashing and
    /// accept a folder without a manifest; one that is there is still read, so a newer
    /// format_version and the gate's verdicts hold whatever `verify` says).
    /// allow_ungated: load a quantized form that the export's quality gate failed or did not
    /// measure (the manifest's `quantization.forms["rust <scheme>"]`; refused otherwise with a
    /// ValueError naming the form, the figure and the threshold), logging what it overrides on
    /// the `rust_runtime` logger.
    #[staticmethod]
    #[pyo3(signature = (path, threads=None, quantize=None, verify=true, allow_ungated=false))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        threads: Option<&Bound<'_, PyAny>>,
        quantize: Option<&str>,
        verify: bool,
        allow_ungated: bool,
    ) -> PyResult<Self> {
        let (q, note) = Quantize::parse_noted(quantize)?;
        if let Some(note) = note {
            py.import("logging")?.call_method1("getLogger", ("rust_runtime",))?.call_method1("warning", (note,))?;
        }
        let n = threads_arg(threads)?.unwrap_or_else(default_threads);
        let (inner, overridden) = detach(py, move || {
            let dir: &Path = &path;
            let tok_path = dir.join(crate::bundle::TOKENIZER);
            if !dir.is_dir() {
                return Err(Error::io(
                    dir,
                    "expected a bundle directory (model.safetensors, config.json, tokenizer.json)",
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                ));
            }
            let manifest = if verify {
                Some(crate::integrity::verify_bundle(dir)?)
            } else {
                crate::integrity::read_manifest(dir)?
            };
            let overridden = match q {
                Quantize::None => None,
                _ => {
                    crate::integrity::check_form(manifest.as_ref(), dir, &format!("rust {}", q.name()), allow_ungated)?
                }
            };
            let tok = Tok::from_file(&tok_path)?;
            let model = Model::load(dir, q, n)?;
            let eot = tok.token_to_id(crate::bundle::EOT).or(model.cfg.eos_token_id);
            Ok((Inner { model: Arc::new(model), tok, eot, dir: path.clone() }, overridden))
        })?;
        if let Some(msg) = overridden {
            py.import("logging")?.call_method1("getLogger", ("rust_runtime",))?.call_method1("warning", (msg,))?;
        }
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
    /// The kind's name: "none", "q8_0", "q4_0" or "q4_mix" (an old name given at load reads as its new one).
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
    /// max_new_tokens. prompt + max_new_tokens must fit in max_position_embeddings. Sampling:
    /// the keyword arguments of `SamplingArgs`.
    #[pyo3(signature = (ids, max_new_tokens, *, stop_ids=None, **sampling))]
    fn generate(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        stop_ids: Option<&Bound<'_, PyAny>>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Vec<(u32, f32)>> {
        let (ids, stops, s) = self.generation_args(ids, stop_ids, sampling, "generate")?;
        let max_new_tokens = max_new_tokens_arg(max_new_tokens)?;
        let inner = self.inner.clone();
        detach(py, move || {
            let mut g = Generator::new(&inner.model, &ids, max_new_tokens, s.params, s.seed, &stops, inner.eot)?;
            generate_all(&inner.model, &mut g)
        })
    }

    /// Like generate (the same arguments), but an iterator yielding (token id, log-prob) one token
    /// at a time.
    #[pyo3(signature = (ids, max_new_tokens, *, stop_ids=None, **sampling))]
    fn stream(
        &self,
        ids: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        stop_ids: Option<&Bound<'_, PyAny>>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyTokenStream> {
        let (ids, stops, s) = self.generation_args(ids, stop_ids, sampling, "stream")?;
        let max_new_tokens = max_new_tokens_arg(max_new_tokens)?;
        let g = catch_panic(|| {
            Generator::new(&self.inner.model, &ids, max_new_tokens, s.params, s.seed, &stops, self.inner.eot)
        })?;
        Ok(PyTokenStream { inner: self.inner.clone(), gen: g })
    }
}

impl PyModel {
    /// generate's and stream's arguments: the prompt ids, the stop ids and the sampling keywords.
    fn generation_args(
        &self,
        ids: &Bound<'_, PyAny>,
        stop_ids: Option<&Bound<'_, PyAny>>,
        sampling: Option<&Bound<'_, PyDict>>,
        func: &str,
    ) -> PyResult<(Vec<i64>, Vec<i64>, SamplingArgs)> {
        let s = SamplingArgs::parse(sampling, func)?;
        Ok((id_list(ids, "ids")?, opt_id_list(stop_ids, "stop_ids")?, s))
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
    /// up to token_budget). Defaults and limits: `policy` (ValueError naming a bad one).
    /// Each size is an int (TypeError for a bool or another type, ValueError out of range); None is its default.
    #[new]
    #[pyo3(signature = (model, max_batch=None, token_budget=None, prefill_chunk=None))]
    fn new(
        model: &PyModel,
        max_batch: Option<&Bound<'_, PyAny>>,
        token_budget: Option<&Bound<'_, PyAny>>,
        prefill_chunk: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let limits = Limits::new(
            limit_arg(max_batch, "max_batch", DEFAULT_MAX_BATCH, MAX_BATCH_LIMIT)?,
            limit_arg(token_budget, "token_budget", DEFAULT_TOKEN_BUDGET, MAX_TOKEN_BUDGET)?,
            limit_arg(prefill_chunk, "prefill_chunk", DEFAULT_PREFILL_CHUNK, MAX_TOKEN_BUDGET)?,
        )?;
        let inner = &model.inner;
        let engine = Engine::start(inner.model.clone(), inner.eot, limits)?;
        Ok(PyEngine { engine: Arc::new(engine) })
    }

    /// Queue a request; returns an iterator of its events. ids, max_new_tokens, stop_ids and the
    /// sampling keywords as Model.generate, plus n (choices, one prefill), top_logprobs
    /// (alternatives reported per token), timeout (seconds from now, then the choices still
    /// running end with "timeout"), ignore_eos (end-of-text is then an ordinary token; stop_ids
    /// still stop) and first_index (choice i draws from choice_seed(seed, first_index + i)).
    /// n, top_logprobs and first_index are ints (TypeError for a bool or another type; None is the default).
    #[pyo3(signature = (ids, max_new_tokens, *, stop_ids=None, n=None, top_logprobs=None, timeout=None,
                        ignore_eos=false, first_index=None, **sampling))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        ids: &Bound<'_, PyAny>,
        max_new_tokens: &Bound<'_, PyAny>,
        stop_ids: Option<&Bound<'_, PyAny>>,
        n: Option<&Bound<'_, PyAny>>,
        top_logprobs: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        ignore_eos: bool,
        first_index: Option<&Bound<'_, PyAny>>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyRequestStream> {
        let s = SamplingArgs::parse(sampling, "submit")?;
        let ids = id_list(ids, "ids")?;
        let stops = opt_id_list(stop_ids, "stop_ids")?;
        let max_new_tokens = max_new_tokens_arg(max_new_tokens)?;
        let n = opt_int_in(n, "n", 1, 1..=i64::MAX, "expected an integer >= 1")?;
        let first_index =
            opt_int_in(first_index, "first_index", 0, 0..=1 << 32, "expected an integer from 0 to 2**32")?;
        let top_logprobs = opt_int_in(top_logprobs, "top_logprobs", 0, 0..=1000, "expected an integer from 0 to 1000")?;
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
            params: s.params,
            seed: s.seed,
            first_choice: first_index as usize,
            stop_ids: to_u32(&stops, "stop_ids")?,
            n: n as usize,
            top_logprobs: top_logprobs as usize,
            timeout,
            ignore_eos,
        };
        let n = req.n;
        let (id, rx) = self.engine.submit(req)?;
        Ok(PyRequestStream {
            engine: self.engine.clone(),
            id,
            rx: std::sync::Mutex::new(rx),
            open: AtomicUsize::new(n),
        })
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
        self.engine.limits.max_batch
    }
    #[getter]
    fn token_budget(&self) -> usize {
        self.engine.limits.token_budget
    }
    #[getter]
    fn prefill_chunk(&self) -> usize {
        self.engine.limits.prefill_chunk
    }

    /// Stop the scheduler thread (running requests end with "cancelled").
    fn close(&self, py: Python<'_>) {
        let e = self.engine.clone();
        py.detach(move || e.shutdown());
    }
}

/// The events of one request, from Engine.submit: tuples
/// (index, token_id, logprob, top_logprobs, finish_reason) — a token has finish_reason None;
/// the end of choice `index` has finish_reason "stop" / "length" / "cancelled" / "timeout" /
/// "error: …" and token_id None (logprob NaN), except a "stop" at end-of-text or a stop id,
/// which carries that token (not part of the output) with its logprob and top alternatives. Iteration ends when every choice has ended.
/// Dropping the stream cancels the request. Frozen (no mutable borrow): cancel(), cancel_choice()
/// and id work from any thread while another thread blocks in next().
#[pyclass(module = "rust_runtime", name = "RequestStream", frozen)]
pub struct PyRequestStream {
    engine: Arc<Engine>,
    #[pyo3(get)]
    id: u64,
    rx: std::sync::Mutex<std::sync::mpsc::Receiver<Event>>,
    /// choices not yet ended
    open: AtomicUsize,
}

type PyEvent = (usize, Option<u32>, f32, Vec<(u32, f32)>, Option<String>);

#[pymethods]
impl PyRequestStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyEvent>> {
        if self.open.load(Ordering::Acquire) == 0 {
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
                Ok(Event::Stopped { index, id, logprob, top }) => {
                    let _ = self.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| o.checked_sub(1));
                    return Ok(Some((index, Some(id), logprob, top, Some("stop".to_string()))));
                }
                Ok(Event::Finished { index, reason }) => {
                    let _ = self.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |o| o.checked_sub(1));
                    let name = match &reason {
                        Finish::Error(m) => format!("error: {m}"),
                        r => r.name().to_string(),
                    };
                    return Ok(Some((index, None, f32::NAN, vec![], Some(name))));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    self.open.store(0, Ordering::Release);
                    return Err(PyRuntimeError::new_err("the engine stopped before this request finished"));
                }
            }
        }
    }

    /// Ask the engine to drop this request before its next step.
    fn cancel(&self) {
        self.engine.cancel(self.id);
    }

    /// End choice `index` only (e.g. at a stop string); the other choices go on.
    fn cancel_choice(&self, index: usize) {
        self.engine.cancel_choice(self.id, index);
    }
}

impl Drop for PyRequestStream {
    fn drop(&mut self) {
        if *self.open.get_mut() > 0 {
            self.engine.cancel(self.id);
        }
    }
}

// ---- the sampler on its own (the engine's per-sequence sampling, for tests and parity checks)

/// Logits from Python: whatever numpy turns into a 1-D float array, as float32; ValueError naming
/// `logits` otherwise.
fn logits_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    let arr = float32_array(obj, "logits", "a 1-D array of floats [vocab]", 1)?;
    let a: numpy::PyReadonlyArray1<f32> = arr.extract()?;
    Ok(a.as_array().to_vec())
}

/// `obj` as a C-contiguous float32 numpy array of `ndim` dimensions; ValueError "{name}: expected
/// {expected}, got …" for anything else.
fn float32_array<'py>(obj: &Bound<'py, PyAny>, name: &str, expected: &str, ndim: usize) -> PyResult<Bound<'py, PyAny>> {
    let bad = |what: String| PyValueError::new_err(format!("{name}: expected {expected}, {what}"));
    let arr =
        obj.py().import("numpy")?.call_method1("ascontiguousarray", (obj, "float32")).map_err(|e| {
            bad(format!("got {}: {e}", obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()))
        })?;
    let got: usize = arr.getattr("ndim")?.extract()?;
    if got != ndim {
        return Err(bad(format!("got {got} dimensions")));
    }
    Ok(arr)
}

/// The sampling keyword arguments, parsed in one place for Model.generate, Model.stream,
/// Engine.submit and Sampler, with serve.sampling.SamplingParams's names and rules (so that
/// serve.engine passes its SamplingParams as `**asdict(params)`): temperature, top_p,
/// presence_penalty, frequency_penalty, repetition_penalty (real numbers), top_k (an integer; one
/// past i64 is off, as any k >= vocab), seed (any integer, taken modulo 2**64; None = fresh
/// entropy). None or absent = the default (`SamplingParams::default`). A bad value is a
/// ValueError naming the parameter; an unknown keyword a TypeError naming it.
struct SamplingArgs {
    params: SamplingParams,
    seed: Option<u64>,
}

/// The keywords `SamplingArgs` reads (rust_runtime.pyi's `SamplingKwargs`).
const SAMPLING_KWARGS: [&str; 7] =
    ["temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed"];

impl SamplingArgs {
    /// Parse `kwargs` (the `**sampling` of `func`).
    fn parse(kwargs: Option<&Bound<'_, PyDict>>, func: &str) -> PyResult<Self> {
        let mut got: [Option<Bound<'_, PyAny>>; 7] = Default::default();
        for (k, v) in kwargs.into_iter().flat_map(|d| d.iter()) {
            let key: String = k.extract()?;
            let Some(slot) = SAMPLING_KWARGS.iter().position(|&n| n == key) else {
                return Err(PyTypeError::new_err(format!(
                    "{func}() got an unexpected keyword argument '{key}'; the sampling keywords are {}",
                    SAMPLING_KWARGS.join(", ")
                )));
            };
            got[slot] = Some(v).filter(|v| !v.is_none());
        }
        let [temperature, top_k, top_p, presence, frequency, repetition, seed] = got;
        let d = SamplingParams::default();
        let params = SamplingParams::new(
            real_param(temperature, "temperature", d.temperature)?,
            int_param(top_k, "top_k", d.top_k as i64)?,
            real_param(top_p, "top_p", d.top_p)?,
            real_param(presence, "presence_penalty", d.presence_penalty)?,
            real_param(frequency, "frequency_penalty", d.frequency_penalty)?,
            real_param(repetition, "repetition_penalty", d.repetition_penalty)?,
        )?;
        Ok(SamplingArgs { params, seed: seed.map(|s| seed_param(&s)).transpose()? })
    }
}

/// A real-valued sampling parameter (not a bool or a str); None = `default`.
fn real_param(obj: Option<Bound<'_, PyAny>>, name: &str, default: f64) -> PyResult<f64> {
    let Some(o) = obj else { return Ok(default) };
    let bad = || {
        PyValueError::new_err(format!(
            "{name} must be a finite number, got {}",
            o.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    };
    if o.is_instance_of::<pyo3::types::PyBool>() || o.is_instance_of::<pyo3::types::PyString>() {
        return Err(bad());
    }
    o.extract::<f64>().map_err(|_| bad())
}

/// An integer sampling parameter (not a bool, not a float); None = `default`. An integer above
/// i64 saturates to i64::MAX (for top_k: off, as serve.sampling reads any k >= vocab).
fn int_param(obj: Option<Bound<'_, PyAny>>, name: &str, default: i64) -> PyResult<i64> {
    let Some(o) = obj else { return Ok(default) };
    int_arg(&o, name).or_else(|e| {
        let huge = !o.is_instance_of::<pyo3::types::PyBool>()
            && o.call_method0("__index__").and_then(|i| i.gt(i64::MAX)).unwrap_or(false);
        if huge {
            Ok(i64::MAX)
        } else {
            Err(PyValueError::new_err(e.value(o.py()).to_string()))
        }
    })
}

/// A seed as serve.sampling.SamplingParams takes it: any integer (not a bool), reduced modulo 2**64.
fn seed_param(o: &Bound<'_, PyAny>) -> PyResult<u64> {
    let bad = || {
        PyValueError::new_err(format!(
            "seed must be an int or None, got {}",
            o.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    };
    if o.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad());
    }
    let i = o.call_method0("__index__").map_err(|_| bad())?;
    i.rem(u128::from(u64::MAX) + 1)?.extract::<u64>()
}

/// An optional list of ids (None = empty), the error naming `name`.
fn opt_id_list(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Vec<i64>> {
    match obj {
        Some(o) if !o.is_none() => id_list(o, name),
        _ => Ok(vec![]),
    }
}

/// The engine's per-sequence sampler on its own: `Sampler(...)(logits) -> token id`, with its own
/// penalty state (the prompt ids; the generated tokens, each call's pick recorded) and seeded
/// generator, created at the first call from the logits' length. It runs the very code each
/// engine sequence runs (`sampling::sample`, then the token counts as generated).
#[pyclass(module = "rust_runtime", name = "Sampler")]
pub struct PySampler {
    params: SamplingParams,
    prompt: Vec<u32>,
    seed: Option<u64>,
    state: Option<Sampler>,
    generated: Vec<u32>,
}

impl PySampler {
    /// The state for logits `v`: made at the first call (the vocab is `v.len()`), checked after.
    fn state_for(&mut self, v: &[f32]) -> PyResult<&mut Sampler> {
        crate::sampling::check_logits(v)?;
        if self.state.is_none() {
            if let Some(&bad) = self.prompt.iter().find(|&&i| i as usize >= v.len()) {
                return Err(PyValueError::new_err(format!(
                    "prompt_ids: token id {bad} is out of range: expected 0 <= id < vocab = {} (the logits' length)",
                    v.len()
                )));
            }
        }
        let state =
            self.state.get_or_insert_with(|| Sampler::new(self.params.clone(), v.len(), &self.prompt, self.seed));
        let vocab = state.pen.vocab();
        if v.len() != vocab {
            return Err(PyValueError::new_err(format!(
                "logits: expected {vocab} values (the vocab of the first call), got {}",
                v.len()
            )));
        }
        Ok(state)
    }
}

#[pymethods]
impl PySampler {
    /// The sampling keywords as Engine.submit takes them (`SamplingArgs`); prompt_ids: ids
    /// (each < the logits' length) for the repetition penalty.
    #[new]
    #[pyo3(signature = (*, prompt_ids=None, **sampling))]
    fn new(prompt_ids: Option<&Bound<'_, PyAny>>, sampling: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let SamplingArgs { params, seed } = SamplingArgs::parse(sampling, "Sampler")?;
        let prompt = opt_id_list(prompt_ids, "prompt_ids")?
            .into_iter()
            .map(|i| {
                u32::try_from(i).map_err(|_| {
                    PyValueError::new_err(format!("prompt_ids: token id {i} is out of range: expected 0 <= id"))
                })
            })
            .collect::<PyResult<Vec<u32>>>()?;
        Ok(PySampler { params, prompt, seed, state: None, generated: vec![] })
    }

    /// The next token id from raw logits (float [vocab]; converted to float32), recorded as
    /// generated. RuntimeError for NaN / +inf / all -inf logits; ValueError for a prompt id
    /// >= vocab or a vocab that changed since the first call.
    fn __call__(&mut self, py: Python<'_>, logits: &Bound<'_, PyAny>) -> PyResult<u32> {
        let v = logits_arg(logits)?;
        let state = self.state_for(&v)?;
        let tok = detach(py, || state.sample(&v))?;
        self.generated.push(tok);
        Ok(tok)
    }

    /// The logits (float [vocab]) after the repetition / presence / frequency penalties of the
    /// current state, as float32 [vocab]: what the next call would sample from before the
    /// temperature. Records nothing. Errors as for a call.
    fn penalize<'py>(
        &mut self,
        py: Python<'py>,
        logits: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, numpy::PyArray1<f32>>> {
        let mut v = logits_arg(logits)?;
        let state = self.state_for(&v)?;
        state.pen.apply(&state.params, &mut v);
        Ok(v.into_pyarray(py))
    }

    /// The token ids picked so far, in order.
    #[getter]
    fn generated(&self) -> Vec<u32> {
        self.generated.clone()
    }

    /// The prompt ids given at construction.
    #[getter]
    fn prompt_ids(&self) -> Vec<u32> {
        self.prompt.clone()
    }

    fn __repr__(&self) -> String {
        let p = &self.params;
        format!(
            "Sampler(temperature={}, top_k={}, top_p={}, presence_penalty={}, frequency_penalty={}, \
             repetition_penalty={}, seed={}, generated={})",
            p.temperature,
            p.top_k,
            p.top_p,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
            self.seed.map_or("None".to_string(), |v| v.to_string()),
            self.generated.len()
        )
    }
}

/// log softmax of raw logits (float [vocab]) as float32 [vocab], computed as the engine computes
/// each reported log-prob (float64 sums, then float32). RuntimeError for NaN / +inf / all -inf.
#[pyfunction]
#[pyo3(name = "log_softmax")]
fn py_log_softmax<'py>(py: Python<'py>, logits: &Bound<'py, PyAny>) -> PyResult<Bound<'py, numpy::PyArray1<f32>>> {
    let v = logits_arg(logits)?;
    let out = detach(py, || {
        let max = crate::sampling::check_logits(&v)?;
        Ok(crate::sampling::log_softmax(&v, max).into_iter().map(|x| x as f32).collect::<Vec<f32>>())
    })?;
    Ok(out.into_pyarray(py))
}

/// The `n` most likely (token id, log-prob) of raw logits (float [vocab]), most likely first, ties
/// to the lower id: the engine's top_logprobs. n <= 0 gives []. RuntimeError for bad logits.
#[pyfunction]
#[pyo3(name = "top_logprobs")]
fn py_top_logprobs(py: Python<'_>, logits: &Bound<'_, PyAny>, n: i64) -> PyResult<Vec<(u32, f32)>> {
    let v = logits_arg(logits)?;
    detach(py, || {
        let max = crate::sampling::check_logits(&v)?;
        Ok(crate::sampling::top_logprobs(&v, n.max(0) as usize, max))
    })
}

#[pymodule]
fn rust_runtime(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Our parallelism is per model (rayon pools, see kernels::Par). No candle op runs in a
    // forward (candle-core only maps the safetensors); should one run, candle's spin-barrier pool,
    // sized once per process, stays at one thread, since its spinning waits collapse on a loaded
    // 2-core machine. A value the user exported is kept.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    m.add_class::<PyModel>()?;
    m.add_class::<PySequence>()?;
    m.add_class::<PyTokenStream>()?;
    m.add_class::<PyTokenizer>()?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyRequestStream>()?;
    m.add_class::<PySampler>()?;
    m.add_function(wrap_pyfunction!(py_log_softmax, m)?)?;
    m.add_function(wrap_pyfunction!(py_top_logprobs, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("simd_level", format!("{:?}", crate::kernels::simd_level()))?;
    // the limits the Python side owns, mirrored here (tests/test_sampling.py and test_rust_runtime.py compare)
    m.add("MAX_THREADS", MAX_THREADS)?;
    m.add("GREEDY_TEMPERATURE", crate::sampling::GREEDY_TEMPERATURE)?;
    m.add("REPETITION_PENALTY_RANGE", crate::sampling::REPETITION_PENALTY_RANGE)?;
    m.add("PENALTY_RANGE", crate::sampling::PENALTY_RANGE)?;
    crate::quant::register(m)?;
    Ok(())
}
