"""Random eviction: each head keeps a seeded random subset of the document (a floor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import Options, knob
from kvlab.compression.paper import Baseline
from kvlab.compression.registry import register
from kvlab.compression.request import Request


@dataclass(frozen=True)
class RandomOptions(Options):
    seed: int = knob(0, "seed of the random scores (same seed, same kept tokens)", low=0)


@register
class RandomEviction(EvictionMethod):
    name = "random"
    summary = "a seeded random subset of the document per head: the floor any scoring rule must beat"
    paper = Baseline("a seeded random subset of the document (kvpress's RandomPress)")
    family = "baselines"
    bf16_tolerance = "same_tokens"  # seeded: the same tokens in both dtypes
    Options = RandomOptions
    scores_are_importance = False  # chance, not importance

    def scores(self, req: Request) -> list[torch.Tensor]:
        lm = req.ctx.lm
        # Drawn on the CPU generator (the same tokens on every device), scored on the model's.
        gen = torch.Generator().manual_seed(self.options.seed)
        shape = (lm.n_kv_heads, req.ctx.doc_len)
        return [torch.rand(shape, generator=gen, device="cpu").to(lm.device) for _ in range(lm.n_layers)]
