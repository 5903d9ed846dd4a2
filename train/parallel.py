"""Run a function over a stream of work items in worker processes, results in input order, memory bounded.

``ordered_map(fn, items, workers, initializer, initargs)`` keeps at most ``2 × workers + 2`` items in flight, so a
stream of chunks of a 20 GB corpus never sits in memory at once, and yields ``fn(item)`` in the order of
``items`` — the output cannot depend on the number of workers. ``workers=1`` runs in this process (no pool).

Workers are forked (Linux): a fork starts in milliseconds and shares the parent's imported modules, where a spawned
worker would import torch again under ``train.run``. Each worker runs ``initializer(*initargs)`` once (load the
tokenizer); Hugging Face tokenizers' own thread pool is switched off (``TOKENIZERS_PARALLELISM=false``) while
the map runs, so N workers use N cores, and ``workers=1`` uses one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor


def resolve_workers(n: int | None) -> int:
    """``n`` worker processes, or ``os.cpu_count()`` for 0 / None (``data.num_workers``'s default)."""
    if n is None or n == 0:
        return max(os.cpu_count() or 1, 1)
    if n < 0:
        raise ValueError(f"workers: expected 0 (all cores) or a positive number, got {n}")
    return n


@contextlib.contextmanager
def serial_tokenizers() -> Iterator[None]:
    """Switch Hugging Face tokenizers' internal thread pool off for the duration (one process = one core)."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def ordered_map(fn: Callable, items: Iterable, workers: int, initializer: Callable | None = None,
                initargs: tuple = ()) -> Iterator:
    """``fn(item)`` for every item, in order, computed by ``workers`` processes (``fn`` and the results must be
    picklable; ``items`` is consumed lazily, a few items ahead of the results). An exception in ``fn`` is
    raised here, at that item's place."""
    workers = resolve_workers(workers)
    with serial_tokenizers():
        if workers == 1:
            if initializer is not None:
                initializer(*initargs)
            for item in items:
                yield fn(item)
            return
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=initializer,
                                 initargs=initargs) as pool:
            pending: deque = deque()
            it = iter(items)
            try:
                for item in it:
                    pending.append(pool.submit(fn, item))
                    if len(pending) >= 2 * workers + 2:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for f in pending:
                    f.cancel()
