"""Prefill/decode disaggregation: a prompt prefilled on one runtime decodes on another.

The prefill side says where a finished request's bytes live (``export_request``); the
decode side admits the request with ``import_request`` (which reserves its memory and says
where each prompt token's bytes go), a transport writes them (here: plain torch copies
between the two runtimes' pools, or byte copies at ``row_offsets`` into the flat pools, as
an RDMA engine addresses registered memory), then ``finish_import`` makes them durable and
publishes them, or ``abort_import`` gives everything back.

Exactness is checked by a dense oracle whose bytes are a pure function of the prompt prefix
(two runtimes, or two requests sharing a prefix, compute the same KV from the same tokens).
Geometry: ``tests/test_runtime.py``'s (``tiny`` cut to 4 layers, block 4, top-k 8, a full
and a sliding-window layer unless ``regular=False``: prefix reuse needs full histories).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_triton import CapacityError, HiSparseRuntime, UnknownRequestError
from hisparse_triton.errors import DuplicateRequestError
from hisparse_triton.oracle import DenseOracle, SplitView, position_bytes
from hisparse_triton.scheduler import KVExport, KVImport
from test_runtime import B, FULL, L0, SWA, TOPK, make_runtime
from test_runtime_oracle import TRITON_DEVICE
from test_serving import Oracle
from test_split import halves, run_plan


# ----------------------------------------------------------------------------- helpers
class Tokens:
    """The token ids of every request (prompt and generated), and the oracle content that
    follows from them."""

    def __init__(self, layers) -> None:
        self.layers = sorted(layers)
        self.ids: dict = {}

    def content(self, rid, layer, positions, row_bytes):
        keys = torch.tensor(Oracle.prefix_keys(self.ids[rid]), dtype=torch.int64)[positions]
        return position_bytes(keys, self.layers.index(layer), positions, row_bytes)


def oracle_for(rt, tokens: Tokens) -> DenseOracle:
    return DenseOracle(rt, content=tokens.content)


def prefill(rt: HiSparseRuntime, oracle: DenseOracle, rid, tokens: list[int],
            max_new_tokens: int = 0) -> KVExport:
    """The prefill side: compute (write) the prompt's KV, commit, say where it lives."""
    cached = rt.add_request(rid, len(tokens), max_new_tokens, token_ids=tokens)
    oracle.add(rid, cached)
    oracle.write(rid, rt.append_slots(rid, len(tokens) - cached))
    rt.commit()
    return rt.export_request(rid)


def cache_of(rt, layer: str, host: bool) -> torch.Tensor:
    return rt.host_cache(layer) if host else rt.device_cache(layer)


