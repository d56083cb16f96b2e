"""The CPU-only scheduler half of the runtime (no torch anywhere in this package).

``HiSparseScheduler`` (``scheduler.py``) is the public API; the parts it orders live beside
it: the block pools, the undo journal and the prefix cache.
"""

from hisparse_triton.scheduler.scheduler import (
    DEFAULT_FREE_BLOCK_WATERMARK,
    HiSparseScheduler,
    SchedulerStats,
    check_id_list,
    check_request_id,
)

__all__ = ["DEFAULT_FREE_BLOCK_WATERMARK", "HiSparseScheduler", "SchedulerStats",
           "check_id_list", "check_request_id"]
