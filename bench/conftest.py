"""Shared state of the transfer benchmarks: figures collected during the run, a ratio table at
the end, and (when a GPU ran) a JSON report under ``bench/results/``.

Only loaded when ``bench/`` is collected explicitly (``pytest bench/...``): the default test
run collects ``tests/`` alone (``testpaths`` in pyproject.toml).
"""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path

import pytest

#: Figures of this run: one dict per measurement (see ``bench_transfer.record``).
FIGURES: list[dict] = []

RESULTS_DIR = Path(__file__).parent / "results"


def _ratios() -> list[dict]:
    """Every figure with its ratio to the eager baseline and to the contiguous copy measured
    in the same run for the same op, size and layers."""
    def key(fig: dict) -> tuple:
        return (fig["op"], fig["device"], fig["rows"], fig["layers"], fig["row_bytes"])

    base = {(key(f), f["method"]): f["gbps"] for f in FIGURES}
    out = []
    for fig in FIGURES:
        eager = base.get((key(fig), "eager"))
        contig = base.get((key(fig), "contiguous"))
        out.append({**fig,
                    "vs_eager": round(fig["gbps"] / eager, 3) if eager else None,
                    "vs_contiguous": round(fig["gbps"] / contig, 3) if contig else None})
    return out


def pytest_terminal_summary(terminalreporter) -> None:
    if not FIGURES:
        return
    tr = terminalreporter
    tr.section("transfer throughput (GB/s; ratios to the baselines of the same run)")
    tr.write_line(f"{'op':8} {'device':6} {'rows':>7} {'L':>2} {'method':11} {'GB/s':>8} "
                  f"{'x eager':>8} {'x contig':>8}")
    for fig in _ratios():
        tr.write_line(f"{fig['op']:8} {fig['device']:6} {fig['rows']:>7} {fig['layers']:>2} "
                      f"{fig['method']:11} {fig['gbps']:>8.2f} "
                      f"{fig['vs_eager'] if fig['vs_eager'] is not None else '-':>8} "
                      f"{fig['vs_contiguous'] if fig['vs_contiguous'] is not None else '-':>8}")


def pytest_sessionfinish(session, exitstatus) -> None:
    gpu = [f for f in FIGURES if f["device"] == "cuda"]
    if not gpu:
        return
    import torch
    import triton

    name = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"transfer-{slug}.json"
    report = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "commit": os.environ.get("GIT_COMMIT"),
              "figures": [f for f in _ratios() if f["device"] == "cuda"]}
    path.write_text(json.dumps(report, indent=2) + "\n")


@pytest.fixture
def record():
    """``record(op=..., method=..., device=..., rows=..., layers=..., row_bytes=...,
    nbytes=..., seconds=...)`` adds one figure and returns its GB/s."""
    def _record(*, op, method, device, rows, layers, row_bytes, nbytes, seconds) -> float:
        gbps = nbytes / seconds / 1e9
        FIGURES.append(dict(op=op, method=method, device=device, rows=rows, layers=layers,
                            row_bytes=row_bytes, bytes=nbytes, us=round(seconds * 1e6, 2),
                            gbps=round(gbps, 3)))
        return gbps
    return _record
