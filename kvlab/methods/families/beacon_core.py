"""The BeaconKV family (kvlab/methods/beaconkv.py, beaconkv_mixed.py; bounded generation,
kvlab.bounded.beacon): beacon queries by farthest-point sampling, the key scores, and what the two
methods share (their knobs, the scores of a prepared context, a head's split into precisions, the base).

Per query head, a few "beacon" queries are chosen by farthest-point sampling
(cosine distance) over the history of pre-RoPE queries, kept bounded by
continual FPS (a buffer of newer queries that, when full, is re-sampled
together with the current beacons down to the beacon count). Beacons are
rotated with the RoPE of the current position; a key's score is the max
attention it gets over the scoring set (the recent queries + the beacons) and
over the query heads of its GQA group. The methods and budgeted generation
both score keys this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvlab.compression.interface import Method
from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.request import Request
from kvlab.context import Context, Memo
from kvlab.methods.families.memory_plan import TokenSplit
from kvlab.queries import question_queries
from kvlab.runtime.attention import attention_weights, expand_kv_heads
from kvlab.runtime.rope import rotate, row_cos_sin, unrotate

BeaconSource = Literal["context", "question", "instruction"]
INSTRUCTION = "Answer the question using the document."


@dataclass(frozen=True)
class BeaconOptions(Options):
    beacon_source: BeaconSource = knob(
        "context",
        "where beacons come from: context (the model's own prefill queries, as published), "
        "question (the user's question: query-aware), instruction (a fixed instruction)",
    )
    n_beacons: int = knob(16, "beacon queries per query head", low=0)
    n_recent: int = knob(16, "recent queries in the scoring set", low=0)
    buffer: int = knob(128, "continual FPS: queries buffered per head before re-sampling", low=1)
    window: int = knob(16, "most recent document tokens always kept", low=0)
    beacon_instruction: str = knob(INSTRUCTION, "beacon_source=instruction: the instruction read after the document")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_beacons + self.n_recent < 1:
            raise MethodError("n_beacons + n_recent must be >= 1: the scoring set needs a query")


# --------------------------------------------------------------------------- beacon queries and key scores


def farthest_point_sampling(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` farthest points by cosine distance, per batch row.

    x: [B, m, d] -> long [B, min(k, m)], in selection order. The first pick
    is point 0 (in continual FPS the oldest beacon, so beacons are stable);
    each next pick maximises the cosine distance 1 - cos to the nearest point
    already picked. A point is never picked twice.
    """
    n_rows, m, _ = x.shape
    k = min(k, m)
    picks = torch.zeros(n_rows, k, dtype=torch.long, device=x.device)
    if k == 0:
        return picks
    unit = F.normalize(x.float(), dim=-1)
    # Cosine distances between all candidates at once: m is small (beacons + buffer).
    dist_all = 1 - unit @ unit.transpose(-1, -2)
    rows = torch.arange(n_rows, device=x.device)
    dist = dist_all[:, 0].clone()
    dist[:, 0] = -1.0
    for i in range(1, k):
        nxt = dist.argmax(dim=-1)
        picks[:, i] = nxt
        dist = torch.minimum(dist, dist_all[rows, nxt])
        dist[rows, nxt] = -1.0
    return picks


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, m, ...], idx [B, k] -> [B, k, ...]."""
    return x[torch.arange(x.shape[0], device=idx.device).unsqueeze(1), idx]


@dataclass
class BeaconBank:
    """Continual FPS: per row (a query head of a layer), beacons + a buffer of newer queries.

    Both hold pre-RoPE queries [R, n, d] with their positions [R, n]; the
    buffer holds at most ``capacity`` queries; when it is full, FPS over
    beacons + buffer re-samples them down to ``n_beacons`` beacons and the
    buffer empties. Memory is bounded by ``n_beacons + capacity`` per row.
    Rows are independent (each has its own beacons); batching every layer's
    heads as rows makes one FPS serve the whole model.
    """

    n_beacons: int
    capacity: int
    beacons: torch.Tensor | None = None
    beacon_pos: torch.Tensor | None = None
    buffer: torch.Tensor | None = None
    buffer_pos: torch.Tensor | None = None

    def _candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [(q, p) for q, p in ((self.beacons, self.beacon_pos), (self.buffer, self.buffer_pos)) if q is not None]
        return torch.cat([q for q, _ in parts], dim=1), torch.cat([p for _, p in parts], dim=1)

    def _resample(self) -> None:
        cand, pos = self._candidates()
        idx = farthest_point_sampling(cand, self.n_beacons)
        self.beacons, self.beacon_pos = _take(cand, idx), _take(pos, idx)
        self.buffer = self.buffer_pos = None

    def add(self, pre: torch.Tensor, positions: torch.Tensor) -> None:
        """Append pre-RoPE queries [R, n, d] at ``positions`` [n] (in reading order)."""
        if self.n_beacons == 0 or pre.shape[1] == 0:
            return
        pos = positions.reshape(1, -1).expand(pre.shape[0], -1)
        start = 0
        while start < pre.shape[1]:
            held = 0 if self.buffer is None else self.buffer.shape[1]
            end = min(pre.shape[1], start + self.capacity - held)
            chunk, chunk_pos = pre[:, start:end], pos[:, start:end]
            if self.buffer is None:
                self.buffer, self.buffer_pos = chunk, chunk_pos
            else:
                self.buffer = torch.cat([self.buffer, chunk], dim=1)
                self.buffer_pos = torch.cat([self.buffer_pos, chunk_pos], dim=1)
            if self.buffer.shape[1] >= self.capacity:
                self._resample()
            start = end

    def current(
        self, n_heads: int, head_dim: int, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The beacons now: FPS over beacons + buffer (state unchanged) -> [R, b, d], positions [R, b].

        device: where an empty bank's (empty) answer lives, the queries' device.
        """
        if self.beacons is None and self.buffer is None:
            empty = torch.zeros(n_heads, 0, head_dim, device=device)
            return empty, torch.zeros(n_heads, 0, dtype=torch.long, device=device)
        cand, pos = self._candidates()
        idx = farthest_point_sampling(cand, self.n_beacons)
        return _take(cand, idx), _take(pos, idx)


