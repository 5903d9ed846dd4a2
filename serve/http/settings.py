"""HTTP server settings from ``SHALIK_*`` environment variables (docs/design.md "Serving").

=========================== ========================= ==================================================
variable                    default                   meaning
=========================== ========================= ==================================================
SHALIK_MODEL                newest ``runs/*/bundle``  bundle directory
SHALIK_MODEL_NAME           bundle folder's parent    id in /v1/models
SHALIK_BACKEND              ``onnx``                  ``onnx`` or ``rust``
SHALIK_QUANTIZE             ``none``                  a name of contract.quant.NAMES the backend offers
                                                      (contract.quant.BACKEND_NAMES; docs/design.md)
SHALIK_THREADS              all cores                 compute threads (1 to 1024)
SHALIK_API_KEY              unset (no auth)           ``Authorization: Bearer KEY`` on all but /, /health,
                                                      /static/*; printable ASCII, no surrounding whitespace
SHALIK_MAX_CONCURRENCY      16                        sequences stepped together (the engine's batch)
SHALIK_MAX_QUEUE            64                        waiting requests; beyond → 429 with Retry-After
SHALIK_MAX_BODY_BYTES       1048576                   larger body → 413
SHALIK_REQUEST_TIMEOUT_S    120                       → 504
SHALIK_BODY_TIMEOUT_S       30                        longest wait for the next piece of a request body → 408
SHALIK_DEFAULT_MAX_TOKENS   64                        when max_tokens is absent or null
SHALIK_VERIFY               1                         check the bundle's sha256 sums at load (0: skip)
SHALIK_ALLOW_UNGATED        0                         serve a quantized form the export's quality gate did
                                                      not pass (1: load it, logging what it overrides)
=========================== ========================= ==================================================
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

from contract.bundle import MANIFEST
from contract.quant import NAMES, QuantizeError, Scheme, check_backend, parse
from serve.lm import DEFAULT_MAX_NEW_TOKENS
from serve.loader import BACKENDS, MAX_THREADS
from serve.policy import DEFAULT_MAX_BATCH, MAX_BATCH_LIMIT

T = TypeVar("T")


class SettingsError(ValueError):
    """An environment variable with a value the server cannot use (the message names it)."""


def parse_bool(raw: str) -> bool:
    """``1/true/yes/on`` → True, ``0/false/no/off`` → False (any case); ValueError otherwise."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def check_api_key(raw: str | None) -> str | None:
    """``SHALIK_API_KEY`` as the server compares it: None when unset or empty (no auth), else the key itself, which
    must be printable ASCII (U+0021 to U+007E, inner spaces allowed) without surrounding whitespace — what a client
    can send as ``Authorization: Bearer KEY`` (the middleware strips the token and reads the header as latin-1, so any
    other key could never match and every request would be a 401). Raises SettingsError naming the variable and the
    first offending character (never the key: it is a secret)."""
    if not raw:
        return None
    if raw != raw.strip():
        raise SettingsError("SHALIK_API_KEY has leading or trailing whitespace: expected printable ASCII without "
                            "surrounding whitespace (a client sends it as 'Authorization: Bearer KEY')")
    bad = next(((i, c) for i, c in enumerate(raw) if not " " <= c <= "~"), None)
    if bad is not None:
        i, c = bad
        raise SettingsError(f"SHALIK_API_KEY holds U+{ord(c):04X} at character {i}: expected printable ASCII "
                            "(U+0021 to U+007E, inner spaces allowed) without surrounding whitespace, as a bearer "
                            "token is sent")
    return raw


def newest_bundle(runs_dir: str | Path = "runs") -> Path | None:
    """The most recently written ``runs_dir/*/bundle`` (by manifest.json's, else the folder's, mtime)."""
    def stamp(p: Path) -> float:
        m = p / MANIFEST
        return (m if m.exists() else p).stat().st_mtime

    found = [p for p in Path(runs_dir).glob("*/bundle") if p.is_dir()]
    return max(found, key=stamp) if found else None


