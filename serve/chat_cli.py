"""Talk to a chat model in the terminal: ``python -m serve.chat_cli BUNDLE``.

    python -m serve.chat_cli runs/cpu-sft/bundle
    python -m serve.chat_cli runs/cpu-sft/bundle --system "You are a helpful assistant." --temperature 0
    printf 'নদীর নাম বলো।\\nWho wrote it?\\n' | python -m serve.chat_cli runs/cpu-sft/bundle   # a message a line

Each message is a user turn; the reply streams as it is drawn, and the conversation so far goes with the next
message, rendered with the bundle's chat template (ChatML, :mod:`contract.chat_format`) as
``/v1/chat/completions`` renders it. Replies are drawn with the bundle's sampling defaults unless the options say
otherwise; reply ``i`` (from 0) with seed ``--seed + i``, so the same messages and seed give the same conversation.

In a terminal: ``>>>`` asks for a message (line editing and history by ``readline``); ``/help`` lists the
commands: ``/clear`` (forget the conversation, keep the system message), ``/system [TEXT]`` (set, or show, the
system message), ``/bye`` (or Ctrl-D) to leave. A message of several lines starts with a line that starts with
``\"\"\"`` and ends with the first line that ends with ``\"\"\"`` (as Ollama's); such a message is never a
command, and Ctrl-D inside it leaves without sending it. A one-line message that starts with ``/`` is sent as
``//…``. Ctrl-C stops a reply (its turn is not kept, its seed not used up) and, at the prompt, says how to leave.
Control characters of a reply are shown as U+FFFD. When the conversation leaves the reply fewer than
``min(--max-new-tokens, context / 4)`` tokens, its oldest turns are dropped (said in a line); a message, or a
system message, that does not fit even alone is refused.

From a pipe or a file: a message a line (commands too), no prompt; stdout holds the replies alone, each followed
by a blank line; everything else the command says goes to stderr. An unclosed ``\"\"\"`` message at the end of
the input is sent (said on stderr); Ctrl-C ends the command (130).

Exit status 0 at the end of the input or ``/bye``; 1 when input that is not a terminal had a message refused (each
said on stderr; the conversation went on without it) or standard output failed (a closed pipe: quietly; a full
disk); 2 for a bundle that cannot be loaded or is not a chat model (a base model: the message says how to get
one), a sampling option out of range (or a bundle default that is), a ``--system`` that is refused, a closed
standard input or output; 130 for Ctrl-C while the model loads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

from contract.chat_format import RESERVED_TOKENS
from contract.cli import HelpFormatter
from serve.chat import chat_prompt_ids, why_not_chat
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
from serve.lm import LM

DEFAULT_MAX_NEW_TOKENS = 256  # a reply's budget, capped by what the context leaves
FENCE = '"""'
HELP = """commands:
  /clear          forget the conversation (the system message stays)
  /system [TEXT]  set the system message (without TEXT: show it)
  /bye            leave (Ctrl-D too)
  /help           this list
a message of several lines: start and end it with \"\"\"; a message that starts with / : send it as //..."""


class TurnRefused(Exception):
    """A message that cannot be sent (too long for the context, or refused by the chat format): the turn is not
    kept and the conversation goes on."""


