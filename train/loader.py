"""Training and validation batches from token shards, with a data position that resumes exactly.

Training windows: every train shard is cut into windows of ``seq_len + 1`` tokens at stride ``seq_len`` (inputs
are the first ``seq_len`` tokens, targets the last ``seq_len``). Each epoch visits all windows in the order of a
permutation drawn from ``numpy.random.default_rng([seed, epoch])``, so the data position is two integers
(``epoch``, ``offset``) and a resumed run draws the same order for the epoch it resumes in (case TR4).

A global step consumes ``micro_batch_size × grad_accum × world_size`` consecutive windows of that order; rank r
takes micro-batches ``r·grad_accum … (r+1)·grad_accum − 1`` of them, so the set of windows in a step does not
depend on how it is split across processes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from train.shards import open_shard


class TrainLoader:
    """Deterministic, resumable windows over the train shards of a prepared shard folder."""

    def __init__(self, shard_dir: str | Path, index: dict, seq_len: int, seed: int):
        self.seq_len = seq_len
        self.seed = seed
        self.shards = [open_shard(Path(shard_dir) / name) for name in index["splits"]["train"]["shards"]]
        counts = [max((len(s) - 1) // seq_len, 0) for s in self.shards]
        self.n_windows = int(sum(counts))
        if self.n_windows == 0:
            total = sum(len(s) for s in self.shards)
            raise ValueError(f"the train shards hold {total} tokens: fewer than one window of seq_len + 1 = "
                             f"{seq_len + 1}; add data or lower train.seq_len")
        self._shard_of = np.repeat(np.arange(len(counts)), counts)
        self._first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.epoch = 0
        self.offset = 0
        self._perm_epoch = -1
        self._perm = None

    @property
    def position(self) -> dict:
        """The data position: ``{"epoch", "offset"}`` (windows consumed in this epoch)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def set_position(self, position: dict) -> None:
        """Continue from a position saved by :attr:`position`."""
        self.epoch, self.offset = int(position["epoch"]), int(position["offset"])

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def _window(self, w: int) -> np.ndarray:
        s = int(self._shard_of[w])
        start = int(w - self._first[s]) * self.seq_len
        return np.asarray(self.shards[s][start:start + self.seq_len + 1], dtype=np.int64)

    def next_windows(self, n: int) -> np.ndarray:
        """The next ``n`` windows of the global order as int64 ``[n, seq_len + 1]``; crosses epochs as needed."""
        out = np.empty((n, self.seq_len + 1), dtype=np.int64)
        for i in range(n):
            if self.offset >= self.n_windows:
                self.epoch += 1
                self.offset = 0
            out[i] = self._window(int(self._order(self.epoch)[self.offset]))
            self.offset += 1
        return out

    def peek_windows(self, n: int) -> np.ndarray:
        """The next ``n`` windows without moving the position (preflight uses this: it never moves the data)."""
        saved = self.position
        try:
            return self.next_windows(n)
        finally:
            self.set_position(saved)


def step_batches(windows: np.ndarray, micro_batch_size: int, grad_accum: int, rank: int = 0) -> list[np.ndarray]:
    """Split a global step's windows ``[micro·accum·world, seq+1]`` into this rank's ``grad_accum`` micro-batches."""
    per_rank = micro_batch_size * grad_accum
    mine = windows[rank * per_rank:(rank + 1) * per_rank]
    return [mine[k * micro_batch_size:(k + 1) * micro_batch_size] for k in range(grad_accum)]


def val_windows(shard: np.ndarray, seq_len: int, max_tokens: int) -> list[np.ndarray]:
    """Windows of up to ``seq_len + 1`` tokens from the start of a val shard, stride ``seq_len``, until
    ``max_tokens`` targets are covered (the last window may be shorter; a shard under 2 tokens gives none)."""
    out = []
    start = 0
    covered = 0
    n = len(shard)
    while start + 1 < n and covered < max_tokens:
        w = np.asarray(shard[start:start + seq_len + 1], dtype=np.int64)
        out.append(w)
        covered += len(w) - 1
        start += seq_len
    return out
