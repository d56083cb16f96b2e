"""The worker half of the runtime: one ``HiSparseWorker`` per GPU rank, and its parts.

- ``worker``: ``HiSparseWorker``: pools, device tables, apply / resolve_rows / mirror;
- ``pools``, ``shared_pool``: the host and device byte pools and a shared pool's file.

Names are imported on first use, so ``import hisparse_triton.worker.shared_pool`` (the
``shm`` command) loads neither torch nor Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public names -> the module that defines them.
_EXPORTS = {
    "BACKENDS": "hisparse_triton.worker.worker",
    "HiSparseWorker": "hisparse_triton.worker.worker",
    "parse_device": "hisparse_triton.worker.worker",
    "plan_fingerprint": "hisparse_triton.worker.worker",
    "StatsSnapshot": "hisparse_triton.worker.worker",
    "WorkerStats": "hisparse_triton.worker.worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse_triton.worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
