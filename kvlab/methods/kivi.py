"""KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Uniform low-bit quantisation of the whole document cache: keys per channel
(groups of ``group_size`` tokens), values per token (groups of ``group_size``
channels), float16 scale and zero per group, codes really packed
(:class:`~kvlab.runtime.quant_segment.QuantSegment`). As in KIVI, the most recent
tokens that do not yet fill a key group (the last ``T mod group_size``) stay
at full precision, and so does the chat-template prefix.

Ratio semantics: the memory this takes is fixed by ``bits``, not by the
requested ratio, which only caps it: ratio 1 means no compression (the full
cache, like every method); above 1 the quantised cache is used, and if it is
still larger than full bytes / ratio, the oldest document tokens are evicted
until it fits (kvlab.methods.families.memory_plan, which may give some heads one token
more than others to use the bytes rounding leaves). The actual memory ratio
is what RunResult reports (and ``meta["memory_ratio"]``); it can be far above
the requested one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.compression.interface import Method
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.memory_plan import TokenSplit, build_layer, context_plan
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.low_bit import SUPPORTED_BITS


@dataclass(frozen=True)
class KIVIOptions(Options):
    bits: int = knob(2, "bits per quantised element: 2, 4 or 8")
    group_size: int = knob(32, "KIVI group size (tokens for keys, channels for values)", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in SUPPORTED_BITS:
            raise MethodError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits}")


@register
class KIVI(Method):
    name = "kivi"
    summary = (
        "uniform KIVI quantisation to `bits` bits (keys per channel, values per token, in groups; the "
        "tokens that do not fill a key group at full precision): memory fixed by bits, the ratio only caps it"
    )
    paper = Paper(
        "Liu et al.", 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arxiv="2402.02750"
    )
    family = "quantisation"
    bf16_tolerance = "code_flips"  # the byte plan is pinned in tests/test_bf16.py
    Options = KIVIOptions
    #: The ratio is an upper bound on memory, not a token count (see the module docstring).
    memory_ratio_semantics: ClassVar[str] = "at_most"

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        full = ctx.full
        if req.ratio == 1.0:
            return CompressedKV(
                [list(layer) for layer in full.stored.layers],
                ctx.length,
                meta={"method": self.name, "bits": None, "memory_ratio": 1.0},
            )
        residual = ctx.doc_len % opts.group_size
        plan = context_plan(ctx, req.ratio, opts.bits, opts.group_size, fp_newest=residual)
        layers = [
            build_layer(
                ctx,
                i,
                [
                    TokenSplit.newest(ctx.doc_len, int(n_fp), int(n_q), ctx.lm.device)
                    for n_fp, n_q in zip(fp_row, q_row)
                ],
                opts.bits,
                opts.group_size,
            )
            for i, (fp_row, q_row) in enumerate(zip(plan.n_fp, plan.n_quant))
        ]
        stored = CompressedKV(layers, ctx.length, meta={})
        stored.meta = {
            "method": self.name,
            "bits": opts.bits,
            **plan.details(ctx.doc_len),
            "memory_ratio": full.nbytes / max(1, stored.nbytes),
        }
        return stored
