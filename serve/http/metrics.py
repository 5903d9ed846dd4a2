"""Prometheus metrics of the HTTP server, in their own registry (one per app, so tests do not collide).

=========================================== ========= ==================================================
name                                        type      meaning
=========================================== ========= ==================================================
shalik_requests_total{endpoint,status}      counter   HTTP requests answered
shalik_prompt_tokens_total                  counter   prompt tokens read (incl. the leading end-of-text)
shalik_completion_tokens_total              counter   tokens generated (counted as they are made)
shalik_time_to_first_token_seconds          histogram request arrival → first generated token
shalik_decode_tokens_per_second             histogram per generation, tokens after the first / time
shalik_queue_depth                          gauge     requests waiting for a generation slot
shalik_in_flight                            gauge     requests holding a generation slot
shalik_engine_running_sequences             gauge     sequences in the engine's batch (prefilling or decoding)
shalik_engine_waiting_sequences             gauge     sequences queued in the engine for a place in the batch
shalik_engine_steps_total                   counter   engine steps (one forward over the batch each)
shalik_engine_prefill_tokens_total          counter   prompt tokens the engine prefilled
shalik_engine_decode_tokens_total           counter   tokens the engine decoded (one per sequence per step)
shalik_engine_last_step_tokens              gauge     tokens in the last step (prefill + decode)
shalik_engine_queue_wait_seconds_total      counter   submission → first step, summed over requests
shalik_engine_admitted_total                counter   requests that took part in a step
=========================================== ========= ==================================================

Tokens per step = (prefill + decode tokens) / steps; mean queue wait = queue_wait_seconds / admitted. The
engine's figures are read from ``engine.stats()`` at each scrape (:meth:`Metrics.watch_engine`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from contract.bundle import EOT

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metrics (see the module table); :meth:`render` gives Prometheus' text format."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("shalik_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("shalik_prompt_tokens", f"Prompt tokens read (incl. the leading {EOT})",
                                     registry=r)
        self.completion_tokens = Counter("shalik_completion_tokens", "Tokens generated, counted as they are made",
                                         registry=r)
        self.ttft = Histogram("shalik_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.decode_speed = Histogram("shalik_decode_tokens_per_second", "Decode speed of one generation",
                                      buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)
        self.queue_depth = Gauge("shalik_queue_depth", "Requests waiting for a generation slot", registry=r)
        self.in_flight = Gauge("shalik_in_flight", "Requests holding a generation slot", registry=r)
        self._engine_stats: Callable[[], dict] | None = None
        r.register(_EngineCollector(self))

    def watch_engine(self, stats: Callable[[], dict] | None) -> None:
        """Report the engine counters from ``stats()`` (``serve.engine`` engines' ``stats``) at every scrape."""
        self._engine_stats = stats

    def observe_generation(self, arrived_at: float, first_token_at: float | None, finished_at: float | None,
                           tokens: int) -> None:
        """Record TTFT (seconds since ``arrived_at``, ``time.perf_counter()`` clock) and decode speed."""
        if first_token_at is None:
            return
        self.ttft.observe(max(0.0, first_token_at - arrived_at))
        if finished_at is not None and tokens > 1 and finished_at > first_token_at:
            self.decode_speed.observe((tokens - 1) / (finished_at - first_token_at))

    def render(self) -> bytes:
        """All metrics in Prometheus' text exposition format."""
        return generate_latest(self.registry)


ENGINE_GAUGES = {"running": ("shalik_engine_running_sequences", "Sequences in the engine's batch"),
                 "waiting": ("shalik_engine_waiting_sequences", "Sequences queued for a place in the batch"),
                 "last_step_tokens": ("shalik_engine_last_step_tokens", "Tokens in the engine's last step")}
ENGINE_COUNTERS = {"steps": ("shalik_engine_steps", "Engine steps (one forward over the batch)"),
                   "prefill_tokens": ("shalik_engine_prefill_tokens", "Prompt tokens prefilled by the engine"),
                   "decode_tokens": ("shalik_engine_decode_tokens", "Tokens decoded by the engine"),
                   "queue_wait_s": ("shalik_engine_queue_wait_seconds", "Submission to first step, summed"),
                   "admitted": ("shalik_engine_admitted", "Requests that took part in an engine step")}


class _EngineCollector:
    """The engine's counters as Prometheus families, read when scraped (nothing before an engine exists)."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def describe(self):
        return []

    def collect(self):
        stats_fn = self._metrics._engine_stats
        stats = stats_fn() if stats_fn is not None else {}
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0)))
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
