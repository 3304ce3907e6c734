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

import torch

from kvlab.compression.solvers.nnls import box_nnls_gram


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
    z = z.float()
    dev = phi.device
    valid_keys = (
        torch.ones(B, T, dtype=torch.bool, device=dev) if key_valid is None else key_valid.to(dev)
    )
    target = valid_keys.sum(-1).clamp(max=t)  # [B]
    # No round picks more than the slots (t) or the keys (T): the picks index ``slots``.
    kpi = max(1, min(keys_per_iter, t, T))
    if max_iters is None:
        # Enough rounds to fill t slots several times over (drops refill);
        # bans make each key pickable once, so this is a safety net only.
        max_iters = 4 * (-(-t // kpi)) + 2 * refit_every + 4
    drop_w = None if drop_below is None else math.exp(drop_below)

    # Slot t is a sink: picks a head does not take are scattered there, so
    # every head can share one fixed-shape scatter.
    slot_idx = torch.full((B, t + 1), -1, dtype=torch.long, device=dev)
    m_sel = phi.new_zeros(B, n, t + 1)
    gram = phi.new_zeros(B, t + 1, t + 1)
    rhs = phi.new_zeros(B, t + 1)
    w = phi.new_zeros(B, t + 1)
    count = torch.zeros(B, dtype=torch.long, device=dev)
    taken = ~valid_keys  # selected, banned or padding
    slots = torch.arange(t + 1, device=dev)

    def append(picks: torch.Tensor, take: torch.Tensor) -> None:
        nonlocal taken, count, m_sel, gram, rhs, slot_idx
        c = picks.shape[-1]
        pos = torch.where(take, count.unsqueeze(-1) + slots[:c], torch.full_like(picks, t))
        slot_idx.scatter_(1, pos, torch.where(take, picks, torch.full_like(picks, -1)))
        new = phi.gather(2, picks.unsqueeze(1).expand(B, n, c)) * take.unsqueeze(1)
        m_sel.scatter_(2, pos.unsqueeze(1).expand(B, n, c), new)
        cross = torch.bmm(m_sel.transpose(1, 2), new)  # [B, t+1, c], new columns included
        gram.scatter_(2, pos.unsqueeze(1).expand(B, t + 1, c), cross)
        gram.scatter_(1, pos.unsqueeze(2).expand(B, c, t + 1), cross.transpose(1, 2))
        rhs.scatter_(1, pos, torch.bmm(z.unsqueeze(1), new).squeeze(1))
        taken = taken | torch.zeros_like(taken).scatter_(1, picks, take)
        count = count + take.sum(-1)

    def refit() -> torch.Tensor:
        active = (slots[:t] < count.unsqueeze(-1)).float()
        out = phi.new_zeros(B, t + 1)
        out[:, :t] = box_nnls_gram(gram[:, :t, :t], rhs[:, :t], active, 0.0, math.inf, nnls_iters,
                                    ridge, m_sel[:, :, :t], z)
        return out

    def correlation() -> torch.Tensor:
        r = z - torch.bmm(m_sel, w.unsqueeze(-1)).squeeze(-1)
        return torch.bmm(r.unsqueeze(1), phi).squeeze(1)  # [B, T]

    corr = correlation()
    fresh = True  # w belongs to the current selection
    since_refit = 0
    for _ in range(max_iters):
        need = target - count
        if not bool((need > 0).any()):
            break
        vals, picks = corr.masked_fill(taken, float("-inf")).topk(kpi, dim=-1)
        take = (slots[:kpi] < need.unsqueeze(-1)) & torch.isfinite(vals)
        if not bool(take.any()):
            break  # every head that still needs keys has run out of candidates
        append(picks, take)
        fresh = False
        since_refit += 1
        if since_refit < refit_every and bool((count < target).any()):
            continue
        w = refit()
        fresh = True
        since_refit = 0
        if drop_w is not None:
            drop = (slots < count.unsqueeze(-1)) & (w < drop_w)
            drop[:, t] = False
            if bool(drop.any()):
                keep = (slots < count.unsqueeze(-1)) & ~drop
                # stable order: kept slots first, in picking order; sink stays last
                key = torch.where(keep, slots, slots + t + 1)
                key[:, t] = 3 * (t + 1)
                perm = key.argsort(dim=-1, stable=True)
                count = keep.sum(-1)
                live = slots < count.unsqueeze(-1)
                slot_idx = slot_idx.gather(1, perm).masked_fill(~live, -1)
                w = w.gather(1, perm) * live
                rhs = rhs.gather(1, perm) * live
                m_sel = m_sel.gather(2, perm.unsqueeze(1).expand(B, n, t + 1)) * live.unsqueeze(1)
                liveg = live.unsqueeze(-1) & live.unsqueeze(-2)
                gram = gram.gather(1, perm.unsqueeze(-1).expand(B, t + 1, t + 1))
                gram = gram.gather(2, perm.unsqueeze(1).expand(B, t + 1, t + 1)) * liveg
        corr = correlation()

    need = target - count
    if bool((need > 0).any()):
        # Ran out of rounds or of unbanned keys: fill with the best remaining
        # real keys (banned ones included) rather than leave real slots empty.
        # empty slots (-1) scatter into an extra column T, so they cannot
        # clobber the mark of a real key
        sel = slot_idx[:, :t]
        chosen = torch.zeros(B, T + 1, dtype=torch.bool, device=dev)
        chosen.scatter_(1, torch.where(sel >= 0, sel, torch.full_like(sel, T)), True)
        avail = valid_keys & ~chosen[:, :T]
        c = int(need.max())
        vals, picks = corr.masked_fill(~avail, float("-inf")).topk(c, dim=-1)
        take = (slots[:c] < need.unsqueeze(-1)) & torch.isfinite(vals)
        append(picks, take)
        fresh = False
    if not fresh:
        w = refit()
    return slot_idx[:, :t].contiguous(), w[:, :t].contiguous()
