"""Preflight: refuse to train until every failure class of the experience report is ruled out.

The report lost its budget to defects no loss curve showed and caught six with one gradient-flow test. Preflight
generalises it to nine checks (names as in docs/design.md, in this order):

1. ``gradient_flow`` — one forward/backward on a real batch: every trainable parameter has a finite gradient
   with norm > 1e-7 (the report's arbiter; candle's fused kernels that emitted no gradient).
2. ``gradient_correctness`` — float64 central differences against autograd on random coordinates of every
   parameter tensor of a tiny copy of the architecture (gradients that are non-zero but wrong).
3. ``update_flow`` — every trainable parameter is in the optimizer exactly once, changes after one step, and
   every optimizer state tensor has its parameter's shape (stale weights; optimizer-state shape drift).
4. ``layout_invariance`` — a non-contiguous view of the batch gives the contiguous batch's logits, and a
   sample's logits do not depend on the other samples of its batch (stride corruption), and every module's backward does not depend on the strides of its inputs or of
   its upstream gradient (float64).
5. ``precision`` — forward/backward under the training dtype (and bf16 autocast) is finite and its loss agrees
   with float32; every norm layer gives finite, correct output on fp16 input of 300 and on small bf16 input
   (fp16/bf16 norm overflow and underflow, case TR6).
6. ``determinism`` — the same batch twice gives the same loss and gradients (stream races).
7. ``learning`` — 30 optimizer steps on one batch cut its loss by at least half.
8. ``throughput`` — tokens/s and, on CUDA, MFU of a training step; a warning below 20 % MFU (the report's
   backward pass ran at 3 %).
9. ``init_loss`` — the step-0 loss on a real batch lies within 1 nat of ln(vocab_size) (the report's random-init
   twin sat at 12.60 nats, above ln V: an init scale that is too large).

Preflight works on deep copies (``gradient_flow`` and ``throughput`` on the model itself, restored after), inside its own RNG scope (``torch.random.fork_rng`` plus saved Python and numpy
states), with a fixed learning rate and one small fixed batch, and never moves the data position: a run with
preflight is bit-identical to one without. Each failing check names the parameters or modules at fault.

One module per check (``gradients``, ``updates``, ``layout``, ``precision``, ``determinism``, ``throughput``,
``init_loss``), the driver in ``runner``, the report in ``report``. Command line (``__main__``): ``python -m
train.preflight [--config C] [--data P...] [--set k=v...]`` (exit 1 on a failed check, 2 on bad input).
"""

from train.preflight.report import CheckResult, PreflightFailed, PreflightReport
from train.preflight.runner import CHECK_NAMES, isolated_rng, run_preflight

__all__ = ["CHECK_NAMES", "CheckResult", "PreflightFailed", "PreflightReport", "isolated_rng", "run_preflight"]
