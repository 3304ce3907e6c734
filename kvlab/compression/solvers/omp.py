"""Orthogonal matching pursuit on the attention mass: Attention Matching's OMP key selection
(Zweiger et al., 2026), the only solver that iterates in Python (over its selection rounds, never
over heads).

Every function is a pure function on tensors, batched over a leading dim ``B`` (the heads
compacted together, e.g. all KV heads of a layer); all maths is float32 whatever the input dtype.
Shapes: ``B`` heads, ``n`` reference queries, ``T`` original keys, ``t`` compact keys, ``d`` key
dim, ``dv`` value dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.compression.solvers.linalg import product
from kvlab.compression.solvers.nnls import box_nnls_gram


@dataclass
class Pursuit:
    """OMP's selection so far, batched over heads, in ``t + 1`` slots: slot ``t`` is a sink, where
    picks a head does not take are scattered, so every head shares one fixed-shape scatter.

    phi: [B, n, T] mass features, z: [B, n] targets (float32); slot_idx: [B, t+1] long key of each
    slot (-1 empty); m_sel: [B, n, t+1] the slots' features; gram: [B, t+1, t+1] their Gram
    ``m_sel^T m_sel``; rhs: [B, t+1] ``m_sel^T z``; w: [B, t+1] the last refit's NNLS weights;
    count: [B] long filled slots (a prefix); taken: [B, T] bool keys selected, banned or padding;
    slots: [t+1] ``arange``; nnls_iters, ridge: the refit's.
    """

    phi: torch.Tensor
    z: torch.Tensor
    slot_idx: torch.Tensor
    m_sel: torch.Tensor
    gram: torch.Tensor
    rhs: torch.Tensor
    w: torch.Tensor
    count: torch.Tensor
    taken: torch.Tensor
    slots: torch.Tensor
    nnls_iters: int
    ridge: float

    @classmethod
    def empty(
        cls, phi: torch.Tensor, z: torch.Tensor, t: int, valid_keys: torch.Tensor, nnls_iters: int, ridge: float
    ) -> Pursuit:
        """No key selected yet; valid_keys: [B, T] bool (False: padding, never selected)."""
        B, n, _ = phi.shape
        dev = phi.device
        return cls(
            phi,
            z,
            torch.full((B, t + 1), -1, dtype=torch.long, device=dev),
            phi.new_zeros(B, n, t + 1),
            phi.new_zeros(B, t + 1, t + 1),
            phi.new_zeros(B, t + 1),
            phi.new_zeros(B, t + 1),
            torch.zeros(B, dtype=torch.long, device=dev),
            ~valid_keys,
            torch.arange(t + 1, device=dev),
            nnls_iters,
            ridge,
        )

    @property
    def t(self) -> int:
        return self.slots.shape[0] - 1

    def append(self, picks: torch.Tensor, take: torch.Tensor) -> None:
        """Add the keys ``picks`` [B, c] where ``take`` [B, c] to the next free slots; the Gram is
        grown by the new columns only (O(n t c))."""
        (B, n, _), t, c = self.phi.shape, self.t, picks.shape[-1]
        pos = torch.where(take, self.count.unsqueeze(-1) + self.slots[:c], torch.full_like(picks, t))
        self.slot_idx.scatter_(1, pos, torch.where(take, picks, torch.full_like(picks, -1)))
        new = self.phi.gather(2, picks.unsqueeze(1).expand(B, n, c)) * take.unsqueeze(1)
        self.m_sel.scatter_(2, pos.unsqueeze(1).expand(B, n, c), new)
        cross = torch.bmm(self.m_sel.transpose(1, 2), new)  # [B, t+1, c], new columns included
        self.gram.scatter_(2, pos.unsqueeze(1).expand(B, t + 1, c), cross)
        self.gram.scatter_(1, pos.unsqueeze(2).expand(B, c, t + 1), cross.transpose(1, 2))
        self.rhs.scatter_(1, pos, torch.bmm(self.z.unsqueeze(1), new).squeeze(1))
        self.taken = self.taken | torch.zeros_like(self.taken).scatter_(1, picks, take)
        self.count = self.count + take.sum(-1)

    def refit(self) -> None:
        """The NNLS weights of the current selection (a t x t Cholesky on the grown Gram)."""
        B, t = self.w.shape[0], self.t
        active = (self.slots[:t] < self.count.unsqueeze(-1)).float()
        out = self.phi.new_zeros(B, t + 1)
        out[:, :t] = box_nnls_gram(
            self.gram[:, :t, :t],
            self.rhs[:, :t],
            active,
            0.0,
            math.inf,
            self.nnls_iters,
            self.ridge,
            self.m_sel[:, :, :t],
            self.z,
        )
        self.w = out

    def correlation(self) -> torch.Tensor:
        """[B, T] each key's correlation ``sum_i phi_ij r_i`` with the residual ``r = z - phi_S w``."""
        r = self.z - product(self.m_sel, self.w.unsqueeze(-1)).squeeze(-1)
        return torch.bmm(r.unsqueeze(1), self.phi).squeeze(1)

    def drop_weak(self, drop_w: float) -> None:
        """Remove the selected keys of weight below ``drop_w`` (their mass is explained by others);
        they stay taken (banned). The kept slots move first, in picking order; the sink stays last."""
        (B, n, _), t, slots = self.phi.shape, self.t, self.slots
        drop = (slots < self.count.unsqueeze(-1)) & (self.w < drop_w)
        drop[:, t] = False
        if not bool(drop.any()):
            return
        keep = (slots < self.count.unsqueeze(-1)) & ~drop
        key = torch.where(keep, slots, slots + t + 1)
        key[:, t] = 3 * (t + 1)
        perm = key.argsort(dim=-1, stable=True)
        self.count = keep.sum(-1)
        live = slots < self.count.unsqueeze(-1)
        self.slot_idx = self.slot_idx.gather(1, perm).masked_fill(~live, -1)
        self.w = self.w.gather(1, perm) * live
        self.rhs = self.rhs.gather(1, perm) * live
        self.m_sel = self.m_sel.gather(2, perm.unsqueeze(1).expand(B, n, t + 1)) * live.unsqueeze(1)
        liveg = live.unsqueeze(-1) & live.unsqueeze(-2)
        gram = self.gram.gather(1, perm.unsqueeze(-1).expand(B, t + 1, t + 1))
        self.gram = gram.gather(2, perm.unsqueeze(1).expand(B, t + 1, t + 1)) * liveg


