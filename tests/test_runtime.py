"""HiSparseRuntime: bookkeeping, errors that change nothing, release/hot-region policy, stats.

Small geometry: the ``tiny`` preset cut to 4 sparse layers in index groups of 2 (leader +
follower), block size 4, top-k 8, hot buffer 16 rows, plus one full-attention and one
sliding-window regular layer. Torch backend on the CPU (the oracle tests also drive Triton).
"""

import pytest
import torch

from hisparse_triton import (CapacityError, HiSparseError, HiSparseRuntime, HostMemoryError,
                             UnknownRequestError)
from hisparse_triton.config import ACTIVE_TAIL_PAGES
from hisparse_triton.errors import (
    DuplicateRequestError,
    ReservationExceededError,
    RuntimeClosedError,
)
from hisparse_triton.oracle import DenseOracle
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import FullAttentionSpec, SlidingWindowSpec, cdiv
from hisparse_triton.workload import plan_for_workload

B, TOPK, BUFFER, ROW = 4, 8, 16, 64
HOT_BLOCKS = cdiv(BUFFER, B)
#: Offload as soon as possible (most tests here exercise the host + hot-buffer path).
EAGER = 1.0
L0, L1, L2, L3 = (f"model.layers.{i}.self_attn.attn" for i in range(4))
FULL, SWA = "model.layers.4.full_attn", "model.layers.5.swa"




def make_runtime(*, max_num_seqs=3, max_model_len=96, host_blocks=None, device_blocks=None,
                 threshold=1, backend="torch", regular=True, device="cpu",
                 **kwargs) -> HiSparseRuntime:
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    if regular:
        spec[FULL] = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype="uint8")
        spec[SWA] = SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=8, dtype="uint8",
                                      sliding_window=8)
    plan = plan_for_workload(spec, max_model_len=max_model_len, num_requests=max_num_seqs,
                             topk=TOPK, device_buffer_size=BUFFER, host_blocks=host_blocks,
                             device_blocks=device_blocks)
    return HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=max_num_seqs,
                           device=device, backend=backend, offload_threshold_pages=threshold,
                           free_block_watermark=kwargs.pop("free_block_watermark", EAGER),
                           **kwargs)


def pool_counts(rt):
    return rt.device_block_pool.num_free, rt.host_block_pool.num_free


def write_random(rt, oracle, rid, n):
    oracle.write(rid, rt.append_slots(rid, n))


# ----------------------------------------------------------------------------- layout
def test_layers_views_and_index_groups():
    with make_runtime() as rt:
        assert rt.leaders == [L0, L2]
        assert rt.index_group(L0) == (L0, L1) and rt.index_group(L2) == (L2, L3)
        assert set(rt.device_layers) == {"model.layers.0.self_attn.indexer",
                                         "model.layers.2.self_attn.indexer",
                                         L0, L1, L2, L3, FULL, SWA}
        view = rt.device_cache(L1)
        assert view.shape == (rt.num_device_blocks, B, ROW) and view.dtype == torch.uint8
        assert view.stride()[0] == rt.bytes_per_block
        for alias in (L1 + ".hisparse_resident", L1 + ".hisparse_hot"):
            assert rt.device_cache(alias).data_ptr() == view.data_ptr()
        assert rt.device_cache(FULL).shape == (rt.num_device_blocks, B, 16)
        host = rt.host_cache(L0)
        assert host.shape == (rt.num_host_blocks, B, ROW) and host.is_contiguous()
        assert host.data_ptr() % 4096 == 0
        with pytest.raises(KeyError):
            rt.device_cache("nope")
        with pytest.raises(KeyError):
            rt.host_cache(FULL)


def test_layers_of_one_group_do_not_overlap():
    with make_runtime() as rt:
        group = [rt.device_cache(layer) for layer in (L0, L1)]
        indexer = [rt.device_cache(f"model.layers.{i}.self_attn.indexer") for i in (0, 2)]
        for views in (group, indexer):
            for value, view in enumerate(views, start=1):
                view[3].fill_(value)
            for value, view in enumerate(views, start=1):
                assert view[3].eq(value).all()


