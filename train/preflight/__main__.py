"""``python -m train.preflight``: prepare data, build the run's model and optimizer, run every check, write
``runs/NAME/preflight.json``. Exit 0 when every check passed, 1 when one failed, 2 on bad input."""

from __future__ import annotations

import argparse
import sys

from contract.cli import HelpFormatter
from train.config import add_config_args
from train.errors import TrainError
from train.preflight import PreflightFailed
from train.run import Trainer


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (see the module doc)."""
    p = argparse.ArgumentParser(prog="python -m train.preflight", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_config_args(p)
    p.add_argument("--name", default=None, help="run name (default: the config's); the report goes to "
                                                "runs/NAME/preflight.json")
    args = p.parse_args(argv)
    try:
        trainer = Trainer.from_args(args)
        ok = trainer.preflight()
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0 if ok else PreflightFailed.exit_code


if __name__ == "__main__":
    sys.exit(main())
