"""The paper's claims beside what the lab measures for them: the Claims section of the Learn tab.

Each :class:`Claim` quotes a sentence of the Attention Matching paper (Zweiger, Fu, Guo, Kim, 2026) or of
its press, with the setting it was measured in, and names the lab's nearest setting, the command and
the page link that reproduce it. Its figure and its verdict are computed here from stored runs: the
file ``assets/claims.json``, written by ``python -m benchmarks.claims`` (the bundled examples' runs
through kvlab.lab.explore, a generation through kvlab.lab.generate, and the per-item rows of the
book studies' ``kvlab bench`` results), never typed in. A claim whose runs the file lacks says so
instead of a figure.

Shapes of the stored file (each list of plain records, see benchmarks/claims.py):

- ``books``: one row per book item and configuration: model, method, preset, ratio (None for the full
  cache and no context), item, correct, compress_s;
- ``examples``: one row per bundled example's question and configuration: example, method, knobs,
  ratio, question, full_right, right, compress_s, bytes_full, bytes_compressed;
- ``generation``: the arithmetic chain, unbounded and online Attention Matching's writing, marked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvlab.paths import assets_dir
from kvlab.tasks.runner import wilson_interval

#: The stored runs the claims read (written by ``python -m benchmarks.claims``).
CLAIMS_FILE = assets_dir() / "claims.json"
#: The recipe of the paper's headline runs, as the book studies name it (attention_matching's knobs).
RECIPE = "on_policy=True self_study_weight=1.0 max_queries=50000"
#: A compressed cache "keeps" a score when it is within this share of the items of the full cache's.
KEEPS = 0.1
#: The embedded model and the second offline model, as the book studies' rows name them.
SMOL = "SmolLM2-135M-Instruct (embedded GGUF)"
GEMMA = "Gemma 3 270M (Q4_K_M GGUF, base)"


@dataclass(frozen=True)
class Measured:
    """What the lab measured for a claim: ``figure`` (numbers with n and intervals, in words) and
    ``verdict`` (one plain sentence)."""

    figure: str
    verdict: str


@dataclass(frozen=True)
class Claim:
    """One claim: ``quote`` as published, ``source`` where, ``setting`` the paper's model, task and ratio;
    ``lab`` the lab's nearest setting, ``command`` and ``link`` (a page query string, or None) what
    reproduces it; ``measure`` reads its figure and verdict from the stored runs."""

    id: str
    quote: str
    source: str
    setting: str
    lab: str
    command: str
    link: str | None
    measure: Callable[[dict[str, Any]], Measured]


@dataclass(frozen=True)
class Cell:
    """Right answers out of n for one configuration, with the Wilson 95 % interval, and the mean
    compression seconds (None where nothing was compressed)."""

    right: int
    n: int
    seconds: float | None

    def text(self) -> str:
        low, high = wilson_interval(self.right, self.n)
        return f"{self.right}/{self.n} [{low:.2f}, {high:.2f}]"


class MissingRuns(LookupError):
    """The stored file holds no run for a configuration a claim reads."""


def cell(rows: list[dict[str, Any]], **match: Any) -> Cell:
    """The rows whose fields equal ``match`` (a row missing a field never matches) as one :class:`Cell`
    (``correct`` or ``right`` marks an answer); MissingRuns when there are none."""
    chosen = [r for r in rows if all(k in r and r[k] == v for k, v in match.items())]
    if not chosen:
        raise MissingRuns(", ".join(f"{k}={v}" for k, v in match.items()))
    marks = [bool(r["correct"] if "correct" in r else r["right"]) for r in chosen]
    times = [r["compress_s"] for r in chosen if r.get("ratio") is not None]
    return Cell(sum(marks), len(marks), sum(times) / len(times) if times else None)


def keeps(compressed: Cell, full: Cell) -> bool:
    """Whether ``compressed`` keeps the full cache's score: at most :data:`KEEPS` of the items fewer."""
    return compressed.right >= full.right - max(1, round(KEEPS * full.n))


def _book(data: dict, model: str, method: str, preset: str = "", ratio: float | None = None) -> Cell:
    return cell(data["books"], model=model, method=method, preset=preset, ratio=ratio)