# ----------------------------------------------------------------------------- admission
def test_add_request_reserves_prompt_and_output():
    with make_runtime() as rt:
        dev0, host0 = pool_counts(rt)
        rt.add_request("a", 10, 20)
        assert rt.host_block_pool.num_free == host0 - cdiv(30, B)
        assert rt.device_block_pool.num_free == dev0  # device pages come with append_slots
        assert len(rt.host_block_table("a")) == cdiv(30, B) and rt.seq_len("a") == 0
        with pytest.raises(DuplicateRequestError, match="'a' is already live") as info:
            rt.add_request("a", 1, 1)
        assert isinstance(info.value, ValueError) and isinstance(info.value, HiSparseError)
        assert rt.host_block_pool.num_free == host0 - cdiv(30, B)


@pytest.mark.parametrize("args,match", [
    ((0, 1), "prompt_len"), ((-3, 1), "prompt_len"), ((1.5, 1), "prompt_len"),
    ((4, -1), "max_new_tokens"), ((90, 7), "97 exceeds max_model_len 96"),
])
def test_add_request_bad_lengths(args, match):
    with make_runtime() as rt:
        before = pool_counts(rt)
        with pytest.raises(ValueError, match=match):
            rt.add_request("r", *args)
        assert pool_counts(rt) == before and not rt.has_request("r")
        rt.add_request("r", 4, 4)


def test_add_request_bad_ids():
    with make_runtime() as rt:
        with pytest.raises(ValueError, match="padding"):
            rt.add_request(None, 4, 4)
        with pytest.raises(ValueError, match="hashable"):
            rt.add_request(["x"], 4, 4)


def test_host_pool_capacity_error_changes_nothing():
    with make_runtime(host_blocks=cdiv(96, B) + 2) as rt:   # 25 allocatable blocks
        rt.add_request("big", 90, 6)                         # 24 blocks
        before = pool_counts(rt)
        with pytest.raises(CapacityError, match=r"'small': it needs 4 host blocks for 16 "
                                                r"tokens, 1 of 25 are free") as info:
            rt.add_request("small", 10, 6)
        assert (info.value.needed, info.value.available) == (4, 1)
        assert pool_counts(rt) == before and not rt.has_request("small")
        rt.free_request("big")
        rt.add_request("small", 10, 6)


def test_state_rows_capacity():
    with make_runtime(max_num_seqs=2) as rt:
        rt.add_request(1, 4, 4)
        rt.add_request(2, 4, 4)
        before = pool_counts(rt)
        with pytest.raises(CapacityError, match="all 2 state rows"):
            rt.add_request(3, 4, 4)
        assert pool_counts(rt) == before
        rt.free_request(1)
        rt.add_request(3, 4, 4)
        assert rt.state_row(3) == 0  # the freed row is reused


