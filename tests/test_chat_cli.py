"""``python -m serve.chat_cli`` (and the endings it shares with ``serve.generate``): a conversation in the terminal over a scripted chat model (history, seeds, the
context, commands, fences, refusals, Ctrl-C) and the command's exits on a real bundle. A real chat bundle in a
pipe is in test_chat_clients.py (slow: it fine-tunes one)."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serve.chat import chat_prompt_ids
from serve.chat_cli import Conversation, Message, Session, TurnRefused, line_reader, read_message
from tests.scripted import scripted_lm

ROOT = Path(__file__).resolve().parents[1]
PIECES = ["নমস্কার", "!", " Hello", "."]
GREEDY = {"temperature": 0.0}


def run_session(lm, text: str, **conv) -> tuple[int, str, str, Conversation]:
    """The command's loop over ``text`` as piped input: (exit status, stdout, stderr, the conversation)."""
    c = Conversation(lm, conv.pop("settings", GREEDY), **conv)
    out, err = io.StringIO(), io.StringIO()
    status = Session(c, line_reader(io.StringIO(text)), out, err, interactive=False).run()
    return status, out.getvalue(), err.getvalue(), c


def test_the_conversation_goes_with_every_message():
    lm = scripted_lm(PIECES, context=256, eos_after=2, chat=True)  # every reply: two pieces, then <|im_end|>
    sent = []
    start_chat = lm.start_chat
    lm.start_chat = lambda messages, *a, **k: (sent.append(messages), start_chat(messages, *a, **k))[1]
    status, out, err, c = run_session(lm, "প্রথম প্রশ্ন\nsecond\n")
    assert status == 0 and err == "" and out == "নমস্কার!\n\nনমস্কার!\n\n"
    first = [{"role": "user", "content": "প্রথম প্রশ্ন"}, {"role": "assistant", "content": "নমস্কার!"}]
    assert sent == [first[:1], [*first, {"role": "user", "content": "second"}]]
    assert c.turns == [*first, {"role": "user", "content": "second"}, {"role": "assistant", "content": "নমস্কার!"}]


def test_reply_i_is_drawn_with_seed_plus_i_and_equals_lm_chat():
    lm = scripted_lm(None, context=256, chat=True)
    sampled = {"temperature": 1.0}
    _, out, _, c = run_session(lm, "a\nb\n", settings=sampled, seed=7, max_new_tokens=6)
    first = lm.chat([{"role": "user", "content": "a"}], 6, seed=7, **sampled).text
    second = lm.chat([*c.turns[:2], {"role": "user", "content": "b"}], 6, seed=8, **sampled).text
    assert [c.turns[1]["content"], c.turns[3]["content"]] == [first, second] and first != second
    assert run_session(lm, "a\nb\n", settings=sampled, seed=7, max_new_tokens=6)[1] == out  # same seed, same chat


def test_the_oldest_turns_are_dropped_to_leave_the_reply_room():
    lm = scripted_lm(PIECES, context=128, eos_after=2, chat=True)
    c = Conversation(lm, GREEDY, max_new_tokens=64, system="be brief")
    assert c.reserve == 32  # min(max_new_tokens, context / 4)
    for i in range(12):
        c.reply(f"question {i} " + "x" * 20, lambda _: None)
    kept = [m["content"] for m in c.turns if m["role"] == "user"]
    assert c.dropped > 0 and kept[-1].startswith("question 11") and len(kept) < 12
    used = len(chat_prompt_ids(lm, c.messages(c.turns[:-1]))) + 1
    assert used + c.reserve <= lm.context_length  # what was sent left the reply its room
    assert c.messages()[0] == {"role": "system", "content": "be brief"}  # the system message is never dropped
    with pytest.raises(TurnRefused) as e:
        c.reply("y" * 400, lambda _: None)
    assert str(e.value).startswith("the message is ") and "tokens with the system message in the chat template; " \
        "the context holds 128 and a reply needs 32 of them: shorten it" in str(e.value)


def test_a_system_message_that_leaves_no_room_is_refused():
    lm = scripted_lm(PIECES, context=128, eos_after=1, chat=True)
    status, out, err, c = run_session(lm, "/system " + "x" * 120 + "\nhi\n", max_new_tokens=32)
    assert status == 1 and c.system is None and out == "নমস্কার\n\n"
    assert "error: the system message is " in err and "tokens with a one-word message in the chat template; the " \
        "context holds 128 and a reply needs 32 of them: shorten it; the system message was not set" in err


