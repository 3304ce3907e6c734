"""A lean forward pass for Llama-type decoders: the same maths with far fewer operations.

On a CPU a decode step of a small model is mostly overhead: transformers'
modules issue about a hundred small operations per layer (three separate
q/k/v projections, two MLP inputs, the RMSNorm in five steps, keyword
plumbing), each costing microseconds of dispatch while the weights take
about a millisecond to read. This pass runs the model's own weights through
one fused q/k/v projection, one fused gate/up projection and single-call
norms, and calls the same attention function as transformers' path
(:func:`kvlab.runtime.attention.causal_attention`), so a biased or ragged
stored cache is read exactly as there.

The fused weights are built once per model, and the model's own
``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` weights become
views of them: the model keeps working through transformers (the tests
compare the two paths) and no weight is held twice.

Supported: the families whose decoder layer is Llama's (Llama, Mistral,
Qwen2 with its q/k/v biases, SmolLM), sliding windows included (each
layer's own, kvlab.runtime.model.layer_geometry). Anything else (q/k norms, Gemma's
scaled norms and embeddings, other activations, weights spread over devices)
gets ``None`` from :func:`lean_model` and runs through transformers.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.runtime.attention import causal_attention
from kvlab.runtime.model import layer_geometry
from kvlab.runtime.rope import rotate

#: The model types whose decoder layers are Llama's, parameter for parameter.
LLAMA_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LeanLayer:
    """One decoder layer's weights, fused, and how it attends.

    qkv: [(H + 2 H_kv) d, D] (and qkv_bias [(H + 2 H_kv) d] or None);
    o: [D, H d]; gate_up: [2 I, D]; down: [D, I]; norms: [D]; scaling: its
    factor on q.k; window: its sliding window, or None.
    """

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    scaling: float
    window: int | None


@dataclass
class LeanModel:
    """What the lean pass reads: the fused layers plus the model's own embedding, RoPE and head."""

    layers: list[LeanLayer]
    embed: torch.nn.Embedding
    rotary: torch.nn.Module
    final_norm: torch.Tensor
    lm_head: torch.nn.Linear
    eps: float
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int


def _fuse(modules: list[torch.nn.Linear], name: str) -> torch.Tensor | None:
    """Concatenate the modules' ``name`` tensors (weight or bias) along rows and make each a view of the result.

    None when no module has one (bias-free projections). In place, so the
    separate tensors are freed and the model computes the same thing.
    """
    parts = [getattr(m, name) for m in modules]
    if all(p is None for p in parts):
        return None
    fused = torch.cat([p.data for p in parts])
    start = 0
    for m, p in zip(modules, parts):
        stop = start + p.shape[0]
        getattr(m, name).data = fused[start:stop]
        start = stop
    return fused


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the lean pass cannot run ``model`` (None: it can)."""
    cfg = model.config
    if cfg.model_type not in LLAMA_TYPES:
        return f"model type {cfg.model_type!r} is not one of {', '.join(LLAMA_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "weights managed by accelerate's hooks (offloaded or split)"
    if len({p.device for p in model.parameters()}) != 1:
        return "weights on more than one device"
    layer = model.model.layers[0]
    if hasattr(layer.self_attn, "q_norm") or getattr(layer.self_attn.o_proj, "bias", None) is not None:
        return "q/k norms or an output-projection bias"
    return None


_LOCK = threading.Lock()


def lean_model(model: torch.nn.Module) -> LeanModel | None:
    """The lean view of ``model``, built (weights fused) on first use; None when unsupported.

    Kept on the model object, and rebuilt when the model's weights are no
    longer the fused ones (a copy of the model, weights moved or cast).
    Built under a lock: the app's threads may ask at once.
    """
    with _LOCK:
        lean = getattr(model, "_kvlab_lean", _UNBUILT)
        if lean is _UNBUILT or (lean is not None and not _current(lean, model)):
            lean = model._kvlab_lean = None if unsupported_reason(model) else _build(model)
        return lean


_UNBUILT = object()


def _current(lean: LeanModel, model: torch.nn.Module) -> bool:
    """Whether ``lean``'s fused weights are still the ones ``model`` computes with."""
    weight = model.model.layers[0].self_attn.q_proj.weight
    fused = lean.layers[0].qkv
    return fused.data_ptr() == weight.data_ptr() and fused.dtype == weight.dtype and fused.device == weight.device


