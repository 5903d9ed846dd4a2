"""``python -m train.tokenizer train|fertility``: the command lines of :mod:`train.tokenizer.cli`."""

import sys

from train.tokenizer.cli import main

sys.exit(main())
