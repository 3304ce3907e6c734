"""Mix a score (kvlab issue #43): a weighted sum of four selection scores, to see what each one adds.

The ingredients are the field's own scores, read from kvlab.methods.families.scorers (none is
written again here): StreamingLLM's recency, H2O's heavy hitters (attention received from the
document's own queries), SnapKV's window attention with the question as the window (as
snapkv_question reads it) and KNorm's minus key norm. Their scales differ by orders of magnitude
(positions in the thousands, attention shares near 1/T, norms near ten), so each is first turned,
per layer and KV head, into its rank among the document's tokens scaled to [0, 1] (tied scores
share their mid-rank). Ranks keep each ingredient's order exactly, ties included, so a weight
corner (one weight above 0, the others 0) orders the tokens as that ingredient's method does.

What a source method adds beyond its score is a knob of its own here, applied after the mix:
``n_sink`` (StreamingLLM's attention sinks, counted from the context's first token as it counts
them) and ``recent_share`` (H2O's recent window, a share of each head's budget). SnapKV's
pooling over the question's attention is ``kernel``. The presets, one per corner, set these as
each method has them, so a preset keeps exactly the tokens of its method at any ratio:
``recency`` = streaming_llm, ``h2o`` = h2o, ``question`` = snapkv_question, ``knorm`` = knorm,
each at its default knobs. Exact ties in a mixed score (two tokens whose weighted ranks add up
alike) are left to the top-k, as any method's ties are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import MethodError, knob
from kvlab.compression.paper import Baseline
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.context import Memo
from kvlab.methods.families.scorers import (
    H2O_RECENT_SHARE,
    N_SINK,
    SnapKVOptions,
    h2o_scores,
    knorm_scores,
    protect_recent,
    recency_scores,
    snap_scores,
)

#: The ingredients, each read from its shared scorer: per layer [H_kv, T_doc] scores, higher = keep,
#: with nothing protected (sinks and recent windows are the mix's own knobs, applied after it).
INGREDIENTS: dict[str, Callable[[Request, int], list[torch.Tensor]]] = {
    "recency": lambda req, kernel: recency_scores(req, 0),  # the position; no sinks
    "h2o": lambda req, kernel: h2o_scores(req),  # heavy hitters; no recent window
    # The question is the window: snap_scores reads no window length then.
    "question": lambda req, kernel: snap_scores(req, 0, kernel, from_question=True),
    "knorm": lambda req, kernel: knorm_scores(req),
}
WEIGHTS = tuple(f"w_{name}" for name in INGREDIENTS)


def _weight(default: float, what: str) -> float:
    """A weight knob: from 0 to 1 (only the weights' ratios matter), the app's slider range."""
    return knob(default, f"weight of {what}", low=0.0, high=1.0, slider=True)


@dataclass(frozen=True)
class MixOptions(SelectionOptions):
    w_recency: float = _weight(1.0, "recency (StreamingLLM's position score)")
    w_h2o: float = _weight(1.0, "the attention received from the document's own queries (H2O's heavy hitters)")
    w_question: float = _weight(0.0, "the attention from the question (SnapKV's, the question as the window)")
    w_knorm: float = _weight(0.0, "a small key norm (KNorm's score, minus the L2 norm)")
    n_sink: int = knob(N_SINK, "attention-sink tokens kept at the start of the context (StreamingLLM's)", low=0)
    recent_share: float = knob(
        0.0, "share of each head's budget kept as the most recent tokens (H2O's recent window)", low=0.0, high=1.0
    )
    kernel: int = knob(
        SnapKVOptions.kernel,
        "1-D average-pooling kernel over the question's attention (SnapKV's; odd: centred on each token)",
        low=1,
        odd=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # each knob's own range first: negative or NaN weights are refused there
        if not any(getattr(self, w) > 0 for w in WEIGHTS):
            raise MethodError(f"at least one weight must be above 0 ({', '.join(WEIGHTS)} are all 0)")

    def weights(self) -> dict[str, float]:
        """The ingredients' weights above 0, by ingredient name."""
        return {name: getattr(self, f"w_{name}") for name in INGREDIENTS if getattr(self, f"w_{name}") > 0}


def rank_normalise(score: torch.Tensor) -> torch.Tensor:
    """Each token's rank within its row, scaled to [0, 1]: [H, T] -> [H, T] float32.

    The lowest score gets 0, the highest 1; tied scores share their mid-rank, so the map keeps
    every comparison of the row (a < b iff rank a < rank b, a == b iff equal ranks). With
    ``below`` the scores smaller than s and ``upto`` those at most s, rank = (below + upto - 1) / 2.
    """
    rows = score.float().contiguous()
    length = rows.shape[-1]
    if length < 2:  # one token: no order to keep
        return torch.zeros_like(rows)
    ordered = rows.sort(dim=-1).values
    below = torch.searchsorted(ordered, rows, side="left")
    upto = torch.searchsorted(ordered, rows, side="right")
    return (below + upto - 1).float() / (2 * (length - 1))


def mix_ranks(ranks: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """The weighted mean of the ingredients' ranks: sum_i w_i r_i / sum_i w_i, in [0, 1].

    ranks: ingredient -> [H, T] (from :func:`rank_normalise`); weights: ingredient -> weight above 0
    (only these ingredients are read). One weight alone keeps its ranks' order (and w = 1 their values).
    """
    total = sum(weights.values())
    mixed = sum(w * ranks[name] for name, w in weights.items())
    return mixed / total


#: What every preset starts from: no weight, no sinks, no recent window.
CORNER: dict[str, float | int] = {**dict.fromkeys(WEIGHTS, 0.0), "n_sink": 0, "recent_share": 0.0}


@dataclass(frozen=True)
class IngredientRanks(Memo):
    """Where :meth:`Mix.ranks` keeps one ingredient's ranks: its name and the pooling kernel (read by
    the question's attention only: 0 for the others), with the question for the question's."""

    ingredient: str
    kernel: int = 0


@register
class Mix(EvictionMethod):
    name = "mix"
    summary = (
        "a weighted mix of recency, heavy hitters, question attention and key norm, each ranked per head "
        "(presets: each alone, as its method)"
    )
    paper = Baseline(
        "the scores of StreamingLLM, H2O, SnapKV (the question as its window) and KNorm, ranked per head "
        "and mixed by weights; each preset is one of them"
    )
    family = "baselines"
    bf16_tolerance = "near_ties"  # sums of ranks tie, and bf16 reorders near-equal scores
    query_aware_when = "w_question>0"
    Options = MixOptions
    # One corner each, equal to its method at that method's default knobs: the sinks and the recent
    # window are StreamingLLM's and H2O's alone, so every other corner turns them off.
    presets = {
        "mix_recency": {**CORNER, "w_recency": 1.0, "n_sink": N_SINK},
        "mix_h2o": {**CORNER, "w_h2o": 1.0, "recent_share": H2O_RECENT_SHARE},
        "mix_question": {**CORNER, "w_question": 1.0},
        "mix_knorm": {**CORNER, "w_knorm": 1.0},
    }
    # The recent window is a share of the budget; each ingredient's ranks are kept per context.
    keep_scores = False

    def uses_question(self) -> bool:
        return self.options.w_question > 0

    def ranks(self, req: Request, ingredient: str) -> list[torch.Tensor]:
        """Per layer [H_kv, T_doc]: the ingredient's scores ranked within each head (:func:`rank_normalise`),
        kept per context (and per question for the question's)."""
        asked = ingredient == "question"
        key = IngredientRanks(ingredient, self.options.kernel if asked else 0, question=req.question if asked else None)
        return req.ctx.cached(key, lambda: [rank_normalise(s) for s in INGREDIENTS[ingredient](req, key.kernel)])

    def scores(self, req: Request) -> list[torch.Tensor]:
        opts = self.options
        if opts.w_question > 0 and not req.question:
            raise MethodError("mix: w_question above 0 needs a question (or set it to 0)")
        weights = opts.weights()
        by_ingredient = {name: self.ranks(req, name) for name in weights}
        # StreamingLLM's sinks as it counts them (from the context's first token): its +inf scores.
        sinks = recency_scores(req, opts.n_sink)[0].isinf()  # [H_kv, T_doc], the same in every layer
        out = []
        for layer in range(req.ctx.lm.n_layers):
            mixed = mix_ranks({name: ranks[layer] for name, ranks in by_ingredient.items()}, weights)
            mixed = protect_recent(mixed, opts.recent_share, req.doc_budget)
            out.append(mixed.masked_fill(sinks, float("inf")))
        return out

    def details(self) -> dict:
        """The mix as the run's details show it, e.g. ``(1·recency + 0.5·question) / 1.5``."""
        weights = self.options.weights()
        terms = " + ".join(f"{w:g}·{name}" for name, w in weights.items())
        return {"mix": f"({terms}) / {sum(weights.values()):g}" if len(weights) > 1 else terms}
