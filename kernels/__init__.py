"""Lynx codec kernels. This top-level ``kernels/`` directory is shipped as ``lynx_connector.kernels`` (setup.py
maps it; there is no top-level ``kernels`` module): import it as ``lynx_connector.kernels.<module>``.

* ``groupquant_ref``, ``pack``, ``fp16_meta``: the torch twins: the portable implementation of the group
  quantizer (and its 4-bit packing and directed fp16 rounding) and the oracle every other kernel is tested
  against, bit-exact (tests/kernels).
* ``groupquant_numba``, ``groupquant_numba_f32``, ``groupquant_numba_kv``: the CPU fast path (numba; generic
  kernels, fp32-cache kernels, and the fp32 one-pass K+V encode for channel and token groups),
  reading and writing vLLM's paged cache directly; driven by ``lynx_connector.codec.numba_path``.
* ``lynx_triton``: the GPU path (Triton; also runs in the CPU interpreter), driven by
  ``lynx_connector.codec.triton_path``.
* ``errors``: the errors the kernels raise on non-finite or out-of-range KV.

This package imports without numba or Triton: ``codec`` imports the numba and Triton modules lazily, only
where they can run.
"""
