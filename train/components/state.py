"""The counters a run carries from one step to the next and, through ``trainer_state.json``, across a resume."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TrainState:
    """``step``: optimizer steps done; ``tokens``: target tokens seen (all ranks); ``nonfinite``: non-finite steps
    in a row; ``wall_before``: seconds the run spent in earlier sessions (before the resume), ``t_start``: when this
    session started (``time.time()``); ``at_init``: the weights are still the random initialisation (no
    ``--init-from``, no resume, no step); ``dtype``: the compute dtype the steps run in ("float32", "bfloat16"; ""
    before it is settled or in a checkpoint that predates the key), which a resumed ``train.dtype = "auto"`` run
    keeps."""

    step: int = 0
    tokens: int = 0
    nonfinite: int = 0
    wall_before: float = 0.0
    t_start: float = field(default_factory=time.time)
    at_init: bool = True
    dtype: str = ""

    def elapsed(self) -> float:
        """Seconds of training wall time, earlier sessions included."""
        return self.wall_before + (time.time() - self.t_start)
