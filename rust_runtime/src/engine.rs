//! Continuous batching: one scheduler thread owns every running sequence and its KV cache.
//!
//! Each step follows `policy` (the policy `serve/policy.py` states for serve's Python engine):
//! retire what was cancelled or timed out, plan ([`plan_step`]: admissions first come, first
//! served while the choices fit in `max_batch`, one token for every decoding sequence, prompt
//! chunks under the prefill budget), then one `Model::forward_batch` over the planned tokens, so
//! the weights are read once per step for all sequences. After the step every sequence that got
//! logits samples its next token in Rust (`sampling::sample`, its own seeded generator and penalty
//! state) and its event goes to the request's channel; a request with n > 1 choices prefills its
//! prompt once and forks the cache per open choice. A cancelled request (or choice), a timed-out
//! one, or one whose receiver was dropped leaves the batch before the next step. Detokenisation
//! and stop strings stay with the caller (it cancels on a stop string).
//!
//! Because the forward is batch-invariant (see `model`), a sequence's tokens do not depend on
//! which other sequences share its steps, nor on how its prompt was split into chunks.

use crate::cache::KvCache;
use crate::error::{catch_panic, Error, Result};
use crate::model::{BatchItem, Logits, Model};
use crate::policy::{plan_step, Entry, Limits, Phase, Plan};
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
    /// the choices still running this long after submission end with `Finish::Timeout`
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
    Token {
        index: usize,
        id: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
    Finished {
        index: usize,
        reason: Finish,
    },
    /// choice `index` ended at end-of-text or a stop id `id` (not part of the output), with its
    /// log-prob and top alternatives as for a token (vLLM reports this step too; lm-eval reads it)
    Stopped {
        index: usize,
        id: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
}

/// Counters for /metrics, published after every pass of the scheduler.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub steps: u64,
    /// sequences (choices) of admitted requests not yet ended
    pub running: usize,
    /// choices queued
    pub waiting: usize,
    pub last_step_tokens: usize,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// seconds between submission and the first step that ran a request's prompt, summed
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

/// A request in the queue or the batch: while `Waiting` or `Prefilling` one sequence for all its
/// open choices; once `Decoding`, one per choice (`index`).
struct Seq {
    id: u64,
    /// the choice this sequence is (while prefilling: the first open one)
    index: usize,
    req: Arc<Request>,
    phase: Phase,
    /// the choices not yet ended: all of the request's open ones until the fork, then `[index]`
    open: Vec<usize>,
    cache: KvCache,
    /// prompt tokens already in the cache
    prefilled: usize,
    rng: StdRng,
    pen: PenaltyState,
    produced: usize,
    tx: Sender<Event>,
    deadline: Option<Instant>,
    submitted: Instant,
    /// the request's place in the order of arrival (`Entry::arrival`): prompt chunks go by it,
    /// wherever the sequence sits in the batch
    arrival: u64,
}

impl Seq {
    fn send(&self, ev: Event) -> bool {
        self.tx.send(ev).is_ok()
    }
    /// End choice `index` (if it is open) with `reason`.
    fn finish_choice(&mut self, index: usize, reason: Finish) {
        if let Some(k) = self.open.iter().position(|&i| i == index) {
            self.open.remove(k);
            let _ = self.tx.send(Event::Finished { index, reason });
        }
    }
    /// End every open choice with `reason`.
    fn finish(&mut self, reason: Finish) {
        for index in std::mem::take(&mut self.open) {
            let _ = self.tx.send(Event::Finished { index, reason: reason.clone() });
        }
    }
    /// The planner's view: a slot per open choice, the prompt not yet in the cache.
    fn entry(&self) -> Entry {
        let prompt_left = match self.phase {
            Phase::Decoding { .. } => 0,
            _ => self.req.prompt.len() - self.prefilled,
        };
        Entry { slots: self.open.len(), prompt_left, arrival: self.arrival }
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
    pub limits: Limits,
}

impl Engine {
    /// Start the scheduler thread with `limits` (checked by `Limits::new`; see `policy`) on
    /// `model`; `eot`: the end-of-text id.
    pub fn start(model: Arc<Model>, eot: Option<u32>, limits: Limits) -> Result<Self> {
        Limits::new(limits.max_batch as i64, limits.token_budget as i64, limits.prefill_chunk as i64)?;
        let (tx, rx) = channel();
        let stats = Arc::new(Mutex::new(Stats::default()));
        let mut sched = Scheduler::new(model.clone(), eot, limits, rx, stats.clone());
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
            limits,
        })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Check and queue a request; returns its id and the receiver of its events. Errors
    /// (ValueError in Python) for an empty prompt, an id or stop id outside the vocabulary,
    /// n = 0 or n > max_batch, or prompt + max_new_tokens past the context — before anything runs.
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
        if req.n == 0 || req.n > self.limits.max_batch {
            return Err(Error::arg(format!(
                "n is {}; expected 1 <= n <= max_batch = {} (each choice is a sequence of the batch)",
                req.n, self.limits.max_batch
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
    /// `Finish::Cancelled`; the request's other choices go on, also when the prompt is still
    /// being prefilled: the cancelled choice is then never forked). Unknown ones are ignored.
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

/// The scheduler's state, owned by its thread (a test drives it directly: `handle` a command,
/// then `tick` a step). `waiting`: the queue, arrival order; `running`: the batch (prefilling
/// requests and decoding choices) in no particular order: a sequence that ends gives its place to
/// the last one, and the plan orders prompt chunks by `Seq::arrival`.
struct Scheduler {
    model: Arc<Model>,
    eot: Option<u32>,
    limits: Limits,
    rx: Receiver<Cmd>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    cancelled: HashSet<u64>,
    cancelled_choices: HashSet<(u64, usize)>,
    stats: Arc<Mutex<Stats>>,
    /// requests queued so far: the next one's `arrival`
    arrivals: u64,
}

/// What one step ran: per request id, the tokens it fed the model (its prompt chunk, or one per
/// decoding choice), in batch order.
type Scheduled = Vec<(u64, usize)>;

impl Scheduler {
    fn new(model: Arc<Model>, eot: Option<u32>, limits: Limits, rx: Receiver<Cmd>, stats: Arc<Mutex<Stats>>) -> Self {
        Scheduler {
            model,
            eot,
            limits,
            rx,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cancelled: HashSet::new(),
            cancelled_choices: HashSet::new(),
            stats,
            arrivals: 0,
        }
    }

    fn run(&mut self) {
        while self.take_commands() {
            self.tick(Instant::now());
        }
        for mut s in self.running.drain(..).chain(self.waiting.drain(..)) {
            s.finish(Finish::Cancelled);
        }
    }

    /// Drain the command channel (blocking while there is nothing to do). False on shutdown.
    fn take_commands(&mut self) -> bool {
        loop {
            let cmd = if self.running.is_empty() && self.waiting.is_empty() {
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
            if !self.handle(cmd) {
                return false;
            }
        }
    }

    /// Apply one command (cancellations are read at the next retire). False for `Shutdown`.
    fn handle(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Shutdown => return false,
            Cmd::Cancel(id) => {
                self.cancelled.insert(id);
            }
            Cmd::CancelChoice(id, index) => {
                self.cancelled_choices.insert((id, index));
            }
            Cmd::Submit { id, req, tx, at } => {
                let req = Arc::new(req);
                let mut pen = PenaltyState::new(self.model.cfg.vocab_size);
                for &t in &req.prompt {
                    pen.add_prompt(t);
                }
                let mut seq = Seq {
                    id,
                    index: 0,
                    phase: Phase::Waiting,
                    open: (0..req.n).collect(),
                    cache: self.model.new_cache(),
                    prefilled: 0,
                    rng: sampling::make_rng(None),
                    pen,
                    produced: 0,
                    tx,
                    deadline: req.timeout.map(|t| at + t),
                    submitted: at,
                    arrival: self.arrivals,
                    req,
                };
                self.arrivals += 1;
                if seq.req.max_new_tokens == 0 {
                    seq.finish(Finish::Length);
                } else {
                    self.waiting.push_back(seq);
                }
            }
        }
        true
    }

    /// One step at `now`: retire, plan, run, sample, post (see `policy`). Returns what ran, or
    /// None when the batch was empty. A failing forward ends every request of the step.
    fn tick(&mut self, now: Instant) -> Option<Scheduled> {
        self.retire(now);
        let waiting: Vec<Entry> = self.waiting.iter().map(Seq::entry).collect();
        let running: Vec<Entry> = self.running.iter().map(Seq::entry).collect();
        let plan = plan_step(&waiting, &running, &self.limits);
        for _ in 0..plan.admit {
            let mut s = self.waiting.pop_front().expect("the plan admits from the queue");
            s.phase = Phase::Prefilling;
            self.running.push(s);
        }
        let ran = if self.running.is_empty() {
            None
        } else {
            Some(catch_panic(|| self.step(&plan, now)).unwrap_or_else(|e| {
                for mut s in self.running.drain(..) {
                    s.finish(Finish::Error(e.to_string()));
                }
                vec![]
            }))
        };
        self.publish();
        ran
    }

    /// Cancelled choices and requests past their deadline leave, queued or running.
    fn retire(&mut self, now: Instant) {
        let cancelled = std::mem::take(&mut self.cancelled);
        let choices = std::mem::take(&mut self.cancelled_choices);
        let retire = |s: &mut Seq| -> bool {
            let gone: Vec<usize> =
                s.open.iter().copied().filter(|&i| cancelled.contains(&s.id) || choices.contains(&(s.id, i))).collect();
            for i in gone {
                s.finish_choice(i, Finish::Cancelled);
            }
            if s.deadline.is_some_and(|d| now >= d) {
                s.finish(Finish::Timeout);
            }
            !s.open.is_empty()
        };
        self.running.retain_mut(retire);
        self.waiting.retain_mut(retire);
    }

    /// Run `plan` on the batch (admissions already applied): one forward over every planned
    /// decode and prompt chunk, then sample, fork and retire the finished.
    fn step(&mut self, plan: &Plan, now: Instant) -> Result<Scheduled> {
        // per batch index: the prompt chunk the plan gives it (decodes: every Decoding entry)
        let mut chunk: Vec<usize> = vec![0; self.running.len()];
        for &(i, len) in &plan.prefill {
            chunk[i] = len;
        }
        let (mut wait, mut admitted, mut n_decode, mut n_prefill) = (0.0, 0u64, 0usize, 0usize);
        let mut order: Vec<usize> = Vec::new();
        let mut scheduled: Scheduled = Vec::new();
        let logits = {
            let mut items: Vec<BatchItem<'_>> = Vec::new();
            for (i, s) in self.running.iter_mut().enumerate() {
                let Seq { cache, req, phase, prefilled, id, submitted, .. } = s;
                match &*phase {
                    Phase::Decoding { last } => {
                        n_decode += 1;
                        scheduled.push((*id, 1));
                        items.push(BatchItem { cache, ids: std::slice::from_ref(last), logits: Logits::Last });
                    }
                    _ if chunk[i] > 0 => {
                        let (start, len) = (*prefilled, chunk[i]);
                        if start == 0 {
                            wait += now.duration_since(*submitted).as_secs_f64();
                            admitted += 1;
                        }
                        n_prefill += len;
                        scheduled.push((*id, len));
                        let done = start + len == req.prompt.len();
                        items.push(BatchItem {
                            cache,
                            ids: &req.prompt[start..start + len],
                            logits: if done { Logits::Last } else { Logits::None },
                        });
                    }
                    _ => continue,
                }
                order.push(i);
            }
            self.model.forward_batch(&mut items)?
        };
        for &(i, len) in &plan.prefill {
            self.running[i].prefilled += len;
        }
        // sample (forking a request whose prompt is in), then retire the finished
        let mut forks: Vec<Seq> = Vec::new();
        let mut done: Vec<usize> = Vec::new();
        for (&i, lg) in order.iter().zip(&logits) {
            if lg.is_empty() {
                continue;
            }
            if self.running[i].phase == Phase::Prefilling {
                for mut child in self.fork(i) {
                    if !sample_seq(&mut child, lg, self.eot)? {
                        forks.push(child);
                    }
                }
            }
            let eot = self.eot;
            if sample_seq(&mut self.running[i], lg, eot)? {
                done.push(i);
            }
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            self.running.swap_remove(i);
        }
        self.running.extend(forks);
        // merge the per-sequence entries of one request (its decoding choices) into one
        let mut merged: Scheduled = Vec::new();
        for (id, t) in scheduled {
            match merged.iter_mut().find(|(m, _)| *m == id) {
                Some(m) => m.1 += t,
                None => merged.push((id, t)),
            }
        }
        if let Ok(mut st) = self.stats.lock() {
            st.steps += 1;
            st.last_step_tokens = n_prefill + n_decode;
            st.prefill_tokens += n_prefill as u64;
            st.decode_tokens += n_decode as u64;
            st.queue_wait_s += wait;
            st.admitted += admitted;
        }
        Ok(merged)
    }

    /// The prompt of batch entry `i` is in: it becomes its first open choice, and each other open
    /// choice a fork of its cache (same penalties; generator `choice_seed(seed, first_choice + c)`).
    fn fork(&mut self, i: usize) -> Vec<Seq> {
        let parent = &mut self.running[i];
        let seed_of = |r: &Request, c: usize| sampling::make_rng(r.seed.map(|s| choice_seed(s, r.first_choice + c)));
        let open = std::mem::take(&mut parent.open);
        parent.index = open[0];
        parent.open = vec![open[0]];
        parent.rng = seed_of(&parent.req, open[0]);
        let parent = &self.running[i];
        open[1..]
            .iter()
            .map(|&c| Seq {
                id: parent.id,
                index: c,
                req: parent.req.clone(),
                phase: Phase::Prefilling,
                open: vec![c],
                cache: parent.cache.fork(),
                prefilled: parent.prefilled,
                rng: seed_of(&parent.req, c),
                pen: parent.pen.clone(),
                produced: 0,
                tx: parent.tx.clone(),
                deadline: parent.deadline,
                submitted: parent.submitted,
                arrival: parent.arrival,
            })
            .collect()
    }

    fn publish(&self) {
        if let Ok(mut st) = self.stats.lock() {
            st.running = self.running.iter().map(|s| s.open.len()).sum();
            st.waiting = self.waiting.iter().map(|s| s.open.len()).sum();
        }
    }
}

/// Sample the next token of `s` from `logits` and report it; true when `s` has finished (stop
/// token, max_new_tokens, or its receiver is gone). Otherwise `s` is Decoding that token next.
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
        s.open.clear();
        return Ok(true);
    }
    s.produced += 1;
    s.pen.add_generated(tok);
    s.phase = Phase::Decoding { last: tok };
    if !s.send(Event::Token { index: s.index, id: tok, logprob, top }) {
        s.open.clear();
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
    use serde_json::Value;
    use std::collections::BTreeMap;

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
        Request {
            prompt,
            max_new_tokens: max_new,
            params,
            seed,
            first_choice: 0,
            stop_ids: vec![],
            n,
            top_logprobs: 0,
            timeout: None,
            ignore_eos: false,
        }
    }

    fn alone(m: &Model, prompt: &[u32], max_new: usize, params: SamplingParams, seed: Option<u64>) -> Vec<(u32, f32)> {
        let p: Vec<i64> = prompt.iter().map(|&i| i as i64).collect();
        let mut g = Generator::new(m, &p, max_new as i64, params, seed, &[], None).unwrap();
        generate_all(m, &mut g).unwrap()
    }

    fn limits(max_batch: usize, token_budget: usize, prefill_chunk: usize) -> Limits {
        Limits { max_batch, token_budget, prefill_chunk }
    }

    #[test]
    fn batched_generation_equals_alone_and_forks_share_the_prefill() {
        let fx = fixture("engine", 2, None, None);
        let model = Arc::new(Model::load(&fx.dir, Quantize::None, 1).unwrap());
        // budget 5: prompts of up to 9 tokens are prefilled in chunks beside decoding sequences
        let eng = Engine::start(model.clone(), None, limits(8, 5, 5)).unwrap();
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
        let (_, rx) = eng
            .submit(Request { first_choice: 1, ..req(prompts[5].clone(), 10, sampled.clone(), Some(99), 2) })
            .unwrap();
        let later = collect(&rx, 2);
        assert_eq!(later[0].0, got[1].0);
        assert_eq!(later[1].0, got[2].0);
    }

    /// tests/data/scheduler_cases.json, the table of scheduler cases that serve's Python engine
    /// runs too (tests/test_scheduler_cases.py): each case is driven one step at a time (step k
    /// at k seconds; requests arrive, are cancelled or time out on the step the case names), and
    /// every step must run the tokens the case lists per request, leave the listed requests
    /// waiting, and end each choice as listed — with the tokens it gets alone (batch invariance:
    /// neither its neighbours nor its chunking change them).
    #[test]
    fn the_scheduler_cases_shared_with_the_python_engine() {
        let doc: Value = serde_json::from_str(include_str!("../../tests/data/scheduler_cases.json")).unwrap();
        let fx = fixture("engine_cases", 2, None, None);
        let model = Arc::new(Model::load(&fx.dir, Quantize::None, 1).unwrap());
        let cases = doc["cases"].as_array().unwrap();
        assert!(cases.len() >= 8);
        for case in cases {
            run_case(&model, case);
        }
    }

    fn run_case(model: &Arc<Model>, case: &Value) {
        let name = case["name"].as_str().unwrap();
        let num = |v: &Value, key: &str, default: u64| v.get(key).map_or(default, |x| x.as_u64().unwrap());
        let l = &case["limits"];
        let lim = Limits::new(
            l["max_batch"].as_i64().unwrap(),
            l["token_budget"].as_i64().unwrap(),
            l["prefill_chunk"].as_i64().unwrap(),
        )
        .unwrap();
        let (_tx, rx) = channel();
        let mut sched = Scheduler::new(model.clone(), None, lim, rx, Arc::new(Mutex::new(Stats::default())));
        let reqs = case["requests"].as_array().unwrap();
        let label = |id: u64| reqs[id as usize - 1]["id"].as_str().unwrap().to_string();
        // request j: prompt of `prompt` ids from its own pattern; greedy unless it names a temperature
        let made: Vec<Request> = reqs
            .iter()
            .enumerate()
            .map(|(j, r)| {
                let len = num(r, "prompt", 0) as u32;
                let temperature = r.get("temperature").map_or(0.0, |t| t.as_f64().unwrap());
                Request {
                    prompt: (0..len).map(|i| (i * 7 + j as u32 * 13 + 1) % 96).collect(),
                    max_new_tokens: num(r, "max_new", 0) as usize,
                    params: SamplingParams { temperature, ..Default::default() },
                    seed: r.get("seed").map(|s| s.as_u64().unwrap()),
                    first_choice: 0,
                    stop_ids: vec![],
                    n: num(r, "n", 1) as usize,
                    top_logprobs: 0,
                    timeout: r.get("timeout").map(|t| Duration::from_secs(t.as_u64().unwrap())),
                    ignore_eos: true,
                }
            })
            .collect();
        let mut rxs: Vec<Option<Receiver<Event>>> = (0..reqs.len()).map(|_| None).collect();
        let steps = case["steps"].as_array().unwrap();
        let t0 = Instant::now();
        let (mut total, mut ran_steps) = (0usize, 0u64);
        // tokens fed per request: its first token comes in the step that feeds the last of its prompt
        let mut fed: Vec<u64> = vec![0; reqs.len()];
        let mut first: Vec<Option<u64>> = vec![None; reqs.len()];
        for k in 0..=steps.len() as u64 {
            let now = t0 + Duration::from_secs(k);
            for (j, r) in reqs.iter().enumerate() {
                let id = j as u64 + 1;
                if num(r, "at", 0) == k {
                    let (tx, rx) = channel();
                    rxs[j] = Some(rx);
                    sched.handle(Cmd::Submit { id, req: made[j].clone(), tx, at: now });
                }
                if r.get("cancel_at").is_some() && num(r, "cancel_at", 0) == k {
                    sched.handle(Cmd::Cancel(id));
                }
                for c in r.get("cancel_choice").and_then(Value::as_array).into_iter().flatten() {
                    let c = c.as_array().unwrap();
                    if c[0].as_u64().unwrap() == k {
                        sched.handle(Cmd::CancelChoice(id, c[1].as_u64().unwrap() as usize));
                    }
                }
            }
            let ran = sched.tick(now);
            let got: BTreeMap<String, u64> = ran.iter().flatten().map(|&(id, t)| (label(id), t as u64)).collect();
            let waiting: Vec<String> = sched.waiting.iter().map(|s| label(s.id)).collect();
            for (j, r) in reqs.iter().enumerate() {
                fed[j] += got.get(r["id"].as_str().unwrap()).copied().unwrap_or(0);
                if first[j].is_none() && num(r, "prompt", 0) > 0 && fed[j] >= num(r, "prompt", 0) {
                    first[j] = Some(k);
                }
            }
            if let Some(step) = steps.get(k as usize) {
                let want: BTreeMap<String, u64> =
                    step["run"].as_object().unwrap().iter().map(|(a, t)| (a.clone(), t.as_u64().unwrap())).collect();
                assert_eq!(got, want, "{name}: step {k} runs");
                let want_waiting: Vec<String> = step
                    .get("waiting")
                    .and_then(Value::as_array)
                    .map_or(vec![], |w| w.iter().map(|x| x.as_str().unwrap().to_string()).collect());
                assert_eq!(waiting, want_waiting, "{name}: waiting after step {k}");
                total += got.values().sum::<u64>() as usize;
                ran_steps += ran.is_some() as u64;
            } else {
                assert!(
                    ran.is_none() && sched.running.is_empty() && waiting.is_empty(),
                    "{name}: idle after its steps"
                );
            }
        }
        let st = sched.stats.lock().unwrap().clone();
        assert_eq!((st.steps, st.prefill_tokens as usize + st.decode_tokens as usize), (ran_steps, total), "{name}");
        assert_eq!((st.running, st.waiting), (0, 0), "{name}");
        if let Some(want) = case.get("first_tokens").and_then(Value::as_array) {
            let mut order: Vec<usize> = (0..reqs.len()).filter(|&j| first[j].is_some()).collect();
            order.sort_by_key(|&j| (first[j], j));
            let got: Vec<String> = order.iter().map(|&j| label(j as u64 + 1)).collect();
            let want: Vec<String> = want.iter().map(|x| x.as_str().unwrap().to_string()).collect();
            assert_eq!(got, want, "{name}: the order of first tokens");
        }
        for (j, r) in reqs.iter().enumerate() {
            let want = r["end"].as_array().unwrap();
            let got = collect(rxs[j].as_ref().unwrap(), want.len());
            for (i, (w, (toks, finish))) in want.iter().zip(&got).enumerate() {
                let w = w.as_array().unwrap();
                let what = format!("{name}: {} choice {i}", label(j as u64 + 1));
                assert_eq!(
                    (toks.len() as u64, finish.name()),
                    (w[0].as_u64().unwrap(), w[1].as_str().unwrap()),
                    "{what}"
                );
                let m = &made[j];
                let own =
                    alone(model, &m.prompt, m.max_new_tokens, m.params.clone(), m.seed.map(|s| choice_seed(s, i)));
                assert_eq!(toks[..], own[..toks.len()], "{what}: its tokens alone");
            }
        }
    }

    /// The thread around the scheduler (the cases above drive the scheduler itself): a timeout
    /// counts from the submission, a dropped receiver frees the batch, bad requests are refused.
    /// Driven one step at a time on this thread, so nothing depends on scheduling: a request whose
    /// stream was dropped before it ran leaves at its first token (sampled in the step that feeds the
    /// last of its prompt), so three of them cost their prefills and no decode.
    #[test]
    fn a_dropped_stream_leaves_at_its_next_token() {
        let fx = fixture("engine_drop", 2, None, None);
        let model = Arc::new(Model::load(&fx.dir, Quantize::None, 1).unwrap());
        let (_cmd, cmds) = channel();
        let stats = Arc::new(Mutex::new(Stats::default()));
        let mut sched = Scheduler::new(model, None, limits(1, 64, 4), cmds, stats.clone());
        let p = SamplingParams { temperature: 1.0, ..Default::default() };
        let t0 = Instant::now();
        for id in 1..=3 {
            let (tx, rx) = channel();
            drop(rx);
            sched.handle(Cmd::Submit { id, req: req(vec![1, 2], 30, p.clone(), Some(1), 1), tx, at: t0 });
        }
        let mut steps = 0;
        while sched.tick(t0).is_some() {
            steps += 1;
            assert!(steps <= 10, "still running after {steps} steps");
        }
        assert!(sched.running.is_empty() && sched.waiting.is_empty());
        let st = stats.lock().unwrap().clone();
        assert_eq!((steps, st.prefill_tokens, st.decode_tokens), (3, 6, 0));
    }

    #[test]
    fn timeout_dropped_streams_and_refusals_through_the_engine_thread() {
        let fx = fixture("engine_cancel", 2, None, None);
        let model = Arc::new(Model::load(&fx.dir, Quantize::None, 1).unwrap());
        let eng = Engine::start(model, None, limits(1, 64, 4)).unwrap();
        assert!(Engine::start(eng.model.clone(), None, limits(4, 64, 0)).is_err());
        let p = SamplingParams { temperature: 1.0, ..Default::default() };
        // dropped streams (how many tokens each ran before its drop depends on the threads' timing: the
        // exact rule is held by a_dropped_stream_leaves_at_its_next_token) do not hold up a later request
        for _ in 0..3 {
            drop(eng.submit(req(vec![1, 2], 30, p.clone(), Some(1), 1)).unwrap().1);
        }
        let (_, rx) = eng.submit(req(vec![1, 2], 3, p.clone(), Some(1), 1)).unwrap();
        assert_eq!(collect(&rx, 1).remove(0).1, Finish::Length);
        let mut r = req(vec![1, 2], 30, p, Some(1), 1);
        r.timeout = Some(Duration::from_nanos(1));
        let (_, rx) = eng.submit(r).unwrap();
        assert_eq!(collect(&rx, 1), vec![(vec![], Finish::Timeout)]);
        let t0 = Instant::now(); // the counters are published after each pass of the scheduler
        while eng.stats().running + eng.stats().waiting > 0 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!((eng.stats().running, eng.stats().waiting), (0, 0));
        // bad requests are refused before anything runs
        assert!(eng.submit(req(vec![], 3, SamplingParams::default(), None, 1)).is_err());
        assert!(eng.submit(req(vec![96], 3, SamplingParams::default(), None, 1)).is_err());
        assert!(eng.submit(req(vec![1; 30], 3, SamplingParams::default(), None, 1)).is_err());
        assert!(eng.submit(req(vec![1], 3, SamplingParams::default(), None, 5)).is_err());
        eng.shutdown();
        assert!(eng.submit(req(vec![1], 3, SamplingParams::default(), None, 1)).is_err());
    }
}
