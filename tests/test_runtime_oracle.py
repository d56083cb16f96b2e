"""End-to-end oracle: random interleavings of add/append/commit/resolve/free (and bad calls)
on a small geometry with index sharing; every row ``resolve`` points at must equal the dense
copy for that (request, layer, position), for the leader and its follower, and every pool
must be back to its initial free count at the end.

The torch backend runs several long seeded interleavings; the Triton backend (the
interpreter on CPU) runs a short one in lockstep with a torch runtime, and the two must
return the same rows and end with the same hot state and counters.
"""

import os
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from hisparse_triton import CapacityError, HiSparseRuntime, UnknownRequestError
from hisparse_triton.errors import DuplicateRequestError, ReservationExceededError
from hisparse_triton.oracle import DenseOracle, OracleMismatch
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import FullAttentionSpec, cdiv
from hisparse_triton.workload import TopkTrace, plan_for_workload

B, TOPK, BUFFER = 4, 8, 16
L1 = "model.layers.1.self_attn.attn"
#: Where the Triton backend runs: CUDA when present, else the interpreter on CPU tensors.
TRITON_DEVICE = ("cuda" if torch.cuda.is_available()
                 and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")




def make_runtime(backend, *, max_num_seqs, max_model_len=64, device_blocks=None,
                 host_blocks=None, threshold=1) -> HiSparseRuntime:
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    spec["model.layers.4.full_attn"] = FullAttentionSpec(block_size=B, num_kv_heads=1,
                                                         head_size=8, dtype="uint8")
    plan = plan_for_workload(spec, max_model_len=max_model_len, num_requests=max_num_seqs,
                             topk=TOPK, device_buffer_size=BUFFER, device_blocks=device_blocks,
                             host_blocks=host_blocks)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    return HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=max_num_seqs,
                           device=device, backend=backend, offload_threshold_pages=threshold,
                           free_block_watermark=1.0)


