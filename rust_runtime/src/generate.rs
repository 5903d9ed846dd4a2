//! The token loop: prefill the prompt, then sample / decode one token at a time, entirely in
//! Rust. `Generator` is a resumable state machine so that `generate` (collect everything) and
//! `stream` (one token per `__next__`) share the same code and give the same tokens.

use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::sampling::{self, PenaltyState, SamplingParams};
use rand::rngs::StdRng;

pub struct Generator {
    params: SamplingParams,
    rng: StdRng,
    pen: PenaltyState,
    cache: KvCache,
    prompt: Vec<u32>,
    /// the last sampled token, still to be fed to the model
    last: Option<u32>,
    stop_ids: Vec<u32>,
    eot: Option<u32>,
    max_new: usize,
    produced: usize,
    done: bool,
}

impl Generator {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &Model,
        prompt: &[i64],
        max_new_tokens: i64,
        params: SamplingParams,
        seed: Option<u64>,
        stop_ids: &[i64],
        eot: Option<u32>,
    ) -> Result<Self> {
        let ctx = model.cfg.max_position_embeddings;
        if max_new_tokens < 0 {
            return Err(Error::arg(format!("max_new_tokens is {max_new_tokens}; expected an integer >= 0")));
        }
        if prompt.is_empty() {
            return Err(Error::arg("prompt: expected at least one token id, got an empty list"));
        }
        let max_new = max_new_tokens as usize;
        if prompt.len() as u128 + max_new as u128 > ctx as u128 {
            return Err(Error::arg(format!(
                "prompt of {} tokens + max_new_tokens {} = {} exceeds the context length {} \
                 (max_position_embeddings); shorten the prompt or ask for at most {} new tokens",
                prompt.len(),
                max_new,
                prompt.len() as u128 + max_new as u128,
                ctx,
                ctx.saturating_sub(prompt.len())
            )));
        }
        let prompt = model.check_ids(prompt, 0)?;
        let vocab = model.cfg.vocab_size;
        let mut stops = Vec::with_capacity(stop_ids.len());
        for &s in stop_ids {
            if s < 0 || s >= vocab as i64 {
                return Err(Error::arg(format!(
                    "stop id {s} is out of range: expected 0 <= id < vocab_size = {vocab}"
                )));
            }
            stops.push(s as u32);
        }
        let mut pen = PenaltyState::new(vocab);
        for &id in &prompt {
            pen.add_prompt(id);
        }
        Ok(Generator {
            params,
            rng: sampling::make_rng(seed),
            pen,
            cache: model.new_cache(),
            prompt,
            last: None,
            stop_ids: stops,
            eot: eot.filter(|&e| (e as usize) < vocab),
            max_new,
            produced: 0,
            done: max_new == 0,
        })
    }

    /// The next (token id, log-prob under the unmodified model distribution), or None when
    /// generation has ended (end-of-text, a stop id, or max_new_tokens).
    pub fn next_token(&mut self, model: &Model) -> Result<Option<(u32, f32)>> {
        if self.done || self.produced >= self.max_new {
            self.done = true;
            return Ok(None);
        }
        let r = self.step(model);
        if r.is_err() {
            self.done = true;
        }
        r
    }

    fn step(&mut self, model: &Model) -> Result<Option<(u32, f32)>> {
        let logits = match self.last {
            None => model.forward(&mut self.cache, &self.prompt, false)?,
            Some(t) => model.forward(&mut self.cache, &[t], false)?,
        };
        let (tok, max) = sampling::sample_with_max(&logits, &self.params, &self.pen, &mut self.rng)?;
        let lp = sampling::log_prob_with_max(&logits, tok as usize, max) as f32;
        if Some(tok) == self.eot || self.stop_ids.contains(&tok) {
            self.done = true;
            return Ok(None);
        }
        self.produced += 1;
        self.pen.add_generated(tok);
        self.last = Some(tok);
        Ok(Some((tok, lp)))
    }

    pub fn is_done(&self) -> bool {
        self.done || self.produced >= self.max_new
    }
}

/// Run a generator to the end.
pub fn generate_all(model: &Model, g: &mut Generator) -> Result<Vec<(u32, f32)>> {
    let mut out = Vec::new();
    while let Some(t) = g.next_token(model)? {
        out.push(t);
    }
    Ok(out)
}
