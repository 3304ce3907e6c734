"""``python -m benchmarks.gpu_check --dry-run``: every section of the GPU run, on tiny sizes, on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_check
from kvlab.methods import REGISTRY

pytestmark = pytest.mark.slow  # the GPU script's whole dry run: left out of make test-fast


def test_the_dry_run_runs_every_section_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["dry_run"] is True
    assert [r["step"] for r in figures["suite"]] == list(gpu_check.DRY_RUN_STEPS)
    assert all(r["status"] == "ok" for r in figures["suite"] + figures["explore"])
    ran = {(r["model"], r["method"]) for r in figures["explore"]}
    assert ran == {(m, name) for m in ("Llama-3.1-8B", "Qwen3-8B") for name in REGISTRY}
    # Each run really compressed: fewer bytes than the full cache, except where no key is dropped.
    assert all(r["bytes_compressed"] < r["bytes_full"] for r in figures["explore"])
    assert figures["kernels"] and figures["decode"]
    assert {r["cache"] for r in figures["decode"]} == {"full", "compacted 4x", "compacted 10x"}


def test_only_runs_the_named_sections_and_refuses_unknown_ones(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--only", "decode", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["decode"] and not {"suite", "explore", "kernels", "kernel_checks"} & set(figures)
    with pytest.raises(SystemExit) as refused:
        gpu_check.main(["--dry-run", "--only", "decode,nonsense", "--out", str(out)])
    assert refused.value.code == 2
