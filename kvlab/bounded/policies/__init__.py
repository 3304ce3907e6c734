"""Bounded-cache policies: one module each, the file named as the policy, found by discovery.

Importing this package imports every module in it (:func:`kvlab.compression.registry.discover`),
each registering its policy (:func:`kvlab.bounded.policy_registry.register_policy`): a policy is a file
here and nothing else. What they run in is :mod:`kvlab.bounded.loop`.
"""

from kvlab.bounded.policy_registry import POLICIES, REFERENCE, bounded_policies, make_policy, policy_class, policy_names
from kvlab.compression.registry import discover

discover(__name__, __path__)

__all__ = ["POLICIES", "REFERENCE", "bounded_policies", "make_policy", "policy_class", "policy_names"]
