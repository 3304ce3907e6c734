"""SGLang's FP4 KV cache (``--kv-cache-dtype fp4_e2m1``): e2m1 codes, a power-of-two scale per block of 16.

Storage: :class:`~kvlab.runtime.engine_formats.FP4Segment` with KVFP4's block exponents. The recipe
is SGLang's ``FP4MXBlock16KVQuantizeUtil.batched_quantize`` and ``batched_dequantize``
(``python/sglang/srt/layers/quantization/kvfp4_tensor.py``). Its blocks are 16 consecutive elements
of the ``[tokens, heads, head_dim]`` tensor it is given, so with a head dim that is a multiple of
16 a block is 16 channels of one token of one head, as here. Each block gets one scale ``2^e``, with
``e = ceil(log2(max(amax_block / 6, 1e-10)))``, stored as the byte ``e + 127``. The elements of
``x / 2^e`` get e2m1 codes by counting the midpoints they reach, so a tie goes to the larger
magnitude. Nothing is calibrated: SGLang's documentation says the scales are computed on the fly.

What SGLang's page does not say and kvlab does not model: which attention backends read this
format, and whether they round the same way in a fused kernel (the recipe above is the one its
memory pool calls).

Ratio semantics: those of the engine formats (:mod:`kvlab.methods.fp8_e4m3`): ratio 1 is the full
cache; above it every token is stored in FP4, and if the cache is still above full bytes / ratio,
document tokens are evicted (``evict_with``) until it fits.
"""

from __future__ import annotations

import torch

from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.context import Context
from kvlab.methods.families.engine_format import FP4Format
from kvlab.runtime.cache import Segment
from kvlab.runtime.engine_formats import FP4Segment


@register
class KVFP4(FP4Format):
    name = "fp4_e2m1"
    summary = (
        "SGLang's FP4 KV cache (--kv-cache-dtype fp4_e2m1): e2m1 codes with a power-of-two scale per block "
        "of 16 head-dim channels, made on the fly; the ratio only caps the memory (evicting the oldest or "
        "a scorer's lowest)"
    )
    paper = Paper(
        "SGLang",
        None,
        "Quantized KV Cache (--kv-cache-dtype fp4_e2m1, FP4MXBlock16KVQuantizeUtil)",
        url="https://github.com/sgl-project/sglang/blob/main/docs/advanced_features/quantized_kv_cache.md",
    )
    family = "engine formats"
    bf16_tolerance = "code_flips"  # e2m1 codes flip like NVFP4's
    layer_scales = 0  # no per-tensor scales: every byte beside the template goes to tokens

    def store(
        self,
        ctx: Context,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        index: torch.Tensor,
    ) -> Segment:
        return FP4Segment.quantize(keys, values, lengths, index)
