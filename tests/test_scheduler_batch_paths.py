"""The scheduler's batch paths against their one-request-at-a-time definitions (no torch).

``append_decode`` counts and grows a plain decode batch (one token each, no token ids,
every started page fitting) over the whole batch (``Capacity.plain_decode``), and
``step()`` commits and schedules every request's tokens at once (``make_durable``,
``schedule_mirror``). A reference scheduler runs the same random calls through the general
decode path and the per-request step written here as it was before the batch paths; every
result, error, plan (byte for byte) and state must agree. Inside a caller's transaction a
fault at any line of these calls leaves the state as it was.
"""

from __future__ import annotations

import random
from functools import partial

import numpy as np
import pytest

from tests.fault_points import sweep
from hisparse_triton.errors import CapacityError, ReservationExceededError
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.scheduler.plan_builder import mirror_rows
from hisparse_triton.specs import FullAttentionSpec, SlidingWindowSpec
from hisparse_triton.workload import plan_for_workload
from scheduler_plans import make_scheduler, tokens

FULL, SWA = "model.layers.4.full_attn", "model.layers.5.swa"


def make(*, B=4, full=False, window=False, max_num_seqs=3, device_blocks=None,
         max_num_batched_tokens=None, watermark=0.1, threshold=None) -> HiSparseScheduler:
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    if full:
        spec[FULL] = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype="uint8")
    if window:
        spec[SWA] = SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=8,
                                      dtype="uint8", sliding_window=8)
    plan = plan_for_workload(spec, max_model_len=64, num_requests=max_num_seqs, topk=8,
                             device_buffer_size=16, device_blocks=device_blocks,
                             max_num_batched_tokens=max_num_batched_tokens)
    return HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=max_num_seqs,
                             free_block_watermark=watermark, offload_threshold_pages=threshold)


# -- the one-request-at-a-time definitions ------------------------------------------------
def reference_make_durable(d) -> int:
    """``Durability.make_durable`` one request after the other (commit, publish, release)."""
    j, values = d.journal, d.counters.values
    before = values["unpinned_pages"] + values["window_released_pages"]
    pressure = d.policy.under_pressure(d.device_pool.num_truly_free)
    keep_gpu_copies = not d.policy.always_offload
    for req in list(d.requests.values()):
        if req.scheduled_len > req.committed_len:
            j.setattr(req, "committed_len", req.scheduled_len)
            if d.prefix is not None and req.page_hashes:
                d.prefix.publish_durable(req, partial(
                    d.devices.page_blocks, req, resident=keep_gpu_copies),
                    d.prefix_required, d.block_size)
        d.release_resident(req, pressure)
        d.devices.release_windows(req)
    return values["unpinned_pages"] + values["window_released_pages"] - before


def reference_build(s, *, commit: bool, released_pages: int):
    """``HiSparseScheduler._build`` with the spans scheduled one request after the other."""
    spans = []
    for req in s._requests.values():
        if req.scheduled_len != req.seq_len:
            spans.append((req.host_array, req.row, req.scheduled_len, req.seq_len))
            s.journal.setattr(req, "scheduled_len", req.seq_len)
        s.journal.setattr(req, "planned_len", req.seq_len)   # every token is in a plan now
    host_rows, device_rows = mirror_rows(spans, [m.blocks for m in s.devices.resident],
                                         s.block_size)
    return s.plan_builder.build(commit=commit, mirror_host_rows=host_rows,
                                mirror_device_rows=device_rows, released_pages=released_pages)


def reference(s: HiSparseScheduler) -> HiSparseScheduler:
    """``s`` with the batch paths replaced by their definitions."""
    s.capacity.plain_decode = lambda request_ids: None
    s.durability.make_durable = partial(reference_make_durable, s.durability)
    s._build = partial(reference_build, s)
    return s


# -- a random workload --------------------------------------------------------------------
def call(s: HiSparseScheduler, op: tuple):
    """Run one call; its result (arrays as lists, plans as bytes) or its error."""
    name, args = op
    try:
        out = getattr(s, name)(*args)
    except Exception as error:   # noqa: BLE001 - the error is the result
        return ("error", type(error).__name__, str(error))
    if isinstance(out, dict):
        return {k: np.asarray(v).tolist() for k, v in out.items()}
    return out.to_bytes() if hasattr(out, "to_bytes") else out


def next_op(rng: random.Random, s: HiSparseScheduler, names: list[str]) -> tuple:
    live = [r for r in names if s.has_request(r)]
    pick = rng.choice(live) if live and rng.random() < 0.9 else rng.choice(names)
    x = rng.random()
    if x < 0.12:
        prompt = rng.randint(1, 30)
        ids = tokens(prompt, rng.randint(0, 2)) if rng.random() < 0.4 else None
        return ("add_request", (pick, prompt, rng.choice([rng.randint(0, 30), 2]), ids))
    if x < 0.22:
        n = rng.randint(1, 9) if rng.random() < 0.8 else rng.randint(10, 30)
        return ("append_slots", (pick, n))
    if x < 0.62:
        batch = rng.sample(live, rng.randint(0, len(live)))
        y = rng.random()
        if y < 0.05 and batch:
            batch.append(batch[0])
        elif y < 0.08:
            batch.append("nope")
        ids = [rng.randint(0, 50) for _ in batch] if rng.random() < 0.15 else None
        return ("append_decode", (batch, ids))
    if x < 0.68 and live:
        req = s._requests[pick] if s.has_request(pick) else None
        return ("truncate", (pick, rng.randint(req.committed_len, req.seq_len)
                             if req is not None else 0))
    if x < 0.73:
        return ("free_request", (pick,))
    if x < 0.93:
        return ("step", ())
    return ("flush", ()) if x < 0.97 else ("commit_mirrors", ())


