"""Stored KV caches: the full one and compressed ones.

A compressed layer is a list of segments. Each segment stores some tokens of
every KV head in its own form (full precision, or packed low-bit codes) and
can show them to attention as padded tensors. Heads may keep different
numbers of tokens: storage is packed per head (no padding is stored), and
padding appears only in the transient attention view, with bias -inf, which
is exactly an absent key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

NEG_INF = float("-inf")


@dataclass
class PaddedView:
    """What attention sees of one segment or layer.

    keys/values: [H_kv, L, d]; bias: [H_kv, L] (-inf on padding);
    token_index: [H_kv, L] original token position, -1 for synthetic or padding keys.
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    token_index: torch.Tensor


class Segment(Protocol):
    """Some tokens of every KV head of one layer, in one storage form."""

    fate: str

    @property
    def nbytes(self) -> int: ...

    def breakdown(self) -> dict[str, int]: ...

    def lengths(self) -> torch.Tensor: ...

    def view(self) -> PaddedView: ...


def pack_heads(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[H, L, ...] padded per head -> [sum(lengths), ...] (head-major).

    When every head keeps all L slots this is a reshape: a view of a contiguous
    ``x`` (the keep-all cache shares the full cache's storage instead of copying it).
    """
    if x.shape[0] and bool((lengths == x.shape[1]).all()):
        return x.reshape(-1, *x.shape[2:])
    keep = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < lengths.to(x.device).unsqueeze(1)
    return x[keep]


def unpack_heads(flat: torch.Tensor, lengths: torch.Tensor, fill: float) -> torch.Tensor:
    """[sum(lengths), ...] -> [H, max(lengths), ...], padded with ``fill``."""
    n_heads, width = lengths.numel(), int(lengths.max()) if lengths.numel() else 0
    out = flat.new_full((n_heads, width, *flat.shape[1:]), fill)
    keep = torch.arange(width, device=flat.device).unsqueeze(0) < lengths.to(flat.device).unsqueeze(1)
    out[keep] = flat
    return out


@dataclass
class DenseSegment:
    """Tokens kept at the model's precision, packed per head.

    keys/values: [N, d] with N = lengths.sum(); bias: [N] or None (all zero:
    eviction methods store no bias, Attention Matching does); lengths: [H_kv];
    token_index: [N] (-1 for keys that are not an original token). The
    token index is bookkeeping for the figures and is not counted as stored:
    attention never reads it (positions are already inside the RoPE'd keys).
    All of them live on the keys' device: the lengths and the token index
    make the masks that meet the keys and biases.
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor | None
    head_lengths: torch.Tensor
    token_index: torch.Tensor
    fate: str = "kept"

    @classmethod
    def from_padded(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        token_index: torch.Tensor,
        bias: torch.Tensor | None = None,
        fate: str = "kept",
    ) -> "DenseSegment":
        """keys/values [H, L, d], lengths [H], token_index [H, L], bias [H, L] or None."""
        lengths = lengths.to(keys.device, torch.long)
        return cls(
            keys=pack_heads(keys, lengths).contiguous(),
            values=pack_heads(values, lengths).contiguous(),
            bias=None if bias is None else pack_heads(bias, lengths).contiguous(),
            head_lengths=lengths,
            token_index=pack_heads(token_index.to(keys.device), lengths),
            fate=fate,
        )

    @property
    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        parts = {"full-precision keys+values": self.keys.nbytes + self.values.nbytes}
        if self.bias is not None:
            parts["biases"] = self.bias.nbytes
        return parts

    def lengths(self) -> torch.Tensor:
        return self.head_lengths

    def view(self) -> PaddedView:
        bias = self.bias if self.bias is not None else self.keys.new_zeros(self.keys.shape[0])
        return PaddedView(
            keys=unpack_heads(self.keys, self.head_lengths, 0.0),
            values=unpack_heads(self.values, self.head_lengths, 0.0),
            bias=unpack_heads(bias, self.head_lengths, NEG_INF),
            token_index=unpack_heads(self.token_index, self.head_lengths, -1),
        )


def template_segment(keys: torch.Tensor, values: torch.Tensor, prefix_len: int) -> DenseSegment:
    """The chat template's prefix of one layer, stored as it is (fate "template").

    keys/values: [H_kv, L, d] whose first ``prefix_len`` keys of every head are
    the template's tokens 0..prefix_len-1, in order (L >= prefix_len).
    """
    n_heads, device = keys.shape[0], keys.device
    index = torch.arange(prefix_len, device=device).expand(n_heads, prefix_len)
    lengths = torch.full((n_heads,), prefix_len, device=device)
    return DenseSegment.from_padded(keys[:, :prefix_len], values[:, :prefix_len], lengths, index, fate="template")


def window_segment(keys: torch.Tensor, values: torch.Tensor, window: int, first: int = 0) -> DenseSegment:
    """What a sliding-window layer keeps of a context: its last ``window - 1`` tokens (fate "window").

    keys/values: [H_kv, L, d], consecutive tokens ``first .. first + L - 1`` of
    the context, its last ones, in order. The next query sees the kept ones
    and itself, ``window`` tokens, as transformers' sliding layers keep them.
    """
    n_heads, length = keys.shape[:2]
    kept = min(length, window - 1)
    index = torch.arange(first + length - kept, first + length, device=keys.device).expand(n_heads, kept)
    lengths = torch.full((n_heads,), kept, device=keys.device)
    return DenseSegment.from_padded(keys[:, length - kept :], values[:, length - kept :], lengths, index, fate="window")


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each head's chosen keys (or values): x [H, L, d], index [H, n] -> [H, n, d]."""
    return x.gather(1, index.to(x.device).unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def concat_views(views: list[PaddedView]) -> PaddedView:
    """Join segment views along the key axis (padding may sit in the middle)."""
    if len(views) == 1:
        return views[0]
    return PaddedView(
        keys=torch.cat([v.keys for v in views], dim=1),
        values=torch.cat([v.values for v in views], dim=1),
        bias=torch.cat([v.bias for v in views], dim=1),
        token_index=torch.cat([v.token_index for v in views], dim=1),
    )


def select_keys(view: PaddedView, mask: torch.Tensor) -> PaddedView:
    """The keys of ``view`` where ``mask`` [H, L] holds, packed to the left of each head.

    Slots past a head's count are padding (bias -inf, token index -1).
    """
    lengths = mask.sum(dim=1)
    width = int(lengths.max()) if lengths.numel() else 0
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]
    valid = torch.arange(width, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)
    gather3 = order.unsqueeze(-1).expand(-1, -1, view.keys.shape[-1])
    return PaddedView(
        keys=view.keys.gather(1, gather3),
        values=view.values.gather(1, gather3),
        bias=torch.where(valid, view.bias.gather(1, order), NEG_INF),
        token_index=torch.where(valid, view.token_index.gather(1, order), -1),
    )


def segment_from_view(view: PaddedView, fate: str, keep_bias: bool = True) -> DenseSegment:
    """Store a left-packed view (padding = bias -inf); ``keep_bias=False`` for views whose
    real keys all have bias 0 (nothing to store)."""
    lengths = torch.isfinite(view.bias).sum(dim=1)
    bias = view.bias if keep_bias else None
    return DenseSegment.from_padded(view.keys, view.values, lengths, view.token_index, bias=bias, fate=fate)


def token_importance(scores: torch.Tensor, token_index: torch.Tensor, length: int) -> torch.Tensor:
    """Place per-key scores at the tokens the keys stand for.

    scores, token_index: [H, L] (index -1: padding or a synthetic key) ->
    [H, length] float32 on the CPU (it goes to the token view), NaN for tokens
    without a scored key. Placed on the scores' device, then moved once.
    """
    device = scores.device
    out = torch.full((scores.shape[0], length), float("nan"), device=device)
    token_index = token_index.to(device)
    real = token_index >= 0
    rows = torch.arange(scores.shape[0], device=device).unsqueeze(1).expand_as(token_index)
    out[rows[real], token_index[real]] = scores.detach().float()[real]
    return out.cpu()


@dataclass
class CompressedKV:
    """A stored cache for one context: per layer, a list of segments.

    logical_len is the number of tokens the context really had, so that a
    token appended after the cache gets the position it would have had with
    the full cache, however few keys are physically stored.

    position_shift: the next token's position is ``logical_len - position_shift``.
    0 for every cache but a re-rotated one (``rerotate=true``,
    kvlab.compression.wrappers.key_rerotation), whose kept keys were moved to
    contiguous positions ending right before that one.

    importance: a diagnostic, filled only when the request asks for it
    (``Request.record_importance``) by methods that score tokens: per layer
    [H_kv, logical_len] float32, the method's own score of each context token
    in that KV head (higher = more important; +inf for tokens the method
    always keeps, e.g. a recent window), NaN where it has none (e.g. the
    template prefix, kept whatever its score). It is not stored bytes (not in
    ``nbytes`` or ``breakdown``) and stays out of ``meta``, which the run's
    JSON details are built from.

    scales: per layer, the model's factor on q.k for this cache's keys
    (kvlab.runtime.model.LayerGeometry.scaling), carried by the keep-all cache
    (:attr:`FullKV.stored`) for what measures or fits against it (the
    metrics, Attention Matching); None: 1/sqrt(d).
    """

    layers: list[list[Segment]]
    logical_len: int
    meta: dict = field(default_factory=dict)
    importance: list[torch.Tensor] | None = None
    scales: list[float] | None = None
    position_shift: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for layer in self.layers for seg in layer)

    def layers_nbytes(self, layers: list[int]) -> int:
        """Stored bytes of the given layers."""
        return sum(seg.nbytes for i in layers for seg in self.layers[i])

    def breakdown(self) -> dict[str, int]:
        """Stored bytes by part (e.g. full-precision, codes, scales, biases)."""
        parts: dict[str, int] = {}
        for layer in self.layers:
            for seg in layer:
                for name, n in seg.breakdown().items():
                    parts[name] = parts.get(name, 0) + n
        return parts

    def kept_per_head(self) -> torch.Tensor:
        """[n_layers, H_kv] number of stored keys per head (all segments)."""
        return torch.stack([sum(seg.lengths() for seg in layer) for layer in self.layers])

    def layer_view(self, layer: int) -> PaddedView:
        return concat_views([seg.view() for seg in self.layers[layer]])

    def fates(self, layer: int, head: int) -> dict[int, str]:
        """Original token index -> the fate of its stored copy in one head."""
        out: dict[int, str] = {}
        for seg in self.layers[layer]:
            idx = seg.view().token_index[head]
            for i in idx[idx >= 0].tolist():
                out[int(i)] = seg.fate
        return out

    def is_plain(self) -> bool:
        """True when no layer needs a bias (no padding, no fitted bias)."""
        return all(
            isinstance(seg, DenseSegment) and seg.bias is None and bool((seg.head_lengths == seg.head_lengths[0]).all())
            for layer in self.layers
            for seg in layer
        )


@dataclass
class FullKV:
    """The document's full cache: per layer, post-RoPE keys and values [H_kv, T, d].

    Each tensor holds exactly its T tokens (no spare decode capacity), and the
    keep-all view :attr:`stored` shares their storage, so a held document costs
    its KV cache's bytes once. windows: per layer, the sliding window of a
    layer that has one (None: it sees every key; no list: no layer has one).
    A window layer's keys are kept for every token too (the methods score
    every layer's keys), but the model's cache, :attr:`stored` and
    :attr:`nbytes`, holds only its window (:func:`window_segment`).
    scales: per layer, the model's factor on q.k (None: 1/sqrt(d)), passed on
    to :attr:`stored` (:attr:`CompressedKV.scales`).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    windows: list[int | None] | None = None
    scales: list[float] | None = None
    # The keep-all view, built once on first use under the lock: the app's prepare slot, its
    # compute slot and its warm-up thread may all ask for it at once.
    _stored: "CompressedKV | None" = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]

    def window(self, layer: int) -> int | None:
        """``layer``'s sliding window, or None when it sees every key."""
        return self.windows[layer] if self.windows is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes of the model's own cache: every token of a full layer, a window layer's window."""
        total = 0
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            window = self.window(layer)
            kept = k.shape[1] if window is None else min(k.shape[1], window - 1)
            total += (k.nbytes + v.nbytes) * kept // max(1, k.shape[1])
        return total

    @property
    def stored(self) -> CompressedKV:
        """The keep-all cache: every token, no bias (the ceiling every method is compared with);
        a window layer keeps its window, as the model does.

        Built once, as views of :attr:`keys` and :attr:`values`, however many
        threads ask at once; like every stored cache it is never modified."""
        with self._lock:
            if self._stored is None:
                self._stored = self._keep_all()
            return self._stored

    def _keep_all(self) -> CompressedKV:
        layers: list[list[Segment]] = []
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            window = self.window(layer)
            if window is not None:
                layers.append([window_segment(k, v, window)])
                continue
            n_heads, length = k.shape[:2]
            lengths = torch.full((n_heads,), length, device=k.device)
            index = torch.arange(length, device=k.device).expand(n_heads, length)
            layers.append([DenseSegment.from_padded(k, v, lengths, index)])
        return CompressedKV(layers=layers, logical_len=self.length, meta={"method": "full"}, scales=self.scales)


def keep_windows(stored: CompressedKV, full: FullKV) -> CompressedKV:
    """``stored`` with every window layer replaced by ``full``'s window: the layers a method compresses
    are the full-attention ones; a window layer keeps what the model keeps. ``stored`` must stand for
    ``full``'s context (the same logical length); its layer list is replaced (a list it may share
    with another cache stays as it was) and it is returned. A window layer's importance, when
    recorded, is NaN: the method's scores chose none of its keys."""
    if full.windows is None or all(w is None for w in full.windows):
        return stored
    keep_all = full.stored
    windowed = [full.window(i) is not None for i in range(stored.n_layers)]
    stored.layers = [
        list(keep_all.layers[i]) if w else layer for i, (layer, w) in enumerate(zip(stored.layers, windowed))
    ]
    if stored.importance is not None:
        nan = float("nan")
        stored.importance = [torch.full_like(imp, nan) if w else imp for imp, w in zip(stored.importance, windowed)]
    return stored