# ----------------------------------------------------------------------------- append
def test_append_rows_per_group():
    with make_runtime() as rt:
        rt.add_request("a", 10, 10)
        rows = rt.append_slots("a", 6)
        assert set(rows) == set(rt.device_layers)
        assert rows[L0] is rows[L1] and rows[L2] is rows[L3]      # one tensor per group
        assert rows[L0].dtype == torch.int64 and rows[L0].shape == (6,)
        assert not torch.equal(rows[L0], rows[L2])                # different groups, blocks
        for layer, r in rows.items():
            table = rt.block_table("a", layer)
            assert len(table) == cdiv(6, B)
            assert r.tolist() == [table[p // B] * B + p % B for p in range(6)]
        assert rt.seq_len("a") == 6
        more = rt.append_slots("a", 3)
        assert more[L0].tolist() == [rt.block_table("a", L0)[p // B] * B + p % B
                                     for p in range(6, 9)]
        assert rt.append_slots("a", 0)[L0].numel() == 0


def test_no_block_is_in_two_groups_or_requests():
    with make_runtime() as rt:
        for rid in range(3):
            rt.add_request(rid, 30, 10)
            rt.append_slots(rid, 13 + rid)
        rt.commit()
        seen = []
        for rid in range(3):
            for layer in ("model.layers.0.self_attn.indexer", L0, L2, FULL, SWA,
                          L0 + ".hisparse_hot", L2 + ".hisparse_hot"):
                seen += [b for b in rt.block_table(rid, layer) if b]
        assert len(seen) == len(set(seen)) == rt.device_block_pool.num_used
        assert 0 not in seen


def test_append_past_reservation_changes_nothing():
    with make_runtime() as rt:
        rt.add_request("a", 5, 3)
        rt.append_slots("a", 6)
        before = pool_counts(rt)
        with pytest.raises(ReservationExceededError,
                           match=r"'a': appending 3 tokens to 6 exceeds its reservation of 8"):
            rt.append_slots("a", 3)
        assert pool_counts(rt) == before and rt.seq_len("a") == 6
        rt.append_slots("a", 2)
        assert rt.seq_len("a") == 8
        with pytest.raises(ValueError, match="num_tokens"):
            rt.append_slots("a", -1)


def test_device_capacity_error_changes_nothing_and_recovers():
    # 31 blocks: 30 allocatable, 2 x 8 hot blocks reserved at admission -> 14 for pages;
    # a page costs a block in each of the 5 paged groups (indexer, 2 resident, full, swa).
    with make_runtime(device_blocks=31, threshold=100) as rt:
        rt.add_request("a", 40, 0)
        rt.add_request("b", 40, 0)
        assert rt.scheduler.available_device_blocks == 30 - 2 * 2 * HOT_BLOCKS
        rt.append_slots("a", 8)    # 2 pages x 5 paged groups = 10 blocks
        before = pool_counts(rt)
        with pytest.raises(CapacityError, match=r"'b': appending 4 tokens needs 5 device "
                                                r"blocks, 4 of 30 are available"):
            rt.append_slots("b", 4)
        assert pool_counts(rt) == before and rt.seq_len("b") == 0
        rt.free_request("a")
        rt.append_slots("b", 4)
        assert rt.seq_len("b") == 4


def test_admission_reserves_the_hot_region():
    """A request is admitted only if its hot region fits next to the others' reservations,
    and appends never eat into a reservation: an offload can never fail for lack of
    blocks."""
    with make_runtime(device_blocks=1 + 3 * 2 * HOT_BLOCKS + 5, threshold=1, max_num_seqs=4,
                      regular=False) as rt:
        for rid in ("a", "b", "c"):
            rt.add_request(rid, 8, 8)
        before = rt._debug_snapshot()
        with pytest.raises(CapacityError, match=r"'d': its hot region needs 8 device "
                                                r"blocks, 5 of 29 are available"):
            rt.add_request("d", 8, 8)
        assert rt._debug_snapshot() == before
        with pytest.raises(CapacityError, match="needs 6 device blocks, 5 of 29"):
            rt.append_slots("a", 5)       # 2 pages x 3 groups: only 5 are not reserved
        rt.append_slots("a", 4)
    with make_runtime(device_blocks=1 + 2 * 2 * HOT_BLOCKS + 9, threshold=1,
                      regular=False) as rt:
        oracle = DenseOracle(rt)
        rt.add_request("a", 12, 4)
        rt.add_request("b", 4, 4)
        oracle.add("a")
        write_random(rt, oracle, "a", 12)  # 3 pages x 3 groups: every unreserved block
        assert rt.scheduler.available_device_blocks == 0
        rt.commit()                        # a offloads into its reserved region
        stats = rt.stats()
        assert stats.hot_blocks == 2 * HOT_BLOCKS and stats.offloaded_requests == 1
        topk = torch.arange(TOPK, dtype=torch.int32).view(1, -1)
        oracle.check_resolve(L0, ["a"], topk, rt.resolve(L0, ["a"], topk))


# ----------------------------------------------------------------------------- commit
def test_commit_mirrors_rows_to_host():
    with make_runtime() as rt:
        oracle = DenseOracle(rt, seed=1)
        rt.add_request("a", 10, 10)
        oracle.add("a")
        write_random(rt, oracle, "a", 7)
        rt.commit()
        oracle.check_host("a", 7)
        assert rt.stats().d2h_bytes == 7 * 4 * ROW
        write_random(rt, oracle, "a", 5)
        rt.commit()
        rt.commit()  # nothing new: no copy
        oracle.check_host("a", 12)
        assert rt.stats().d2h_bytes == 12 * 4 * ROW


def test_release_keeps_active_tail_and_allocates_hot_region():
    with make_runtime(threshold=1) as rt:
        rt.add_request("a", 40, 8)
        rt.append_slots("a", 41)          # 11 pages, the last one partial
        rt.commit()
        released = cdiv(41, B) - ACTIVE_TAIL_PAGES          # 9 sealed pages leave the GPU
        table = rt.block_table("a", L0)
        assert table[:released] == [0] * released and all(table[released:])
        stats = rt.stats()
        assert stats.resident_blocks == 2 * ACTIVE_TAIL_PAGES
        assert stats.hot_blocks == 2 * HOT_BLOCKS
        assert len(rt.block_table("a", L0 + ".hisparse_hot")) == HOT_BLOCKS
        assert stats.indexer_blocks == cdiv(41, B) and stats.regular_blocks > 0
        rt.append_slots("a", 4)           # page 11 starts: page 9 leaves at the next commit
        rt.commit()
        assert rt.block_table("a", L2)[released] == 0
        assert rt.stats().resident_blocks == 2 * ACTIVE_TAIL_PAGES


def test_offload_waits_for_the_threshold():
    with make_runtime(threshold=HOT_BLOCKS) as rt:
        rt.add_request("a", 40, 8)
        rt.append_slots("a", (HOT_BLOCKS + 1) * B)   # HOT_BLOCKS - 1 pages outside the tail
        rt.commit()
        assert rt.stats().hot_blocks == 0
        assert rt.stats().resident_blocks == 2 * (HOT_BLOCKS + 1)
        rt.append_slots("a", 1)           # now HOT_BLOCKS sealed pages outside the tail
        rt.commit()
        assert rt.stats().hot_blocks == 2 * HOT_BLOCKS
        assert rt.stats().resident_blocks == 2 * ACTIVE_TAIL_PAGES
    with make_runtime(threshold=None) as rt:
        assert rt.offload_threshold_pages == 1   # the hot region is reserved: no extra cost


def test_sliding_window_pages_are_released():
    with make_runtime(threshold=100) as rt:
        rt.add_request("a", 60, 0)
        rt.append_slots("a", 60)
        rt.commit()
        swa = rt.block_table("a", SWA)
        full = rt.block_table("a", FULL)
        window_pages = cdiv(8, B)
        assert all(full) and len(full) == 15
        assert swa[:15 - window_pages] == [0] * (15 - window_pages)
        assert all(swa[15 - window_pages:])
        rt.free_request("a")
        assert rt.device_block_pool.num_used == 0


# ----------------------------------------------------------------------------- free
def test_free_returns_every_block():
    with make_runtime(threshold=1) as rt:
        dev0, host0 = pool_counts(rt)
        for rid in range(3):
            rt.add_request(rid, 30, 20)
            rt.append_slots(rid, 30 + rid)
        rt.commit()
        assert rt.stats().hot_blocks == 3 * 2 * HOT_BLOCKS
        for rid in (1, 0, 2):
            rt.free_request(rid)
        assert pool_counts(rt) == (dev0, host0)
        stats = rt.stats()
        assert (stats.device_blocks, stats.host_blocks, stats.num_requests) == (0, 0, 0)
        assert stats.peak_device_blocks > 0 and stats.peak_host_blocks == 3 * cdiv(50, B)


def test_unknown_request_ids():
    with make_runtime() as rt:
        rt.add_request("a", 4, 4)
        rt.free_request("a")
        for call in (lambda: rt.append_slots("a", 1), lambda: rt.free_request("a"),
                     lambda: rt.seq_len("a"),
                     lambda: rt.resolve(L0, ["a"], torch.zeros(1, TOPK, dtype=torch.int32))):
            with pytest.raises(UnknownRequestError, match="unknown request 'a'") as info:
                call()
            assert isinstance(info.value, LookupError) and info.value.request_id == "a"
        rt.add_request("a", 4, 4)        # the id can be used again


# ----------------------------------------------------------------------------- resolve
@pytest.fixture
def decoding():
    """A runtime with two offloaded requests and a dense oracle."""
    rt = make_runtime(threshold=1)
    oracle = DenseOracle(rt, seed=3)
    for rid, n in (("a", 37), ("b", 22)):
        rt.add_request(rid, n, 10)
        oracle.add(rid)
        write_random(rt, oracle, rid, n)
    rt.commit()
    yield rt, oracle
    rt.close()


def test_resolve_bad_input_raises_and_runtime_keeps_working(decoding):
    rt, oracle = decoding
    good = torch.tensor([[0, 1, 2, 3, 20, 21, 30, 36], [5, 6, 7, 8, 9, 10, 11, 21]],
                        dtype=torch.int32)
    bad_calls = [
        (ValueError, "its leader is", lambda: rt.resolve(L1, ["a", "b"], good)),
        (ValueError, "not an index-group leader", lambda: rt.resolve("x", ["a", "b"], good)),
        (DuplicateRequestError, "twice", lambda: rt.resolve(L0, ["a", "a"], good)),
        (UnknownRequestError, "'zz'", lambda: rt.resolve(L0, ["a", "zz"], good)),
        (ValueError, "2 rows but 1 request", lambda: rt.resolve(L0, ["a"], good)),
        (ValueError, "top-k width 17", lambda: rt.resolve(
            L0, ["a"], torch.zeros(1, BUFFER + 1, dtype=torch.int32))),
        (ValueError, "integer positions", lambda: rt.resolve(L0, ["a", "b"], good.float())),
        (ValueError, r"\[rows, k\] or", lambda: rt.resolve(L0, ["a"], good[0])),
        # a lone str id used to be split into characters ("2 rows but 1 request ids" or,
        # for a one-character id, silently accepted)
        (ValueError, "request_ids must be a list", lambda: rt.resolve(L0, "a", good[:1])),
        (ValueError, "request_ids must be a list", lambda: rt.state_rows("ab")),
    ]
    state = [t.clone() for t in (rt.hot_order(L0), rt.hot_slots(L0))]
    for exc, match, call in bad_calls:
        with pytest.raises(exc, match=match):
            call()
    assert torch.equal(rt.hot_order(L0), state[0])
    assert torch.equal(rt.hot_slots(L0), state[1])
    assert rt.stats().hits + rt.stats().misses + rt.stats().masked == 0
    for leader in rt.leaders:
        rows = rt.resolve(leader, ["a", "b"], good)
        oracle.check_resolve(leader, ["a", "b"], good, rows)


def test_invalid_positions_are_masked(decoding):
    rt, oracle = decoding
    big = 2**40
    topk = torch.tensor([[-1, -big, 37, 38, 2**31 - 1, big, 36, 0],
                         [22, -5, 21, 0, 100, 3, 3, 2**62]], dtype=torch.int64)
    rows = rt.resolve(L0, ["a", "b"], topk)
    assert rows.dtype == torch.int32 and rows.shape == (2, TOPK)
    oracle.check_resolve(L0, ["a", "b"], topk, rows)
    assert rows[0].tolist()[:6] == [-1] * 6 and rows[0, 6] >= 0 and rows[0, 7] >= 0
    assert rows[1, 0] == rows[1, 1] == rows[1, 4] == rows[1, 7] == -1
    assert rows[1, 5] == rows[1, 6] >= 0          # a duplicate column shares its row
    assert rt.stats().masked == 10
    topk32 = torch.tensor([[-7, 37, 1000, 5, 6, 7, 8, 9]], dtype=torch.int32)
    rows = rt.resolve(L2, ["a"], topk32)
    oracle.check_resolve(L2, ["a"], topk32, rows)


def test_padding_rows_touch_no_state(decoding):
    rt, oracle = decoding
    topk = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]] * 3, dtype=torch.int32)
    before = rt.hot_order(L0).clone()
    rows = rt.resolve(L0, [None, None, None], topk)
    assert rows.eq(-1).all() and torch.equal(rt.hot_order(L0), before)
    rows = rt.resolve(L0, [None, "b", None], topk)
    oracle.check_resolve(L0, [None, "b", None], topk, rows)
    assert rt.resolve(L0, [], torch.zeros(0, TOPK, dtype=torch.int32)).shape == (0, TOPK)


