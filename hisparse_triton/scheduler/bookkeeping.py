"""What a scheduler's bookkeeping costs in RAM, checked before any of it is built (no torch).

A stack runs the scheduler in its own process, so it checks its own memory: a plan with a
huge block count fails with one clear ``HostMemoryError`` naming every item, never a bare
``MemoryError`` or gigabytes of tables built first. Fixed costs (allocated once, at
construction):

| item | bytes |
| --- | --- |
| each block pool (device, host) | ``BYTES_PER_POOL_BLOCK`` (24) per block |
| the paged groups' block tables | 4 per ``max_num_seqs`` x block-table column |
| the requests' host block lists (at most) | ``BYTES_PER_HOST_ENTRY`` (48) per ``max_num_seqs`` x host page |
| the requests' lengths (``RequestColumns``) | ``BYTES_PER_STATE_ROW`` (58) per ``max_num_seqs`` |

Costs that grow with use are small and bounded by what is live: a pending plan (a few
dozen bytes per table entry written), a prefix-cache entry (about 400 B per published page)
and, for a request added with ``token_ids``, about 36 B per known token id.
"""

from __future__ import annotations

from hisparse_triton import memory
from hisparse_triton.errors import HostMemoryError
from hisparse_triton.groups import PlanGroups
from hisparse_triton.step_plan import TableLayout

#: ``BlockPool``: reference and reader counts and the two free queues' links (6 int32).
BYTES_PER_POOL_BLOCK = 24
#: A request's host block list entry: a list slot, a Python int, an int64 array copy, and
#: its int32 entry in the request columns' host table.
BYTES_PER_HOST_ENTRY = 48
#: The request columns' entries of a state row: seven int64 numbers and two flags.
BYTES_PER_STATE_ROW = 58


def bookkeeping_items(groups: PlanGroups, layout: TableLayout, *, num_device_blocks: int,
                      num_host_blocks: int, max_num_seqs: int) -> list[tuple[str, int]]:
    """``(what, bytes)`` of every fixed allocation a scheduler makes (module docstring)."""
    columns = sum(g.width for g in groups.groups if g.paged)
    return [
        ("device block pool", BYTES_PER_POOL_BLOCK * num_device_blocks),
        ("host block pool", BYTES_PER_POOL_BLOCK * num_host_blocks),
        ("block tables", 4 * max_num_seqs * columns),
        ("request host block lists", BYTES_PER_HOST_ENTRY * max_num_seqs * layout.host_width),
        ("request lengths", BYTES_PER_STATE_ROW * max_num_seqs),
    ]


def check_plan(groups: PlanGroups, layout: TableLayout, *, device_buffer_size: int,
               num_device_blocks: int, num_host_blocks: int, max_num_seqs: int,
               host_ram_fraction: float = 0.9) -> None:
    """What a scheduler checks of its plan before building anything: hot regions that hold
    ``device_buffer_size`` rows, a host pool of at least 2 blocks, and the bookkeeping
    against RAM (``check_bookkeeping``). ``ValueError`` / ``HostMemoryError``."""
    B = groups.block_size
    hot_widths = [g.width for g in groups.hot]
    if hot_widths and min(hot_widths) * B < device_buffer_size:
        raise ValueError(f"hot groups hold {min(hot_widths)} blocks of {B} rows, fewer "
                         f"than device_buffer_size={device_buffer_size}.")
    if num_host_blocks < 2:
        raise ValueError(f"the host pool needs at least 2 blocks (the null block and one "
                         f"page), the plan has {num_host_blocks}.")
    check_bookkeeping(bookkeeping_items(groups, layout, num_device_blocks=num_device_blocks,
                                        num_host_blocks=num_host_blocks,
                                        max_num_seqs=max_num_seqs), host_ram_fraction)


def check_bookkeeping(items: list[tuple[str, int]], max_ram_fraction: float = 0.9) -> None:
    """``HostMemoryError`` naming every item unless they fit ``max_ram_fraction`` of the RAM
    this process can still get (``memory.available_ram_bytes``); allocates nothing."""
    memory.check_fraction(max_ram_fraction, "host_ram_fraction")
    needed = sum(nbytes for _, nbytes in items)
    available = memory.available_ram_bytes()
    if needed > max_ram_fraction * available:
        listed = " + ".join(f"{what} {memory.format_bytes(n)}" for what, n in items)
        raise HostMemoryError(
            f"the scheduler's bookkeeping ({listed} = {memory.format_bytes(needed)}) exceeds "
            f"{memory.format_fraction(max_ram_fraction)} of the available RAM "
            f"({memory.format_bytes(available)}); lower num_gpu_blocks_override, "
            f"host_pool_gib or max_num_seqs.", resource="host RAM bytes", needed=needed,
            available=available)


__all__ = ["BYTES_PER_HOST_ENTRY", "BYTES_PER_POOL_BLOCK", "BYTES_PER_STATE_ROW",
           "bookkeeping_items", "check_bookkeeping", "check_plan"]
