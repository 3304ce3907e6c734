"""Results on disk: JSONL files that an interrupted run resumes and shards merge.

Each run appends one JSON object per result to ``results.jsonl`` (a shard K
of N to ``results-shardKofN.jsonl``) and flushes it at once, so a killed run
loses at most the result being written. Reading takes every results*.jsonl
in the folder, skips a line cut short by an interruption, and keeps one
result per key.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TypeVar

from kvlab.tasks.items import TaskError
from kvlab.tasks.runner import TaskResult, unique

RESULTS_GLOB = "results*.jsonl"
_FIELDS = {f.name for f in dataclasses.fields(TaskResult)}
T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` (1-based) of ``count``: the entries i with i % count == index - 1."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise TaskError(f"shard must be K/N with 1 <= K <= N, got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    def select(self, items: Sequence[T]) -> list[T]:
        """This shard's share of ``items`` (round robin, so every shard gets a share of every task)."""
        return [it for i, it in enumerate(items) if i % self.count == self.index - 1]

    @property
    def suffix(self) -> str:
        return f"-shard{self.index}of{self.count}"


def results_path(out: Path, shard: Shard | None = None) -> Path:
    """The JSONL file this run appends to."""
    return Path(out) / f"results{shard.suffix if shard else ''}.jsonl"


def _parse(line: str) -> TaskResult | None:
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or set(data) < _FIELDS:
        return None
    return TaskResult(**{k: data[k] for k in _FIELDS})


def read_results(out: Path) -> list[TaskResult]:
    """Every result in ``out``'s results*.jsonl files, one per key."""
    results = []
    for path in sorted(Path(out).glob(RESULTS_GLOB)):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and (r := _parse(line)) is not None:
                results.append(r)
    return unique(results)


class ResultWriter:
    """Appends results to one JSONL file, one flushed line each."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A run killed mid-line leaves no newline: start on a fresh line so the next result parses.
        cut = self.path.exists() and self.path.stat().st_size > 0 and not self.path.read_bytes().endswith(b"\n")
        self._file = self.path.open("a", encoding="utf-8")
        if cut:
            self._file.write("\n")

    def write(self, result: TaskResult) -> None:
        self._file.write(json.dumps(result.to_dict()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
