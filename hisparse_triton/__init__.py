"""hisparse-triton: hierarchical sparse-attention KV offload (HiSparse) on Triton.

The planner (``specs``, ``config``, ``layout``, ``presets``) imports no torch, so the CLI's
``plan`` starts fast; the runtime, ops and kernels are imported on first use, after a check
that the installed torch and Triton are supported (``hisparse_triton.compat``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from pathlib import Path
from typing import Any

from hisparse_triton.config import EngineConfig, HiSparseConfig


def _version() -> str:
    """The version of the installed distribution; from a source tree that is not installed,
    the ``version`` in its ``pyproject.toml``; else ``"0+unknown"``."""
    try:
        return importlib.metadata.version("hisparse-triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text("utf-8")
    except OSError:
        return "0+unknown"
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project and re.search(r'^name\s*=\s*"hisparse-triton"', project.group(1), re.M):
        found = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
        if found:
            return found.group(1)
    return "0+unknown"


__version__ = _version()

#: Public names imported lazily: name -> module. Names from ``_TORCH_MODULES`` import torch
#: (and may import Triton), so the versions are checked first.
_LAZY = {
    "HiSparseRuntime": "hisparse_triton.runtime",
    "HiSparseStats": "hisparse_triton.runtime",
    "HiSparseScheduler": "hisparse_triton.scheduler",
    "SchedulerStats": "hisparse_triton.scheduler",
    "KVImport": "hisparse_triton.scheduler",
    "KVExport": "hisparse_triton.scheduler",
    "RowCopy": "hisparse_triton.scheduler",
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
    "ReadOnlyViewError": "hisparse_triton.errors",
    "UnsupportedVersionError": "hisparse_triton.errors",
    "PrefillStagingError": "hisparse_triton.errors",
    "BackendUnavailableError": "hisparse_triton.ops",
    "RowTable": "hisparse_triton.row_table",
    "MemoryRequest": "hisparse_triton.memory",
    "check_memory": "hisparse_triton.memory",
    "HostPool": "hisparse_triton.worker.pools",
    "DevicePool": "hisparse_triton.worker.pools",
    "get_hisparse_kv_cache_groups": "hisparse_triton.layout",
    "create_hisparse_layout": "hisparse_triton.layout",
    "get_hisparse_kv_cache_config": "hisparse_triton.layout",
    "get_hisparse_steady_state_concurrency": "hisparse_triton.layout",
    "HiSparseLayout": "hisparse_triton.layout",
}
_TORCH_MODULES = frozenset({"hisparse_triton.runtime", "hisparse_triton.ops",
                            "hisparse_triton.row_table", "hisparse_triton.memory",
                            "hisparse_triton.worker.pools"})

__all__ = ["EngineConfig", "HiSparseConfig", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = "hisparse_triton.ops" if name == "ops" else _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_triton' has no attribute {name!r}")
    if module in _TORCH_MODULES:
        from hisparse_triton.compat import check_versions

        check_versions()
    loaded = importlib.import_module(module)
    value = loaded if name == "ops" else getattr(loaded, name)
    globals()[name] = value  # later lookups skip __getattr__ (and the check)
    return value