class Harness:
    """Drives one or more runtimes (same geometry) in lockstep with a dense oracle each."""

    def __init__(self, backends, seed, **kwargs):
        self.rng = random.Random(seed)
        self.runtimes = [make_runtime(b, **kwargs) for b in backends]
        self.oracles = [DenseOracle(rt, seed=seed) for rt in self.runtimes]
        self.trace = TopkTrace(TOPK, locality=0.6, seed=seed)
        self.initial = [(rt.device_block_pool.num_free, rt.host_block_pool.num_free)
                        for rt in self.runtimes]
        self.reserved = {}
        self.next_id = 0
        self.resolves = 0
        self.errors = 0
        self.capacity_errors = 0

    @property
    def rt(self):
        return self.runtimes[0]

    def all(self, method, *args):
        return [getattr(rt, method)(*args) for rt in self.runtimes]

    def counts(self):
        return [(rt.device_block_pool.num_free, rt.host_block_pool.num_free)
                for rt in self.runtimes]

    def snapshots(self):
        return [rt._debug_snapshot() for rt in self.runtimes]

    def expect_error(self, exc, call, match=None):
        """``call`` raises ``exc`` on every runtime and changes nothing: not the Python
        bookkeeping, not the allocators, not one entry of any device table."""
        before = self.snapshots()
        for rt in self.runtimes:
            with pytest.raises(exc, match=match):
                call(rt)
        assert self.snapshots() == before, f"a failed call ({exc.__name__}) changed state"
        self.errors += 1

    # -- operations ----------------------------------------------------------------------
    def add(self):
        rid = f"r{self.next_id}"
        self.next_id += 1
        limit = self.rt.max_model_len
        prompt = self.rng.randint(1, min(40, limit))
        new = self.rng.randint(0, min(20, limit - prompt))
        if len(self.reserved) >= self.rt.max_num_seqs:
            self.expect_error(CapacityError, lambda rt: rt.add_request(rid, prompt, new),
                              match="state rows")
            return
        if cdiv(prompt + new, B) > self.rt.host_block_pool.num_free:
            self.expect_error(CapacityError, lambda rt: rt.add_request(rid, prompt, new),
                              match=f"'{rid}': it needs .* host blocks")
            return
        before = self.snapshots()
        try:
            self.all("add_request", rid, prompt, new)
        except CapacityError:   # the device pool cannot reserve its hot region
            assert self.snapshots() == before, "a failed add_request changed state"
            self.errors += 1
            self.capacity_errors += 1
            return
        for oracle in self.oracles:
            oracle.add(rid)
        self.reserved[rid] = prompt + new

    def append(self):
        if not self.reserved:
            return
        rid = self.rng.choice(sorted(self.reserved))
        n = self.rng.choice([1, 1, 1, self.rng.randint(1, 16)])
        if self.rt.seq_len(rid) + n > self.reserved[rid]:
            self.expect_error(ReservationExceededError, lambda rt: rt.append_slots(rid, n))
            return
        before = self.snapshots()
        try:
            rows = self.all("append_slots", rid, n)
        except CapacityError:   # only with a tight device pool; nothing changed
            assert self.snapshots() == before, "a failed append_slots changed state"
            self.errors += 1
            self.capacity_errors += 1
            return
        for oracle, r in zip(self.oracles, rows):
            oracle.write(rid, r)

    def commit(self):
        self.all("commit")
        if self.rng.random() < 0.3:
            for rt, oracle in zip(self.runtimes, self.oracles):
                for rid in self.reserved:
                    oracle.check_pages(rid)
                    oracle.check_host(rid, rt.seq_len(rid))

    def resolve(self):
        if not self.reserved:
            return
        ids = self.rng.sample(sorted(self.reserved), self.rng.randint(1, len(self.reserved)))
        if self.rng.random() < 0.3:
            ids.insert(self.rng.randint(0, len(ids)), None)
        leader = self.rng.choice(self.rt.leaders)
        topk = np.full((len(ids), TOPK), -1, dtype=np.int64)
        for r, rid in enumerate(ids):
            if rid is None:
                continue
            seq_len = self.rt.seq_len(rid)
            topk[r] = self.trace.next((rid, leader), seq_len)
            if self.rng.random() < 0.3:   # sprinkle invalid positions
                col = self.rng.randrange(TOPK)
                topk[r, col] = self.rng.choice([-1, -(2**33), seq_len, seq_len + 7, 2**40])
        topk_t = torch.from_numpy(topk)
        outs = self.all("resolve", leader, ids, topk_t)
        for oracle, rows in zip(self.oracles, outs):
            oracle.check_resolve(leader, ids, topk_t, rows)
        for rows in outs[1:]:
            assert torch.equal(rows.cpu(), outs[0].cpu()), "backends returned different rows"
        self.resolves += 1

    def free(self):
        if not self.reserved:
            return
        rid = self.rng.choice(sorted(self.reserved))
        self.all("free_request", rid)
        for oracle in self.oracles:
            oracle.free(rid)
        del self.reserved[rid]

    def bad(self):
        """One call that must fail, of every public entry point, and change nothing."""
        live = sorted(self.reserved)
        leader = self.rt.leaders[0]
        topk = torch.zeros(1, TOPK, dtype=torch.int32)
        calls = [
            (UnknownRequestError, lambda rt: rt.free_request("ghost")),
            (UnknownRequestError, lambda rt: rt.append_slots("ghost", 1)),
            (ValueError, lambda rt: rt.add_request("new", 0, 4)),
            (ValueError, lambda rt: rt.add_request("new", rt.max_model_len, 1)),
        ]
        if live:
            rid = self.rng.choice(live)
            two = torch.zeros(2, TOPK, dtype=torch.int32)
            calls += [
                (DuplicateRequestError, lambda rt: rt.add_request(rid, 2, 2)),
                (ValueError, lambda rt: rt.append_slots(rid, -1)),
                (ReservationExceededError,
                 lambda rt: rt.append_slots(rid, self.reserved[rid] - rt.seq_len(rid) + 1)),
                (ValueError, lambda rt: rt.resolve(L1, [rid], topk)),     # a follower
                (DuplicateRequestError, lambda rt: rt.resolve(leader, [rid, rid], two)),
                (UnknownRequestError, lambda rt: rt.resolve(leader, [rid, "ghost"], two)),
                (ValueError, lambda rt: rt.resolve(leader, [rid], topk.float())),
                (ValueError, lambda rt: rt.resolve(leader, [rid], two)),
                (ValueError, lambda rt: rt.resolve(
                    leader, [rid], torch.zeros(1, BUFFER + 1, dtype=torch.int32))),
                (ValueError, lambda rt: rt.resolve_rows(
                    leader, torch.zeros(1, dtype=torch.int64), topk)),
            ]
        exc, call = self.rng.choice(calls)
        self.expect_error(exc, call)

    def run(self, steps, max_resolves=None):
        ops = [self.add, self.append, self.append, self.append, self.commit, self.resolve,
               self.resolve, self.free, self.bad]
        weights = [2, 4, 4, 4, 3, 5, 5, 1, 1]
        for _ in range(steps):
            op = self.rng.choices(ops, weights)[0]
            if op == self.resolve and max_resolves is not None \
                    and self.resolves >= max_resolves:
                op = self.commit
            op()
        return self

    def prime(self, count, prompt_len, max_new_tokens):
        """Add ``count`` requests with long prompts, committing each (one prefill per step,
        as a scheduler runs them): their history is offloaded."""
        for _ in range(count):
            rid = f"r{self.next_id}"
            self.next_id += 1
            self.all("add_request", rid, prompt_len, max_new_tokens)
            for oracle, rows in zip(self.oracles, self.all("append_slots", rid, prompt_len)):
                oracle.add(rid)
                oracle.write(rid, rows)
            self.reserved[rid] = prompt_len + max_new_tokens
            self.all("commit")
        return self

    def finish(self):
        for rid in sorted(self.reserved):
            self.free_rid(rid)
        assert self.counts() == self.initial, "blocks leaked"
        for rt in self.runtimes:
            stats = rt.stats()
            assert (stats.device_blocks, stats.host_blocks, stats.num_requests) == (0, 0, 0)
            for pool in (rt.device_block_pool, rt.host_block_pool):
                assert sorted(pool._free) == list(range(1, pool.num_blocks))
                assert not any(pool._ref)
            # Every state row is empty again: no stale table entry or hot slot survives.
            rt.flush()
            assert not rt.worker.seq_lens.any() and not rt.worker.host_table.any()
            assert not any(table.any() for table in rt.worker.tables)
            for leader in rt.leaders:
                assert rt.hot_slots(leader).eq(-1).all()

    def free_rid(self, rid):
        self.all("free_request", rid)
        del self.reserved[rid]


