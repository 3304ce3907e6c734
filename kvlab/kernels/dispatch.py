"""The three kernels' dispatch: the Triton kernel on CUDA tensors, the torch reference elsewhere.

See :mod:`kvlab.kernels` for the kernels and ``KVLAB_KERNELS``. The backend choice and the decode
kernel's launch are the runtime's (:mod:`kvlab.runtime.kernel_launch`: its forward pass launches
that kernel); this package sits above the runtime, whose attention maths its references are built on.
"""

from __future__ import annotations

import torch

from kvlab.runtime import kernel_launch as launch
from kvlab.runtime.kernel_launch import KernelAttention, backend, check_heads, decode_inputs, unit_stride
from kvlab.runtime.low_bit import PackedTensor


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
) -> KernelAttention:
    """New queries over a (compacted) cache.

    q [B, H, n, d]; k/v [B, H_kv, S, d]; bias [H_kv, L] or [B or 1, H_kv, L]
    (L <= S) for the first L keys, -inf = absent key, later keys bias 0; kept
    in float32 whatever q's dtype. With ``causal`` the queries are the last n
    of the S tokens. ``scale`` defaults to 1/sqrt(d).
    """
    if backend(q) == "torch":
        from kvlab.kernels import reference

        bias, scale = decode_inputs(q, k, v, bias, scale)
        return KernelAttention(*reference.eager_decode_attention(q, k, v, bias, scale, causal))
    return launch.launch_decode_attention(q, k, v, bias, scale, causal)


def check_packed(keys: PackedTensor, values: PackedTensor) -> None:
    """One clear message when a pair of PackedTensors is not KIVI keys + values of one block."""
    if keys.axis != "channel" or values.axis != "token":
        raise ValueError("mixed attention needs per-channel keys and per-token values (KIVI layout)")
    if tuple(keys.shape) != tuple(values.shape) or len(keys.shape) != 3:
        raise ValueError(f"packed keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be [H_kv, T, d]")
    if (keys.bits, keys.group_size) != (values.bits, values.group_size) or keys.bits not in (2, 4, 8):
        raise ValueError("packed keys and values must share bits (2, 4 or 8) and group size")


def mixed_attention(
    q: torch.Tensor,
    keys: PackedTensor,
    values: PackedTensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    bias_full: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
) -> KernelAttention:
    """New queries over KIVI-packed tokens followed by full-precision ones.

    q [H, n, d]; keys/values: PackedTensor [H_kv, T, d] from
    :func:`~kvlab.runtime.low_bit.quantize_keys` / ``quantize_values`` (fold a
    batch into the heads); k_full/v_full [H_kv, S, d] (S may be 0);
    bias_full float32 [H_kv, L <= S] or None. With ``causal`` the queries are
    the last n full-precision tokens.
    """
    check_packed(keys, values)
    check_heads(q.shape[0], keys.shape[0])
    if k_full.shape != v_full.shape or k_full.shape[0] != keys.shape[0] or q.shape[-1] != keys.shape[-1]:
        raise ValueError(f"full-precision k/v {tuple(k_full.shape)} do not fit packed {tuple(keys.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bias_full = None if bias_full is None else bias_full.float().contiguous()
    if backend(q) == "torch":
        from kvlab.kernels import reference

        return KernelAttention(*reference.mixed_attention(q, keys, values, k_full, v_full, bias_full, scale, causal))
    from kvlab.kernels import triton_mixed as kernel

    k_full, v_full = unit_stride(k_full.to(q.dtype)), unit_stride(v_full.to(q.dtype))
    return KernelAttention(
        *kernel.mixed_attention(unit_stride(q), keys, values, k_full, v_full, bias_full, scale, causal)
    )


def key_scores(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None, scale: float | None = None, scoring: str = "rms"
) -> torch.Tensor:
    """HighestAttnKeys scores [B, T] float32 of q [B, n, d] over k [B, T, d], bias [B, T] or None.

    Same values as :func:`kvlab.compression.solvers.scores.score_keys`, without building
    the [B, n, T] attention matrix.
    """
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[1] == 0:
        raise ValueError(f"key scores need q [B, n>0, d] and k [B, T, d], got {tuple(q.shape)}, {tuple(k.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bias = None if bias is None else bias.float().contiguous()
    if backend(q) == "torch" or k.shape[1] == 0:
        from kvlab.kernels import reference

        return reference.key_scores(q, k, bias, scale, scoring)
    from kvlab.kernels import triton_scores as kernel

    return kernel.key_scores(unit_stride(q), unit_stride(k), bias, scale, scoring)
