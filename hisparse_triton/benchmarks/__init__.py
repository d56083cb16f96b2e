"""The measurement library behind ``hisparse-triton bench`` (and ``tune``,
``bench/gpu_check.py`` and the pytest-benchmark suites under ``bench/``): what a user
measures on their own GPU. What measures the project itself (host cost with stubbed
launches, the stand-in driver, instruction counts, the decode checks) is the lab in
``bench/lab/`` of a source checkout, not part of the package.

What is measured (docs/benchmarking.md has the user's view):

- transfers (``transfers``): ``gather`` / ``backup`` rows and ``restore`` / ``spill`` pages in
  GB/s of payload, for the Triton kernels (per launch, and replayed from a CUDA graph), the
  torch backend, and two baselines measured in the same run: torch eager (``index_select`` +
  one copy + ``index_copy_``) and a contiguous pinned copy of the same bytes (the link
  ceiling);
- ``resolve`` (``resolve``): latency of one decode step from the same warm state each call,
  at a prescribed miss ratio;
- where the H200 performance targets stand (``targets``).

Modules, one job each: ``registry`` (the ops every tool measures or tunes), ``settings``
(the sweep), ``environment`` (GPU, driver, versions), ``timing`` (medians, L2 flush,
rotation, CUDA graphs), ``workloads`` (pools, plans, resolve state), ``figures`` (a measured
point), ``transfers`` / ``resolve`` (the measurements), ``noise`` (how far the run can
trust each figure: spread, a CPU-speed probe, the load), ``runner`` (``run_bench``),
``tuner`` (the launch-config search of ``tune``), ``targets``, ``report`` (the table),
``plot``, ``progress``, ``decode_step`` (a whole decode step on a GPU, eager and replayed
from a CUDA graph: ``bench --decode-step``).

The names below are loaded on first use (PEP 562), so that importing a torch-free module of
this package (``registry``, ``settings``, ``targets``, ``report``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("environment",), "environment"),
    **dict.fromkeys(("Figure",), "figures"),
    **dict.fromkeys(("MissingPlotDependency", "plot_available", "write_plot"), "plot"),
    **dict.fromkeys(("Progress",), "progress"),
    **dict.fromkeys(("format_table",), "report"),
    **dict.fromkeys(("ResolveBench",), "resolve"),
    **dict.fromkeys(("count_steps", "iter_figures", "run_bench"), "runner"),
    **dict.fromkeys(("ALL_OPS", "BENCH_OPS", "BenchOp", "DIRECTION", "PAGE_OPS", "ROW_OPS",
                     "TRANSFER_OPS", "TUNABLE_OPS", "op_names"), "registry"),
    **dict.fromkeys(("BASELINES", "BLOCK_SIZE", "DEFAULT_MISS_RATIOS", "GRAPH_METHOD",
                     "KERNEL_METHODS", "KERNELS_NEED_GPU", "METHODS", "SCHEMA", "VERSION",
                     "BenchSettings", "override"), "settings"),
    **dict.fromkeys(("evaluate_targets", "target_lines"), "targets"),
    **dict.fromkeys(("Rotation", "Timing", "capture_graph", "device_time", "event_time",
                     "gbps", "wall_time"), "timing"),
    **dict.fromkeys(("TransferBench",), "transfers"),
    **dict.fromkeys(("Pools", "ResolveWorkload", "RowPlans", "device_flat_rows",
                     "host_flat_rows", "make_page_plans", "make_pools", "make_row_plans",
                     "plan_geometry", "plan_variants"), "workloads"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
