//! The engine's scheduling policy: the defaults, the limits and the pure planning step.
//!
//! `serve/policy.py` is the same policy for serve's Python engine (`serve.engine.StepEngine`), and
//! both engines run the one table of cases in `tests/data/scheduler_cases.json` (here in
//! `engine::tests`, there in `tests/test_scheduler_cases.py`); `tests/test_engine.py` checks that
//! these defaults equal Python's. Each step of the engine is: retire (cancelled and timed-out
//! requests leave), plan ([`plan_step`], which never runs the model: vLLM's scheduler), run the
//! model on the planned tokens, sample, post the events.

use crate::error::{Error, Result};

/// Sequences stepped together: where more streams stop paying for their inter-token latency
/// (benchmarks/results/serve_batching.md).
pub const DEFAULT_MAX_BATCH: usize = 16;
/// Tokens per step, decodes plus prompt chunks (llama.cpp's n_batch).
pub const DEFAULT_TOKEN_BUDGET: usize = 256;
/// Prompt tokens in a step that also decodes: a cap on how much a step beside decodes grows, so
/// arriving prompts do not stall the streams (benchmarks/results/serve_batching_prefill_chunk.md).
pub const DEFAULT_PREFILL_CHUNK: usize = 16;
/// The most sequences one engine steps together.
pub const MAX_BATCH_LIMIT: usize = 4096;
/// The most tokens (`token_budget`, `prefill_chunk`) one step may carry.
pub const MAX_TOKEN_BUDGET: usize = 1 << 20;

/// An engine's size: `max_batch` sequences a step, `token_budget` tokens a step, at most
/// `prefill_chunk` prompt tokens in a step that also decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_batch: usize,
    pub token_budget: usize,
    pub prefill_chunk: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_batch: DEFAULT_MAX_BATCH,
            token_budget: DEFAULT_TOKEN_BUDGET,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
}

impl Limits {
    /// Checked limits (as `serve.policy.check_engine_limits`): `max_batch` in
    /// [1, MAX_BATCH_LIMIT], `token_budget` and `prefill_chunk` in [1, MAX_TOKEN_BUDGET].
    /// Takes i64 so that a negative value from Python is named, not wrapped.
    pub fn new(max_batch: i64, token_budget: i64, prefill_chunk: i64) -> Result<Self> {
        let check = |name: &str, v: i64, hi: usize| -> Result<usize> {
            if v >= 1 && v as u64 <= hi as u64 {
                Ok(v as usize)
            } else {
                Err(Error::arg(format!("{name} is {v}; expected an integer >= 1 (at most {hi})")))
            }
        };
        Ok(Limits {
            max_batch: check("max_batch", max_batch, MAX_BATCH_LIMIT)?,
            token_budget: check("token_budget", token_budget, MAX_TOKEN_BUDGET)?,
            prefill_chunk: check("prefill_chunk", prefill_chunk, MAX_TOKEN_BUDGET)?,
        })
    }
}

/// Where a request stands (vLLM's RequestStatus, llama.cpp server's slot states): `Waiting` in
/// the queue; `Prefilling` in the batch, one sequence whose cache the prompt enters chunk by chunk
/// (holding a slot per open choice); then each choice `Decoding`, fed `last` every step, until it
/// ends (it then leaves the batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Waiting,
    Prefilling,
    Decoding { last: u32 },
}

/// What the planner sees of a queued request or a batch entry: `slots`, the sequences it holds
/// (its open choices while waiting or prefilling, 1 when decoding); `prompt_left`, the prompt
/// tokens not yet in its cache (0: it decodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub slots: usize,
    pub prompt_left: usize,
}

/// One step's work: the first `admit` waiting entries join the batch after the running ones
/// (batch = running ++ waiting[..admit]); `decode`: batch indices that decode one token;
/// `prefill`: (batch index, prompt tokens) chunks in batch order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub admit: usize,
    pub decode: Vec<usize>,
    pub prefill: Vec<(usize, usize)>,
}

