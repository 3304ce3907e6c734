"""The unbounded cache: keeps every key, the reference every bounded policy is measured against."""

from __future__ import annotations

from kvlab.bounded.loop import CachePolicy
from kvlab.bounded.policy_registry import register_policy


@register_policy
class Unbounded(CachePolicy):
    """Never shrinks (the base class's rule); the budget is ignored."""

    name = "unbounded"
    label = "Unbounded"
    summary = "keeps every key: the reference"
