//! Sampling exactly as docs/design.md "Serving" defines it, in this order:
//! repetition penalty (over prompt + generated ids, each id once: a positive logit is divided by
//! it, a negative one multiplied), presence/frequency penalties (over generated ids only:
//! `logit -= presence·[count>0] + frequency·count`), then a temperature below
//! [`GREEDY_TEMPERATURE`] (0 included) → greedy (ties to the lower id), else divide by the
//! temperature, top_k (0 = off, every id tied with the k-th value kept, as Hugging Face's
//! `TopKLogitsWarper` and vLLM do), top_p (the smallest set whose probability reaches top_p,
//! never empty, so top_p = 0 is the top token), and a draw from a generator seeded per sequence.
//! Probabilities are exp((z - max) / T), so no temperature can overflow; sums are accumulated in
//! f64. The penalties' ranges ([`REPETITION_PENALTY_RANGE`], [`PENALTY_RANGE`]) keep a model's
//! logits finite in f32; a logit pushed past f32 anyway gets the largest finite value.
//!
//! The Python sampler `serve/sampling.py` implements the same order and edges; the tests of
//! `tests/test_sampling.py` run against both (this one through `rust_runtime.Sampler`).

use crate::error::{Error, Result};
use crate::kernels;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// repetition_penalty's range, both ends included (1 = off): serve/sampling.py's
/// `REPETITION_PENALTY_RANGE` (tests/test_sampling.py checks they agree). Within it a penalty
/// scales a logit by at most 10, so a model's logits stay finite in f32 and this sampler computes
/// what the f64 Python one does (a penalty of 1e-45 tied every penalised logit at f32::MAX here).
pub const REPETITION_PENALTY_RANGE: (f64, f64) = (0.1, 10.0);

/// presence_penalty's and frequency_penalty's range, both ends included (0 = off): OpenAI's,
/// serve/sampling.py's `PENALTY_RANGE`.
pub const PENALTY_RANGE: (f64, f64) = (-2.0, 2.0);

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    /// Build from the Python-facing values, refusing anything non-finite or out of range.
    pub fn new(
        temperature: f64,
        top_k: i64,
        top_p: f64,
        presence_penalty: f64,
        frequency_penalty: f64,
        repetition_penalty: f64,
    ) -> Result<Self> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(Error::arg(format!(
                "temperature is {temperature}; expected a finite number >= 0 (0 = greedy)"
            )));
        }
        if top_k < 0 {
            return Err(Error::arg(format!("top_k is {top_k}; expected an integer >= 0 (0 = off)")));
        }
        if !(top_p.is_finite() && (0.0..=1.0).contains(&top_p)) {
            return Err(Error::arg(format!("top_p is {top_p}; expected 0 <= top_p <= 1 (1 = off, 0 = the top token)")));
        }
        let (lo, hi) = REPETITION_PENALTY_RANGE;
        if !(repetition_penalty.is_finite() && (lo..=hi).contains(&repetition_penalty)) {
            return Err(Error::arg(format!(
                "repetition_penalty is {repetition_penalty:?}; expected a number from {lo} to {hi} (1 = off)"
            )));
        }
        let (lo, hi) = PENALTY_RANGE;
        for (name, v) in [("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)] {
            if !(v.is_finite() && (lo..=hi).contains(&v)) {
                return Err(Error::arg(format!("{name} is {v:?}; expected a number from {lo} to {hi} (0 = off)")));
            }
        }
        Ok(SamplingParams {
            temperature,
            top_k: top_k as usize,
            top_p,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
        })
    }
}

/// Which ids the penalties look at.
#[derive(Clone)]
pub struct PenaltyState {
    /// ids seen in prompt + generated (repetition penalty), as a flag per id and a list
    seen: Vec<bool>,
    seen_list: Vec<u32>,
    /// generated-only counts (presence / frequency)
    counts: Vec<u32>,
    gen_list: Vec<u32>,
}

