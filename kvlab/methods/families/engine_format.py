"""What the serving engines' KV-cache formats share (``fp8_e4m3``, ``fp8_e5m2``, ``nvfp4``):
:class:`EngineFormat`, the FP8 scales (:class:`FP8Format`) and the ``evict_with`` knob.

Sources read (vLLM, github.com/vllm-project/vllm):

* the cast: ``csrc/quantization/fp8/nvidia/quant_utils.cuh``, ``scaled_convert`` ->
  ``scaled_vec_conversion``: ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)``;
  ``fp8`` and ``fp8_e4m3`` both dispatch to e4m3 (``DISPATCH_BY_KV_CACHE_DTYPE``). The
  conversion saturates; there is no clamp before it. The Triton writer
  (``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``) divides by the scale and lets
  the store cast.
* the scales: ``scale="fixed"`` is 1.0, what ``BaseKVCacheMethod.process_weights_after_loading``
  (``vllm/model_executor/layers/quantization/kv_cache.py``) uses when the checkpoint ships none;
  ``scale="calculated"`` is ``--calculate-kv-scales``: ``Attention.calc_kv_scales``
  (``vllm/attention/layer.py``) sets ``k_scale = max|k| / K_SCALE_CONSTANT`` and
  ``v_scale = max|v| / V_SCALE_CONSTANT`` from the first forward pass, once, per layer
  (``vllm/envs.py``: 200 and 100 by default). Not the format's largest value: that is
  ``scale="checkpoint"``, the scale a calibrated checkpoint ships (compressed-tensors'
  ``calculate_qparams``: ``max|x| / (bit_range / 2)``, i.e. max|x| / 448 for e4m3), here
  calibrated on the document itself.

Ratio semantics (as KIVI's in kvlab): the format fixes the bytes, the ratio caps them. Ratio 1 is
the full cache; above it every stored token is in the format (the chat template's too, as an
engine stores it), and when that is still above full bytes / ratio, document tokens are evicted
until it fits (``evict_with``: the oldest, or a scoring method's lowest), the same number in every
head and layer: "evict, then store the rest in the format". The memory ratio is counted against
the model's own cache dtype.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvlab.compression.interface import EvictionMethod, Method, document_importance
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.registry import REGISTRY, get_method
from kvlab.compression.request import Request
from kvlab.compression.selection import top_k_per_head
from kvlab.context import Context
from kvlab.runtime.cache import CompressedKV, Segment, gather_tokens
from kvlab.runtime.engine_formats import (
    FP8_DTYPES,
    NVFP4_BLOCK,
    FP8Segment,
    fp4_token_bytes,
    fp8_max,
    fp8_token_bytes,
    tokens_that_fit,
)

#: ``evict_with``'s value for KIVI's rule: the oldest document tokens go first.
OLDEST = "oldest"
#: vLLM's divisors for ``--calculate-kv-scales`` (``vllm/envs.py``: K_SCALE_CONSTANT, V_SCALE_CONSTANT).
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0


def scoring_methods() -> list[str]:
    """The registered methods whose scores can choose what to evict (the eviction methods)."""
    return sorted(name for name, cls in REGISTRY.items() if issubclass(cls, EvictionMethod))


def evict_with_knob() -> str:
    """The ``evict_with`` knob every engine format declares."""
    return knob(
        OLDEST,
        "when the format alone is above full bytes / ratio, which document tokens go: oldest, or "
        "the name of a scoring method (its lowest scores)",
    )


def check_evict_with(name: str) -> None:
    """Refuse an ``evict_with`` that is neither ``oldest`` nor a registered scoring method."""
    if name != OLDEST and name not in scoring_methods():
        raise MethodError(
            f"evict_with must be oldest or a scoring method ({', '.join(scoring_methods())}), got {name!r}"
        )


@dataclass(frozen=True)
class FP8Options(Options):
    scale: Literal["fixed", "calculated", "checkpoint"] = knob(
        "fixed",
        "per-tensor scales: fixed (1.0, vLLM's default), calculated (vLLM's --calculate-kv-scales: "
        "max|k| / 200, max|v| / 100) or checkpoint (max|x| / the format's largest value)",
    )
    evict_with: str = evict_with_knob()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_evict_with(self.evict_with)


def document_tokens(ctx: Context, ratio: float, token_bytes: int, layer_scales: int = 2) -> int:
    """Document tokens every KV head stores so that the cache, template included, takes at most
    full bytes / ratio (token_bytes: one token of one head in the format, keys and values;
    layer_scales: the float32 per-tensor scales each layer stores besides)."""
    lm = ctx.lm
    fits = tokens_that_fit(ctx.full.nbytes / ratio, lm.n_layers, lm.n_kv_heads, token_bytes, layer_scales)
    n_doc = min(ctx.doc_len, fits - ctx.prefix_len)
    if n_doc < 1:
        raise MethodError(f"ratio {ratio:g} leaves no room for one document token beside the template in this format")
    return n_doc


class EngineFormat(Method):
    """A serving engine's KV-cache format: every stored token in it, the ratio a cap on the bytes.
    Its ``Options`` declare ``evict_with`` (:func:`evict_with_knob`)."""

    #: The ratio is an upper bound on memory, not a token count (see the module docstring).
    memory_ratio_semantics: ClassVar[str] = "at_most"
    #: float32 per-tensor scales each layer stores besides its tokens (the keys' and the values').
    layer_scales: ClassVar[int] = 2
    query_aware_when = "evict_with=snapkv_question"

    @abstractmethod
    def token_bytes(self, head_dim: int) -> int:
        """Bytes one token of one KV head costs in the format (keys and values)."""

    @abstractmethod
    def store(
        self,
        ctx: Context,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        index: torch.Tensor,
    ) -> Segment:
        """One layer's stored tokens (keys/values [H, L, d], lengths [H], index [H, L]) in the format;
        per-tensor scales come from the whole layer of the full cache, ``ctx.full``."""

    def details(self) -> dict:
        """The format's settings, for the stored cache's meta."""
        return {}

    def fit_tokens(self, ctx: Context, ratio: float) -> int:
        """Document tokens every KV head stores at ``ratio``: :func:`document_tokens` with
        :meth:`token_bytes` in every layer (a format whose layers cost differently overrides it)."""
        return document_tokens(ctx, ratio, self.token_bytes(ctx.lm.head_dim), self.layer_scales)

    def scorer(self) -> EvictionMethod | None:
        """The scoring method that chooses what to evict, or None for the oldest."""
        name = self.options.evict_with
        return None if name == OLDEST else get_method(name)

    def uses_question(self) -> bool:
        scorer = self.scorer()
        return scorer is not None and scorer.uses_question()

    def compress(self, req: Request) -> CompressedKV:
        ctx = req.ctx
        if req.ratio == 1.0:
            return CompressedKV(
                [list(layer) for layer in ctx.full.stored.layers],
                ctx.length,
                meta={"method": self.name, "memory_ratio": 1.0},
            )
        n_doc = self.fit_tokens(ctx, req.ratio)
        scorer, importance = self.scorer(), None
        device, n_heads = ctx.lm.device, ctx.lm.n_kv_heads
        lengths = torch.full((n_heads,), n_doc, dtype=torch.long, device=device)
        if scorer is None:
            newest = torch.arange(ctx.doc_len - n_doc, ctx.doc_len, device=device).expand(n_heads, n_doc)
            doc_index = [newest] * ctx.lm.n_layers
        else:
            scores = scorer.kept_scores(req)
            doc_index = [top_k_per_head(s, lengths) for s in scores]
            importance = document_importance(req, scores)
        prefix = torch.arange(ctx.prefix_len, device=device).expand(n_heads, ctx.prefix_len)
        layers = []
        for i, doc in enumerate(doc_index):
            index = torch.cat([prefix, doc + ctx.prefix_len], dim=1)
            keys, values = gather_tokens(ctx.full.keys[i], index), gather_tokens(ctx.full.values[i], index)
            layers.append([self.store(ctx, i, keys, values, lengths + ctx.prefix_len, index)])
        stored = CompressedKV(layers, ctx.length, meta={}, importance=importance)
        stored.meta = {
            "method": self.name,
            **self.details(),
            "evict_with": self.options.evict_with,
            "evicted_tokens_per_head": ctx.doc_len - n_doc,
            "memory_ratio": ctx.full.nbytes / max(1, stored.nbytes),
        }
        return stored


def fp8_scale(x: torch.Tensor, convention: str, dtype: torch.dtype, constant: float) -> torch.Tensor:
    """x: one layer's keys or values [H, T, d] -> its float32 per-tensor scale, 0-dim, by ``convention``
    (``constant``: vLLM's divisor for "calculated"). A zero tensor gets 1 (its codes are 0 whatever
    the scale)."""
    if convention == "fixed":
        return torch.ones((), dtype=torch.float32, device=x.device)
    amax = x.float().abs().amax()
    divisor = constant if convention == "calculated" else fp8_max(dtype)
    return torch.where(amax > 0, amax / divisor, torch.ones_like(amax))


class FP8Format(EngineFormat):
    """vLLM's FP8 KV cache in one of its float8 formats (``fp8``: ``e4m3`` or ``e5m2``)."""

    fp8: ClassVar[str]

    def token_bytes(self, head_dim: int) -> int:
        return fp8_token_bytes(head_dim)

    def details(self) -> dict:
        return {"format": f"fp8_{self.fp8}", "scale": self.options.scale}

    def store(
        self,
        ctx: Context,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        index: torch.Tensor,
    ) -> Segment:
        dtype, convention = FP8_DTYPES[self.fp8], self.options.scale
        k_scale = fp8_scale(ctx.full.keys[layer], convention, dtype, K_SCALE_CONSTANT)
        v_scale = fp8_scale(ctx.full.values[layer], convention, dtype, V_SCALE_CONSTANT)
        return FP8Segment.quantize(keys, values, lengths, index, dtype, k_scale, v_scale)


@dataclass(frozen=True)
class FP4Options(Options):
    """The FP4 formats' one knob: nothing to calibrate, only what goes when the format alone is too big."""

    evict_with: str = evict_with_knob()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_evict_with(self.evict_with)


class FP4Format(EngineFormat):
    """An FP4 format (NVFP4, SGLang's KVFP4): half a byte per element plus a scale byte per block of 16
    head-dim channels, so the head dim must be whole blocks."""

    Options = FP4Options

    def token_bytes(self, head_dim: int) -> int:
        return fp4_token_bytes(head_dim)

    def details(self) -> dict:
        return {"format": self.name}

    def compress(self, req: Request) -> CompressedKV:
        head_dim = req.ctx.lm.head_dim
        if head_dim % NVFP4_BLOCK:
            raise MethodError(
                f"{self.name} needs a head dim that is a multiple of {NVFP4_BLOCK}; this model's is {head_dim}"
            )
        return super().compress(req)