/// Prompt tokens a step may take beside `decoding` decode tokens: the whole `token_budget` when
/// nothing decodes, else `prefill_chunk` capped by what the decodes leave of the budget.
pub fn prefill_budget(limits: &Limits, decoding: usize) -> usize {
    if decoding == 0 {
        limits.token_budget
    } else {
        limits.prefill_chunk.min(limits.token_budget.saturating_sub(decoding))
    }
}

/// The work of one step, given the queue in arrival order and the batch in admission order:
/// admit first come, first served while the slots fit in `max_batch` (a request that does not
/// fit waits, and so does everything behind it); every decoding entry decodes; then prompt
/// chunks in batch order under [`prefill_budget`]. Pure. Assumes every entry's slots ≤
/// max_batch (`Engine::submit` refuses a larger n), so the queue always drains.
pub fn plan_step(waiting: &[Entry], running: &[Entry], limits: &Limits) -> Plan {
    let mut used: usize = running.iter().map(|e| e.slots).sum();
    let mut admit = 0;
    for e in waiting {
        if used + e.slots > limits.max_batch {
            break;
        }
        used += e.slots;
        admit += 1;
    }
    let batch = || running.iter().chain(&waiting[..admit]).enumerate();
    let decode: Vec<usize> = batch().filter(|(_, e)| e.prompt_left == 0).map(|(i, _)| i).collect();
    let mut budget = prefill_budget(limits, decode.len());
    let mut prefill = Vec::new();
    for (i, e) in batch() {
        if e.prompt_left > 0 && budget > 0 {
            let take = e.prompt_left.min(budget);
            budget -= take;
            prefill.push((i, take));
        }
    }
    Plan { admit, decode, prefill }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(slots: usize, prompt_left: usize) -> Entry {
        Entry { slots, prompt_left }
    }

    #[test]
    fn the_prefill_budget_is_the_token_budget_alone_else_the_chunk_capped_by_the_decodes() {
        let l = |t, c| Limits { max_batch: 16, token_budget: t, prefill_chunk: c };
        assert_eq!(prefill_budget(&l(64, 4), 0), 64);
        assert_eq!(prefill_budget(&l(64, 4), 3), 4);
        assert_eq!(prefill_budget(&l(10, 16), 7), 3);
        assert_eq!(prefill_budget(&l(10, 16), 12), 0);
    }

    #[test]
    fn admission_is_fifo_and_a_request_that_does_not_fit_blocks_the_queue() {
        let l = Limits { max_batch: 3, token_budget: 8, prefill_chunk: 2 };
        // running: one decoding choice; waiting: n = 3 (does not fit beside it), then n = 1
        let p = plan_step(&[e(3, 5), e(1, 2)], &[e(1, 0)], &l);
        assert_eq!(p, Plan { admit: 0, decode: vec![0], prefill: vec![] });
        // nothing running: n = 3 fills the batch, the prompt takes the whole budget
        let p = plan_step(&[e(3, 10), e(1, 2)], &[], &l);
        assert_eq!(p, Plan { admit: 1, decode: vec![], prefill: vec![(0, 8)] });
        // beside two decodes: chunks of at most prefill_chunk in batch order
        let p = plan_step(&[e(1, 1)], &[e(1, 0), e(1, 3), e(1, 0)], &Limits { max_batch: 4, ..l });
        assert_eq!(p, Plan { admit: 1, decode: vec![0, 2], prefill: vec![(1, 2)] });
    }

    #[test]
    fn limits_are_checked_with_the_name_and_the_range() {
        assert_eq!(Limits::new(16, 256, 16).unwrap(), Limits::default());
        for (b, t, c, name) in [
            (0, 1, 1, "max_batch"),
            (4097, 1, 1, "max_batch"),
            (1, -3, 1, "token_budget"),
            (1, 1, 0, "prefill_chunk"),
            (1, 1, 1 << 21, "prefill_chunk"),
        ] {
            let msg = Limits::new(b, t, c).unwrap_err().to_string();
            assert!(msg.contains(name), "{msg}");
        }
    }
}
