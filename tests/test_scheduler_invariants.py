"""``check_invariants``: holds through random serving runs (admissions with prefix hits,
appends, steps, frees, refusals) and catches each kind of corruption."""

import random

import pytest

from hisparse_triton.errors import HiSparseError, SchedulerStateError
from scheduler_plans import make_scheduler, tokens


def run(s, seed, steps=60):
    rnd = random.Random(seed)
    live: dict = {}
    for step in range(steps):
        op = rnd.random()
        if op < 0.25 and len(live) < s.max_num_seqs:
            rid = f"r{step}"
            n = rnd.randint(1, 30)
            ids = tokens(n, seed=rnd.randint(0, 1)) if rnd.random() < 0.7 else None
            try:
                cached = s.add_request(rid, n, rnd.randint(0, 20), token_ids=ids)
            except HiSparseError:
                continue
            live[rid] = n - cached
        elif op < 0.35 and live:
            rid = rnd.choice(sorted(live))
            s.free_request(rid)
            del live[rid]
        else:
            for rid in sorted(live):
                n = live[rid] or 1
                try:
                    s.append_slots(rid, min(n, 8))
                except HiSparseError:
                    continue
                live[rid] = max(0, live[rid] - 8)
            s.step()
        s.check_invariants()


@pytest.mark.parametrize("watermark", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_invariants_hold_through_a_random_serving_run(watermark, seed):
    s = make_scheduler(max_num_seqs=3, device_blocks=70, watermark=watermark, full=True)
    run(s, seed)
    assert s.stats().steps > 0


def corrupted(corrupt):
    s = make_scheduler(max_num_seqs=2, device_blocks=47, watermark=10**6)
    s.add_request("a", 40, 8, token_ids=tokens(40))
    s.append_slots("a", 40)
    s.step()
    s.step()
    s.check_invariants()
    corrupt(s)
    return s


@pytest.mark.parametrize("corrupt,message", [
    (lambda s: s.device_block_pool._ref.__setitem__(
        s.devices.paged[0].table(s._requests["a"])[-1], 2), "reference count"),
    (lambda s: s.devices.resident[0]._readers.popitem(), "reader count"),
    (lambda s: s.devices.paged[0].blocks.__setitem__((1, 0), 5), "free state row"),
    (lambda s: setattr(s.devices.hot[0], "reserved", 4), "reserves"),
    (lambda s: setattr(s._requests["a"], "committed_len", 99), "lengths out of order"),
    (lambda s: setattr(s.devices.paged[0], "num_blocks", 1), "counts 1 blocks"),
    (lambda s: s._prefix._by_host.clear(), "host reverse map"),
])
def test_each_kind_of_corruption_is_caught(corrupt, message):
    s = corrupted(corrupt)
    with pytest.raises(SchedulerStateError, match=message):
        s.check_invariants()
