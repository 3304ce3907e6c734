"""vLLM's FP8 KV cache in e5m2 (``--kv-cache-dtype fp8_e5m2``).

The same storage as ``fp8_e4m3`` (:mod:`kvlab.methods.fp8_e4m3`, whose docstring cites the vLLM
source read) in the other float8 format: 1 sign, 5 exponent and 2 mantissa bits, largest finite
value 57344. vLLM dispatches ``fp8_e5m2`` to ``__NV_E5M2`` in ``scaled_convert``
(``csrc/quantization/fp8/nvidia/quant_utils.cuh``), the same saturating conversion
(``__NV_SATFINITE``); torch's own ``float8_e5m2`` cast does not saturate (a value past the
largest rounds to inf), which is why :func:`~kvlab.runtime.engine_formats.fp8_encode` clamps
first. ``--calculate-kv-scales`` uses the same divisors as for e4m3 (``Attention.calc_kv_scales``
does not look at the format).
"""

from __future__ import annotations

from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.methods.families.engine_format import FP8Format, FP8Options


@register
class FP8E5M2(FP8Format):
    name = "fp8_e5m2"
    fp8 = "e5m2"
    summary = (
        "vLLM's FP8 KV cache, e5m2 (--kv-cache-dtype fp8_e5m2): every key and value one byte with a "
        "per-tensor scale per layer; the ratio only caps the memory (evicting the oldest or a scorer's lowest)"
    )
    paper = Paper(
        "vLLM", None, "Quantized KV Cache (--kv-cache-dtype fp8_e5m2)", url="https://github.com/vllm-project/vllm"
    )
    family = "engine formats"
    bf16_tolerance = "code_flips"  # as fp8_e4m3
    Options = FP8Options
    presets = {"fp8_e5m2": {"scale": "fixed"}, "fp8_e5m2+calculate-kv-scales": {"scale": "calculated"}}
