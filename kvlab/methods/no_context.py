"""No context: the floor. The document is dropped; only the chat template's prefix stays.

The stored cache is exactly what prefilling the prefix alone gives (its keys
never saw the document: attention is causal), and its logical length is the
prefix's, so the question follows the prefix directly, as if no document
had been given. The ratio is ignored: whatever is asked, the document costs
0 bytes and the prefix's bytes are counted.
"""

from __future__ import annotations

from kvlab.compression.interface import Method
from kvlab.compression.paper import Baseline
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.runtime.cache import CompressedKV, template_segment


@register
class NoContext(Method):
    name = "no_context"
    summary = "the floor: the document is dropped, only the template prefix is kept (ignores the ratio)"
    paper = Baseline("the model answers without the document")
    family = "baselines"
    bf16_tolerance = "same_tokens"
    # Keeps a fixed amount whatever the ratio: the budget tests do not apply.
    fixed_budget = True

    def compress(self, req: Request) -> CompressedKV:
        ctx, prefix = req.ctx, req.ctx.prefix_len
        layers = [[template_segment(k, v, prefix)] for k, v in zip(ctx.full.keys, ctx.full.values)]
        return CompressedKV(layers, prefix, meta={"method": self.name, "ratio_ignored": True})