def fifty_x(data: dict) -> Measured:
    """The recipe on the book needles at 50x and at every other ratio measured on all the items, both models."""
    parts, held = [], []
    for model, name in ((SMOL, "SmolLM2-135M"), (GEMMA, "Gemma 3 270M")):
        full = _book(data, model, "full")
        measured = sorted({r["ratio"] for r in data["books"] if r["model"] == model and r["preset"] == RECIPE})
        at = {r: c for r in measured if (c := _book(data, model, "attention_matching", RECIPE, r)).n == full.n}
        if 50.0 not in at:
            raise MissingRuns(f"{name}: the recipe at 50x on all {full.n} items")
        others = ", ".join(f"{at[r].right}/{at[r].n} at {r:g}x" for r in sorted(at, reverse=True) if r != 50.0)
        parts.append(
            f"{name}: {at[50.0].text()} at 50x, {others} (full cache {full.right}/{full.n}, "
            f"no context {_book(data, model, 'no_context').right}/{full.n})"
        )
        kept = [r for r, c in at.items() if keeps(c, full)]
        held.append(f"{name} up to {max(kept):g}x" if kept else f"{name} at none of {', '.join(f'{r:g}x' for r in at)}")
    if all(keeps(_book(data, m, "attention_matching", RECIPE, 50.0), _book(data, m, "full")) for m in (SMOL, GEMMA)):
        verdict = "Holds here at 50x."
    else:
        verdict = (
            "Does not hold on these small models at 50x: the recipe keeps the full cache's needles (within "
            f"{KEEPS:.0%} of the items) {'; '.join(held)}, and loses most of them at 50x."
        )
    return Measured("Book needles, the paper's recipe: " + "; ".join(parts) + ".", verdict)


def seconds_not_hours(data: dict) -> Measured:
    """Attention Matching against Cartridges at equal bytes: both times and both scores, books and story."""
    books, slower, pairs = [], [], []
    for ratio in (5.0, 10.0, 20.0, 50.0):
        am = _book(data, SMOL, "attention_matching", "", ratio)
        cart = _book(data, SMOL, "cartridges", "", ratio)
        books.append(
            f"{ratio:g}x AM {am.right}/{am.n} in {am.seconds:.1f} s, "
            f"Cartridges {cart.right}/{cart.n} in {cart.seconds:.1f} s"
        )
        slower.append(cart.seconds / am.seconds)
        pairs.append((am, cart))
    full = _book(data, SMOL, "full")
    story = [
        cell(data["examples"], example="story", method=m, ratio=10.0) for m in ("attention_matching", "cartridges")
    ]
    pairs.append((story[0], story[1]))
    figure = (
        f"SmolLM2-135M, 24 book needles (full cache {full.right}/{full.n}): {'; '.join(books)}. "
        f"The story at 10x, 5 questions: AM {story[0].right}/5 in {story[0].seconds:.1f} s, "
        f"Cartridges {story[1].right}/5 in {story[1].seconds:.1f} s (16 Adam steps on 4 self-study conversations; "
        "the first ratio's time holds the document's preparation, the repeat pass or the self-study text)."
    )
    ahead = sum(c.right > a.right for a, c in pairs)
    behind = sum(c.right < a.right for a, c in pairs)
    verdict = (
        f"The speed holds: Cartridges took {min(slower):.0f}-{max(slower):.0f} times Attention Matching's time "
        f"here, with a training thousands of times shorter than the paper's. The quality: of these "
        f"{len(pairs)} comparisons at equal bytes, Cartridges scored higher in {ahead}, lower in {behind}, the "
        f"same in {len(pairs) - ahead - behind}."
    )
    return Measured(figure, verdict)


def _example(data: dict, method: str, ratio: float | None, example: str = "patient_record") -> Cell:
    return cell(data["examples"], example=example, method=method, ratio=ratio)


def summaries_fall(data: dict) -> Measured:
    """Summarisation on the dense patient record against no context, the full cache and AM."""
    full = _example(data, "full", None)
    none, summ, am = (
        _example(data, "no_context", None),
        _example(data, "summarisation", 10.0),
        _example(data, "attention_matching", 10.0),
    )
    figure = (
        f"SmolLM2-135M, the bundled patient record, its 5 questions at 10x: summarisation "
        f"{summ.right}/5, no context {none.right}/5, Attention Matching {am.right}/5, full cache {full.right}/5."
    )
    if summ.right <= none.right + 1:
        verdict = "Holds here: the summary answers about as few questions as no context."
    else:
        verdict = f"Does not hold here: the summary answers {summ.right - none.right} more than no context."
    return Measured(figure, verdict)


