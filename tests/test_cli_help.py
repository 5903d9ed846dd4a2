"""Every ``python -m`` command prints ``--help`` by one rule (contract/cli.py): an option with a value to default
to states it exactly once, a flag states none, and a list default reads as its items."""

from __future__ import annotations

import argparse
import importlib

import pytest

from contract.cli import HelpFormatter

COMMANDS = ["train.run", "train.sft.cli", "train.sft.build", "train.preflight.__main__", "train.plan", "train.data",
            "train.tokenizer.cli", "train.compression", "export.onnx", "export.gguf", "serve.generate",
            "serve.chat_cli"]


def _parsers(module: str, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parser ``module.main`` builds (caught at its ``parse_args``) and its sub-commands' parsers."""
    seen = []

    def caught(self, *_args, **_kwargs):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(SystemExit):
        importlib.import_module(module).main([])
    parsers = [seen[0]]
    for action in seen[0]._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += list(action.choices.values())
    return parsers


@pytest.mark.parametrize("module", COMMANDS)
def test_each_option_states_its_default_once(module, monkeypatch):
    """export.onnx, export.gguf, train.compression and train.sft.build stated no default unless the text did, and
    train's and serve's commands followed one rule in two copies."""
    for parser in _parsers(module, monkeypatch):
        assert parser.formatter_class is HelpFormatter, parser.prog
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            text = parser._get_formatter()._expand_help(action) if action.help else ""
            mentions = text.lower().count("default")
            where = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}: {text!r}"
            if action.nargs == 0:  # a flag: nothing to state unless its text does
                assert "(default: " not in text or "(default: " in action.help, where
            elif action.default is None or action.default == []:
                assert mentions <= 1, where
            else:
                assert mentions == 1 and "['" not in text, where


def test_the_rule():
    """The formatter itself: a text's own default wins, a flag and None state none, 0 and a list are stated."""
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    p.add_argument("--zero", type=int, default=0, help="a count")
    p.add_argument("--paths", nargs="+", default=["data/sample", "b%"], help="inputs")
    p.add_argument("--threads", default=4, help="threads (default: all cores)")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--off", action="store_false", dest="on", help="turn it off")
    p.add_argument("--none", default=None, help="nothing")
    text = " ".join(p.format_help().split())
    assert "a count (default: 0)" in text and "inputs (default: data/sample b%)" in text
    assert "threads (default: all cores) " in text and text.count("(default:") == 3
