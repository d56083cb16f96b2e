"""The measurement library behind ``hisparse-triton bench`` (and ``tune``,
``bench/gpu_check.py`` and the pytest-benchmark suites under ``bench/``).

What is measured (docs/benchmarking.md has the user's view):

- transfers (``transfers``): ``gather`` / ``backup`` rows and ``restore`` / ``spill`` pages in
  GB/s of payload, for the Triton kernels (per launch, and replayed from a CUDA graph), the
  torch backend, and two baselines measured in the same run: torch eager (``index_select`` +
  one copy + ``index_copy_``) and a contiguous pinned copy of the same bytes (the link
  ceiling);
- ``resolve`` (``resolve``): latency of one decode step from the same warm state each call,
  at a prescribed miss ratio;
- where the H200 performance targets stand (``targets``).

Modules, one job each: ``settings`` (the sweep), ``environment`` (GPU, driver, versions),
``timing`` (medians, L2 flush, rotation, CUDA graphs), ``workloads`` (pools, plans, resolve
state), ``figures`` (a measured point), ``transfers`` / ``resolve`` (the measurements),
``runner`` (``run_bench``), ``targets``, ``report`` (the table), ``plot``, ``progress``.
"""

from __future__ import annotations

from hisparse_triton.benchmarks.environment import environment
from hisparse_triton.benchmarks.figures import Figure
from hisparse_triton.benchmarks.plot import MissingPlotDependency, plot_available, write_plot
from hisparse_triton.benchmarks.progress import Progress
from hisparse_triton.benchmarks.report import format_table
from hisparse_triton.benchmarks.resolve import ResolveBench
from hisparse_triton.benchmarks.runner import count_steps, iter_figures, run_bench
from hisparse_triton.benchmarks.settings import (
    ALL_OPS,
    BASELINES,
    BLOCK_SIZE,
    DEFAULT_MISS_RATIOS,
    DIRECTION,
    GRAPH_METHOD,
    KERNEL_METHODS,
    KERNELS_NEED_GPU,
    METHODS,
    PAGE_OPS,
    ROW_OPS,
    SCHEMA,
    TRANSFER_OPS,
    VERSION,
    BenchSettings,
    override,
)
from hisparse_triton.benchmarks.targets import evaluate_targets, target_lines
from hisparse_triton.benchmarks.timing import (
    Rotation,
    Timing,
    capture_graph,
    device_time,
    event_time,
    gbps,
    wall_time,
)
from hisparse_triton.benchmarks.transfers import TransferBench
from hisparse_triton.benchmarks.workloads import (
    Pools,
    ResolveWorkload,
    RowPlans,
    device_flat_rows,
    host_flat_rows,
    make_page_plans,
    make_pools,
    make_row_plans,
    plan_geometry,
    plan_variants,
)

__all__ = [
    "ALL_OPS", "BASELINES", "BLOCK_SIZE", "DEFAULT_MISS_RATIOS", "DIRECTION", "GRAPH_METHOD",
    "KERNEL_METHODS", "KERNELS_NEED_GPU", "METHODS", "PAGE_OPS", "ROW_OPS", "SCHEMA",
    "TRANSFER_OPS", "VERSION",
    "BenchSettings", "Figure", "MissingPlotDependency", "Pools", "Progress", "ResolveBench",
    "ResolveWorkload", "Rotation", "RowPlans", "Timing", "TransferBench", "capture_graph",
    "count_steps", "device_flat_rows", "device_time", "environment", "evaluate_targets",
    "event_time", "format_table", "gbps", "host_flat_rows", "iter_figures", "make_page_plans",
    "make_pools", "make_row_plans", "override", "plot_available", "plan_geometry",
    "plan_variants", "run_bench", "target_lines", "wall_time", "write_plot",
]
