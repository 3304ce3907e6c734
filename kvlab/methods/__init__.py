"""Compression methods: one module each, the file named as the method, found by discovery.

Importing this package imports every module in it (:func:`kvlab.compression.registry.discover`),
each registering its method: a method is a file here, and its Learn text the markdown file beside it
(``snapkv.py``, ``snapkv.md``: kvlab.learn_text), and nothing else. What the methods stand on
(options, the interface, selection, the registry, shared maths) is kvlab.compression; what a family
of methods shares (the shared scorers, a family's base and machinery) is kvlab.methods.families, a
subpackage that discovery skips. A method imports those, never another method.
"""

from kvlab.compression.interface import Method
from kvlab.compression.options import MethodError
from kvlab.compression.registry import REGISTRY, discover, get_method, method_class
from kvlab.compression.request import Request

discover(__name__, __path__)

__all__ = ["REGISTRY", "Method", "MethodError", "Request", "get_method", "method_class"]