def _build(model: torch.nn.Module) -> LeanModel:
    cfg, body = model.config, model.model
    layers = []
    for layer, geometry in zip(body.layers, layer_geometry(model)):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        layers.append(
            LeanLayer(
                qkv=_fuse(projections, "weight"),
                qkv_bias=_fuse(projections, "bias"),
                o=attn.o_proj.weight,
                gate_up=_fuse([mlp.gate_proj, mlp.up_proj], "weight"),
                down=mlp.down_proj.weight,
                attn_norm=layer.input_layernorm.weight,
                mlp_norm=layer.post_attention_layernorm.weight,
                scaling=geometry.scaling,
                window=geometry.window,
            )
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return LeanModel(
        layers=layers,
        embed=body.embed_tokens,
        rotary=body.rotary_emb,
        final_norm=body.norm.weight,
        lm_head=model.lm_head,
        eps=cfg.rms_norm_eps,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        intermediate=cfg.intermediate_size,
    )


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [N, D_in], weight [D_out, D_in] -> [N, D_out], contiguous.

    On a CPU it is computed as ``weight @ x^T``, a single row doubled: MKL, PyTorch's CPU BLAS,
    multiplies a few rows by a wide weight much more slowly in linear's own layout (x @ W^T, M = N)
    than with the weight as the tall operand, and one row goes down its matrix-vector path, slower
    than the two-column product. On the AMD EPYC measured (2026-12-04) a SmolLM2-135M step's weight
    products took 57 ms as linear, 27 ms this way, and two sequences' step 97 ms against 27 ms
    (``python -m benchmarks.decode_speed`` times both forms). Other devices keep linear.
    """
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    n = x.shape[0]
    out = (weight @ (torch.cat([x, x]) if n == 1 else x).mT)[:, :n].mT.contiguous()  # [N, D_out]
    return out if bias is None else out.add_(bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, cast back, then scaled (x [..., D], weight [D])."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@dataclass
class LeanItem:
    """One sequence of a :func:`lean_forward_many` pass: its own cache, tokens and positions.

    cache: a transformers DynamicCache whose ``layers[i].update(k, v)``
    appends [1, H_kv, n, d] and returns the whole layer (layers are added
    from ``layer_class_to_replicate`` while the cache is empty); ids: [n];
    positions: [n] on the model's device; key_bias and capture as in
    :class:`kvlab.runtime.hooks.ForwardContext`; logits_to_keep: the last rows
    whose logits it returns (0: all).
    """

    cache: Any
    ids: torch.Tensor
    positions: torch.Tensor
    key_bias: list[torch.Tensor] | None = None
    capture: Any = None
    logits_to_keep: int = 0


def lean_forward(
    lean: LeanModel,
    cache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    key_bias: list[torch.Tensor] | None,
    capture,
    logits_to_keep: int,
) -> torch.Tensor:
    """The model over ``ids`` [n] at ``positions`` [1, n], appending to ``cache``; logits [keep, V].

    One sequence of :func:`lean_forward_many` (see :class:`LeanItem` for the arguments).
    """
    return lean_forward_many(lean, [LeanItem(cache, ids, positions[0], key_bias, capture, logits_to_keep)])[0]


def lean_forward_many(lean: LeanModel, items: list[LeanItem]) -> list[torch.Tensor]:
    """The model over several sequences at once, each appending to its own cache; per item logits [keep, V].

    Every projection and MLP runs once over all the items' rows (N = the sum
    of their lengths): a decode step reads the weights once for all its
    sequences instead of once each, which is what a step costs on a CPU.
    Attention is each item's own, over its own cache and biases.
    """
    heads, kv_heads, d = lean.n_heads, lean.n_kv_heads, lean.head_dim
    lengths = [item.ids.numel() for item in items]
    rows = [slice(start, start + n) for start, n in zip(itertools.accumulate([0] + lengths), lengths)]
    x = lean.embed(torch.cat([item.ids for item in items]))  # [N, D]
    cos, sin = lean.rotary(x.unsqueeze(0), torch.cat([item.positions for item in items]).unsqueeze(0))  # [1, N, d]
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [N, 1, d]: the same for every head
    sizes = [(heads + kv_heads) * d, kv_heads * d]
    for i, w in enumerate(lean.layers):
        qk, v = project(rms_norm(x, w.attn_norm, lean.eps), w.qkv, w.qkv_bias).split(sizes, dim=-1)
        # Queries and keys rotated together: the same arithmetic in one set of operations instead of two.
        qk = rotate(qk.view(-1, heads + kv_heads, d), cos, sin)  # [N, H + H_kv, d]
        v = v.view(-1, kv_heads, d)
        outs = []
        for item, r in zip(items, rows):
            q, k = (t.transpose(0, 1).unsqueeze(0) for t in qk[r].split([heads, kv_heads], dim=1))  # [1, H(_kv), n, d]
            cache = item.cache
            if i == len(cache.layers):  # an empty cache grows its layers on first use, as transformers' does
                cache.layers.append(cache.layer_class_to_replicate())
            keys, values = cache.layers[i].update(k, v[r].transpose(0, 1).unsqueeze(0))
            bias = None if item.key_bias is None else item.key_bias[i]
            if item.capture is not None:
                item.capture.record(i, q.contiguous())  # a copy of the queries alone, not of the whole pass
                keys, values, bias = item.capture.attended(i, keys, values, bias)
            out = causal_attention(q, keys, values, bias, w.scaling, w.window)  # [1, H, n, d]
            outs.append(out[0].transpose(0, 1).reshape(-1, heads * d))
        x = x + project(outs[0] if len(outs) == 1 else torch.cat(outs), w.o)
        gate, up = project(rms_norm(x, w.mlp_norm, lean.eps), w.gate_up).split(lean.intermediate, dim=-1)
        x = x + project(F.silu(gate) * up, w.down)
    kept = [x[r][-item.logits_to_keep :] if item.logits_to_keep else x[r] for item, r in zip(items, rows)]
    head = lean.lm_head
    logits = project(
        rms_norm(kept[0] if len(kept) == 1 else torch.cat(kept), lean.final_norm, lean.eps), head.weight, head.bias
    )
    return list(logits.split([k.shape[0] for k in kept]))
