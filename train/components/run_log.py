"""What a run writes to ``runs/NAME`` besides its checkpoints (docs/design.md, "The run folder"), rank 0 only:
``config.toml``, ``train.log``, ``metrics.jsonl`` (and its truncation on resume), ``samples.jsonl``,
``preflight.json``, ``loss.png`` and ``summary.json``; the folder's lock; and the throughput meter behind the train rows."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from contract.atomic import atomic_write_json, atomic_write_text
from train.config import Config, to_toml
from train.errors import TrainError
from train.plots import plot_loss, read_metrics


class RunLog:
    """The record files of ``run_dir``. Only the main rank (``is_main``) writes or logs; the others' calls do
    nothing. ``sink`` receives every log line (default: stderr, through tqdm so a progress bar stays intact)."""

    def __init__(self, run_dir: Path, is_main: bool, sink: Callable[[str], None] | None = None):
        self.run_dir = run_dir
        self.is_main = is_main
        self._sink = sink
        self._early: list[str] = []  # lines logged before runs/NAME exists (setup), written first by create()
        self._lock_fd: int | None = None  # runs/NAME's flock, held until the process ends (lock())

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def log(self, msg: str) -> None:
        """To the sink and to runs/NAME/train.log with a timestamp (lines logged before runs/NAME exists are kept
        and written when :meth:`create` makes it)."""
        if not self.is_main:
            return
        if self._sink:
            self._sink(msg)
        else:
            tqdm.write(msg, file=sys.stderr)
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n"
        if self.run_dir.is_dir():
            with open(self.run_dir / "train.log", "a", encoding="utf-8") as f:
                f.write(line)
        else:
            self._early.append(line)

    def ensure_dir(self) -> None:
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def lock(self) -> None:
        """Hold an exclusive lock on runs/NAME until :meth:`unlock` (``flock`` on the folder; the kernel releases it
        when the process ends, even by kill -9), once the folder exists: a second train.run or train.sft on the same run
        folder is refused instead of interleaving its checkpoints and metrics. TrainError when another process
        holds it."""
        if not self.is_main or self._lock_fd is not None or not self.run_dir.is_dir():
            return
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TrainError(f"{self.run_dir} is in use: another train.run or train.sft is writing it. Wait for it "
                             f"to end (or stop it), or use --name NEW") from None
        self._lock_fd = fd

    def unlock(self) -> None:
        """Release :meth:`lock`'s lock (the end of :meth:`train.run.Trainer.train`, however it ends)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def create(self, cfg: Config, fresh: bool = False, init: dict | None = None) -> None:
        """runs/NAME with its config.toml (the resolved config), locked (:meth:`lock`). Called once the data is
        prepared, so that bad input (a missing data path, a corpus without a configured language) leaves no run
        folder behind. ``fresh`` (a run that starts at step 0, not a resume): the metrics, samples and summary of a
        session that stopped before its first checkpoint are removed, not appended to, and ``init`` (the identity
        of the checkpoint the run starts from, :func:`train.components.checkpoint.checkpoint_identity`) is written
        to ``init.json`` (removed when None)."""
        if self.is_main:
            self.ensure_dir()
            self.lock()
            if fresh:
                for name in ("metrics.jsonl", "samples.jsonl", "summary.json", "init.json"):
                    (self.run_dir / name).unlink(missing_ok=True)
                if init is not None:
                    atomic_write_json(self.run_dir / "init.json", init)
            atomic_write_text(self.run_dir / "config.toml", to_toml(cfg))
            if self._early:
                with open(self.run_dir / "train.log", "a", encoding="utf-8") as f:
                    f.writelines(self._early)
                self._early = []

    def append_metrics(self, row: dict) -> None:
        """One row of metrics.jsonl (``kind`` "train" or "eval"), flushed."""
        if self.is_main:
            self._append(self.metrics_path, [row])

    def metrics(self) -> list[dict]:
        """The rows of metrics.jsonl so far (a torn last line is ignored)."""
        return read_metrics(self.metrics_path)

    def truncate_metrics(self, step: int) -> None:
        """On resume: drop the rows of steps after ``step`` (logged by the interrupted session past its last
        checkpoint, and about to be logged again), atomically."""
        if self.is_main:
            rows = [r for r in self.metrics() if r.get("step", 0) <= step]
            atomic_write_text(self.metrics_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    def append_samples(self, step: int, samples: list[dict]) -> None:
        """``{step, prompt, lang, text}`` rows of samples.jsonl."""
        if self.is_main:
            self._append(self.run_dir / "samples.jsonl", [{"step": step, **s} for s in samples])

    def write_preflight(self, report) -> None:
        """preflight.json (``report.to_dict()``) and the report's summary in the log (the table when a check
        failed)."""
        if self.is_main:
            atomic_write_json(self.run_dir / "preflight.json", report.to_dict())
            self.log(report.summary())

    def plot(self, title: str) -> None:
        """loss.png from metrics.jsonl."""
        if self.is_main:
            plot_loss(self.metrics_path, self.run_dir / "loss.png", title=title)

    def read_summary(self) -> dict:
        """The run's summary.json as written last, or ``{}`` when there is none or it is not a JSON object."""
        try:
            data = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write_summary(self, summary: dict, title: str, finished: bool = True) -> None:
        """summary.json and the final loss.png; logs the validation NLL against the random-init twin's and the
        totals when the run is ``finished`` (a run stopped by a signal says so itself: ``Trainer.train``)."""
        if not self.is_main:
            return
        atomic_write_json(self.run_dir / "summary.json", summary)
        self.plot(title)
        if not finished:
            return
        ri = summary["random_init"]
        if summary["val"] and ri:
            self.log("val NLL vs the random-init twin: " + ", ".join(
                f"{k} {v['nll']:.3f} vs {ri[k]['nll']:.3f}" for k, v in summary["val"].items() if k in ri))
        self.log(f"done: {summary['steps']} steps, {summary['tokens']:,} tokens in {summary['wall_s'] / 60:.1f} min "
                 f"→ {self.run_dir}")

    @staticmethod
    def _append(path: Path, rows: list[dict]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()


class Throughput:
    """Tokens per second and MFU over a window of steps: :meth:`add` each step's tokens, :meth:`measure` at a log
    step (which starts a new window), :meth:`exclude_pause` after an evaluation or a checkpoint so its time does
    not count. MFU = ``flops_per_token`` × tokens/s ÷ ``peak_flops`` (None without a known peak)."""

    def __init__(self, flops_per_token: float, peak_flops: float | None):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.tokens_per_s: float | None = None
        self.mfu: float | None = None
        self._t0 = time.time()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def measure(self) -> tuple[float, float | None]:
        """(tokens/s, MFU) of the window since the last measure; both are also kept as the latest figures."""
        dt = max(time.time() - self._t0, 1e-9)
        self.tokens_per_s = self._tokens / dt
        self.mfu = self.flops_per_token * self.tokens_per_s / self.peak_flops if self.peak_flops else None
        self._t0, self._tokens = time.time(), 0
        return self.tokens_per_s, self.mfu

    def exclude_pause(self) -> None:
        self._t0 = time.time()
