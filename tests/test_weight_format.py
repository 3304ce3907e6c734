"""``benchmarks.weight_format``: each format's kernel computes what its description says.

Every kernel is checked against an eager float32 product with the format's
own rounding applied by hand (weights cast or quantised here, not by the
kernel), so a kernel that silently ran another format would fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.weight_format import FORMATS, GROUP, q4_groups


def _q4_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight that is Q4_1 groups by construction: w = d q + m, q in 0..15 with 0 and 15 in every group."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // GROUP, 1, generator=g) * 0.01 + 0.001
    m = -torch.rand(n, k // GROUP, 1, generator=g) * 0.05
    return (d.half().float() * q + m.half().float()).view(n, k)


def test_q4_groups_recovers_hand_built_groups_and_refuses_other_weights() -> None:
    w = _q4_weight(8, 64)
    q, d, m = q4_groups(w)
    assert q.min() >= 0 and q.max() <= 15
    assert torch.equal(q.view(8, 2, GROUP) * d[..., None] + m[..., None], w.view(8, 2, GROUP))
    with pytest.raises(ValueError):
        q4_groups(torch.randn(8, 64))


def _x(k: int) -> torch.Tensor:
    return torch.randn(1, k, generator=torch.Generator().manual_seed(1))


def test_fp16_keeps_float32_activations_and_rounds_only_the_weights() -> None:
    w, x = torch.randn(96, 64), _x(64)
    y = FORMATS["fp16"].step(w)(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ w.half().float().T, rtol=1e-5, atol=1e-5)
    assert (y - x @ w.T).abs().max() > 0  # it did round: not the float32 product


def test_bf16_rounds_weights_and_activations() -> None:
    w, x = torch.randn(96, 64), _x(64)
    reference = x.bfloat16().float() @ w.bfloat16().float().T
    torch.testing.assert_close(FORMATS["bf16"].step(w)(x), reference, rtol=2e-2, atol=2e-2)


def test_int8_is_per_channel_weights_with_dynamically_quantised_activations() -> None:
    w, x = torch.randn(96, 64), _x(64)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    dequantised = (w / scale).round().clamp(-127, 127) * scale
    y = FORMATS["int8"].step(w)(x)
    # The activations' own 8-bit rounding: at most half a step of x's range per element, times |w|.
    step = (x.max() - x.min()) / 255
    bound = (step / 2 * dequantised.abs().sum(dim=1) + 1e-4).unsqueeze(0)
    assert ((y - x @ dequantised.T).abs() <= bound).all()


def test_int4_reads_the_exact_groups_with_bf16_activations() -> None:
    w, x = _q4_weight(64, 128), _x(128)
    q, d, m = q4_groups(w)
    # The kernel's scales and zeros are bf16: s = d, z = m + 8 d, w' = (q - 8) s + z.
    s, z = d.bfloat16().float(), (m + 8 * d).bfloat16().float()
    grouped = (q.view(64, 4, GROUP) - 8) * s[..., None] + z[..., None]
    reference = x.bfloat16().float() @ grouped.view(64, 128).T
    torch.testing.assert_close(FORMATS["int4"].step(w)(x), reference, rtol=1e-2, atol=1e-2)
    assert not FORMATS["int4"].head  # the embedded model's head is not Q4_1


def test_every_format_leaves_multi_token_passes_in_float32() -> None:
    from benchmarks.weight_format import _Steps

    w = torch.randn(96, 64)
    steps = _Steps({w.data_ptr(): FORMATS["bf16"].step(w)})
    rows = torch.randn(3, 64)
    torch.testing.assert_close(steps.linear(rows, w), F.linear(rows, w), rtol=0, atol=0)
