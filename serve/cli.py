"""What the terminal commands (``python -m serve.generate``, ``python -m serve.chat_cli``) share: the options that
load a bundle and set its sampling, and loading it with a one-line error instead of a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from contract.bundle import GENERATION_CONFIG, MANIFEST, SAMPLING_KEYS, BundleError, sampling_defaults
from contract.quant import NAMES, QuantizeError, Scheme, parse
from contract.text import lone_surrogate
from serve.errors import RequestError
from serve.lm import LM
from serve.loader import BACKENDS, MAX_THREADS, load
from serve.sampling import SamplingParams

SETTINGS = SAMPLING_KEYS  # the options that override the bundle's sampling


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The bundle (positional) and how to load it: ``--backend``, ``--quantize``, ``--no-verify``,
    ``--allow-ungated``, ``--threads`` (:func:`serve.loader.load`'s arguments)."""
    p.add_argument("bundle", help="bundle directory (runs/NAME/bundle)")
    p.add_argument("--backend", choices=BACKENDS, default="onnx", help="runtime: onnxruntime or rust_runtime")
    p.add_argument("--quantize", type=_quantize, default="none", metavar="|".join(NAMES),
                   help="weights (contract/quant.py): onnx reads the bundle's graph of the scheme; rust quantizes at load")
    p.add_argument("--no-verify", action="store_true", help=f"skip checking the files' sha256 against {MANIFEST}")
    p.add_argument("--allow-ungated", action="store_true",
                   help="serve a quantized form the export's quality gate did not pass (logged; serve/verdict.py)")
    p.add_argument("--threads", type=_threads, default=None, help=f"compute threads, 1 to {MAX_THREADS} (default: all cores)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-k``, ``--top-p``, ``--repetition-penalty`` (default: the bundle's, see
    :func:`sampling_settings`) and ``--seed``."""
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the bundle's)")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default: the bundle's)")
    p.add_argument("--top-p", type=float, default=None, help="1 = off (default: the bundle's)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="1 = off (default: the bundle's)")
    p.add_argument("--seed", type=int, default=1234, help="random seed (same seed, same text)")


def _quantize(value: str) -> Scheme | None:
    """``--quantize`` parsed here, once (:func:`contract.quant.parse`: an old name is taken with a deprecation line);
    an unknown name is argparse's one-line usage error (exit 2)."""
    try:
        return parse(value, "--quantize")
    except QuantizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _threads(value: str) -> int:
    """``--threads``: an integer from 1 to :data:`serve.loader.MAX_THREADS`, else argparse's one-line usage error."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_THREADS}, got {value!r}")
    return n


def check_options(args: argparse.Namespace) -> None:
    """RequestError naming the option (``--top-p: top_p must be <= 1.0, got 2.0``) for a sampling option out of
    range (:class:`serve.sampling.SamplingParams`' rules), before anything loads."""
    try:
        SamplingParams(**_given(args), seed=args.seed)
    except RequestError as e:
        raise RequestError(f"--{e.param.replace('_', '-')}: {e}" if e.param else str(e)) from None


def sampling_settings(args: argparse.Namespace) -> dict:
    """The sampling of this command: the bundle's defaults (:func:`contract.bundle.sampling_defaults`) overridden by
    the options given. Missing keys are off (top_k 0, top_p 1, repetition_penalty 1). Raises BundleError for a
    bundle whose ``generation_config.json`` cannot be read or holds a value that cannot be sampled with."""
    defaults = sampling_defaults(args.bundle)
    try:
        SamplingParams(**defaults)
    except RequestError as e:
        raise BundleError(f"{Path(args.bundle) / GENERATION_CONFIG}: {e}") from None
    return {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **defaults, **_given(args)}


def _given(args: argparse.Namespace) -> dict:
    """The sampling options given on the command line (the others are None)."""
    return {k: getattr(args, k) for k in SETTINGS if getattr(args, k) is not None}


def describe_sampling(settings: dict, seed: int) -> str:
    """``greedy``, or ``sampled: temperature 0.8, top_k 50, top_p 0.95, repetition_penalty 1.1, seed 1234``."""
    if settings["temperature"] == 0:
        return "greedy"
    return "sampled: " + ", ".join(f"{k} {settings[k]:g}" for k in SETTINGS) + f", seed {seed}"


def not_utf8(text: str) -> str | None:
    """Why ``text`` from the command line or standard input is not text (``not valid UTF-8: byte 0xFF at character
    0``), or None when it is. Both are read with ``surrogateescape``: a byte that is not UTF-8 arrives as a lone
    surrogate U+DC80..U+DCFF, which no output can encode (printing it raised UnicodeEncodeError)."""
    at = lone_surrogate(text)
    if at is None:
        return None
    code = ord(text[at])
    if 0xDC80 <= code <= 0xDCFF:
        return f"not valid UTF-8: byte 0x{code - 0xDC00:02X} at character {at}"
    return f"not valid Unicode text: a lone surrogate U+{code:04X} at character {at}"


def utf8_stdout() -> None:
    """Bangla on any terminal locale: stdout re-encoded as UTF-8 where it can be."""
    try:
        sys.stdout.reconfigure(encoding="utf-8")
    except (AttributeError, ValueError):
        pass


def open_model(args: argparse.Namespace) -> tuple[LM, dict]:
    """The loaded model and the command's sampling settings. A sampling option out of range (checked first), a
    bundle that cannot be loaded (``cannot load BUNDLE: why``) or whose sampling defaults cannot be used is one
    ``error:`` line on stderr and SystemExit(2) (the commands' bad-input status)."""
    try:
        check_options(args)
    except RequestError as e:
        _fail(str(e))
    try:
        lm = load(args.bundle, backend=args.backend, quantize=args.quantize, threads=args.threads,
                  verify=not args.no_verify, allow_ungated=args.allow_ungated)
    except (OSError, ValueError, ImportError, RuntimeError) as e:  # RuntimeError: rust_runtime's load errors
        _fail(f"cannot load {args.bundle}: {e}")
    try:
        return lm, sampling_settings(args)
    except BundleError as e:
        _fail(str(e))


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_command(main: Callable[[], int]) -> int:
    """Run a terminal command's ``main`` with the endings every command shares: Ctrl-C is 130 (a newline on
    stderr, no traceback); a reader that went away (``| head``) a quiet 1; another failure to write (a full disk)
    one ``error:`` line and 1; a closed standard output one line and 2."""
    if sys.stdout is None:
        print("error: standard output is closed: this command writes its text there", file=sys.stderr)
        return 2
    try:
        return main()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # nothing more to say to a reader that left; keep Python's exit flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        print(f"error: cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 1
