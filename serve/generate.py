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

from contract.cli import HelpFormatter
from contract.text import distinct_word_share
from serve.cli import (
    add_model_args,
    add_sampling_args,
    describe_sampling,
    not_utf8,
    open_model,
    run_command,
    utf8_stdout,
)
from serve.errors import RequestError
from serve.generation import Generation
from serve.lm import LM

DEFAULT_PROMPTS = [("bn", "বাংলা ভাষা"), ("en", "The river")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt", default=None, help="continue this text instead of the Bangla and English defaults")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    add_sampling_args(p)
    p.add_argument("--no-greedy", action="store_true", help="do not follow a sampled continuation by the greedy one")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0:
        p.error(f"argument --max-new-tokens: expected an integer >= 0, got {args.max_new_tokens}")
    return args


def continuations(prompts: list[tuple[str | None, str]], args: argparse.Namespace,
                  settings: dict) -> list[tuple[str | None, str, dict]]:
    """What the command prints, in order: (label, prompt, sampling settings) — each sampled continuation followed by
    the greedy one of its prompt unless ``--no-greedy`` (or it is greedy already)."""
    out = []
    for label, prompt in prompts:
        out.append((label, prompt, settings))
        if settings["temperature"] != 0 and not args.no_greedy:
            out.append((f"{label}, greedy" if label else "greedy", prompt, {**settings, "temperature": 0.0}))
    return out


def start(lm: LM, prompt: str, args: argparse.Namespace, settings: dict) -> Generation:
    """The generation of one continuation (lazy: nothing runs yet). Raises RequestError for a prompt or
    ``--max-new-tokens`` the model cannot take, its message naming the option."""
    try:
        return lm.start(prompt, args.max_new_tokens, seed=args.seed, **settings)
    except RequestError as e:
        option = {"max_tokens": "--max-new-tokens", "prompt": "--prompt"}.get(e.param or "")
        raise RequestError(f"{option}: {e}" if option else str(e), e.param, e.code) from None


def print_continuation(lm: LM, prompt: str, args: argparse.Namespace, settings: dict,
                       label: str | None = None) -> str:
    """Stream one continuation of ``prompt`` to stdout (prompt first, once the request is known to be valid), then a
    line with how it was drawn and its share of distinct words; returns the generated text. RequestError (nothing
    written) for a request the model cannot take."""
    gen = start(lm, prompt, args, settings)
    head = f"[{label}] " if label else ""
    sys.stdout.write(f"{head}{prompt}")
    sys.stdout.flush()
    pieces = []
    for chunk in gen:
        pieces.append(chunk.text)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    text = "".join(pieces)
    share = distinct_word_share(text)
    sys.stdout.write(f"\n    ({describe_sampling(settings, args.seed)}; distinct words "
                     f"{'-' if share is None else f'{share:.0%}'})\n\n")
    sys.stdout.flush()
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m serve.generate``: exit 0, 2 for bad input, 130 on Ctrl-C, 1 when standard output
    fails (:func:`serve.cli.run_command`)."""
    return run_command(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    """Every input is checked before anything is printed: ``--prompt`` (bytes that are not UTF-8 would fail only when
    printed), then the bundle and options, then each continuation's request (its prompt against the context and
    ``--max-new-tokens``); a failure is one ``error:`` line on stderr and exit status 2."""
    args = parse_args(argv)
    why = None if args.prompt is None else not_utf8(args.prompt)
    if why is not None:
        print(f"error: --prompt: the prompt is {why}", file=sys.stderr)
        return 2
    utf8_stdout()
    lm, settings = open_model(args)
    todo = continuations([(None, args.prompt)] if args.prompt is not None else DEFAULT_PROMPTS, args, settings)
    try:
        for _label, prompt, s in todo:
            start(lm, prompt, args, s)  # validation only: a generation runs when it is iterated
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for label, prompt, s in todo:
            print_continuation(lm, prompt, args, s, label)
    except RequestError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