@pytest.mark.parametrize("seed,kwargs", [
    (0, {}),
    (1, {"threshold": None}),
    (2, {"device_blocks": 45}),            # tight pool: capacity errors
    (3, {"max_num_seqs": 2}),
    (4, {"host_blocks": 2 * cdiv(64, B) + 2}),  # tight host pool: host blocks reused early
])
def test_random_interleavings_torch(seed, kwargs):
    kwargs.setdefault("max_num_seqs", 4)
    harness = Harness(["torch"], seed, **kwargs).run(400)
    assert harness.resolves > 50
    stats = harness.rt.stats()
    assert stats.misses > 0 and stats.hits > 0 and stats.masked > 0
    if seed == 2:
        assert harness.capacity_errors > 0
    harness.finish()


OPS = ("add", "append", "commit", "resolve", "free", "bad")


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=20, max_size=60),
       seed=st.integers(0, 2**16), device_blocks=st.sampled_from([None, 40]),
       threshold=st.sampled_from([1, 3, None]))
def test_hypothesis_interleavings(ops, seed, device_blocks, threshold):
    """Shrinkable op sequences (sizes and ids from ``seed``): exact resolves, failed calls
    that change nothing, no leak; ``max_num_seqs=2`` reuses state rows and blocks often."""
    harness = Harness(["torch"], seed, max_num_seqs=2, max_model_len=48,
                      device_blocks=device_blocks, threshold=threshold)
    for op in ops:
        getattr(harness, op)()
    harness.finish()


def test_random_interleaving_triton_matches_torch():
    """The Triton kernels (CUDA, or the interpreter on CPU) inside the runtime, in lockstep
    with the torch backend."""
    harness = Harness(["triton", "torch"], seed=7, max_num_seqs=2, max_model_len=48)
    harness.prime(2, 36, 8).run(40, max_resolves=8)
    assert harness.resolves >= 4
    triton_rt, torch_rt = harness.runtimes
    assert triton_rt.stats() == torch_rt.stats()
    for leader in triton_rt.leaders:
        assert torch.equal(triton_rt.hot_order(leader).cpu(), torch_rt.hot_order(leader).cpu())
        assert torch.equal(triton_rt.hot_slots(leader).cpu(), torch_rt.hot_slots(leader).cpu())
    assert triton_rt.stats().misses > 0
    harness.finish()


def test_oracle_detects_corruption():
    """The check is not vacuous: a wrong byte in a gathered hot row is caught."""
    harness = Harness(["torch"], seed=11, max_num_seqs=2)
    rt, oracle = harness.rt, harness.oracles[0]
    rt.add_request("a", 40, 0)
    oracle.add("a")
    oracle.write("a", rt.append_slots("a", 40))
    rt.commit()
    topk = torch.arange(TOPK, dtype=torch.int32).view(1, -1)      # pages 0-1: offloaded
    rows = rt.resolve(rt.leaders[0], ["a"], topk)
    oracle.check_resolve(rt.leaders[0], ["a"], topk, rows)
    follower = rt.index_group(rt.leaders[0])[1]
    cache = rt.device_cache(follower)
    row = int(rows[0, 3])
    cache[row // B, row % B, 5] ^= 0xFF
    with pytest.raises(OracleMismatch, match=f"layer {follower}"):
        oracle.check_resolve(rt.leaders[0], ["a"], topk, rows)
    bad_rows = rows.clone()
    bad_rows[0, 0] = -1
    with pytest.raises(OracleMismatch, match="column 0"):
        oracle.check_resolve(rt.leaders[0], ["a"], topk, bad_rows)
