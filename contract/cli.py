"""How every ``python -m`` command of the project prints ``--help``: :class:`HelpFormatter`."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` stating each option's default once: argparse's ``(default: X)`` only where the help text does not
    mention a default itself (``(default: all cores)``, ``default auto: …``) and there is a value to state: not for a
    flag (``store_true`` / ``store_false``), None or an empty list. A list default is stated as its items
    (``data/sample``, not ``['data/sample']``); an option whose default is 0 states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or action.nargs == 0 or default is None or default is argparse.SUPPRESS \
                or (isinstance(default, list) and not default):
            return action.help
        if isinstance(default, list):
            return text + " (default: " + " ".join(map(str, default)).replace("%", "%%") + ")"
        return super()._get_help_string(action)
