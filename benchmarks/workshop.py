"""A workshop on one server: `python -m benchmarks.workshop --clients 30 --clicks 3`.

Simulates a class through ``gradio_client`` (loopback only): each participant
opens the page (``--open``: a client session and the handed-out link's example,
timed; ``browser``: what a browser sends for the link, the page, its load event
with the link's query and the page's ``/prepare``), runs the link the teacher
handed out (the first line of the sheet, as a plain ``/run``), then ``--clicks`` more runs drawn from the sheet (default
assets/workshop.txt, 18 configurations), thinking ``--think`` seconds between
clicks, arrivals spread over ``--spread`` seconds (``--together``: everyone
clicks the link within one second). With ``--picks``, once every participant
is done with the sheet, each splits the document in the Your pick tab and makes a pick of their own
(the sheet's ``?tab=pick`` link: its example, question and ratio; random
sentences within the budget, seeded per participant: a new run by nature),
the thirty picks clicked within ``--pick-window`` seconds. Bounded: at most
``--clients`` x (1 + ``--clicks`` + 1) requests, and everything stops after
``--limit-s``.

Prints, per click kind (the link, a further run, all), n, p50, p95 and max
seconds, the errors, and how many runs were served from the result store,
shared with an identical request in flight, or computed (read from the line
the page shows above a run's summary). ``--url`` measures a server already
running; by default the benchmark starts one itself (``python app.py``, as
``make run`` does, on a free port, with ``--store-dir`` as its result store;
``--fresh-store`` empties it first) and waits ``--settle`` seconds for the
page's own preparation of the first example. ``--json FILE`` writes every
click.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHEET = ROOT / "assets" / "workshop.txt"
#: What a page shows above a run it did not compute itself (kvlab.lab.views.SERVED_NOTES).
SERVED_MARKS = {"stored": "Served from the result store", "shared": "Shared computation"}
#: "**method**... at **10x** on 2,011 document tokens": what a run's summary says it ran.
RAN = re.compile(
    r"\*\*(?P<method>[a-z0-9_]+)\*\*.*? at \*\*(?P<ratio>[0-9.]+)x\*\* on (?P<tokens>[0-9,]+) document tokens"
)


@dataclass
class Click:
    """One participant's run: what was asked, how long it took, how it was served, what came back."""

    client: int
    kind: str  # "link", "further" or "pick"
    label: str
    asked: dict
    seconds: float = 0.0
    started_s: float = 0.0  # when it was clicked, from the simulation's start
    served: str = ""  # stored, shared, computed, or "error"
    error: str = ""
    ran: dict = field(default_factory=dict)  # method, ratio, doc tokens read off the summary


def served_of(summary: str) -> str:
    """How the page says a run was served: stored, shared or computed."""
    return next((how for how, mark in SERVED_MARKS.items() if mark in summary), "computed")


def run_args(item: Any, text: str) -> dict:
    """The /run endpoint's keyword arguments for a kvlab.lab.warm.WarmItem on its document."""
    args = {"text": text, "method": item.method, "ratio": item.ratio, "question": item.question}
    args.update({f"{item.method}__{k}": v for k, v in item.options})
    return args


def click(client: Any, index: int, kind: str, label: str, asked: dict, origin: float | None = None) -> Click:
    """One /run through ``client``; its time, how it was served, what its summary says it ran.

    origin: the simulation's start (time.perf_counter), for ``started_s``.
    """
    c = Click(index, kind, label, {k: v for k, v in asked.items() if k != "text"})
    start = time.perf_counter()
    c.started_s = start - (start if origin is None else origin)
    try:
        out = client.predict(api_name="/run", **asked)
        summary = out[0]["value"] if isinstance(out[0], dict) else out[0]
        c.served = served_of(summary)
        found = RAN.search(summary)
        if found:
            c.ran = {
                "method": found["method"],
                "ratio": float(found["ratio"]),
                "doc_tokens": int(found["tokens"].replace(",", "")),
            }
    except Exception as exc:  # noqa: BLE001 - an error is a result of the benchmark
        c.served, c.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    c.seconds = time.perf_counter() - start
    return c


@dataclass(frozen=True)
class Opening:
    """What a browser does when a participant opens the handed-out link: the page, its load event with
    the link's query (kvlab.ui.page_links.wire_links reads it from the request), then ``/prepare`` of the
    document shown (the load's ``.then``)."""

    query: str  # "?tab=explore&example=story&..."
    prepare: dict  # /prepare's arguments: the link's document, method, question, model
    example: str  # the link's example, for /load_example


def opening_of(item: Any, text: str) -> Opening:
    """The Opening of a kvlab.lab.warm.WarmItem's link on its document ``text``."""
    from kvlab.lab.links import Link, link_query

    link = Link(
        example=item.example,
        question=item.question,
        model=item.model,
        method=item.method,
        options=item.options,
        ratio=item.ratio,
    )
    prepare = {"text": text, "method": item.method, "question": item.question}
    prepare.update({f"{item.method}__{k}": v for k, v in item.options})
    return Opening(link_query(link), prepare, item.example)


