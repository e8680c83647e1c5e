"""Triton runs on CPU only in its interpreter, and ``@triton.jit`` decides at decoration time: set the flag
before any kernel module is imported (this conftest is loaded before the test modules)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
