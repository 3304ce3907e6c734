"""Online Attention Matching while writing: compaction to half the budget whenever the cache is full,
by the method's own fit (kvlab.methods.families.compaction, through kvlab.bounded.online) and its options."""

from __future__ import annotations

import torch

from kvlab.bounded.loop import CacheEvent, CachePolicy
from kvlab.bounded.online import Compactor, am_compactor, read_so_far, with_appended
from kvlab.bounded.policy_registry import register_policy
from kvlab.methods import MethodError
from kvlab.methods.families.am_recipe import AMOptions
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import open_session
from kvlab.runtime.model import LoadedModel


@register_policy
class OnlineAMPolicy(CachePolicy):
    """Generation under a budget by online Attention Matching: when the next tokens would not fit,
    the cache is compacted to budget/2 keys per head (the template prefix kept as is), fitted on
    the queries of everything read and written so far; writing then goes on from the compacted
    cache (with its biases). Once full it compacts every budget - budget/2 written tokens.

    protected: leading tokens (the template prefix) never compacted; compactor: how a full cache
    is shrunk (default: Attention Matching with ``options``).
    """

    name = "online_am"
    label = "Online Attention Matching"
    summary = "compacts to half the budget (fitted keys, biases, values) when full"
    Options = AMOptions
    wants_queries = True

    def __init__(
        self,
        lm: LoadedModel,
        budget: int | None = None,
        stored: CompressedKV | None = None,
        options: AMOptions | None = None,
        protected: int = 0,
        compactor: Compactor | None = None,
    ):
        super().__init__(lm, budget, stored, options, protected)
        self.compactor = compactor or am_compactor(self.options)
        self.stored, self.appended = stored, 0
        self.queries: list[list[torch.Tensor]] = [[] for _ in range(lm.n_layers)]

    def check(self, chunk: int) -> None:
        if self.budget is not None and (
            self.budget <= 2 * self.protected + 2 or self.budget // 2 + chunk > self.budget
        ):
            raise MethodError(
                f"{self.name}: a budget of {self.budget} keys per head is too small to compact to half "
                f"beside the {self.protected} template tokens and {chunk} new tokens; raise the budget"
            )

    def make_room(self, n: int) -> None:
        before = self.size()
        if self.budget is None or before + n <= self.budget:
            return
        if self.stored is None:  # nothing compacted yet: the working cache holds positions 0..L-1
            full = read_so_far(self.lm, self.session)
        else:
            full = with_appended(self.lm, self.stored, self.session, self.appended)
        queries = [torch.cat(q, dim=1) for q in self.queries]
        self.stored = self.compactor(full, queries, self.budget // 2 - self.protected, self.protected)
        self.session, self.appended = open_session(self.lm, self.stored), 0
        self.events.append(CacheEvent(self.session.position, before, self.size()))

    def observe(self, queries: list[torch.Tensor] | None, positions: torch.Tensor) -> None:
        for held, q in zip(self.queries, queries):
            held.append(q)
        self.appended += positions.numel()
