"""BeaconKV as published (Kim, Kim, Shim, Choi, 2026, "BeaconKV: Key-Value Cache Compression
Guided by Beacon Queries for Efficient Large Reasoning Model Inference"; details from secondary
summaries, the code was not available): KV *eviction* by the beacon scores of
kvlab.methods.families.beacon_core (the family's knobs and scoring too). The template prefix and a
recent window are always kept.
:func:`kvlab.bounded.beacon.beacon_generate` is the paper's setting: greedy decoding under a token
budget, evicting by these scores with the running query history. ``beaconkv_mixed`` is the
source article's reading, on the same scores.

Beacon sources (``beacon_source``): ``context`` (the model's own query history:
the document prefill's queries, as published), ``question`` (the question's
queries read after the document: query-aware) or ``instruction`` (a fixed
instruction read after the document). With ``context`` the last ``n_recent``
queries form the recent part and the earlier ones the beacon history; with
the other two, the beacons are sampled from that source's queries and the
recent part is still the document's last queries.
"""

from __future__ import annotations

import torch

from kvlab.compression.interface import document_importance
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.beacon_core import BeaconBase, BeaconOptions, beacon_scores, split_head
from kvlab.methods.families.memory_plan import build_layer
from kvlab.runtime.cache import CompressedKV


@register
class BeaconKV(BeaconBase):
    name = "beaconkv"
    summary = (
        "eviction: score = max attention from the recent and the beacon queries (cosine FPS over the "
        "pre-RoPE query history, re-rotated to now), max over the GQA group; template + recent window kept"
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = BeaconOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        """Per layer [H_kv, T_doc] beacon scores of the document tokens."""
        return beacon_scores(req, self.options)[0]

    def compress(self, req: Request) -> CompressedKV:
        ctx = req.ctx
        scores, beacons = beacon_scores(req, self.options)
        budget = min(req.doc_budget, ctx.doc_len)
        layers = [
            build_layer(ctx, i, [split_head(s[h], budget, 0, self.options.window) for h in range(s.shape[0])])
            for i, s in enumerate(scores)
        ]
        meta = {"method": self.name, "beacon_source": self.options.beacon_source, "beacon_positions": beacons}
        return CompressedKV(layers, ctx.length, meta=meta, importance=document_importance(req, scores))