def transport(src, dst, imp: KVImport, export: KVExport, *, limit=None) -> int:
    """Move the rows ``imp.copies(export)`` names from ``src``'s pools to ``dst``'s with
    plain torch copies (``src``/``dst``: a runtime or a worker); ``limit``: stop after that
    many copies (a transfer cut short). Returns the rows moved."""
    moved = 0
    for copy in imp.copies(export)[:limit]:
        s_cache, d_cache = cache_of(src, copy.layer, copy.src_host), cache_of(dst, copy.layer,
                                                                             copy.dst_host)
        s, d = torch.as_tensor(copy.src_rows), torch.as_tensor(copy.dst_rows)
        sb, db = s_cache.shape[1], d_cache.shape[1]
        data = s_cache[(s // sb).to(s_cache.device), (s % sb).to(s_cache.device)]
        d_cache[(d // db).to(d_cache.device), (d % db).to(d_cache.device)] = \
            data.to(d_cache.device)
        moved += len(d)
    return moved


def decode(rt, oracle, tokens: Tokens, ids, steps, gen) -> None:
    """``steps`` decode steps of ``ids``: append one token (with its id) each, resolve
    every index group and check it against the oracle, commit."""
    for _ in range(steps):
        for rid in ids:
            new = int(torch.randint(0, 1000, (1,), generator=gen))
            tokens.ids[rid].append(new)
            oracle.write(rid, rt.append_slots(rid, 1, token_ids=[new]))
        for leader in rt.leaders:
            hi = max(rt.seq_len(rid) for rid in ids)
            topk = torch.randint(-1, hi + 1, (len(ids), TOPK), dtype=torch.int32, generator=gen)
            oracle.check_resolve(leader, ids, topk, rt.resolve(leader, ids, topk))
        rt.commit()


def pools(rt):
    s = rt.stats()
    return (rt.device_block_pool.num_free, rt.host_block_pool.num_free, s.device_blocks,
            s.host_blocks, s.hot_blocks, s.num_requests)


def sides(backend="torch", **kwargs):
    """A prefill runtime, a decode runtime of the same plan, the tokens and an oracle each."""
    kwargs.setdefault("max_num_seqs", 2)
    kwargs.setdefault("max_model_len", 64)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    P, D = (make_runtime(backend=backend, device=device, **kwargs) for _ in range(2))
    tokens = Tokens(P.device_layers)
    return P, D, tokens, oracle_for(P, tokens), oracle_for(D, tokens)


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("backend,prompt,steps,watermark", [
    ("torch", 37, 10, 1.0), ("torch", 37, 10, 0.1), ("torch", 6, 4, 1.0),
    ("triton", 21, 3, 1.0)])
def test_a_prompt_prefilled_on_one_runtime_decodes_exactly_on_another(backend, prompt, steps,
                                                                       watermark):
    """Prefill on P, bytes copied, decode on D: every resolve matches the dense oracle; a
    request decoding on D meanwhile is not disturbed (its commits neither mirror nor make
    the importing prompt durable); D's state row and hot slots were used before. The
    prompt's pages before its resident tail go to the host pool only (the request starts
    offloaded), whatever the watermark; a prompt of at most two pages goes to the GPU."""
    P, D, tokens, op, od = sides(backend, free_block_watermark=watermark)
    with P, D:
        gen = torch.Generator().manual_seed(1)
        initial = pools(D)
        # D serves a request first: the import reuses its state row and hot slots.
        tokens.ids["w"] = list(range(100, 100 + 30))
        prefill(D, od, "w", list(tokens.ids["w"]), 8)
        decode(D, od, tokens, ["w"], 2, gen)
        D.free_request("w")
        od.free("w")
        tokens.ids["v"] = list(range(500, 500 + 9))
        prefill(D, od, "v", list(tokens.ids["v"]), 20)

        tokens.ids["a"] = [int(t) for t in torch.randint(0, 1000, (prompt,), generator=gen)]
        export = prefill(P, op, "a", list(tokens.ids["a"]))
        assert export.num_tokens == prompt and export.host_rows.shape == (prompt,)
        imp = D.import_request("a", prompt, steps + 2, token_ids=tokens.ids["a"])
        tail = max((prompt + B - 1) // B - 2, 0)
        assert (imp.cached_len, imp.tail_start, imp.prompt_len) == (0, tail * B, prompt)
        assert imp.host_rows.shape == (tail * B,) and imp.host_rows.dtype == np.int64
        assert set(imp.device_rows) == set(D.device_layers)
        assert imp.device_start(L0) == tail * B and imp.device_start(FULL) == 0
        assert D.is_importing("a") and (D.scheduler.is_offloaded("a") or not tail)
        # The transport runs while D keeps decoding another request.
        half = len(imp.copies(export)) // 2
        transport(P, D, imp, export, limit=half)
        d2h = D.stats().d2h_bytes
        decode(D, od, tokens, ["v"], 2, gen)
        # The steps mirrored v's two tokens, nothing of the importing prompt.
        assert D.stats().d2h_bytes - d2h == 2 * sum(map(D.row_bytes, D.source_layers))
        assert D.is_importing("a")
        D.scheduler.check_invariants()
        with pytest.raises(ValueError, match="being imported"):
            D.export_request("a")
        transport(P, D, imp, export)
        D.finish_import("a")
        assert not D.is_importing("a")
        od.add("a", prompt)
        od.check_host("a", tail * B)         # the host part went straight to the host pool
        decode(D, od, tokens, ["a", "v"], steps, gen)
        od.check_pages("a")
        od.check_host("a", D.seq_len("a"))   # the tail was mirrored once imported
        assert D.stats().misses > 0
        for rid in ("a", "v"):
            D.free_request(rid)
        D.scheduler.check_invariants()
        assert pools(D) == initial
        assert od.rows_checked > 0


def test_the_sliding_window_keeps_only_the_rows_it_reads():
    """A sliding-window layer's pages the prefill side released are -1 in the export and
    left out of the copies; the decode side still decodes exactly and frees them at once."""
    P, D, tokens, op, od = sides(max_model_len=96)
    with P, D:
        tokens.ids["a"] = list(range(40))
        export = prefill(P, op, "a", list(tokens.ids["a"]))
        assert (export.device_rows[SWA] == -1).any() and (export.device_rows[FULL] >= 0).all()
        imp = D.import_request("a", 40, 8)
        swa = [c for c in imp.copies(export) if c.layer == SWA]
        assert len(swa) == 1 and len(swa[0].dst_rows) == int((export.device_rows[SWA] >= 0).sum())
        transport(P, D, imp, export)
        D.finish_import("a")
        assert 0 in D.block_table("a", SWA)   # out-of-window pages went back at once
        od.add("a", 40)
        decode(D, od, tokens, ["a"], 4, torch.Generator().manual_seed(2))
        od.check_pages("a")


@pytest.mark.parametrize("watermark", [1.0, 0.1])
def test_an_import_publishes_its_prompt_and_reuses_a_cached_prefix(watermark):
    """``finish_import`` publishes the prompt's full pages (``token_ids``): a request added
    later with the same prompt starts cached; an import sharing a cached prefix leaves it
    out of the transfer; both decode exactly (cached pages kept on the GPU or not)."""
    P, D, tokens, op, od = sides(max_num_seqs=3, regular=False, free_block_watermark=watermark)
    with P, D:
        gen = torch.Generator().manual_seed(3)
        prompt = list(range(7, 7 + 30))
        tokens.ids["a"] = list(prompt)
        export = prefill(P, op, "a", list(prompt))
        imp = D.import_request("a", 30, 6, token_ids=prompt)
        assert imp.cached_len == 0
        transport(P, D, imp, export)
        D.finish_import("a")
        od.add("a", 30)
        decode(D, od, tokens, ["a"], 2, gen)    # the tail becomes durable, published
        # The same prompt again: the cache holds all of its full pages.
        tokens.ids["b"] = list(prompt)
        cached = D.add_request("b", 30, 4, token_ids=prompt)
        assert cached == 28
        od.add("b", cached)
        od.write("b", D.append_slots("b", 2))
        # An import sharing the first 20 tokens: they come from the cache, not the wire.
        tokens.ids["c"] = prompt[:20] + list(range(900, 913))
        export_c = prefill(P, op, "c", list(tokens.ids["c"]))
        imp_c = D.import_request("c", 33, 4, token_ids=tokens.ids["c"])
        assert imp_c.cached_len == 20 and imp_c.host_rows.shape == (imp_c.tail_start - 20,)
        assert all(len(c.dst_rows) <= 33 - 20 for c in imp_c.copies(export_c))
        transport(P, D, imp_c, export_c)
        D.finish_import("c")
        od.add("c", 33)
        decode(D, od, tokens, ["a", "b", "c"], 3, gen)
        for rid in ("a", "b", "c"):
            od.check_pages(rid)
            od.check_host(rid, D.seq_len(rid))


# ----------------------------------------------------------------------------- aborts
@pytest.mark.parametrize("end", ["abort_import", "free_request"])
def test_an_aborted_import_leaks_nothing(end):
    """A transfer cut short and aborted gives back every block, the hot region and the
    state row; a cached prefix the import shared stays cached; the next import into the
    same row decodes exactly (no stale byte is read)."""
    P, D, tokens, op, od = sides(regular=False)
    with P, D:
        gen = torch.Generator().manual_seed(4)
        prompt = list(range(300, 300 + 24))
        tokens.ids["p"] = list(prompt)
        prefill(D, od, "p", list(prompt), 4)   # D caches the first pages of the prompt
        D.commit()
        D.free_request("p")
        od.free("p")
        initial = pools(D)
        tokens.ids["a"] = prompt[:16] + list(range(40, 60))
        export = prefill(P, op, "a", list(tokens.ids["a"]))
        imp = D.import_request("a", 36, 8, token_ids=tokens.ids["a"])
        assert imp.cached_len == 16
        assert pools(D) != initial
        row = imp.state_row
        transport(P, D, imp, export, limit=2)
        getattr(D, end)("a")
        D.scheduler.check_invariants()
        assert not D.has_request("a")
        assert pools(D) == initial
        D.commit()
        assert D.stats().num_requests == 0 and pools(D) == initial
        # The cached prefix survived the abort; a retry imports into the same row.
        imp = D.import_request("a", 36, 8, token_ids=tokens.ids["a"])
        assert imp.cached_len == 16 and imp.state_row == row
        transport(P, D, imp, export)
        D.finish_import("a")
        od.add("a", 36)
        decode(D, od, tokens, ["a"], 4, gen)
        D.free_request("a")
        assert pools(D) == initial


# ----------------------------------------------------------------------------- the halves
def test_the_split_halves_import_through_registered_memory():
    """A connector drives the split halves: the prefill scheduler's export, the decode
    scheduler's import, and a transport that writes raw bytes at ``row_offsets`` into the
    decode worker's flat pools (the address an RDMA engine registers), then the decode
    steps (apply, resolve, mirror) exact against the oracle."""
    with make_runtime(max_num_seqs=2, max_model_len=64) as rt:
        (ps, pw), (ds, dw) = halves(rt), halves(rt)
        with pw, dw:
            tokens = Tokens(rt.device_layers)
            op = DenseOracle(SplitView(ps, pw), content=tokens.content)
            od = DenseOracle(SplitView(ds, dw), content=tokens.content)
            tokens.ids["a"] = list(range(11, 11 + 29))
            ps.add_request("a", 29, 0)
            op.add("a")
            rows = ps.append_slots("a", 29)
            plan = ps.step()
            pw.apply(plan)
            op.write("a", rows)
            pw.mirror(plan)
            run_plan(ps, pw)   # the mirror's plan, then the step that makes it durable
            export = ps.export_request("a")
            imp = ds.import_request("a", 29, 6)
            host_flat, device_flat = dw.host_pool.raw, dw.device_pool.tensor
            for copy in imp.copies(export):
                src = cache_of(pw, copy.layer, copy.src_host)
                s = torch.as_tensor(copy.src_rows)
                data = src[s // src.shape[1], s % src.shape[1]]
                offsets = dw.row_offsets(copy.layer, copy.dst_rows, host=copy.dst_host)
                n = dw.row_bytes(copy.layer)
                flat = host_flat if copy.dst_host else device_flat
                for off, row in zip(offsets.tolist(), data):
                    flat[off:off + n] = row
            ds.finish_import("a")
            od.add("a", 29)
            gen = torch.Generator().manual_seed(5)
            for _ in range(4):
                tokens.ids["a"].append(0)
                rows = ds.append_slots("a", 1)
                plan = ds.step()
                dw.apply(plan)
                od.write("a", rows)
                state_rows = torch.from_numpy(ds.state_rows(["a"]))
                for leader in ds.leaders:
                    topk = torch.randint(0, ds.seq_len("a"), (1, TOPK), dtype=torch.int32,
                                         generator=gen)
                    od.check_resolve(leader, ["a"], topk,
                                     dw.resolve_rows(leader, state_rows, topk))
                dw.mirror(plan)
            od.check_pages("a")
            assert dw.stats().misses > 0


def test_row_offsets_address_the_rows_of_the_views():
    """``row_offsets`` names the same bytes as ``host_cache``/``device_cache`` views."""
    with make_runtime(max_num_seqs=2, max_model_len=64) as rt:
        host_base = rt.worker.host_pool.data_ptr
        device_base = rt.worker.device_pool.tensor.data_ptr()
        rows = np.array([0, 1, B, 3 * B + 2])
        for layer in rt.device_layers:
            view = rt.device_cache(layer)
            off = rt.row_offsets(layer, rows)
            assert rt.row_bytes(layer) == view.shape[-1]
            assert [view[r // B, r % B].data_ptr() - device_base for r in rows] == off.tolist()
        for layer in rt.source_layers:
            view = rt.host_cache(layer)
            off = rt.row_offsets(layer, rows, host=True)
            assert [view[r // B, r % B].data_ptr() - host_base for r in rows] == off.tolist()
            assert all(o % 16 == 0 for o in off.tolist())


# ----------------------------------------------------------------------------- bad calls
def _bad_calls(D, imp):
    export_short = KVExport("x", 3, np.arange(3), {k: np.arange(3) for k in
                                                    set(imp.device_rows) - set(imp.source_layers)},
                            imp.source_layers)
    num_host_rows = D.num_host_blocks * B
    return [
        (ValueError, "prompt_len", lambda: D.import_request("n", 0, 4)),
        (ValueError, "token_ids", lambda: D.import_request("n", 10, 4, token_ids=[1, 2])),
        (DuplicateRequestError, "'d'", lambda: D.import_request("d", 10, 4)),
        (CapacityError, "'big'", lambda: D.import_request("big", 60, 4)),
        (UnknownRequestError, "ghost", lambda: D.finish_import("ghost")),
        (UnknownRequestError, "ghost", lambda: D.abort_import("ghost")),
        (ValueError, "'d'.*not being imported", lambda: D.finish_import("d")),
        (ValueError, "'d'.*not being imported", lambda: D.abort_import("d")),
        (ValueError, "'i'", lambda: D.append_slots("i", 1)),
        (ValueError, "'i'", lambda: D.truncate("i", 1)),
        (ValueError, "'i'", lambda: D.export_request("i")),
        (ValueError, "'i'", lambda: D.resolve(L0, ["i"], torch.zeros(1, TOPK,
                                                                       dtype=torch.int32))),
        (ValueError, "not durable", lambda: D.export_request("d")),
        (ValueError, f"row {num_host_rows}", lambda: D.row_offsets(L0, [0, num_host_rows],
                                                                   host=True)),
        (ValueError, "row -1", lambda: D.row_offsets(FULL, [-1])),
        (ValueError, "1-D integer", lambda: D.row_offsets(FULL, [0.5])),
        (KeyError, "not a source", lambda: D.row_offsets(FULL, [0], host=True)),
        (ValueError, "holds 3 tokens", lambda: imp.copies(export_short)),
    ]


def test_bad_calls_are_refused_and_change_nothing():
    """Every bad call names the bad value and leaves every table, counter and pool as it
    was; then the import still completes."""
    P = make_runtime(max_num_seqs=3, max_model_len=64)
    D = make_runtime(max_num_seqs=3, max_model_len=64, device_blocks=64)
    with P, D:
        tokens = Tokens(P.device_layers)
        op, od = oracle_for(P, tokens), oracle_for(D, tokens)
        tokens.ids["i"] = list(range(25))
        export = prefill(P, op, "i", list(tokens.ids["i"]))
        imp = D.import_request("i", 25, 4)
        # can_import answers what import_request would do, counting the prompt's pages.
        answers = []
        for n in (0, 8, 24, 40, 60):
            before = D._debug_snapshot()
            answers.append(D.scheduler.can_import(n, 4))
            assert D._debug_snapshot() == before
            try:
                D.import_request(f"t{n}", n, 4)
            except (ValueError, CapacityError):
                assert not answers[-1]
            else:
                assert answers[-1]
                D.abort_import(f"t{n}")
        assert answers == [False, True, True, False, False]
        assert D.scheduler.can_admit(40, 4)   # its hot region fits, its prompt's pages do not
        D.add_request("d", 10, 4)
        D.append_slots("d", 10)
        calls = _bad_calls(D, imp)
        for exc, match, call in calls:
            before = D._debug_snapshot()
            with pytest.raises(exc, match=match):
                call()
            assert D._debug_snapshot() == before, f"a refused call ({match}) changed state"
        transport(P, D, imp, export)
        D.finish_import("i")
        od.add("i", 25)
        tokens.ids["i"].append(0)
        od.write("i", D.append_slots("i", 1))
        topk = torch.arange(TOPK, dtype=torch.int32)[None] * 3
        od.check_resolve(L0, ["i"], topk, D.resolve(L0, ["i"], topk))


# ----------------------------------------------------------------------------- with drafts
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_imported_request_drafts_and_rolls_back_exactly(backend):
    """Once imported, a request appends drafts and has them verified like any other: each
    step appends one token and two drafts, resolves against the dense oracle, verifies
    0, 1 or 2 of the drafts (a rejected position is written again with new bytes the next
    step) and commits; the accepted tokens reach the host pool, the pools come back whole."""
    P, D, tokens, op, od = sides(backend)
    with P, D:
        gen = torch.Generator().manual_seed(5)
        initial = pools(D)
        prompt = 21
        tokens.ids["a"] = [int(t) for t in torch.randint(0, 1000, (prompt,), generator=gen)]
        export = prefill(P, op, "a", list(tokens.ids["a"]))
        imp = D.import_request("a", prompt, 12, token_ids=tokens.ids["a"])
        transport(P, D, imp, export)
        D.finish_import("a")
        od.add("a", prompt)
        for step in range(4):
            new = [int(t) for t in torch.randint(0, 1000, (3,), generator=gen)]
            tokens.ids["a"].extend(new)
            od.write("a", D.append_slots("a", 3, token_ids=new, num_draft_tokens=2))
            assert D.pending_drafts("a") == [(D.seq_len("a") - 2, 2)]
            accepted = step % 3
            D.verify_drafts("a", accepted)
            assert D.pending_drafts("a") == []
            del tokens.ids["a"][len(tokens.ids["a"]) - (2 - accepted):]
            od.truncate("a", D.seq_len("a"))
            assert D.seq_len("a") == len(tokens.ids["a"])
            for leader in D.leaders:
                topk = torch.randint(-1, D.seq_len("a") + 1, (1, TOPK), dtype=torch.int32,
                                     generator=gen)
                od.check_resolve(leader, ["a"], topk, D.resolve(leader, ["a"], topk))
            D.commit()
            D.scheduler.check_invariants()
        D.commit()
        od.check_pages("a")
        od.check_host("a", D.seq_len("a"))
        assert od.rows_checked > 0
        D.free_request("a")
        D.scheduler.check_invariants()
        assert pools(D) == initial
