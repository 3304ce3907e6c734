"""TensorRT-LLM's NVFP4 KV cache: e2m1 codes, an e4m3 scale per block of 16, a float32 global scale.

Storage: :class:`~kvlab.runtime.engine_formats.FP4Segment`. The recipe is TensorRT-LLM's
``cvt_warp_fp16_to_fp4`` (``cpp/tensorrt_llm/kernels/quantization.cuh``; read through copies of
that kernel in the code index, since the TensorRT-LLM snapshot was too large to fetch here): with
``SFScaleVal`` the inverse of the global scale ``g``, a block's scale is
``e4m3(SFScaleVal * amax_block / 6)``, the elements are multiplied by
``1 / (fp32(block scale) * g)`` and converted to e2m1 by a round-to-nearest-even, saturating
conversion; a block whose scale is 0 stores zeros.

Not verified in TensorRT-LLM's own source: how its KV cache obtains the global scale (a
checkpoint's calibrated KV scale). kvlab uses the documented NVFP4 convention,
``g = amax_tensor / (6 * 448)``, calibrated on the document: one global scale per layer for the
keys and one for the values, from every token of the full cache (as the FP8 formats' per-tensor
scales). Blocks run along the head dim of one token of one head (16 consecutive channels), so the
head dim must be a multiple of 16.

Ratio semantics: those of the engine formats (:mod:`kvlab.methods.fp8_e4m3`): ratio 1 is the full
cache, above it everything is stored in NVFP4 and, if still above full bytes / ratio, document
tokens are evicted (``evict_with``) until it fits.
"""

from __future__ import annotations

import torch

from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.context import Context
from kvlab.methods.families.engine_format import FP4Format
from kvlab.runtime.cache import Segment
from kvlab.runtime.engine_formats import FP4Segment, nvfp4_global_scale


@register
class NVFP4(FP4Format):
    name = "nvfp4"
    summary = (
        "TensorRT-LLM's NVFP4 KV cache: e2m1 codes with an e4m3 scale per block of head-dim channels and a "
        "float32 global scale per layer; the ratio only caps the memory (evicting the oldest or a scorer's "
        "lowest)"
    )
    paper = Paper(
        "NVIDIA TensorRT-LLM",
        None,
        "NVFP4 KV cache (cvt_warp_fp16_to_fp4)",
        url="https://github.com/NVIDIA/TensorRT-LLM",
    )
    family = "engine formats"
    bf16_tolerance = "code_flips"  # e2m1 codes flip like KIVI's 4-bit ones

    def store(
        self,
        ctx: Context,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        index: torch.Tensor,
    ) -> Segment:
        k_global = nvfp4_global_scale(ctx.full.keys[layer])
        v_global = nvfp4_global_scale(ctx.full.values[layer])
        return FP4Segment.quantize(keys, values, lengths, index, k_global, v_global)
