"""Cartridges' training (Eyuboglu et al., 2025): a KV prefix of t keys and values per KV head, fitted by
context distillation on self-study conversations about the document, the full cache the teacher.

The student is the model reading a conversation after the cartridge through kvlab's own runtime
(kvlab.runtime.decode's session and forward pass, kvlab.runtime.attention's maths), the cartridge's
keys and values being the only tensors autograd differentiates for: the model's weights are frozen
(the gradient is asked for the cartridge alone, :func:`torch.autograd.grad`). The teacher is the
same model reading the same conversation after the full cache, its next-token distributions computed
once per conversation (:func:`teacher`). kvlab.methods.cartridges is the method built on it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvlab.compression.solvers.learned_keys import trainable
from kvlab.context import Context
from kvlab.runtime.attention import BIAS_BLOCK
from kvlab.runtime.cache import CompressedKV, DenseSegment, Segment, template_segment
from kvlab.runtime.decode import Session, extend, open_session
from kvlab.runtime.lean import LeanItem, LeanModel, lean_forward_many, lean_model
from kvlab.runtime.model import LoadedModel

#: The longest conversation the student reads in one differentiable pass (longer ones are cut, as
#: the published code truncates its packed sequences): up to BIAS_BLOCK queries after a biased cache
#: a layer's attention is one float-masked SDPA call, whose every output autograd follows
#: (:func:`with_biases` says why the other paths would not do).
MAX_TOKENS = BIAS_BLOCK
#: The fate of a cartridge's keys in a stored cache: trained keys, no original token's.
FATE = "cartridge"

#: ``extend``'s body without its ``torch.inference_mode()`` decorator: the one forward path of kvlab
#: (the lean pass or transformers' modules with kvlab's attention), here recorded by autograd.
_extend_recorded: Callable[..., torch.Tensor] = extend.__wrapped__  # type: ignore[attr-defined]


@dataclass
class Teacher:
    """The full cache's next-token distributions along one conversation: the student's target.

    ids: [n] the conversation's tokens, on the model's device; logprobs: [n, k + 1] float32, at each
    position the teacher's log-probabilities of its k most likely next tokens, then of all the others
    as one outcome (the rest of the vocabulary); index: [n, k] those k tokens' ids. index None: the
    whole vocabulary, logprobs [n, V] in vocabulary order.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    index: torch.Tensor | None


