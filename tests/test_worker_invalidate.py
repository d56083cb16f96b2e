"""The plan's ``invalidate`` section: hot slots holding dropped host rows become empty.

The device path (``HotState.invalidate``: whole-tensor torch ops) is checked bit-exactly
against a per-entry Python reference, through ``PlanTables`` (applied after the resets, with
the writes, undone by ``revert``), and through a worker on both backends: an emptied slot is
reused before any held row is evicted and a later resolve of a dropped position gathers it
again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_triton.step_plan import StepPlan
from hisparse_triton.worker.hot_cache import HotState
from tests.worker_helpers import B, L0, make_pair, prefill


def invalidate_reference(slot_host_rows: list, lru: list, entries) -> tuple[list, list]:
    """``[G][S][H]`` lists after the entries ``(row, lo, hi)``: one entry at a time."""
    slots = [[list(r) for r in g] for g in slot_host_rows]
    order = [[list(r) for r in g] for g in lru]
    touched = set()
    for row, lo, hi in entries:
        touched.add(row)
        for g in range(len(slots)):
            slots[g][row] = [-1 if lo <= h < hi else h for h in slots[g][row]]
    for row in touched:
        for g in range(len(slots)):
            held = slots[g][row]
            order[g][row] = ([s for s in order[g][row] if held[s] < 0]
                             + [s for s in order[g][row] if held[s] >= 0])
    return slots, order


def random_state(gen: np.random.Generator, G: int, S: int, H: int) -> HotState:
    state = HotState(G, S, H, torch.device("cpu"))
    held = gen.integers(-1, 40, size=(G, S, H))
    state.slot_host_rows.copy_(torch.from_numpy(held.astype(np.int32)))
    perms = np.stack([[gen.permutation(H) for _ in range(S)] for _ in range(G)])
    state.lru.copy_(torch.from_numpy(perms.astype(np.int32)))
    return state


@pytest.mark.parametrize("seed", range(20))
def test_invalidate_matches_the_reference_with_repeated_rows_and_overlaps(seed):
    gen = np.random.default_rng(seed)
    G, S, H = 3, 5, 8
    state = random_state(gen, G, S, H)
    n = int(gen.integers(1, 7))
    entries = []
    for _ in range(n):
        lo = int(gen.integers(0, 40))
        entries.append((int(gen.integers(0, S)), lo, lo + int(gen.integers(0, 12))))
    expected = invalidate_reference(state.slot_host_rows.tolist(), state.lru.tolist(), entries)
    table = np.asarray(entries, dtype=np.int32)
    rows, entry_row = np.unique(table[:, 0], return_inverse=True)
    state.invalidate(torch.from_numpy(rows.astype(np.int32)),
                     torch.from_numpy(entry_row.reshape(-1).astype(np.int32)),
                     torch.from_numpy(table[:, 1].copy()), torch.from_numpy(table[:, 2].copy()))
    assert (state.slot_host_rows.tolist(), state.lru.tolist()) == expected
    for g in range(G):                                  # every LRU row stays a permutation
        for s in range(S):
            assert sorted(state.lru[g, s].tolist()) == list(range(H))


def test_invalidate_applies_after_resets_and_reverts_exactly():
    scheduler, worker = make_pair(max_num_seqs=2)
    gen = torch.Generator().manual_seed(0)
    with worker:
        prefill(scheduler, worker, "a", 24, gen)
        row = scheduler.state_row("a")
        state_rows = torch.tensor([row], dtype=torch.int32)
        topk = torch.arange(0, 16, 2, dtype=torch.int32).view(1, 8)
        for leader in scheduler.leaders:
            worker.resolve_rows(leader, state_rows, topk)
        held = worker.hot_slots(L0)[row].clone()
        assert (held >= 0).sum() == 8
        base = scheduler.step()
        host_block = scheduler.host_block_table("a")[1]     # page 1: positions 4..7
        lo, hi = host_block * B, host_block * B + B
        plan = StepPlan.build(step=base.step, layout=base.layout, commit=base.commit,
                              reset_rows=base.reset_rows, write_index=base.write_index,
                              write_value=base.write_value,
                              mirror_host_rows=base.mirror_host_rows,
                              mirror_device_rows=base.mirror_device_rows, lost=base.lost,
                              invalidate=[[row, lo, hi]])
        before = worker._debug_snapshot()
        worker.apply(plan)
        for leader in scheduler.leaders:
            slots = worker.hot_slots(leader)[row]
            order = worker.hot_order(leader)[row]
            dropped = [s for s in range(slots.numel())
                       if lo <= int(held[s]) < hi]
            assert len(dropped) == 2                     # positions 4 and 6
            assert all(int(slots[s]) == -1 for s in dropped)
            empty = [int(s) for s in order if int(slots[int(s)]) < 0]
            assert order[:len(empty)].tolist() == empty  # empty slots come first
        worker.revert(plan)
        assert worker._debug_snapshot() == before


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_dropped_row_is_gathered_again_and_emptied_slots_are_reused_first(backend):
    """Both backends end in the same hot state and read the host bytes of every column."""
    states = {}
    for kernel in ("torch", backend):
        scheduler, worker = make_pair(max_num_seqs=2, backend=kernel)
        gen = torch.Generator().manual_seed(3)
        with worker:
            prefill(scheduler, worker, "a", 40, gen)
            row = scheduler.state_row("a")
            state_rows = torch.tensor([row], dtype=torch.int32)
            first = torch.arange(0, 32, 2, dtype=torch.int32).view(1, 16)  # fills 16 slots
            worker.resolve_rows(L0, state_rows, first)
            blocks = scheduler.host_block_table("a")
            base = scheduler.step()
            plan = StepPlan.build(
                step=base.step, layout=base.layout, commit=base.commit,
                reset_rows=base.reset_rows, write_index=base.write_index,
                write_value=base.write_value, mirror_host_rows=base.mirror_host_rows,
                mirror_device_rows=base.mirror_device_rows, lost=base.lost,
                invalidate=[[row, blocks[2] * B, blocks[2] * B + B],    # positions 8, 10
                            [row, blocks[5] * B + 2, blocks[5] * B + 3]])  # position 22
            worker.apply(plan)
            worker.mirror(plan)
            hit_before = worker.stats()
            # Three new positions: they take the three emptied slots, no held row is evicted.
            second = torch.tensor([[0, 2, 4, 6, 12, 14, 16, 18, 20, 24, 26, 28, 30, 1, 3, 5]],
                                  dtype=torch.int32)
            rows = worker.resolve_rows(L0, state_rows, second).clone()
            stats = worker.stats()
            assert stats.misses - hit_before.misses == 3
            slots = worker.hot_slots(L0)[row].tolist()
            kept = {blocks[p // B] * B + p % B for p in range(0, 32, 2) if p not in (8, 10, 22)}
            new = {blocks[p // B] * B + p % B for p in (1, 3, 5)}
            assert set(slots) == kept | new             # no held row was evicted
            host = worker.host_cache(L0).reshape(-1, worker.host_cache(L0).shape[2])
            device = worker.device_cache(L0).reshape(-1, worker.device_cache(L0).shape[2])
            for col, pos in enumerate(second[0].tolist()):
                r = int(rows[0, col])
                assert torch.equal(device[r], host[blocks[pos // B] * B + pos % B])
            states[kernel] = (worker.hot_slots(L0).tolist(), worker.hot_order(L0).tolist(),
                              rows.tolist())
    assert states["torch"] == states[backend]


def test_describe_names_the_invalidated_ranges():
    plan = StepPlan.build(step=1, layout=0, commit=False, reset_rows=[], write_index=[],
                          write_value=[], mirror_host_rows=[],
                          mirror_device_rows=np.zeros((1, 0)), lost=np.zeros((0, 3)),
                          invalidate=[[1, 8, 12], [1, 16, 20], [0, 4, 8]])
    assert plan.num_invalidate == 3 and plan.invalidate[1].tolist() == [1, 16, 20]
    assert "3 hot-slot ranges invalidated (state rows [0, 1])" in plan.describe()
    assert StepPlan.from_bytes(plan.to_bytes()) == plan
