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


class EpochLoader:
    """A resumable walk over ``n_windows`` items in one order per epoch (module doc): the data position
    ``{"epoch", "offset"}``, :meth:`next_windows` crossing epochs and :meth:`peek_windows`. Subclasses give
    :meth:`window` (item ``i`` as int64 tokens) and may replace :meth:`epoch_order` (default: a permutation drawn
    from ``numpy.random.default_rng([seed, epoch])``) and :meth:`collate` (default: stack equal-length rows)."""

    def __init__(self, n_windows: int, seed: int):
        self.n_windows = n_windows
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    @property
    def position(self) -> dict:
        """The data position: ``{"epoch", "offset"}`` (windows consumed in this epoch)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def set_position(self, position: dict) -> None:
        """Continue from a position saved by :attr:`position`."""
        self.epoch, self.offset = int(position["epoch"]), int(position["offset"])

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The item indices of ``epoch`` in visiting order (a permutation of ``range(n_windows)``)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def order(self, epoch: int) -> np.ndarray:
        """:meth:`epoch_order`, kept for the epoch being read."""
        if self._order_epoch != epoch:
            self._order, self._order_epoch = self.epoch_order(epoch), epoch
        return self._order

    def window(self, i: int) -> np.ndarray:
        """Item ``i`` as int64 tokens (a :mod:`train.windows` row)."""
        raise NotImplementedError

    def collate(self, rows: list[np.ndarray]) -> np.ndarray:
        """One ``[n, L]`` int64 array of ``rows``."""
        return np.stack(rows)

    def next_windows(self, n: int) -> np.ndarray:
        """The next ``n`` windows of the global order as one int64 array (:meth:`collate`); crosses epochs."""
        rows = []
        for _ in range(n):
            if self.offset >= self.n_windows:
                self.epoch += 1
                self.offset = 0
            rows.append(self.window(int(self.order(self.epoch)[self.offset])))
            self.offset += 1
        return self.collate(rows)

    def peek_windows(self, n: int) -> np.ndarray:
        """The next ``n`` windows without moving the position (preflight uses this: it never moves the data)."""
        saved = self.position
        try:
            return self.next_windows(n)
        finally:
            self.set_position(saved)


class TrainLoader(EpochLoader):
    """Deterministic, resumable windows ``[n, seq_len + 1]`` over the train shards of a prepared shard folder."""

    def __init__(self, shard_dir: str | Path, index: dict, seq_len: int, seed: int):
        self.seq_len = seq_len
        self.shards = [open_shard(Path(shard_dir) / name) for name in index["splits"]["train"]["shards"]]
        counts = [max((len(s) - 1) // seq_len, 0) for s in self.shards]
        super().__init__(int(sum(counts)), seed)
        if self.n_windows == 0:
            total = sum(len(s) for s in self.shards)
            raise ValueError(f"the train shards hold {total} tokens: fewer than one window of seq_len + 1 = "
                             f"{seq_len + 1}; add data or lower train.seq_len")
        self._shard_of = np.repeat(np.arange(len(counts)), counts)
        self._first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

    def window(self, i: int) -> np.ndarray:
        s = int(self._shard_of[i])
        start = int(i - self._first[s]) * self.seq_len
        return np.asarray(self.shards[s][start:start + self.seq_len + 1], dtype=np.int64)


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