def coarse(logp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log-probabilities [n, V] -> [n, k + 1]: those of the tokens ``index`` [n, k], then the log of the
    mass of every other token (-inf when there is none), as one outcome."""
    rest = torch.logsumexp(logp.scatter(-1, index, float("-inf")), dim=-1, keepdim=True)
    return torch.cat([logp.gather(-1, index), rest], dim=-1)


def teacher(ctx: Context, ids: torch.Tensor, top_k: int) -> Teacher:
    """The model's distributions after the full cache along ``ids`` [n] (cut to :data:`MAX_TOKENS`),
    read once without a graph; ``top_k`` 0 keeps the whole vocabulary."""
    lm = ctx.lm
    ids = ids[:MAX_TOKENS].to(lm.device)
    logits = extend(lm, open_session(lm, ctx.full.stored), ids)  # [n, V] float32, an inference tensor
    # Outside inference mode, so that the loss may keep these for its backward pass.
    with torch.inference_mode(False):
        logp = torch.log_softmax(logits, dim=-1)
        if top_k == 0 or top_k >= logp.shape[-1]:
            return Teacher(ids, logp, None)
        index = logp.topk(top_k, dim=-1).indices
        return Teacher(ids, coarse(logp, index), index)


def distillation_kl(target: Teacher, logits: torch.Tensor) -> torch.Tensor:
    """sum_i KL(teacher_i || student_i) over the conversation's positions (a scalar): over the whole
    vocabulary, or over the teacher's top k tokens and the rest of the vocabulary as one outcome (the
    KL of the two distributions so coarsened: never negative, 0 when the student gives those k tokens
    and the rest the teacher's probabilities). The published code's loss, the cross-entropy on the top
    k alone, would reward the student for more mass on them than the teacher gives.

    logits: [n, V] the student's along ``target.ids``.
    """
    student = torch.log_softmax(logits.float(), dim=-1)
    if target.index is not None:
        student = coarse(student, target.index)
    p = target.logprobs.exp()
    # An outcome the teacher gives no mass (a rest that underflowed) adds nothing, whatever the student.
    return torch.where(p > 0, p * (target.logprobs - student), 0.0).sum()


@dataclass
class Cartridge:
    """The trained part of the cache: for each layer of ``layers`` (the model's compressed layers),
    keys and values [H_kv, t, d] on the model's device, float32 while training."""

    layers: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def parameters(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]


def first_tokens(ctx: Context, t: int) -> Cartridge:
    """The paper's best initialisation: the KV of the document's first ``t`` tokens in every compressed
    layer and KV head, keys as stored (RoPE applied at their own positions), as float32 copies (made
    outside inference mode whatever the caller's, so that they may be trained)."""
    start, end = ctx.prefix_len, ctx.prefix_len + t
    layers = ctx.lm.compressed_layers
    with torch.inference_mode(False):
        return Cartridge(
            layers,
            [ctx.full.keys[i][:, start:end].to(torch.float32, copy=True) for i in layers],
            [ctx.full.values[i][:, start:end].to(torch.float32, copy=True) for i in layers],
        )


def cartridge_cache(ctx: Context, cart: Cartridge, dtype: torch.dtype, meta: dict | None = None) -> CompressedKV:
    """The stored cache with ``cart`` in place of every compressed layer's document: the template prefix
    as it is, then the cartridge's t keys per KV head in ``dtype`` (token index -1: they stand for no one
    token); a sliding-window layer as the model keeps it. Its logical length is the full context's, so
    a token read after it gets the position it has with the full cache. Differentiable with respect to
    ``cart``'s tensors (a reshape and a cast)."""
    full = ctx.full.stored
    layers: list[list[Segment]] = [list(layer) for layer in full.layers]
    for i, layer in enumerate(cart.layers):
        keys, values = cart.keys[i], cart.values[i]
        n_heads, t = keys.shape[:2]
        lengths = torch.full((n_heads,), t, dtype=torch.long, device=keys.device)
        index = torch.full((n_heads, t), -1, dtype=torch.long, device=keys.device)
        trained = DenseSegment.from_padded(keys.to(dtype), values.to(dtype), lengths, index, fate=FATE)
        prefix = ctx.prefix_len
        template = [template_segment(ctx.full.keys[layer], ctx.full.values[layer], prefix)] if prefix else []
        layers[layer] = [*template, trained]
    return CompressedKV(layers, full.logical_len, meta=meta or {}, scales=full.scales)


def with_biases(lm: LoadedModel, session: Session) -> None:
    """Give every layer of ``session`` a key bias, zeros where it has none (a zero bias is no bias).

    Why: several tokens read after a plain cache on a CPU go through
    kvlab.runtime.attention._past_then_causal, which merges two kernels by their log-sum-exps, and
    autograd does not differentiate the CPU flash kernel's log-sum-exp: the gradient would silently
    lack the share of attention mass between the cartridge and the conversation. With a bias, up to
    BIAS_BLOCK queries take the float-masked SDPA path on every device, which autograd follows whole.
    """
    layers = session.cache.layers
    biases = session.key_bias or [None] * len(layers)
    session.key_bias = [
        bias if bias is not None else torch.zeros(layer.keys.shape[1], layer.keys.shape[2], device=lm.device)
        for bias, layer in zip(biases, layers)
    ]


def recordable_lean(lm: LoadedModel) -> LeanModel | None:
    """The model's lean view (kvlab.runtime.lean) with weights autograd may keep for its backward pass;
    None for a model the lean pass does not run (transformers' modules then, on the model's own
    parameters). Call outside inference mode.

    The lean view fuses the q/k/v and gate/up weights where it is first built, usually inside a
    decode pass's inference mode: inference tensors, which autograd refuses to save (the model's own
    q/k/v and gate/up weights are views of them). Those are copied here for the training's while
    (normal tensors, the same values); every other weight is shared.
    """
    lean = lean_model(lm.model)
    if lean is None:
        return None
    layers = [
        dataclasses.replace(w, qkv=trainable(w.qkv), qkv_bias=trainable(w.qkv_bias), gate_up=trainable(w.gate_up))
        for w in lean.layers
    ]
    return dataclasses.replace(lean, layers=layers)


@dataclass
class Student:
    """The model reading after a cartridge with autograd recording: ``lean`` its
    :func:`recordable_lean` view (None: transformers' modules)."""

    lm: LoadedModel
    lean: LeanModel | None

    def logits(self, stored: CompressedKV, conversations: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per conversation [n_k] read on its own after ``stored`` (from the position the full cache gives
        the next token), its float32 logits [n_k, V], with autograd's graph back to the stored tensors.
        kvlab's forward pass as kvlab.runtime.decode.extend runs it, without its inference mode; the lean
        pass reads them all in one pass (kvlab.runtime.lean.lean_forward_many: the weights read once, each
        conversation's attention its own)."""
        lm = self.lm
        sessions = [open_session(lm, stored) for _ in conversations]
        for session in sessions:
            with_biases(lm, session)
        if self.lean is None:
            return [_extend_recorded(lm, s, ids) for s, ids in zip(sessions, conversations)]
        items = [
            LeanItem(
                s.cache,
                ids.to(lm.device),
                torch.arange(s.position, s.position + ids.numel(), device=lm.device),
                s.key_bias,
            )
            for s, ids in zip(sessions, conversations)
        ]
        return [out.float() for out in lean_forward_many(self.lean, items)]


@dataclass(frozen=True)
class Schedule:
    """How the cartridge is trained: ``steps`` Adam steps at learning rate ``lr``, each on ``batch``
    conversations (0: all of them) drawn in a ``seed``-shuffled order, epoch after epoch; the first
    ``frozen`` keys and values of every head stay as they were initialised."""

    steps: int
    lr: float
    batch: int
    seed: int
    frozen: int = 0


def frozen_keys(ctx: Context) -> int:
    """How many of the cartridge's first keys stay as initialised. The paper freezes the cartridge's first
    token, the attention sink (the sequence's first token, which takes a large share of attention), for
    stability. kvlab keeps the chat template's prefix as it is, outside the cartridge: with a template,
    the sink is there and every cartridge key trains; without one (a base model's plain layout), the
    document's first token is the sequence's, the cartridge's first key, and it is frozen."""
    return 0 if ctx.prefix_len else 1


def batches(n: int, schedule: Schedule) -> list[list[int]]:
    """Per step, the conversations it reads: a seeded shuffle of 0..n-1, ``batch`` at a time, reshuffled
    each epoch (the published code's shuffled data loader); every one each step when ``batch`` is 0
    or covers them all."""
    size = n if schedule.batch == 0 else min(schedule.batch, n)
    rng = random.Random(schedule.seed)
    order: list[int] = []
    out = []
    for _ in range(schedule.steps):
        if len(order) < size:
            fresh = list(range(n))
            rng.shuffle(fresh)
            order += fresh
        out.append(sorted(order[:size]))
        del order[:size]
    return out


#: report(step, steps, loss, seconds per step): told after each step (the loss before its update).
Report = Callable[[int, int, float, float], None]


def train(ctx: Context, cart: Cartridge, targets: list[Teacher], schedule: Schedule, report: Report) -> list[float]:
    """Train ``cart`` in place by Adam on the mean per-token KL(teacher || student) of each step's
    conversations; returns each step's loss, measured before its update. The cache the student reads is
    made from ``cart`` again at every step (a graph is consumed by its backward pass)."""
    params = cart.parameters()
    with torch.inference_mode(False), torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        optimiser = torch.optim.Adam(params, lr=schedule.lr)
        student = Student(ctx.lm, recordable_lean(ctx.lm))
        losses = []
        start = time.perf_counter()
        for step, chosen in enumerate(batches(len(targets), schedule)):
            read = [targets[k] for k in chosen]
            outs = student.logits(cartridge_cache(ctx, cart, ctx.lm.dtype), [t.ids for t in read])
            tokens = sum(t.ids.numel() for t in read)
            loss = sum(distillation_kl(t, out) for t, out in zip(read, outs)) / tokens
            for p, grad in zip(params, torch.autograd.grad(loss, params)):
                grad[:, : schedule.frozen] = 0  # Adam never moves a coordinate whose gradient is always 0
                p.grad = grad
            optimiser.step()
            losses.append(float(loss.detach()))
            report(step + 1, schedule.steps, losses[-1], (time.perf_counter() - start) / (step + 1))
        for p in params:
            p.requires_grad_(False)
    return losses