CONFIGS = [
    dict(),
    dict(watermark=1.0),
    dict(full=True, window=True, device_blocks=60),
    dict(B=8, full=True, device_blocks=40, watermark=0.0),
    dict(max_num_batched_tokens=16, threshold=2, device_blocks=45),
    dict(max_num_seqs=5, watermark=3, window=True),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_batch_paths_agree_with_the_one_by_one_definitions(config):
    names = [f"r{i}" for i in range(7)]
    for seed in range(6):
        fast, slow = make(**config), reference(make(**config))
        rng = random.Random(seed)
        for _ in range(120):
            op = next_op(rng, fast, names)
            assert call(fast, op) == call(slow, op), (seed, op)
            assert fast._debug_snapshot() == slow._debug_snapshot(), (seed, op)
        fast.check_invariants()
        assert fast.stats() == slow.stats()


# -- the plain decode count ---------------------------------------------------------------
def decoding(**kwargs) -> HiSparseScheduler:
    s = make_scheduler(max_num_seqs=3, **kwargs)
    for rid, n in (("a", 9), ("b", 6)):
        s.add_request(rid, n, 20)
        s.append_slots(rid, n)
    s.step()
    return s


def test_a_plain_batch_takes_the_batch_path_and_nothing_else_does():
    s = decoding()
    assert s.capacity.plain_decode(["a", "b"]) is not None
    assert s.capacity.plain_decode([]) is not None
    for batch in (["a", "a"], ["a", "nope"], [["a"]]):
        assert s.capacity.plain_decode(batch) is None
    s.add_request("t", 5, 8, token_ids=tokens(5))
    s.append_slots("t", 5)
    assert s.capacity.plain_decode(["a", "t"]) is None   # its token closes the id chain
    s.append_slots("t", 1)                              # now closed: plain again
    assert s.capacity.plain_decode(["a", "t"]) is not None

    def general(*args):
        raise AssertionError("the general decode path ran")
    s.capacity.decode_batch = general
    before = s.seq_len("a")
    rows = s.append_decode(["a", "b"])
    assert s.seq_len("a") == before + 1 and all(r.shape == (2,) for r in rows.values())


def test_a_request_at_its_reservation_or_past_the_chunk_limit_is_not_plain():
    s = decoding()
    s.append_slots("a", s._requests["a"].reserved_tokens - s.seq_len("a"))
    assert s.capacity.plain_decode(["b", "a"]) is None
    before = s._debug_snapshot()
    with pytest.raises(ReservationExceededError):
        s.append_decode(["b", "a"])
    assert s._debug_snapshot() == before

    s = make(max_num_batched_tokens=4)
    s.add_request("a", 3, 20)
    s.append_slots("a", 3)
    assert s.capacity.plain_decode(["a"]) is not None
    s.append_decode(["a"])
    assert s.capacity.plain_decode(["a"]) is None   # 4 uncommitted tokens: step first
    s.step()
    assert s.capacity.plain_decode(["a"]) is not None


def test_a_batch_whose_pages_do_not_fit_goes_the_general_way_with_its_error():
    s = make(device_blocks=40, watermark=0.0)
    s.add_request("a", 8, 40)
    s.append_slots("a", 8)                       # the next token starts page 2
    s.add_request("f", 60, 0)
    while s.available_device_blocks >= len(s.devices.paged):
        s.append_slots("f", 1)                   # nothing durable: nothing to reclaim
    assert s.capacity.plain_decode(["a"]) is None
    before = s._debug_snapshot()
    with pytest.raises(CapacityError):
        s.append_decode(["a"])
    assert s._debug_snapshot() == before


# -- all or nothing -----------------------------------------------------------------------
def columns_state(s):
    cols = s._requests.columns
    return (s._debug_snapshot(), cols.host.tolist(), cols.reserved.tolist(),
            cols.tracks_ids.tolist(), s.stats())


#: The modules of the batch paths (``BlockPool`` and the managers have their own checks).
BATCH_PATHS = tuple(f"/hisparse_triton/scheduler/{name}.py" for name in (
    "scheduler", "capacity", "requests", "durability", "plan_builder", "coordinator",
    "residency"))


def in_transaction(s, fn):
    def run():
        with s.journal.transaction():
            fn()
    return run


def three_running(watermark: float):
    """A scheduler with requests a, b, c prefilled (7, 4, 11 tokens) and stepped once."""
    s = make(full=True, watermark=watermark, max_num_seqs=3)
    for rid, n in (("a", 7), ("b", 4), ("c", 11)):
        s.add_request(rid, n, 30)
        s.append_slots(rid, n)
    s.step()
    return s


@pytest.mark.parametrize("watermark", [0.1, 1.0])
def test_a_fault_anywhere_in_a_batch_call_inside_a_transaction_changes_nothing(watermark):
    s = three_running(watermark)
    for _ in range(3):                           # a and c start a page: blocks, releases
        assert s.capacity.plain_decode(["c", "a", "b"]) is not None
        assert sweep(in_transaction(s, lambda: s.append_decode(["c", "a", "b"])),
                     lambda: columns_state(s), where=BATCH_PATHS) > 10
        assert sweep(in_transaction(s, s.step), lambda: columns_state(s),
                     where=BATCH_PATHS) > 10
    s.check_invariants()


def test_request_lengths_live_in_the_columns():
    s = decoding()
    req = s._requests["a"]
    cols = s._requests.columns
    assert cols.seq_len[req.row] == req.seq_len == 9
    req.released_pages = 1
    assert cols.released_pages[req.row] == 1
    req.released_pages = 0
    s.check_invariants()
    cols.host[req.row, 0] += 1                   # the columns disagree with the request
    with pytest.raises(Exception, match="columns"):
        s.check_invariants()
