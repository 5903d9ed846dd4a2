"""``python -m export.onnx CKPT_OR_RUN [--out DIR] [--force] [--dtype float32|float16] [--quantize NAME...] [--no-parity]``

Turns a checkpoint (a step folder, a ``checkpoints/`` folder or a run folder, meaning its latest checkpoint) into
the bundle of docs/design.md — ``model.safetensors``, ``config.json``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``model.onnx`` + ``model.onnx.data`` (+ ``model.q8_0.onnx`` /
``model.q4_0.onnx`` / ``model.q4_mix.onnx`` with ``--quantize q8_0 q4_0 q4_mix``), ``README.md`` (model card) and
``manifest.json`` — and refuses to finish unless the bundle computes what the checkpoint computes (the parity gate,
:mod:`export.parity`) and every quantized form passes its quality gate (:mod:`export.gate`). Default output:
``<run dir>/bundle``.

This module is the command line; the pipeline is :mod:`export.pipeline`, the graph :mod:`export.graph`.
An up-to-date bundle of the same checkpoint is kept ("nothing to do"), and the run's own ``RUN/bundle`` of an older
step of the run is replaced; ``--force`` replaces any other existing bundle (a folder whose manifest says
``shalik-bundle``) or an empty folder, never another folder or a file. Exit codes: 0 done, 1 parity or quality-gate failure (the table is printed) or no exporter
could build the graph, 2 bad input (a path that is not a checkpoint, a file that fails its sha256, a config that
does not match the weights, an existing output without ``--force``, an output that cannot be written: the
message names the path and the errno, e.g. ENOSPC), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from contract.bundle import ONNX_GRAPHS
from contract.cli import HelpFormatter
from contract.quant import BACKEND_NAMES, NAMES
from export.errors import ExportError, ParityError, run_cli
from export.graph import EXPORTERS
from export.pipeline import DTYPES, export_bundle

__all__ = ["ExportError", "ParityError", "export_bundle", "main"]


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0, 1 parity failure, 2 bad input, 130 interrupted)."""
    p = argparse.ArgumentParser(prog="python -m export.onnx", description=__doc__.split("\n\n")[1],
                                formatter_class=HelpFormatter,
                                epilog="exit codes: 0 done, 1 parity failure, 2 bad input, 130 interrupted")
    p.add_argument("checkpoint", metavar="CKPT_OR_RUN",
                   help="a checkpoint step folder, a checkpoints/ folder or a run folder (its latest checkpoint)")
    p.add_argument("--out", default=None, help="bundle folder (default: <run dir>/bundle)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing bundle folder (not needed for an up-to-date bundle, which is kept, or "
                        "for the run's own bundle of an older step, which is replaced)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="ONNX weights and KV cache (default: float32; safetensors stay float32)")
    p.add_argument("--quantize", nargs="+", default=None, metavar="NAME",  # checked by parse_schemes: one line
                   help=f"quantized forms to add and gate, of {', '.join(NAMES)} (contract/quant.py): " + ", ".join(
                       f"{n} → {ONNX_GRAPHS[n]}" for n in BACKEND_NAMES["onnx"] if n != "none")
                   + "; the Rust forms rust_runtime offers are gated too (default: none)")
    p.add_argument("--no-parity", dest="parity", action="store_false", help="skip the parity gate (not advised)")
    p.add_argument("--val-data", default=None, metavar="PATH",
                   help="validation shards folder or text for the quality gate (default: the run's val shards)")
    p.add_argument("--exporter", choices=["auto", *EXPORTERS], default="auto",
                   help="default auto: dynamo, falling back to TorchScript when it fails to export or to match")
    a = p.parse_args(argv)
    return run_cli(lambda: export_bundle(a.checkpoint, a.out, force=a.force, dtype=a.dtype, quantize=a.quantize,
                                         parity=a.parity, val_data=a.val_data, exporter=a.exporter),
                   "no bundle was written")


if __name__ == "__main__":
    sys.exit(main())
