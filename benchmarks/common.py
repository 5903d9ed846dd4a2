"""``free_port()``: a free TCP port on 127.0.0.1 for a server a benchmark starts (serve_load, hostile_battery,
serve_batching's llama-server)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