def test_stats_accounting(decoding):
    rt, oracle = decoding
    torch.manual_seed(0)
    columns = 0
    for step in range(6):
        topk = torch.randint(-2, 40, (2, TOPK), dtype=torch.int32)
        for leader in rt.leaders:
            oracle.check_resolve(leader, ["a", "b"], topk, rt.resolve(leader, ["a", "b"], topk))
            columns += topk.numel()
    stats = rt.stats()
    assert stats.hits + stats.misses + stats.masked == columns
    assert stats.misses > 0 and stats.hits > 0
    assert stats.h2d_bytes == stats.misses * ROW * 2      # leader + follower per miss
    assert 0 < stats.hit_rate < 1
    rt.reset_stats()
    assert (rt.stats().hits, rt.stats().h2d_bytes, rt.stats().d2h_bytes) == (0, 0, 0)


def test_warm_replay_hits_everything(decoding):
    rt, oracle = decoding
    topk = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
                        dtype=torch.int32)
    rt.resolve(L0, ["a", "b"], topk)
    misses = rt.stats().misses
    assert misses > 0
    rows = rt.resolve(L0, ["b", "a"], topk.flip(0))
    oracle.check_resolve(L0, ["b", "a"], topk.flip(0), rows)
    assert rt.stats().misses == misses


