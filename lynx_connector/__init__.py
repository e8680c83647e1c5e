"""lynx-connector: anchor-first progressive KV transfer for vLLM disaggregated prefill/decode (Lynx)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
