"""The split gather against the plain one, on the same miss plans, on 1..N ranks.

Every rank builds the same host pool (same seed; pinned on CUDA), device pool and the same
miss plans of a DeepSeek-V3.2-like resolve (656 B rows, one layer, ``--top-k`` 2048 columns,
``--rows`` requests): per step and row a miss count (``--misses trace``: the runtime's LRU
replayed on the calibrated top-k trace with a hot buffer of 2 x top-k, each row a request
of 96 steps that started ``3 x row`` steps earlier, so about one row in 100 is a new
request whose first step misses almost everything; ``binomial``: about 13.4% of the
columns per row, a rate drawn per row around it), random
host rows and distinct device rows. Then, per variant, ``SplitGather.gather`` over every
step twice (the first pass lets ``"auto"`` settle; ``on_plan`` is called every step as the
worker does), against the plain gather of the same plans (``copy_rows`` on the worker's
backend), and records per call the time (CUDA events on GPUs, wall time on CPU), whether the
final pool is the plain gather's bytes, and per step the misses, bytes exchanged, overflow
rows and capacity in force, next to advise's model of the exchanged bytes
(``advisor.split_bytes`` at ``split_capacity.capacity_fraction`` of the run's miss rate).

Variants: ``fixed-0.25-serial`` (the old default capacity, one chunk), ``fixed-0.25``,
``auto-serial``, ``auto`` (2 chunks: the pull of chunk 2 while chunk 1 is exchanged) and
``full`` (fraction 1). Ranks: processes over gloo (``--device cpu``) or NCCL (CUDA, one GPU
each: a rank count above the GPUs there is recorded as skipped with the reason).

    PYTHONPATH=bench python -m lab.split_bench --device cpu --ranks 1,2,4 --json out.json
    PYTHONPATH=bench python -m lab.split_bench            # CUDA: 1 rank and every GPU

The last line printed is the JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["VARIANTS", "main", "miss_counts", "model_per_layer", "run"]

#: name -> (split_gather_fraction, chunks)
VARIANTS: dict[str, tuple[Any, int]] = {
    "fixed-0.25-serial": (0.25, 1), "fixed-0.25": (0.25, 2), "auto-serial": ("auto", 1),
    "auto": ("auto", 2), "full": (1.0, 2)}
BLOCK = 64


def miss_counts(source: str, rows: int, steps: int, cols: int, seed: int = 0) -> list[list[int]]:
    """``[steps][rows]`` miss counts (see the module docstring)."""
    if source == "binomial":
        gen = np.random.default_rng(seed)
        rate = np.clip(gen.normal(0.134, 0.02, size=rows), 0.0, 1.0)
        return gen.binomial(cols, np.tile(rate, (steps, 1))).tolist()
    from hisparse_triton.advisor import AdviseSettings, stream_step_misses, trace_streams

    length = max(steps, 96)
    settings = AdviseSettings(streams=min(rows, 64), steps=length, seed=seed)
    streams, _ = trace_streams(settings, cols, 16 * cols)
    per_stream = [stream_step_misses(sel, seqs, 2 * cols, BLOCK) for sel, seqs in streams]
    return [[int(per_stream[r % len(per_stream)][(t + 3 * r + r // 64) % length])
             for r in range(rows)] for t in range(steps)]


def model_per_layer(rows: int, top_k: int, row_bytes: int, miss: float, *,
                    ranks: tuple[int, ...] = (2, 4, 8), link_gbps: Optional[float] = None,
                    exchange_gbps: Optional[float] = None) -> list[dict[str, Any]]:
    """Advise's model of one layer's split gather per decode step (``advisor.split_bytes``,
    ``advisor.step_seconds``): ``rows`` requests of ``top_k`` columns of ``row_bytes`` rows
    at ``miss``, per rank count, the former fixed 1/4 capacity exchanged after the pulls
    against the ``"auto"`` capacity pipelined in ``SPLIT_CHUNKS`` chunks."""
    from hisparse_triton.advisor import (DEFAULT_EXCHANGE_GBPS, AdviseSettings, split_bytes,
                                         step_seconds)
    from hisparse_triton.link import DEFAULT_LINK_GBPS
    from hisparse_triton.worker.split_capacity import SPLIT_CHUNKS, capacity_fraction

    link = link_gbps or DEFAULT_LINK_GBPS
    exchange = exchange_gbps or DEFAULT_EXCHANGE_GBPS
    out = []
    auto = capacity_fraction(miss)
    for n in ranks:
        row: dict[str, Any] = {"ranks": n, "miss_rate": miss, "auto_fraction": auto,
                               "link_gbps": link, "exchange_gbps": exchange,
                               "miss_bytes": round(rows * miss * top_k * row_bytes)}
        for name, fraction, chunks in (("fixed-0.25-serial", 0.25, 1),
                                       ("auto", auto, SPLIT_CHUNKS)):
            pcie, ex = split_bytes(miss * top_k, top_k, row_bytes, n, fraction)
            settings = AdviseSettings(exchange_gbps=exchange, split_chunks=chunks)
            _, link_s, _ = step_seconds(settings, rows, pcie, link, exchange_bytes=ex)
            row[name] = {"fraction": fraction, "chunks": chunks,
                         "pcie_bytes": round(rows * pcie), "exchange_bytes": round(rows * ex),
                         "us": round(link_s * 1e6, 1)}
        pcie, _ = split_bytes(miss * top_k, top_k, row_bytes, 1, 1.0)
        row["unsplit_us"] = round(rows * pcie / (link * 1e9) * 1e6, 1)
        out.append(row)
    return out


def _rank(rank: int, world: int, init: str, result: str, spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from hisparse_triton.advisor import split_bytes
    from hisparse_triton.row_table import RowTable
    from hisparse_triton.worker.hot_cache import split_copy
    from hisparse_triton.worker.split_capacity import capacity_fraction
    from hisparse_triton.worker.split_gather import SplitGather

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}",
                            rank=rank, world_size=world)
    rb, R, K, steps = spec["row_bytes"], spec["rows"], spec["top_k"], spec["steps"]
    counts_all = spec["counts"]
    gen = torch.Generator().manual_seed(0)
    host_blocks = 8192 if cuda else 1024      # 344 MB / 43 MB of 656 B rows per rank
    host_pool = torch.randint(0, 256, (host_blocks * BLOCK * rb,), dtype=torch.uint8,
                              generator=gen)
    if cuda:
        host_pool = host_pool.pin_memory()
    host = RowTable.build(host_pool, [0], row_bytes=rb, block_size=BLOCK,
                          block_stride=BLOCK * rb, num_rows=host_blocks * BLOCK, device=dev)
    dev_blocks = -(-R * K // BLOCK) + 1
    dev_pool = torch.zeros(dev_blocks * BLOCK * rb, dtype=torch.uint8, device=dev)
    device_table = RowTable.build(dev_pool, [0], row_bytes=rb, block_size=BLOCK,
                                  block_stride=BLOCK * rb, num_rows=dev_blocks * BLOCK,
                                  device=dev)
    plans = []
    for t in range(steps):    # block 0 is the null block: device rows from BLOCK on
        src = torch.randint(0, host_blocks * BLOCK, (R, K), dtype=torch.int32, generator=gen)
        dst = (torch.randperm((dev_blocks - 1) * BLOCK, generator=gen)[:R * K].view(R, K)
               + BLOCK).to(torch.int32)
        counts = torch.tensor(counts_all[t], dtype=torch.int32)
        plans.append((src.to(dev), dst.to(dev), counts.to(dev)))
    copy = split_copy("triton" if cuda else "torch", dev, programs_per_sm=4 if cuda else 0)

    def timed(fn) -> float:
        """Microseconds of one call."""
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    plain_us = []
    for src, dst, counts in plans:      # warm, then timed
        copy(device_table, host, src, dst, counts)
    dev_pool.zero_()
    for src, dst, counts in plans:
        plain_us.append(timed(lambda: copy(device_table, host, src, dst, counts)))
    expected = dev_pool.clone()
    misses = [sum(c) for c in counts_all]
    miss_rate = sum(misses) / (steps * R * K)
    model_fraction = capacity_fraction(miss_rate)
    model_pcie, model_exchange = split_bytes(miss_rate * K, K, rb, world, model_fraction)
    report: dict[str, Any] = {
        "ranks": world, "rows": R, "top_k": K, "row_bytes": rb, "steps": steps,
        "misses_per_step": misses, "miss_rate": round(miss_rate, 5),
        "plain_us": _summary(plain_us),
        "model": {"fraction": model_fraction,
                  "exchange_bytes_per_step": round(R * model_exchange),
                  "pcie_bytes_per_step": round(R * model_pcie),
            "note": "advise's model (advisor.split_bytes) at the run's mean miss rate and "
                    "the auto rule's capacity (split_capacity.capacity_fraction)"},
        "variants": {}}
    for name in spec["variants"]:
        fraction, chunks = VARIANTS[name]
        split = SplitGather(None, dev, copy, fraction=fraction, chunks=chunks)
        plan_no = 0
        for src, dst, counts in plans:            # warm: "auto" settles
            plan_no += 1
            split.on_plan(plan_no)
            split.gather(device_table, host, src, dst, counts)
        dev_pool.zero_()
        us, per_step = [], []
        before = split.stats()      # each step's stats are the next one's "before"
        for src, dst, counts in plans:
            plan_no += 1
            split.on_plan(plan_no)
            fraction_in_force = split.fraction
            us.append(timed(lambda: split.gather(device_table, host, src, dst, counts)))
            after = split.stats()
            per_step.append([after.misses - before.misses,
                             after.exchange_bytes - before.exchange_bytes,
                             after.overflow_rows - before.overflow_rows, fraction_in_force])
            before = after
        total = before
        ex = sum(s[1] for s in per_step)
        miss_bytes = sum(s[0] for s in per_step) * rb
        report["variants"][name] = {
            "fraction": fraction, "chunks": chunks, "us": _summary(us),
            "exact": bool(torch.equal(dev_pool, expected)),
            "fraction_end": total.fraction,
            "exchange_bytes_per_step": round(ex / steps),
            "miss_bytes_per_step": round(miss_bytes / steps),
            "exchange_per_miss": round(ex / miss_bytes, 4) if miss_bytes else None,
            "overflow_rows": sum(s[2] for s in per_step),
            "per_step": per_step}
    if rank == 0:
        with open(result, "w") as out:
            json.dump(report, out)
    dist.barrier()
    dist.destroy_process_group()


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "n": len(values)}


def run(device: str, ranks: list[int], *, rows: int, top_k: int, row_bytes: int, steps: int,
        misses: str, variants: Optional[list[str]] = None) -> dict[str, Any]:
    """The report: per rank count, the run's figures or why it was skipped."""
    import torch.multiprocessing as mp

    counts = miss_counts(misses, rows, steps, top_k)
    spec = {"device": device, "rows": rows, "top_k": top_k, "row_bytes": row_bytes,
            "steps": steps, "counts": counts, "variants": variants or list(VARIANTS)}
    report: dict[str, Any] = {
        "schema": "hisparse-triton/split-bench", "version": 1, "device": device,
        "misses": misses, "backend": "nccl" if device == "cuda" else "gloo",
        "command": " ".join(["PYTHONPATH=bench", "python", "-m", "lab.split_bench",
                             *sys.argv[1:]]),
        "model_per_layer": {
            "note": "advise's model (advisor.split_bytes / step_seconds) of one layer of a "
                    "decode step at 64 requests x 2048 columns of 656 B rows and a 13.4% "
                    "miss rate: the former fixed 1/4 capacity exchanged after the pulls "
                    "against the auto capacity pipelined; link and exchange speeds are "
                    "advise's defaults (assumptions), at 360 and at 100 GB/s for NVLink",
            "nvlink_360": model_per_layer(64, 2048, 656, 0.134),
            "nvlink_100": model_per_layer(64, 2048, 656, 0.134, exchange_gbps=100.0)},
        "runs": []}
    gpus = torch.cuda.device_count() if device == "cuda" else None
    for world in ranks:
        if gpus is not None and world > gpus:
            report["runs"].append({"ranks": world, "skipped": f"needs {world} GPUs, this "
                                   f"machine has {gpus}"})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.json")
            start = time.time()
            mp.start_processes(_rank, args=(world, os.path.join(tmp, "pg"), result, spec),
                               nprocs=world, join=True, start_method="spawn")
            with open(result) as handle:
                run_report = json.load(handle)
            run_report["wall_s"] = round(time.time() - start, 1)
            report["runs"].append(run_report)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--ranks", default=None,
                        help="rank counts, comma-separated (default: cuda 1 and every GPU, up "
                             "to 8; cpu 1,2,4)")
    parser.add_argument("--rows", type=int, default=None, help="requests (default cuda 64, "
                                                              "cpu 16)")
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--row-bytes", type=int, default=656)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--misses", choices=("trace", "binomial"), default="binomial")
    parser.add_argument("--variants", default=None, help=f"comma-separated, of "
                                                         f"{', '.join(VARIANTS)}")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu)")
    if args.ranks:
        ranks = [int(r) for r in args.ranks.split(",") if r]
    elif cuda:
        count = min(torch.cuda.device_count(), 8)
        ranks = sorted({1, count} | ({2} if count >= 2 else set()))
    else:
        ranks = [1, 2, 4]
    rows = args.rows or (64 if cuda else 16)
    variants = args.variants.split(",") if args.variants else None
    for name in variants or ():
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    report = run(args.device, ranks, rows=rows, top_k=args.top_k, row_bytes=args.row_bytes,
                 steps=args.steps, misses=args.misses, variants=variants)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=1)
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