@dataclass
class BeaconState:
    """A query history per row (query head of a layer): the ``n_recent`` latest
    post-RoPE queries and a beacon bank.

    Queries enter the bank (un-rotated to pre-RoPE) when they leave the recent set.
    """

    n_recent: int
    bank: BeaconBank
    recent: torch.Tensor | None = None  # [R, r, d] post-RoPE
    recent_pos: torch.Tensor | None = None  # [r]
    recent_cos: torch.Tensor | None = None  # [r, d] or [R, r, d]: the RoPE tables at recent_pos
    recent_sin: torch.Tensor | None = None

    def observe(self, post: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """New post-RoPE queries [R, n, d] at ``positions`` [n]; cos/sin at those positions: [n, d], or
        [R, n, d] when the rows' layers rotate differently (kvlab.runtime.rope.row_cos_sin)."""
        pos = positions.long()
        if self.recent is not None:
            post = torch.cat([self.recent, post], dim=1)
            pos = torch.cat([self.recent_pos, pos])
            cos = torch.cat([self.recent_cos, cos], dim=-2)
            sin = torch.cat([self.recent_sin, sin], dim=-2)
        cut = max(0, post.shape[1] - self.n_recent)
        if cut:
            self.bank.add(unrotate(post[:, :cut], cos[..., :cut, :], sin[..., :cut, :]), pos[:cut])
        self.recent, self.recent_pos = post[:, cut:], pos[cut:]
        self.recent_cos, self.recent_sin = cos[..., cut:, :], sin[..., cut:, :]

    def scoring_set(
        self, cos_now: torch.Tensor, sin_now: torch.Tensor, now: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recent queries + beacons rotated to position ``now`` (cos_now/sin_now: [1, d] or [R, 1, d]).

        -> queries [R, m, d] (post-RoPE), their positions [m] (the beacons': ``now``),
        and the beacons' source positions [R, b].
        """
        held = next((t for t in (self.recent, self.bank.beacons, self.bank.buffer) if t is not None), None)
        if held is None:
            raise MethodError("BeaconKV has no queries to score with")
        beacons, beacon_pos = self.bank.current(held.shape[0], held.shape[-1], held.device)
        queries = [self.recent, rotate(beacons, cos_now, sin_now)]
        positions = [self.recent_pos, torch.full((beacons.shape[1],), now, dtype=torch.long, device=held.device)]
        if self.recent is None:
            queries, positions = queries[1:], positions[1:]
        return torch.cat(queries, dim=1), torch.cat(positions), beacon_pos


def max_attention_scores(
    queries: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, k_pos: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """BeaconKV score of every key: max attention over the queries and the GQA group.

    queries: [H, m, d] post-RoPE, q_pos: [m] their positions; keys: [H_kv, T, d]
    post-RoPE, k_pos: [T] or [H_kv, T] their positions; scale: the layer's own
    (None: 1/sqrt(d)). A query sees the keys at or before its position
    (softmax over those). -> [H_kv, T].
    """
    n_heads, n_kv, length = queries.shape[0], keys.shape[0], keys.shape[1]
    k = expand_kv_heads(keys.float(), n_heads)
    kp = expand_kv_heads(k_pos.reshape(-1, length).expand(n_kv, length), n_heads)
    q = queries.float()
    best = torch.zeros(n_heads, length, device=k.device)
    visible = (kp.unsqueeze(1) <= q_pos.reshape(1, -1, 1)).sum(-1)  # [H, m] keys each query sees
    sees_all = (visible == length).all(dim=0)
    if sees_all.any():  # the beacons (at "now"): one softmax over every key
        best = torch.maximum(best, attention_weights(q[:, sees_all], k, scale=scale).amax(dim=1))
    rest = torch.nonzero(~sees_all).squeeze(1)
    if rest.numel() == 0:
        return best.reshape(n_kv, n_heads // n_kv, length).amax(dim=1)
    counts = visible[:, rest]
    in_order = bool((kp[:, 1:] >= kp[:, :-1]).all())
    if in_order and bool((counts == counts[:1]).all()) and bool((counts[0].diff() == 1).all()):
        # Consecutive queries over a key prefix (the recent queries): one causal softmax.
        end = int(counts[0, -1])
        w = attention_weights(q[:, rest], k[:, :end], scale=scale, causal=True)
        best[:, :end] = torch.maximum(best[:, :end], w.amax(dim=1))
    else:
        for i in rest.tolist():
            bias = torch.zeros(n_heads, length, device=k.device).masked_fill(kp > q_pos[i], float("-inf"))
            best = torch.maximum(best, attention_weights(q[:, i : i + 1], k, bias=bias, scale=scale)[:, 0])
    return best.reshape(n_kv, n_heads // n_kv, length).amax(dim=1)


def stack_layers(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Per layer [H, n, d] -> [L * H, n, d]: every (layer, head) is one row of the beacon state."""
    return torch.cat(per_layer, dim=0)


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


@dataclass(frozen=True)
class BeaconScores(Memo):
    """Where :func:`beacon_scores` keeps its scores and beacons: the scoring knobs (the instruction
    only for beacons from it; the question, for beacons from it, is the memo's own)."""

    source: str
    n_beacons: int
    n_recent: int
    buffer: int
    instruction: str | None


def beacon_scores(req: Request, opts: BeaconOptions) -> tuple[list[torch.Tensor], list[list[list[int]]]]:
    """Per layer [H_kv, T_doc] document-token scores, and per layer / query head the beacons' positions.

    They do not depend on the ratio: computed once per context and scoring knobs.
    """
    ctx = req.ctx
    question = req.question if opts.beacon_source == "question" else None
    key = BeaconScores(
        opts.beacon_source,
        opts.n_beacons,
        opts.n_recent,
        opts.buffer,
        opts.beacon_instruction if opts.beacon_source == "instruction" else None,
        question=question,
    )

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

    return ctx.cached(key, make)


# --------------------------------------------------------------------------- what the methods share


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


class BeaconBase(Method):
    paper = Paper(
        "Kim, Kim, Shim, Choi",
        2026,
        "BeaconKV: Key-Value Cache Compression Guided by Beacon Queries for Efficient Large Reasoning Model Inference",
        arxiv="2609.04971",
        note="details from secondary summaries",
    )

    query_aware_when = "beacon_source=question"

    def uses_question(self) -> bool:
        return self.options.beacon_source == "question"