def test_control_characters_of_a_reply_reach_a_terminal_as_u_fffd():
    lm = scripted_lm(["a\x1b[2Jb", "\x07"], context=256, eos_after=2, chat=True)
    c = Conversation(lm, GREEDY)
    shown, raw = "a\ufffd[2Jb\ufffd\n\n", "a\x1b[2Jb\x07\n\n"
    # (messages from a terminal, replies to one): a terminal gets U+FFFD whoever types, a pipe the reply as it is
    for interactive, terminal_out, want in ((True, None, shown), (False, True, shown), (False, None, raw),
                                            (True, False, raw)):
        out = io.StringIO()
        Session(c, line_reader(io.StringIO("hi\n")), out, io.StringIO(), interactive, terminal_out).send("hi")
        assert out.getvalue() == want
    assert c.turns[-1] == {"role": "assistant", "content": "a\x1b[2Jb\x07"}  # kept as the model wrote it


def test_a_reply_is_kept_without_control_token_text_so_that_the_next_message_can_carry_it():
    lm = scripted_lm(["ok<|<|pad|>pad|>"], context=256, eos_after=1, chat=True)
    status, out, err, c = run_session(lm, "hi\nagain\n")
    assert status == 0 and err == "" and out == "ok<|<|pad|>pad|>\n\n" * 2
    # removed until none is left: taking <|pad|> out of <|<|pad|>pad|> leaves another
    assert [m["content"] for m in c.turns if m["role"] == "assistant"] == ["ok", "ok"]


def test_commands_fences_and_refusals_in_a_pipe():
    lm = scripted_lm(PIECES, context=256, eos_after=1, chat=True)
    text = "\n".join(["/system Answer in Bangla.", "/system", "hello", '"""', "two", "lines", '"""',
                      "bad <|im_end|> text", "caf\udce9", "/system <|im_start|>", "/nope", "//slash", '"""one line"""', "/clear",
                      "/help", "after clear", "/bye", "never read"]) + "\n"
    sent = []
    start_chat = lm.start_chat
    lm.start_chat = lambda messages, *a, **k: (sent.append(messages[-1]["content"]), start_chat(messages, *a, **k))[1]
    status, out, err, c = run_session(lm, text)
    assert status == 1  # a message was refused in a pipe
    # a fenced message keeps its line break, // sends a leading slash, a one-line fence its text
    assert sent == ["hello", "two\nlines", "/slash", "one line", "after clear"]
    assert out == "নমস্কার\n\n" * 5  # replies alone on stdout
    assert err.splitlines()[:2] == ["(system message set)", "system: Answer in Bangla."]
    assert ("error: the message contains the reserved token <|im_end|> (the model's control tokens cannot be sent as "
            "text); the message was not sent") in err
    assert "error: the system message contains the reserved token <|im_start|>" in err
    assert "error: the message is not valid UTF-8: byte 0xE9 at character 3; the message was not sent" in err
    assert "unknown command /nope; /help lists them" in err and "/clear          forget" in err
    assert "(the conversation is cleared, the system message kept)" in err
    assert c.system == "Answer in Bangla." and c.turns[0] == {"role": "user", "content": "after clear"}
    assert c.replies == 5


def test_read_message_fences():
    def read(lines):
        return read_message(line_reader(io.StringIO("".join(f"{x}\n" for x in lines))), False)

    assert read(["plain"]) == Message("plain")
    assert read(['"""', "a", "", "b", '"""']) == Message("a\n\nb", fenced=True)
    assert read(['"""first', "second", 'third"""']) == Message("first\nsecond\nthird", fenced=True)
    assert read(['"""inline"""']) == Message("inline", fenced=True)
    assert read(['   """', "  a", '   """']) == Message("  a", fenced=True)  # a closing line of only the fence adds nothing
    assert read(['"""', "unclosed"]) == Message("unclosed", fenced=True, unclosed=True)
    with pytest.raises(EOFError):
        read([])


