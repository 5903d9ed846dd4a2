"""Golden losses: 20 optimizer steps of the tiny preset on tests/data/mini (CPU, float32, one thread) must give
exactly the per-step training losses recorded in tests/data/golden/tiny_losses.json for this environment (torch
version + CPU), compared as ``float.hex``; on a CPU without a record, within ``FOREIGN_RTOL`` of the first record.

Any change to numerics (model, initialisation, data order, tokenizer, optimizer, schedule, torch) shows here. When
the change is intended, regenerate with ``python -m tests.golden_losses --write`` and say why in the commit.
"""

from __future__ import annotations

import torch

from tests.conftest import ROOT
from tests.golden_losses import FOREIGN_RTOL, GOLDEN, REGENERATE, diff, environment, pick, read_records, run_losses


def test_tiny_losses_are_bit_identical_to_golden():
    threads = torch.get_num_threads()
    actual = run_losses()
    assert torch.get_num_threads() == threads  # the pin to one thread does not leak into the session
    expected, same = pick(read_records(), actual)
    assert expected is not None, f"{GOLDEN.relative_to(ROOT)} has no record; write one with `{REGENERATE}`"
    assert len(actual["losses"]) == len(expected["losses"]) == 20
    changes = diff(expected, actual, 0.0 if same else FOREIGN_RTOL)
    where = "bit for bit" if same else f"within {FOREIGN_RTOL:g} (no record of {environment(actual)})"
    assert not changes, (
        f"training losses differ from {GOLDEN.relative_to(ROOT)} ({where}):\n  "
        + "\n  ".join(changes)
        + f"\nIf the change is intended (or torch was upgraded), regenerate with `{REGENERATE}` and say why in"
        " the commit message."
    )


def test_foreign_environment_tolerates_last_bits_only():
    """On a CPU without a record the comparison allows ISA noise (4e-7 seen) but not a numerics change."""
    rec = {"preset": "tiny", "torch": "t", "cpu": "x86_64 AVX512 A", "num_threads": 1, "settings": {},
           "losses": [{"step": 1, "hex": (6.0).hex()}]}
    noisy = {**rec, "cpu": "x86_64 AVX2 B", "losses": [{"step": 1, "hex": (6.0 + 4e-7).hex()}]}
    changed = {**noisy, "losses": [{"step": 1, "hex": (6.0 + 1e-3).hex()}]}
    assert pick([rec], noisy) == (rec, False) and pick([noisy, rec], rec) == (rec, True)
    assert diff(rec, noisy, FOREIGN_RTOL) == [] and len(diff(rec, noisy)) == 1
    assert len(diff(rec, changed, FOREIGN_RTOL)) == 1
