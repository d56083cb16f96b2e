"""Serving semantics: evictable resident pages, chunked prefill, prefix reuse, MTP resolve.

Every test checks exactness with a dense oracle whose KV bytes are a pure function of what a
real model's KV depends on: the prompt prefix up to a position (so requests sharing a
prefix share its bytes, as prefix reuse assumes) or, for tokens without ids, the request and
the position. Geometry: ``tiny`` cut to 4 sparse layers in index groups of 2, block 4,
top-k 8, hot buffer 16 rows; no sliding-window layer (prefix reuse needs full histories).
"""

import dataclasses
import hashlib
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from hisparse_triton import CapacityError, HiSparseRuntime
from hisparse_triton.config import ACTIVE_TAIL_PAGES
from hisparse_triton.errors import ReservationExceededError, UncommittedTokensError
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.specs import FullAttentionSpec, cdiv
from hisparse_triton.workload import plan_for_workload

B, TOPK, BUFFER = 4, 8, 16
L0, L2 = "model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"
FULL = "model.layers.4.full_attn"


def make(*, max_num_seqs=3, max_model_len=64, device_blocks=None, watermark=0.1, q=1,
         max_num_batched_tokens=None, backend="torch", device="cpu", regular=False,
         host_blocks=None, buffer=BUFFER, draft_layers=()):
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    if regular:
        spec[FULL] = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype="uint8")
    plan = plan_for_workload(spec, max_model_len=max_model_len, num_requests=max_num_seqs,
                             topk=TOPK, device_buffer_size=buffer, device_blocks=device_blocks,
                             host_blocks=host_blocks)
    config = dataclasses.replace(
        plan.config, max_num_batched_tokens=max_num_batched_tokens,
        hisparse=dataclasses.replace(plan.config.hisparse, max_decode_query_len=q))
    return HiSparseRuntime(plan.kv_cache_config, config, max_num_seqs=max_num_seqs,
                           device=device, backend=backend, free_block_watermark=watermark,
                           draft_layers=draft_layers)


