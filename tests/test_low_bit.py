"""Tests for kvlab.runtime.low_bit (KIVI-style packed quantisation)."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.runtime.low_bit import PackedTensor, pack_codes, quantize_keys, quantize_values, unpack_codes


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _per_element_scale(p: PackedTensor) -> torch.Tensor:
    """Stored group scale broadcast to every element, in the original [H, T, d] layout."""
    length = p.shape[-2] if p.axis == "channel" else p.shape[-1]
    s = p.scale.float().repeat_interleave(p.group_size, dim=-1)[..., :length]
    return s.transpose(-1, -2) if p.axis == "channel" else s


# --- packing -----------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 8, 9, 1001])
def test_pack_unpack_exact_inverse(bits: int, count: int) -> None:
    codes = torch.randint(0, 1 << bits, (count,), generator=_gen(count), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(count * bits / 8)
    assert torch.equal(unpack_codes(packed, bits, count), codes)


def test_pack_multidim_flattens_row_major() -> None:
    codes = torch.randint(0, 4, (3, 5, 7), generator=_gen(1), dtype=torch.uint8)
    packed = pack_codes(codes, 2)
    assert torch.equal(unpack_codes(packed, 2, codes.numel()).view(3, 5, 7), codes)


def test_pack_layout_low_bits_first() -> None:
    codes = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    assert pack_codes(codes, 2).tolist() == [1 | (2 << 2) | (3 << 4)]
    assert pack_codes(torch.tensor([0xA, 0x5], dtype=torch.uint8), 4).tolist() == [0x5A]


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        pack_codes(torch.tensor([4], dtype=torch.uint8), 2)
    with pytest.raises(ValueError):
        pack_codes(torch.tensor([1], dtype=torch.uint8), 3)
    with pytest.raises(TypeError):
        pack_codes(torch.tensor([1]), 2)
    with pytest.raises(ValueError):
        unpack_codes(torch.zeros(2, dtype=torch.uint8), 4, 5)


# --- round-trip error ----------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("quant", [quantize_keys, quantize_values])
@pytest.mark.parametrize("shape,group", [((3, 100, 64), 32), ((2, 37, 20), 8), ((1, 5, 16), 32)])
def test_round_trip_error_within_half_scale(bits, quant, shape, group) -> None:
    x = torch.randn(*shape, generator=_gen(bits)) * 3 + 1
    p = quant(x, bits, group)
    assert p.codes.dtype == torch.uint8 and p.scale.dtype == p.zero.dtype == torch.float16
    y = p.dequantize()
    assert y.shape == x.shape and y.dtype == torch.float32
    err = (y - x).abs()
    bound = _per_element_scale(p) / 2 + 1e-5 * (1 + x.abs())
    assert (err <= bound).all(), float((err - bound).max())
    # No element may be silently lost: every token and channel is reconstructed.
    assert torch.isfinite(y).all()


def test_group_layout_and_partial_groups() -> None:
    k = torch.randn(3, 100, 64, generator=_gen(2))
    pk = quantize_keys(k, 4, 32)
    assert pk.axis == "channel" and pk.scale.shape == (3, 64, 4)  # 100 = 3*32 + 4
    pv = quantize_values(k, 4, 32)
    assert pv.axis == "token" and pv.scale.shape == (3, 100, 2)
    # d smaller than group_size: the whole head dim is one group.
    pv_small = quantize_values(torch.randn(2, 10, 16, generator=_gen(3)), 2, 128)
    assert pv_small.scale.shape == (2, 10, 1)


def test_partial_key_group_uses_its_own_range() -> None:
    # Tokens 0..31 are huge, the 4 trailing tokens small; the partial group must
    # get its own (small) scale rather than inherit one or be dropped.
    k = torch.randn(1, 36, 4, generator=_gen(4))
    k[:, :32] *= 1000
    p = quantize_keys(k, 4, 32)
    assert float(p.scale[..., 1].float().max()) < 1.0
    assert (p.dequantize()[:, 32:] - k[:, 32:]).abs().max() < 0.5


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("quant", [quantize_keys, quantize_values])
@pytest.mark.parametrize("value", [0.0, 1.5, -3.25, 7.0])
def test_constant_tensor_round_trips_exactly(bits, quant, value) -> None:
    x = torch.full((2, 33, 16), value)
    p = quant(x, bits, 8)
    assert torch.equal(p.scale, torch.zeros_like(p.scale))
    assert torch.equal(p.dequantize(), x)


def test_constant_groups_inside_varying_tensor() -> None:
    x = torch.randn(2, 64, 8, generator=_gen(5))
    x[:, :32, 3] = 2.5  # one constant key group (channel 3, first token block)
    p = quantize_keys(x, 2, 32)
    assert torch.equal(p.dequantize()[:, :32, 3], x[:, :32, 3])


def test_dequantize_dtype() -> None:
    x = torch.randn(2, 8, 8, generator=_gen(6))
    assert quantize_values(x, 4, 8).dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert quantize_keys(x.to(torch.bfloat16), 4, 8).dequantize().shape == x.shape


# --- honest bytes --------------------------------------------------------------


def test_nbytes_hand_computed() -> None:
    x = torch.randn(3, 100, 64, generator=_gen(7))  # H, T, d
    # 4 bits: 2 codes per byte, 3 * 100 * 64 / 2 = 9,600 B. A float16 scale and zero per group, 4 B.
    pk = quantize_keys(x, 4, 32)
    # Keys per channel, groups along the tokens: 3 * 64 * ceil(100 / 32) = 768 groups = 3,072 B.
    assert pk.codes.numel() == 9600 and pk.scale.numel() == pk.zero.numel() == 768
    assert pk.nbytes == 9600 + 3072
    pv = quantize_values(x, 4, 32)
    # Values per token, groups along the channels: 3 * 100 * 2 = 600 groups = 2,400 B.
    assert pv.codes.numel() == 9600 and pv.scale.numel() == pv.zero.numel() == 600
    assert pv.nbytes == 9600 + 2400


def test_nbytes_odd_count_rounds_up() -> None:
    x = torch.randn(1, 3, 5, generator=_gen(8))  # 15 codes
    p = quantize_values(x, 2, 32)
    assert p.codes.numel() == 4  # ceil(15 * 2 / 8)
    assert p.nbytes == 4 + 3 * 2 * 2


@pytest.mark.parametrize("bits,ratio", [(4, 1 / 8), (2, 1 / 16), (8, 1 / 4)])
def test_compression_ratio_vs_fp32(bits: int, ratio: float) -> None:
    H, T, d, g = 4, 512, 128, 128
    x = torch.randn(H, T, d, generator=_gen(9))
    fp32 = x.numel() * 4
    # Overhead: two fp16 numbers per group of 128 -> 4 / (128 * 4) of fp32.
    overhead = 4 / (g * 4)
    for p in (quantize_keys(x, bits, g), quantize_values(x, bits, g)):
        assert p.nbytes / fp32 == pytest.approx(ratio + overhead, rel=1e-9)
        # The reported size is the packed storage, never a float copy.
        assert p.nbytes < p.dequantize(torch.float16).numel() * 2


def test_packed_tensor_stores_no_float_copy() -> None:
    x = torch.randn(2, 64, 32, generator=_gen(10))
    p = quantize_keys(x, 2, 32)
    assert p.codes.dtype == torch.uint8
    # By hand: 2 * 64 * 32 codes of 2 bits = 1,024 B; 2 * 32 channels * 2 token groups = 128 groups,
    # a float16 scale and zero each = 512 B. Every tensor the object holds is one of those.
    assert p.codes.numel() == 1024 and p.nbytes == 1024 + 512
    tensors = [v for v in vars(p).values() if isinstance(v, torch.Tensor)]
    assert sum(t.numel() * t.element_size() for t in tensors) == 1024 + 512


# --- outlier isolation (why keys per channel, values per token) ---------------


def test_key_outlier_channel_does_not_hurt_other_channels() -> None:
    k = torch.randn(2, 64, 16, generator=_gen(11))
    spiky = k.clone()
    spiky[..., 5] = 200 * torch.randn(2, 64, generator=_gen(12))  # KIVI-style outlier channel
    others = [c for c in range(16) if c != 5]
    base = quantize_keys(k, 2, 32).dequantize()[..., others]
    with_outlier = quantize_keys(spiky, 2, 32).dequantize()[..., others]
    # Per-channel groups are independent: the other channels decode identically.
    assert torch.equal(base, with_outlier)
    # Per-token grouping of the same keys would smear the outlier's range.
    per_token_err = (quantize_values(spiky, 2, 32).dequantize()[..., others] - k[..., others]).abs().mean()
    per_channel_err = (with_outlier - k[..., others]).abs().mean()
    assert per_channel_err * 3 < per_token_err


def test_value_outlier_token_does_not_hurt_other_tokens() -> None:
    v = torch.randn(2, 64, 16, generator=_gen(13))
    spiky = v.clone()
    spiky[:, 7] = 200 * torch.randn(2, 16, generator=_gen(14))  # one outlier token
    others = [t for t in range(64) if t != 7]
    base = quantize_values(v, 2, 32).dequantize()[:, others]
    with_outlier = quantize_values(spiky, 2, 32).dequantize()[:, others]
    assert torch.equal(base, with_outlier)
    per_channel_err = (quantize_keys(spiky, 2, 32).dequantize()[:, others] - v[:, others]).abs().mean()
    per_token_err = (with_outlier - v[:, others]).abs().mean()
    assert per_token_err * 3 < per_channel_err


def test_rejects_bad_arguments() -> None:
    x = torch.randn(2, 8, 8)
    with pytest.raises(ValueError):
        quantize_keys(x, 3, 8)
    with pytest.raises(ValueError):
        quantize_values(x, 4, 0)
    with pytest.raises(ValueError):
        quantize_keys(torch.randn(8), 4, 8)
    bad = x.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        quantize_values(bad, 4, 8)
