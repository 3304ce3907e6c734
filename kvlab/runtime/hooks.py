"""kvlab's attention function, registered with transformers.

It replaces the model's attention so that a stored cache can carry one
additive bias per key, have a different length in every layer and head, and
so that post-RoPE queries can be recorded. Everything it needs arrives in one
keyword argument, ``kvlab=ForwardContext(...)``, that transformers forwards
from ``model(...)`` down to the attention call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel

from kvlab.runtime.attention import causal_attention

ATTENTION_NAME = "kvlab"


@dataclass
class QueryCapture:
    """Post-RoPE queries seen by the first ``n_layers`` layers during some forward passes.

    ``chunks[layer]`` is a list of [H, q, d] tensors in call order, kept on
    the model's device (they meet its keys in every use) in the model's
    dtype: a float32 copy of a bf16 model's queries would be four times its
    KV cache (GQA 4:1). Every use casts to float32 inside the maths
    (kvlab.runtime.attention.attention_logits).
    """

    n_layers: int
    chunks: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    #: Layers whose queries nobody reads (a reference pass's sliding-window layers): each keeps an empty
    #: [H, 0, d], since a long document's queries there would be most of the pass's memory (15 of Gemma 3's 18 layers).
    skip: frozenset[int] = frozenset()

    def record(self, layer: int, query: torch.Tensor) -> None:
        if layer >= self.n_layers:
            return
        if layer in self.skip:
            if layer not in self.chunks:  # a copy: an empty view would keep the whole query alive
                self.chunks[layer] = [query[0, :, :0].detach().clone()]
            return
        # RoPE made ``query`` afresh: the view holds exactly these queries, nothing more.
        self.chunks.setdefault(layer, []).append(query[0].detach())

    def layer(self, layer: int) -> torch.Tensor:
        """All queries recorded for ``layer``: [H, n, d]."""
        return torch.cat(self.chunks[layer], dim=1)

    def per_layer(self) -> list[torch.Tensor]:
        return [self.layer(i) for i in range(self.n_layers)]

    def attended(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What ``layer``'s attention reads, called once the layer's queries are recorded: keys/values
        [1, H_kv, kv, d] (the cache's, the pass's own last) and the bias of the first cached keys
        ([H_kv, L] or None), unchanged here. A capture that compacts the layer it has just read
        (kvlab.methods.families.compaction's on-policy sweep) returns the compacted keys instead."""
        return keys, values, bias


@dataclass
class ForwardContext:
    """What one forward pass needs beyond the usual arguments.

    key_bias: per layer, [H_kv, L] additive bias for the first L cached keys
    (padding = -inf), or None for a plain cache. capture: where to record
    queries, or None.
    """

    key_bias: list[torch.Tensor | None] | None = None
    capture: QueryCapture | None = None


def kvlab_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, q, d], key/value [1, H_kv, kv, d] -> ([1, q, H, d], None).

    The causal mask is built here, per layer, from the physical key length;
    transformers' own mask is sized from layer 0 and would be wrong for
    caches whose layers differ in length. ``scaling`` is the model's own
    (Gemma's query_pre_attn_scalar included), and so is ``sliding_window``,
    the window the layer passes (None on full layers): kvlab's mask applies
    it, and so are GPT-OSS's learned attention sinks (``s_aux``, one logit
    per head). ``attention_mask`` and ``softcap`` are not used: a model that
    caps its logits is refused at load time (kvlab.runtime.model.check_supported).
    """
    ctx: ForwardContext | None = kwargs.get("kvlab")
    layer = module.layer_idx
    bias = None
    if ctx is not None:
        if ctx.key_bias is not None:
            bias = ctx.key_bias[layer]
        if ctx.capture is not None:
            ctx.capture.record(layer, query)
            key, value, bias = ctx.capture.attended(layer, key, value, bias)
    out = causal_attention(query, key, value, bias, scaling, kwargs.get("sliding_window"), kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``model.set_attn_implementation("kvlab")`` available (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvlab_attention)


def use_kvlab_attention(model: PreTrainedModel) -> None:
    """Switch ``model``'s attention to kvlab's function (registered first; idempotent)."""
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
