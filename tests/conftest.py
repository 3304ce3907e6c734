"""Shared fixtures: a tiny random Llama built in code, and the embedded model."""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import threading
import time
from concurrent.futures import Future

# Before anything imports triton, gradio or the hub client.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Finished runs of the suite's servers (subprocesses included) go to a folder of this session's own:
# never the user's store, where an earlier session's results would answer this one's requests.
os.environ["KVLAB_STORE_DIR"] = tempfile.mkdtemp(prefix="kvlab-test-store-")
# `make test` runs the suite in parallel (pytest-xdist, one worker per core): each worker, and the servers it
# starts, takes its share of the cores, since torch's threads spin and oversubscribed cores slow every worker.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest
from transformers import PreTrainedTokenizerFast

try:
    from hypothesis import settings as hypothesis_settings
except ImportError:  # requirements-dev.txt's; the property tests skip themselves without it
    hypothesis_settings = None

from kvlab import memo, results
from kvlab.models import get_model
from kvlab.runtime.hooks import ATTENTION_NAME
from kvlab.runtime.model import LoadedModel
from kvlab.testing import random_models
from kvlab.testing.random_models import TINY, word_tokenizer

#: The tiny models' document: 96 word tokens whose repeats give every scorer something to rank.
TINY_DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(96))


@pytest.fixture(scope="module")
def templated(tiny: LoadedModel):
    """The tiny model (2 layers, 4 query heads over 2 KV heads, head dim 16) with a 2-token chat template,
    prefilled with TINY_DOC: its contexts start with a template prefix, as a chat model's do."""
    from kvlab.context import prepare_context

    ctx = prepare_context(with_template(tiny), TINY_DOC)
    assert ctx.prefix_len == 2 and ctx.doc_len == 96
    return ctx


@pytest.fixture(autouse=True)
def result_store(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test its own empty result store (kvlab.results): a run another test stored must never answer it;
    and its own empty folder of measured head-budget profiles (the shipped ones stay)."""
    monkeypatch.setenv("KVLAB_STORE_DIR", str(tmp_path / "result-store"))
    monkeypatch.setattr(results, "_store", None)
    monkeypatch.setenv("KVLAB_BUDGETS_DIR", str(tmp_path / "budgets"))


if hypothesis_settings is not None:
    # The same examples on every run and machine (a failure found once is found again), and no example
    # database written into the checkout.
    hypothesis_settings.register_profile("kvlab", derandomize=True, database=None)
    hypothesis_settings.load_profile("kvlab")


#: The methods a quick run (make test-fast) keeps in every per-method harness: one scoring method and the
#: compaction at the lab's heart; `make test` runs every method through every harness.
QUICK_METHODS = frozenset({"snapkv", "attention_matching"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``matrix`` the cases of a harness parametrised over the registry for the other methods."""
    from kvlab.compression.registry import REGISTRY

    for item in items:
        spec = getattr(item, "callspec", None)
        values = spec.params.values() if spec is not None else ()
        if any(isinstance(v, str) and v in REGISTRY and v not in QUICK_METHODS for v in values):
            item.add_marker(pytest.mark.matrix)


def pytest_configure(config: pytest.Config) -> None:
    # gradio's queue still uses pandas options that pandas 4 deprecates; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:gradio.queueing")
    config.addinivalue_line("filterwarnings", "ignore:.*(no_silent_downcasting|copy keyword).*")


#: A chat template in the tiny word vocabulary: 2 template tokens before the document, as real models keep a prefix.
TINY_TEMPLATE = (
    "w60 w61 {% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} w59{% endif %}"
)


def with_template(lm: LoadedModel) -> LoadedModel:
    """``lm`` whose tokenizer (a copy: ``lm`` is unchanged) applies :data:`TINY_TEMPLATE`."""
    tokenizer = copy.deepcopy(lm.tokenizer)
    tokenizer.chat_template = TINY_TEMPLATE
    return dataclasses.replace(lm, tokenizer=tokenizer)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny models' word-level tokenizer over w0..w61, so tests can write token ids as text."""
    return word_tokenizer(TINY["vocab_size"])


def tiny_llama(seed: int = 0, attn: str = ATTENTION_NAME) -> LoadedModel:
    """kvlab.testing.random_models.tiny_llama (2 layers, 4 query heads, 2 KV heads, head dim 16, fp32,
    CPU) under the attention implementation ``attn``."""
    lm = random_models.tiny_llama(seed)
    if attn != ATTENTION_NAME:
        lm.model.set_attn_implementation(attn)
    return lm


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_eager(tiny: LoadedModel) -> LoadedModel:
    """The same weights as ``tiny`` under transformers' own eager attention: the reference."""
    ref = tiny_llama()
    ref.model.load_state_dict(tiny.model.state_dict())
    ref.model.set_attn_implementation("eager")
    return ref


@pytest.fixture
def own_models(monkeypatch):
    """Models loaded by name inside the test (a CLI run with ``--model DIR``) go to a cache of the test's
    own: they never push the session's models (the ``embedded`` fixture's, the app's) out of
    kvlab.models' cache, which would make the next get_model load a second copy."""
    from collections import OrderedDict

    from kvlab import models

    monkeypatch.setattr(models, "_cache", OrderedDict())


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct (loaded once per test session, ~20 s)."""
    return get_model()


class FlightWaiters:
    """Callers that joined a computation already in flight (kvlab.memo.compute_once's followers),
    counted as each calls the flight's ``result()``: at once for a plain call (what these tests
    race); a cancellable request first waits through kvlab.cancellation and is counted when it is done."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def arrived(self) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_for(self, n: int, timeout: float = 60.0) -> bool:
        """Whether ``n`` callers are waiting (False only if they never came: a guard, not a timing)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= n, timeout)


@pytest.fixture
def flight_waiters(monkeypatch: pytest.MonkeyPatch) -> FlightWaiters:
    """Counts the callers waiting on an in-flight computation, so that a test's slow ``make`` can wait
    until every racing request has joined it (an event, not a sleep that hopes they have)."""
    waiters = FlightWaiters()

    class Counted(Future):
        def result(self, timeout: float | None = None):
            waiters.arrived()
            return super().result(timeout)

    monkeypatch.setattr(memo, "Future", Counted)
    return waiters


def method_sections(markdown: str) -> dict[str, tuple[str, str]]:
    """A methods text (the Learn tab's, ``kvlab methods --long``) read back by its headings.

    Returns, per ``#### `name``` heading, the ``### Family`` heading above it and the section's text
    up to the next heading of any level; a name heading twice keeps only its last section.
    """
    sections: dict[str, tuple[str, str]] = {}
    family, name, lines = "", None, []
    for line in markdown.splitlines() + ["### end"]:
        if line.startswith("#"):
            if name is not None:
                sections[name] = (family, "\n".join(lines))
            name, lines = None, []
            if line.startswith("#### `"):
                name = line.split("`")[1]
            elif line.startswith("### "):
                family = line[4:].strip()
        elif name is not None:
            lines.append(line)
    return sections


def cancel_when_known(job, timeout_s: float = 60) -> None:
    """Press Stop on a gradio_client job once the client knows its event's id.

    The client learns the id when its join returns, which can come after the
    server has started the work: a cancel sent before names no event (its
    ``/cancel`` carries ``event_id: None``) and stops nothing.
    """
    deadline = time.monotonic() + timeout_s
    while job.communicator.event_id is None:
        assert time.monotonic() < deadline, "the client never learned its event's id"
        time.sleep(0.01)
    job.cancel()