@dataclass(frozen=True)
class Settings:
    """Everything the HTTP server is configured by. ``model`` None means "no model found";
    ``model_problem`` then says why (shown by /health)."""

    model: Path | None = None
    model_name: str | None = None
    backend: str = "onnx"
    quantize: Scheme | None = None  # parsed here, once (contract.quant.parse); serve.load takes it as it is
    threads: int | None = None
    api_key: str | None = None
    max_concurrency: int = DEFAULT_MAX_BATCH  # the engine's batch (serve.policy)
    max_queue: int = 64
    max_body_bytes: int = 1_048_576
    request_timeout_s: float = 120.0
    body_timeout_s: float = 30.0
    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS
    verify: bool = True
    allow_ungated: bool = False
    model_problem: str | None = None

    @property
    def served_name(self) -> str:
        """The id in /v1/models: SHALIK_MODEL_NAME, else the bundle folder's parent name."""
        if self.model_name:
            return self.model_name
        if self.model is not None:
            return self.model.resolve().parent.name or self.model.name
        return "shalik"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, runs_dir: str | Path = "runs") -> Settings:
        """Read the SHALIK_* variables (``env`` defaults to ``os.environ``). Raises SettingsError naming the
        variable for a malformed value; a missing model is not an error (``model_problem`` says why)."""
        env = os.environ if env is None else env

        defaults = {f.name: f.default for f in fields(cls)}

        def get(key: str, parse: Callable[[str], T], check: Callable[[T], bool], want: str) -> T:
            """``SHALIK_<KEY>`` parsed and checked, else the dataclass's default for ``key``."""
            name = f"SHALIK_{key.upper()}"
            raw = env.get(name, "").strip()
            if not raw:
                return defaults[key]
            try:
                value = parse(raw)
            except ValueError:
                raise SettingsError(f"{name}={raw!r}: expected {want}") from None
            if not check(value):
                raise SettingsError(f"{name}={raw!r}: expected {want}")
            return value

        def positive(v: float) -> bool:
            return v > 0

        backend = get("backend", str.lower, lambda v: v in BACKENDS, " or ".join(BACKENDS))
        quantize = get("quantize", lambda raw: parse(raw, "SHALIK_QUANTIZE"), lambda v: True, "one of " + ", ".join(NAMES))
        try:
            check_backend(quantize, backend, "SHALIK_QUANTIZE")
        except QuantizeError as e:
            raise SettingsError(f"{e} (SHALIK_BACKEND={backend})") from None
        model_raw = env.get("SHALIK_MODEL", "").strip()
        problem = None
        if model_raw:
            model: Path | None = Path(model_raw)
            if not model.is_dir():
                problem = f"SHALIK_MODEL={model_raw!r} is not a directory"
                model = None
        else:
            model = newest_bundle(runs_dir)
            if model is None:
                problem = (f"no model: SHALIK_MODEL is unset and there is no {Path(runs_dir).resolve()}/*/bundle "
                           "(export one with python -m export.onnx runs/NAME)")
        return cls(
            model=model,
            model_name=env.get("SHALIK_MODEL_NAME", "").strip() or None,
            backend=backend,
            quantize=quantize,
            threads=get("threads", int, lambda v: 1 <= v <= MAX_THREADS, f"an integer from 1 to {MAX_THREADS}"),
            api_key=check_api_key(env.get("SHALIK_API_KEY")),
            max_concurrency=get("max_concurrency", int, lambda v: 1 <= v <= MAX_BATCH_LIMIT,
                                f"a positive integer (at most {MAX_BATCH_LIMIT})"),
            max_queue=get("max_queue", int, lambda v: v >= 0, "an integer >= 0"),
            max_body_bytes=get("max_body_bytes", int, positive, "a positive integer"),
            request_timeout_s=get("request_timeout_s", float, positive, "a positive number"),
            body_timeout_s=get("body_timeout_s", float, positive, "a positive number"),
            default_max_tokens=get("default_max_tokens", int, lambda v: v >= 0, "an integer >= 0"),
            verify=get("verify", parse_bool, lambda v: True, "1 or 0 (true/false)"),
            allow_ungated=get("allow_ungated", parse_bool, lambda v: True, "1 or 0 (true/false)"),
            model_problem=problem,
        )
