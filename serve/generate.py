"""Print continuations from a bundle, streaming: ``python -m serve.generate BUNDLE``.

    python -m serve.generate runs/small/bundle                      # a Bangla and an English continuation
    python -m serve.generate runs/small/bundle --prompt "আমি বাংলায়" --temperature 0 --max-new-tokens 40
    python -m serve.generate runs/small/bundle --backend rust --quantize int8

Exit status 2 for a bundle that cannot be loaded or a request that cannot be served (message on stderr).
"""

from __future__ import annotations

import argparse
import sys

from serve.bundle import QUANTIZE_CHOICES
from serve.errors import RequestError
from serve.lm import BACKENDS, LM, load

DEFAULT_PROMPTS = [("bn", "বাংলা ভাষা"), ("en", "The river")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("bundle", help="bundle directory (runs/NAME/bundle)")
    p.add_argument("--prompt", default=None, help="continue this text instead of the Bangla and English defaults")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.1, help="1 = off")
    p.add_argument("--seed", type=int, default=1234, help="random seed (same seed, same text)")
    p.add_argument("--backend", choices=BACKENDS, default="onnx")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none")
    p.add_argument("--no-verify", action="store_true", help="skip checking the files' sha256 against manifest.json")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    return p.parse_args(argv)


def print_continuation(lm: LM, prompt: str, args: argparse.Namespace, label: str | None = None) -> str:
    """Stream one continuation of ``prompt`` to stdout (prompt first); returns the generated text."""
    head = f"[{label}] " if label else ""
    sys.stdout.write(f"{head}{prompt}")
    sys.stdout.flush()
    pieces = []
    for piece in lm.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed):
        pieces.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n\n")
    sys.stdout.flush()
    return "".join(pieces)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sys.stdout.reconfigure(encoding="utf-8")  # Bangla on any terminal locale
    except (AttributeError, ValueError):
        pass
    try:
        lm = load(args.bundle, backend=args.backend, quantize=args.quantize, threads=args.threads,
                  verify=not args.no_verify)
    except (OSError, ValueError, ImportError) as e:
        print(f"error: cannot load {args.bundle}: {e}", file=sys.stderr)
        return 2
    prompts = [(None, args.prompt)] if args.prompt is not None else DEFAULT_PROMPTS
    try:
        for label, prompt in prompts:
            print_continuation(lm, prompt, args, label)
    except RequestError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
