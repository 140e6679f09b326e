"""Session-wide test set-up.

Triton runs on the CPU through its interpreter in every test: TRITON_INTERPRET must be set before anything
imports triton, and test modules of any directory may import the trainer (and so the kernels) while pytest
collects them, before ``tests/kernels/conftest.py`` is read.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
