"""Attention Matching's cache of a request's document (Zweiger, Fu, Guo, Kim, 2026):
:func:`compact_document` records the reference queries, sets the per-head budgets and fits every layer
(kvlab.methods.families.compaction.compact_cache), or, on-policy, fits each layer on queries read through
the layers fitted before it: in one forward sweep (:func:`on_policy_cache`, the lab's way: each segment
of the reference text its own pass after the document, the passes held together layer by layer,
:class:`SweepLayers`) or by re-reading the text once per layer (:func:`on_policy_reread`, the paper's
code's way, kept as the reference the sweep is tested against).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator

import torch

from kvlab.compression.request import Request
from kvlab.context import Context
from kvlab.methods.families.am_recipe import AMOptions, am_budgets, on_policy_segments, reference_queries
from kvlab.methods.families.compaction import (
    LayerFit,
    compact_cache,
    compact_layer,
    fitted_cache,
    is_window,
    window_fit,
)
from kvlab.methods.families.scorers import KVzipOptions, kvzip_scores
from kvlab.queries import read_after, read_after_into, self_study_queries
from kvlab.runtime.cache import CompressedKV, concat_views
from kvlab.runtime.hooks import QueryCapture


def compact_document(req: Request, opts: AMOptions, method: str) -> CompressedKV:
    """Attention Matching's cache of ``req``'s document: reference queries, budgets, then the fit
    (on-policy: layer by layer); ``method`` names it in the meta. Every layer is fitted here (a
    window layer as the model keeps it, :func:`window_fit`)."""
    ctx = req.ctx
    req.progress(0.3, f"reference queries: {opts.query_source}")
    start = time.perf_counter()
    # KVzip's scores need the reconstruction pass: timed with the queries.
    exact_kvzip = opts.exact_share > 0 and opts.exact_keys == "kvzip"
    scores = (
        kvzip_scores(req, KVzipOptions()) if opts.key_selection in ("kvzip", "kvzip_union") or exact_kvzip else None
    )
    key_scores = scores if opts.key_selection in ("kvzip", "kvzip_union") else None
    exact_scores = scores if exact_kvzip else None
    if opts.on_policy:
        scores_s = time.perf_counter() - start
        head = am_budgets(req, opts)
        on_policy = on_policy_cache if opts.on_policy_sweep else on_policy_reread
        stored, queries_s = on_policy(req, opts, head.budgets, key_scores, exact_scores)
        queries_s += scores_s
    else:
        queries = reference_queries(ctx, opts, req.question)
        extra = self_study_queries(ctx, opts.self_study_tokens) if opts.self_study_weight > 0 else None
        head = am_budgets(req, opts, queries)
        queries_s = time.perf_counter() - start
        req.progress(0.4, "fitting keys, biases and values")
        stored = compact_cache(
            ctx.full.stored,
            queries,
            head.budgets,
            opts,
            ctx.prefix_len,
            req.record_importance,
            key_scores,
            extra,
            exact_scores,
        )
    stored.meta = {
        "method": method,
        "query_source": opts.query_source,
        **query_meta(opts),
        "key_selection": opts.key_selection,
        **head.meta(),
        **stored.meta,
        "fit_s": {"queries": queries_s, **stored.meta["fit_s"]},
    }
    return stored


def query_meta(opts: AMOptions) -> dict:
    """What a fit's meta (the run's details, ``--json``) says of its reference queries: their kinds (the
    source, then self-study's conversations when mixed in, with its weight), the cap per KV head, and
    whether they were read on-policy (in one sweep, or re-read per layer). The count per head actually
    fitted is ``queries_per_head``."""
    kinds = [opts.query_source]
    if opts.self_study_weight > 0:
        kinds.append("self_study")
    on_policy = ("sweep" if opts.on_policy_sweep else "reread") if opts.on_policy else "no"
    return {
        "query_kinds": kinds,
        "self_study_weight": opts.self_study_weight,
        "max_queries": opts.max_queries,
        "on_policy": on_policy,
    }


def on_policy_cache(
    req: Request,
    opts: AMOptions,
    budgets: torch.Tensor,
    key_scores: list[torch.Tensor] | None,
    exact_scores: list[torch.Tensor] | None = None,
) -> tuple[CompressedKV, float]:
    """On-policy Attention Matching in one forward sweep: each segment of the reference text
    (:func:`on_policy_segments`: the source's text, each self-study conversation) is read once, on its
    own right after the full cache, and each layer is fitted as the passes reach it, on the queries
    they all record there (read through layers 0..l-1, already compacted), then the passes go on
    through the compacted layer (:class:`SweepLayers`). Layer l's queries depend only on layers
    0..l-1, final once fitted, so this is the per-layer re-read (:func:`on_policy_reread`) at the cost
    of one pass. A segment is read in one piece (a layer's fit needs all of its queries), its attention
    after a fitted layer in blocks of queries (kvlab.runtime.attention.BIAS_BLOCK). Returns the cache
    and the seconds spent outside the fits (the passes)."""
    ctx = req.ctx
    segments = on_policy_segments(ctx, opts, req.question)
    length = ctx.full.stored.logical_len if req.record_importance else None
    sweep = SweepLayers(
        ctx.lm.n_layers,
        len(segments),
        lambda layer, q: fit_on_policy(
            req,
            opts,
            layer,
            q[0],
            budgets,
            length,
            key_scores,
            exact_scores,
            torch.cat(q[1:], dim=1) if q[1:] else None,
        ),
        ctx.length,
    )
    start = time.perf_counter()
    read_segments(ctx, segments, sweep)
    total = time.perf_counter() - start
    fitting = sum(f.timings["keys"] + f.timings["bias"] + f.timings["values"] for f in sweep.fits)
    return fitted_cache(sweep.fits, ctx.full.stored.logical_len), max(0.0, total - fitting)


def read_segments(ctx: Context, segments: list[torch.Tensor], sweep: SweepLayers) -> None:
    """Every segment read after the full cache into its capture of ``sweep``, each pass in its own thread
    (the first in this one) under the caller's context (its cancellation scope) and torch function modes
    (:func:`carried_modes`); the first real error of any pass raised here (the others' broken barrier is
    only its echo)."""
    errors: list[BaseException] = []
    modes = torch.overrides._get_current_function_mode_stack()

    def read(k: int) -> None:
        try:
            with carried_modes(modes) if k else contextlib.nullcontext():
                read_after_into(ctx, segments[k], sweep.captures[k])
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)
            sweep.barrier.abort()  # the other passes wait at the next layer's barrier: release them

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(read, k)) for k in range(1, len(segments))]
    for thread in threads:
        thread.start()
    read(0)
    for thread in threads:
        thread.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]


@contextlib.contextmanager
def carried_modes(modes: list) -> Iterator[None]:
    """The caller's torch function modes, entered in a worker thread: a mode holds for the thread that
    entered it only (``with torch.device(...)``, kvlab.testing.fake_cuda's device-mixing check)."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def fit_on_policy(
    req: Request,
    opts: AMOptions,
    layer: int,
    q: torch.Tensor,
    budgets: torch.Tensor,
    importance_len: int | None,
    key_scores: list[torch.Tensor] | None,
    exact_scores: list[torch.Tensor] | None,
    extra: torch.Tensor | None = None,
) -> LayerFit:
    """One layer of the full cache fitted on its on-policy queries q [H, n, d] and self-study's extra
    [H, n2, d] (weighted ``self_study_weight``; None or empty: none) (a window layer kept)."""
    ctx = req.ctx
    full = ctx.full.stored
    req.progress(0.3 + 0.3 * layer / ctx.lm.n_layers, f"on-policy: layer {layer + 1}")  # done before it
    if is_window(full.layers[layer]):
        return window_fit(full.layers[layer], importance_len)
    return compact_layer(
        full.layer_view(layer),
        q,
        budgets[layer],
        opts,
        ctx.prefix_len,
        importance_len,
        None if key_scores is None else key_scores[layer],
        None if extra is None or extra.shape[1] == 0 else extra,
        scale=ctx.lm.geometry[layer].scaling,
        exact_scores=None if exact_scores is None else exact_scores[layer],
    )


class SweepLayers:
    """The on-policy sweep's passes, one per segment of its text, held together layer by layer: once
    every pass has recorded layer l's queries (a barrier), the layer is fitted once on them all, in
    segment order (``fit(layer, [q_k [H, n_k, d], ...])``), and every pass reads the fitted layer in
    place of the full one (:class:`SweepCapture`).

    cached: the full cache's length (template and document), which each pass's own keys follow.
    """

    def __init__(
        self, n_layers: int, n_segments: int, fit: Callable[[int, list[torch.Tensor]], LayerFit], cached: int
    ) -> None:
        self.fit = fit
        self.cached = cached
        self.fits: list[LayerFit] = []
        self.captures = [SweepCapture(n_layers, self) for _ in range(n_segments)]
        self.barrier = threading.Barrier(n_segments, action=self._fit_next)

    def _fit_next(self) -> None:
        """The barrier's action (one thread, the others waiting): fit the next layer on every pass's queries."""
        layer = len(self.fits)
        self.fits.append(self.fit(layer, [c.layer(layer) for c in self.captures]))
        for capture in self.captures:
            del capture.chunks[layer]  # fitted: its queries are not needed again (30 layers' would stay alive)

    def fitted(self, layer: int) -> LayerFit:
        """Layer ``layer``'s fit, once every pass has reached it."""
        self.barrier.wait()
        return self.fits[layer]


class SweepCapture(QueryCapture):
    """One pass of the on-policy sweep (:class:`SweepLayers`): as each layer's queries are recorded, the
    pass waits for the layer's fit and reads the fitted layer, then its own keys."""

    def __init__(self, n_layers: int, sweep: SweepLayers) -> None:
        super().__init__(n_layers)
        self.sweep = sweep

    def attended(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if len(self.chunks[layer]) != 1:
            raise RuntimeError("the on-policy sweep reads each segment in one pass")
        fit = self.sweep.fitted(layer)
        if all(seg.fate == "window" for seg in fit.segments):
            return keys, values, bias
        # The fitted layer (template, compact keys with their biases, padding at -inf), then the pass's own keys.
        view = concat_views([seg.view() for seg in fit.segments])
        own = slice(self.sweep.cached, keys.shape[2])
        return (
            torch.cat([view.keys.to(keys.dtype).unsqueeze(0), keys[:, :, own]], dim=2),
            torch.cat([view.values.to(values.dtype).unsqueeze(0), values[:, :, own]], dim=2),
            view.bias.float(),
        )


def on_policy_reread(
    req: Request,
    opts: AMOptions,
    budgets: torch.Tensor,
    key_scores: list[torch.Tensor] | None,
    exact_scores: list[torch.Tensor] | None = None,
) -> tuple[CompressedKV, float]:
    """On-policy by re-reading: layer by layer, each segment of the reference text
    (:func:`on_policy_segments`) read again through the layers fitted so far (one pass per layer and
    segment, as the paper's code does it). The reference the sweep is tested against
    (``on_policy_sweep=false``)."""
    ctx = req.ctx
    segments = on_policy_segments(ctx, opts, req.question)
    full = ctx.full.stored
    length = full.logical_len if req.record_importance else None
    fits: list[LayerFit] = []
    queries_s = 0.0
    for layer in range(ctx.lm.n_layers):
        start = time.perf_counter()
        mixed = CompressedKV([f.segments for f in fits] + full.layers[layer:], full.logical_len)
        q = [read_after(ctx, ids, mixed, layers=layer + 1)[layer] for ids in segments]
        queries_s += time.perf_counter() - start
        extra = torch.cat(q[1:], dim=1) if q[1:] else None
        fits.append(fit_on_policy(req, opts, layer, q[0], budgets, length, key_scores, exact_scores, extra))
    return fitted_cache(fits, full.logical_len), queries_s
