"""Compression methods, one module each, registered by name (see base.py)."""
from kvlab.methods import attention_matching, beacon, cur, expected_attention, fp8_e4m3, fp8_e5m2, h2o, keydiff, kivi, knorm, kvzip, lagkv, no_context, nvfp4, pyramidkv, random_evict, snapkv, streaming, summarisation, summary_am, tova  # noqa: F401  (registration side effects)
from kvlab.methods.base import REGISTRY, Method, MethodError, Request, get_method

__all__ = ["REGISTRY", "Method", "MethodError", "Request", "get_method"]
