"""Rotary position embedding (RoPE) of query vectors, both ways.

The cache and the recorded queries are post-RoPE: each vector is rotated by
its own position. Methods that compare queries across positions (BeaconKV's
beacon queries) need them pre-RoPE, and re-rotate them to a new position
before scoring. These helpers use the model's own rotary embedding
(``model.model.rotary_emb(x, position_ids) -> cos, sin``; Gemma 3's takes the
layer type too: one RoPE for its local layers, one for its global ones), so
frequencies and RoPE scaling (Llama 3.1's "llama3", YaRN's attention
factor...) match each layer, and the Llama "rotate half" layout (Llama,
Mistral, Qwen2, Qwen3, Gemma 3, SmolLM, GPT-OSS...):
``rot(q) = q * cos + rotate_half(q) * sin``.
"""

from __future__ import annotations

import torch

from kvlab.runtime.model import LoadedModel, ModelLoadError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: q [..., n, d], cos/sin [n, d] (or broadcastable) -> [..., n, d]."""
    return q * cos + rotate_half(q) * sin


def unrotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Invert :func:`rotate` for the same cos/sin: rotate(unrotate(q)) == q.

    Each pair (i, i + d/2) was rotated by an angle and scaled by the RoPE's
    attention scaling s (cos = s cos a, sin = s sin a); the inverse rotates by
    -a and divides by s^2 = cos^2 + sin^2 (1 for plain RoPE).
    """
    return (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)


def rope_cos_sin(
    lm: LoadedModel, positions: torch.Tensor, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s RoPE tables at ``positions`` [n] -> cos, sin: float32 [n, d] on the model's device.

    layer None: the table every layer shares; ModelLoadError for a model whose
    layers rotate differently (Gemma 3), which must name the layer.
    """
    kinds = {g.rope_type for g in lm.geometry}
    if layer is None and len(kinds) > 1:
        raise ModelLoadError(
            f"{lm.name}: its layers rotate by different RoPEs ({', '.join(sorted(kinds))}): ask for one layer's tables"
        )
    kind = lm.geometry[0 if layer is None else layer].rope_type
    positions = positions.reshape(1, -1).to(lm.device)
    probe = torch.zeros(1, 1, lm.head_dim, device=lm.device, dtype=torch.float32)
    rotary = lm.model.model.rotary_emb
    with torch.no_grad():
        cos, sin = rotary(probe, positions) if kind is None else rotary(probe, positions, layer_type=kind)
    if cos.shape[-1] * 2 == lm.head_dim:
        # GPT-OSS's tables hold each frequency once and rotate the halves (x1, x2) by them: the
        # rotate-half layout with the tables repeated for both halves.
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos[0].float(), sin[0].float()


def row_cos_sin(lm: LoadedModel, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for queries stacked layer-major (row ``layer * H + head``, BeaconKV's rows).

    positions [n] -> cos, sin: [n, d] when every layer rotates alike (they
    broadcast over the rows), else [L * H, n, d], each layer's tables for its H rows.
    """
    if len({g.rope_type for g in lm.geometry}) == 1:
        return rope_cos_sin(lm, positions)
    tables = {g.rope_type: None for g in lm.geometry}
    for layer, g in enumerate(lm.geometry):
        if tables[g.rope_type] is None:
            tables[g.rope_type] = rope_cos_sin(lm, positions, layer)
    cos = torch.stack([tables[g.rope_type][0] for g in lm.geometry]).repeat_interleave(lm.n_heads, dim=0)
    sin = torch.stack([tables[g.rope_type][1] for g in lm.geometry]).repeat_interleave(lm.n_heads, dim=0)
    return cos, sin


def rotation_tables(lm: LoadedModel, layer: int, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, d] float32 that turn a post-RoPE key by ``delta`` [n] positions in ``layer``'s RoPE.

    RoPE rotates by an angle proportional to the position, so a key at p is
    moved to p + delta by the rotation of position delta. The model's tables
    carry its attention scaling s (YaRN's factor: cos^2 + sin^2 = s^2); it is
    divided out, so the key is turned, not scaled again. Tables are made once
    per distinct delta.
    """
    steps, where = torch.unique(delta, return_inverse=True)
    cos, sin = rope_cos_sin(lm, steps, layer)
    scale = torch.sqrt(cos * cos + sin * sin)
    where = where.to(cos.device)
    return (cos / scale)[where], (sin / scale)[where]


def turn_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """keys [..., n, d] turned by :func:`rotation_tables`' cos, sin [n, d] (or broadcastable), in
    float32, returned in the keys' dtype."""
    return rotate(keys.float(), cos, sin).to(keys.dtype)
