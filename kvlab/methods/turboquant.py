"""vLLM's TurboQuant KV cache (``--kv-cache-dtype turboquant_k8v4``, ``turboquant_4bit_nc``,
``turboquant_k3v4_nc``, ``turboquant_3bit_nc``): keys rotated and rounded to Lloyd-Max codes, values
rounded to min-max uniform codes, per token and KV head.

Sources read (vLLM, github.com/vllm-project/vllm, through the code index, 2026-12-02):

* the presets and the bytes: ``vllm/model_executor/layers/quantization/turboquant/config.py``,
  ``TQ_PRESETS`` and ``TurboQuantConfig`` (commit 1471680b): ``key_quant_bits`` 8 (FP8 keys, no
  rotation), 4 or 3; ``value_quant_bits`` 4 or 3; ``norm_correction``. ``key_packed_size`` =
  ``ceil(d * bits / 8) + 2`` (the codes and the key's float16 norm; ``d`` for FP8 keys),
  ``value_packed_size`` = ``ceil(d * bits / 8) + 4`` (codes, a float16 scale and a float16 zero);
  ``slot_size_aligned`` rounds their sum up to even (no padding when 8 divides d, which kvlab requires).
  An earlier version of the same file (commit a45af330) also stored a float16 residual norm per key.
* the boundary layers: ``TurboQuantConfig.get_boundary_skip_layers(model_config, n=2)``, which
  ``vllm/engine/arg_utils.py`` adds to ``kv_cache_dtype_skip_layers`` for every ``turboquant_``
  dtype: the first and last ``min(n, n_layers // 2)`` layers of a dense model stay in the model's
  own dtype ("auto").
* the rotation: ``vllm/v1/attention/backends/turboquant_attn.py``, ``_build_hadamard`` and
  ``TurboQuantAttentionImpl._ensure_on_device`` (commit 0135d081): one orthonormal Sylvester
  Hadamard matrix H (d a power of two), the same for every layer, ``PiT = Pi = H``. The seeded Haar
  QR matrix of ``quantizer.py``'s ``generate_rotation_matrix`` (commit 4a9f0a66) is an earlier
  version's; ``config.py`` calls the seed "no longer used internally".
* the centroids: ``.../turboquant/centroids.py``, ``solve_lloyd_max`` (commit 06d0369d):
  Lloyd-Max for N(0, 1/d), written out in :func:`lloyd_max_centroids`; the midpoints of the
  float32 centroids are the decision boundaries (``_ensure_on_device``).
* the store: ``vllm/v1/attention/ops/triton_turboquant_store.py`` (commit 0135d081),
  ``triton_turboquant_store`` and ``_tq_fused_store_mse``: ``norm = ||k||``,
  ``y = (k / (norm + 1e-8)) @ H``, code = the number of midpoints ``<= y`` (``y >= mid`` counts),
  the norm stored as float16. FP8 keys (``_tq_fused_store_fp8``): ``k.to(float8e4nv)``, no scale
  (the e4b15 variant of GPUs before compute capability 8.9 is not modelled). Values
  (``_store_quantized_value``): per token and head, ``scale = max((max - min) / (2^b - 1), 1e-8)``,
  ``code = clamp(floor((v - min) / scale + 0.5), 0, 2^b - 1)`` in float32, scale and min stored as
  float16.
* the decode: ``vllm/v1/attention/ops/triton_turboquant_decode.py`` (``_tq_decode_stage1``,
  ``_tq_full_dequant_kv``): key = ``fp16 norm * c`` with ``c`` the codes' centroids, and with norm
  correction ``c / sqrt(||c||^2 + 1e-16)``, rotated back by H; value = ``code * fp16 scale + fp16 min``.

Code layout: code ``j`` of a row occupies bits ``j*b .. j*b + b - 1`` of its little-endian bytes
(vLLM's 4-bit pairs, low nibble first, and its 3-bit groups of 8 codes in 3 bytes). kvlab computes
in float32 with exact division; Triton's ``/`` may differ by an ulp, which only moves a value that
sits on a rounding boundary. The layers' constants (H, the centroids) are not KV-cache bytes (vLLM
keeps them as layer buffers) and are not counted.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvlab.compression.options import MethodError, Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.context import Context
from kvlab.methods.families.engine_format import EngineFormat, check_evict_with, evict_with_knob
from kvlab.runtime.cache import CompressedKV, DenseSegment, PaddedView, Segment, pack_heads
from kvlab.runtime.engine_formats import fp8_decode, fp8_encode, padded_view

#: vLLM's ``--kv-cache-dtype`` values (``TQ_PRESETS``) -> this method's options.
TQ_PRESETS: dict[str, dict] = {
    "turboquant_k8v4": {"key_quant_bits": 8, "value_quant_bits": 4, "norm_correction": False},
    "turboquant_4bit_nc": {"key_quant_bits": 4, "value_quant_bits": 4, "norm_correction": True},
    "turboquant_k3v4_nc": {"key_quant_bits": 3, "value_quant_bits": 4, "norm_correction": True},
    "turboquant_3bit_nc": {"key_quant_bits": 3, "value_quant_bits": 3, "norm_correction": True},
}
FP8_KEY_BITS = 8
NORM_BYTES = 2  # the key's float16 norm
SCALE_ZERO_BYTES = 4  # the value's float16 scale and float16 zero (its minimum)
#: vLLM's guards: the store's ``norm + 1e-8``, the value scale's floor, the decode's ``||c||^2 + 1e-16``.
NORM_EPS, SCALE_FLOOR, CENTROID_EPS = 1e-8, 1e-8, 1e-16


# --- the constants: Lloyd-Max centroids, the Hadamard rotation -----------------------------------


def _trapz(f, a: torch.Tensor, b: torch.Tensor, n: int = 200) -> torch.Tensor:
    """Trapezoidal integrals of ``f`` over each [a_i, b_i] (float64 [k] -> [k]), ``n`` steps each:
    ``centroids.py``'s ``_trapz``, one interval per row."""
    h = (b - a) / n
    steps = torch.arange(n + 1, dtype=torch.float64, device=a.device)
    y = f(a.unsqueeze(1) + steps * h.unsqueeze(1))  # [k, n + 1]
    return (0.5 * (y[:, 0] + y[:, -1]) + y[:, 1:-1].sum(dim=1)) * h


