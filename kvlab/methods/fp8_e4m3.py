"""vLLM's FP8 KV cache in e4m3 (``--kv-cache-dtype fp8`` or ``fp8_e4m3``).

Every stored key and value element is one float8 e4m3 byte of ``x / scale``, with one float32
scale per layer for the keys and one for the values (:class:`~kvlab.runtime.engine_formats.FP8Segment`).
The storage, the scales and the ratio's meaning are those of every FP8 format
(:mod:`kvlab.methods.families.engine_format`, whose docstring cites the vLLM source read).
"""

from __future__ import annotations

from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.methods.families.engine_format import FP8Format, FP8Options


@register
class FP8E4M3(FP8Format):
    name = "fp8_e4m3"
    fp8 = "e4m3"
    summary = (
        "vLLM's FP8 KV cache, e4m3 (--kv-cache-dtype fp8): every key and value one byte with a per-tensor "
        "scale per layer; the ratio only caps the memory (evicting the oldest or a scorer's lowest)"
    )
    paper = Paper(
        "vLLM", None, "Quantized KV Cache (--kv-cache-dtype fp8_e4m3)", url="https://github.com/vllm-project/vllm"
    )
    family = "engine formats"
    bf16_tolerance = "code_flips"  # an fp8 step flips; the byte plan is pinned in tests/test_bf16.py
    Options = FP8Options
    presets = {
        "fp8": {"scale": "fixed"},
        "fp8+calculate-kv-scales": {"scale": "calculated"},
        "fp8+checkpoint-scales": {"scale": "checkpoint"},
    }
