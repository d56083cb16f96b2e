"""The split gather on N GPUs (``decode_checks.split_gather``; needs 2+ CUDA devices).

Every rank builds the same host pool (pinned, same seed) and device pool, and the same miss
plan of a DeepSeek-V3.2 resolve at batch 64 (656 B rows, 2048 columns, about 13.4% misses
per row); then times (device ms, CUDA events, median) the plain gather of every miss on each
rank against ``SplitGather.gather`` (1/N over each rank's link + the NCCL all_gather) at
``fraction`` 0.25 and 1, and checks that the hot rows are the same bytes.

    PYTHONPATH=bench python -m lab.split_bench     # prints one JSON line (rank 0)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import torch

__all__ = ["main"]


def _rank(rank: int, world: int, init: str, result: str) -> None:
    import torch.distributed as dist

    from hisparse_triton.kernels.gather import gather_rows
    from hisparse_triton.row_table import RowTable
    from hisparse_triton.worker.split_gather import SplitGather

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    rb, B, host_blocks, dev_blocks, R, K = 656, 64, 8192, 4096 + 1, 64, 2048
    host_pool = torch.randint(0, 256, (host_blocks * B * rb,), dtype=torch.uint8,
                              generator=gen).pin_memory()
    host = RowTable.build(host_pool, [0], row_bytes=rb, block_size=B, block_stride=B * rb,
                          num_rows=host_blocks * B, device=dev)
    dev_pool = torch.zeros(dev_blocks * B * rb, dtype=torch.uint8, device=dev)
    device_table = RowTable.build(dev_pool, [0], row_bytes=rb, block_size=B,
                                  block_stride=B * rb, num_rows=dev_blocks * B, device=dev)
    src = torch.randint(0, host_blocks * B, (R, K), dtype=torch.int32, generator=gen).to(dev)
    dst = torch.randperm(dev_blocks * B - B, generator=gen)[:R * K].view(R, K).to(
        torch.int32).add_(B).to(dev)
    counts = torch.full((R,), int(0.134 * K), dtype=torch.int32, device=dev)

    def plain():
        gather_rows(device_table, host, src, dst, counts)

    def timed(fn, n=10):
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        return round(statistics.median(out), 4)

    report = {"ranks": world, "rows_per_step": int(counts.sum()), "row_bytes": rb,
              "plain_ms": timed(plain)}
    plain()
    expected = dev_pool.clone()
    for fraction in (0.25, 1.0):
        dev_pool.zero_()
        split = SplitGather(None, dev, lambda d, s, a, b, c=None: gather_rows(d, s, a, b, c),
                            fraction=fraction)
        report[f"split_ms_fraction_{fraction:g}"] = timed(
            lambda: split.gather(device_table, host, src, dst, counts))
        report[f"split_exact_fraction_{fraction:g}"] = bool(torch.equal(dev_pool, expected))
    if rank == 0:
        with open(result, "w") as out:
            json.dump(report, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    world = min(torch.cuda.device_count(), 8)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "pg"), result),
                           nprocs=world, join=True, start_method="spawn")
        with open(result) as handle:
            sys.stdout.write(handle.read() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
