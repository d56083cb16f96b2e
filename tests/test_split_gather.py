"""The split gather (``worker.split_gather``): its plan, its capacity rule, and 1, 2 and 4
gloo ranks exact against the plain gather.

- the device plan (``_plan``) against its loop definition (``split_plan_reference``): every
  miss's rank, staging slot and whether it spills past the capacity;
- the capacity rule (``split_capacity``): levels, headroom, hysteresis;
- N spawned gloo ranks (1, 2, 4) run ``SplitGather.gather`` on the same random miss plans
  (rows with no miss, rows all misses, a batch that does not divide into the chunks) at a
  capacity that overflows, at ``"auto"`` (retuned by ``on_plan``) and at 1; after every call
  each rank's device pool must equal a plain ``copy_rows`` of the same plan, and the tally
  (misses, rows past the capacity, bytes exchanged) must equal what the loop definition
  gives.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import reporting_errors, spawn_ranks

from hisparse_triton.row_table import RowTable
from hisparse_triton.worker import split_capacity as sc
from hisparse_triton.worker.split_gather import _plan, build_exchange, split_plan_reference


# ------------------------------------------------------------------ the plan
@pytest.mark.parametrize("ranks,chunks,rows,cols", [(1, 2, 5, 8), (2, 2, 5, 8), (3, 2, 7, 10),
                                                    (4, 3, 10, 8), (4, 1, 3, 6)])
def test_device_plan_matches_its_loop_definition(ranks, chunks, rows, cols):
    gen = random.Random(ranks * 100 + rows)
    for capacity in (1, 2, 5, 1000):
        rpc, _ = sc.chunk_rows(rows, chunks, 1)
        ex = build_exchange(rows, cols, 2, 16, ranks=ranks, rows_per_chunk=rpc,
                            capacity=min(capacity, rpc * -(-cols // ranks)),
                            device=torch.device("cpu"))
        P, rpc = ex.capacity, ex.rows_per_chunk
        for _ in range(4):
            counts = [gen.choice([0, cols, gen.randint(0, cols)]) for _ in range(rows)]
            dst = torch.randint(0, 1000, (rows, cols), dtype=torch.int32)
            before = ex.acc.clone()
            _plan(ex, torch.tensor(counts, dtype=torch.int32), dst, ranks)
            expect = split_plan_reference(counts, cols, ranks, rpc, P)
            slots = ex.slots.view(rows, -1)[:, :cols]
            spilled = ex.spilled.view(rows, -1)[:, :cols]
            unpack = ex.unpack.view(rows, -1)[:, :cols]
            for (r, j), (q, slot, spill) in expect.items():
                assert j % ranks == q
                assert int(slots[r, j]) == slot and bool(spilled[r, j]) == spill, (r, j)
                assert int(unpack[r, j]) == q * P + slot
                assert int(ex.unpack_dst[r, j]) == (-1 if spill else int(dst[r, j]))
                if ex.overflow_dst is not None:
                    assert int(ex.overflow_dst[r, j]) == (int(dst[r, j]) if spill else -1)
                else:
                    assert not spill
            tally = (ex.acc - before).tolist()
            n = len(ex.chunks)
            assert tally == [sum(counts), sum(s for _, _, s in expect.values()),
                             (ranks - 1) * P * n * 2 * 16, 1, rows * cols]


def test_capacity_rule():
    assert sc.capacity_fraction(0.134) == 11 / 64          # 0.1675 -> the next level
    assert sc.capacity_fraction(0.0) == 1 / 64
    assert sc.capacity_fraction(0.9) == 1.0
    assert sc.capacity_fraction(0.2, headroom=0) == 13 / 64
    levels = sc.CAPACITY_LEVELS
    assert list(levels) == sorted(set(levels)) and levels[-1] == 1.0
    # up at once, down only two levels or more
    assert sc.retune(0.125, 0.134) == 11 / 64
    assert sc.retune(11 / 64, 0.125) == 11 / 64            # target 10/64: one level down
    assert sc.retune(11 / 64, 0.11) == 9 / 64              # target 9/64: two levels down
    assert sc.chunk_rows(64, 2) == (32, 2) and sc.chunk_rows(31, 2) == (31, 1)
    assert sc.chunk_rows(5, 2, 1) == (3, 2) and sc.chunk_rows(7, 3, 1) == (3, 3)
    assert sc.capacity_rows(32, 2048, 8, 0.25) == 2048
    assert sc.capacity_rows(3, 10, 4, 1.0) == 9            # rows x ceil(cols / ranks)
    assert sc.capacity_rows(3, 10, 4, 0.01) == 1
    for bad in (0, 1.5, True, "half", float("nan")):
        with pytest.raises(ValueError, match="split_gather_fraction"):
            sc.check_fraction(bad)
    assert sc.check_fraction("auto") == "auto" and sc.check_fraction(1) == 1.0
    with pytest.raises(ValueError, match="miss_fraction"):
        sc.capacity_fraction(-0.1)


# ------------------------------------------------------------------ gloo ranks
ROW_BYTES, LAYERS, BLOCK = 32, 2, 4
HOST_ROWS, DEVICE_ROWS = 64 * BLOCK, 80 * BLOCK


def _tables(seed: int) -> tuple[RowTable, RowTable, torch.Tensor]:
    """A host table (random bytes, the same on every rank) and a zeroed device table."""
    gen = torch.Generator().manual_seed(seed)
    stride = BLOCK * ROW_BYTES
    host_pool = torch.randint(0, 256, (LAYERS * HOST_ROWS * ROW_BYTES,), dtype=torch.uint8,
                              generator=gen)
    dev_pool = torch.zeros(LAYERS * DEVICE_ROWS * ROW_BYTES, dtype=torch.uint8)
    host = RowTable.build(host_pool, [layer * HOST_ROWS * ROW_BYTES for layer in range(LAYERS)],
                          row_bytes=ROW_BYTES, block_size=BLOCK, block_stride=stride,
                          num_rows=HOST_ROWS, device="cpu")
    dev = RowTable.build(dev_pool, [layer * DEVICE_ROWS * ROW_BYTES for layer in range(LAYERS)],
                         row_bytes=ROW_BYTES, block_size=BLOCK, block_stride=stride,
                         num_rows=DEVICE_ROWS, device="cpu")
    return host, dev, dev_pool


def _plan_of(gen: random.Random, rows: int, cols: int, miss: float):
    """A miss plan: distinct destination rows, per-row counts around ``miss`` (one row all
    misses, one none)."""
    counts = [min(cols, max(0, round(gen.gauss(miss * cols, cols / 6)))) for _ in range(rows)]
    counts[0], counts[-1] = cols, 0
    src = torch.tensor([[gen.randrange(HOST_ROWS) for _ in range(cols)] for _ in range(rows)],
                       dtype=torch.int32)
    dst = torch.tensor(gen.sample(range(DEVICE_ROWS), rows * cols),
                       dtype=torch.int32).view(rows, cols)
    return src, dst, torch.tensor(counts, dtype=torch.int32)


def _rank_main(rank: int, world: int, init_file: str, result_dir: str, backend: str) -> None:
    with reporting_errors(result_dir, rank):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        torch.set_num_threads(1)
        from hisparse_triton.ops import copy_rows
        from hisparse_triton.worker.hot_cache import split_copy
        from hisparse_triton.worker.split_gather import SplitGather

        cpu = torch.device("cpu")
        lines = []
        for fraction, chunks, rows, cols, steps in (
                (0.05, 2, 5, 12, 3),            # overflows every call
                ("auto", 3, 7, 16, 24),         # retuned every 8 plans
                (1.0, 1, 3, 9, 2)):             # every miss exchanged
            split = SplitGather(None, cpu, split_copy(backend, cpu), fraction=fraction,
                                chunks=chunks, min_chunk_rows=1)
            host, dev, pool = _tables(seed=7)
            _, ref_dev, ref_pool = _tables(seed=7)
            gen = random.Random(11)            # the same plans on every rank
            seen, periods, current, expected = [], [], 0, split.fraction
            for step in range(1, steps + 1):
                miss = 0.6 if step <= 8 else 0.15
                src, dst, counts = _plan_of(gen, rows, cols, miss)
                rpc, n = sc.chunk_rows(rows, chunks, 1)
                P = sc.capacity_rows(rpc, cols, world, split.fraction)
                expect = split_plan_reference(counts.tolist(), cols, world, rpc, P)
                before = split.stats()
                split.gather(dev, host, src, dst, counts)
                copy_rows(ref_dev, host, src, dst, counts, backend="torch")
                assert torch.equal(pool, ref_pool), (fraction, step)
                after = split.stats()
                spilled = sum(s for _, _, s in expect.values())
                assert after.misses - before.misses == int(counts.sum())
                assert after.overflow_rows - before.overflow_rows == spilled
                assert after.exchange_bytes - before.exchange_bytes == \
                    (world - 1) * P * n * LAYERS * ROW_BYTES
                split.on_plan(step)
                current += int(counts.sum())
                if fraction == "auto" and step % 8 == 0:
                    periods.append(current)
                    current = 0
                    if len(periods) >= 2:   # the snapshot of plan step - 8 is read now
                        expected = sc.retune(expected, periods[-2] / (8 * rows * cols))
                assert split.fraction == expected, (step, split.fraction, expected)
                seen.append(split.fraction)
            lines.append(f"{fraction} {' '.join(map(str, seen))}")
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as out:
            out.write("\n".join(lines) + "\n")
        dist.barrier()
        dist.destroy_process_group()


def _run(tmp_path, world: int, backend: str) -> list[str]:
    spawn_ranks(_rank_main, world, (world, str(tmp_path / "pg"), str(tmp_path), backend),
                tmp_path)
    return [(tmp_path / f"rank{r}").read_text() for r in range(world)]


@pytest.mark.parametrize("world,backend", [(1, "torch"), (2, "torch"), (4, "torch"),
                                           (2, "triton")])
def test_ranks_split_the_gather_exactly(tmp_path, world, backend):
    """Every rank's device pool equals the plain gather's after every call, at a capacity
    that overflows, at ``"auto"`` and at 1; ``"auto"`` settles on the rule's capacity for
    the plans' miss fraction, the same on every rank."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" \
            and not torch.cuda.is_available():
        pytest.skip("the Triton backend on CPU needs TRITON_INTERPRET=1")
    results = _run(tmp_path, world, backend)
    assert len(set(results)) == 1, results          # every rank retuned alike
    auto = [line for line in results[0].splitlines() if line.startswith("auto")][0]
    fractions = [float(f) for f in auto.split()[1:]]
    assert fractions[:15] == [sc.SPLIT_START_FRACTION] * 15   # first read at plan 16
    # plans 1-8 miss about 60% of their columns: the capacity rises to the rule's level;
    # later plans miss less: it comes down again (checked against the rule in every rank)
    assert fractions[15] > sc.SPLIT_START_FRACTION and fractions[-1] < fractions[15]