def omp_select(
    phi: torch.Tensor,
    z: torch.Tensor,
    t: int,
    keys_per_iter: int = 4,
    refit_every: int = 2,
    drop_below: float | None = -7.0,
    key_valid: torch.Tensor | None = None,
    nnls_iters: int = 20,
    ridge: float = 1e-6,
    max_iters: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy key selection that matches the attention mass.

    phi: [B, n, T] mass features, z: [B, n] targets (from :func:`mass_features`),
    key_valid: [B, T] bool or None (False = padding key, never selected).
    Returns ``idx`` [B, t] long in the order picked (-1 where a head has fewer
    than ``t`` real keys) and ``w`` [B, t] >= 0, the NNLS weights of the final
    selection on ``phi`` (0 for -1 slots); ``log w`` is the bias *relative to*
    any bias already inside ``phi``.

    Each round picks, per head, the ``keys_per_iter`` unselected keys with the
    largest correlation ``sum_i phi_ij r_i`` with the residual ``r = z - phi_S w``.
    The residual is only refreshed by a refit (every ``refit_every`` rounds and
    whenever all heads are full), which is what makes the "fast" variant fast.
    At a refit, keys with ``log w < drop_below`` are removed (their mass is
    explained by others) and banned, so each key is picked at most once and
    the loop ends; later rounds refill the freed slots.

    The Gram matrix of the selection is grown by the new columns only
    (O(n t k) per round), so a refit costs a t x t Cholesky and O(n t)
    refinement products instead of re-forming ``phi_S^T phi_S`` (O(n t^2))
    every time. Cost per round is dominated by the O(n T) correlation.
    """
    B, n, T = phi.shape
    if not 0 <= t <= T:
        raise ValueError(f"t={t} must be in [0, T={T}]")
    if keys_per_iter < 1 or refit_every < 1:
        raise ValueError("keys_per_iter and refit_every must be >= 1")
    phi = phi.float()
    valid_keys = (
        torch.ones(B, T, dtype=torch.bool, device=phi.device) if key_valid is None else key_valid.to(phi.device)
    )
    target = valid_keys.sum(-1).clamp(max=t)  # [B]
    # No round picks more than the slots (t) or the keys (T): the picks index ``slots``.
    kpi = max(1, min(keys_per_iter, t, T))
    if max_iters is None:
        # Enough rounds to fill t slots several times over (drops refill);
        # bans make each key pickable once, so this is a safety net only.
        max_iters = 4 * (-(-t // kpi)) + 2 * refit_every + 4
    state = Pursuit.empty(phi, z.float(), t, valid_keys, nnls_iters, ridge)
    drop_w = None if drop_below is None else math.exp(drop_below)
    corr, fresh = pursue(state, target, kpi, max_iters, refit_every, drop_w)
    if fill_short_heads(state, corr, valid_keys, target):
        fresh = False
    if not fresh:
        state.refit()
    return state.slot_idx[:, :t].contiguous(), state.w[:, :t].contiguous()


def pursue(
    state: Pursuit, target: torch.Tensor, kpi: int, max_iters: int, refit_every: int, drop_w: float | None
) -> tuple[torch.Tensor, bool]:
    """OMP's rounds until every head holds its ``target`` [B] keys, none has a candidate left, or
    ``max_iters`` rounds: ``kpi`` picks a round, a refit every ``refit_every`` rounds (and when all
    are full), keys of weight below ``drop_w`` (None: none) dropped at a refit. Returns the last
    correlation [B, T] and whether ``state.w`` belongs to the final selection."""
    slots = state.slots
    corr = state.correlation()
    fresh = True  # w belongs to the current selection
    since_refit = 0
    for _ in range(max_iters):
        need = target - state.count
        if not bool((need > 0).any()):
            break
        vals, picks = corr.masked_fill(state.taken, float("-inf")).topk(kpi, dim=-1)
        take = (slots[:kpi] < need.unsqueeze(-1)) & torch.isfinite(vals)
        if not bool(take.any()):
            break  # every head that still needs keys has run out of candidates
        state.append(picks, take)
        fresh = False
        since_refit += 1
        if since_refit < refit_every and bool((state.count < target).any()):
            continue
        state.refit()
        fresh = True
        since_refit = 0
        if drop_w is not None:
            state.drop_weak(drop_w)
        corr = state.correlation()
    return corr, fresh


def fill_short_heads(state: Pursuit, corr: torch.Tensor, valid_keys: torch.Tensor, target: torch.Tensor) -> bool:
    """Where the rounds ran out (of rounds or of unbanned keys), fill the heads' empty real slots
    with their best remaining real keys by ``corr`` [B, T] (banned ones included) rather than leave
    them empty. Returns whether any head was filled."""
    need = target - state.count
    if not bool((need > 0).any()):
        return False
    B, T = valid_keys.shape
    # empty slots (-1) scatter into an extra column T, so they cannot clobber the mark of a real key
    sel = state.slot_idx[:, : state.t]
    chosen = torch.zeros(B, T + 1, dtype=torch.bool, device=valid_keys.device)
    chosen.scatter_(1, torch.where(sel >= 0, sel, torch.full_like(sel, T)), True)
    avail = valid_keys & ~chosen[:, :T]
    c = int(need.max())
    vals, picks = corr.masked_fill(~avail, float("-inf")).topk(c, dim=-1)
    take = (state.slots[:c] < need.unsqueeze(-1)) & torch.isfinite(vals)
    state.append(picks, take)
    return True
