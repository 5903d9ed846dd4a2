"""The server's model lifecycle: load the bundle in a background thread at start-up, answer 503 (with the reason)
until it is loaded or when it cannot be, and hold what every route shares (settings, metrics, admission)."""

from __future__ import annotations

import logging
import threading
import time

from contract.bundle import BundleError, read_manifest
from serve.http.admission import Admission
from serve.http.errors import HTTPError
from serve.http.metrics import Metrics
from serve.http.schemas import Health
from serve.http.settings import Settings
from serve.lm import LM
from serve.loader import load
from serve.verdict import form_name, forms_summary

log = logging.getLogger("shalik.serve")


def gate_forms(bundle) -> dict[str, bool | None] | None:
    """``{form: passed}`` from the bundle's quality gate (:func:`serve.verdict.forms_summary`; None without a
    readable manifest)."""
    try:
        return forms_summary(read_manifest(bundle)) if bundle is not None else None
    except BundleError:
        return None


class ServerState:
    """The app's model (loaded lazily), settings, metrics and admission control."""

    def __init__(self, settings: Settings, lm: LM | None):
        self.settings = settings
        self.lm = lm
        self.metrics = Metrics()
        self.problem: str | None = None if lm is not None else settings.model_problem
        if lm is None and settings.model is None and self.problem is None:
            self.problem = "no model configured (set SHALIK_MODEL to a bundle folder)"
        self.loading = False
        self._forms: tuple[LM, dict | None] | None = None
        if lm is not None:
            lm.configure_engine(settings.max_concurrency)
            self.metrics.watch_engine(lambda: lm.engine.stats())
        self._admission: Admission | None = None
        self.created = int(time.time())
        if settings.model_name:
            self.name = settings.model_name
        elif lm is not None and settings.model is None:
            self.name = lm.name
        else:
            self.name = settings.served_name

    @property
    def admission(self) -> Admission:
        """Admission control, created on first use inside the running event loop."""
        if self._admission is None:
            s = self.settings
            self._admission = Admission(s.max_concurrency, s.max_queue, self.metrics)
        return self._admission

    def startup(self) -> None:
        """At server start (inside its loop): fresh admission control, and start loading the model."""
        s = self.settings
        self._admission = Admission(s.max_concurrency, s.max_queue, self.metrics)
        if self.problem is not None:
            log.error("no model will be served: %s (/health answers 503 with this)", self.problem)
        self.start_loading()

    def start_loading(self) -> None:
        """Load the bundle in a background thread (no-op when a model is present or cannot be found)."""
        if self.lm is not None or self.problem is not None or self.loading:
            return
        self.loading = True
        threading.Thread(target=self._load, name="shalik-load", daemon=True).start()

    def _load(self) -> None:
        s = self.settings
        try:
            self.lm = load(s.model, backend=s.backend, quantize=s.quantize, threads=s.threads, name=self.name,
                           verify=s.verify, max_batch=s.max_concurrency, allow_ungated=s.allow_ungated)
            lm = self.lm
            self.metrics.watch_engine(lambda: lm.engine.stats())
        except Exception as e:  # reported by /health; the server keeps answering
            self.problem = f"loading {s.model} with the {s.backend} backend failed: {type(e).__name__}: {e}"
            log.error("%s (/health answers 503 with this)", self.problem)
        finally:
            self.loading = False

    def require_lm(self) -> LM:
        """The model, or HTTPError 503 (loading / unavailable, with the reason)."""
        if self.lm is not None:
            return self.lm
        self.start_loading()  # in case the app runs without its lifespan
        if self.problem is not None:
            raise HTTPError(503, f"no model is available: {self.problem}", code="model_not_loaded")
        raise HTTPError(503, "the model is still loading; retry shortly", code="model_loading",
                        headers={"Retry-After": "1"})

    def check_model(self, model: str | None) -> None:
        """HTTPError 404 unless ``model`` is None or the served id."""
        if model is not None and model != self.name:
            raise HTTPError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                            param="model", code="model_not_found")

    def limits(self) -> tuple[int, int] | None:
        """(vocab_size, context_length) of the loaded model, or None while there is none."""
        return None if self.lm is None else (self.lm.vocab_size, self.lm.context_length)

    def health(self) -> tuple[int, Health]:
        """The /health status code and body."""
        if self.lm is not None:
            lm = self.lm
            backend, quantize = getattr(lm.backend, "name", None), getattr(lm.backend, "quantize", None) or "none"
            if self._forms is None or self._forms[0] is not lm:  # read once per model
                self._forms = (lm, gate_forms(lm.path))
            forms = self._forms[1]
            return 200, Health(status="ok", model=self.name, backend=backend, quantize=quantize,
                               vocab_size=lm.vocab_size, context_length=lm.context_length, quantized_forms=forms,
                               ungated=quantize != "none" and (forms or {}).get(form_name(backend, quantize)) is not True)
        if self.problem is not None:
            return 503, Health(status="unavailable", model=self.name, detail=self.problem)
        return 503, Health(status="loading", model=self.name, detail=f"loading {self.settings.model}")
