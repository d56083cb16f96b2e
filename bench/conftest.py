"""Shared state of the bench suites: the figures recorded during the run, their tables at the
end and, when a GPU ran, a JSON report under ``bench/results/``.

Figures are records in the format of ``hisparse_triton.benchmarks`` (``Figure.to_json``) plus
a ``device`` field; CPU transfer figures get their ratios to the eager and contiguous
baselines of the same case here (the library computes them for GPU figures).

Only loaded when ``bench/`` is collected explicitly (``pytest bench/...``): the default test
run collects ``tests/`` alone (``testpaths`` in pyproject.toml).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

#: Figures of this run.
FIGURES: list[dict[str, Any]] = []

RESULTS_DIR = Path(__file__).parent / "results"


def _with_ratios(figures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Transfer figures with ``vs_eager`` / ``vs_contiguous`` filled from the baselines of the
    same op, size, layers and device (where the figure has none yet)."""
    def key(f: dict[str, Any]) -> tuple:
        return (f["op"], f["device"], f["rows"], f["layers"], f["row_bytes"])

    base = {(key(f), f["method"]): f["gbps"] for f in figures if f.get("gbps")}
    out = []
    for f in figures:
        f = dict(f)
        for method, name in (("eager", "vs_eager"), ("contiguous", "vs_contiguous")):
            ref = base.get((key(f), method))
            if name not in f and ref and f.get("gbps"):
                f[name] = round(f["gbps"] / ref, 3)
        out.append(f)
    return out


def pytest_terminal_summary(terminalreporter) -> None:
    if not FIGURES:
        return
    from hisparse_triton.benchmarks.report import resolve_lines, transfer_lines

    transfers = _with_ratios([f for f in FIGURES if f["op"] != "resolve"])
    resolves = [f for f in FIGURES if f["op"] == "resolve"]
    terminalreporter.section("hisparse-triton figures (ratios to the baselines of this run)")
    for device in sorted({f["device"] for f in FIGURES}):
        lines = [f"device: {device}"]
        mine = [f for f in transfers if f["device"] == device]
        if mine:
            lines += transfer_lines(mine)
        mine = [f for f in resolves if f["device"] == device]
        if mine:
            lines += resolve_lines(mine)
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus) -> None:
    gpu = [f for f in FIGURES if f["device"] == "cuda"]
    if not gpu:
        return
    from hisparse_triton.benchmarks.environment import environment

    env = environment()
    slug = re.sub(r"[^a-z0-9]+", "-", (env.get("gpu") or "gpu").lower()).strip("-")
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"pytest-bench-{slug}.json"
    report = {"schema": "hisparse-triton/pytest-bench", "environment": env,
              "figures": _with_ratios(gpu)}
    path.write_text(json.dumps(report, indent=2) + "\n")


@pytest.fixture
def record():
    """``record(figure, device)``: add one figure record (``Figure.to_json()`` format) measured
    on ``device`` ("cpu" / "cuda"); returns it."""
    def _record(figure: dict[str, Any], device: str) -> dict[str, Any]:
        figure = {**figure, "device": device}
        FIGURES.append(figure)
        return figure
    return _record
