"""The Rust backend: a Shalik bundle served by the ``rust_runtime`` extension (no torch, no Python in
the token loop when ``generate``/``stream`` are used; one Rust call per step through ``Sequence``).

Build the extension once with ``pip install ./rust_runtime`` (see rust_runtime/README.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np

from contract.quant import Scheme
from serve.backends.base import BackendError, check_ids, check_scheme
from serve.policy import DEFAULT_MAX_BATCH, DEFAULT_TOKEN_BUDGET

try:  # the extension is optional: serve works with the onnx backend without it
    import rust_runtime as _rr
except ImportError as _e:  # pragma: no cover - exercised only where the extension is absent
    _rr = None
    _IMPORT_ERROR: ImportError | None = _e
else:
    _IMPORT_ERROR = None

BUILD_HINT = (
    "the Rust backend needs the rust_runtime extension, which is not importable here "
    "({err}). Build and install it from the repository root with: pip install ./rust_runtime "
    "(needs a Rust toolchain; see rust_runtime/README.md), or use backend='onnx'."
)


def _as_backend_error(e: ValueError) -> BackendError:
    return e if isinstance(e, BackendError) else BackendError(str(e))


class RustSequence:
    """One sequence's KV cache, held in Rust. Implements serve.backends.base.Sequence."""

    def __init__(self, seq, backend: RustBackend):
        self._seq = seq
        self._backend = backend

    @property
    def position(self) -> int:
        return self._seq.position

    def prefill(self, ids: Seq[int], all_logits: bool = False) -> np.ndarray:
        b = self._backend
        ids = check_ids(ids, b.vocab_size, self._seq.position, b.max_position_embeddings)
        try:
            return self._seq.prefill(ids, all_logits)
        except ValueError as e:
            raise _as_backend_error(e) from e

    def decode(self, token_id: int) -> np.ndarray:
        b = self._backend
        (tid,) = check_ids([token_id], b.vocab_size, self._seq.position, b.max_position_embeddings)
        try:
            return self._seq.decode(tid)
        except ValueError as e:
            raise _as_backend_error(e) from e

    def reset(self) -> None:
        self._seq.reset()


class RustBackend:
    """Weights in Rust (f32, or quantized at load: ``quantize`` a :class:`contract.quant.Scheme` parsed by the
    caller; the schemes rust_runtime offers are :data:`contract.quant.BACKEND_NAMES` ``["rust"]``;
    ``rust_runtime.Model.load`` reads the scheme's name once more, at its own boundary) plus a factory of KV caches. A quantized form loads only
    when the export's quality gate passed it (``rust_runtime.Model.load``, :mod:`serve.verdict`), unless
    ``allow_ungated``."""

    name = "rust"

    def __init__(
        self,
        path: str | Path,
        quantize: Scheme | None = None,
        threads: int | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        allow_ungated: bool = False,
    ):
        if _rr is None:
            raise ImportError(BUILD_HINT.format(err=_IMPORT_ERROR)) from _IMPORT_ERROR
        scheme = check_scheme(quantize)
        self.path = Path(path)
        # serve.load checks the manifest's sha256 sums itself (contract.bundle, with its verify setting), so the
        # extension's own check (rust_runtime.Model.load(verify=True)) would hash every file a second time; the
        # manifest's format_version and the gate's verdict on the quantized form are checked by the extension.
        self.model = _rr.Model.load(str(self.path), threads=threads, quantize=scheme.name if scheme else None, verify=False,
                                    allow_ungated=allow_ungated)
        self.vocab_size: int = self.model.vocab_size
        self.max_position_embeddings: int = self.model.max_position_embeddings
        self.quantize: str = self.model.quantize
        self.threads: int = self.model.threads
        self.eot_id: int | None = self.model.eot_id
        self.max_batch, self.token_budget = max_batch, token_budget
        self._engine = None
        self._engine_lock = threading.Lock()

    @property
    def engine(self):
        """The continuous-batching ``rust_runtime.Engine`` over this model (started on first use, sized
        ``max_batch`` / ``token_budget``): concurrent ``generate``/``stream``/``generate_batch`` calls — and every
        generation of :mod:`serve` — are stepped together."""
        return self.start_engine(self.max_batch, self.token_budget)

    def start_engine(self, max_batch: int, token_budget: int):
        """The model's one ``rust_runtime.Engine``: started now with these limits, or the running one (whose
        limits were fixed when it started)."""
        with self._engine_lock:
            if self._engine is None:
                self.max_batch, self.token_budget = max_batch, token_budget
                self._engine = _rr.Engine(self.model, max_batch=max_batch, token_budget=token_budget)
            return self._engine

    def close_engine(self, engine) -> None:
        """Close ``engine`` (its running requests end "cancelled") and forget it, so that the next
        :meth:`start_engine` starts a fresh one instead of handing back a stopped engine."""
        with self._engine_lock:
            if self._engine is engine:
                self._engine = None
        engine.close()

    def new_sequence(self) -> RustSequence:
        return RustSequence(self.model.new_sequence(), self)

    # ---- extras beyond the Backend protocol: the whole token loop in Rust

    def logits(self, ids: Seq[int]) -> np.ndarray:
        ids = check_ids(ids, self.vocab_size, 0, self.max_position_embeddings)
        try:
            return self.model.logits(ids)
        except ValueError as e:
            raise _as_backend_error(e) from e

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def detokenize(self, ids: Seq[int]) -> str:
        return self.model.decode([int(i) for i in ids])

    def generate(self, ids: Seq[int], max_new_tokens: int, **sampling) -> list[tuple[int, float]]:
        """[(token id, log-prob)] through the engine (rust_runtime.Model.generate's keyword arguments; the same
        tokens as Model.generate, bit for bit, since the engine's forward is batch-invariant)."""
        return list(self.stream(ids, max_new_tokens, **sampling))

    def generate_batch(self, prompts: Seq[Seq[int]], max_new_tokens: int, **sampling) -> list[list[tuple[int, float]]]:
        """One [(token id, log-prob)] per prompt, all submitted at once so that they share the engine's steps."""
        streams = [self._submit(ids, max_new_tokens, sampling) for ids in prompts]
        return [list(self._tokens(s)) for s in streams]

    def stream(self, ids: Seq[int], max_new_tokens: int, **sampling) -> Iterator[tuple[int, float]]:
        """(token id, log-prob) one at a time; closing the iterator early cancels the request in the engine."""
        return self._tokens(self._submit(ids, max_new_tokens, sampling))

    def _submit(self, ids: Seq[int], max_new_tokens: int, sampling: dict):
        ids = check_ids(ids, self.vocab_size, 0, self.max_position_embeddings)
        try:
            return self.engine.submit(ids, max_new_tokens, **sampling)
        except ValueError as e:
            raise _as_backend_error(e) from e

    @staticmethod
    def _tokens(stream) -> Iterator[tuple[int, float]]:
        for _index, tok, logprob, _top, finish in stream:
            if finish is None:
                yield tok, logprob
            elif finish.startswith("error"):
                raise BackendError(f"the rust engine failed: {finish}")

    def __repr__(self) -> str:
        return f"RustBackend({self.model!r})"
