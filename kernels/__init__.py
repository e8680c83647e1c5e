"""Lynx codec kernels, shipped as ``lynx_connector.kernels``.

Every Triton kernel (``lynx_triton``) has a torch twin (``*_ref``) that is both the CPU implementation and
the test oracle. This package imports without Triton: only ``lynx_triton`` needs it, and it is imported lazily.
"""
