"""``python -m train.sft``: see :mod:`train.sft.cli`."""

import sys

from train.sft.cli import main

sys.exit(main())
