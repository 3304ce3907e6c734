"""Compression methods, one module each, registered by name (see base.py)."""
from kvlab.methods import attention_matching, snapkv, streaming  # noqa: F401  (registration side effects)
from kvlab.methods.base import REGISTRY, Method, MethodError, Request, get_method

__all__ = ["REGISTRY", "Method", "MethodError", "Request", "get_method"]
