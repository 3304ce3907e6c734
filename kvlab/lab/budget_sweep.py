"""The sensitivity sweep behind non-uniform Attention Matching budgets.

    python -m kvlab budgets [--model M] [--doc PATH] [--ratio 20] [--boost 4]

All heads are compacted at a low baseline budget (``--ratio``); then each KV
head in turn gets ``--boost`` times more keys while the others stay at the
baseline, and the log-perplexity of the full cache's own answers to a few
questions is measured. A head's sensitivity is how much its boost lowers
that loss. Budget shares follow the sensitivities (a smooth version of the
published greedy donor -> receiver exchange), capped per head, and are
written to the user's budgets folder (kvlab.paths.budgets_dir; ``--out``
elsewhere: the shipped profiles are in assets/budgets/) for ``budgets=profile``
and Attention Matching's default. Only the layers a method compresses are swept: a
sliding-window layer keeps its window (share 1, never used).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvlab.cancellation import checkpoint
from kvlab.compression.budget_profiles import cap_shares, profile_path
from kvlab.context import Context
from kvlab.methods.families.am_recipe import AMOptions
from kvlab.methods.families.compaction import compact_cache
from kvlab.metrics import log_perplexity
from kvlab.pipeline import Evaluation
from kvlab.queries import repeat_queries
from kvlab.runtime.cache import CompressedKV, PaddedView, concat_views, segment_from_view, select_keys
from kvlab.runtime.decode import continuation_logprobs


@dataclass
class SensitivitySweep:
    """sensitivity: [n_layers, H_kv] loss decrease when one head is boosted; shares: budget shares (mean 1)."""

    loss_base: float
    sensitivity: torch.Tensor
    shares: torch.Tensor
    seconds: float


def swap_head(base: CompressedKV, boosted: CompressedKV, layer: int, head: int) -> CompressedKV:
    """``base`` with one head of one layer taken from ``boosted``."""
    a, b = base.layer_view(layer), boosted.layer_view(layer)
    width = max(a.keys.shape[1], b.keys.shape[1])
    a, b = pad_view(a, width), pad_view(b, width)
    pick = torch.zeros(a.keys.shape[0], dtype=torch.bool, device=a.keys.device)
    pick[head] = True
    mixed = PaddedView(
        keys=torch.where(pick[:, None, None], b.keys, a.keys),
        values=torch.where(pick[:, None, None], b.values, a.values),
        bias=torch.where(pick[:, None], b.bias, a.bias),
        token_index=torch.where(pick[:, None], b.token_index, a.token_index),
    )
    layers = list(base.layers)
    layers[layer] = [segment_from_view(select_keys(mixed, torch.isfinite(mixed.bias)), fate="compacted")]
    return CompressedKV(layers, base.logical_len)


def pad_view(view: PaddedView, width: int) -> PaddedView:
    """Pad a view with absent keys (bias -inf) up to ``width``."""
    extra = width - view.keys.shape[1]
    if extra == 0:
        return view
    h, d = view.keys.shape[0], view.keys.shape[2]
    return concat_views(
        [
            view,
            PaddedView(
                keys=view.keys.new_zeros(h, extra, d),
                values=view.values.new_zeros(h, extra, view.values.shape[2]),
                bias=view.bias.new_full((h, extra), float("-inf")),
                token_index=view.token_index.new_full((h, extra), -1),
            ),
        ]
    )


def answer_loss(ctx: Context, stored: CompressedKV, evaluations: list[Evaluation]) -> float:
    """Mean log-perplexity of the full cache's answers when read from ``stored``."""
    losses = [
        log_perplexity(
            continuation_logprobs(ctx.lm, stored, ev.question_ids, torch.tensor(ev.answer.ids, device="cpu"))
        )
        for ev in evaluations
    ]
    return sum(losses) / len(losses)


def sensitivity_sweep(
    ctx: Context,
    evaluations: list[Evaluation],
    ratio: float = 20.0,
    boost: float = 4.0,
    opts: AMOptions = AMOptions(),
    progress: Callable[[float, str], None] = lambda f, d: None,
) -> SensitivitySweep:
    """Measure every KV head's sensitivity to its budget (see the module docstring)."""
    start = time.perf_counter()
    lm = ctx.lm
    shape = (lm.n_layers, lm.n_kv_heads)
    low = max(1, round(ctx.doc_len / ratio))
    high = min(ctx.doc_len, round(low * boost))
    queries = repeat_queries(ctx)
    base = compact_cache(ctx.full.stored, queries, torch.full(shape, low, device=lm.device), opts, ctx.prefix_len)
    boosted = compact_cache(ctx.full.stored, queries, torch.full(shape, high, device=lm.device), opts, ctx.prefix_len)
    loss_base = answer_loss(ctx, base, evaluations)
    sens = torch.zeros(shape, device="cpu")  # Python floats, written one head at a time
    layers = lm.compressed_layers
    for done, layer in enumerate(layers, 1):
        for head in range(lm.n_kv_heads):
            checkpoint(f"sensitivity sweep: layer {layer + 1}, head {head + 1}")
            sens[layer, head] = loss_base - answer_loss(ctx, swap_head(base, boosted, layer, head), evaluations)
        elapsed = time.perf_counter() - start
        progress(
            done / len(layers),
            f"sensitivity sweep: layer {layer + 1} ({done}/{len(layers)}), {elapsed:.0f}s, "
            f"about {elapsed / done * (len(layers) - done):.0f}s left",
        )
    # A boost that does not help (or hurts, within noise) earns the floor share.
    gain = sens[layers].clamp_min(0)
    shares = torch.ones(shape, dtype=torch.float64, device="cpu")
    shares[layers] = cap_shares(gain + 1e-3 * float(gain.mean() + 1e-9))
    return SensitivitySweep(loss_base, sens, shares, time.perf_counter() - start)


def save_profile(
    ctx: Context, sweep: SensitivitySweep, ratio: float, boost: float, doc: str, folder: Path | None = None
) -> str:
    """Write the sweep as ``ctx.lm``'s profile into ``folder`` (default: the user's budgets folder)."""
    path = profile_path(ctx.lm.name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "model": ctx.lm.name,
                "document": doc,
                "doc_tokens": ctx.doc_len,
                "baseline_ratio": ratio,
                "boost": boost,
                "loss_base": sweep.loss_base,
                "compressed_layers": ctx.lm.compressed_layers,
                "sensitivity": [[round(x, 6) for x in row] for row in sweep.sensitivity.tolist()],
                "shares": [[round(x, 6) for x in row] for row in sweep.shares.tolist()],
                "seconds": round(sweep.seconds, 1),
            },
            indent=1,
        )
    )
    return str(path)