impl PenaltyState {
    pub fn new(vocab: usize) -> Self {
        PenaltyState { seen: vec![false; vocab], seen_list: vec![], counts: vec![0; vocab], gen_list: vec![] }
    }
    /// The vocabulary size it was made for.
    pub fn vocab(&self) -> usize {
        self.seen.len()
    }
    pub fn add_prompt(&mut self, id: u32) {
        if let Some(s) = self.seen.get_mut(id as usize) {
            if !*s {
                *s = true;
                self.seen_list.push(id);
            }
        }
    }
    pub fn add_generated(&mut self, id: u32) {
        self.add_prompt(id);
        if let Some(c) = self.counts.get_mut(id as usize) {
            if *c == 0 {
                self.gen_list.push(id);
            }
            *c += 1;
        }
    }

    /// Apply the repetition, presence and frequency penalties to `logits` in place.
    pub fn apply(&self, p: &SamplingParams, logits: &mut [f32]) {
        if p.repetition_penalty != 1.0 {
            for &id in &self.seen_list {
                if let Some(l) = logits.get_mut(id as usize) {
                    let v = *l as f64;
                    let z = if v > 0.0 { v / p.repetition_penalty } else { v * p.repetition_penalty };
                    // a tiny penalty pushes a logit past f32: its limit is the largest finite value
                    *l = z.clamp(-(f32::MAX as f64), f32::MAX as f64) as f32;
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for &id in &self.gen_list {
                let c = self.counts[id as usize];
                if let Some(l) = logits.get_mut(id as usize) {
                    let pen = p.presence_penalty * ((c > 0) as u8 as f64) + p.frequency_penalty * c as f64;
                    // -inf stays -inf; a finite logit pushed past f32 gets the largest finite value
                    let z = *l as f64 - pen;
                    *l = if z.is_finite() { z.clamp(-(f32::MAX as f64), f32::MAX as f64) as f32 } else { z as f32 };
                }
            }
        }
    }
}

/// Refuse logits the model should never produce: any NaN or +inf, or all -inf. Returns the max.
pub fn check_logits(logits: &[f32]) -> Result<f32> {
    if logits.is_empty() {
        return Err(Error::Numerical("the model returned no logits".into()));
    }
    let (m, bad) = kernels::max_and_bad(logits);
    if bad {
        let i = logits.iter().position(|v| !(*v < f32::INFINITY)).unwrap_or(0);
        return Err(Error::Numerical(format!(
            "the model produced a non-finite logit ({}) for token {i}; refusing to sample",
            logits[i]
        )));
    }
    if m == f32::NEG_INFINITY {
        return Err(Error::Numerical("every logit is -inf; nothing can be sampled".into()));
    }
    Ok(m)
}

/// log Σ exp(logits - max) (logits already checked, `max` = their maximum).
fn log_sum_exp_shifted(logits: &[f32], max: f32) -> f64 {
    kernels::sum_exp_shifted(logits, max).ln()
}

/// log softmax(logits)[id] (logits already checked, `max` = their maximum).
pub fn log_prob_with_max(logits: &[f32], id: usize, max: f32) -> f64 {
    (logits[id] - max) as f64 - log_sum_exp_shifted(logits, max)
}

/// log softmax(logits) for every id, as [`log_prob_with_max`] computes each (logits already
/// checked, `max` = their maximum); `-inf` logits give `-inf`.
pub fn log_softmax(logits: &[f32], max: f32) -> Vec<f64> {
    let lse = log_sum_exp_shifted(logits, max);
    logits.iter().map(|&v| (v - max) as f64 - lse).collect()
}

/// The `n` most likely ids under log softmax(logits) (`max` = their maximum), most likely
/// first, ties to the lower id: (id, log-prob).
pub fn top_logprobs(logits: &[f32], n: usize, max: f32) -> Vec<(u32, f32)> {
    let lse = log_sum_exp_shifted(logits, max);
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let n = n.min(ids.len());
    if n == 0 {
        return vec![];
    }
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, desc);
    }
    ids.truncate(n);
    ids.sort_unstable_by(desc);
    ids.into_iter().map(|i| (i, ((logits[i as usize] - max) as f64 - lse) as f32)).collect()
}