@functools.lru_cache(maxsize=32)
def lloyd_max_centroids(d: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> torch.Tensor:
    """The 2^bits sorted Lloyd-Max centroids of N(0, 1/d), float32 [2^bits] on the CPU, computed as
    vLLM's ``solve_lloyd_max`` (``turboquant/centroids.py``) does: start at the midpoints of 2^bits
    equal cells of [-3.5 sigma, 3.5 sigma]; each round, boundaries at the centroids' midpoints (the
    outer edges at +-10.5 sigma) and each centroid the cell's mean by trapezoidal integrals of 200
    steps; stop when no centroid moved by ``tol`` (keeping the previous round's) or after
    ``max_iter`` rounds. Float64, then float32. Callers move it to their device."""
    n_levels, sigma2 = 2**bits, 1.0 / d
    sigma = math.sqrt(sigma2)

    def pdf(x: torch.Tensor) -> torch.Tensor:
        return (1.0 / math.sqrt(2 * math.pi * sigma2)) * torch.exp(-x * x / (2 * sigma2))

    lo, hi = -3.5 * sigma, 3.5 * sigma
    cells = torch.arange(n_levels, dtype=torch.float64, device="cpu")
    centroids = lo + (hi - lo) * (cells + 0.5) / n_levels
    for _ in range(max_iter):
        boundaries = (centroids[:-1] + centroids[1:]) / 2.0
        edges = torch.cat(
            [
                torch.tensor([lo * 3], dtype=torch.float64, device="cpu"),
                boundaries,
                torch.tensor([hi * 3], dtype=torch.float64, device="cpu"),
            ]
        )
        num = _trapz(lambda x: x * pdf(x), edges[:-1], edges[1:])
        den = _trapz(pdf, edges[:-1], edges[1:])
        new = torch.where(den > 1e-15, num / den, centroids)
        if float((new - centroids).abs().max()) < tol:
            break
        centroids = new
    return centroids.float()


def midpoints(centroids: torch.Tensor) -> torch.Tensor:
    """Sorted float32 centroids [n] -> the [n - 1] decision boundaries (their float32 midpoints)."""
    return (centroids[:-1] + centroids[1:]) / 2


def hadamard(d: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [d, d] float32 (d a power of two): H_1 = [1],
    H_2n = [[H_n, H_n], [H_n, -H_n]], over sqrt(d). Symmetric, so H @ H = I."""
    h = torch.ones((1, 1), dtype=torch.float32, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


# --- codes ---------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: integers [N, d] below 2^bits (bits <= 4, d a multiple of 8) -> uint8 [N, d * bits / 8]:
    code j in bits j*b .. j*b + b - 1 of the row's little-endian bytes (vLLM's layout). Built per
    group of 8 codes (one word of 8 * bits <= 32 bits, then its bytes): int32 transients the size of
    the codes, not a tensor per bit."""
    n, d = codes.shape
    shifts = bits * torch.arange(8, dtype=torch.int32, device=codes.device)
    # int32 wraps past bit 31 for 4-bit groups; the bits stay the same, which is all the bytes read.
    words = (codes.to(torch.int32).view(n, d // 8, 8) << shifts).sum(-1, dtype=torch.int32)  # [N, d / 8]
    byte_shifts = 8 * torch.arange(bits, dtype=torch.int32, device=codes.device)
    return ((words.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).flatten(1)


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """uint8 [N, d * bits / 8] as from :func:`pack_codes` -> int32 codes [N, d]."""
    n = packed.shape[0]
    byte_shifts = 8 * torch.arange(bits, dtype=torch.int32, device=packed.device)
    words = (packed.view(n, d // 8, bits).to(torch.int32) << byte_shifts).sum(-1, dtype=torch.int32)
    shifts = bits * torch.arange(8, dtype=torch.int32, device=packed.device)
    return ((words.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(1)


def encode_keys(keys: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [N, d] (d a power of two) -> (Lloyd-Max codes int32 [N, d], float16 norms [N]):
    ``y = (k / (||k|| + 1e-8)) @ H``, each coordinate's code the number of midpoints <= it."""
    k = keys.float()
    norms = k.norm(dim=1, keepdim=True)
    y = (k / (norms + NORM_EPS)) @ hadamard(k.shape[1], k.device)
    bounds = midpoints(lloyd_max_centroids(k.shape[1], bits).to(k.device))
    return torch.bucketize(y, bounds, right=True, out_int32=True), norms.squeeze(1).half()


def decode_keys(codes: torch.Tensor, norms: torch.Tensor, bits: int, norm_correction: bool) -> torch.Tensor:
    """(codes [N, d], float16 norms [N]) -> float32 keys [N, d]: the centroids, renormalised to
    unit length with norm correction, times the norm, rotated back by H."""
    d = codes.shape[1]
    c = lloyd_max_centroids(d, bits).to(codes.device)[codes]
    if norm_correction:
        c = c / torch.sqrt((c * c).sum(dim=1, keepdim=True) + CENTROID_EPS)
    return (norms.float().unsqueeze(1) * c) @ hadamard(d, codes.device)


def encode_values(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [N, d] -> (codes int32 [N, d], float16 scales [N], float16 zeros [N]): per row min-max
    uniform codes, ``floor((v - min) / scale + 0.5)`` clamped to [0, 2^b - 1], computed with the
    float32 scale and min that are then stored as float16."""
    v, top = values.float(), 2**bits - 1
    low = v.amin(dim=1, keepdim=True)
    scale = (v.amax(dim=1, keepdim=True) - low) / top
    scale = torch.where(scale > SCALE_FLOOR, scale, torch.full_like(scale, SCALE_FLOOR))
    codes = torch.floor((v - low) / scale + 0.5).clamp(0, top).to(torch.int32)
    return codes, scale.squeeze(1).half(), low.squeeze(1).half()


def decode_values(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(codes [N, d], float16 scales [N], float16 zeros [N]) -> float32 values [N, d]."""
    return codes.float() * scales.float().unsqueeze(1) + zeros.float().unsqueeze(1)


# --- bytes and layers ----------------------------------------------------------------------------


def key_packed_size(head_dim: int, key_quant_bits: int) -> int:
    """vLLM's ``key_packed_size``: d bytes for FP8 keys, else ceil(d * bits / 8) codes + a float16 norm."""
    if key_quant_bits == FP8_KEY_BITS:
        return head_dim
    return math.ceil(head_dim * key_quant_bits / 8) + NORM_BYTES


def value_packed_size(head_dim: int, value_quant_bits: int) -> int:
    """vLLM's ``value_packed_size``: ceil(d * bits / 8) codes + a float16 scale and zero."""
    return math.ceil(head_dim * value_quant_bits / 8) + SCALE_ZERO_BYTES


def boundary_layers(n_layers: int, n: int) -> list[int]:
    """vLLM's ``get_boundary_skip_layers`` for a dense model: the first and last ``min(n, n_layers // 2)``."""
    if n <= 0 or n_layers <= 0:
        return []
    n = min(n, n_layers // 2)
    return sorted(set(range(n)) | set(range(n_layers - n, n_layers)))


def document_tokens_by_layer(ctx: Context, ratio: float, layer_bytes: list[int]) -> int:
    """Document tokens every KV head stores so that the cache, template included, takes at most
    full bytes / ratio, one token of one head costing ``layer_bytes[i]`` in layer i (a TurboQuant slot,
    or a key and a value at the model's dtype in a boundary layer; no per-tensor scales)."""
    fits = math.floor(ctx.full.nbytes / ratio / (ctx.lm.n_kv_heads * sum(layer_bytes)))
    n_doc = min(ctx.doc_len, fits - ctx.prefix_len)
    if n_doc < 1:
        raise MethodError(f"ratio {ratio:g} leaves no room for one document token beside the template in this format")
    return n_doc


@dataclass
class TurboQuantSegment:
    """Tokens of every KV head of one layer in TurboQuant (see the module docstring).

    key_codes: uint8 [N, d * kb / 8] packed Lloyd-Max codes, or float8_e4m3fn [N, d] (kb = 8);
    key_norms: float16 [N] (None for FP8 keys); value_codes: uint8 [N, d * vb / 8];
    value_scales/value_zeros: float16 [N]; head_lengths: [H]; token_index: [N];
    dtype: what :meth:`view` dequantises to.
    """

    key_codes: torch.Tensor
    key_norms: torch.Tensor | None
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    value_zeros: torch.Tensor
    head_lengths: torch.Tensor
    token_index: torch.Tensor
    dtype: torch.dtype
    key_bits: int
    value_bits: int
    norm_correction: bool
    fate: str

    @classmethod
    def quantize(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        token_index: torch.Tensor,
        key_bits: int,
        value_bits: int,
        norm_correction: bool,
    ) -> TurboQuantSegment:
        """keys/values [H, L, d] padded per head past ``lengths`` [H]; token_index [H, L]."""
        lengths = lengths.to(keys.device, torch.long)
        k, v = pack_heads(keys, lengths), pack_heads(values, lengths)
        if key_bits == FP8_KEY_BITS:
            key_codes, key_norms = fp8_encode(k, torch.ones((), device=k.device), torch.float8_e4m3fn), None
        else:
            codes, key_norms = encode_keys(k, key_bits)
            key_codes = pack_codes(codes, key_bits)
        value_codes, scales, zeros = encode_values(v, value_bits)
        return cls(
            key_codes,
            key_norms,
            pack_codes(value_codes, value_bits),
            scales,
            zeros,
            head_lengths=lengths,
            token_index=pack_heads(token_index.to(keys.device), lengths),
            dtype=keys.dtype,
            key_bits=key_bits,
            value_bits=value_bits,
            norm_correction=norm_correction,
            # The mean code width of a key and a value element, for the bits strip.
            fate=f"{(key_bits + value_bits + 1) // 2}-bit",
        )

    @property
    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def breakdown(self) -> dict[str, int]:
        if self.key_norms is None:
            keys = {"fp8 keys": self.key_codes.nbytes}
        else:
            keys = {"Lloyd-Max key codes": self.key_codes.nbytes, "key norms (fp16)": self.key_norms.nbytes}
        return {
            **keys,
            "uniform value codes": self.value_codes.nbytes,
            "value scales and zeros (fp16)": self.value_scales.nbytes + self.value_zeros.nbytes,
        }

    def lengths(self) -> torch.Tensor:
        return self.head_lengths

    def view(self) -> PaddedView:
        """Dequantised keys/values for attention (transient: never stored)."""
        d = self.value_codes.shape[1] * 8 // self.value_bits
        if self.key_norms is None:
            keys = fp8_decode(self.key_codes, torch.ones((), device=self.key_codes.device), torch.float32)
        else:
            codes = unpack_codes(self.key_codes, self.key_bits, d)
            keys = decode_keys(codes, self.key_norms, self.key_bits, self.norm_correction)
        values = decode_values(unpack_codes(self.value_codes, self.value_bits, d), self.value_scales, self.value_zeros)
        return padded_view(keys.to(self.dtype), values.to(self.dtype), self.head_lengths, self.token_index)


# --- the method ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurboQuantOptions(Options):
    key_quant_bits: int = knob(
        4,
        "bits per key element: 8 (FP8 e4m3, no rotation), 4 or 3 (Hadamard-rotated "
        "Lloyd-Max codes with a float16 norm)",
        low=3,
        high=8,
    )
    value_quant_bits: int = knob(
        4, "bits per value element (min-max uniform codes with a float16 scale and zero)", low=3, high=4
    )
    norm_correction: bool = knob(
        True, "rescale each key's centroid vector to unit length before the norm and the inverse rotation"
    )
    boundary_skip_layers: int = knob(
        2, "the first and the last this many layers stay in the model's dtype (vLLM's get_boundary_skip_layers)", low=0
    )
    evict_with: str = evict_with_knob()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.key_quant_bits not in (3, 4, FP8_KEY_BITS):
            raise MethodError(f"key_quant_bits must be 3, 4 or 8, got {self.key_quant_bits}")
        check_evict_with(self.evict_with)


@register
class TurboQuant(EngineFormat):
    name = "turboquant"
    summary = (
        "vLLM's TurboQuant KV cache (--kv-cache-dtype turboquant_*): Hadamard-rotated keys in Lloyd-Max codes "
        "or FP8, values in min-max uniform codes, the boundary layers unquantised; the ratio only caps the "
        "memory (evicting the oldest or a scorer's lowest)"
    )
    paper = Paper(
        "Zandieh et al.",
        2025,
        "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate",
        arxiv="2504.19874",
        note="as vLLM ships it (--kv-cache-dtype turboquant_*): a Hadamard rotation, no QJL stage, "
        "uniform values, boundary layers unquantised",
    )
    family = "engine formats"
    bf16_tolerance = "code_flips"  # a rotated coordinate or a value rounded across a code boundary moves a whole step
    Options = TurboQuantOptions
    presets = TQ_PRESETS

    def token_bytes(self, head_dim: int) -> int:
        o = self.options
        return key_packed_size(head_dim, o.key_quant_bits) + value_packed_size(head_dim, o.value_quant_bits)

    def skipped(self, n_layers: int) -> list[int]:
        """The layers kept in the model's dtype."""
        return boundary_layers(n_layers, self.options.boundary_skip_layers)

    def details(self) -> dict:
        settings = {k: getattr(self.options, k) for k in ("key_quant_bits", "value_quant_bits", "norm_correction")}
        preset = next((name for name, values in TQ_PRESETS.items() if values == settings), None)
        return {"format": preset or "turboquant", **settings}

    def fit_tokens(self, ctx: Context, ratio: float) -> int:
        lm, skipped = ctx.lm, set(self.skipped(ctx.lm.n_layers))
        layer_bytes = [
            ctx.full.keys[i].element_size() * 2 * lm.head_dim if i in skipped else self.token_bytes(lm.head_dim)
            for i in range(lm.n_layers)
        ]
        return document_tokens_by_layer(ctx, ratio, layer_bytes)

    def compress(self, req: Request) -> CompressedKV:
        d, o = req.ctx.lm.head_dim, self.options
        if d % 8:
            raise MethodError(f"turboquant packs codes in groups of 8 channels; this model's head dim is {d}")
        if o.key_quant_bits != FP8_KEY_BITS and d & (d - 1):
            raise MethodError(f"turboquant's Hadamard rotation needs a power-of-two head dim; this model's is {d}")
        stored = super().compress(req)
        if req.ratio != 1.0:
            stored.meta["boundary_layers"] = self.skipped(req.ctx.lm.n_layers)
        return stored

    def store(
        self,
        ctx: Context,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        index: torch.Tensor,
    ) -> Segment:
        if layer in self.skipped(ctx.lm.n_layers):
            return DenseSegment.from_padded(keys, values, lengths, index)
        o = self.options
        return TurboQuantSegment.quantize(
            keys, values, lengths, index, o.key_quant_bits, o.value_quant_bits, o.norm_correction
        )
