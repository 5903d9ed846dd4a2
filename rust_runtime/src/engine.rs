//! Continuous batching: one scheduler thread owns every running sequence and its KV cache.
//!
//! Each step is one `Model::forward_batch` over the next token of every decoding sequence plus
//! chunks of pending prompts, at most `token_budget` tokens in all (llama.cpp's n_batch, vLLM's
//! chunked prefill), so the weights are read once per step for all sequences. Decodes come
//! first; a step that carries decodes takes at most `prefill_chunk` prompt tokens beside them
//! (Sarathi-Serve's stall-free batching), so a long prompt arriving mid-stream is spread over
//! several steps instead of stalling every decoding sequence for one long step; a step with
//! nothing decoding prefills up to the whole `token_budget`. After the step,
//! every sequence that got logits samples its next token in Rust (`sampling::sample`, its own
//! seeded generator and penalty state) and its event goes to the request's channel. A cancelled
//! request, a timed-out one, or one whose receiver was dropped leaves the batch before the next
//! step. A request with n > 1 choices prefills its prompt once; the cache is then forked per
//! choice. Detokenisation and stop strings stay with the caller (it cancels on a stop string).
//!
//! Because the forward is batch-invariant (see `model`), a sequence's tokens do not depend on
//! which other sequences share its steps, nor on how its prompt was split into chunks.

use crate::cache::KvCache;
use crate::error::{catch_panic, Error, Result};
use crate::model::{BatchItem, Logits, Model};
use crate::sampling::{self, PenaltyState, SamplingParams};
use rand::rngs::StdRng;
use std::collections::{HashSet, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What one request asks for. Ids are checked by `Engine::submit`.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub params: SamplingParams,
    /// choice i draws from `choice_seed(seed, first_choice + i)`; None = fresh entropy
    pub seed: Option<u64>,
    /// the caller's index of this request's choice 0 (a caller that splits n choices into groups of at
    /// most max_batch submits each group with its first index, so every choice follows the one seed rule)
    pub first_choice: usize,
    pub stop_ids: Vec<u32>,
    /// number of choices (n), each a sequence of its own after the shared prefill
    pub n: usize,
    /// how many most likely tokens (id, log-prob) to report with each token (0 = none)
    pub top_logprobs: usize,
    /// the request ends with `Finish::Timeout` this long after submission
    pub timeout: Option<Duration>,
    /// keep going past end-of-text (it is then an ordinary token); stop ids still stop
    pub ignore_eos: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Finish {
    /// end-of-text or a stop id (that token is not reported)
    Stop,
    /// max_new_tokens reached
    Length,
    Cancelled,
    Timeout,
    Error(String),
}

impl Finish {
    /// The OpenAI-style name ("stop", "length", "cancelled", "timeout", "error").
    pub fn name(&self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
            Finish::Timeout => "timeout",
            Finish::Error(_) => "error",
        }
    }
}

/// One event of one choice: a token (with its log-prob under the unmodified model distribution
/// and the top alternatives), or the end of that choice.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token { index: usize, id: u32, logprob: f32, top: Vec<(u32, f32)> },
    Finished { index: usize, reason: Finish },
    /// choice `index` ended at end-of-text or a stop id `id` (not part of the output), with its
    /// log-prob and top alternatives as for a token (vLLM reports this step too; lm-eval reads it)
    Stopped { index: usize, id: u32, logprob: f32, top: Vec<(u32, f32)> },
}

/// Counters for /metrics, updated after every step.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub steps: u64,
    pub running: usize,
    pub waiting: usize,
    pub last_step_tokens: usize,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// seconds between submission and the first step a request took part in, summed
    pub queue_wait_s: f64,
    pub admitted: u64,
}

enum Cmd {
    Submit {
        id: u64,
        req: Request,
        tx: Sender<Event>,
        at: Instant,
    },
    Cancel(u64),
    /// end one choice (id, index) of a request, e.g. at a stop string; the others go on
    CancelChoice(u64, usize),
    /// tests: allow only this many more steps (None = no limit), to order events deterministically
    #[cfg(test)]
    Hold(Option<u64>),
    Shutdown,
}

