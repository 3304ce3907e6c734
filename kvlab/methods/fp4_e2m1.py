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
from kvlab.methods.families.engine_format import EVICT_LEARN, FP4Format
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
    learn = (
        "Stores every key and value element as a 4-bit e2m1 code (a sign and the magnitudes 0, 0.5, 1, 1.5, 2, 3, "
        "4, 6), two per byte, as SGLang's `--kv-cache-dtype fp4_e2m1` does (its MXFP4-style KV cache, with blocks "
        "of 16 elements where the OCP spec has 32). Each block $b$ of 16 consecutive channels of a token has one "
        "power-of-two scale, stored as its exponent in one byte (e8m0): "
        "$e_b=\\lceil\\log_2(\\max_{j\\in b}|x_j|/6)\\rceil$, then $q_j$ is the e2m1 value nearest to "
        "$x_j/2^{e_b}$, a tie going to the larger magnitude, and $\\hat x_j=q_j\\,2^{e_b}$. There is no global "
        "scale and nothing to calibrate. The recipe is SGLang's `FP4MXBlock16KVQuantizeUtil` "
        "(`python/sglang/srt/layers/quantization/kvfp4_tensor.py`). Compared with NVFP4 (`nvfp4`): a power of "
        "two wastes up to half of the e2m1 range per block, where NVFP4's e4m3 block scale fits the block's "
        "largest value. Memory: 4 bits per element plus 8 bits per 16 elements, 4.5 bits, so 3.56x the model's "
        "cache in bf16 (SGLang's own figure) and 7.1x in float32 (the ratio is counted against the model's own "
        "dtype). " + EVICT_LEARN
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