@dataclass
class Conversation:
    """A chat with ``lm``: the system message, the turns so far (user and assistant messages, alternating) and the
    replies drawn. ``settings``: sampling keyword arguments of :meth:`serve.lm.LM.start_chat`; ``seed``: reply
    ``i`` is drawn with ``seed + i``; ``max_new_tokens``: a reply's budget (capped by the context)."""

    lm: LM
    settings: dict
    seed: int = 1234
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    system: str | None = None
    turns: list[dict] = field(default_factory=list)
    replies: int = 0
    dropped: int = 0  # turns dropped to fit the last message

    def messages(self, turns: list[dict] | None = None) -> list[dict]:
        """The OpenAI-form messages: the system message (when set), then ``turns`` (default: the conversation's)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + (self.turns if turns is None else turns)

    @property
    def reserve(self) -> int:
        """Tokens kept free for a reply: ``min(max_new_tokens, context_length // 4)``."""
        return max(1, min(self.max_new_tokens, self.lm.context_length // 4))

    def fit(self, user: str) -> tuple[list[dict], int]:
        """The turns to send with ``user`` (the oldest dropped until the rendered conversation leaves
        :attr:`reserve` tokens free) and how many turns were dropped. Raises TurnRefused for a message the chat
        format refuses (a control token's text, not valid Unicode) or one that does not fit with the system message
        alone."""
        turns = [*self.turns, {"role": "user", "content": user}]
        dropped = 0
        while True:
            used = prompt_tokens(self.lm, self.messages(turns))
            if used + self.reserve <= self.lm.context_length:
                return turns, dropped
            if len(turns) == 1:
                what = "with the system message " if self.system else ""
                raise TurnRefused(f"the message is {used} tokens {what}in the chat template; the context holds "
                                  f"{self.lm.context_length} and a reply needs {self.reserve} of them: shorten it")
            turns, dropped = turns[2:], dropped + 2  # the oldest user turn and its reply

    def reply(self, user: str, write: Callable[[str], None]) -> str | None:
        """Send ``user``, stream the reply's pieces to ``write`` and keep both turns (the reply without the text of a
        control token, should it hold one); returns the finish reason ("stop": the turn ended; "length": the budget
        did). Raises TurnRefused (nothing kept); a KeyboardInterrupt (or an error of ``write``) while the reply
        streams cancels it and propagates (nothing kept, its seed not used up)."""
        turns, self.dropped = self.fit(user)
        gen = self.lm.start_chat(self.messages(turns), 1, None, seed=self.seed + self.replies,
                                 default_max_new_tokens=self.max_new_tokens, **self.settings)[0]
        pieces = []
        try:
            for chunk in gen:
                pieces.append(chunk.text)
                write(chunk.text)
        except BaseException:  # Ctrl-C, a closed terminal: the reply ends here, its turn is not kept
            gen.cancel()
            raise
        reply, before = "".join(pieces), None
        while reply != before:  # sampled control text (<|pad|>) could not be sent back with the next message
            before = reply
            for token in RESERVED_TOKENS:
                reply = reply.replace(token, "")
        self.turns = [*turns, {"role": "assistant", "content": reply}]
        self.replies += 1
        return gen.finish_reason

    def clear(self) -> None:
        """Forget the turns (the system message stays)."""
        self.turns = []


def prompt_tokens(lm: LM, messages: list[dict]) -> int:
    """Tokens of ``messages`` in the chat template, the leading ``<|endoftext|>`` included. TurnRefused, worded
    for the user (:func:`_about_the_message`), for a conversation the chat format refuses."""
    try:
        return len(chat_prompt_ids(lm, messages)) + 1
    except RequestError as e:
        raise TurnRefused(_about_the_message(str(e), messages[0]["role"] == "system")) from None


def _about_the_message(error: str, has_system: bool) -> str:
    """The chat format's error about ``messages[i].content`` as the user sees it: about the system message
    (index 0 when one is set) or the message just typed."""
    where, sep, why = error.partition(": ")
    if not sep or not where.startswith("messages["):
        return error
    return f"the {'system message' if has_system and where.startswith('messages[0]') else 'message'} {why}"


def _check_utf8(text: str, what: str = "the message") -> None:
    """TurnRefused for input bytes that were not UTF-8 (standard input and arguments are read with
    ``surrogateescape``: such a byte arrives as U+DC80..U+DCFF), naming the first and where it is
    (:func:`serve.cli.not_utf8`)."""
    why = not_utf8(text)
    if why is not None:
        raise TurnRefused(f"{what} is {why}")


def check_system(lm: LM, system: str, reserve: int) -> None:
    """Raises TurnRefused when ``system`` cannot be the system message: the chat format refuses it (a control
    token's text, bytes that were not UTF-8) or, with a one-word message, it leaves a reply fewer than ``reserve``
    tokens of the context."""
    _check_utf8(system, "the system message")
    used = prompt_tokens(lm, [{"role": "system", "content": system}, {"role": "user", "content": "?"}])
    if used + reserve > lm.context_length:
        raise TurnRefused(f"the system message is {used} tokens with a one-word message in the chat template; the "
                          f"context holds {lm.context_length} and a reply needs {reserve} of them: shorten it")


@dataclass
class Message:
    """What one read gives: the ``text``; ``fenced`` when it came between ``\"\"\"`` lines (never a command);
    ``unclosed`` when the input ended before its closing ``\"\"\"``."""

    text: str
    fenced: bool = False
    unclosed: bool = False


def read_message(read: Callable[[str], str], interactive: bool) -> Message:
    """The next message: one line, or — when a line starts with ``\"\"\"`` — the lines up to the first that ends with
    ``\"\"\"`` (as Ollama's), joined with newlines, the fences cut (a closing line of only ``\"\"\"`` adds nothing).
    ``read(prompt)`` returns a line without its newline and raises EOFError at the end of the input."""
    line = read(">>> " if interactive else "")
    if not line.lstrip().startswith(FENCE):
        return Message(line)
    first = line.lstrip()[len(FENCE):]
    if first.rstrip().endswith(FENCE) and first.strip() != "":
        return Message(first.rstrip()[:-len(FENCE)], fenced=True)
    lines = [first] if first else []
    while True:
        try:
            more = read("... " if interactive else "")
        except EOFError:
            return Message("\n".join(lines), fenced=True, unclosed=True)
        if more.rstrip().endswith(FENCE):
            last = more.rstrip()[:-len(FENCE)]
            lines += [last] if last.strip() else []
            return Message("\n".join(lines), fenced=True)
        lines.append(more)


def line_reader(stream: TextIO) -> Callable[[str], str]:
    """``read(prompt)`` over a non-terminal stream: its next line (the prompt unused); EOFError at its end."""
    lines: Iterator[str] = iter(stream)

    def read(_prompt: str) -> str:
        try:
            return next(lines).rstrip("\r\n")
        except StopIteration:
            raise EOFError from None

    return read


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve.chat_cli", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--system", default=None, help="a system message for the conversation")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="tokens of a reply at most (capped by what the context leaves)")
    add_sampling_args(p)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"argument --max-new-tokens: expected an integer >= 1, got {args.max_new_tokens}")
    return args


