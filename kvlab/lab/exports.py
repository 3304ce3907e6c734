"""A sweep written out: CSV rows (flat) and JSON (every number, per-head errors included)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlab.lab.compare import Sweep

#: The CSV export's columns: RunResult fields (plus the method's query-awareness).
EXPORT_FIELDS = [
    "model",
    "question",
    "method",
    "ratio",
    "query_aware",
    "doc_tokens",
    "context_tokens",
    "kept_tokens_mean",
    "bytes_full",
    "bytes_compressed",
    "memory_ratio",
    "attn_output_rel_err",
    "attn_output_rel_err_weighted",
    "attn_mass_rel_err",
    "budgets",
    "logppl_full",
    "logppl_compressed",
    "prefill_s",
    "compress_s",
    "answer_full_s",
    "answer_compressed_s",
    "answer_full",
    "answer_compressed",
]
#: Downloads older than this (seconds) are removed from the export folder.
EXPORT_KEEP_S = 3600


def sweep_records(sweep: Sweep) -> list[dict[str, Any]]:
    """One flat record per run (the CSV rows): EXPORT_FIELDS of each RunResult."""
    out = []
    for r, aware in zip(sweep.results, sweep.query_aware):
        row = {**r.to_dict(), "query_aware": aware, "budgets": r.details.get("budgets", "")}
        out.append({k: row[k] for k in EXPORT_FIELDS})
    return out


def sweep_json(sweep: Sweep) -> dict[str, Any]:
    """The JSON export: the setting, every run's full RunResult (per-head errors included), and failures."""
    return {
        "kvlab": "compare",
        "model": sweep.model,
        "question": sweep.question,
        "doc_tokens": sweep.doc_tokens,
        "context_tokens": sweep.context_tokens,
        "answer_full": sweep.answer_full,
        "logppl_full": sweep.logppl_full,
        "prefill_s": sweep.prefill_s,
        "methods": list(dict.fromkeys(r.method for r in sweep.results)),
        "ratios": sorted({r.ratio for r in sweep.results}),
        "results": [{**r.to_dict(), "query_aware": a} for r, a in zip(sweep.results, sweep.query_aware)],
        "errors": [dataclasses.asdict(e) for e in sweep.errors],
        "ceilings": [dataclasses.asdict(c) for c in sweep.ceilings],  # each model's full cache, on a sweep over several
    }


_EXPORT_DIR: Path | None = None


def export_dir() -> Path:
    """A per-process folder for downloads; files older than EXPORT_KEEP_S are removed."""
    global _EXPORT_DIR
    if _EXPORT_DIR is None or not _EXPORT_DIR.is_dir():
        _EXPORT_DIR = Path(tempfile.mkdtemp(prefix="kvlab_exports_"))
    now = time.time()
    for old in _EXPORT_DIR.iterdir():
        try:
            if now - old.stat().st_mtime > EXPORT_KEEP_S:
                old.unlink()
        except OSError:
            pass
    return _EXPORT_DIR


def write_exports(sweep: Sweep, folder: Path | None = None, stem: str | None = None) -> tuple[str, str]:
    """Write the sweep as CSV and JSON files in ``folder`` (default: export_dir()); returns their paths.

    stem: the files' name without extension (default: a timestamped unique name).
    """
    folder = Path(folder) if folder is not None else export_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stem = stem or f"kvlab_compare_{time.strftime('%Y%m%d-%H%M%S')}_{os.urandom(3).hex()}"
    csv_path, json_path = folder / f"{stem}.csv", folder / f"{stem}.json"
    with csv_path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=EXPORT_FIELDS)
        writer.writeheader()
        writer.writerows(sweep_records(sweep))
    json_path.write_text(json.dumps(sweep_json(sweep), indent=1), encoding="utf-8")
    return str(csv_path), str(json_path)
