"""The HTTP server (OpenAI-compatible, ``uvicorn serve.app:app``), along llama.cpp's server lines; everything here
is HTTP-only, the library it serves is the rest of :mod:`serve`:

* :mod:`serve.http.app` — builds the app from its parts (``create_app``); :mod:`serve.app` is the entry point;
* :mod:`serve.http.settings` — the ``SHALIK_*`` environment variables and their defaults;
* :mod:`serve.http.routes` — the transport: endpoints, static files;
* :mod:`serve.http.schemas` — request and response bodies (pydantic; the OpenAPI schema);
* :mod:`serve.http.translate` — OpenAI request → generation parameters, results → OpenAI bodies (pure functions);
* :mod:`serve.http.admission` — generation slots and the bounded queue (429, 504 while waiting);
* :mod:`serve.http.runs` — running an admitted request in a worker thread: deadlines, disconnects, server-sent events;
* :mod:`serve.http.lifecycle` — loading the model and /health;
* :mod:`serve.http.middleware` — API key, body limits, request counting (pure ASGI);
* :mod:`serve.http.metrics` — the Prometheus metrics;
* :mod:`serve.http.errors` — OpenAI's error body and the exception → status mapping;
* :mod:`serve.http.openapi` — the served schema.
"""