def open_page(url: str, opening: Opening, index: int, origin: float, browser: bool) -> tuple[Any, Click]:
    """A participant opens the page: a client session (Gradio's config), then either the example chosen
    (``/load_example``: the session's first event) or, ``browser``, what a browser sends for the link:
    the page itself and its load event with the link's query (the page's ``/prepare`` follows in the
    background: :func:`prepare_page`). The client, and the open as a Click (kind "open")."""
    import httpx
    from gradio_client import Client

    c = Click(index, "open", f"open {opening.query}", {"query": opening.query})
    start = time.perf_counter()
    c.started_s = start - origin
    client = None
    try:
        client = Client(url, verbose=False)
        if not browser:
            client.predict(opening.example, api_name="/load_example")
            c.served, c.seconds = "opened", time.perf_counter() - start
            return client, c
        base = url.rstrip("/")
        load = next(d["id"] for d in client.config["dependencies"] if ["load"] == [t[1] for t in d["targets"]])
        with httpx.Client(timeout=120) as http:
            http.get(f"{base}/{opening.query}").raise_for_status()
            http.post(
                f"{base}/gradio_api/run/predict{opening.query}",
                json={"fn_index": load, "data": [], "session_hash": client.session_hash, "event_data": None},
            ).raise_for_status()
        c.served = "opened"
    except Exception as exc:  # noqa: BLE001 - an error is a result of the benchmark
        client = None
        c.served, c.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    c.seconds = time.perf_counter() - start
    return client, c


def prepare_page(client: Any, opening: Opening, index: int, origin: float) -> Click:
    """The page's ``/prepare`` after its load (the document and method readied, the status line "Ready"),
    timed as a Click of kind "prepare"."""
    c = Click(index, "prepare", "the page's /prepare", {})
    start = time.perf_counter()
    c.started_s = start - origin
    try:
        client.predict(api_name="/prepare", **opening.prepare)
        c.served = "prepared"
    except Exception as exc:  # noqa: BLE001 - an error is a result of the benchmark
        c.served, c.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    c.seconds = time.perf_counter() - start
    return c


