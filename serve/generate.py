"""Print continuations from a bundle, streaming: ``python -m serve.generate BUNDLE``.

    python -m serve.generate runs/cpu/bundle                      # a Bangla and an English continuation
    python -m serve.generate runs/cpu/bundle --prompt "আমি বাংলায়" --temperature 0 --max-new-tokens 40
    python -m serve.generate runs/cpu/bundle --backend rust --quantize q8_0

Each continuation is drawn the way a user would draw it: with the bundle's sampling defaults
(``generation_config.json``; the model card states them) and a fixed seed, unless ``--temperature`` / ``--top-k``
/ ``--top-p`` / ``--repetition-penalty`` say otherwise; a sampled continuation is followed by the greedy one of the
same prompt (``--no-greedy`` to skip it), and each by its share of distinct words (1.0: no word repeats; a
continuation that loops on one word is near 0).

Exit status 2 for a bundle that cannot be loaded or a request that cannot be served (message on stderr).
"""

from __future__ import annotations

import argparse
import sys

from contract.bundle import MANIFEST, SAMPLING_KEYS, BundleError, sampling_defaults
from contract.quant import NAMES, QuantizeError, Scheme, parse
from contract.text import distinct_word_share
from serve.errors import RequestError
from serve.lm import LM
from serve.loader import BACKENDS, load

DEFAULT_PROMPTS = [("bn", "বাংলা ভাষা"), ("en", "The river")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("bundle", help="bundle directory (runs/NAME/bundle)")
    p.add_argument("--prompt", default=None, help="continue this text instead of the Bangla and English defaults")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the bundle's)")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default: the bundle's)")
    p.add_argument("--top-p", type=float, default=None, help="1 = off (default: the bundle's)")
    p.add_argument("--repetition-penalty", type=float, default=None, help="1 = off (default: the bundle's)")
    p.add_argument("--seed", type=int, default=1234, help="random seed (same seed, same text)")
    p.add_argument("--no-greedy", action="store_true", help="do not follow a sampled continuation by the greedy one")
    p.add_argument("--backend", choices=BACKENDS, default="onnx")
    p.add_argument("--quantize", type=_quantize, default="none", metavar="|".join(NAMES),
                   help="weights (contract/quant.py): onnx reads the bundle's graph of the scheme; rust quantizes at load")
    p.add_argument("--no-verify", action="store_true", help=f"skip checking the files' sha256 against {MANIFEST}")
    p.add_argument("--allow-ungated", action="store_true",
                   help="serve a quantized form the export's quality gate did not pass (logged; serve/verdict.py)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    return p.parse_args(argv)


SETTINGS = SAMPLING_KEYS  # the options that override the bundle's sampling


def sampling_settings(args: argparse.Namespace) -> dict:
    """The sampling of this command: the bundle's defaults (:func:`contract.bundle.sampling_defaults`) overridden by
    the options given. Missing keys are off (top_k 0, top_p 1, repetition_penalty 1)."""
    s = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **sampling_defaults(args.bundle)}
    s.update({k: getattr(args, k) for k in SETTINGS if getattr(args, k) is not None})
    return s


def print_continuation(lm: LM, prompt: str, args: argparse.Namespace, settings: dict,
                       label: str | None = None) -> str:
    """Stream one continuation of ``prompt`` to stdout (prompt first), then a line with how it was drawn and its
    share of distinct words; returns the generated text."""
    head = f"[{label}] " if label else ""
    sys.stdout.write(f"{head}{prompt}")
    sys.stdout.flush()
    pieces = []
    for piece in lm.stream(prompt, args.max_new_tokens, seed=args.seed, **settings):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    text = "".join(pieces)
    share = distinct_word_share(text)
    how = ("greedy" if settings["temperature"] == 0 else
           "sampled: " + ", ".join(f"{k} {settings[k]:g}" for k in SETTINGS) + f", seed {args.seed}")
    sys.stdout.write(f"\n    ({how}; distinct words {'-' if share is None else f'{share:.0%}'})\n\n")
    sys.stdout.flush()
    return text


def _quantize(value: str) -> Scheme | None:
    """``--quantize`` parsed here, once (:func:`contract.quant.parse`: an old name is taken with a deprecation line);
    an unknown name is argparse's one-line usage error (exit 2)."""
    try:
        return parse(value, "--quantize")
    except QuantizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sys.stdout.reconfigure(encoding="utf-8")  # Bangla on any terminal locale
    except (AttributeError, ValueError):
        pass
    try:
        lm = load(args.bundle, backend=args.backend, quantize=args.quantize, threads=args.threads,
                  verify=not args.no_verify, allow_ungated=args.allow_ungated)
    except (OSError, ValueError, ImportError) as e:
        print(f"error: cannot load {args.bundle}: {e}", file=sys.stderr)
        return 2
    try:
        settings = sampling_settings(args)
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [(None, args.prompt)] if args.prompt is not None else DEFAULT_PROMPTS
    try:
        for label, prompt in prompts:
            print_continuation(lm, prompt, args, settings, label)
            if settings["temperature"] != 0 and not args.no_greedy:
                greedy = {**settings, "temperature": 0.0}
                print_continuation(lm, prompt, args, greedy, f"{label}, greedy" if label else "greedy")
    except RequestError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