/// log softmax(logits)[id].
pub fn log_prob(logits: &[f32], id: usize) -> f64 {
    let (m, _) = kernels::max_and_bad(logits);
    log_prob_with_max(logits, id, m)
}

/// Greedy: the largest value, ties to the lowest index. None when everything is -inf/NaN.
pub fn argmax(x: &[f32]) -> Option<usize> {
    let (m, _) = kernels::max_and_bad(x);
    if m == f32::NEG_INFINITY || m.is_nan() {
        return None;
    }
    x.iter().position(|&v| v == m)
}

pub fn make_rng(seed: Option<u64>) -> StdRng {
    match seed {
        Some(s) => StdRng::seed_from_u64(s),
        None => StdRng::from_rng(&mut rand::rng()),
    }
}

/// Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): 0 is the argmax, and a tiny
/// positive temperature is its limit, the same argmax with ties to the lower id, whatever the
/// float precision of the logits. serve/sampling.py uses the same constant.
pub const GREEDY_TEMPERATURE: f64 = 1e-5;

/// True when `temperature` samples as its limit 0: below [`GREEDY_TEMPERATURE`].
pub fn is_greedy(temperature: f64) -> bool {
    temperature < GREEDY_TEMPERATURE
}

/// One sequence's sampling state, as the engine keeps it per sequence: the parameters, the
/// penalty state (prompt ids seen, generated-token counts) and the seeded generator.
/// [`Sampler::sample`] is [`sample`] followed by recording the token as generated.
pub struct Sampler {
    pub params: SamplingParams,
    pub pen: PenaltyState,
    pub rng: StdRng,
}

impl Sampler {
    /// `vocab` = the logits' length; `prompt` ids (each < vocab) count for the repetition penalty.
    pub fn new(params: SamplingParams, vocab: usize, prompt: &[u32], seed: Option<u64>) -> Self {
        let mut pen = PenaltyState::new(vocab);
        for &id in prompt {
            pen.add_prompt(id);
        }
        Sampler { params, pen, rng: make_rng(seed) }
    }

    /// The next token from raw logits `[vocab]`, recorded as generated for the penalties.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let tok = sample(logits, &self.params, &self.pen, &mut self.rng)?;
        self.pen.add_generated(tok);
        Ok(tok)
    }
}

/// Choose the next token from raw model logits (penalties, temperature, top_k, top_p, draw).
pub fn sample(raw: &[f32], p: &SamplingParams, pen: &PenaltyState, rng: &mut StdRng) -> Result<u32> {
    sample_with_max(raw, p, pen, rng).map(|(tok, _)| tok)
}

/// `sample`, also returning the maximum of the raw logits (what `check_logits` returns), so that
/// the caller's log-probabilities need no second pass to find it.
pub fn sample_with_max(raw: &[f32], p: &SamplingParams, pen: &PenaltyState, rng: &mut StdRng) -> Result<(u32, f32)> {
    let max = check_logits(raw)?;
    sample_checked(raw, max, p, pen, rng).map(|tok| (tok, max))
}

