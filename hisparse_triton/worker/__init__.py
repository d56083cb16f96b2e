"""The worker half of the runtime: one ``HiSparseWorker`` per GPU rank, and its parts.

- ``worker``: ``HiSparseWorker``: construction, the memory check and the public API;
- ``tables``: the per-request int32 table arena, plan staging, ``apply`` and its undo;
- ``hot_cache``: per index group, the hot slots, their LRU order, the counters and the bound
  resolve + gather (the only part that calls ``hisparse_triton.ops`` and the kernels);
- ``mirror``: the device -> host mirror of a plan's new rows;
- ``split_gather``, ``split_capacity``: tensor-parallel ranks splitting each gather, and
  the rule that sizes its exchange by the observed miss fraction;
- ``layers``: where each layer's rows lie in the two pools;
- ``stats``: ``WorkerStats`` and reading the device counters;
- ``options``, ``placement``: constructor checks; small inputs onto the device;
- ``pools``, ``shared_pool``: the host and device byte pools and a shared pool's file (who
  may create and attach it);
- ``adopted``: tensors a serving stack allocated, checked and used as the pools;
- ``host_register``: page-locking host memory on CUDA and ROCm builds of torch;
- ``read_only``: ``ReadOnlyTensor``, the views an attached rank hands out.

Names are imported on first use, so ``import hisparse_triton.worker.shared_pool`` (the
``shm`` command) loads neither torch nor Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public names -> the module that defines them.
_EXPORTS = {
    "BACKENDS": "hisparse_triton.worker.options",
    "HiSparseWorker": "hisparse_triton.worker.worker",
    "HostEvent": "hisparse_triton.worker.hot_cache",
    "SplitGather": "hisparse_triton.worker.split_gather",
    "StreamRows": "hisparse_triton.worker.hot_cache",
    "parse_device": "hisparse_triton.worker.options",
    "plan_fingerprint": "hisparse_triton.worker.options",
    "GroupCounts": "hisparse_triton.worker.stats",
    "StatsSnapshot": "hisparse_triton.worker.stats",
    "WorkerStats": "hisparse_triton.worker.stats",
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