# what a terminal would run rather than show: C0 controls but tab and newline, DEL, C1 (escape sequences)
_CONTROLS = {c: "\ufffd" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0)]}


class Session:
    """The command's loop over one :class:`Conversation`: reads messages and commands, writes replies to
    ``out`` and everything else to ``err``. ``interactive``: messages come from a terminal; ``terminal_out``
    (default: the same): ``out`` is one, and control characters of a reply are shown there as U+FFFD, so that a
    reply cannot drive the terminal."""

    def __init__(self, conv: Conversation, read: Callable[[str], str], out: TextIO, err: TextIO,
                 interactive: bool, terminal_out: bool | None = None):
        self.conv, self.read, self.out, self.err, self.interactive = conv, read, out, err, interactive
        self.terminal_out = interactive if terminal_out is None else terminal_out
        self.refused = 0

    def say(self, text: str) -> None:
        """A line for the user (not a reply): stderr, or stdout in a terminal so that it reads in order."""
        stream = self.out if self.interactive else self.err
        stream.write(text + "\n")
        stream.flush()

    def run(self) -> int:
        """Until the end of the input or ``/bye``; the exit status (module doc). Ctrl-C at the prompt of a terminal
        says how to leave; from a pipe it ends the command (130)."""
        while True:
            try:
                message = read_message(self.read, self.interactive)
            except EOFError:
                if self.interactive:
                    self.out.write("\n")
                break
            except KeyboardInterrupt:
                if not self.interactive:
                    return 130
                self.say("\n(Ctrl-D or /bye to leave)")
                continue
            if message.unclosed and self.interactive:  # Ctrl-D inside a message: leave without sending it
                self.out.write("\n")
                break
            text = message.text
            if not text.strip():
                continue
            if message.unclosed:
                self.say(f'(the input ended inside a {FENCE} message; it is sent as it stands)')
            if not message.fenced and text.startswith("/") and not text.startswith("//"):
                if not self.command(text):
                    break
                continue
            self.send(text[1:] if not message.fenced and text.startswith("//") else text)
        return 1 if self.refused and not self.interactive else 0

    def command(self, line: str) -> bool:
        """Run a ``/command``; False to leave."""
        name, _, rest = line.partition(" ")
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name == "/clear":
            self.conv.clear()
            self.say("(the conversation is cleared" + (", the system message kept)" if self.conv.system else ")"))
        elif name == "/system":
            if rest.strip():
                try:
                    check_system(self.conv.lm, rest.strip(), self.conv.reserve)
                except TurnRefused as e:
                    self.refused += 1
                    self.say(f"error: {e}; the system message was not set")
                    return True
                self.conv.system = rest.strip()
                self.say("(system message set)")
            else:
                self.say(f"system: {self.conv.system}" if self.conv.system else "(no system message)")
        elif name in ("/help", "/?"):
            self.say(HELP)
        else:
            self.say(f"unknown command {name}; /help lists them (a message that starts with / is sent as //...)")
        return True

    def send(self, message: str) -> None:
        """One turn: the reply streamed to ``out``, then a blank line; a refused message or a stopped reply said."""
        try:
            _check_utf8(message)
            finish = self.conv.reply(message, self._write)
        except (TurnRefused, RequestError) as e:
            self.refused += 1
            self.say(f"error: {e}; the message was not sent")
            return
        except KeyboardInterrupt:
            self.out.write("\n")
            self.say("(stopped; this turn is not kept)")
            return
        self.out.write("\n\n")
        self.out.flush()
        if self.conv.dropped:
            self.say(f"(the oldest {self.conv.dropped} turns were dropped to fit the context of "
                     f"{self.conv.lm.context_length} tokens)")
        if finish == "length":
            self.say(f"(the reply was cut at its budget: --max-new-tokens {self.conv.max_new_tokens} or the "
                     f"context)")

    def _write(self, text: str) -> None:
        self.out.write(text.translate(_CONTROLS) if self.terminal_out else text)
        self.out.flush()


