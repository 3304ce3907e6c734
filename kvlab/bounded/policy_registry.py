"""The registered bounded-cache policies by name: :func:`register_policy` adds one; the policies
package (kvlab.bounded.policies) imports every module of its folder (kvlab.compression.registry.discover),
so a policy is a file there, no import list -- the methods' way.

Everything that lists the policies reads :data:`POLICIES` here: the CLI's ``generate --method``,
the app's Generate tab, :func:`kvlab.lab.generate.generate` and docs/architecture.md's table
(:func:`policies_table`).
"""

from __future__ import annotations

from kvlab import messages
from kvlab.bounded.loop import CachePolicy
from kvlab.methods import MethodError
from kvlab.runtime.model import LoadedModel

POLICIES: dict[str, type[CachePolicy]] = {}
#: The policy that keeps every key: the reference every bounded one is measured against.
REFERENCE = "unbounded"


def register_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Class decorator: make a policy available by its ``name``; it declares a ``label`` and a ``summary``."""
    if not (cls.name and cls.label and cls.summary):
        raise TypeError(f"{cls.__name__}: a policy declares a name, a label and a one-line summary")
    if cls.name in POLICIES:
        raise ValueError(f"policy {cls.name!r} registered twice")
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """Every registered policy, the reference first, then by name."""
    return sorted(POLICIES, key=lambda name: (name != REFERENCE, name))


def bounded_policies() -> list[str]:
    """The policies that bound the cache (all but the reference), by name."""
    return [name for name in policy_names() if name != REFERENCE]


def policy_class(name: str) -> type[CachePolicy]:
    """The registered class of ``name``; MethodError listing the names when there is none."""
    if name not in POLICIES:
        raise MethodError(messages.unknown("generation method", name, policy_names()))
    return POLICIES[name]


def make_policy(name: str, lm: LoadedModel, budget: int | None, protected: int) -> CachePolicy:
    """A fresh policy ``name`` with ``budget`` keys per head (ignored by the reference) on an empty cache,
    with its method's default options; ``protected``: the template prefix length (BeaconKV and online
    Attention Matching keep it)."""
    return policy_class(name)(lm, budget, protected=protected)


#: Where docs/architecture.md holds :func:`policies_table` (the lines between these two are generated).
TABLE_BEGIN = (
    "<!-- policies table: generated from the registry (kvlab.bounded.policy_registry.policies_table); do not edit -->"
)
TABLE_END = "<!-- end of the policies table -->"


def policies_table() -> str:
    """docs/architecture.md's table of the policies: a row per policy (name, label, summary), the reference first."""
    lines = ["| policy | shown as | what it keeps |", "| --- | --- | --- |"]
    for name in policy_names():
        cls = POLICIES[name]
        lines.append(f"| `{name}` | {cls.label} | {cls.summary} |")
    return "\n".join(lines)