# ------------------------------------------------------------------ graph capture
def test_a_capture_keeps_the_warm_up_capacity(tmp_path, monkeypatch):
    """While a CUDA graph is captured the split gather builds no exchange: a retune between
    the warm-up and the capture leaves the captured call at the warm-up's capacity (whose
    buffers exist), still exact; the next eager call takes the new capacity. Checked on one
    gloo rank with the capture state faked (``is_current_stream_capturing``)."""
    from hisparse_triton.ops import copy_rows
    from hisparse_triton.worker.hot_cache import split_copy
    from hisparse_triton.worker.split_gather import SplitGather

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                            world_size=1)
    try:
        cpu = torch.device("cpu")
        split = SplitGather(None, cpu, split_copy("torch", cpu), fraction="auto",
                            min_chunk_rows=1)
        host, dev, pool = _tables(seed=3)
        _, ref_dev, ref_pool = _tables(seed=3)
        gen = random.Random(5)
        src, dst, counts = _plan_of(gen, 4, 12, 0.5)
        split.gather(dev, host, src, dst, counts)           # the warm-up
        copy_rows(ref_dev, host, src, dst, counts, backend="torch")
        warm = dict(split._exchanges)
        split.fraction = 1 / 64                              # a retune after it
        split.device = torch.device("cuda")                  # as on a GPU, capturing
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        src, dst, counts = _plan_of(gen, 4, 12, 0.5)
        split.gather(dev, host, src, dst, counts)
        copy_rows(ref_dev, host, src, dst, counts, backend="torch")
        assert split._exchanges == warm and torch.equal(pool, ref_pool)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        split.device = cpu
        src, dst, counts = _plan_of(gen, 4, 12, 0.5)
        split.gather(dev, host, src, dst, counts)           # eager: the new capacity
        copy_rows(ref_dev, host, src, dst, counts, backend="torch")
        assert len(split._exchanges) == len(warm) + 1 and torch.equal(pool, ref_pool)
        assert min(ex.capacity for ex in split._exchanges.values()) == \
            sc.capacity_rows(4, 12, 1, 1 / 64)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the lab's bench
