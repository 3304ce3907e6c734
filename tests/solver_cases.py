"""Random problems shared by the solver tests (tests/test_solvers.py, tests/test_compact_block.py)."""

from __future__ import annotations

import torch


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv(B=3, n=64, T=32, d=16, dv=16, seed=0, q_scale=1.0):
    g = gen(seed)
    q = torch.randn(B, n, d, generator=g) * q_scale
    k = torch.randn(B, T, d, generator=g)
    v = torch.randn(B, T, dv, generator=g)
    return q, k, v


def rel_out_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())


def mass_err(phi_sel: torch.Tensor, w: torch.Tensor, z: torch.Tensor) -> float:
    fit = torch.bmm(phi_sel, w.unsqueeze(-1)).squeeze(-1)
    return float(((fit - z) / z).abs().mean())


def gather_cols(phi: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    B, n, _ = phi.shape
    return phi.gather(2, idx.clamp_min(0).unsqueeze(1).expand(B, n, idx.shape[-1]))