fn sample_checked(raw: &[f32], max: f32, p: &SamplingParams, pen: &PenaltyState, rng: &mut StdRng) -> Result<u32> {
    let penalized = p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
    if is_greedy(p.temperature) && !penalized {
        // the raw logits are the candidates: the first position of their (checked, finite) maximum
        return Ok(raw.iter().position(|&v| v == max).unwrap_or(0) as u32);
    }
    let mut z = raw.to_vec();
    pen.apply(p, &mut z);
    if is_greedy(p.temperature) {
        // top_k / top_p keep the maximum, so greedy is the argmax after the penalties.
        return argmax(&z)
            .map(|i| i as u32)
            .ok_or_else(|| Error::Numerical("every logit is -inf after the penalties".into()));
    }
    let n = z.len();
    if p.top_k > 0 && p.top_k < n {
        let mut tmp = z.clone();
        let kth = {
            let (_, kth, _) = tmp.select_nth_unstable_by(p.top_k - 1, |a, b| b.total_cmp(a));
            *kth
        };
        for v in z.iter_mut() {
            if *v < kth {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    let (m, _) = kernels::max_and_bad(&z);
    if m == f32::NEG_INFINITY {
        return Err(Error::Numerical("every logit is -inf after the penalties".into()));
    }
    // softmax((z - m) / T): the shifted values are <= 0, so no temperature can overflow
    let inv_t = (1.0 / p.temperature) as f32;
    for v in z.iter_mut() {
        *v = kernels::exp_approx((*v - m) * inv_t);
    }
    let mut probs = z;
    let total: f64 = probs.iter().map(|&q| q as f64).sum();
    if p.top_p < 1.0 {
        top_p_filter(&mut probs, total, p.top_p);
    }
    let total: f64 = probs.iter().map(|&q| q as f64).sum();
    let target = rng.random::<f64>() * total;
    let mut acc = 0.0f64;
    let mut last = None;
    for (i, &q) in probs.iter().enumerate() {
        if q > 0.0 {
            acc += q as f64;
            last = Some(i);
            if acc > target {
                return Ok(i as u32);
            }
        }
    }
    last.map(|i| i as u32).ok_or_else(|| Error::Numerical("no token left to sample".into()))
}

/// Zero every weight outside the smallest set (by descending weight, ties to the lower id)
/// whose share of `total` reaches `top_p`. The most likely token is always kept.
pub fn top_p_filter(weights: &mut [f32], total: f64, top_p: f64) {
    let mut cand: Vec<(u32, f32)> =
        weights.iter().enumerate().filter(|(_, &q)| q > 0.0).map(|(i, &q)| (i as u32, q)).collect();
    if cand.is_empty() {
        return;
    }
    let goal = top_p * total;
    let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    // Sort only a growing prefix: the nucleus is usually far smaller than the vocabulary.
    let mut k = 64.min(cand.len());
    let keep = loop {
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, desc);
        }
        cand[..k].sort_unstable_by(desc);
        let mut acc = 0.0f64;
        let mut found = None;
        for (j, &(_, q)) in cand[..k].iter().enumerate() {
            acc += q as f64;
            if acc >= goal {
                found = Some(j + 1);
                break;
            }
        }
        match found {
            Some(n) => break n,
            None if k == cand.len() => break k, // rounding: the whole support
            None => k = (k * 4).min(cand.len()),
        }
    };
    let keep = keep.max(1);
    let mut mask = vec![false; weights.len()];
    for &(i, _) in &cand[..keep] {
        mask[i as usize] = true;
    }
    for (q, &keep) in weights.iter_mut().zip(&mask) {
        if !keep {
            *q = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn penalties(rep: f64, pres: f64, freq: f64) -> SamplingParams {
        SamplingParams {
            repetition_penalty: rep,
            presence_penalty: pres,
            frequency_penalty: freq,
            ..Default::default()
        }
    }

    #[test]
    fn s1_repetition_penalty_pushes_negative_logits_down() {
        let mut st = PenaltyState::new(3);
        st.add_prompt(0);
        st.add_prompt(1);
        let mut z = vec![2.0f32, -2.0, 0.5];
        st.apply(&penalties(1.5, 0.0, 0.0), &mut z);
        assert!((z[0] - 4.0 / 3.0).abs() < 1e-6);
        assert_eq!(z[1], -3.0);
        assert_eq!(z[2], 0.5);
        let mut z = vec![2.0f32, -2.0, 0.5];
        st.apply(&penalties(1.0, 0.0, 0.0), &mut z);
        assert_eq!(z, vec![2.0, -2.0, 0.5]);
    }

    #[test]
    fn s4_presence_frequency_count_generated_only() {
        let mut st = PenaltyState::new(10);
        for _ in 0..3 {
            st.add_prompt(7);
        }
        for id in [5, 5, 9] {
            st.add_generated(id);
        }
        let mut z = vec![0.0f32; 10];
        st.apply(&penalties(1.0, 1.0, 0.5), &mut z);
        assert_eq!(z[5], -2.0);
        assert_eq!(z[9], -1.5);
        assert_eq!(z[7], 0.0);
        assert!(z.iter().enumerate().all(|(i, &v)| [5, 9].contains(&i) || v == 0.0));
        let mut z = vec![0.0f32; 10];
        st.apply(&penalties(1.0, 0.0, 0.0), &mut z);
        assert!(z.iter().all(|&v| v == 0.0));
        // the repetition penalty does look at the prompt
        let mut z = vec![1.0f32; 10];
        st.apply(&penalties(2.0, 0.0, 0.0), &mut z);
        assert_eq!(z[7], 0.5);
        assert_eq!(z[0], 1.0);
    }

    #[test]
    fn s3_temperature_zero_is_greedy_with_ties_to_lower_id() {
        let pen = PenaltyState::new(4);
        let p = SamplingParams { temperature: 0.0, ..Default::default() };
        for seed in 1..=5 {
            let mut rng = make_rng(Some(seed));
            assert_eq!(sample(&[1.0, 3.0, 3.0, -1.0], &p, &pen, &mut rng).unwrap(), 1);
        }
        // tiny temperature: no inf / NaN, still the argmax
        let p = SamplingParams { temperature: 1e-7, ..Default::default() };
        let logits: Vec<f32> = (0..512).map(|i| ((i * 7919) % 997) as f32 / 100.0).collect();
        let best = argmax(&logits).unwrap() as u32;
        for seed in 1..=5 {
            let mut rng = make_rng(Some(seed));
            assert_eq!(sample(&logits, &p, &pen, &mut rng).unwrap(), best);
        }
        // penalties still apply before the argmax
        let mut pen = PenaltyState::new(4);
        pen.add_generated(1);
        let p = SamplingParams { temperature: 0.0, presence_penalty: 1.0, ..Default::default() };
        assert_eq!(sample(&[1.0, 3.0, 3.0, -1.0], &p, &pen, &mut make_rng(Some(0))).unwrap(), 2);
    }

    /// A reproducible pseudo-normal 4096-way logit vector.
    fn logits_4096(seed: u64) -> Vec<f32> {
        let mut rng = make_rng(Some(seed));
        (0..4096)
            .map(|_| {
                let u1: f64 = rng.random::<f64>().max(1e-12);
                let u2: f64 = rng.random();
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            })
            .collect()
    }

    #[test]
    fn s2_tiny_top_p_keeps_the_top_token() {
        let pen = PenaltyState::new(4096);
        let logits = logits_4096(0);
        let logits16: Vec<f32> = logits.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        for l in [&logits, &logits16] {
            let best = argmax(l).unwrap() as u32;
            for top_p in [1e-8, 1e-4, 1e-3] {
                let p = SamplingParams { temperature: 0.8, top_p, ..Default::default() };
                for seed in 0..20 {
                    assert_eq!(sample(l, &p, &pen, &mut make_rng(Some(seed))).unwrap(), best, "top_p {top_p}");
                }
            }
            // top_p 1.0 disables the filter: 20 draws are not all the argmax
            let p = SamplingParams { temperature: 0.8, top_p: 1.0, ..Default::default() };
            let draws: Vec<u32> = (0..20).map(|s| sample(l, &p, &pen, &mut make_rng(Some(s))).unwrap()).collect();
            assert!(draws.iter().any(|&d| d != best));
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_top_p() {
        // weights need not be normalised: 1, 4, 3, 2 out of 10
        let mut w = vec![1.0f32, 4.0, 3.0, 2.0];
        top_p_filter(&mut w, 10.0, 0.7);
        assert_eq!(w, vec![0.0, 4.0, 3.0, 0.0]);
        let mut w = vec![1.0f32, 4.0, 3.0, 2.0];
        top_p_filter(&mut w, 10.0, 0.71);
        assert_eq!(w, vec![0.0, 4.0, 3.0, 2.0]);
        // ties broken towards the lower id
        let mut w = vec![0.25f32; 4];
        top_p_filter(&mut w, 1.0, 0.5);
        assert_eq!(w, vec![0.25, 0.25, 0.0, 0.0]);
        // large flat distribution: exercises the growing-prefix path
        let n = 5000;
        let mut w: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32).collect();
        let total: f64 = w.iter().map(|&q| q as f64).sum();
        let orig = w.clone();
        top_p_filter(&mut w, total, 0.9);
        let kept: f64 = w.iter().map(|&q| q as f64).sum::<f64>() / total;
        assert!(kept >= 0.9);
        let min_kept = w.iter().zip(&orig).filter(|(q, _)| **q > 0.0).map(|(_, o)| *o).fold(f32::MAX, f32::min);
        let max_dropped = w.iter().zip(&orig).filter(|(q, _)| **q == 0.0).map(|(_, o)| *o).fold(0.0, f32::max);
        assert!(min_kept >= max_dropped);
        // dropping the smallest kept token would fall below top_p
        assert!(kept - (min_kept as f64) / total < 0.9);
    }

    #[test]
    fn top_k_keeps_k_best_and_ties() {
        let pen = PenaltyState::new(5);
        let p = SamplingParams { temperature: 1.0, top_k: 2, ..Default::default() };
        let l = [0.0f32, 5.0, 1.0, 4.9, -3.0];
        for seed in 0..50 {
            let t = sample(&l, &p, &pen, &mut make_rng(Some(seed))).unwrap();
            assert!(t == 1 || t == 3, "{t}");
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let pen = PenaltyState::new(4096);
        let l = logits_4096(3);
        let p = SamplingParams { temperature: 1.0, top_p: 0.95, top_k: 100, ..Default::default() };
        let a: Vec<u32> =
            (0..10).map(|_| 0).scan(make_rng(Some(42)), |r, _| Some(sample(&l, &p, &pen, r).unwrap())).collect();
        let b: Vec<u32> =
            (0..10).map(|_| 0).scan(make_rng(Some(42)), |r, _| Some(sample(&l, &p, &pen, r).unwrap())).collect();
        let c: Vec<u32> =
            (0..10).map(|_| 0).scan(make_rng(Some(43)), |r, _| Some(sample(&l, &p, &pen, r).unwrap())).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn bad_logits_and_params_are_errors() {
        let pen = PenaltyState::new(3);
        let p = SamplingParams::default();
        let mut rng = make_rng(Some(0));
        assert!(sample(&[f32::NAN, 1.0, 0.0], &p, &pen, &mut rng).is_err());
        assert!(sample(&[f32::NEG_INFINITY; 3], &p, &pen, &mut rng).is_err());
        let g = SamplingParams { temperature: 0.0, ..Default::default() };
        assert!(sample(&[f32::NEG_INFINITY; 3], &g, &pen, &mut rng).is_err());
        assert!(SamplingParams::new(f64::NAN, 0, 1.0, 0.0, 0.0, 1.0).is_err());
        assert!(SamplingParams::new(-1.0, 0, 1.0, 0.0, 0.0, 1.0).is_err());
        assert!(SamplingParams::new(1.0, -1, 1.0, 0.0, 0.0, 1.0).is_err());
        assert!(SamplingParams::new(1.0, 0, -0.1, 0.0, 0.0, 1.0).is_err());
        assert!(SamplingParams::new(1.0, 0, 1.5, 0.0, 0.0, 1.0).is_err());
        assert!(SamplingParams::new(1.0, 0, 1.0, f64::NAN, 0.0, 1.0).is_err());
        assert!(SamplingParams::new(1.0, 0, 1.0, 0.0, 0.0, 0.0).is_err());
        assert!(SamplingParams::new(0.0, 0, 1e-8, 0.0, 0.0, 1.0).is_ok());
        // the penalties' ranges, both ends included
        let (lo, hi) = REPETITION_PENALTY_RANGE;
        for rep in [1e-45, 1e-39, 5e-324, lo * 0.99, hi * 1.01, f64::INFINITY] {
            let e = SamplingParams::new(0.0, 0, 1.0, 0.0, 0.0, rep).unwrap_err().to_string();
            assert!(e.contains("repetition_penalty") && e.contains("from 0.1 to 10"), "{e}");
        }
        assert!(SamplingParams::new(0.0, 0, 1.0, 0.0, 0.0, lo).is_ok());
        assert!(SamplingParams::new(0.0, 0, 1.0, 0.0, 0.0, hi).is_ok());
        let (lo, hi) = PENALTY_RANGE;
        for v in [lo - 0.01, hi + 0.01, 1e39] {
            assert!(SamplingParams::new(0.0, 0, 1.0, v, 0.0, 1.0)
                .unwrap_err()
                .to_string()
                .contains("presence_penalty"));
            assert!(SamplingParams::new(0.0, 0, 1.0, 0.0, v, 1.0)
                .unwrap_err()
                .to_string()
                .contains("frequency_penalty"));
        }
        assert!(SamplingParams::new(0.0, 0, 1.0, lo, hi, 1.0).is_ok());
    }

    #[test]
    fn edge_values_behave_as_their_limit() {
        // temperature 1e-310 raised "no token left to sample"
        let l = [1.0f32, 3.0, 2.5, -1.0];
        let pen = PenaltyState::new(4);
        for t in [1e-310, 1e-45, 5e-324] {
            let p = SamplingParams::new(t, 0, 1.0, 0.0, 0.0, 1.0).unwrap();
            for seed in 0..10 {
                assert_eq!(sample(&l, &p, &pen, &mut make_rng(Some(seed))).unwrap(), 1, "temperature {t}");
            }
        }
        // the smallest repetition penalty: seen positive logits times 10, negative ones a tenth
        let mut pen = PenaltyState::new(4);
        pen.add_prompt(2);
        pen.add_prompt(3);
        let p = SamplingParams::new(0.0, 0, 1.0, 0.0, 0.0, REPETITION_PENALTY_RANGE.0).unwrap();
        let mut z = l.to_vec();
        pen.apply(&p, &mut z);
        assert_eq!(z, vec![1.0, 3.0, 25.0, -0.1]);
        assert_eq!(sample(&l, &p, &pen, &mut make_rng(None)).unwrap(), 2);
        // new() refuses a vanishing penalty; should one get here, a logit past f32 is its largest value
        let tiny = SamplingParams { repetition_penalty: 5e-324, ..p.clone() };
        let mut z = l.to_vec();
        pen.apply(&tiny, &mut z);
        assert_eq!(z, vec![1.0, 3.0, f32::MAX, -0.0]);
        // top_p = 0 keeps the top token (ties to the lower id), as the Python sampler does
        let p = SamplingParams::new(1.0, 0, 0.0, 0.0, 0.0, 1.0).unwrap();
        let pen = PenaltyState::new(4);
        for seed in 0..10 {
            assert_eq!(sample(&[0.5, 2.0, 2.0, 1.9], &p, &pen, &mut make_rng(Some(seed))).unwrap(), 1);
        }
    }

    #[test]
    fn below_greedy_temperature_ties_go_to_the_lower_id() {
        let pen = PenaltyState::new(4);
        let l = [1.0f32, 3.0, 3.0, -1.0];
        for t in [0.0, 1e-6, 1e-300, GREEDY_TEMPERATURE / 2.0] {
            let p = SamplingParams::new(t, 0, 1.0, 0.0, 0.0, 1.0).unwrap();
            for seed in 0..20 {
                assert_eq!(sample(&l, &p, &pen, &mut make_rng(Some(seed))).unwrap(), 1, "temperature {t}");
            }
        }
        // at the threshold it samples: both tied maxima come up
        let p = SamplingParams::new(GREEDY_TEMPERATURE, 0, 1.0, 0.0, 0.0, 1.0).unwrap();
        let got: std::collections::BTreeSet<u32> =
            (0..40).map(|s| sample(&l, &p, &pen, &mut make_rng(Some(s))).unwrap()).collect();
        assert_eq!(got.into_iter().collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn a_huge_frequency_penalty_leaves_a_finite_logit() {
        // the only finite logit, penalised past f32 (a penalty new() refuses, or a logit near f32::MAX):
        // the largest negative value, still sampleable
        let mut pen = PenaltyState::new(3);
        pen.add_generated(0);
        let p = SamplingParams { temperature: 0.0, frequency_penalty: 1e39, ..Default::default() };
        let mut z = vec![0.0f32, f32::NEG_INFINITY, f32::NEG_INFINITY];
        pen.apply(&p, &mut z);
        assert_eq!(z, vec![-f32::MAX, f32::NEG_INFINITY, f32::NEG_INFINITY]);
        assert_eq!(sample(&[0.0, f32::NEG_INFINITY, f32::NEG_INFINITY], &p, &pen, &mut make_rng(None)).unwrap(), 0);
        // a negative one cannot overflow to +inf either
        let p = SamplingParams { presence_penalty: -1e39, ..Default::default() };
        let mut z = vec![1.0f32, 0.0, 0.0];
        pen.apply(&p, &mut z);
        assert_eq!(z, vec![f32::MAX, 0.0, 0.0]);
    }

    #[test]
    fn sampler_records_generated_tokens() {
        let p = SamplingParams::new(0.0, 0, 1.0, 2.0, 0.0, 1.0).unwrap();
        let mut s = Sampler::new(p, 3, &[], None);
        let l = [1.0f32, 0.5, 0.0];
        let got: Vec<u32> = (0..3).map(|_| s.sample(&l).unwrap()).collect();
        assert_eq!(got, vec![0, 1, 2]);
        // the prompt counts for the repetition penalty only
        let p = SamplingParams::new(0.0, 0, 1.0, 0.0, 0.0, 4.0).unwrap();
        let mut s = Sampler::new(p, 3, &[0], None);
        assert_eq!(s.sample(&l).unwrap(), 1);
    }

    #[test]
    fn log_softmax_matches_log_prob() {
        let l = [1.0f32, 3.0, 3.0, f32::NEG_INFINITY];
        let m = check_logits(&l).unwrap();
        let all = log_softmax(&l, m);
        for (i, &v) in all.iter().enumerate().take(3) {
            assert_eq!(v, log_prob_with_max(&l, i, m));
        }
        assert_eq!(all[3], f64::NEG_INFINITY);
        let s: f64 = all.iter().map(|v| v.exp()).sum();
        assert!((s - 1.0).abs() < 1e-6, "{s}");
    }

    #[test]
    fn log_prob_is_normalised() {
        let l = [1.0f32, 2.0, 3.0];
        let s: f64 = (0..3).map(|i| log_prob(&l, i).exp()).sum();
        assert!((s - 1.0).abs() < 1e-6, "{s}");
        let want = 2.0f64 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((log_prob(&l, 1) - want).abs() < 1e-6);
    }
}