def summary_then_am(data: dict) -> Measured:
    """summary_am at 200x against the summary itself, on two bundled examples."""
    parts, held, low = [], [], False
    for example in ("patient_record", "story"):
        summ = _example(data, "summarisation", 10.0, example)
        both = _example(data, "summary_am", 200.0, example)
        full = _example(data, "full", None, example)
        parts.append(
            f"{example}: summary + AM at 200x {both.right}/5, the summary alone at 10x {summ.right}/5, "
            f"full {full.right}/5"
        )
        held.append(both.right >= summ.right - 1)
        low = low or not keeps(summ, full)
    if not all(held):
        verdict = "Does not hold here on every example: the compacted summary answers fewer questions than the summary."
    else:
        verdict = "Holds here: compacting the summary to 200x keeps the summary's score (within one question)"
        verdict += "; but the summary itself answers few questions here." if low else "."
    return Measured("SmolLM2-135M, 5 questions each: " + "; ".join(parts) + ".", verdict)


def six_compactions(data: dict) -> Measured:
    """Online compaction (50% each time the budget is full) while writing an arithmetic chain."""
    gen = data["generation"]
    unbounded, online = gen["unbounded"], gen["online_am"]
    figure = (
        f"SmolLM2-135M writing the chain '{gen['task']}' ({gen['steps']} steps), budget {gen['budget']} keys: "
        f"unbounded {unbounded['right_steps']}/{gen['steps']} steps right; online Attention Matching "
        f"{online['events']} compactions, {online['right_steps']}/{gen['steps']} steps right."
    )
    if unbounded["right_steps"] < gen["steps"]:
        verdict = (
            "Cannot be checked on this model: with an unbounded cache it does not solve the chain, so there "
            "is no score to keep."
        )
    elif online["events"] < 6:
        verdict = f"Not reached: only {online['events']} compactions in this run."
    elif online["right_steps"] == unbounded["right_steps"]:
        verdict = f"Holds here: after {online['events']} compactions the chain is still right."
    else:
        verdict = (
            f"Does not hold here: {online['events']} compactions cost {gen['steps'] - online['right_steps']} steps."
        )
    return Measured(figure, verdict)


BOOKS_COMMAND = (
    "kvlab bench [--model gemma3-270m] --tasks niah_single --haystack books --needle-values mixed --limit 24 "
    "--seed 0 --length 1500 --ratios 5,10,20,50 --methods {methods}"
)

