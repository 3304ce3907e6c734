"""KIVI-style asymmetric low-bit quantisation of a KV cache, with real packed storage.

KIVI (Liu et al., 2024) quantises keys *per channel* and values *per token*:
key matrices have a few outlier channels whose magnitude is large for every
token, so sharing one range across the channels of a token would spend all
the levels on the outlier; values have no such channel structure and are
consumed per token by the attention-weighted sum, so grouping along channels
keeps each token's error local to that token.

Shapes use ``H`` heads (any leading dims are accepted), ``T`` tokens, ``d``
head dim. A group is ``group_size`` consecutive elements along the grouped
axis (tokens for keys, channels for values); a trailing partial group is a
group of its own, so no element is ever dropped.

Memory honesty: a :class:`PackedTensor` holds only the packed integer codes
(``bits`` per element, several codes per byte) and one float16 scale and
zero per group, and :attr:`PackedTensor.nbytes` counts exactly those
buffers. Dequantised floats are produced on demand and never stored, because
a quantise-dequantise round trip kept in floating point saves nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Axis = Literal["channel", "token"]
SUPPORTED_BITS: tuple[int, ...] = (2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def _codes_per_byte(bits: int) -> int:
    _check_bits(bits)
    return 8 // bits


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes needed to store ``count`` codes of ``bits`` bits each (last byte may be partial)."""
    return math.ceil(count * bits / 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes, ``8 // bits`` per byte.

    codes: uint8 [...] with every value in [0, 2**bits - 1]
    -> uint8 [ceil(codes.numel() * bits / 8)], the codes in flattened
    (row-major) order; code ``j`` of a byte sits in bits ``[j*bits, (j+1)*bits)``
    (first code in the low bits). The tail of the last byte is zero.
    """
    per = _codes_per_byte(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be torch.uint8, got {codes.dtype}")
    flat = codes.reshape(-1)
    # An out-of-range code would silently spill into its neighbour's bits.
    if flat.numel() and int(flat.max()) >= (1 << bits):
        raise ValueError(f"codes exceed {bits}-bit range")
    if per == 1:
        return flat.clone()
    pad = (-flat.numel()) % per
    # int32 so the shifted fields can be summed without uint8 wrap-around;
    # the fields are disjoint, so the sum equals the bitwise OR.
    grouped = F.pad(flat.to(torch.int32), (0, pad)).view(-1, per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Exact inverse of :func:`pack_codes`.

    packed: uint8 [ceil(count * bits / 8)] -> uint8 [count] (flat; reshape as needed).
    """
    per = _codes_per_byte(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be torch.uint8, got {packed.dtype}")
    flat = packed.reshape(-1)
    # A length mismatch means the caller paired the buffer with the wrong
    # count or bit width; decoding it anyway would return garbage silently.
    if flat.numel() != packed_nbytes(count, bits):
        raise ValueError(f"{flat.numel()} bytes cannot hold exactly {count} codes of {bits} bits")
    if per == 1:
        return flat.clone()
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    mask = (1 << bits) - 1
    return ((flat.unsqueeze(-1) >> shifts) & mask).reshape(-1)[:count]


def _fp16_round_down(x: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= x (float32 in, float16 out)."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def _fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= x (float32 in, float16 out)."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def _group_params(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group float16 (scale, zero) for groups along the last dim.

    x: float32 [..., L] -> scale, zero: float16 [..., ceil(L / group_size)].

    The zero is rounded *down* and the scale *up* to float16 so that the
    stored grid [zero, zero + (2**bits - 1) * scale] still covers the whole
    group: codes are then never clamped, and the round-trip error stays
    within scale / 2 of the *stored* scale despite the float16 metadata.
    """
    qmax = (1 << bits) - 1
    pad = (-x.shape[-1]) % group_size
    # Padding with +inf / -inf keeps a partial group's min / max its own.
    lo = F.pad(x, (0, pad), value=math.inf).unflatten(-1, (-1, group_size)).amin(dim=-1)
    hi = F.pad(x, (0, pad), value=-math.inf).unflatten(-1, (-1, group_size)).amax(dim=-1)
    zero = _fp16_round_down(lo)
    scale = _fp16_round_up((hi - zero.float()) / qmax)
    # Beyond float16's range the metadata would be inf and decode to nonsense.
    if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        raise ValueError("group range does not fit float16 scale/zero")
    return scale, zero


def _expand_groups(p: torch.Tensor, group_size: int, length: int) -> torch.Tensor:
    """Per-group values [..., G] -> per-element float32 [..., length]."""
    return p.float().repeat_interleave(group_size, dim=-1)[..., :length]


def _quantize_last_dim(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantisation with groups along the last dim.

    x: [..., L] (any float dtype) -> codes uint8 [..., L] (unpacked),
    scale, zero float16 [..., ceil(L / group_size)].
    """
    _check_bits(bits)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise ValueError("cannot quantise non-finite values")
    scale, zero = _group_params(xf, bits, group_size)
    length = xf.shape[-1]
    s = _expand_groups(scale, group_size, length)
    z = _expand_groups(zero, group_size, length)
    # A constant group has scale 0: every element equals zero's value (when it
    # is float16-exact), so code 0 is exact; dividing by 1 just avoids 0/0.
    q = torch.round((xf - z) / torch.where(s > 0, s, torch.ones_like(s)))
    # The clamp only absorbs float32 rounding at the top of the range.
    codes = q.clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale, zero


@dataclass
class PackedTensor:
    """A quantised tensor as it is really stored.

    codes: uint8 [ceil(N * bits / 8)], the N = prod(shape) integer codes packed
        ``8 // bits`` per byte, in the row-major order of the *grouped layout*
        (the tensor with its grouped axis moved last: [H, d, T] for keys,
        [H, T, d] for values).
    scale, zero: float16 [H, d, ceil(T / group_size)] for ``axis="channel"``
        (keys), [H, T, ceil(d / group_size)] for ``axis="token"`` (values).
        Element value = zero + code * scale.
    shape: the original shape [H, T, d].
    axis: "channel" = per-channel quantisation, groups run along tokens (KIVI
        keys); "token" = per-token quantisation, groups run along channels
        (KIVI values).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    shape: tuple[int, ...]
    bits: int
    group_size: int
    axis: Axis

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: packed codes + float16 scales + float16 zeros."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    def _grouped_shape(self) -> tuple[int, ...]:
        if self.axis == "channel":
            return (*self.shape[:-2], self.shape[-1], self.shape[-2])
        return tuple(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reconstruct the tensor: -> ``dtype`` [*shape] (computed in float32)."""
        grouped = self._grouped_shape()
        codes = unpack_codes(self.codes, self.bits, self.numel).reshape(grouped)
        length = grouped[-1]
        x = _expand_groups(self.zero, self.group_size, length) + codes.float() * _expand_groups(
            self.scale, self.group_size, length
        )
        if self.axis == "channel":
            x = x.transpose(-1, -2)
        return x.to(dtype)


def _check_kv(x: torch.Tensor, name: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{name} must be [..., T, d], got shape {tuple(x.shape)}")


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> PackedTensor:
    """KIVI key quantisation, per channel.

    k: [H, T, d] (any leading dims) -> PackedTensor(axis="channel") with
    scale/zero float16 [H, d, ceil(T / group_size)]: for each head and channel,
    every ``group_size`` consecutive tokens share one min/max range.
    """
    _check_kv(k, "k")
    # Moving tokens last lets one grouping routine serve keys and values.
    codes, scale, zero = _quantize_last_dim(k.transpose(-1, -2), bits, group_size)
    return PackedTensor(
        codes=pack_codes(codes, bits),
        scale=scale,
        zero=zero,
        shape=tuple(k.shape),
        bits=bits,
        group_size=group_size,
        axis="channel",
    )


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> PackedTensor:
    """KIVI value quantisation, per token.

    v: [H, T, d] (any leading dims) -> PackedTensor(axis="token") with
    scale/zero float16 [H, T, ceil(d / group_size)]: for each head and token,
    every ``group_size`` consecutive channels share one range (if d <=
    group_size the whole head dim is one group).
    """
    _check_kv(v, "v")
    codes, scale, zero = _quantize_last_dim(v, bits, group_size)
    return PackedTensor(
        codes=pack_codes(codes, bits),
        scale=scale,
        zero=zero,
        shape=tuple(v.shape),
        bits=bits,
        group_size=group_size,
        axis="token",
    )
