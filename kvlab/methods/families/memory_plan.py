"""Mixed-precision storage under a byte budget, shared by KIVI and BeaconKV-mixed.

Both store each KV head's document tokens in three ways: some at full
precision, some as packed low-bit codes (:class:`~kvlab.runtime.quant_segment.QuantSegment`),
the rest evicted, so that the whole cache takes at most ``full bytes / ratio``.
:func:`plan_memory` says how many tokens of each kind every head can afford;
the method says which tokens (:class:`TokenSplit`); :func:`build_layer` stores them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.context import Context
from kvlab.runtime.cache import DenseSegment, Segment, gather_tokens, template_segment
from kvlab.runtime.quant_segment import QuantSegment, quant_nbytes


@dataclass
class MemoryPlan:
    """Per layer and KV head: full-precision and quantised document tokens; target and planned bytes."""

    n_fp: torch.Tensor  # [L, H_kv]
    n_quant: torch.Tensor  # [L, H_kv]
    target_bytes: int
    planned_bytes: int

    def details(self, doc_len: int) -> dict:
        """The plan as a run's JSON details: token counts per head (means over heads) and the target."""
        stored = (self.n_fp + self.n_quant).float()
        return {
            "full_precision_tokens_mean": float(self.n_fp.float().mean()),
            "quantized_tokens_mean": float(self.n_quant.float().mean()),
            "evicted_tokens_mean": float(doc_len - stored.mean()),
            "target_bytes": self.target_bytes,
        }


