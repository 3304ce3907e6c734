"""The KV-cache formats serving engines ship, as stored segments: FP8 (vLLM, SGLang), NVFP4 (TensorRT-LLM)
and KVFP4 (SGLang).

Shapes: ``N`` stored tokens of all KV heads, head-major (as
:class:`~kvlab.runtime.cache.DenseSegment` packs them), ``d`` the head dim.

**FP8** (vLLM's ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``): each
element is stored as one float8 byte of ``x / scale``, one float32 scale per
layer for the keys and one for the values (per tensor). vLLM writes the cache
with ``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, fp8_type)``
(``csrc/quantization/fp8/nvidia/quant_utils.cuh``, ``scaled_vec_conversion``
called by ``scaled_convert``): round to nearest even, and a value past the
largest finite one is stored as that value (saturation, no clamp of its own
before the cast). torch's casts round to nearest even too but do not all
saturate (``float8_e5m2`` gives inf), so :func:`fp8_encode` clamps to the
largest finite value first: the same codes as the saturating conversion.

**NVFP4** (TensorRT-LLM's FP4 KV cache): e2m1 values (magnitudes 0, 0.5, 1,
1.5, 2, 3, 4, 6, a sign bit; two per byte), one float8 e4m3 scale per block of
16 consecutive elements along the head dim, and one float32 global scale per
tensor. The recipe is TensorRT-LLM's ``cvt_warp_fp16_to_fp4``
(``cpp/tensorrt_llm/kernels/quantization.cuh``): with the global scale
``g = amax / (6 * 448)``, the block scale is ``s = e4m3(amax_block / (6 g))``
and the elements are rounded (nearest, ties to even, saturating at 6) from
``x / (s g)``; a block whose scale is 0 stores zeros. Dequantised:
``code * s * g``.

**KVFP4** (SGLang's ``--kv-cache-dtype fp4_e2m1``, ``FP4MXBlock16KVQuantizeUtil`` in
``python/sglang/srt/layers/quantization/kvfp4_tensor.py``): MXFP4's microscaling with blocks of 16
elements (the OCP spec says 32). A block's scale is a power of two, stored as its exponent plus 127
in one byte (e8m0): ``e = ceil(log2(max(amax_block / 6, 1e-10)))``. The elements of ``x / 2^e`` get
the e2m1 code that counts the midpoints (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) they reach, so a tie
goes to the larger magnitude, not to the even code. There is no global scale. Dequantised:
``code * 2^e``.

What a segment counts as stored (``nbytes``): the codes and the scales,
nothing else; the token index is bookkeeping for the figures, as for every
segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.runtime.cache import NEG_INF, PaddedView, pack_heads, unpack_heads

#: vLLM's names of its FP8 cache dtypes (``--kv-cache-dtype``) -> torch's dtype.
FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: Bytes of one float32 per-tensor scale (vLLM's k_scale / v_scale, NVFP4's global scales).
SCALE_BYTES = 4
#: NVFP4's block: elements along the head dim that share one e4m3 scale; SGLang's KVFP4 uses the same
#: 16 for its power-of-two scales.
NVFP4_BLOCK = 16
#: The bias of KVFP4's stored exponents (e8m0: 2^(byte - 127)), and its smallest block amax / 6.
E8M0_BIAS, KVFP4_TINY = 127, 1e-10
E2M1_MAX = 6.0
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
#: The e2m1 magnitudes by code (bits 0-2 of a nibble; bit 3 is the sign).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def fp8_encode(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [...] any float dtype; scale: float32, 0-dim -> ``dtype`` codes [...] of x / scale,
    rounded to nearest even and saturated at the format's largest finite value."""
    top = fp8_max(dtype)
    return (x.float() / scale).clamp(-top, top).to(dtype)


