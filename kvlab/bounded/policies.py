"""Every bounded-cache policy by name, and one call that builds one."""
from __future__ import annotations

from kvlab import messages
from kvlab.bounded.beacon import BeaconPolicy
from kvlab.bounded.generate import CachePolicy, H2OPolicy, WindowPolicy
from kvlab.bounded.online import OnlineAMPolicy
from kvlab.methods import MethodError
from kvlab.runtime.model import LoadedModel

#: name -> (label, one-line summary); "unbounded" is the reference every other one is measured against.
POLICIES: dict[str, tuple[str, str]] = {
    "unbounded": ("Unbounded", "keeps every key: the reference"),
    "streaming_llm": ("StreamingLLM (sinks + a sliding window)", "4 attention sinks + the most recent tokens; evicts one per step"),
    "h2o": ("H2O", "accumulated attention (heavy hitters) + a recent half; evicts one per step"),
    "beaconkv": ("BeaconKV", "scores keys by recent queries + FPS beacons of the history; evicts 16 at a time"),
    "online_am": ("Online Attention Matching", "compacts to half the budget (fitted keys, biases, values) when full"),
}
BOUNDED = tuple(name for name in POLICIES if name != "unbounded")


def make_policy(name: str, lm: LoadedModel, budget: int | None, protected: int) -> CachePolicy:
    """A fresh policy ``name`` with ``budget`` keys per head (ignored by "unbounded") on an empty cache;
    ``protected``: the template prefix length, kept by BeaconKV and online Attention Matching."""
    if name == "unbounded":
        return CachePolicy(lm)
    if name == "streaming_llm":
        return WindowPolicy(lm, budget)
    if name == "h2o":
        return H2OPolicy(lm, budget)
    if name == "beaconkv":
        return BeaconPolicy(lm, budget, protected=protected)
    if name == "online_am":
        return OnlineAMPolicy(lm, budget, protected=protected)
    raise MethodError(messages.unknown("generation method", name, POLICIES))
