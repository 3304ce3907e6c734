"""Cartridges (Eyuboglu et al., 2025, "Cartridges: Lightweight and general-purpose long context
representations via self-study").

Each compressed layer's document block is replaced by a trained cartridge of t = T / ratio keys and
values per KV head (the chat template's prefix stays as it is): initialised with the KV of the
document's first t tokens, then trained by Adam on context distillation, the KL divergence from
the model reading each self-study conversation after the full cache (the teacher) to the model
reading it after the cartridge (the student), the model frozen
(kvlab.methods.families.cartridge_training). The self-study conversations are kvlab's own
(kvlab.queries.self_study), made once per document and kept in the result store.

Training is the expensive part, so a trained cartridge is kept in the result store (kvlab.results),
by the model's identity, the document, the ratio, the knobs, the dtype and the code: a second run,
or a run after a restart, reads it instead of training again.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import torch

from kvlab import cancellation
from kvlab.compression.budget_profiles import uniform
from kvlab.compression.interface import Method
from kvlab.compression.options import Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.context import Context
from kvlab.memo import MISSING
from kvlab.methods.families.cartridge_training import (
    Cartridge,
    Schedule,
    cartridge_cache,
    first_tokens,
    frozen_keys,
    teacher,
    train,
)
from kvlab.queries import self_study
from kvlab.results import RunKey, code_identity, loaded_identity, store, text_digest
from kvlab.runtime.cache import CompressedKV

PAPER = Paper(
    "Eyuboglu et al.",
    2025,
    "Cartridges: Lightweight and general-purpose long context representations via self-study",
    arxiv="2506.06266",
)


@dataclass(frozen=True)
class CartridgesOptions(Options):
    """The published training's optimiser settings are the defaults (Adam at lr 2e-2 on the teacher's top
    20 logits: the public code's examples/arxiv/arxiv_train.py and its benchmarks' training configurations);
    its batch (32 packed sequences of 2,048 tokens) and its steps (an epoch of thousands of self-study
    conversations, about 5 GPU-hours per document) are sized for a data set the lab does not make (a few
    conversations per document), so no preset copies them; ``steps`` is sized for a CPU."""

    steps: int = knob(
        16, "Adam steps (0: no training, the cartridge is the document's first tokens' keys and values)", low=0
    )
    lr: float = knob(0.02, "Adam's learning rate (the published training configurations' lr)", low=0.0)
    batch_size: int = knob(
        1,
        "self-study conversations read per step, drawn in a seeded shuffled order (0: every one; the "
        "published configurations read 32 packed sequences a step)",
        low=0,
    )
    top_k_logits: int = knob(
        20,
        "the teacher's most likely next tokens the loss compares at each position, as the published code "
        "stores them (0: the whole vocabulary)",
        low=0,
    )
    self_study_tokens: int = knob(
        256, "self-study: generated tokens over all prompts (the conversations attention_matching reads too)", low=1
    )
    seed: int = knob(0, "seed of the order the conversations are read in", low=0)


def cartridge_key(ctx: Context, opts: CartridgesOptions, ratio: float) -> RunKey:
    """Where the result store keeps a trained cartridge: by the model's weights, the document, the ratio,
    every knob, the model's dtype (the stored keys are in it) and the code that trained it."""
    return RunKey(
        model=loaded_identity(ctx.lm),
        document=text_digest(ctx.text),
        question="",
        method=Cartridges.name,
        options=json.dumps({**asdict(opts), "dtype": str(ctx.lm.dtype)}, sort_keys=True),
        ratio=ratio,
        max_new_tokens=0,
        code=code_identity(),
    )


@dataclass
class Trained:
    """A trained cartridge as the result store keeps it (CPU tensors: a pickle must load on any device).

    keys/values: per compressed layer [H_kv, t, d] in the model's dtype; losses: each step's training
    loss (mean KL per token, before its update); train_s: seconds the training took; conversations:
    how many self-study conversations it read.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    losses: list[float]
    train_s: float
    conversations: int


def training(req: Request, opts: CartridgesOptions, t: int) -> Trained:
    """Self-study, the teacher's distributions, then the training of a t-key cartridge (progress from
    0.3 to 0.6 of the run, with the time left; each report a cancellation checkpoint)."""
    ctx = req.ctx
    report = cancellation.checked(req.progress)
    report(0.26, "self-study conversations about the document")
    turns = self_study(ctx, opts.self_study_tokens).turns
    report(0.28, f"the full cache's distributions along {len(turns)} conversations")
    targets = [teacher(ctx, ids, opts.top_k_logits) for ids in turns]
    cart = first_tokens(ctx, t)
    schedule = Schedule(opts.steps, opts.lr, opts.batch_size, opts.seed, frozen_keys(ctx))

    def step_done(step: int, steps: int, loss: float, per_step: float) -> None:
        left = per_step * (steps - step)
        report(
            0.3 + 0.3 * step / steps, f"training the cartridge: step {step}/{steps}, loss {loss:.3f}, {left:.0f} s left"
        )

    start = time.perf_counter()
    losses = train(ctx, cart, targets, schedule, step_done)
    seconds = time.perf_counter() - start
    # Leaving the maths for the store: one copy of the cartridge to the CPU, in the model's dtype.
    keep = [x.detach().to("cpu", ctx.lm.dtype, copy=True) for x in cart.parameters()]
    n = len(cart.layers)
    return Trained(keep[:n], keep[n:], losses, seconds, len(targets))


@register
class Cartridges(Method):
    name = "cartridges"
    summary = "a trained KV prefix: the document's first tokens' KV, fitted by self-study distillation (Adam)"
    paper = PAPER
    family = "compaction"
    # The self-study conversations are the model's greedy writing, whose argmaxes on a random model are
    # near ties (the summaries are pinned in tests/test_bf16.py for that reason), and Adam's first steps
    # move every coordinate by about the learning rate whatever the gradient's size: bf16 trains on other
    # text and lands elsewhere, as a selection swaps near-tied tokens. Spread 0.0006-0.022 over the tiny
    # Llama's seeds 0-2 (above same_tokens' bound at seed 1).
    bf16_tolerance = "near_ties"
    Options = CartridgesOptions

    def long_compression(self) -> bool:
        """It trains the cache on self-study conversations."""
        return True

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts, t = req.ctx, self.options, req.doc_budget
        meta = {"method": self.name, "cartridge_tokens": t, **uniform(req).meta()}
        # The initialisation is the cache when nothing is to be trained: no steps; the first T tokens, the
        # whole document, are the teacher itself (at ratio 1 its loss is 0, and Adam would only move it by
        # rounding); a model whose every layer is a sliding window compresses none.
        if opts.steps == 0 or t >= ctx.doc_len or not ctx.lm.compressed_layers:
            return cartridge_cache(ctx, first_tokens(ctx, t), ctx.lm.dtype, {**meta, "trained": "no"})
        key = cartridge_key(ctx, opts, req.ratio)
        kept = store().get(key)
        trained_now = kept is MISSING
        if trained_now:
            kept = training(req, opts, t)
            store().put(key, kept)
        device = ctx.lm.device
        cart = Cartridge(
            ctx.lm.compressed_layers, [k.to(device) for k in kept.keys], [v.to(device) for v in kept.values]
        )
        meta.update(
            trained="now" if trained_now else "stored",
            steps=opts.steps,
            conversations=kept.conversations,
            loss_first=kept.losses[0] if kept.losses else None,
            loss_last=kept.losses[-1] if kept.losses else None,
            train_s=kept.train_s,
        )
        return cartridge_cache(ctx, cart, ctx.lm.dtype, meta)
