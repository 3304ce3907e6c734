"""No context: the floor. The document is dropped; only the chat template's prefix stays.

The stored cache is exactly what prefilling the prefix alone gives (its keys
never saw the document: attention is causal), and its logical length is the
prefix's, so the question follows the prefix directly, as if no document
had been given. The ratio is ignored: whatever is asked, the document costs
0 bytes and the prefix's bytes are counted.
"""
from __future__ import annotations

import torch

from kvlab.methods.base import Method, Request, register
from kvlab.runtime.cache import CompressedKV, DenseSegment


@register
class NoContext(Method):
    name = "no_context"
    summary = "the floor: the document is dropped, only the template prefix is kept (ignores the ratio)"
    paper = "a baseline: the model answers without the document"
    # Keeps a fixed amount whatever the ratio: the budget tests do not apply.
    fixed_budget = True

    def compress(self, req: Request) -> CompressedKV:
        ctx, prefix = req.ctx, req.ctx.prefix_len
        layers = []
        for keys, values in zip(ctx.full.keys, ctx.full.values):
            n_heads = keys.shape[0]
            index = torch.arange(prefix).expand(n_heads, prefix)
            layers.append([DenseSegment.from_padded(
                keys[:, :prefix], values[:, :prefix], torch.full((n_heads,), prefix), index, fate="template"
            )])
        return CompressedKV(layers, prefix, meta={"method": self.name, "ratio_ignored": True})
