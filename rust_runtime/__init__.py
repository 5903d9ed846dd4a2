"""rust_runtime: Shalik's CPU runtime (a Llama forward on its own kernels, through PyO3).

The compiled module is ``rust_runtime.rust_runtime``.

This file makes the crate folder a Python package, so that ``pip install -e ".[all]"`` (setuptools-rust, from the
repository root) and ``pip install ./rust_runtime`` (maturin, the crate alone) both give ``import rust_runtime``
the same names. See rust_runtime/README.md.
"""

from .rust_runtime import *  # noqa: F403
from .rust_runtime import __all__, __doc__  # noqa: F401