def test_a_fenced_message_is_never_a_command_and_an_unclosed_one_is_said():
    lm = scripted_lm(PIECES, context=256, eos_after=1, chat=True)
    sent = []
    start_chat = lm.start_chat
    lm.start_chat = lambda messages, *a, **k: (sent.append(messages[-1]["content"]), start_chat(messages, *a, **k))[1]
    status, out, err, c = run_session(lm, '"""\n/bye\n"""\n"""\n//two\nlines\n')
    assert status == 0 and sent == ["/bye", "//two\nlines"] and out == "নমস্কার\n\n" * 2
    assert err == '(the input ended inside a """ message; it is sent as it stands)\n'


def test_a_stopped_reply_is_cancelled_and_its_turn_not_kept():
    gate = threading.Event()
    lm = scripted_lm(PIECES, context=256, chat=True, gate=gate, gate_after=3)  # never ends a turn by itself
    c = Conversation(lm, GREEDY, max_new_tokens=64)
    out, err = InterruptedOut(after=2), io.StringIO()
    status = Session(c, line_reader(io.StringIO("stop me\n")), out, err, interactive=False).run()
    assert status == 0 and c.turns == [] and c.replies == 0  # the next reply is drawn with the seed this one had
    assert out.getvalue() == "নমস্কার!\n" and err.getvalue() == "(stopped; this turn is not kept)\n"
    gate.set()
    end = time.time() + 10
    while lm.engine.stats()["running"] and time.time() < end:
        time.sleep(0.01)
    # cancelled where it stood (the gate held it at its 4th token), not run on to its budget of 64
    assert lm.engine.stats()["running"] == 0 and lm.engine.stats()["decode_tokens"] <= 5


class InterruptedOut(io.StringIO):
    """A terminal where Ctrl-C is pressed as the ``after`` + 1-th write arrives (it is not written)."""

    def __init__(self, after: int):
        super().__init__()
        self.left = after

    def write(self, s: str) -> int:
        if self.left == 0:
            self.left = -1
            raise KeyboardInterrupt
        self.left -= 1
        return super().write(s)


def chat_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve.chat_cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_a_base_model_bad_options_and_no_bundle_are_one_line_and_exit_2(bundle, tmp_path):
    out = chat_cli(str(bundle), stdin="hello\n")
    assert out.returncode == 2 and out.stdout == ""
    # the main job's kind of bundle: its tokenizer reserves the chat tokens, but it was never fine-tuned on them
    assert out.stderr == (f"error: model {bundle.parent.name!r} is a base model, not a chat model: it was not "
                          f"fine-tuned on conversations, so its bundle has no chat template (its tokenizer only "
                          f"reserves <|im_start|> and <|im_end|>). Fine-tune it with python -m train.sft, then export "
                          f"it again; python -m serve.generate {bundle} continues text with it\n")
    missing = chat_cli(str(tmp_path / "nothing"))
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: cannot load {tmp_path / 'nothing'}: ")
    assert missing.stderr.count("\n") == 1
    zero = chat_cli(str(bundle), "--max-new-tokens", "0")
    assert zero.returncode == 2 and "argument --max-new-tokens: expected an integer >= 1, got 0" in zero.stderr
    hot = chat_cli(str(bundle), "--temperature", "-1", stdin="hi\n")
    assert (hot.returncode, hot.stdout, hot.stderr) == (2, "", "error: --temperature: temperature must be >= 0.0, "
                                                                "got -1.0\n")
    junk = tmp_path / "junk"
    shutil.copytree(bundle, junk)
    (junk / "generation_config.json").write_text('{"do_sample": true, "temperature": "hot"}')
    bad = chat_cli(str(junk), "--no-verify", stdin="hi\n")
    assert bad.returncode == 2 and bad.stderr == (f"error: {junk / 'generation_config.json'}: temperature must be a "
                                                  f"finite number, got 'hot'\n")
    (junk / "generation_config.json").write_text("null")
    bad = chat_cli(str(junk), "--no-verify", stdin="hi\n")
    assert bad.returncode == 2 and bad.stderr == (f"error: {junk / 'generation_config.json'}: expected a JSON object, "
                                                  f"got NoneType\n")
    (junk / "tokenizer.json").write_text('{"model": {}}')
    broken = chat_cli(str(junk), "--no-verify")
    assert broken.returncode == 2 and broken.stderr.startswith(f"error: cannot load {junk}: {junk / 'tokenizer.json'}"
                                                                f": cannot read it as a tokenizer (")


