"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Uniform low-bit quantisation of the whole document cache: keys per channel
(groups of ``group_size`` tokens), values per token (groups of ``group_size``
channels), float16 scale and zero per group, codes really packed
(:class:`~kvlab.runtime.quantized.QuantSegment`). As in KIVI, the most recent
tokens that do not yet fill a key group (the last ``T mod group_size``) stay
at full precision, and so does the chat-template prefix.

Ratio semantics: the memory this takes is fixed by ``bits``, not by the
requested ratio, which only caps it: ratio 1 means no compression (the full
cache, like every method); above 1 the quantised cache is used, and if it is
still larger than full bytes / ratio, the oldest document tokens are evicted
until it fits. The actual memory ratio is what RunResult reports (and
``meta["memory_ratio"]``); it can be far above the requested one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.methods.base import Method, MethodError, Request, register
from kvlab.runtime.quant import SUPPORTED_BITS
from kvlab.runtime.cache import CompressedKV, DenseSegment, Segment
from kvlab.runtime.quantized import QuantSegment, quant_nbytes


@dataclass(frozen=True)
class KIVIOptions:
    bits: int = field(default=2, metadata={"help": "bits per quantised element: 2, 4 or 8"})
    group_size: int = field(default=32, metadata={"help": "KIVI group size (tokens for keys, channels for values)"})

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise MethodError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")
        if self.group_size < 1:
            raise MethodError("group_size must be >= 1")


def kept_tokens(doc_len: int, residual: int, budget: int, fp: int, head_dim: int, bits: int, group_size: int) -> int:
    """Most recent document tokens one head can keep in ``budget`` bytes (at least 1):
    the newest ``residual`` at full precision (``fp`` bytes each), the others quantised."""
    for n in range(doc_len, 0, -1):
        dense = min(residual, n)
        if dense * fp + quant_nbytes(n - dense, head_dim, bits, group_size) <= budget:
            return n
    return 1


@register
class KIVI(Method):
    name = "kivi"
    summary = ("uniform KIVI quantisation (bits=2|4|8; keys per channel, values per token, groups of 32, the last "
               "T mod 32 tokens at full precision): memory fixed by bits, the ratio only caps it (ratio 1 = none)")
    paper = "Liu et al., 2024, KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"
    Options = KIVIOptions
    #: The ratio is an upper bound on memory, not a token count (see the module docstring).
    memory_ratio_semantics: ClassVar[str] = "at_most"

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        full = ctx.full
        if req.ratio == 1.0:
            return CompressedKV([list(layer) for layer in full.stored.layers], ctx.length,
                                meta={"method": self.name, "bits": None, "memory_ratio": 1.0})
        n_layers, (n_heads, _, head_dim) = len(full.keys), full.keys[0].shape
        prefix, doc_len = ctx.prefix_len, ctx.doc_len
        fp = 2 * head_dim * full.keys[0].element_size()
        residual = doc_len % opts.group_size
        budget = math.floor(full.nbytes / req.ratio) // (n_layers * n_heads) - prefix * fp
        n_keep = kept_tokens(doc_len, residual, budget, fp, head_dim, opts.bits, opts.group_size)
        n_dense = min(residual, n_keep)
        quant = torch.arange(prefix + doc_len - n_keep, prefix + doc_len - n_dense)
        dense = torch.arange(prefix + doc_len - n_dense, prefix + doc_len)
        layers: list[list[Segment]] = []
        for keys, values in zip(full.keys, full.values):
            segments: list[Segment] = []
            for index, fate in ((torch.arange(prefix), "template"), (dense, "kept")):
                if index.numel():
                    segments.append(DenseSegment.from_padded(
                        keys[:, index], values[:, index], torch.full((n_heads,), index.numel()),
                        index.expand(n_heads, -1), fate=fate))
            if quant.numel():
                segments.append(QuantSegment.quantize(
                    keys[:, quant], values[:, quant], torch.full((n_heads,), quant.numel()),
                    quant.expand(n_heads, -1), opts.bits, opts.group_size))
            layers.append(segments)
        stored = CompressedKV(layers, ctx.length, meta={})
        stored.meta = {
            "method": self.name,
            "bits": opts.bits,
            "quantized_tokens": int(quant.numel()),
            "full_precision_tokens": int(dense.numel()),
            "evicted_tokens": doc_len - n_keep,
            "memory_ratio": full.nbytes / max(1, stored.nbytes),
        }
        return stored