CLAIMS: tuple[Claim, ...] = (
    Claim(
        "fifty-x",
        "Attention Matching compacts the KV cache up to 50x with little loss in quality.",
        "the paper's abstract and headline figures",
        "Qwen3-4B, Llama-3.1-8B-Instruct and Gemma-3-12B-it on QuALITY (5-8k-token stories) and LongHealth (about "
        "60k tokens); Qwen3-4B on QuALITY at 50x: full cache about 71.5%, AM-OMP about 62-65%, no context about "
        "42%; the recipe: self-study + repeat queries read on-policy, the model's head budgets",
        "24 needles in public-domain books (~1,500 tokens), the same recipe (preset "
        "AM-HighestAttnKeys-ss-plus-repeat), SmolLM2-135M and Gemma 3 270M",
        BOOKS_COMMAND.format(methods='"attention_matching:on_policy=true:self_study_weight=1:max_queries=50000"'),
        "?tab=explore&example=story&method=attention_matching:on_policy=true:self_study_weight=1:max_queries=50000&ratio=50",
        fifty_x,
    ),
    Claim(
        "seconds-not-hours",
        "Attention Matching compacts in seconds, where Cartridges needs hours of GPU optimisation, at similar quality.",
        "the paper's comparison with Cartridges and the press",
        "Qwen3-4B on QuALITY at 50x: Cartridges on par with AM-OMP (about 62-65%) after about 5 GPU-hours of "
        "training per document; AM on a 60k-token context on one H200: repeat-prefill queries about 8 s, "
        "HighestAttnKeys about 3 s, beta and values about 2 s each",
        "the same book needles and the story, SmolLM2-135M, at equal bytes (the same keys and values per head; "
        "Attention Matching adds one bias per key): Attention Matching's default against `cartridges` (16 Adam "
        "steps)",
        BOOKS_COMMAND.format(methods="attention_matching,cartridges") + "; python -m benchmarks.cartridges",
        "?tab=explore&example=story&method=cartridges&ratio=10",
        seconds_not_hours,
    ),
    Claim(
        "summaries-fall",
        "Summarising the context falls to the level of no context on dense medical records.",
        "the paper's LongHealth results",
        "LongHealth (about 60k tokens of patient records): summarisation falls to the no-context level while AM "
        "holds up (on QuALITY summarisation reaches about 55%)",
        "the bundled patient record (fictional, 2,648 tokens), its 5 questions, 10x",
        "python -m benchmarks.claims",
        "?tab=explore&example=patient_record&method=summarisation&ratio=10",
        summaries_fall,
    ),
    Claim(
        "summary-am-200x",
        "Summarising, then compacting the summary with Attention Matching, reaches about 200x at the "
        "summary's accuracy.",
        "the paper's summary + Attention Matching results",
        "Attention Matching applied on a model-written summary: about 200x overall, at the accuracy of the "
        "summary alone",
        "the patient record and the story, `summary_am` at 200x against `summarisation` at 10x",
        "kvlab run --doc assets/examples/patient_record.md --method summary_am --ratio 200 "
        '--question "What is the patient\'s name?"',
        None,  # Explore's ratio stops at 100x
        summary_then_am,
    ),
    Claim(
        "six-compactions",
        "Compacting the cache by 50% six times in a row while solving maths problems kept the unbounded model's score.",
        "the paper's online compaction on reasoning",
        "math reasoning, the cache compacted by 50% whenever full, six times in a row: the same accuracy as "
        "unbounded memory",
        "the Generate tab's online Attention Matching while counting by sevens to 140 (each number the one before "
        "plus 7), budget 64 keys",
        "python -m benchmarks.claims",
        "?tab=generate",
        six_compactions,
    ),
)


def load(path: Path = CLAIMS_FILE) -> dict[str, Any] | None:
    """The stored runs, or None when the file is absent (an install without the repository's assets)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def measure(claim: Claim, data: dict[str, Any] | None) -> Measured:
    """``claim``'s figure and verdict from ``data``, or why there is none."""
    if data is None:
        return Measured("not measured here: run `python -m benchmarks.claims`", "Not checked yet.")
    try:
        return claim.measure(data)
    except (MissingRuns, KeyError) as exc:
        return Measured(f"not measured here (no stored run for {exc}): run `{claim.command}`", "Not checked yet.")


def claims_markdown(data: dict[str, Any] | None) -> str:
    """The Claims section: one block per claim (the quote, the paper's setting, the lab's measure, the
    verdict, how to reproduce), then when and where the runs were made."""
    blocks = ["## The paper's claims, checked here", ""]
    for claim in CLAIMS:
        got = measure(claim, data)
        link = f" · [open it on this page]({claim.link})" if claim.link else ""
        blocks += [
            f'<div class="kvlab-claim" id="kvlab-claim-{claim.id}">',
            "",
            f"**\u201c{claim.quote}\u201d** ({claim.source})",
            "",
            f"- *The paper's setting:* {claim.setting}.",
            f"- *Here:* {claim.lab}.",
            f'- *Measured:* <span class="kvlab-claim-figure">{got.figure}</span>',
            f'- *Verdict:* <span class="kvlab-claim-verdict">{got.verdict}</span>',
            f'- *Reproduce:* <code class="kvlab-claim-command">{claim.command}</code>{link}',
            "",
            "</div>",
            "",
        ]
    if data is not None:
        made = data.get("made", {})
        blocks.append(
            f"The runs: {made.get('date', '?')}, {made.get('machine', '?')}, code {made.get('commit', '?')}; "
            "each figure is read from `assets/claims.json` (`python -m benchmarks.claims` writes it)."
        )
    return "\n".join(blocks)