# ----------------------------------------------------------------------------- lifecycle
def test_close_and_context_manager():
    rt = make_runtime()
    with rt:
        rt.add_request("a", 4, 4)
    assert rt.closed
    rt.close()
    for call in (lambda: rt.add_request("b", 4, 4), lambda: rt.append_slots("a", 1),
                 rt.commit, rt.stats, lambda: rt.device_cache(L0)):
        with pytest.raises(RuntimeClosedError):
            call()
    assert "closed" in repr(rt)


def test_bad_backend_and_config():
    with pytest.raises(ValueError, match="backend"):
        make_runtime(backend="bogus")
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_runtime(max_num_seqs=0, host_blocks=100, device_blocks=100)
    # the message names the runtime's parameter (it used to say HostPool's max_ram_fraction)
    with pytest.raises(ValueError, match=r"host_ram_fraction must be in \(0, 1\], got 2"):
        make_runtime(host_ram_fraction=2)


def test_bad_device_is_a_value_error():
    # used to surface torch's RuntimeError / an AssertionError from torch.cuda
    with pytest.raises(ValueError, match="device 'tpu' is not a torch device"):
        make_runtime(device="tpu")
    with pytest.raises(ValueError, match="device '' is not a torch device"):
        make_runtime(device="")
    with pytest.raises(ValueError, match="device 'meta': the runtime runs on a cpu or cuda"):
        make_runtime(device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda': CUDA is not available"):
            make_runtime(device="cuda")
    else:
        bad = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(ValueError, match=f"device '{bad}': this machine has"):
            make_runtime(device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        make_runtime(backend="triton")


def test_host_ram_check():
    with pytest.raises(CapacityError, match="available RAM"):
        make_runtime(host_ram_fraction=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runtime_pins_the_host_pool():
    spec = build_kv_cache_spec("tiny", num_layers=4, block_size=B)
    plan = plan_for_workload(spec, max_model_len=96, num_requests=2, topk=TOPK,
                             device_buffer_size=BUFFER)
    rt = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=2, device="cuda")
    assert rt.host_cache(L0).is_pinned() and rt.device_cache(L0).is_cuda
    pool = rt.worker.host_pool
    rt.close()
    assert not pool.pinned and pool.closed


def test_resolve_rows_by_state_row(decoding):
    """The host-free core: device state rows in, same rows out as resolve(ids)."""
    rt, oracle = decoding
    topk = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 36], [21, 20, 19, 18, 2, 1, 0, 99]],
                        dtype=torch.int32)
    state = rt.state_rows(["a", None])
    assert state.tolist() == [rt.state_row("a"), -1]
    rows = rt.resolve_rows(L0, state, topk)
    oracle.check_resolve(L0, ["a", None], topk, rows)
    stale = torch.tensor([rt.max_num_seqs - 1], dtype=torch.int32)   # not a live request
    assert rt.resolve_rows(L0, stale, topk[:1]).eq(-1).all()
    with pytest.raises(ValueError, match=r"state_rows must be an int32 tensor \[2\]"):
        rt.resolve_rows(L0, state.long(), topk)


