"""BeaconKV, in its two readings (see docs/beaconkv.md), sharing one beacon core.

1. ``beaconkv``, as published (Kim, Kim, Shim, Choi, 2026, "BeaconKV: Key-Value
   Cache Compression Guided by Beacon Queries for Efficient Large Reasoning
   Model Inference"; details from secondary summaries, the code was not
   available): KV *eviction*. Per query head, a few "beacon" queries are
   chosen by farthest-point sampling (cosine distance) over the history of
   pre-RoPE queries, kept bounded by continual FPS (a buffer of newer queries
   that, when full, is re-sampled together with the current beacons down to
   the beacon count). Beacons are rotated with the RoPE of the current
   position; a key's score is the max attention it gets over the scoring set
   (the recent queries + the beacons) and over the query heads of its GQA
   group. The template prefix and a recent window are always kept.
   :func:`beacon_generate` is the paper's setting: greedy decoding under a
   token budget, evicting by these scores with the running query history.
2. ``beaconkv_mixed``, the source article's reading: the tokens the beacons
   select stay at full precision, the others are stored at 4 or 2 bits (KIVI,
   :class:`~kvlab.runtime.quantized.QuantSegment`) or evicted; the ratio is a
   *memory* ratio (bytes stored ~= full bytes / ratio).

Beacon sources (``beacon_source``): ``context`` (the model's own query history:
the document prefill's queries, as published), ``question`` (the question's
queries read after the document: query-aware) or ``instruction`` (a fixed
instruction read after the document). With ``context`` the last ``n_recent``
queries form the recent part and the earlier ones the beacon history; with
the other two, the beacons are sampled from that source's queries and the
recent part is still the document's last queries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from kvlab.context import Context
from kvlab.methods.base import Method, MethodError, Request, document_importance, register, top_k_per_head
from kvlab.methods.scoring import per_context
from kvlab.models import LoadedModel
from kvlab.queries import question_queries
from kvlab.runtime.attention import attention_weights, expand_kv_heads
from kvlab.runtime.cache import CompressedKV, DenseSegment, Segment
from kvlab.runtime.decode import GrowingLayer, Generation, extend, greedy_loop, open_session, stop_token_ids
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.quantized import QuantSegment, quant_nbytes
from kvlab.runtime.rope import rope_cos_sin, rotate, unrotate

BeaconSource = Literal["context", "question", "instruction"]
Rest = Literal["evict", "4bit", "2bit"]
INSTRUCTION = "Answer the question using the document."
REST_BITS = {"evict": None, "4bit": 4, "2bit": 2}


# --------------------------------------------------------------------------- beacon selection


def farthest_point_sampling(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` farthest points by cosine distance, per batch row.

    x: [B, m, d] -> long [B, min(k, m)], in selection order. The first pick
    is point 0 (in continual FPS the oldest beacon, so beacons are stable);
    each next pick maximises the cosine distance 1 - cos to the nearest point
    already picked. A point is never picked twice.
    """
    n_rows, m, _ = x.shape
    k = min(k, m)
    picks = torch.zeros(n_rows, k, dtype=torch.long)
    if k == 0:
        return picks
    unit = F.normalize(x.float(), dim=-1)
    # Cosine distances between all candidates at once: m is small (beacons + buffer).
    dist_all = 1 - unit @ unit.transpose(-1, -2)
    rows = torch.arange(n_rows)
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
    return x[torch.arange(x.shape[0]).unsqueeze(1), idx]


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

    def current(self, n_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The beacons now: FPS over beacons + buffer (state unchanged) -> [R, b, d], positions [R, b]."""
        if self.beacons is None and self.buffer is None:
            return torch.zeros(n_heads, 0, head_dim), torch.zeros(n_heads, 0, dtype=torch.long)
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
    recent_cos: torch.Tensor | None = None  # [r, d]: the RoPE tables at recent_pos
    recent_sin: torch.Tensor | None = None

    def observe(self, post: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """New post-RoPE queries [R, n, d] at ``positions`` [n]; cos/sin [n, d] at those positions."""
        pos = positions.long()
        if self.recent is not None:
            post = torch.cat([self.recent, post], dim=1)
            pos = torch.cat([self.recent_pos, pos])
            cos = torch.cat([self.recent_cos, cos])
            sin = torch.cat([self.recent_sin, sin])
        cut = max(0, post.shape[1] - self.n_recent)
        if cut:
            self.bank.add(unrotate(post[:, :cut], cos[:cut], sin[:cut]), pos[:cut])
        self.recent, self.recent_pos = post[:, cut:], pos[cut:]
        self.recent_cos, self.recent_sin = cos[cut:], sin[cut:]

    def scoring_set(
        self, cos_now: torch.Tensor, sin_now: torch.Tensor, now: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recent queries + beacons rotated to position ``now`` (cos_now/sin_now: [1, d]).

        -> queries [R, m, d] (post-RoPE), their positions [m] (the beacons': ``now``),
        and the beacons' source positions [R, b].
        """
        held = next((t for t in (self.recent, self.bank.beacons, self.bank.buffer) if t is not None), None)
        if held is None:
            raise MethodError("BeaconKV has no queries to score with")
        beacons, beacon_pos = self.bank.current(held.shape[0], held.shape[-1])
        queries = [self.recent, rotate(beacons, cos_now, sin_now)]
        positions = [self.recent_pos, torch.full((beacons.shape[1],), now, dtype=torch.long)]
        if self.recent is None:
            queries, positions = queries[1:], positions[1:]
        return torch.cat(queries, dim=1), torch.cat(positions), beacon_pos


def key_scores(queries: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """BeaconKV score of every key: max attention over the queries and the GQA group.

    queries: [H, m, d] post-RoPE, q_pos: [m] their positions; keys: [H_kv, T, d]
    post-RoPE, k_pos: [T] or [H_kv, T] their positions. A query sees the keys at
    or before its position (softmax over those). -> [H_kv, T].
    """
    n_heads, n_kv, length = queries.shape[0], keys.shape[0], keys.shape[1]
    k = expand_kv_heads(keys.float(), n_heads)
    kp = expand_kv_heads(k_pos.reshape(-1, length).expand(n_kv, length), n_heads)
    q = queries.float()
    best = torch.zeros(n_heads, length)
    visible = (kp.unsqueeze(1) <= q_pos.reshape(1, -1, 1)).sum(-1)  # [H, m] keys each query sees
    sees_all = (visible == length).all(dim=0)
    if sees_all.any():  # the beacons (at "now"): one softmax over every key
        best = torch.maximum(best, attention_weights(q[:, sees_all], k).amax(dim=1))
    rest = torch.nonzero(~sees_all).squeeze(1)
    if rest.numel() == 0:
        return best.reshape(n_kv, n_heads // n_kv, length).amax(dim=1)
    counts = visible[:, rest]
    in_order = bool((kp[:, 1:] >= kp[:, :-1]).all())
    if in_order and bool((counts == counts[:1]).all()) and bool((counts[0].diff() == 1).all()):
        # Consecutive queries over a key prefix (the recent queries): one causal softmax.
        end = int(counts[0, -1])
        w = attention_weights(q[:, rest], k[:, :end], causal=True)
        best[:, :end] = torch.maximum(best[:, :end], w.amax(dim=1))
    else:
        for i in rest.tolist():
            bias = torch.zeros(n_heads, length).masked_fill(kp > q_pos[i], float("-inf"))
            best = torch.maximum(best, attention_weights(q[:, i : i + 1], k, bias=bias)[:, 0])
    return best.reshape(n_kv, n_heads // n_kv, length).amax(dim=1)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class BeaconOptions:
    beacon_source: BeaconSource = field(default="context", metadata={
        "help": "where beacons come from: context (the model's own prefill queries, as published), "
                "question (the user's question: query-aware), instruction (a fixed instruction)"})
    n_beacons: int = field(default=16, metadata={"help": "beacon queries per query head"})
    n_recent: int = field(default=16, metadata={"help": "recent queries in the scoring set"})
    buffer: int = field(default=128, metadata={"help": "continual FPS: queries buffered per head before re-sampling"})
    window: int = field(default=16, metadata={"help": "most recent document tokens always kept"})
    beacon_instruction: str = field(default=INSTRUCTION, metadata={
        "help": "beacon_source=instruction: the instruction read after the document"})

    def __post_init__(self) -> None:
        if self.beacon_source not in ("context", "question", "instruction"):
            raise MethodError(f"beacon_source must be context, question or instruction, got {self.beacon_source!r}")
        if min(self.n_beacons, self.n_recent, self.window) < 0 or self.n_beacons + self.n_recent < 1:
            raise MethodError("n_beacons, n_recent and window must be >= 0, with at least one scoring query")
        if self.buffer < 1:
            raise MethodError("buffer must be >= 1")


@dataclass(frozen=True)
class BeaconMixedOptions(BeaconOptions):
    rest: Rest = field(default="4bit", metadata={
        "help": "what happens to the tokens the beacons do not select: evict, 4bit or 2bit (KIVI)"})
    group_size: int = field(default=32, metadata={"help": "KIVI group size of the quantised rest"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rest not in REST_BITS:
            raise MethodError(f"rest must be evict, 4bit or 2bit, got {self.rest!r}")
        if self.group_size < 1:
            raise MethodError("group_size must be >= 1")


# --------------------------------------------------------------------------- scoring a prepared context


def stack_layers(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Per layer [H, n, d] -> [L * H, n, d]: every (layer, head) is one row of the beacon state."""
    return torch.cat(per_layer, dim=0)


def document_state(ctx: Context, opts: BeaconOptions, question: str | None) -> BeaconState:
    """The beacon state of every (layer, query head) after reading the document (and the source).

    Rows are layer-major: row ``layer * H + head``.
    """
    lm, length = ctx.lm, ctx.length
    positions = torch.arange(length)
    cos, sin = rope_cos_sin(lm, positions)
    ctx_q = ctx.queries["context"]
    state = BeaconState(opts.n_recent, BeaconBank(opts.n_beacons, opts.buffer))
    if opts.beacon_source == "context":
        # In slices, so the stacked copy of the history stays small.
        step = max(512, opts.buffer)
        for start in range(0, length, step):
            part = slice(start, min(start + step, length))
            state.observe(stack_layers([q[:, part] for q in ctx_q]), positions[part], cos[part], sin[part])
        return state
    if opts.beacon_source == "question":
        if not question:
            raise MethodError("beacon_source=question needs a question")
        source = question_queries(ctx, question)
    else:
        source = question_queries(ctx, opts.beacon_instruction)
    # Recent part: the document's last queries; beacon history: the source's queries.
    tail = slice(length - min(opts.n_recent, length), length)
    state.observe(stack_layers([q[:, tail] for q in ctx_q]), positions[tail], cos[tail], sin[tail])
    src_pos = torch.arange(length, length + source[0].shape[1])
    s_cos, s_sin = rope_cos_sin(lm, src_pos)
    state.bank.add(unrotate(stack_layers(source), s_cos, s_sin), src_pos)
    return state


def beacon_scores(req: Request, opts: BeaconOptions) -> tuple[list[torch.Tensor], list[list[list[int]]]]:
    """Per layer [H_kv, T_doc] document-token scores, and per layer / query head the beacons' positions.

    They do not depend on the ratio: computed once per context and scoring knobs.
    """
    ctx = req.ctx
    question = req.question if opts.beacon_source == "question" else None
    key = (f"beaconkv:{opts.beacon_source}:{opts.n_beacons}:{opts.n_recent}:{opts.buffer}:"
           f"{opts.beacon_instruction if opts.beacon_source == 'instruction' else ''}:{question or ''}")

    def make() -> tuple[list[torch.Tensor], list[list[list[int]]]]:
        state = document_state(ctx, opts, req.question)
        now, n_heads = ctx.length, ctx.lm.n_heads
        cos_now, sin_now = rope_cos_sin(ctx.lm, torch.tensor([now]))
        queries, q_pos, beacon_pos = state.scoring_set(cos_now, sin_now, now)
        k_pos = torch.arange(ctx.length)
        scores, beacons = [], []
        for layer in range(ctx.lm.n_layers):
            rows = slice(layer * n_heads, (layer + 1) * n_heads)
            keys = ctx.full.keys[layer].float().cpu()
            scores.append(key_scores(queries[rows], q_pos, keys, k_pos)[:, ctx.prefix_len :])
            beacons.append([sorted(int(p) for p in row) for row in beacon_pos[rows].tolist()])
        return scores, beacons

    return per_context(ctx, key, make)


# --------------------------------------------------------------------------- building the stored cache


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head 1-D index tensors -> [H, max] (padded with 0) and lengths [H]."""
    lengths = torch.tensor([r.numel() for r in rows], dtype=torch.long)
    out = torch.zeros(len(rows), int(lengths.max()) if rows else 0, dtype=torch.long)
    for h, r in enumerate(rows):
        out[h, : r.numel()] = r
    return out, lengths


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [H, L, d], index [H, n] -> [H, n, d]."""
    return x.gather(1, index.to(x.device).unsqueeze(-1).expand(-1, -1, x.shape[-1]))


@dataclass
class TokenSplit:
    """One head's document tokens by fate (document-relative, ascending)."""

    window: torch.Tensor
    beacon: torch.Tensor
    quant: torch.Tensor


def split_head(score: torch.Tensor, n_fp: int, n_quant: int, window: int) -> TokenSplit:
    """Full precision: the last min(window, n_fp) tokens + the top-scored others up to n_fp;
    quantised: the top ``n_quant`` of the remaining tokens (window tokens first); the rest evicted.

    score: [T] -> index sets of that head.
    """
    length = score.numel()
    w = min(window, n_fp, length)
    win = torch.arange(length - w, length)
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


def build_layer(
    ctx: Context,
    layer: int,
    splits: list[TokenSplit],
    bits: int | None = None,
    group_size: int = 32,
) -> list[Segment]:
    """Segments of one layer: template, window ("kept"), beacon-selected ("beacon"), quantised rest."""
    keys, values, prefix = ctx.full.keys[layer], ctx.full.values[layer], ctx.prefix_len
    n_heads = keys.shape[0]
    segments: list[Segment] = []
    if prefix:
        index = torch.arange(prefix).expand(n_heads, prefix)
        segments.append(DenseSegment.from_padded(
            keys[:, :prefix], values[:, :prefix], torch.full((n_heads,), prefix), index, fate="template"))
    for part, fate in (("window", "kept"), ("beacon", "beacon"), ("quant", None)):
        index, lengths = _padded([getattr(s, part) + prefix for s in splits])
        if int(lengths.sum()) == 0:
            continue
        k, v = _gather(keys, index), _gather(values, index)
        if fate is None:
            if bits is None:
                raise ValueError("quantised tokens need a bit width")
            segments.append(QuantSegment.quantize(k, v, lengths, index, bits, group_size))
        else:
            segments.append(DenseSegment.from_padded(k, v, lengths, index, fate=fate))
    return segments


# --------------------------------------------------------------------------- memory planning


@dataclass
class MemoryPlan:
    """Per layer and KV head: full-precision and quantised document tokens; target and planned bytes."""

    n_fp: torch.Tensor  # [L, H_kv]
    n_quant: torch.Tensor  # [L, H_kv]
    target_bytes: int
    planned_bytes: int


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
) -> MemoryPlan:
    """How many full-precision / quantised tokens each head stores so that the
    whole cache takes at most ``full_nbytes / ratio`` bytes, as close to it as the
    token granularity allows.

    The template prefix is stored at full precision and paid from the budget.
    With a quantised rest (``bits``), every document token is stored if even the
    all-quantised head fits, with as many at full precision as possible;
    otherwise none is at full precision and the lowest-scored are evicted.
    Every head gets the same plan for ``budget // heads`` bytes, then what
    rounding left over buys one more full-precision (or quantised) token in as
    many heads as it can. At least one document token per head is stored.
    """
    fp = 2 * head_dim * element_size
    heads = n_layers * n_kv_heads
    target = math.floor(full_nbytes / ratio)
    budget = target - heads * prefix_len * fp
    n = torch.arange(doc_len + 1)
    if bits is None:
        qcost = torch.zeros(doc_len + 1, dtype=torch.long)
    else:
        qcost = torch.tensor([quant_nbytes(i, head_dim, bits, group_size) for i in range(doc_len + 1)])

    def plan(b: int) -> tuple[int, int, int]:
        if bits is None:
            n_fp = max(1, min(doc_len, b // fp))
            return n_fp, 0, n_fp * fp
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
    n_fp = torch.full((heads,), base[0])
    n_q = torch.full((heads,), base[1])
    left = budget - heads * base[2]
    for h in range(heads):
        extra = plan(base[2] + left)
        if extra[2] <= base[2]:
            break
        n_fp[h], n_q[h] = extra[0], extra[1]
        left -= extra[2] - base[2]
    planned = budget - left + heads * prefix_len * fp
    return MemoryPlan(n_fp.view(n_layers, n_kv_heads), n_q.view(n_layers, n_kv_heads), target, planned)


# --------------------------------------------------------------------------- the methods


class _BeaconBase(Method):
    paper = ("Kim, Kim, Shim, Choi, 2026, BeaconKV: Key-Value Cache Compression Guided by Beacon Queries "
             "for Efficient Large Reasoning Model Inference (arXiv 2609.04971; details from secondary summaries)")

    query_aware_when = "beacon_source=question"

    def uses_question(self) -> bool:
        return self.options.beacon_source == "question"


@register
class BeaconKV(_BeaconBase):
    name = "beaconkv"
    summary = ("eviction: score = max attention from 16 recent + 16 beacon queries (cosine FPS over the "
               "pre-RoPE query history, re-rotated to now), max over the GQA group; template + recent window kept")
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


@register
class BeaconKVMixed(_BeaconBase):
    name = "beaconkv_mixed"
    summary = ("mixed precision: beacon-selected tokens + recent window at full precision, the rest at "
               "2/4 bits (KIVI) or evicted; the ratio is a memory ratio (bytes stored ~ full bytes / ratio)")
    Options = BeaconMixedOptions
    #: The ratio is met in bytes (tests compare bytes, not token counts).
    memory_ratio_semantics: ClassVar[str] = "match"

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        lm = ctx.lm
        bits = REST_BITS[opts.rest]
        keys0 = ctx.full.keys[0]
        plan = plan_memory(
            ctx.doc_len, ctx.prefix_len, lm.n_layers, lm.n_kv_heads, keys0.shape[-1],
            keys0.element_size(), ctx.full.nbytes, req.ratio, bits, opts.group_size,
        )
        scores, beacons = beacon_scores(req, opts)
        layers = []
        for i, s in enumerate(scores):
            splits = [
                split_head(s[h], int(plan.n_fp[i, h]), int(plan.n_quant[i, h]), opts.window)
                for h in range(s.shape[0])
            ]
            layers.append(build_layer(ctx, i, splits, bits, opts.group_size))
        stored = CompressedKV(layers, ctx.length, meta={}, importance=document_importance(req, scores))
        stored.meta = {
            "method": self.name,
            "beacon_source": opts.beacon_source,
            "rest": opts.rest,
            "beacon_positions": beacons,
            "full_precision_tokens_mean": float(plan.n_fp.float().mean()),
            "quantized_tokens_mean": float(plan.n_quant.float().mean()),
            "evicted_tokens_mean": float(ctx.doc_len - (plan.n_fp + plan.n_quant).float().mean()),
            "target_bytes": plan.target_bytes,
            "memory_ratio": ctx.full.nbytes / max(1, stored.nbytes),
        }
        return stored


# --------------------------------------------------------------------------- budgeted generation


@dataclass
class BeaconGeneration(Generation):
    """A greedy answer under a token budget: also the largest physical cache seen and how often it evicted."""

    max_cache_len: int = 0
    evictions: int = 0


def beacon_generate(
    lm: LoadedModel,
    ctx: Context | None,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    token_budget: int,
    options: BeaconOptions | None = None,
    evict_chunk: int = 16,
    stop: bool = True,
) -> BeaconGeneration:
    """Greedy decoding with at most ``token_budget`` keys per layer and head (the paper's setting).

    Starts from ``ctx``'s full cache (or an empty one) and reads ``prompt_ids``
    then its own tokens, in chunks of at most ``evict_chunk`` tokens. Before a
    chunk would make the physical cache exceed the budget, each layer evicts
    down to ``token_budget - evict_chunk`` keys per head: it keeps the template
    prefix (``ctx.prefix_len`` tokens), the ``window`` most recent tokens and the
    best-scored others, scored by the running query history (recent queries +
    beacons from continual FPS, rotated to the current position). Every head
    keeps the same number of keys, so the working cache stays plain.
    ``options.beacon_source`` must be ``context`` (the model's own queries).
    """
    opts = options or BeaconOptions()
    if opts.beacon_source != "context":
        raise MethodError("beacon_generate scores with the model's own query history (beacon_source=context)")
    chunk = max(1, evict_chunk)
    keep_prefix = ctx.prefix_len if ctx is not None else 0
    if token_budget - chunk < keep_prefix + opts.window + 1:
        raise MethodError(
            f"token_budget {token_budget} leaves no room beyond the template ({keep_prefix}), "
            f"the window ({opts.window}) and one eviction chunk ({chunk})")
    session = open_session(lm, ctx.full.stored if ctx is not None else None)
    if session.key_bias is not None:
        raise MethodError("beacon_generate needs a plain starting cache")
    n_kv = lm.n_kv_heads
    n_heads = lm.n_heads
    k_pos: list[torch.Tensor] = [torch.zeros(n_kv, 0, dtype=torch.long) for _ in range(lm.n_layers)]
    if ctx is not None:
        state = document_state(ctx, opts, None)
        k_pos = [torch.arange(ctx.length).expand(n_kv, -1).clone() for _ in range(lm.n_layers)]
    else:
        state = BeaconState(opts.n_recent, BeaconBank(opts.n_beacons, opts.buffer))
    stats = {"max": 0, "evictions": 0}

    def physical() -> int:
        layers = session.cache.layers
        return int(layers[0].keys.shape[-2]) if layers else 0

    def evict_to(target: int) -> None:
        now = session.position
        cos_now, sin_now = rope_cos_sin(lm, torch.tensor([now]))
        queries, q_pos, _ = state.scoring_set(cos_now, sin_now, now)
        for layer in range(lm.n_layers):
            cached = session.cache.layers[layer]
            keys, values = cached.keys[0], cached.values[0]
            length = keys.shape[1]
            rows = slice(layer * n_heads, (layer + 1) * n_heads)
            score = key_scores(queries[rows], q_pos, keys.float().cpu(), k_pos[layer])
            score[:, :keep_prefix] = float("inf")
            score[:, max(keep_prefix, length - opts.window) :] = float("inf")
            index = top_k_per_head(score, torch.full((n_kv,), target))
            session.cache.layers[layer] = GrowingLayer(
                _gather(keys, index).unsqueeze(0), _gather(values, index).unsqueeze(0))
            k_pos[layer] = k_pos[layer].gather(1, index)
        stats["evictions"] += 1

    def feed(ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        if physical() + n > token_budget:
            evict_to(token_budget - max(n, chunk))
        capture = QueryCapture(lm.n_layers)
        positions = torch.arange(session.position, session.position + n)
        logits = extend(lm, session, ids, capture, logits_to_keep=1)[-1]
        stats["max"] = max(stats["max"], physical())
        cos, sin = rope_cos_sin(lm, positions)
        state.observe(stack_layers(capture.per_layer()), positions, cos, sin)
        for layer in range(lm.n_layers):
            k_pos[layer] = torch.cat([k_pos[layer], positions.expand(n_kv, -1)], dim=1)
        return logits

    logits = None
    for start in range(0, prompt_ids.numel(), chunk):
        logits = feed(prompt_ids[start : start + chunk])
    if logits is None:
        raise MethodError("beacon_generate needs a non-empty prompt")
    gen = greedy_loop(lm, logits, feed, max_new_tokens, stop_token_ids(lm) if stop else set())
    return BeaconGeneration(ids=gen.ids, text=gen.text, logprobs=gen.logprobs,
                            max_cache_len=stats["max"], evictions=stats["evictions"])
