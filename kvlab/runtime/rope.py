"""Rotary position embedding (RoPE) of query vectors, both ways.

The cache and the recorded queries are post-RoPE: each vector is rotated by
its own position. Methods that compare queries across positions (BeaconKV's
beacon queries) need them pre-RoPE, and re-rotate them to a new position
before scoring. These helpers use the model's own rotary embedding
(``model.model.rotary_emb(x, position_ids) -> cos, sin``), so frequencies and
RoPE scaling match the model, and the Llama "rotate half" layout (Llama,
Mistral, Qwen, SmolLM...): ``rot(q) = q * cos + rotate_half(q) * sin``.
"""
from __future__ import annotations

import torch

from kvlab.models import LoadedModel


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
    """The model's RoPE tables at ``positions`` [n] -> cos, sin: float32 [n, d] on the CPU."""
    positions = positions.reshape(1, -1).to(lm.device)
    probe = torch.zeros(1, 1, lm.head_dim, device=lm.device, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = lm.model.model.rotary_emb(probe, positions)
    return cos[0].float().cpu(), sin[0].float().cpu()