# ----------------------------------------------------------------------------- exactness corners
def test_small_integer_topk_dtypes(decoding):
    """Any integer dtype works: narrow ones convert losslessly, wide ones saturate."""
    rt, oracle = decoding
    base = torch.tensor([[0, 1, 2, 3, 20, 21, 30, 36], [-1, 6, 7, 8, 9, 10, 11, 127]])
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        topk = base.clamp(min=0).to(dtype) if dtype == torch.uint8 else base.to(dtype)
        rows = rt.resolve(L0, ["a", "b"], topk)
        oracle.check_resolve(L0, ["a", "b"], topk, rows)
    assert rows[1, 7] == -1 and rows[1, 0] == -1


def test_reused_state_row_and_host_blocks_start_with_an_empty_hot_buffer():
    """A freed request's hot slots name host rows; the next request in its state row gets
    the same host blocks. Its hot state must start empty, or it would "hit" on the old
    request's bytes."""
    pages = cdiv(48, B)
    with make_runtime(max_num_seqs=1, max_model_len=48, host_blocks=pages + 2,
                      device_blocks=60, regular=False) as rt:
        oracle = DenseOracle(rt, seed=5)
        topk = torch.arange(5 * B, 7 * B, dtype=torch.int32).view(1, -1)  # a's pages 5-6
        held = None
        for rid in ("a", "b"):
            rt.add_request(rid, 40, 8)
            oracle.add(rid)
            assert rt.state_row(rid) == 0
            write_random(rt, oracle, rid, 40)
            rt.commit()
            table = rt.host_block_table(rid)
            if held is None:  # the host blocks a's hot slots will hold
                held = table[5:7]
            else:  # b selects exactly the positions that land in those host blocks
                topk = torch.tensor([[table.index(h) * B + o for h in held for o in range(B)]],
                                    dtype=torch.int32)
                assert all(table.index(h) < cdiv(40, B) - 2 for h in held)  # offloaded
            for leader in rt.leaders:
                oracle.check_resolve(leader, [rid], topk, rt.resolve(leader, [rid], topk))
            rt.free_request(rid)
            oracle.free(rid)
        assert rt.stats().misses == 2 * 2 * TOPK    # b missed everything, like a did


