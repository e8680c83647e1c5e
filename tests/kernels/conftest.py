"""Triton runs on CPU only in its interpreter, and ``@triton.jit`` decides at decoration time. The flag must not
leak into the rest of the session (vLLM, imported by other tests, changes behaviour under it), so the Triton
tests switch it on for their module only: see ``triton_interpreter`` in ``test_triton_twins.py``."""
