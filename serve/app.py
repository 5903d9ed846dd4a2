"""The HTTP server's entry point: ``uvicorn serve.app:app``.

``app`` is :func:`serve.http.app.create_app` configured from the ``SHALIK_*`` environment variables
(:mod:`serve.http.settings`); the server's parts live in :mod:`serve.http`. This module stays at ``serve.app``
because that is the command the README, the model card and docs/design.md give; it builds the app only when
imported, which is what uvicorn does (tests build their own with ``create_app``).
"""

from __future__ import annotations

import sys

from serve.http.app import create_app
from serve.http.settings import SettingsError

__all__ = ["app"]

try:
    app = create_app()
except SettingsError as e:  # a bad SHALIK_* value: its message alone, not uvicorn's traceback of the import
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