/// The seed of choice `index`: choice 0 uses `seed` itself (so n = 1 equals `generate(seed)`),
/// the others a SplitMix64 mix of (seed, index).
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Seq {
    id: u64,
    index: usize,
    req: Arc<Request>,
    cache: KvCache,
    /// prompt tokens already in the cache
    prefilled: usize,
    /// the last sampled token, to be fed next step
    last: Option<u32>,
    rng: StdRng,
    pen: PenaltyState,
    produced: usize,
    tx: Sender<Event>,
    deadline: Option<Instant>,
    submitted: Instant,
    started: bool,
}

impl Seq {
    fn send(&self, ev: Event) -> bool {
        self.tx.send(ev).is_ok()
    }
    fn finish(&self, reason: Finish) {
        let _ = self.tx.send(Event::Finished { index: self.index, reason });
    }
    fn slots(&self) -> usize {
        if self.prefilled < self.req.prompt.len() {
            self.req.n
        } else {
            1
        }
    }
}

/// A handle to the scheduler thread. Dropping it stops the thread (running requests end with
/// `Finish::Cancelled`).
pub struct Engine {
    tx: Mutex<Sender<Cmd>>,
    handle: Mutex<Option<JoinHandle<()>>>,
    next_id: std::sync::atomic::AtomicU64,
    stats: Arc<Mutex<Stats>>,
    model: Arc<Model>,
    eot: Option<u32>,
    pub max_batch: usize,
    pub token_budget: usize,
    pub prefill_chunk: usize,
}

/// The default `prefill_chunk` (prompt tokens in a step that also decodes), picked with
/// benchmarks/serve_batching.py on `small`: a prompt row skips the lm_head, which is about half
/// a decode row's work, so 16 prompt tokens beside 16 decodes make the step ≈ 1.5× a pure
/// 16-decode step (32: ≈ 2×, and a p99 inter-token latency over 4× one stream's).
pub const DEFAULT_PREFILL_CHUNK: usize = 16;