def fp8_decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes: float8 [...]; scale: float32, 0-dim -> ``dtype`` [...] (computed in float32)."""
    return (codes.float() * scale).to(dtype)


def e2m1_encode(y: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """y: float [...] -> uint8 nibbles [...]: the nearest e2m1 value (magnitudes past 6 saturate to
    6); sign in bit 3, magnitude code in bits 0-2. ties: "even" (TensorRT-LLM's round to nearest
    even) or "up" (SGLang's KVFP4: a magnitude on a midpoint takes the larger value)."""
    magnitude = y.float().abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    # The code is the number of midpoints below the magnitude. With ties to even, a magnitude on a
    # midpoint counts it when the code above is even: the midpoints after odd codes (0.75, 1.75, 3.5).
    for i, (low, high) in enumerate(zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:])):
        midpoint = (low + high) / 2
        code += (magnitude >= midpoint) if i % 2 or ties == "up" else (magnitude > midpoint)
    return (torch.signbit(y).to(torch.uint8) << 3) | code


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [...] -> float32 [...] e2m1 values."""
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=nibbles.device)
    value = grid[(nibbles & 7).long()]
    return torch.where((nibbles & 8) > 0, -value, value)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [...] (an even count) -> uint8 [numel / 2], row-major, the first of each pair in
    the low nibble."""
    pairs = nibbles.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n] as from :func:`pack_nibbles` -> float32 [2 n] e2m1 values, through a table of the
    two values of every byte (one gather instead of shifts, masks and a sign per element)."""
    every_byte = torch.arange(256, device=packed.device).to(torch.uint8)
    table = e2m1_decode(torch.stack([every_byte & 15, every_byte >> 4], dim=-1))  # [256, 2]
    return table[packed.long()].flatten()


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """x: [...] -> float32, 0-dim: amax / (6 * 448), so that the largest block scale is e4m3's
    largest value; 1 for an all-zero tensor (any scale stores its zeros)."""
    amax = x.float().abs().amax()
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def nvfp4_encode(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., d] with d a multiple of 16; global_scale: float32, 0-dim
    -> (packed e2m1 codes uint8 [numel / 2] (:func:`pack_nibbles`), block scales float8_e4m3fn
    [..., d / 16])."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a head dim that is a multiple of {NVFP4_BLOCK}, got {x.shape[-1]}")
    blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK))  # [..., d / 16, 16]
    amax = blocks.abs().amax(dim=-1)
    # The clamp only absorbs float32 rounding: a block's amax never exceeds the tensor's.
    block_scale = (amax / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block_scale.float() * global_scale
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = e2m1_encode(blocks * inverse.unsqueeze(-1))
    return pack_nibbles(codes), block_scale


def nvfp4_decode(
    codes: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(packed codes, block scales [..., d / 16], global scale) as from :func:`nvfp4_encode`
    -> ``dtype`` [..., d] (computed in float32)."""
    values = unpack_e2m1(codes).view(*block_scale.shape, NVFP4_BLOCK)
    return (values * (block_scale.float() * global_scale).unsqueeze(-1)).flatten(-2).to(dtype)


def kvfp4_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., d] with d a multiple of 16 -> (packed e2m1 codes uint8 [numel / 2] (:func:`pack_nibbles`),
    block exponents uint8 [..., d / 16], each 127 + e for the block's scale 2^e)."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"KVFP4 needs a head dim that is a multiple of {NVFP4_BLOCK}, got {x.shape[-1]}")
    blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK))  # [..., d / 16, 16]
    exponent = torch.ceil(torch.log2((blocks.abs().amax(dim=-1) / E2M1_MAX).clamp(min=KVFP4_TINY)))
    codes = e2m1_encode(blocks / torch.exp2(exponent).unsqueeze(-1), ties="up")
    return pack_nibbles(codes), (exponent + E8M0_BIAS).to(torch.uint8)


