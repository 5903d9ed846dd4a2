"""The facts more than one stage reads, with one owner each: the bundle contract (:mod:`contract.bundle`), the
quantization schemes (:mod:`contract.quant`), the byte-level table and special tokens (:mod:`contract.byte_level`),
the chat format (:mod:`contract.chat_format`), text normalisation, language and split (:mod:`contract.text`),
atomic writes (:mod:`contract.atomic`), what the CPU is (:mod:`contract.cpu`) and how a command prints ``--help``
(:mod:`contract.cli`).

Every stage (``train/``, ``export/``, ``serve/``, the benchmarks) may import this package; it imports nothing else of
the project, no torch and no onnxruntime (standard library and numpy only; tests/test_import_rules.py).
"""
