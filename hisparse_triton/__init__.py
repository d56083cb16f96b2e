"""hisparse-triton: hierarchical sparse-attention KV offload (HiSparse) on Triton.

The planner (``specs``, ``config``, ``layout``, ``presets``) imports no torch, so the CLI's
``plan`` starts fast; the runtime, ops and kernels are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from hisparse_triton.config import EngineConfig, HiSparseConfig

__version__ = "0.1.0"

#: Public names imported lazily (they pull in torch / triton): name -> module.
_LAZY = {
    "HiSparseRuntime": "hisparse_triton.runtime",
    "HiSparseStats": "hisparse_triton.runtime",
    "HiSparseScheduler": "hisparse_triton.scheduler",
    "SchedulerStats": "hisparse_triton.scheduler",
    "StepPlan": "hisparse_triton.step_plan",
    "TableLayout": "hisparse_triton.step_plan",
    "HiSparseWorker": "hisparse_triton.worker",
    "WorkerStats": "hisparse_triton.worker",
    "CapacityError": "hisparse_triton.errors",
    "UnknownRequestError": "hisparse_triton.errors",
    "HiSparseError": "hisparse_triton.errors",
    "DuplicateRequestError": "hisparse_triton.errors",
    "ReservationExceededError": "hisparse_triton.errors",
    "RuntimeClosedError": "hisparse_triton.errors",
    "HostMemoryError": "hisparse_triton.errors",
    "BlockPoolError": "hisparse_triton.errors",
    "SharedHostPoolError": "hisparse_triton.errors",
    "BackendUnavailableError": "hisparse_triton.ops",
    "RowTable": "hisparse_triton.row_table",
    "get_hisparse_kv_cache_groups": "hisparse_triton.layout",
    "create_hisparse_layout": "hisparse_triton.layout",
    "get_hisparse_kv_cache_config": "hisparse_triton.layout",
    "get_hisparse_steady_state_concurrency": "hisparse_triton.layout",
    "HiSparseLayout": "hisparse_triton.layout",
}

__all__ = ["EngineConfig", "HiSparseConfig", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name == "ops":
        return importlib.import_module("hisparse_triton.ops")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_triton' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
