"""Rotary position embedding (RoPE) of query vectors, both ways.

The cache and the recorded queries are post-RoPE: each vector is rotated by
its own position. Methods that compare queries across positions (BeaconKV's
beacon queries) need them pre-RoPE, and re-rotate them to a new position
before scoring. These helpers use the model's own rotary embedding
(``model.model.rotary_emb(x, position_ids) -> cos, sin``), so frequencies and
RoPE scaling (Llama 3.1's "llama3", YaRN's attention factor...) match the
model, and the Llama "rotate half" layout (Llama, Mistral, Qwen2, Qwen3,
Gemma 3, SmolLM...): ``rot(q) = q * cos + rotate_half(q) * sin``.
"""
from __future__ import annotations

import inspect

import torch

from kvlab.models import PER_LAYER_ROPE, LoadedModel, ModelLoadError, unsupported_message


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


def rope_cos_sin(lm: LoadedModel, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE tables at ``positions`` [n] -> cos, sin: float32 [n, d] on the model's device.

    A rotary embedding that takes a ``layer_type`` (Gemma 3: one RoPE for its
    sliding layers, one for its global ones) is asked for every layer type the
    model has; the callers use one table for every layer, so the tables must
    agree, or ModelLoadError (kvlab.models.check_supported refuses such a
    model at load time already).
    """
    positions = positions.reshape(1, -1).to(lm.device)
    probe = torch.zeros(1, 1, lm.head_dim, device=lm.device, dtype=torch.float32)
    rotary = lm.model.model.rotary_emb
    kinds: list[str | None] = [None]
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        kinds = sorted(set(lm.model.config.layer_types))
    with torch.no_grad():
        tables = [rotary(probe, positions) if k is None else rotary(probe, positions, layer_type=k) for k in kinds]
    cos, sin = tables[0]
    for kind, (c, s) in zip(kinds[1:], tables[1:]):
        if not (torch.equal(c, cos) and torch.equal(s, sin)):
            feature = f"a different rotary embedding per layer type ({kinds[0]} and {kind} differ)"
            raise ModelLoadError(unsupported_message(lm.name, [(feature, PER_LAYER_ROPE)]))
    return cos[0].float(), sin[0].float()
