"""Device -> host row write-through and whole-page spill.

Both are launches of the shared span-copy kernel (``gather.copy_rows_kernel``; launch shape,
access width and bounds rules are documented there) in the other direction, with the defaults
of ``tuning.default_config("backup" | "spill", ...)``: a write-through mirrors a few new rows
per request into every source layer (61-78 layers in one launch), so its default spreads the
layers over grid axis 1 in groups of 4 layers per program.
"""

from __future__ import annotations

from typing import Optional

import torch

from hisparse_triton.kernels.gather import launch_copy
from hisparse_triton.row_table import RowTable
from hisparse_triton.tuning import CopyConfig

__all__ = ["backup_rows", "spill_pages"]


def backup_rows(dst: RowTable, src: RowTable, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                counts: Optional[torch.Tensor] = None,
                config: Optional[CopyConfig] = None) -> None:
    """Device -> host rows of all source layers in one launch (``reference.copy_rows``
    semantics).

    ``src`` is the device pool's table, ``dst`` the host pool's (pinned CPU memory on CUDA);
    ``src_rows``/``dst_rows``: ``[R, K]`` or ``[L, R, K] int32`` device/host row ids,
    ``counts``: ``[R] int32`` or None, on the kernel's device. ``config`` defaults to
    ``default_config("backup", row_bytes, num_layers)``.
    """
    launch_copy(dst, src, src_rows, dst_rows, counts, pages=False, kernel="backup",
                config=config)


def spill_pages(dst: RowTable, src: RowTable, src_blocks: torch.Tensor,
                dst_blocks: torch.Tensor, counts: Optional[torch.Tensor] = None,
                config: Optional[CopyConfig] = None) -> None:
    """Device -> host whole pages (``reference.copy_pages`` semantics), one launch.

    Block-id plans ``[R, K]`` / ``[L, R, K] int32``; ``config`` defaults to
    ``default_config("spill", block_size * row_bytes, num_layers)``.
    """
    launch_copy(dst, src, src_blocks, dst_blocks, counts, pages=True, kernel="spill",
                config=config)