def plan_memory(
    doc_len: int,
    prefix_len: int,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    element_size: int,
    full_nbytes: int,
    ratio: float,
    bits: int | None,
    group_size: int,
    fp_newest: int | None = None,
) -> MemoryPlan:
    """How many full-precision / quantised tokens each head stores so that the
    whole cache takes at most ``full_nbytes / ratio`` bytes, as close to it as the
    token granularity allows.

    The template prefix is stored at full precision and paid from the budget.
    With a quantised rest (``bits``), every document token is stored if even the
    all-quantised head fits, with as many at full precision as possible;
    otherwise none is at full precision and the lowest-scored are evicted.
    With ``fp_newest`` (KIVI), a head instead stores its newest tokens: the
    newest ``fp_newest`` at full precision, older ones quantised, the oldest
    evicted first.
    Every head gets the same plan for ``budget // heads`` bytes, then what
    rounding left over is spent head by head, each head buying as many more
    tokens as it can. At least one document token per head is stored.
    """
    fp = 2 * head_dim * element_size
    heads = n_layers * n_kv_heads
    target = math.floor(full_nbytes / ratio)
    budget = target - heads * prefix_len * fp
    # Byte bookkeeping, on the CPU: these counts never meet the model's tensors.
    n = torch.arange(doc_len + 1, device="cpu")
    if bits is None:
        qcost = torch.zeros(doc_len + 1, dtype=torch.long, device="cpu")
    else:
        qcost = torch.tensor([quant_nbytes(i, head_dim, bits, group_size) for i in range(doc_len + 1)], device="cpu")

    def plan(b: int) -> tuple[int, int, int]:
        """(full-precision tokens, quantised tokens, bytes) of one head given ``b`` bytes."""
        if bits is None:
            n_fp = max(1, min(doc_len, b // fp))
            return n_fp, 0, n_fp * fp
        if fp_newest is not None:
            dense = n.clamp(max=fp_newest)
            cost = dense * fp + qcost[n - dense]  # the newest n tokens stored
            ok = torch.nonzero(cost[1:] <= b)
            keep = int(ok.max()) + 1 if ok.numel() else 1
            return int(dense[keep]), keep - int(dense[keep]), int(cost[keep])
        cost = n * fp + qcost.flip(0)  # n at full precision, the other T - n quantised
        ok = torch.nonzero(cost <= b)
        if ok.numel():
            n_fp = int(ok.max())
            return n_fp, doc_len - n_fp, int(cost[n_fp])
        fits = torch.nonzero(qcost <= b)
        n_q = int(fits.max()) if fits.numel() else 0
        if n_q == 0:
            return 1, 0, fp
        return 0, n_q, int(qcost[n_q])

    base = plan(budget // heads)
    n_fp = torch.full((heads,), base[0], device="cpu")
    n_q = torch.full((heads,), base[1], device="cpu")
    left = budget - heads * base[2]
    for h in range(heads):
        extra = plan(base[2] + left)
        if extra[2] <= base[2]:
            break
        n_fp[h], n_q[h] = extra[0], extra[1]
        left -= extra[2] - base[2]
    planned = budget - left + heads * prefix_len * fp
    return MemoryPlan(n_fp.view(n_layers, n_kv_heads), n_q.view(n_layers, n_kv_heads), target, planned)


def context_plan(
    ctx: Context, ratio: float, bits: int | None, group_size: int, fp_newest: int | None = None
) -> MemoryPlan:
    """:func:`plan_memory` for a prepared context's full cache, over the layers a method compresses
    (a sliding-window layer keeps its window: its rows of the plan are the first compressed layer's,
    never used)."""
    layers = ctx.lm.compressed_layers or [0]
    keys = ctx.full.keys[layers[0]]
    full_nbytes = sum(ctx.full.keys[i].nbytes + ctx.full.values[i].nbytes for i in layers)
    plan = plan_memory(
        ctx.doc_len,
        ctx.prefix_len,
        len(layers),
        keys.shape[0],
        keys.shape[-1],
        keys.element_size(),
        full_nbytes,
        ratio,
        bits,
        group_size,
        fp_newest,
    )
    if len(layers) == len(ctx.full.keys):
        return plan
    rows = torch.tensor([layers.index(i) if i in layers else 0 for i in range(len(ctx.full.keys))], device="cpu")
    return MemoryPlan(plan.n_fp[rows], plan.n_quant[rows], plan.target_bytes, plan.planned_bytes)


@dataclass
class TokenSplit:
    """One head's stored document tokens by fate (document-relative indices, ascending).

    kept and beacon are stored at full precision (fates "kept" and "beacon"),
    quant as low-bit codes; tokens in none of them are evicted.
    """

    kept: torch.Tensor
    beacon: torch.Tensor
    quant: torch.Tensor

    @classmethod
    def newest(cls, doc_len: int, n_fp: int, n_quant: int, device: torch.device) -> "TokenSplit":
        """The newest ``n_fp`` tokens at full precision, the ``n_quant`` before them quantised (KIVI)."""
        cut = doc_len - n_fp
        return cls(
            torch.arange(cut, doc_len, device=device),
            torch.zeros(0, dtype=torch.long, device=device),
            torch.arange(cut - n_quant, cut, device=device),
        )


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head 1-D index tensors (at least one) -> [H, max] (padded with 0) and lengths [H], on their device."""
    device = rows[0].device
    lengths = torch.tensor([r.numel() for r in rows], dtype=torch.long, device=device)
    out = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long, device=device)
    for h, r in enumerate(rows):
        out[h, : r.numel()] = r
    return out, lengths


def build_layer(
    ctx: Context, layer: int, splits: list[TokenSplit], bits: int | None = None, group_size: int = 32
) -> list[Segment]:
    """Segments of one layer: the template, then each head's split (one TokenSplit per KV head)."""
    keys, values, prefix = ctx.full.keys[layer], ctx.full.values[layer], ctx.prefix_len
    segments: list[Segment] = [template_segment(keys, values, prefix)] if prefix else []
    for part, fate in (("kept", "kept"), ("beacon", "beacon"), ("quant", None)):
        index, lengths = _padded([getattr(s, part) + prefix for s in splits])
        if int(lengths.sum()) == 0:
            continue
        k, v = gather_tokens(keys, index), gather_tokens(values, index)
        if fate is None:
            if bits is None:
                raise ValueError("quantised tokens need a bit width")
            segments.append(QuantSegment.quantize(k, v, lengths, index, bits, group_size))
        else:
            segments.append(DenseSegment.from_padded(k, v, lengths, index, fate=fate))
    return segments
