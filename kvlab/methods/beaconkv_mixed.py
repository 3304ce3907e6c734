"""``beaconkv_mixed``, the source article's reading of BeaconKV (Kim, Kim, Shim, Choi, 2026): the
tokens the beacons select (scored as in ``beaconkv``) stay at full precision, the others are stored
at 4 or 2 bits (KIVI, :class:`~kvlab.runtime.quant_segment.QuantSegment`) or evicted; the ratio is a
*memory* ratio (bytes stored ~= full bytes / ratio, kvlab.methods.families.memory_plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvlab.compression.interface import document_importance
from kvlab.compression.options import knob
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.beacon_core import BeaconBase, BeaconOptions, beacon_scores, split_head
from kvlab.methods.families.memory_plan import build_layer, context_plan
from kvlab.runtime.cache import CompressedKV

Rest = Literal["evict", "4bit", "2bit"]
REST_BITS = {"evict": None, "4bit": 4, "2bit": 2}


@dataclass(frozen=True)
class BeaconMixedOptions(BeaconOptions):
    rest: Rest = knob("4bit", "what happens to the tokens the beacons do not select: evict, 4bit or 2bit (KIVI)")
    group_size: int = knob(32, "KIVI group size of the quantised rest", low=1)


@register
class BeaconKVMixed(BeaconBase):
    name = "beaconkv_mixed"
    summary = (
        "mixed precision: beacon-selected tokens + recent window at full precision, the rest "
        "quantised (KIVI) or evicted; the ratio is a memory ratio (bytes stored ~ full bytes / ratio)"
    )
    family = "quantisation"
    bf16_tolerance = "code_flips"  # the byte plan is pinned in tests/test_bf16.py
    Options = BeaconMixedOptions
    #: The ratio is met in bytes (tests compare bytes, not token counts).
    memory_ratio_semantics: ClassVar[str] = "match"

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        bits = REST_BITS[opts.rest]
        plan = context_plan(ctx, req.ratio, bits, opts.group_size)
        scores, beacons = beacon_scores(req, opts)
        layers = []
        for i, s in enumerate(scores):
            splits = [
                split_head(s[h], int(plan.n_fp[i, h]), int(plan.n_quant[i, h]), opts.window) for h in range(s.shape[0])
            ]
            layers.append(build_layer(ctx, i, splits, bits, opts.group_size))
        stored = CompressedKV(layers, ctx.length, meta={}, importance=document_importance(req, scores))
        stored.meta = {
            "method": self.name,
            "beacon_source": opts.beacon_source,
            "rest": opts.rest,
            "beacon_positions": beacons,
            **plan.details(ctx.doc_len),
            "memory_ratio": ctx.full.nbytes / max(1, stored.nbytes),
        }
        return stored