class Oracle:
    """Dense KV per request whose bytes depend on the prompt prefix (or on request and
    position for tokens without ids)."""

    def __init__(self, rt: HiSparseRuntime) -> None:
        self.rt = rt
        self.layers = list(rt.device_layers)
        self.row_bytes = {layer: rt.device_cache(layer).shape[-1] for layer in self.layers}
        self.keys: dict = {}      # request -> [seq_len] position keys
        self.tokens: dict = {}    # request -> prompt token ids (or None)
        self.epoch: dict = {}     # request -> rollbacks so far (re-appended tokens differ)

    @staticmethod
    def prefix_keys(tokens) -> list[int]:
        keys, h = [], b""
        for t in tokens:
            h = hashlib.sha256(h + int(t).to_bytes(8, "little", signed=True)).digest()
            keys.append(int.from_bytes(h[:7], "little"))
        return keys

    def add(self, rid, cached: int, tokens=None) -> None:
        self.tokens[rid] = None if tokens is None else list(tokens)
        self.keys[rid] = (self.prefix_keys(tokens)[:cached] if tokens is not None else [])
        assert len(self.keys[rid]) == cached

    def truncate(self, rid, new_len: int) -> None:
        """The dense copy rolls back too; tokens appended again get new bytes."""
        del self.keys[rid][new_len:]
        self.epoch[rid] = self.epoch.get(rid, 0) + 1

    def content(self, key: int, layer: str) -> torch.Tensor:
        n = self.row_bytes[layer]
        seed = torch.tensor((key * 1_000_003 + self.layers.index(layer) * 7_919) % (2**62))
        base = (torch.arange(n, dtype=torch.int64) * 1_442_695_040_888_963_407
                + seed * 6_364_136_223_846_793_005)
        return ((base >> 40) & 0xFF).to(torch.uint8)

    def write(self, rid, rows: dict) -> None:
        """The KV a model writes for the tokens ``append_slots`` just returned ``rows`` for."""
        keys = self.keys[rid]
        start = len(keys)
        n = next(iter(rows.values())).numel()
        tokens = self.tokens[rid]
        full = self.prefix_keys(tokens) if tokens is not None else []
        for pos in range(start, start + n):
            keys.append(full[pos] if pos < len(full)
                        else hash((str(rid), pos, "generated", self.epoch.get(rid, 0)))
                        & ((1 << 56) - 1))
        for layer in self.layers:
            cache = self.rt.device_cache(layer)
            r = rows[layer].to(cache.device)
            data = torch.stack([self.content(k, layer) for k in keys[start:]])
            cache[r // B, r % B] = data.to(cache.device)

    def check(self, leader: str, ids: list, topk: torch.Tensor, rows: torch.Tensor) -> int:
        """Every row ``resolve`` returned holds the dense bytes; -1 exactly where invalid."""
        if topk.dim() == 2:
            topk, rows = topk[:, None], rows[:, None]
        assert rows.shape == topk.shape
        checked = 0
        for r, rid in enumerate(ids):
            n = len(self.keys[rid]) if rid is not None else 0
            pos = topk[r].to(torch.int64).cpu()
            got = rows[r].to(torch.int64).cpu()
            valid = (pos >= 0) & (pos < n)
            assert torch.equal(got < 0, ~valid), (rid, pos, got)
            for layer in self.rt.index_group(leader):
                cache = self.rt.device_cache(layer)
                flat = cache.reshape(-1, cache.shape[-1])
                for p, g in zip(pos[valid].tolist(), got[valid].tolist()):
                    assert torch.equal(flat[g].cpu(), self.content(self.keys[rid][p], layer)), \
                        (rid, layer, p, g)
                    checked += 1
        return checked


def decode(rt, oracle, ids, steps, gen, q=1, span=None):
    """``steps`` decode steps: append q tokens each, resolve every index group, commit."""
    for _ in range(steps):
        for rid in ids:
            oracle.write(rid, rt.append_slots(rid, q))
        for leader in rt.leaders:
            hi = max(rt.seq_len(rid) for rid in ids)
            shape = (len(ids), q, TOPK) if q > 1 else (len(ids), TOPK)
            topk = torch.randint(0 if span is None else max(0, hi - span), hi + 1, shape,
                                 dtype=torch.int32, generator=gen)
            oracle.check(leader, ids, topk, rt.resolve(leader, ids, topk))
        rt.commit()


def no_page_left_gpu_without_a_hot_region(rt):
    """A request that has not offloaded reads every page from the GPU."""
    for rid in rt.request_ids:
        if not rt.scheduler.is_offloaded(rid):
            for layer in (L0, L2):
                assert all(rt.block_table(rid, layer)), (rid, layer)


# ------------------------------------------------------------------ evictable resident pages
def test_a_roomy_pool_at_batch_one_never_transfers():
    with make(device_blocks=400) as rt:
        oracle = Oracle(rt)
        rt.add_request("a", 40, 20)
        oracle.add("a", 0)
        oracle.write("a", rt.append_slots("a", 40))
        rt.commit()
        decode(rt, oracle, ["a"], 20, torch.Generator().manual_seed(0))
        stats = rt.stats()
        assert stats.misses == 0 and stats.h2d_bytes == 0 and stats.hits > 0
        assert stats.offloaded_requests == 0 and stats.hot_blocks == 0
        assert stats.unpinned_pages == 0
        no_page_left_gpu_without_a_hot_region(rt)


def test_under_pressure_pages_are_unpinned_then_lost_and_stay_exact():
    gen = torch.Generator().manual_seed(1)
    with make(max_num_seqs=3, device_blocks=100, max_model_len=64) as rt:
        oracle = Oracle(rt)
        for rid, n in (("a", 36), ("b", 28), ("c", 20)):
            rt.add_request(rid, n, 24)
            oracle.add(rid, 0)
            oracle.write(rid, rt.append_slots(rid, n))
            rt.commit()
        decode(rt, oracle, ["a", "b", "c"], 24, gen)
        stats = rt.stats()
        assert stats.offloaded_requests > 0 and stats.unpinned_pages > 0
        assert stats.lost_pages > 0 and stats.misses > 0 and stats.hits > 0
        no_page_left_gpu_without_a_hot_region(rt)
        # a lost page reads as 0 in the request's resident table; an unpinned one keeps its block
        lost = [b == 0 for rid in ("a", "b", "c") for b in rt.block_table(rid, L0)]
        assert any(lost)


def test_unpinned_pages_are_served_without_transfers_until_reused():
    """Under pressure the pages leave the pool's ownership, but while no one takes their
    blocks they are read where they are: no miss."""
    # a's 10 pages x 3 groups + its hot region + b's reserved one: no other free block
    with make(max_num_seqs=2, device_blocks=47, watermark=200) as rt:  # always pressure
        oracle = Oracle(rt)
        rt.add_request("a", 40, 8)
        oracle.add("a", 0)
        oracle.write("a", rt.append_slots("a", 40))
        rt.commit()
        stats = rt.stats()
        unpinned = cdiv(40, B) - ACTIVE_TAIL_PAGES
        assert stats.offloaded_requests == 1 and stats.unpinned_pages == 2 * unpinned
        assert all(rt.block_table("a", L0))          # still readable where they are
        topk = torch.arange(TOPK, dtype=torch.int32).view(1, -1)
        for leader in rt.leaders:
            oracle.check(leader, ["a"], topk, rt.resolve(leader, ["a"], topk))
        assert rt.stats().misses == 0
        # rows a resolve served in place are valid until commit(): their blocks are held
        rt.add_request("b", 20, 0)
        with pytest.raises(CapacityError, match="held until the step ends"):
            rt.append_slots("b", 20)
        rt.free_request("b")
        rt.commit()
        # then another request takes those blocks: a's pages are lost, read from host, exact
        rt.add_request("b", 20, 0)
        oracle.add("b", 0)
        oracle.write("b", rt.append_slots("b", 20))
        assert rt.stats().lost_pages > 0
        # unpinned tail first: the newest of a's unpinned pages were reused first
        lost = [p for p, b in enumerate(rt.block_table("a", L0)) if b == 0]
        assert lost and max(lost) == cdiv(40, B) - ACTIVE_TAIL_PAGES - 1
        topk = torch.tensor([[lost[0] * B + o for o in range(B)] * 2], dtype=torch.int32)
        for leader in rt.leaders:
            oracle.check(leader, ["a", "b"], torch.cat([topk, topk]),
                         rt.resolve(leader, ["a", "b"], torch.cat([topk, topk])))
        assert rt.stats().misses > 0


# ------------------------------------------------------------------ chunked prefill
def test_chunked_prefill_streams_a_long_prompt_through_about_one_chunk():
    chunk = 16
    with make(max_num_seqs=1, max_model_len=128, device_blocks=200,
              max_num_batched_tokens=chunk) as rt:
        oracle = Oracle(rt)
        rt.add_request("a", 120, 8)
        oracle.add("a", 0)
        oracle.write("a", rt.append_slots("a", 10))
        before = rt._debug_snapshot()
        with pytest.raises(UncommittedTokensError, match=r"leave 17 tokens uncommitted, more "
                                                         r"than max_num_batched_tokens=16"):
            rt.append_slots("a", 7)
        assert rt._debug_snapshot() == before
        assert isinstance(UncommittedTokensError("x", "a"), ReservationExceededError)
        oracle.write("a", rt.append_slots("a", 6))
        rt.commit()
        peak = 0
        while rt.seq_len("a") < 120:
            oracle.write("a", rt.append_slots("a", min(chunk, 120 - rt.seq_len("a"))))
            peak = max(peak, rt.stats().resident_blocks)
            rt.commit()
        # a request longer than its admission window keeps about one chunk on the GPU
        window = cdiv(chunk, B)
        assert peak <= 2 * (window + ACTIVE_TAIL_PAGES + 1)
        assert rt.stats().resident_blocks <= 2 * (ACTIVE_TAIL_PAGES + 1)
        decode(rt, oracle, ["a"], 8, torch.Generator().manual_seed(2))
        assert rt.stats().misses == 0   # a roomy pool: its unpinned pages are still readable


# ------------------------------------------------------------------ prefix reuse
def test_prefix_reuse_shares_host_blocks_and_adopts_gpu_copies():
    with make(max_num_seqs=3, max_model_len=64, device_blocks=300) as rt:
        oracle = Oracle(rt)
        shared = list(range(100, 132))
        a_tokens = shared + [1, 2, 3, 4, 5, 6, 7, 8]
        assert rt.add_request("a", 40, 8, token_ids=a_tokens) == 0   # nothing cached yet
        oracle.add("a", 0, a_tokens)
        oracle.write("a", rt.append_slots("a", 40))
        rt.commit()                                     # a's pages durable: published
        b_tokens = shared + [9, 9, 9, 9, 9]
        cached = rt.add_request("b", 37, 8, token_ids=b_tokens)
        assert cached == 32                             # 8 full shared pages
        oracle.add("b", cached, b_tokens)
        assert rt.seq_len("b") == 32
        assert rt.host_block_table("b")[:8] == rt.host_block_table("a")[:8]
        for layer in (L0, L2, "model.layers.0.self_attn.indexer"):
            assert rt.block_table("b", layer)[:8] == rt.block_table("a", layer)[:8]
        stats = rt.stats()
        assert stats.prefix_hit_tokens == 32 and stats.readopted_pages == 2 * 8
        assert stats.prefix_query_tokens == 40 + 37
        oracle.write("b", rt.append_slots("b", 5))      # only the uncached rest
        rt.commit()
        decode(rt, oracle, ["a", "b"], 6, torch.Generator().manual_seed(3))
        # the whole prompt cached: one token is always left to compute
        assert rt.add_request("c", 32, 4, token_ids=shared) == 28
        rt.free_request("c")
        # a prompt that differs in its first page shares nothing
        assert rt.add_request("d", 32, 4, token_ids=[7] + shared[1:]) == 0


def test_prefix_survives_its_request_and_is_evicted_when_space_is_needed():
    with make(max_num_seqs=2, max_model_len=64, device_blocks=80) as rt:
        oracle = Oracle(rt)
        tokens = list(range(40))
        rt.add_request("a", 40, 0, token_ids=tokens)
        oracle.add("a", 0, tokens)
        oracle.write("a", rt.append_slots("a", 40))
        rt.commit()
        rt.free_request("a")
        assert rt.stats().cached_device_blocks > 0
        cached = rt.add_request("b", 40, 4, token_ids=tokens)
        assert cached == 36
        oracle.add("b", cached, tokens)
        oracle.write("b", rt.append_slots("b", 4))
        rt.commit()
        topk = torch.arange(TOPK, dtype=torch.int32).view(1, -1) * 4
        for leader in rt.leaders:
            oracle.check(leader, ["b"], topk, rt.resolve(leader, ["b"], topk))
        rt.free_request("b")
        # requests that fit in the truly free blocks leave the cached pages alone
        rt.add_request("x", 40, 0)
        rt.append_slots("x", 40)
        rt.commit()
        rt.free_request("x")
        assert rt.stats().lost_pages == 0
        assert rt.add_request("c", 40, 0, token_ids=tokens) == 36
        rt.free_request("c")
        # unrelated requests need the space: the cached pages go (the first freed first:
        # b's last pages)
        for rid in ("x", "y"):
            rt.add_request(rid, 40, 0)
            rt.append_slots(rid, 40)
        rt.commit()
        for rid in ("x", "y"):
            rt.free_request(rid)
        assert rt.add_request("c", 40, 0, token_ids=tokens) < 36
        rt.free_request("c")
        dropped = rt.reset_prefix_cache()
        stats = rt.stats()
        assert stats.cached_device_blocks == 0 and dropped >= 0
        assert stats.device_blocks == 0 and stats.host_blocks == 0


def test_a_prefix_left_only_on_the_host_starts_offloaded_and_reads_it_exactly():
    with make(max_num_seqs=3, max_model_len=64, device_blocks=70, watermark=1.0) as rt:
        oracle = Oracle(rt)
        tokens = list(range(50, 90))
        rt.add_request("a", 40, 8, token_ids=tokens)
        oracle.add("a", 0, tokens)
        oracle.write("a", rt.append_slots("a", 40))
        rt.commit()          # published, then a's pages leave the GPU (pure HiSparse)
        # another request takes every free block: the cached resident copies are reused
        rt.add_request("c", 64, 0)
        per_page = 3  # indexer + 2 resident groups
        pages = min(rt.scheduler.available_device_blocks // per_page, 16)
        rt.append_slots("c", pages * B)
        rt.free_request("c")
        cached = rt.add_request("b", 40, 8, token_ids=tokens)
        assert cached == 36
        assert rt.scheduler.is_offloaded("b")           # its prefix is read from host
        assert rt.stats().readopted_pages < 2 * 9
        oracle.add("b", cached, tokens)
        oracle.write("b", rt.append_slots("b", 4))
        rt.commit()
        topk = torch.arange(0, 36, 36 // TOPK, dtype=torch.int32)[:TOPK].view(1, -1)
        misses = rt.stats().misses
        for leader in rt.leaders:
            oracle.check(leader, ["b"], topk, rt.resolve(leader, ["b"], topk))
        assert rt.stats().misses > misses


def test_pure_hisparse_drops_pages_at_once_even_for_the_prefix_cache():
    """#22: with free_block_watermark=1.0 (documented: committed pages leave the GPU at
    once) a second request with the same prompt re-adopted 18 resident pages; now the
    prefix is reused from the host only (indexer pages stay shared: they never leave)."""
    with make(max_num_seqs=2, max_model_len=64, device_blocks=300, watermark=1.0) as rt:
        oracle = Oracle(rt)
        tokens = list(range(60, 100))
        rt.add_request("a", 40, 8, token_ids=tokens)
        oracle.add("a", 0, tokens)
        oracle.write("a", rt.append_slots("a", 40))
        rt.commit()
        cached = rt.add_request("b", 40, 8, token_ids=tokens)
        assert cached == 36 and rt.stats().readopted_pages == 0
        assert rt.scheduler.is_offloaded("b")
        assert rt.block_table("b", L0)[:9] == [0] * 9
        oracle.add("b", cached, tokens)
        oracle.write("b", rt.append_slots("b", 4))
        rt.commit()
        _check_all(rt, oracle, "b")


def test_prefix_reuse_needs_token_ids_of_the_prompt_length():
    with make() as rt:
        with pytest.raises(ValueError, match=r"token_ids must be 8 ints"):
            rt.add_request("a", 8, 4, token_ids=[1, 2, 3])
        with pytest.raises(ValueError, match=r"token_ids must be 8 ints"):
            rt.add_request("a", 8, 4, token_ids=[0.5] * 8)
        assert not rt.has_request("a")


# ------------------------------------------------------------------ generated pages reused
def _generate(rt, oracle, rid, answer, gen):
    """Decode ``answer`` one token per step, with its ids; exact throughout."""
    for token in answer:
        oracle.write(rid, rt.append_slots(rid, 1, token_ids=[token]))
        for leader in rt.leaders:
            topk = torch.randint(0, rt.seq_len(rid), (1, TOPK), dtype=torch.int32,
                                 generator=gen)
            oracle.check(leader, [rid], topk, rt.resolve(leader, [rid], topk))
        rt.commit()


def _check_all(rt, oracle, rid):
    n = rt.seq_len(rid)
    for leader in rt.leaders:
        for start in range(0, n, TOPK):
            topk = torch.arange(start, start + TOPK, dtype=torch.int32).clamp(max=n - 1)
            oracle.check(leader, [rid], topk.view(1, -1), rt.resolve(leader, [rid],
                                                                     topk.view(1, -1)))


def _fill_the_pool(rt):
    """Another request takes every truly free device block and a few cached ones (the
    pages they held are evicted: the newest freed first)."""
    rt.add_request("filler", 64, 0)
    pages = rt.scheduler.truly_free_device_blocks // len(rt.scheduler.devices.paged) + 2
    assert pages * len(rt.scheduler.devices.paged) <= rt.scheduler.available_device_blocks
    rt.append_slots("filler", pages * B)
    rt.commit()
    rt.free_request("filler")


@pytest.mark.parametrize("pressure", [False, True])
def test_a_second_turn_reuses_the_first_turns_generated_pages(pressure):
    gen = torch.Generator().manual_seed(8)
    watermark = 0.1
    with make(max_num_seqs=2, max_model_len=64, device_blocks=50 if pressure else 300,
              watermark=watermark) as rt:
        oracle = Oracle(rt)
        prompt, answer = list(range(300, 318)), list(range(500, 512))   # 18 + 12 tokens
        assert rt.add_request("t1", len(prompt), len(answer), token_ids=prompt) == 0
        oracle.add("t1", 0, prompt + answer)
        oracle.write("t1", rt.append_slots("t1", len(prompt)))
        rt.commit()
        _generate(rt, oracle, "t1", answer, gen)
        rt.free_request("t1")
        if pressure:
            _fill_the_pool(rt)
        turn2 = prompt + answer + [7, 8, 9, 10, 11, 12]
        cached = rt.add_request("t2", len(turn2), 4, token_ids=turn2)
        full = (len(prompt) + len(answer)) // B * B                 # every full page: 28
        assert 0 < cached < full if pressure else cached == full
        oracle.add("t2", cached, turn2)
        oracle.write("t2", rt.append_slots("t2", len(turn2) - cached))
        rt.commit()
        _check_all(rt, oracle, "t2")
        rt.free_request("t2")
        rt.scheduler.check_invariants()


@pytest.mark.parametrize("pressure", [False, True])
def test_a_preempted_request_resumed_with_its_tokens_recomputes_nothing_cached(pressure):
    gen = torch.Generator().manual_seed(9)
    with make(max_num_seqs=2, max_model_len=64, device_blocks=50 if pressure else 300,
              watermark=0.1) as rt:
        oracle = Oracle(rt)
        prompt, answer = list(range(40, 53)), list(range(900, 920))    # 13 + 20 tokens
        rt.add_request("a", len(prompt), len(answer), token_ids=prompt)
        oracle.add("a", 0, prompt + answer)
        oracle.write("a", rt.append_slots("a", len(prompt)))
        rt.commit()
        _generate(rt, oracle, "a", answer[:11], gen)            # 24 tokens: 6 full pages
        rt.free_request("a")                                    # preempted
        if pressure:
            _fill_the_pool(rt)
        done = prompt + answer[:11]
        cached = rt.add_request("a", len(done), 9, token_ids=done)
        full = (len(done) - 1) // B * B                         # one token is computed
        assert 0 < cached < full if pressure else cached == full
        oracle.add("a", cached, prompt + answer)
        oracle.write("a", rt.append_slots("a", len(done) - cached))
        rt.commit()
        _generate(rt, oracle, "a", answer[11:], gen)
        _check_all(rt, oracle, "a")


def test_generated_token_ids_are_checked():
    with make(device_blocks=200) as rt:
        rt.add_request("a", 6, 8, token_ids=list(range(6)))
        before = rt._debug_snapshot()
        with pytest.raises(ValueError, match=r"token_ids must be 6 ints"):
            rt.append_slots("a", 6, token_ids=[1, 2])
        with pytest.raises(ValueError, match=r"positions 0..5 differ from its prompt's"):
            rt.append_slots("a", 6, token_ids=[9] * 6)
        assert rt._debug_snapshot() == before
        rt.append_slots("a", 6, token_ids=list(range(6)))
        rt.append_slots("a", 2)                       # no ids: the chain ends here
        rt.append_slots("a", 2, token_ids=[1, 2])     # ... and is not resumed
        rt.commit()
        rt.free_request("a")
        assert rt.add_request("b", 12, 0, token_ids=list(range(6)) + [0] * 6) == 4


# ------------------------------------------------------------------ speculative decoding
def test_mtp_resolves_the_draft_tokens_as_one_union():
    with make(max_num_seqs=2, device_blocks=200, watermark=1.0, q=2) as rt:
        oracle = Oracle(rt)
        rt.add_request("a", 40, 8)
        oracle.add("a", 0)
        oracle.write("a", rt.append_slots("a", 40))
        rt.commit()
        first = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
        second = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11], dtype=torch.int32)  # 4 shared
        topk = torch.stack([first, second]).view(1, 2, TOPK)
        rows = rt.resolve(L0, ["a"], topk)
        assert rows.shape == (1, 2, TOPK)
        oracle.check(L0, ["a"], topk, rows)
        stats = rt.stats()
        assert stats.misses == 12                       # distinct positions, once each
        assert torch.equal(rows[0, 0, 4:], rows[0, 1, :4])  # a shared position: one slot
        with pytest.raises(ValueError, match="max_decode_query_len is 2"):
            rt.resolve(L0, ["a"], torch.zeros(1, 3, 4, dtype=torch.int32))
        with pytest.raises(ValueError, match=r"top-k width 18 \(q x k\)"):
            rt.resolve(L0, ["a"], torch.zeros(1, 2, 9, dtype=torch.int32))
        decode(rt, oracle, ["a"], 3, torch.Generator().manual_seed(4), q=2)


def _speculate(rt, oracle, ids, steps, gen, rng, q):
    """``steps`` MTP steps: each request appends ``q`` tokens (the last accepted one and
    ``q - 1`` drafts), every index group resolves ``[R, q, K]``, a drafter that is wrong at
    random accepts 0..q-1 drafts, the rejected ones are rolled back before ``commit()``."""
    rolled = 0
    for _ in range(steps):
        for rid in ids:
            oracle.write(rid, rt.append_slots(rid, q))
        for leader in rt.leaders:
            hi = max(rt.seq_len(rid) for rid in ids)
            topk = torch.randint(-1, hi + 2, (len(ids), q, TOPK), dtype=torch.int32,
                                 generator=gen)
            oracle.check(leader, ids, topk, rt.resolve(leader, ids, topk))
        for rid in ids:
            rejected = q - 1 - rng.randint(0, q - 1)
            new_len = rt.seq_len(rid) - rejected
            rt.truncate(rid, new_len)
            oracle.truncate(rid, new_len)
            rolled += rejected
        for leader in rt.leaders:   # dropped positions are masked, kept ones exact
            hi = max(rt.seq_len(rid) for rid in ids)
            topk = torch.randint(max(0, hi - 8), hi + q, (len(ids), TOPK), dtype=torch.int32,
                                 generator=gen)
            oracle.check(leader, ids, topk, rt.resolve(leader, ids, topk))
        rt.commit()
    return rolled


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_drafter_wrong_at_random_rolls_back_exactly(backend):
    """Random acceptance, offloading and eviction: exact against a dense oracle that rolls
    back too; no block leaks; both backends (Triton: the interpreter on CPU)."""
    q = 3
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    steps = 14 if backend == "torch" else 4
    configs = ((1.0, 200), (0.1, 60)) if backend == "torch" else ((1.0, 200),)
    for watermark, blocks in configs:
        with make(max_num_seqs=2, device_blocks=blocks, watermark=watermark, q=q,
                  backend=backend, device=device, buffer=q * TOPK) as rt:
            rng, gen = random.Random(7), torch.Generator().manual_seed(7)
            oracle = Oracle(rt)
            initial = rt.device_block_pool.num_free
            for rid, n in (("a", 22), ("b", 13)):
                rt.add_request(rid, n, q * steps)
                oracle.add(rid, 0)
                oracle.write(rid, rt.append_slots(rid, n))
                rt.commit()
            assert _speculate(rt, oracle, ["a", "b"], steps, gen, rng, q) > 0
            if watermark == 1.0:
                assert rt.stats().misses > 0
            rt.scheduler.check_invariants()
            for rid in ("a", "b"):
                rt.free_request(rid)
            assert rt.device_block_pool.num_free == initial


def test_truncate_is_refused_for_committed_tokens_and_changes_nothing():
    with make(device_blocks=200) as rt:
        rt.add_request("a", 10, 8)
        rt.append_slots("a", 10)
        rt.commit()
        rt.append_slots("a", 3)
        before = rt._debug_snapshot()
        with pytest.raises(ValueError, match=r"first 10 are durable"):
            rt.truncate("a", 9)
        with pytest.raises(ValueError, match=r"cannot truncate to 14 tokens, it has 13"):
            rt.truncate("a", 14)
        assert rt._debug_snapshot() == before


def test_draft_layer_rows_must_be_mirrored_before_commit():
    """The drafter writes its layers' KV after the main forward (and the rollback):
    ``mirror_draft()`` copies them, and ``commit()`` refuses a step whose draft rows were
    not copied (it makes the tokens durable and may hand their blocks to others)."""
    with make(device_blocks=200, draft_layers=[L2]) as rt:
        oracle = Oracle(rt)
        rt.add_request("a", 10, 8)
        oracle.add("a", 0)
        oracle.write("a", rt.append_slots("a", 10))
        rt.flush()
        before = rt._debug_snapshot()
        with pytest.raises(ValueError, match=r"draft layers' rows of plan 1 were not mirrored"
                                             r".*call mirror_draft\(\), then commit"):
            rt.commit()
        assert rt._debug_snapshot() == before
        rt.mirror_draft()
        rt.commit()
        host, device = rt.host_cache(L2), rt.device_cache(L2)
        for pos in range(10):
            h, d = rt.host_block_table("a")[pos // B], rt.block_table("a", L2)[pos // B]
            assert torch.equal(host[h, pos % B], device[d, pos % B].cpu())
        rt.append_slots("a", 2)
        rt.truncate("a", 11)                 # rolled back before the drafter runs
        rt.mirror_draft()
        rt.commit()
    with make() as rt, pytest.raises(ValueError, match=r"mirror_draft\(\): this runtime has "
                                                      r"no draft layers"):
        rt.mirror_draft()


# ------------------------------------------------------------------ everything at once
OPS = ("add", "add_shared", "append", "chunk", "commit", "resolve", "resolve_q2", "free")


def _run_ops(rt, ops, seed):
    """Drive ``rt`` through ``ops`` (names from ``OPS``); exact throughout, nothing leaks."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    oracle = Oracle(rt)
    shared = [rng.randrange(1000) for _ in range(24)]
    live: dict = {}
    initial = (rt.device_block_pool.num_free, rt.host_block_pool.num_free)
    limit = rt.scheduler.max_num_batched_tokens or 10**9
    next_id = 0
    for op in ops:
        if op in ("add", "add_shared") and len(live) < rt.max_num_seqs:
            rid = f"r{next_id}"
            next_id += 1
            prompt = rng.randint(2, 40)
            tokens = None
            if op == "add_shared":
                tokens = shared[:min(prompt, 24)] + [rng.randrange(1000)
                                                     for _ in range(max(0, prompt - 24))]
            before = rt._debug_snapshot()
            try:
                cached = rt.add_request(rid, prompt, rng.randint(0, 20), token_ids=tokens)
            except CapacityError:
                assert rt._debug_snapshot() == before
                continue
            oracle.add(rid, cached, tokens)
            live[rid] = prompt
        elif op in ("append", "chunk") and live:
            rid = rng.choice(sorted(live))
            n = 1 if op == "append" else rng.randint(1, 20)
            before = rt._debug_snapshot()
            try:
                oracle.write(rid, rt.append_slots(rid, n))
            except (CapacityError, ReservationExceededError) as exc:
                assert rt._debug_snapshot() == before, type(exc).__name__
                if isinstance(exc, UncommittedTokensError):
                    assert n > 0 and limit < 10**9
        elif op == "commit":
            rt.commit()
        elif op in ("resolve", "resolve_q2") and live:
            ids = rng.sample(sorted(live), rng.randint(1, len(live)))
            if rng.random() < 0.3:
                ids.insert(0, None)
            q = 2 if op == "resolve_q2" else 1
            hi = max(rt.seq_len(rid) for rid in ids if rid is not None)
            shape = (len(ids), q, TOPK) if q == 2 else (len(ids), TOPK)
            topk = torch.randint(-2, hi + 3, shape, dtype=torch.int32, generator=gen)
            for leader in rt.leaders:
                oracle.check(leader, ids, topk, rt.resolve(leader, ids, topk))
        elif op == "free" and live:
            rid = rng.choice(sorted(live))
            rt.free_request(rid)
            del live[rid]
        no_page_left_gpu_without_a_hot_region(rt)
    for rid in list(live):
        rt.free_request(rid)
    rt.reset_prefix_cache()
    assert (rt.device_block_pool.num_free, rt.host_block_pool.num_free) == initial, "leak"
    stats = rt.stats()
    assert stats.device_blocks == 0 and stats.host_blocks == 0
    assert stats.cached_device_blocks == 0
    return stats


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), min_size=20, max_size=70),
       seed=st.integers(0, 2**16), device_blocks=st.sampled_from([48, 60, 90, 400]),
       watermark=st.sampled_from([0.1, 1.0]), chunk=st.sampled_from([None, 12]))
def test_random_serving_interleavings_are_exact(ops, seed, device_blocks, watermark, chunk):
    with make(max_num_seqs=3, device_blocks=device_blocks, watermark=watermark, q=2,
              max_num_batched_tokens=chunk) as rt:
        _run_ops(rt, ops, seed)


def test_triton_backend_matches_torch_through_the_serving_paths():
    """The same op sequence on the Triton backend (the interpreter on CPU) and the torch
    backend: both exact, same counters."""
    ops = ["add_shared", "chunk", "chunk", "commit", "add_shared", "chunk", "commit",
           "resolve", "resolve_q2", "append", "append", "commit", "resolve", "free",
           "add", "chunk", "commit", "resolve_q2"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stats = []
    for backend, dev in (("triton", device), ("torch", "cpu")):
        with make(max_num_seqs=3, device_blocks=60, watermark=1.0, q=2, backend=backend,
                  device=dev) as rt:
            stats.append(_run_ops(rt, ops, seed=11))
    assert stats[0] == stats[1] and stats[0].misses > 0