def kvfp4_decode(codes: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(packed codes, block exponents [..., d / 16]) as from :func:`kvfp4_encode` -> ``dtype`` [..., d]
    (computed in float32)."""
    values = unpack_e2m1(codes).view(*exponents.shape, NVFP4_BLOCK)
    return (values * torch.exp2(exponents.float() - E8M0_BIAS).unsqueeze(-1)).flatten(-2).to(dtype)


def fp8_token_bytes(head_dim: int) -> int:
    """Bytes one token of one KV head costs in FP8: a byte per key and per value element."""
    return 2 * head_dim


def fp4_token_bytes(head_dim: int) -> int:
    """Bytes one token of one KV head costs in NVFP4 or KVFP4 (keys and values): half a byte per element and
    one e4m3 scale per block (head dims are whole blocks, so a token's codes fill whole bytes)."""
    return 2 * (head_dim // 2 + head_dim // NVFP4_BLOCK)


def padded_view(
    keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, token_index: torch.Tensor
) -> PaddedView:
    """Head-major [N, d] keys/values -> the attention view, padding masked with bias -inf."""
    bias = torch.zeros(keys.shape[0], dtype=keys.dtype, device=keys.device)
    return PaddedView(
        keys=unpack_heads(keys, lengths, 0.0),
        values=unpack_heads(values, lengths, 0.0),
        bias=unpack_heads(bias, lengths, NEG_INF),
        token_index=unpack_heads(token_index, lengths, -1),
    )


@dataclass
class FP8Segment:
    """Tokens of every KV head of one layer in FP8 with per-tensor scales (see the module docstring).

    keys/values: float8 [N, d] codes, head-major; k_scale/v_scale: float32, 0-dim;
    head_lengths: [H]; token_index: [N]; dtype: what :meth:`view` dequantises to.
    """

    keys: torch.Tensor
    values: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    head_lengths: torch.Tensor
    token_index: torch.Tensor
    dtype: torch.dtype
    fate: str = "8-bit"

    @classmethod
    def quantize(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        token_index: torch.Tensor,
        fp8_dtype: torch.dtype,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> "FP8Segment":
        """keys/values [H, L, d] padded per head past ``lengths`` [H]; token_index [H, L]."""
        lengths = lengths.to(keys.device, torch.long)
        return cls(
            keys=fp8_encode(pack_heads(keys, lengths), k_scale, fp8_dtype),
            values=fp8_encode(pack_heads(values, lengths), v_scale, fp8_dtype),
            k_scale=k_scale.float(),
            v_scale=v_scale.float(),
            head_lengths=lengths,
            token_index=pack_heads(token_index.to(keys.device), lengths),
            dtype=keys.dtype,
        )

    @property
    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        return {
            "fp8 codes": self.keys.nbytes + self.values.nbytes,
            "per-tensor scales": self.k_scale.nbytes + self.v_scale.nbytes,
        }

    def lengths(self) -> torch.Tensor:
        return self.head_lengths

    def view(self) -> PaddedView:
        """Dequantised keys/values for attention (transient: never stored)."""
        keys = fp8_decode(self.keys, self.k_scale, self.dtype)
        values = fp8_decode(self.values, self.v_scale, self.dtype)
        return padded_view(keys, values, self.head_lengths, self.token_index)


@dataclass
class FP4Segment:
    """Tokens of every KV head of one layer in an FP4 format (see the module docstring): NVFP4 or KVFP4.

    key_codes/value_codes: uint8 [N * d / 2] packed e2m1 codes of the head-major [N, d] tensors;
    key_block_scales/value_block_scales: [N, d / 16], float8_e4m3fn (NVFP4) or uint8 exponents (KVFP4);
    k_global/v_global: float32, 0-dim (NVFP4's), None for KVFP4; head_lengths: [H]; token_index: [N];
    dtype: what :meth:`view` dequantises to.
    """

    key_codes: torch.Tensor
    value_codes: torch.Tensor
    key_block_scales: torch.Tensor
    value_block_scales: torch.Tensor
    k_global: torch.Tensor | None
    v_global: torch.Tensor | None
    head_lengths: torch.Tensor
    token_index: torch.Tensor
    dtype: torch.dtype
    fate: str = "4-bit"

    @classmethod
    def quantize(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        token_index: torch.Tensor,
        k_global: torch.Tensor | None = None,
        v_global: torch.Tensor | None = None,
    ) -> "FP4Segment":
        """keys/values [H, L, d] padded per head past ``lengths`` [H]; token_index [H, L]; the global
        scales for NVFP4, None for KVFP4."""
        lengths = lengths.to(keys.device, torch.long)

        def encode(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            packed = pack_heads(x, lengths)
            return kvfp4_encode(packed) if scale is None else nvfp4_encode(packed, scale)

        key_codes, key_scales = encode(keys, k_global)
        value_codes, value_scales = encode(values, v_global)
        return cls(
            key_codes,
            value_codes,
            key_scales,
            value_scales,
            None if k_global is None else k_global.float(),
            None if v_global is None else v_global.float(),
            head_lengths=lengths,
            token_index=pack_heads(token_index.to(keys.device), lengths),
            dtype=keys.dtype,
        )

    @property
    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        scales = self.key_block_scales.nbytes + self.value_block_scales.nbytes
        if self.k_global is None:
            return {"e2m1 codes": self.key_codes.nbytes + self.value_codes.nbytes, "e8m0 block exponents": scales}
        return {
            "e2m1 codes": self.key_codes.nbytes + self.value_codes.nbytes,
            "e4m3 block scales": scales,
            "global scales": self.k_global.nbytes + self.v_global.nbytes,
        }

    def lengths(self) -> torch.Tensor:
        return self.head_lengths

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
        if global_scale is None:
            return kvfp4_decode(codes, scales, self.dtype)
        return nvfp4_decode(codes, scales, global_scale, self.dtype)

    def view(self) -> PaddedView:
        """Dequantised keys/values for attention (transient: never stored)."""
        keys = self._decode(self.key_codes, self.key_block_scales, self.k_global)
        values = self._decode(self.value_codes, self.value_block_scales, self.v_global)
        return padded_view(keys, values, self.head_lengths, self.token_index)


def tokens_that_fit(
    budget_bytes: float, n_layers: int, n_kv_heads: int, token_bytes: int, layer_scales: int = 2
) -> int:
    """Tokens every KV head of every layer can store in a format within ``budget_bytes``, after the
    layers' ``layer_scales`` float32 per-tensor scales (``token_bytes``: one token of one head, keys and values)."""
    room = budget_bytes - n_layers * layer_scales * SCALE_BYTES
    return max(0, math.floor(room / (n_layers * n_kv_heads * token_bytes)))