def _stdin() -> TextIO:
    """Standard input, bytes that are not UTF-8 kept as lone surrogates (refused by :func:`_check_utf8`). One
    ``error:`` line and SystemExit(2) when it is closed."""
    if sys.stdin is None:
        print("error: standard input is closed: the chat reads its messages there", file=sys.stderr)
        raise SystemExit(2)
    try:
        sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
    except (AttributeError, ValueError):
        pass
    return sys.stdin


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m serve.chat_cli``; the exit status as the module doc says
    (:func:`serve.cli.run_command`: 130 on Ctrl-C while the model loads, 1 when standard output fails)."""
    return run_command(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    utf8_stdout()
    stdin, stdout = _stdin(), sys.stdout
    lm, settings = open_model(args)
    why = why_not_chat(lm)
    if why:
        print(f"error: {why}; python -m serve.generate {args.bundle} continues text with it", file=sys.stderr)
        return 2
    conv = Conversation(lm, settings, args.seed, args.max_new_tokens, (args.system or "").strip() or None)
    if conv.system is not None:
        try:
            check_system(lm, conv.system, conv.reserve)
        except TurnRefused as e:
            print(f"error: --system: {e}", file=sys.stderr)
            return 2
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401, PLC0415 - line editing and history for input()
        except ImportError:
            pass
        read = input
    else:
        read = line_reader(stdin)
    print(f"chat with {lm.name} ({args.bundle}, {args.backend}); replies {describe_sampling(settings, args.seed)}, "
          f"at most {args.max_new_tokens} tokens; context {lm.context_length} tokens. /help for commands, /bye or "
          f"Ctrl-D to leave", file=stdout if interactive else sys.stderr)
    return Session(conv, read, stdout, sys.stderr, interactive, stdout.isatty()).run()


if __name__ == "__main__":
    sys.exit(main())