def simulate(
    url: str,
    clients: int,
    link: tuple[str, dict],
    further: list[tuple[str, dict]],
    clicks: int,
    spread_s: float = 20.0,
    think_s: tuple[float, float] = (5.0, 15.0),
    seed: int = 0,
    limit_s: float = 900.0,
    opening: Opening | None = None,
    browser: bool = False,
) -> list[Click]:
    """Every participant's clicks (each a thread with its own session), within ``limit_s`` in all.

    link: (label, /run arguments) everyone runs first; further: the sheet's
    configurations, ``clicks`` of them drawn per participant (seeded); opening: the page opened
    on the handed-out link's example, or as a browser opens the link (``browser``) (:func:`open_page`,
    timed as a click of kind "open"; None: a client session only, untimed).
    """
    from gradio_client import Client

    rng = random.Random(seed)
    plans = [
        (
            rng.uniform(0, spread_s),
            [rng.choice(further) for _ in range(clicks)],
            [rng.uniform(*think_s) for _ in range(clicks)],
        )
        for _ in range(clients)
    ]
    done: list[Click] = []
    aside: list[threading.Thread] = []  # the pages' own /prepare, beside their clicks
    lock = threading.Lock()
    start = time.monotonic()
    origin = time.perf_counter()
    deadline = start + limit_s

    def participant(i: int) -> None:
        arrival, picks, thinks = plans[i]
        time.sleep(arrival)
        if opening is None:
            client = Client(url, verbose=False)  # opening the page: a session of its own
        else:
            client, opened = open_page(url, opening, i, origin, browser)
            with lock:
                done.append(opened)
            if client is None:
                return
            if browser:

                def prepare() -> None:
                    prepared = prepare_page(client, opening, i, origin)
                    with lock:
                        done.append(prepared)

                side = threading.Thread(target=prepare, daemon=True)
                side.start()
                aside.append(side)
        mine = [(link[0], link[1], "link")] + [(lab, args, "further") for lab, args in picks]
        for n, (label, args, kind) in enumerate(mine):
            if time.monotonic() > deadline:
                return
            c = click(client, i, kind, label, args, origin)
            with lock:
                done.append(c)
            if n < len(thinks):
                time.sleep(thinks[n])

    threads = [threading.Thread(target=participant, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1)
    for t in aside:
        t.join(max(0.0, deadline - time.monotonic()) + 1)
    with lock:
        return list(done)


@dataclass(frozen=True)
class PickExercise:
    """The sheet's Your pick link, and the document's sentences as the model reads them: (label, tokens)."""

    example: str
    question: str
    ratio: float
    text: str
    sentences: tuple[tuple[str, int], ...]
    budget: int


def pick_exercise(path: Path) -> PickExercise | None:
    """The first ``?tab=pick`` link of the sheet, its document split as the page splits it (the default
    model's tokens); None when the sheet has none."""
    from urllib.parse import parse_qsl

    from kvlab.lab.inputs import examples
    from kvlab.lab.pick import read_for_pick
    from kvlab.lab.warm import parse_sheet

    for line in path.read_text(encoding="utf-8").splitlines():
        if "tab=pick" in line and not line.lstrip().startswith("#"):
            (item, *_) = parse_sheet(line)  # checked as kvlab warm checks it
            query = dict(parse_qsl(line[line.index("?") + 1 :]))
            text = next(ex for ex in examples() if ex.id == item.example).text()
            doc = read_for_pick(text, None)
            sentences = tuple((s.label, s.n_tokens) for s in doc.sentences)
            question = query.get("question") or item.question
            return PickExercise(item.example, question, item.ratio, text, sentences, doc.budget(item.ratio))
    return None


def own_pick(exercise: PickExercise, rng: random.Random) -> list[str]:
    """A learner's pick: sentences in a random order, each ticked while the budget allows it."""
    order = list(exercise.sentences)
    rng.shuffle(order)
    ticked, used = [], 0
    for label, n_tokens in order:
        if used + n_tokens <= exercise.budget:
            ticked.append(label)
            used += n_tokens
    return ticked


def pick_click(client: Any, index: int, exercise: PickExercise, ticked: list[str], origin: float) -> Click:
    """One /pick through ``client``: the pick run, answered and ranked (its time; always computed or shared)."""
    asked = {"text": exercise.text, "ticked": ticked, "ratio": exercise.ratio, "question": exercise.question}
    c = Click(index, "pick", f"{len(ticked)} sentences at {exercise.ratio:g}x", {"ticked": ticked})
    start = time.perf_counter()
    c.started_s = start - origin
    try:
        client.predict(api_name="/pick", **asked)
        c.served = "computed"
    except Exception as exc:  # noqa: BLE001 - an error is a result of the benchmark
        c.served, c.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    c.seconds = time.perf_counter() - start
    return c


def simulate_picks(url: str, clients: int, exercise: PickExercise, window_s: float, seed: int) -> list[Click]:
    """Every participant's own pick (a session each), clicked at a random moment within ``window_s``."""
    from gradio_client import Client

    rng = random.Random(seed)
    plans = [(rng.uniform(0, window_s), own_pick(exercise, random.Random(seed * 1000 + i))) for i in range(clients)]
    done: list[Click] = []
    lock = threading.Lock()
    origin = time.perf_counter()

    def participant(i: int) -> None:
        at, ticked = plans[i]
        client = Client(url, verbose=False)
        # The learner splits the document first (the page's checkboxes get their choices), then picks.
        client.predict(text=exercise.text, ratio=exercise.ratio, api_name="/pick_read")
        time.sleep(max(0.0, at - (time.perf_counter() - origin)))
        c = pick_click(client, i, exercise, ticked, origin)
        with lock:
            done.append(c)

    threads = [threading.Thread(target=participant, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(window_s + 600)
    return done


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


#: The table's rows: each a label and which clicks it counts.
ROWS = (
    ("opening the page", lambda c: c.kind == "open"),
    ("the page's /prepare (in the background)", lambda c: c.kind == "prepare"),
    ("the handed-out link", lambda c: c.kind == "link"),
    ("a further run", lambda c: c.kind == "further"),
    ("the sheet's runs", lambda c: c.kind in ("link", "further")),
    ("a learner's own pick", lambda c: c.kind == "pick"),
    ("served from the store", lambda c: c.served == "stored"),
)


def table(clicks: list[Click]) -> list[dict]:
    """Per row of :data:`ROWS`: n, p50, p95 and max seconds, errors, and how the runs were served."""
    rows = []
    for label, counts in ROWS:
        mine = [c for c in clicks if counts(c)]
        secs = [c.seconds for c in mine if c.served != "error"]
        rows.append(
            {
                "click": label,
                "n": len(mine),
                "p50_s": round(statistics.median(secs), 2) if secs else None,
                "p95_s": round(percentile(secs, 95), 2) if secs else None,
                "max_s": round(max(secs), 2) if secs else None,
                **{how: sum(c.served == how for c in mine) for how in ("error", "stored", "shared", "computed")},
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """The table as markdown (docs/workshop.md)."""

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:g} s"

    head = (
        "| click | n | p50 | p95 | max | errors | stored | shared | computed |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(
        f"| {r['click']} | {r['n']} | {secs(r['p50_s'])} | {secs(r['p95_s'])} | {secs(r['max_s'])} | {r['error']} | "
        f"{r['stored']} | {r['shared']} | {r['computed']} |"
        for r in rows
    )


def sheet_runs(path: Path) -> tuple[tuple[str, dict], list[tuple[str, dict]], Opening]:
    """(the handed-out link, every other configuration) of a sheet, as /run arguments, and the page
    opened on the handed-out link (:class:`Opening`)."""
    from kvlab.lab.inputs import examples
    from kvlab.lab.warm import read_sheet

    texts = {ex.id: ex.text() for ex in examples()}
    sheet = read_sheet(path)
    items = [(it.label, run_args(it, texts[it.example])) for it in sheet]
    return items[0], items[1:], opening_of(sheet[0], texts[sheet[0].example])


def parser_of() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.workshop", description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--clicks", type=int, default=3, help="runs after the handed-out link, per participant")
    parser.add_argument("--sheet", type=Path, default=SHEET)
    parser.add_argument("--spread", type=float, default=20.0, help="seconds over which participants arrive")
    parser.add_argument("--think", default="5,15", help="seconds between a participant's clicks: low,high")
    parser.add_argument(
        "--together", action="store_true", help="everyone clicks the link within one second, and only it"
    )
    parser.add_argument("--url", default=None, help="a running server (default: start `python app.py`)")
    parser.add_argument("--store-dir", type=Path, default=Path("/tmp/kvlab-workshop-store"))
    parser.add_argument("--fresh-store", action="store_true", help="empty --store-dir before starting the server")
    parser.add_argument("--settle", type=float, default=40.0, help="seconds to wait after the server starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=900.0, help="the whole simulation stops after this")
    parser.add_argument("--json", type=Path, default=None, help="write every click here")
    parser.add_argument(
        "--open",
        choices=("session", "example", "browser"),
        default="example",
        help="how a participant opens the page: a client session only (untimed), the session and the handed-out "
        "link's example (/load_example, timed; the default), or as a browser opens the link (the page, its "
        "load event with the link, then /prepare in the background; timed)",
    )
    parser.add_argument("--picks", action="store_true", help="then each participant's own pick (the sheet's pick link)")
    parser.add_argument("--pick-window", type=float, default=60.0, help="seconds within which the picks are clicked")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = parser_of()
    args = parser.parse_args(argv)
    if args.clients < 1 or args.clicks < 0 or args.clients * (1 + args.clicks) > 1000:
        parser.error("--clients >= 1, --clicks >= 0, at most 1,000 requests in all")
    low, high = (float(x) for x in args.think.split(","))
    link, further, opening = sheet_runs(args.sheet)
    exercise = pick_exercise(args.sheet) if args.picks else None
    if args.picks and exercise is None:
        parser.error(f"--picks needs a ?tab=pick link in the sheet ({args.sheet} has none)")
    clicks = 0 if args.together else args.clicks
    spread = 1.0 if args.together else args.spread

    def measure(url: str) -> list[Click]:
        print(
            f"{args.clients} participants, {clicks} further click(s) each, arrivals over {spread:g} s, "
            f"thinking {low:g}-{high:g} s; {os.getloadavg()[0]:.2f} load average",
            file=sys.stderr,
        )
        done = simulate(
            url,
            args.clients,
            link,
            further,
            clicks,
            spread,
            (low, high),
            args.seed,
            args.limit_s,
            None if args.open == "session" else opening,
            args.open == "browser",
        )
        if exercise is not None:
            print(
                f"then {args.clients} own picks within {args.pick_window:g} s ({exercise.budget} tokens at "
                f"{exercise.ratio:g}x); {os.getloadavg()[0]:.2f} load average",
                file=sys.stderr,
            )
            done += simulate_picks(url, args.clients, exercise, args.pick_window, args.seed)
        return done

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.url:
        done = measure(args.url)
    else:
        from benchmarks.browser import free_port, serve_process

        if args.fresh_store:
            shutil.rmtree(args.store_dir, ignore_errors=True)
        env = {
            **os.environ,
            "GRADIO_SERVER_PORT": str(free_port()),
            "KVLAB_STORE_DIR": str(args.store_dir),
            "GRADIO_ANALYTICS_ENABLED": "False",
            "HF_HUB_OFFLINE": "1",
        }
        log_path = Path("/tmp/kvlab-workshop-server.log")
        with serve_process([sys.executable, "app.py"], ROOT, env, log_path, start_s=300) as url:
            time.sleep(args.settle)
            done = measure(url)
    rows = table(done)
    print(f"\n{started}, {len(done)} runs:\n{markdown(rows)}")
    errors = sorted({c.error for c in done if c.error})
    if errors:
        print("errors:\n" + "\n".join(f"- {e}" for e in errors))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "clicks": [asdict(c) for c in done]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
