"""Torch references for the Triton kernels: the CPU path, and what the kernels are tested against.

Each function computes exactly what its kernel computes, through kvlab's one
attention maths (:mod:`kvlab.runtime.attention`), in float32, with the
kernel's shapes:

* decode attention: q [B, H, n, d], k/v [B, H_kv, S, d], bias float32
  [B or 1, H_kv, L] for the first L <= S keys (later keys: bias 0), the
  queries being the last n of the S tokens when ``causal``;
* mixed-precision attention: the same over KIVI-packed keys/values
  (:class:`~kvlab.runtime.low_bit.PackedTensor`, [H_kv, T, d]) followed by
  full-precision keys, batch folded into heads;
* key scores: HighestAttnKeys scores of ``n`` queries over ``T`` keys,
  reduced per key, computed in key chunks so that the n-by-T matrix is
  never whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.runtime.attention import attend, attention_logits
from kvlab.runtime.low_bit import PackedTensor

# Keys per chunk of the chunked key scores: n x 1024 float32 logits at a time.
SCORE_CHUNK = 1024


def full_bias(bias: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """[B?, H_kv, L] bias of the first L keys -> float32 [..., S] (bias 0 for the later keys)."""
    if bias is None:
        return None
    return F.pad(bias.float(), (0, seq_len - bias.shape[-1]))


def eager_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, H, n, d] in q.dtype, lse [B, H, n] float32); see the module docstring.

    One :func:`attend` call per query token (n is a handful), each over the
    keys that token may see, with the GQA group as a broadcast dim.
    """
    batch, n_heads, n, d = q.shape
    n_kv, seq_len = k.shape[1], k.shape[2]
    grouped = q.reshape(batch, n_kv, n_heads // n_kv, n, d)
    keys, values = k.unsqueeze(2), v.unsqueeze(2)  # [B, H_kv, 1, S, d]: shared by the group
    b = full_bias(bias, seq_len)
    b = None if b is None else b.expand(batch, n_kv, seq_len).unsqueeze(2)
    outs, lses = [], []
    for i in range(n):
        seen = seq_len - n + i + 1 if causal else seq_len
        part = attend(
            grouped[..., i : i + 1, :],
            keys[..., :seen, :],
            values[..., :seen, :],
            None if b is None else b[..., :seen],
            scale,
        )
        outs.append(part.output)
        lses.append(part.lse)
    out = torch.cat(outs, dim=-2).reshape(batch, n_heads, n, -1)
    lse = torch.cat(lses, dim=-1).reshape(batch, n_heads, n)
    return out.to(q.dtype), lse


def mixed_attention(
    q: torch.Tensor,
    keys: PackedTensor,
    values: PackedTensor,
    k_full: torch.Tensor,
    v_full: torch.Tensor,
    bias_full: torch.Tensor | None,
    scale: float,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantise, then attend: q [H, n, d], packed [H_kv, T, d], full k/v [H_kv, S, d].

    bias_full: float32 [H_kv, L <= S] for the first full-precision keys, or
    None. The quantised tokens come first (bias 0); the queries are the last
    n full-precision tokens when ``causal``. -> (out [H, n, d], lse [H, n]).
    The dequantised keys are rounded to q's dtype first, as the kernel does
    and as :meth:`QuantSegment.view` does for the model.
    """
    k_q, v_q = keys.dequantize(q.dtype), values.dequantize(q.dtype)
    k = torch.cat([k_q, k_full.to(q.dtype)], dim=1)
    v = torch.cat([v_q, v_full.to(q.dtype)], dim=1)
    bias = None
    if bias_full is not None:
        bias = torch.cat([bias_full.new_zeros(k_q.shape[:2]).float(), bias_full.float()], dim=1)
    out, lse = eager_decode_attention(q[None], k[None], v[None], None if bias is None else bias[None], scale, causal)
    return out[0], lse[0]


def key_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    scoring: str = "rms",
    chunk: int = SCORE_CHUNK,
) -> torch.Tensor:
    """HighestAttnKeys scores [B, T] float32 of q [B, n, d] over k [B, T, d], bias [B, T] or None.

    ``a_ij = exp(s_ij - lse_i)``; rms = sqrt(mean_i a_ij^2), mean = mean_i
    a_ij, max = max_i a_ij; keys with bias -inf score -inf. Two passes over
    key chunks (row log-sum-exps, then per-key reductions), as the kernel
    does; :func:`kvlab.compression.solvers.scores.score_keys` is the unchunked original.
    """
    if scoring not in ("rms", "mean", "max"):
        raise ValueError(f"scoring must be 'rms', 'mean' or 'max', got {scoring!r}")
    seq_len, n = k.shape[1], q.shape[1]
    spans = [(s, min(s + chunk, seq_len)) for s in range(0, seq_len, chunk)]

    def logits(a: int, e: int) -> torch.Tensor:
        return attention_logits(q, k[:, a:e], None if bias is None else bias[:, a:e], scale)

    lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
    for a, e in spans:
        lse = torch.logaddexp(lse, torch.logsumexp(logits(a, e), dim=-1))
    # A query that sees only padding has lse -inf: shift by 0 so its weights are 0, not NaN.
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1)
    parts = []
    for a, e in spans:
        weights = torch.exp(logits(a, e) - shift)  # [B, n, e - a]
        if scoring == "mean":
            parts.append(weights.sum(dim=1) / n)
        elif scoring == "rms":
            parts.append((weights.square().sum(dim=1) / n).sqrt())
        else:
            parts.append(weights.amax(dim=1))
    scores = torch.cat(parts, dim=1) if parts else q.new_zeros(q.shape[0], 0, dtype=torch.float32)
    if bias is not None:
        scores = scores.masked_fill(~torch.isfinite(bias), float("-inf"))
    return scores
