"""Choosing a backend, and launching the decode kernel: what the dispatch and the model's forward pass share.

The runtime's forward pass wants the Triton decode kernel (:mod:`kvlab.runtime.triton_decode`) on
CUDA; :mod:`kvlab.kernels`, above the runtime, dispatches every kernel to Triton or to its torch
reference, built on :mod:`kvlab.runtime.attention`. This module holds what both need and imports
nothing of kvlab: :func:`backend` (the choice, ``KVLAB_KERNELS``) and :func:`launch_decode_attention`
(the checked Triton launch, for callers that asked :func:`backend` first).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch

Backend = Literal["triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


@dataclass
class KernelAttention:
    """Attention of new queries over a cache.

    output: [..., H, n, d] in the queries' dtype; lse: [..., H, n] float32, the
    log of each query's total attention mass (so results over separate
    caches can be merged exactly).
    """

    output: torch.Tensor
    lse: torch.Tensor


def backend(x: torch.Tensor) -> Backend:
    """Which implementation runs on tensors like ``x``: Triton on CUDA, torch elsewhere (see kvlab.kernels)."""
    mode = os.environ.get("KVLAB_KERNELS", "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"KVLAB_KERNELS must be one of {', '.join(BACKENDS)}, got {mode!r}")
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("KVLAB_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before import)")
        return "triton"
    return "triton" if x.is_cuda and importlib.util.find_spec("triton") is not None else "torch"


def unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last dim: the kernels address the head dim as contiguous; other strides are free."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_heads(n_heads: int, n_kv: int) -> None:
    """One clear message when query heads cannot be grouped over the KV heads."""
    if n_kv == 0 or n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads cannot be grouped over {n_kv} KV heads")


def decode_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float | None
) -> tuple[torch.Tensor | None, float]:
    """Check decode attention's shapes (see :func:`kvlab.kernels.dispatch.decode_attention`);
    -> (bias as float32 [B or 1, H_kv, L] or None, scale)."""
    check_heads(q.shape[1], k.shape[1])
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if bias is not None:
        bias = (bias[None] if bias.dim() == 2 else bias).float().contiguous()
        if bias.shape[-1] > k.shape[2] or bias.shape[1] != k.shape[1]:
            raise ValueError(f"bias {tuple(bias.shape)} does not fit keys {tuple(k.shape)}")
    return bias, scale


def launch_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
) -> KernelAttention:
    """The Triton decode kernel, shapes as :func:`kvlab.kernels.dispatch.decode_attention`, whatever
    :func:`backend` says."""
    bias, scale = decode_inputs(q, k, v, bias, scale)
    from kvlab.runtime import triton_decode as kernel  # triton is imported only when a kernel runs

    return KernelAttention(
        *kernel.triton_decode_attention(unit_stride(q), unit_stride(k), unit_stride(v), bias, scale, causal)
    )
