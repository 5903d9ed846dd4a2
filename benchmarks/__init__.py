"""Shalik's benchmarks: one script per figure (``python benchmarks/NAME.py``, or ``python -m benchmarks.NAME`` from
the repository root), their tables and plots in ``results/``.

The scripts share four modules and never load each other:

* :mod:`benchmarks.timing` — how a figure is timed: interleaved rounds, the quiet pause, medians and per-round
  ratios, load average and RSS, one engine per worker process;
* :mod:`benchmarks.roofline` — the physical limits beside a figure (memory bandwidth, GEMM peak) and the work a
  model does (matmul weights, prefill FLOPs);
* :mod:`benchmarks.bundles` — the models: the presets of ``configs/``, built by ``train.run`` and
  ``export.onnx`` as a user would build them;
* :mod:`benchmarks.lanes` — the runtimes × quantization kinds a script can time, loaded as serving loads them.

A script run by path puts the repository root on ``sys.path`` first (``python benchmarks/x.py`` starts with the
``benchmarks/`` folder there instead).
"""
