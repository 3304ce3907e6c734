"""vLLM's FP8 KV cache in e4m3 (``--kv-cache-dtype fp8`` or ``fp8_e4m3``).

Every stored key and value element is one float8 e4m3 byte of ``x / scale``, with one float32
scale per layer for the keys and one for the values (:class:`~kvlab.runtime.engine_formats.FP8Segment`).
The storage, the scales and the ratio's meaning are those of every FP8 format
(:mod:`kvlab.methods.families.engine_format`, whose docstring cites the vLLM source read).
"""

from __future__ import annotations

from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.methods.families.engine_format import EVICT_LEARN, FP8_SCALE_LEARN, FP8Format, FP8Options


@register
class FP8E4M3(FP8Format):
    name = "fp8_e4m3"
    fp8 = "e4m3"
    summary = (
        "vLLM's FP8 KV cache, e4m3 (--kv-cache-dtype fp8): every key and value one byte with a per-tensor "
        "scale per layer; the ratio only caps the memory (evicting the oldest or a scorer's lowest)"
    )
    learn = (
        "Stores every key and value element as one float8 e4m3 byte (1 sign, 4 exponent, 3 mantissa bits; largest "
        "finite value 448), as vLLM's `--kv-cache-dtype fp8` (or `fp8_e4m3`) does: "
        "$q=\\operatorname{sat}\\big(\\operatorname{rne}(x/s)\\big)$ and $\\hat x=q\\,s$, with one float32 scale "
        "$s$ per layer for the keys and one for the values. Rounding is to nearest even; a value past 448 is stored "
        "as 448 (vLLM's `__NV_SATFINITE` conversion, `scaled_vec_conversion` in "
        "`csrc/quantization/fp8/nvidia/quant_utils.cuh`; kvlab clamps, then casts with torch). "
        + FP8_SCALE_LEARN
        + " Memory: one byte per element, so 2x the model's cache in bf16 or fp16 and 4x in "
        "float32 (the ratio is counted against the model's own dtype), less the 8 bytes of scales per layer. "
        + EVICT_LEARN
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
