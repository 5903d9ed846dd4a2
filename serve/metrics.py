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
shalik_in_flight                            gauge     generations running
=========================================== ========= ==================================================
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's metrics (see the module table); :meth:`render` gives Prometheus' text format."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("shalik_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("shalik_prompt_tokens", "Prompt tokens read (incl. the leading <|endoftext|>)",
                                     registry=r)
        self.completion_tokens = Counter("shalik_completion_tokens", "Tokens generated, counted as they are made",
                                         registry=r)
        self.ttft = Histogram("shalik_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.decode_speed = Histogram("shalik_decode_tokens_per_second", "Decode speed of one generation",
                                      buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000), registry=r)
        self.queue_depth = Gauge("shalik_queue_depth", "Requests waiting for a generation slot", registry=r)
        self.in_flight = Gauge("shalik_in_flight", "Generations running", registry=r)

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