def test_split_bench_on_gloo_is_exact_and_records_the_bytes():
    """``lab.split_bench --device cpu`` (what ``bench/results/`` records, and what
    ``gpu_check``'s decode-checks run on GPUs): every variant exact against the plain
    gather, the bytes exchanged per step as the capacity says, and gpu_check's summary
    lines read it."""
    from lab import split_bench

    from test_cli_bench import _gpu_check_module

    report = split_bench.run("cpu", [1, 2], rows=5, top_k=64, row_bytes=16, steps=18,
                             misses="binomial", variants=["fixed-0.25-serial", "auto"])
    one, two = report["runs"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and report["backend"] == "gloo"
    for run in (one, two):
        assert len(run["misses_per_step"]) == 18
        for name, v in run["variants"].items():
            assert v["exact"], (run["ranks"], name)
            assert [s[0] for s in v["per_step"]] == run["misses_per_step"]
    auto = two["variants"]["auto"]
    for misses, exchanged, _, fraction in auto["per_step"]:
        rpc, n = sc.chunk_rows(5, 2)   # 5 rows: one chunk (fewer than 2 x MIN_CHUNK_ROWS)
        assert (rpc, n) == (5, 1)
        assert exchanged == (2 - 1) * sc.capacity_rows(rpc, 64, 2, fraction) * n * 16
    assert one["variants"]["auto"]["exchange_bytes_per_step"] == 0   # one rank: nothing
    gpu_check = _gpu_check_module()
    lines = gpu_check.split_gather_lines(report)
    assert len(lines) == 2 and "auto" in lines[1] and "NOT EXACT" not in "".join(lines)
    # gpu_check's summary routes the decode-checks section there, and flags a wrong pool
    wrapped = {"steps": {"decode-checks": {"result": {"sections": {"split_gather": report}}}}}
    assert gpu_check.decode_check_lines(wrapped) == lines
    two["variants"]["auto"]["exact"] = False
    assert "auto" in gpu_check.split_gather_lines(report)[1].split("NOT EXACT")[0]
