"""BeaconKV as published (Kim, Kim, Shim, Choi, 2026, "BeaconKV: Key-Value Cache Compression
Guided by Beacon Queries for Efficient Large Reasoning Model Inference"; details from secondary
summaries, the code was not available): KV *eviction* by the beacon scores of
kvlab.compression.beacon_core. The template prefix and a recent window are always kept.
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

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.compression.beacon_core import BeaconBank, BeaconState, max_attention_scores, stack_layers
from kvlab.compression.interface import Method, document_importance
from kvlab.compression.memory_plan import TokenSplit, build_layer
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import per_context
from kvlab.context import Context
from kvlab.queries import question_queries
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.rope import row_cos_sin, unrotate

BeaconSource = Literal["context", "question", "instruction"]
INSTRUCTION = "Answer the question using the document."


@dataclass(frozen=True)
class BeaconOptions(Options):
    beacon_source: BeaconSource = knob(
        "context", "where beacons come from: context (the model's own prefill queries, as published), "
                   "question (the user's question: query-aware), instruction (a fixed instruction)")
    n_beacons: int = knob(16, "beacon queries per query head", low=0)
    n_recent: int = knob(16, "recent queries in the scoring set", low=0)
    buffer: int = knob(128, "continual FPS: queries buffered per head before re-sampling", low=1)
    window: int = knob(16, "most recent document tokens always kept", low=0)
    beacon_instruction: str = knob(INSTRUCTION, "beacon_source=instruction: the instruction read after the document")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_beacons + self.n_recent < 1:
            raise MethodError("n_beacons + n_recent must be >= 1: the scoring set needs a query")


# --------------------------------------------------------------------------- scoring a prepared context


def document_state(ctx: Context, opts: BeaconOptions, question: str | None) -> BeaconState:
    """The beacon state of every (layer, query head) after reading the document (and the source).

    Rows are layer-major: row ``layer * H + head``.
    """
    lm, length = ctx.lm, ctx.length
    positions = torch.arange(length, device=lm.device)
    ctx_q = ctx.queries["context"]
    state = BeaconState(opts.n_recent, BeaconBank(opts.n_beacons, opts.buffer))
    if opts.beacon_source == "context":
        # In slices, so the stacked copy of the history stays small.
        step = max(512, opts.buffer)
        for start in range(0, length, step):
            part = slice(start, min(start + step, length))
            state.observe(stack_layers([q[:, part] for q in ctx_q]), positions[part], *row_cos_sin(lm, positions[part]))
        return state
    if opts.beacon_source == "question":
        if not question:
            raise MethodError("beacon_source=question needs a question")
        source = question_queries(ctx, question)
    else:
        source = question_queries(ctx, opts.beacon_instruction)
    # Recent part: the document's last queries; beacon history: the source's queries.
    tail = slice(length - min(opts.n_recent, length), length)
    state.observe(stack_layers([q[:, tail] for q in ctx_q]), positions[tail], *row_cos_sin(lm, positions[tail]))
    src_pos = torch.arange(length, length + source[0].shape[1], device=lm.device)
    s_cos, s_sin = row_cos_sin(lm, src_pos)
    state.bank.add(unrotate(stack_layers(source), s_cos, s_sin), src_pos)
    return state


def beacon_scores(req: Request, opts: BeaconOptions) -> tuple[list[torch.Tensor], list[list[list[int]]]]:
    """Per layer [H_kv, T_doc] document-token scores, and per layer / query head the beacons' positions.

    They do not depend on the ratio: computed once per context and scoring knobs.
    """
    ctx = req.ctx
    question = req.question if opts.beacon_source == "question" else None
    key = ("beaconkv", opts.beacon_source, opts.n_beacons, opts.n_recent, opts.buffer,
           opts.beacon_instruction if opts.beacon_source == "instruction" else None, question)

    def make() -> tuple[list[torch.Tensor], list[list[list[int]]]]:
        state = document_state(ctx, opts, req.question)
        now, n_heads = ctx.length, ctx.lm.n_heads
        device = ctx.lm.device
        cos_now, sin_now = row_cos_sin(ctx.lm, torch.tensor([now], device=device))
        queries, q_pos, beacon_pos = state.scoring_set(cos_now, sin_now, now)
        k_pos = torch.arange(ctx.length, device=device)
        scores, beacons = [], []
        for layer in range(ctx.lm.n_layers):
            rows = slice(layer * n_heads, (layer + 1) * n_heads)
            keys = ctx.full.keys[layer]
            scale = ctx.lm.geometry[layer].scaling
            scores.append(max_attention_scores(queries[rows], q_pos, keys, k_pos, scale)[:, ctx.prefix_len :])
            beacons.append([sorted(int(p) for p in row) for row in beacon_pos[rows].tolist()])
        return scores, beacons

    return per_context(ctx, key, make, question)


# --------------------------------------------------------------------------- building the stored cache


def split_head(score: torch.Tensor, n_fp: int, n_quant: int, window: int) -> TokenSplit:
    """Full precision: the last min(window, n_fp) tokens ("kept") + the top-scored others up
    to n_fp ("beacon"); quantised: the top ``n_quant`` of the remaining tokens (window
    tokens first); the rest evicted.

    score: [T] -> index sets of that head.
    """
    length = score.numel()
    w = min(window, n_fp, length)
    win = torch.arange(length - w, length, device=score.device)
    cand = score.float().clone()
    cand[length - w :] = float("-inf")
    beacon = torch.topk(cand, n_fp - w).indices
    rest = score.float().clone()
    # Window tokens that did not fit at full precision are protected from eviction.
    rest[length - min(window, length) :] = float("inf")
    rest[win] = float("-inf")
    rest[beacon] = float("-inf")
    quant = torch.topk(rest, min(n_quant, length - n_fp)).indices
    return TokenSplit(win, torch.sort(beacon).values, torch.sort(quant).values)


# --------------------------------------------------------------------------- the methods


class BeaconBase(Method):
    paper = Paper(
        "Kim, Kim, Shim, Choi", 2026,
        "BeaconKV: Key-Value Cache Compression Guided by Beacon Queries for Efficient Large Reasoning Model Inference",
        arxiv="2609.04971", note="details from secondary summaries")

    query_aware_when = "beacon_source=question"

    def uses_question(self) -> bool:
        return self.options.beacon_source == "question"


@register
class BeaconKV(BeaconBase):
    name = "beaconkv"
    summary = ("eviction: score = max attention from the recent and the beacon queries (cosine FPS over the "
               "pre-RoPE query history, re-rotated to now), max over the GQA group; template + recent window kept")
    learn = (
        "Eviction guided by *beacon queries*: some decoding steps look far back (e.g. to an early plan) and "
        "their queries fall into a few clusters. Per query head, `n_beacons` past queries are chosen by "
        "farthest-point sampling (cosine distance) over the history of pre-RoPE queries, kept bounded by "
        "continual re-sampling (every `buffer` new queries), and rotated to the current position. A key's "
        "score is the largest attention it gets from the scoring set (the `n_recent` latest queries $R$ and "
        "the beacons $\\mathcal B$) and from any query head $g$ of its group, "
        "$s_j=\\max_{q\\in R\\cup\\mathcal B}\\max_g a^{(g)}_{qj}$. The template and the last `window` "
        "document tokens are always kept. `beacon_source` says whose queries the beacons are sampled from: "
        "the document's own (as published), your question's, or a fixed instruction's. The paper's abstract "
        "is confirmed, but its details here come from **secondary summaries** (its code could not be read), "
        "so treat this as the best available reading."
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
