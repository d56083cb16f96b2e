"""The scheduler's bookkeeping rules, checked across its parts (``check_invariants``).

Each part checks its own rules (``BlockPool.check_invariants``, the managers', the request
table's, the prefix cache's); this module adds the rules that tie them together:

- every pool reference count equals the references the owners hold (device: the managers'
  block tables and hot regions; host: the requests' host blocks);
- every reader count equals the readers registered (device: unpinned resident pages and
  published pages; host: published pages);
- the hot reservations are backed: at least as many free device blocks (some may be held
  for rows read in place until the step ends);
- an offloaded request has a region in every hot group.
No torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hisparse_triton.errors import SchedulerStateError

if TYPE_CHECKING:  # pragma: no cover
    from hisparse_triton.scheduler.scheduler import HiSparseScheduler


def _counts(blocks: list[int], size: int) -> np.ndarray:
    return np.bincount(np.asarray(blocks, dtype=np.int64), minlength=size)[:size]


def _compare(name: str, what: str, expected: np.ndarray, found: np.ndarray) -> list[str]:
    bad = np.flatnonzero(expected != found)
    if not bad.size:
        return []
    b = int(bad[0])
    return [f"{name} pool: {bad.size} block(s) with a wrong {what}, e.g. block {b}: "
            f"{int(found[b])}, its holders account for {int(expected[b])}"]


def scheduler_problems(s: "HiSparseScheduler") -> list[str]:
    """Every broken rule of ``s``, as messages (empty: consistent)."""
    problems: list[str] = []
    for pool in (s.device_block_pool, s.host_block_pool):
        try:
            pool.check_invariants()
        except SchedulerStateError as error:
            problems.append(str(error))
    live = list(s._requests.values())
    problems += s._requests.check_invariants(s.block_size)
    devices = s.devices
    for m in devices.managers:
        problems += m.check_invariants(live)
    problems += s._prefix.check_invariants()

    dev, host = s.device_block_pool, s.host_block_pool
    owned = [b for m in devices.managers for b in m.owned_blocks(live)]
    owned += s.read_holds.kept_blocks()    # dropped pages a resolve read, until the step ends
    problems += _compare("device", "reference count", _counts(owned, dev.num_blocks),
                         dev._ref_array)
    host_owned = [b for req in live for b in req.host_blocks]
    problems += _compare("host", "reference count", _counts(host_owned, host.num_blocks),
                         host._ref_array)
    readers = _counts(s._prefix.device_blocks(), dev.num_blocks)
    for m in devices.resident:
        for block, count in m.reader_counts().items():
            readers[block] += count
    problems += _compare("device", "reader count", readers, dev._readers_array)
    problems += _compare("host", "reader count",
                         _counts(s._prefix.host_blocks(), host.num_blocks),
                         host._readers_array)
    if dev.num_free < devices.reserved:
        problems.append(f"the hot reservations ({devices.reserved} blocks) exceed the "
                        f"{dev.num_free} free device blocks")
    positions = sorted(m.position for m in devices.hot)
    for req in live:
        if req.hot is not None and sorted(req.hot) != positions:
            problems.append(f"request {req.request_id!r}: hot regions in groups "
                            f"{sorted(req.hot)}, expected {positions}")
    return problems


def scheduler_snapshot(s: "HiSparseScheduler") -> dict:
    """Every piece of ``s``'s mutable state as comparable values (tests: a failed call
    changes nothing)."""
    requests, free_rows = s._requests.snapshot()
    state: dict = {("request", rid): snap for rid, snap in requests.items()}
    for pool in (s.device_block_pool, s.host_block_pool):
        state[("pool", pool.name)] = pool.snapshot()
    state["managers"] = s.devices.snapshot()
    state["pending"] = s.plan_builder.snapshot()
    state["cache"] = s._prefix.snapshot()
    state["holds"] = s.read_holds.snapshot()
    state["misc"] = (free_rows, s.counters.snapshot())
    return state


__all__ = ["scheduler_problems", "scheduler_snapshot"]