impl Engine {
    /// Start the scheduler thread. `max_batch`: sequences decoding together (≥ 1);
    /// `token_budget`: tokens per step, decode plus prefill chunks (≥ 1); `prefill_chunk`: at
    /// most this many prompt tokens in a step that also carries decoding sequences (≥ 1; a
    /// step with nothing decoding takes up to `token_budget`); `eot`: end-of-text id.
    pub fn start(
        model: Arc<Model>,
        eot: Option<u32>,
        max_batch: usize,
        token_budget: usize,
        prefill_chunk: usize,
    ) -> Result<Self> {
        if max_batch == 0 || max_batch > 4096 {
            return Err(Error::arg(format!("max_batch is {max_batch}; expected 1 <= max_batch <= 4096")));
        }
        if token_budget == 0 {
            return Err(Error::arg(format!("token_budget is {token_budget}; expected an integer >= 1")));
        }
        if prefill_chunk == 0 {
            return Err(Error::arg(format!("prefill_chunk is {prefill_chunk}; expected an integer >= 1")));
        }
        let (tx, rx) = channel();
        let stats = Arc::new(Mutex::new(Stats::default()));
        let mut sched = Scheduler {
            model: model.clone(),
            eot,
            max_batch,
            token_budget,
            prefill_chunk,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cancelled: HashSet::new(),
            cancelled_choices: HashSet::new(),
            stats: stats.clone(),
            allowed: None,
        };
        let handle = std::thread::Builder::new()
            .name("rust_runtime-engine".into())
            .spawn(move || sched.run())
            .map_err(|e| Error::format(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx: Mutex::new(tx),
            handle: Mutex::new(Some(handle)),
            next_id: std::sync::atomic::AtomicU64::new(1),
            stats,
            model,
            eot,
            max_batch,
            token_budget,
            prefill_chunk,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Check and queue a request; returns its id and the receiver of its events. Errors
    /// (ValueError in Python) for an empty prompt, an id or stop id outside the vocabulary,
    /// n = 0, or prompt + max_new_tokens past the context — before anything runs.
    pub fn submit(&self, req: Request) -> Result<(u64, Receiver<Event>)> {
        let c = &self.model.cfg;
        let ctx = c.max_position_embeddings;
        if req.prompt.is_empty() {
            return Err(Error::arg("prompt: expected at least one token id, got an empty list"));
        }
        if let Some(&bad) = req.prompt.iter().chain(&req.stop_ids).find(|&&i| i as usize >= c.vocab_size) {
            return Err(Error::arg(format!(
                "token id {bad} is out of range: expected 0 <= id < vocab_size = {}",
                c.vocab_size
            )));
        }
        if req.n == 0 || req.n > self.max_batch {
            return Err(Error::arg(format!(
                "n is {}; expected 1 <= n <= max_batch = {} (each choice is a sequence of the batch)",
                req.n, self.max_batch
            )));
        }
        if req.prompt.len() as u128 + req.max_new_tokens as u128 > ctx as u128 {
            return Err(Error::arg(format!(
                "prompt of {} tokens + max_new_tokens {} exceeds the context length {ctx} \
                 (max_position_embeddings); ask for at most {} new tokens",
                req.prompt.len(),
                req.max_new_tokens,
                ctx.saturating_sub(req.prompt.len())
            )));
        }
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = channel();
        self.send(Cmd::Submit { id, req, tx, at: Instant::now() })?;
        Ok((id, rx))
    }

    /// Ask request `id` to leave the batch before the next step (its choices end with
    /// `Finish::Cancelled`). Unknown or finished ids are ignored.
    pub fn cancel(&self, id: u64) {
        let _ = self.send(Cmd::Cancel(id));
    }

    /// End choice `index` of request `id` before the next step (it ends with
    /// `Finish::Cancelled`; the request's other choices go on). Unknown ones are ignored. A
    /// choice whose prompt is still being prefilled (n > 1 shares one sequence until then) is
    /// not split: cancel the whole request instead.
    pub fn cancel_choice(&self, id: u64, index: usize) {
        let _ = self.send(Cmd::CancelChoice(id, index));
    }

    pub fn stats(&self) -> Stats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    fn send(&self, cmd: Cmd) -> Result<()> {
        let tx = self.tx.lock().map_err(|_| Error::Internal("engine channel lock poisoned".into()))?;
        tx.send(cmd).map_err(|_| Error::Internal("the engine thread has stopped".into()))
    }

    /// Stop the scheduler thread and wait for it (idempotent).
    pub fn shutdown(&self) {
        let _ = self.send(Cmd::Shutdown);
        if let Ok(mut h) = self.handle.lock() {
            if let Some(h) = h.take() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Scheduler {
    model: Arc<Model>,
    eot: Option<u32>,
    max_batch: usize,
    token_budget: usize,
    prefill_chunk: usize,
    rx: Receiver<Cmd>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    cancelled: HashSet<u64>,
    cancelled_choices: HashSet<(u64, usize)>,
    stats: Arc<Mutex<Stats>>,
    /// steps still allowed (tests only hold the scheduler; None = no limit)
    allowed: Option<u64>,
}

impl Scheduler {
    fn run(&mut self) {
        loop {
            if !self.take_commands() {
                break;
            }
            self.drop_finished();
            self.admit();
            if self.running.is_empty() || self.allowed == Some(0) {
                continue;
            }
            if let Some(n) = self.allowed.as_mut() {
                *n -= 1;
            }
            if let Err(e) = catch_panic(|| self.step()) {
                for s in self.running.drain(..) {
                    s.finish(Finish::Error(e.to_string()));
                }
            }
            self.publish();
        }
        for s in self.running.drain(..).chain(self.waiting.drain(..)) {
            s.finish(Finish::Cancelled);
        }
    }

    /// Drain the command channel (blocking while there is nothing to do). False on shutdown.
    fn take_commands(&mut self) -> bool {
        loop {
            let cmd = if self.allowed == Some(0) || (self.running.is_empty() && self.waiting.is_empty()) {
                // idle: wake up at least once a second to notice nothing in particular
                match self.rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(c) => c,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(_) => return false,
                }
            } else {
                match self.rx.try_recv() {
                    Ok(c) => c,
                    Err(std::sync::mpsc::TryRecvError::Empty) => return true,
                    Err(_) => return false,
                }
            };
            match cmd {
                Cmd::Shutdown => return false,
                Cmd::Cancel(id) => {
                    self.cancelled.insert(id);
                }
                Cmd::CancelChoice(id, index) => {
                    self.cancelled_choices.insert((id, index));
                }
                #[cfg(test)]
                Cmd::Hold(h) => self.allowed = h,
                Cmd::Submit { id, req, tx, at } => {
                    let req = Arc::new(req);
                    let mut pen = PenaltyState::new(self.model.cfg.vocab_size);
                    for &t in &req.prompt {
                        pen.add_prompt(t);
                    }
                    let seq = Seq {
                        id,
                        index: 0,
                        cache: self.model.new_cache(),
                        prefilled: 0,
                        last: None,
                        rng: sampling::make_rng(req.seed.map(|s| choice_seed(s, req.first_choice))),
                        pen,
                        produced: 0,
                        tx,
                        deadline: req.timeout.map(|t| at + t),
                        submitted: at,
                        started: false,
                        req,
                    };
                    if seq.req.max_new_tokens == 0 {
                        for i in 0..seq.req.n {
                            let _ = seq.tx.send(Event::Finished { index: i, reason: Finish::Length });
                        }
                    } else {
                        self.waiting.push_back(seq);
                    }
                }
            }
        }
    }

    /// Remove cancelled and timed-out sequences (and those whose receiver is gone).
    fn drop_finished(&mut self) {
        let now = Instant::now();
        let cancelled = std::mem::take(&mut self.cancelled);
        let choices = std::mem::take(&mut self.cancelled_choices);
        let verdict = |s: &Seq| -> Option<Finish> {
            let whole = s.last.is_none() && s.req.n > 1; // still one sequence for every choice
            if cancelled.contains(&s.id) || (!whole && choices.contains(&(s.id, s.index))) {
                Some(Finish::Cancelled)
            } else if s.deadline.is_some_and(|d| now >= d) {
                Some(Finish::Timeout)
            } else {
                None
            }
        };
        let mut keep = Vec::with_capacity(self.running.len());
        for s in self.running.drain(..) {
            match verdict(&s) {
                Some(f) => s.finish(f),
                None => keep.push(s),
            }
        }
        self.running = keep;
        let mut keep = VecDeque::with_capacity(self.waiting.len());
        for s in self.waiting.drain(..) {
            match verdict(&s) {
                Some(f) => {
                    for i in 0..s.req.n {
                        let _ = s.tx.send(Event::Finished { index: i, reason: f.clone() });
                    }
                }
                None => keep.push_back(s),
            }
        }
        self.waiting = keep;
    }

    /// Move waiting requests into the batch while their choices fit in max_batch (FIFO).
    fn admit(&mut self) {
        let mut used: usize = self.running.iter().map(|s| s.slots()).sum();
        while let Some(front) = self.waiting.front() {
            if used + front.req.n > self.max_batch {
                break;
            }
            used += front.req.n;
            let s = self.waiting.pop_front().expect("front exists");
            self.running.push(s);
        }
    }

    fn step(&mut self) -> Result<()> {
        let now = Instant::now();
        // decoding sequences first (one token each), then prompt chunks in admission order:
        // beside decodes at most prefill_chunk prompt tokens, else the whole token budget
        let decoding = self.running.iter().filter(|s| s.last.is_some()).count();
        let mut budget = prefill_budget(self.token_budget, self.prefill_chunk, decoding);
        let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (running index, start, len) of prompt chunks
        for (i, s) in self.running.iter().enumerate() {
            if s.last.is_none() && budget > 0 {
                let take = (s.req.prompt.len() - s.prefilled).min(budget);
                budget -= take;
                plan.push((i, s.prefilled, take));
            }
        }
        let (mut n_prefill, mut n_decode) = (0usize, 0usize);
        let mut order: Vec<usize> = Vec::new();
        let mut wait = 0.0;
        let mut admitted = 0;
        let logits = {
            let mut chunk_of = vec![None; self.running.len()];
            for &(i, start, len) in &plan {
                chunk_of[i] = Some((start, len));
            }
            let mut items: Vec<BatchItem<'_>> = Vec::new();
            for (i, s) in self.running.iter_mut().enumerate() {
                if !s.started {
                    s.started = true;
                    wait += now.duration_since(s.submitted).as_secs_f64();
                    admitted += 1;
                }
                let Seq { cache, req, last, .. } = s;
                if let Some(t) = last.as_ref() {
                    n_decode += 1;
                    order.push(i);
                    items.push(BatchItem { cache, ids: std::slice::from_ref(t), logits: Logits::Last });
                } else if let Some((start, len)) = chunk_of[i] {
                    n_prefill += len;
                    order.push(i);
                    let done = start + len == req.prompt.len();
                    items.push(BatchItem {
                        cache,
                        ids: &req.prompt[start..start + len],
                        logits: if done { Logits::Last } else { Logits::None },
                    });
                }
            }
            self.model.forward_batch(&mut items)?
        };
        for &(i, _, len) in &plan {
            self.running[i].prefilled += len;
        }
        // sample, report, fork n > 1 after its prefill, and retire finished sequences
        let mut forks: Vec<Seq> = Vec::new();
        let mut done: Vec<usize> = Vec::new();
        for (&i, lg) in order.iter().zip(&logits) {
            if lg.is_empty() {
                continue;
            }
            let first = self.running[i].last.is_none();
            if first && self.running[i].req.n > 1 {
                let parent = &self.running[i];
                for c in 1..parent.req.n {
                    let mut child = Seq {
                        id: parent.id,
                        index: c,
                        req: parent.req.clone(),
                        cache: parent.cache.fork(),
                        prefilled: parent.prefilled,
                        last: None,
                        rng: sampling::make_rng(parent.req.seed.map(|s| choice_seed(s, parent.req.first_choice + c))),
                        pen: parent.pen.clone(),
                        produced: 0,
                        tx: parent.tx.clone(),
                        deadline: parent.deadline,
                        submitted: parent.submitted,
                        started: true,
                    };
                    if !self.sample_into(&mut child, lg)? {
                        forks.push(child);
                    }
                }
            }
            if self.sample_into_idx(i, lg)? {
                done.push(i);
            }
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            self.running.swap_remove(i);
        }
        self.running.extend(forks);
        if let Ok(mut st) = self.stats.lock() {
            st.steps += 1;
            st.last_step_tokens = n_prefill + n_decode;
            st.prefill_tokens += n_prefill as u64;
            st.decode_tokens += n_decode as u64;
            st.queue_wait_s += wait;
            st.admitted += admitted;
        }
        Ok(())
    }

    fn sample_into_idx(&mut self, i: usize, logits: &[f32]) -> Result<bool> {
        let eot = self.eot;
        sample_seq(&mut self.running[i], logits, eot)
    }

    fn sample_into(&self, s: &mut Seq, logits: &[f32]) -> Result<bool> {
        sample_seq(s, logits, self.eot)
    }

    fn publish(&self) {
        if let Ok(mut st) = self.stats.lock() {
            st.running = self.running.len();
            st.waiting = self.waiting.len();
        }
    }
}

/// Prompt tokens a step may take beside `decoding` decode tokens: the whole `token_budget`
/// when nothing decodes, else `prefill_chunk` capped by what the decodes leave of the budget.
fn prefill_budget(token_budget: usize, prefill_chunk: usize, decoding: usize) -> usize {
    if decoding == 0 {
        token_budget
    } else {
        prefill_chunk.min(token_budget.saturating_sub(decoding))
    }
}

/// Sample the next token of `s` from `logits` and report it; true when `s` has finished
/// (stop token, max_new_tokens, or its receiver is gone).
fn sample_seq(s: &mut Seq, logits: &[f32], eot: Option<u32>) -> Result<bool> {
    let (tok, max) = match sampling::sample_with_max(logits, &s.req.params, &s.pen, &mut s.rng) {
        Ok(t) => t,
        Err(e) => {
            s.finish(Finish::Error(e.to_string()));
            return Ok(true);
        }
    };
    let logprob = sampling::log_prob_with_max(logits, tok as usize, max) as f32;
    let top = if s.req.top_logprobs > 0 { sampling::top_logprobs(logits, s.req.top_logprobs, max) } else { vec![] };
    if (Some(tok) == eot && !s.req.ignore_eos) || s.req.stop_ids.contains(&tok) {
        s.send(Event::Stopped { index: s.index, id: tok, logprob, top });
        return Ok(true);
    }
    s.produced += 1;
    s.pen.add_generated(tok);
    s.last = Some(tok);
    if !s.send(Event::Token { index: s.index, id: tok, logprob, top }) {
        return Ok(true); // nobody listens any more
    }
    if s.produced >= s.req.max_new_tokens {
        s.finish(Finish::Length);
        return Ok(true);
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{generate_all, Generator};
    use crate::model::tests::fixture;
    use crate::model::Quantize;

    fn collect(rx: &Receiver<Event>, n: usize) -> Vec<(Vec<(u32, f32)>, Finish)> {
        let mut out: Vec<(Vec<(u32, f32)>, Option<Finish>)> = vec![(vec![], None); n];
        while out.iter().any(|o| o.1.is_none()) {
            match rx.recv_timeout(Duration::from_secs(30)).expect("an event within 30 s") {
                Event::Token { index, id, logprob, .. } => out[index].0.push((id, logprob)),
                Event::Finished { index, reason } => out[index].1 = Some(reason),
                Event::Stopped { index, .. } => out[index].1 = Some(Finish::Stop),
            }
        }
        out.into_iter().map(|(t, f)| (t, f.unwrap())).collect()
    }

    fn req(prompt: Vec<u32>, max_new: usize, params: SamplingParams, seed: Option<u64>, n: usize) -> Request {
        Request { prompt, max_new_tokens: max_new, params, seed, first_choice: 0, stop_ids: vec![], n, top_logprobs: 0, timeout: None, ignore_eos: false }
    }

    fn alone(m: &Model, prompt: &[u32], max_new: usize, params: SamplingParams, seed: Option<u64>) -> Vec<(u32, f32)> {
        let p: Vec<i64> = prompt.iter().map(|&i| i as i64).collect();
        let mut g = Generator::new(m, &p, max_new as i64, params, seed, &[], None).unwrap();
        generate_all(m, &mut g).unwrap()
    }

    #[test]
    fn batched_generation_equals_alone_and_forks_share_the_prefill() {
        let fx = fixture("engine", 2, None, None);
        let model = Arc::new(Model::load(&fx.dir, Quantize::None, 1).unwrap());
        // budget 5: prompts of up to 9 tokens are prefilled in chunks beside decoding sequences
        let eng = Engine::start(model.clone(), None, 8, 5, 5).unwrap();
        let greedy = SamplingParams { temperature: 0.0, ..Default::default() };
        let sampled = SamplingParams { temperature: 0.9, top_p: 0.95, ..Default::default() };
        let prompts: Vec<Vec<u32>> =
            (0..6).map(|j| (0..(j + 3) as u32).map(|i| (i * 11 + j as u32 * 5) % 96).collect()).collect();
        let mut rxs = vec![];
        for (j, p) in prompts.iter().enumerate() {
            let params = if j % 2 == 0 { greedy.clone() } else { sampled.clone() };
            rxs.push(eng.submit(req(p.clone(), 12, params, Some(j as u64), 1)).unwrap().1);
        }
        for (j, rx) in rxs.iter().enumerate() {
            let params = if j % 2 == 0 { greedy.clone() } else { sampled.clone() };
            let got = collect(rx, 1).remove(0);
            assert_eq!(got.1, Finish::Length);
            assert_eq!(got.0, alone(&model, &prompts[j], 12, params, Some(j as u64)), "request {j}");
        }
        let st = eng.stats();
        assert!(st.steps > 0 && st.prefill_tokens as usize == prompts.iter().map(|p| p.len()).sum::<usize>());
        // n = 3: one prefill, three choices; choice 0 equals n = 1 with the same seed
        let before = eng.stats().prefill_tokens;
        let (_, rx) = eng.submit(req(prompts[5].clone(), 10, sampled.clone(), Some(99), 3)).unwrap();
        let got = collect(&rx, 3);
        assert_eq!(eng.stats().prefill_tokens - before, prompts[5].len() as u64);
        assert_eq!(got[0].0, alone(&model, &prompts[5], 10, sampled.clone(), Some(99)));
        assert_eq!(got[2].0, alone(&model, &prompts[5], 10, sampled.clone(), Some(choice_seed(99, 2))));
        assert_ne!(got[1].0, got[2].0);
        // a later group of the same request (first_choice 1, n = 2): its choices are choices 1 and 2
        let (_, rx) =
            eng.submit(Request { first_choice: 1, ..req(prompts[5].clone(), 10, sampled.clone(), Some(99), 2) }).unwrap();
        let later = collect(&rx, 2);
        assert_eq!(later[0].0, got[1].0);
        assert_eq!(later[1].0, got[2].0);
    }

    /// Wait (polling, at most 30 s) until the held scheduler has run `n` steps in all.
    fn wait_steps(eng: &Engine, n: u64) -> Stats {
        let t0 = Instant::now();
        loop {
            let st = eng.stats();
            if st.steps >= n {
                return st;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "step {n} within 30 s");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn a_prompt_beside_decodes_is_prefilled_prefill_chunk_tokens_a_step() {
        assert_eq!(prefill_budget(64, 4, 0), 64);
        assert_eq!(prefill_budget(64, 4, 3), 4);
        assert_eq!(prefill_budget(10, 16, 7), 3);
        assert_eq!(prefill_budget(10, 16, 12), 0);
        let fx = fixture("engine_chunk", 2, None, None);
        let model = Arc::new(Model::load(&fx.dir, Quantize::None, 1).unwrap());
        assert!(Engine::start(model.clone(), None, 4, 64, 0).is_err());
        let eng = Engine::start(model.clone(), None, 4, 64, 4).unwrap();
        let greedy = SamplingParams { temperature: 0.0, ..Default::default() };
        let (pa, pb): (Vec<u32>, Vec<u32>) =
            ((0..3).map(|i| i * 7 + 1).collect(), (0..14).map(|i| i * 5 + 2).collect());
        eng.send(Cmd::Hold(Some(0))).unwrap();
        let (_, rxa) = eng.submit(req(pa.clone(), 12, greedy.clone(), None, 1)).unwrap();
        eng.send(Cmd::Hold(Some(1))).unwrap();
        // step 1: nothing decodes, A's whole prompt
        let st = wait_steps(&eng, 1);
        assert_eq!((st.prefill_tokens, st.decode_tokens), (3, 0));
        let (_, rxb) = eng.submit(req(pb.clone(), 8, greedy.clone(), None, 1)).unwrap();
        eng.send(Cmd::Hold(Some(2))).unwrap();
        // steps 2 and 3: A decodes, B's 14-token prompt goes in 4 tokens a step
        let st = wait_steps(&eng, 3);
        assert_eq!((st.prefill_tokens, st.decode_tokens, st.last_step_tokens), (3 + 8, 2, 5));
        eng.send(Cmd::Hold(None)).unwrap();
        let (a, b) = (collect(&rxa, 1).remove(0), collect(&rxb, 1).remove(0));
        assert_eq!(a.0, alone(&model, &pa, 12, greedy.clone(), None));
        assert_eq!(b.0, alone(&model, &pb, 8, greedy, None));
        assert_eq!(eng.stats().prefill_tokens, 3 + 14);
    }

    #[test]
    fn cancel_and_timeout_leave_the_batch() {
        let fx = fixture("engine_cancel", 2, None, None);
        let model = Arc::new(Model::load(&fx.dir, Quantize::None, 1).unwrap());
        let eng = Engine::start(model, None, 4, 64, DEFAULT_PREFILL_CHUNK).unwrap();
        let p = SamplingParams { temperature: 1.0, ..Default::default() };
        // a running request: held after its first step, cancelled, then released
        eng.send(Cmd::Hold(Some(0))).unwrap();
        let (id, rx) = eng.submit(req(vec![1, 2], 30, p.clone(), Some(1), 1)).unwrap();
        let (id2, rx2) = eng.submit(req(vec![3, 4], 30, p.clone(), Some(1), 1)).unwrap();
        eng.cancel(id2); // cancelled while waiting: no token at all
        eng.send(Cmd::Hold(Some(3))).unwrap(); // prefill + first token, then two decode steps
        assert_eq!(collect(&rx2, 1), vec![(vec![], Finish::Cancelled)]);
        for _ in 0..3 {
            assert!(matches!(rx.recv_timeout(Duration::from_secs(30)).unwrap(), Event::Token { .. }));
        }
        eng.cancel(id);
        eng.send(Cmd::Hold(None)).unwrap();
        // the cancel is seen before the next step: no further token
        assert_eq!(collect(&rx, 1), vec![(vec![], Finish::Cancelled)]);
        let mut r = req(vec![1, 2], 30, p, Some(1), 2);
        r.timeout = Some(Duration::from_nanos(1));
        let (_, rx) = eng.submit(r).unwrap();
        let got = collect(&rx, 2);
        assert!(got.iter().all(|(t, f)| t.is_empty() && *f == Finish::Timeout));
        // bad requests are refused before anything runs
        assert!(eng.submit(req(vec![], 3, SamplingParams::default(), None, 1)).is_err());
        assert!(eng.submit(req(vec![96], 3, SamplingParams::default(), None, 1)).is_err());
        assert!(eng.submit(req(vec![1; 30], 3, SamplingParams::default(), None, 1)).is_err());
        assert!(eng.submit(req(vec![1], 3, SamplingParams::default(), None, 5)).is_err());
        eng.shutdown();
        assert!(eng.submit(req(vec![1], 3, SamplingParams::default(), None, 1)).is_err());
    }
}