def test_serve_generate_ends_as_the_chat_does(bundle):
    """The endings both terminal commands share (serve.cli.run_command, check_options): a reader that leaves
    (| head) is a quiet exit 1, a bad option one line and exit 2 before anything is generated."""
    gone = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -m serve.generate {bundle} "
                           f"--max-new-tokens 60 | head -c 5"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert gone.returncode == 1 and gone.stderr == "", gone.stderr
    for args, msg in ((["--max-new-tokens", "-3"], "argument --max-new-tokens: expected an integer >= 0, got -3"),
                      (["--top-p", "2"], "error: --top-p: top_p must be <= 1.0, got 2.0"),
                      (["--threads", "100000"], "argument --threads: expected an integer from 1 to 1024, got '100000'"),
                      (["--threads", "0"], "argument --threads: expected an integer from 1 to 1024, got '0'")):
        out = subprocess.run([sys.executable, "-m", "serve.generate", str(bundle), *args], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 2 and out.stdout == "" and msg in out.stderr and "Traceback" not in out.stderr


def _help_defaults(parse_args, capsys) -> dict[str, list[str]]:
    """``--help`` of a terminal command: each option → the ``(default: ...)`` texts its entry states (an entry's
    wrapped lines joined)."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    options = capsys.readouterr().out.split("options:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", options)
    return {e.split()[0].rstrip(","): re.findall(r"\(default: ([^)]*)\)", " ".join(e.split())) for e in entries}


def test_each_option_of_the_terminal_commands_states_its_default_once(capsys):
    """--help of serve.generate and serve.chat_cli: a default stated by the help text is not stated again by argparse
    ("(default: all cores) (default: None)"), flags and options without a value state none, and --backend states
    its own."""
    from serve.chat_cli import parse_args as chat_args
    from serve.generate import parse_args as generate_args

    bundles = "the bundle's"
    shared = {"-h": [], "--backend": ["onnx"], "--quantize": ["none"], "--no-verify": [], "--allow-ungated": [],
              "--threads": ["all cores"], "--temperature": [bundles], "--top-k": [bundles], "--top-p": [bundles],
              "--repetition-penalty": [bundles], "--seed": ["1234"]}
    assert _help_defaults(generate_args, capsys) == {**shared, "--prompt": [], "--max-new-tokens": ["64"],
                                                     "--no-greedy": []}
    assert _help_defaults(chat_args, capsys) == {**shared, "--system": [], "--max-new-tokens": ["256"]}


@pytest.fixture
def generate_with(monkeypatch):
    """``serve.generate.main`` over a scripted model instead of a bundle (greedy unless the test says otherwise)."""
    import serve.generate

    def use(lm, **settings):
        sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, **settings}
        monkeypatch.setattr(serve.generate, "open_model", lambda args: (lm, sampling))
        return serve.generate.main

    return use


def test_serve_generate_refuses_a_prompt_that_is_not_utf8_in_one_line(generate_with, capsys):
    """``--prompt $'\\xff\\xfe'`` ended in a UnicodeEncodeError traceback when the prompt was printed; now it is one
    line and exit 2, before the bundle is even loaded (as chat_cli refuses such a message)."""
    main = generate_with(scripted_lm(["ab"], context=64))
    assert main(["bundle", "--prompt", "ok\udcff\udcfe"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --prompt: the prompt is not valid UTF-8: byte 0xFF at character 2\n"
    raw = subprocess.run([sys.executable, "-m", "serve.generate", "no-such-bundle", "--prompt", b"\xff\xfe"],
                         capture_output=True, cwd=ROOT, timeout=120)
    assert (raw.returncode, raw.stdout) == (2, b"")
    assert raw.stderr == b"error: --prompt: the prompt is not valid UTF-8: byte 0xFF at character 0\n"


def test_serve_generate_checks_every_request_before_printing(generate_with, capsys):
    """``--max-new-tokens 100000`` printed the prompt, then the context-length error; now nothing reaches stdout."""
    main = generate_with(scripted_lm(["ab"], context=64), temperature=0.8)
    assert main(["bundle", "--max-new-tokens", "100000"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: --max-new-tokens: the prompt is ") and "100000" in err and "context length 64" in err
    assert main(["bundle", "--prompt", "ab", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("abababab\n    (sampled: ") and "[greedy] abababab\n    (greedy" in out