def test_positions_appended_after_offload_are_served_from_resident_pages():
    """Rows written after the history left the GPU reach the host only at the next commit;
    until then resolve must serve them from their resident pages (never from stale host
    bytes), including a multi-page append."""
    with make_runtime(threshold=1) as rt:
        oracle = DenseOracle(rt, seed=7)
        rt.add_request("a", 40, 40)
        oracle.add("a")
        write_random(rt, oracle, "a", 40)
        rt.commit()                                    # pages 0-7 offloaded, 8-9 resident
        assert rt.stats().hot_blocks > 0
        rows = rt.append_slots("a", 13)                 # positions 40-52: 4 new pages
        oracle.write("a", rows)
        pos = torch.arange(40, 53)
        host_blocks = torch.tensor(rt.host_block_table("a"))
        for layer in rt.source_layers:                  # not on the host yet
            host = rt.host_cache(layer)[host_blocks[pos // B], pos % B]
            assert not torch.equal(host, oracle.dense_rows("a", layer)[40:53])
        topk = torch.tensor([[0, 5, 33, 39, 40, 44, 51, 52]], dtype=torch.int32)
        for leader in rt.leaders:
            out = rt.resolve(leader, ["a"], topk)
            oracle.check_resolve(leader, ["a"], topk, out)
            assert out[0, 4:].tolist() == rows[leader][[0, 4, 11, 12]].tolist()
        rt.commit()                                     # mirrored; pages up to 10 leave
        oracle.check_host("a", 53)
        assert rt.block_table("a", L0)[:cdiv(53, B) - ACTIVE_TAIL_PAGES] == \
            [0] * (cdiv(53, B) - ACTIVE_TAIL_PAGES)
        for leader in rt.leaders:
            out = rt.resolve(leader, ["a"], topk)
            oracle.check_resolve(leader, ["a"], topk, out)
        assert rt.stats().misses > 0


def test_views_match_the_kv_cache_config_tensors():
    """Every layer view is exactly the bytes its KVCacheTensor names (offset, strides)."""
    with make_runtime() as rt:
        kvc = rt.kv_cache_config
        host_end = max(t.offset + t.size for t in kvc.kv_cache_tensors if t.host_resident)
        assert rt.worker.host_pool.size_bytes == cdiv(host_end, 4096) * 4096
        for tensor in kvc.kv_cache_tensors:
            for name in tensor.layers:
                if tensor.host_resident:
                    view, pool = rt.host_cache(name), rt.worker.host_pool.tensor
                    assert view.shape[0] * tensor.block_stride == tensor.size
                else:
                    view, pool = rt.device_cache(name), rt.worker.device_pool.tensor
                    assert view.shape[0] == kvc.num_blocks
                row_bytes = view.shape[2]
                assert view.data_ptr() - pool.data_ptr() == tensor.offset
                assert view.stride() == (tensor.block_stride, row_bytes, 1)
                block, slot = view.shape[0] - 1, B - 1
                view[block, slot] = torch.arange(row_bytes, dtype=torch.uint8)
                start = tensor.offset + block * tensor.block_stride + slot * row_bytes
                assert torch.equal(pool[start:start + row_bytes],
                                   torch.arange(row_bytes, dtype=torch.uint8))
                view[block, slot] = 0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_released_pages_are_reused_only_after_the_mirror_read_them(device):
    """commit() releases sealed pages right after enqueuing their mirror; the next request
    gets those blocks and overwrites them. On CUDA the stream is kept busy so the mirror
    runs late: stream order alone must keep the host copy exact (no host sync needed)."""
    layers = (L0, L1, L2, L3)
    # 38 allocatable: a's 40 tokens take 10 pages x 3 groups + its 8 reserved hot blocks
    with make_runtime(max_num_seqs=2, device_blocks=39, regular=False, device=device,
                      backend="auto") as rt:
        rt.add_request("a", 40, 0)
        rows = rt.append_slots("a", 40)                 # the whole pool: 10 + 2 x 10 blocks
        assert rt.scheduler.available_device_blocks == 0   # (+ a's reserved hot region)
        data = {layer: torch.randint(0, 256, (40, ROW), dtype=torch.uint8, device=device)
                for layer in layers}
        for layer in layers:
            rows_t = rows[layer]
            rt.device_cache(layer)[rows_t // B, rows_t % B] = data[layer]
        resident = {layer: rt.block_table("a", layer) for layer in (L0, L2)}
        overwrite = torch.full((8, ROW), 0xFF, dtype=torch.uint8, device=device)
        if device == "cuda":
            torch.cuda._sleep(100_000_000)              # the mirror below waits behind this
        rt.commit()                                     # mirror enqueued, 16 blocks released
        rt.add_request("b", 8, 0)
        rows_b = rt.append_slots("b", 8)                # reuses released resident blocks
        reused = {b for layer in (L0, L2) for b in rt.block_table("b", layer)}
        released = {b for layer in (L0, L2) for b in resident[layer][:8]}
        assert reused & released
        for layer in rt.device_layers:
            r = rows_b[layer]
            cache = rt.device_cache(layer)
            cache[r // B, r % B] = overwrite[:, :cache.shape[2]]
        if device == "cuda":
            torch.cuda.synchronize()
        host_blocks = torch.tensor(rt.host_block_table("a"))
        pos = torch.arange(40)
        for layer in layers:
            host = rt.host_cache(layer)[host_blocks[pos // B], pos % B]
            assert torch.equal(host, data[layer].cpu()), layer


# ----------------------------------------------------------------------------- protocol
def test_a_steady_decode_loop_makes_one_plan_per_step():
    """append -> resolve (every index group) -> commit hands the worker ONE plan per step
    (the scheduler's flush at the first resolve); reads make none; changes between two
    resolves of a step travel in one more plan, mirrored in order at commit, exactly."""
    rt = make_runtime(max_num_seqs=2, threshold=1, free_block_watermark=1.0)
    with rt:
        oracle = DenseOracle(rt, seed=5)
        for rid in ("a", "b"):
            rt.add_request(rid, 20, 40)
            oracle.add(rid)
            write_random(rt, oracle, rid, 20)
        rt.commit()
        topk = torch.randint(-1, 30, (2, TOPK), dtype=torch.int32,
                             generator=torch.Generator().manual_seed(5))
        for step in range(6):
            plans = rt.worker.stats().plans
            for rid in ("a", "b"):
                write_random(rt, oracle, rid, 1)
            rt.block_tables(L0), rt.hot_slots(L0)          # reads make no plan
            assert rt.worker.stats().plans == plans
            for leader in rt.leaders:
                oracle.check_resolve(leader, ["a", "b"], topk,
                                     rt.resolve(leader, ["a", "b"], topk))
            if step == 3:                                  # a change between two resolves
                write_random(rt, oracle, "a", 1)
                oracle.check_resolve(L0, ["a", "b"], topk, rt.resolve(L0, ["a", "b"], topk))
            rt.commit()
            assert rt.worker.stats().plans - plans == (2 if step == 3 else 1)
        assert rt.stats().misses > 0 and rt.stats().d2h_bytes > 0
        for leader in rt.leaders:                          # every mirrored row reads back
            oracle.check_resolve(leader, ["a", "b"], topk, rt.resolve(leader, ["a", "b"], topk))


def test_a_plan_too_large_for_memory_fails_before_any_bookkeeping(monkeypatch):
    """The facade builds its worker (which checks every allocation first) before the
    scheduler's block lists: a plan of 400M device blocks is refused, naming it, and no
    scheduler is ever built."""
    import dataclasses

    import hisparse_triton.runtime as runtime_module

    def no_scheduler(*args, **kwargs):
        raise AssertionError("the scheduler was built before the memory check")
    monkeypatch.setattr(runtime_module, "HiSparseScheduler", no_scheduler)
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    plan = plan_for_workload(spec, max_model_len=96, num_requests=2, topk=TOPK,
                             device_buffer_size=BUFFER)
    huge = dataclasses.replace(plan.kv_cache_config, num_blocks=4 * 10**8)
    with pytest.raises(HostMemoryError, match="400000000 blocks"):
        HiSparseRuntime(huge, plan.config, max_num_seqs=2, device="cpu", backend="torch")
