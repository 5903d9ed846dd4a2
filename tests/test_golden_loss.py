"""Golden losses: 20 optimizer steps of the tiny preset on tests/data/mini (CPU, float32, one thread) must give
exactly the per-step training losses recorded in tests/data/golden/tiny_losses.json, compared as ``float.hex``.

Any change to numerics (model, initialisation, data order, tokenizer, optimizer, schedule, torch) shows here. When
the change is intended, regenerate with ``python -m tests.golden_losses --write`` and say why in the commit.
"""

from __future__ import annotations

import json

import torch

from tests.conftest import ROOT
from tests.golden_losses import GOLDEN, REGENERATE, diff, run_losses


def test_tiny_losses_are_bit_identical_to_golden():
    expected = json.loads(GOLDEN.read_text(encoding="utf-8"))
    threads = torch.get_num_threads()
    actual = run_losses()
    assert torch.get_num_threads() == threads  # the pin to one thread does not leak into the session
    assert len(actual["losses"]) == len(expected["losses"]) == 20
    changes = diff(expected, actual)
    assert not changes, (
        f"training losses differ from {GOLDEN.relative_to(ROOT)}:\n  "
        + "\n  ".join(changes)
        + f"\nIf the change is intended (or torch was upgraded), regenerate with `{REGENERATE}` and say why in"
        " the commit message."
    )
