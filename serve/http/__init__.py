"""The HTTP server's parts, along llama.cpp's server lines (``serve/app.py`` assembles them):

* :mod:`serve.http.routes` — the transport: endpoints, static files;
* :mod:`serve.http.translate` — OpenAI request → generation parameters, results → OpenAI bodies (pure functions);
* :mod:`serve.http.runs` — slots, deadlines, disconnects, streaming a run as server-sent events;
* :mod:`serve.http.lifecycle` — loading the model and /health;
* :mod:`serve.http.errors` — OpenAI's error body and the exception → status mapping;
* :mod:`serve.http.openapi` — the served schema.
"""
