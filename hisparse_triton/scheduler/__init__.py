"""The CPU-only scheduler half of the runtime (no torch anywhere in this package).

``HiSparseScheduler`` (``scheduler.py``) is the public API and orders one step over its
parts: the request table (``requests``), a manager per device group (``managers``, driven
together by ``coordinator``), the counting of what each call needs (``capacity``), the
residency policy (``residency``), the block pools (``block_pool``), the prefix cache
(``prefix_cache``), the pending plan (``plan_builder``), counters (``stats``), the undo log
(``journal``) and the cross-part consistency checks (``invariants``). ``transfer`` holds
what prefill/decode disaggregation hands a transport (``KVImport``, ``KVExport``).
"""

from hisparse_triton.scheduler.requests import check_id_list, check_request_id
from hisparse_triton.scheduler.scheduler import (
    DEFAULT_FREE_BLOCK_WATERMARK,
    HiSparseScheduler,
    SchedulerStats,
)
from hisparse_triton.scheduler.transfer import KVExport, KVImport, RowCopy

__all__ = ["DEFAULT_FREE_BLOCK_WATERMARK", "HiSparseScheduler", "KVExport", "KVImport",
           "RowCopy", "SchedulerStats", "check_id_list", "check_request_id"]
