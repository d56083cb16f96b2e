"""Benchmark ``resolve`` on a drifting top-k trace (DESIGN.md section 9 shapes by default).

CPU: the torch reference (the runtime's CPU backend). CUDA: the torch reference on the GPU (the
torch-eager baseline), the Triton kernel (``triton.testing.do_bench``) and the Triton kernel
replayed from a CUDA graph (the decode-path cost). Prints one JSON object per measurement;
``--json PATH`` also writes them as a list.

    python bench/bench_resolve.py                       # 64 x 2048 x 4096, whatever device
    python bench/bench_resolve.py --rows 8 --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

from hisparse_triton import reference

ACTIVE_TAIL_PAGES = 2


def build(rows: int, top_k: int, hot: int, block_size: int, context: int, miss_rate: float,
          steps: int, device: torch.device, seed: int = 0) -> tuple[dict, list[torch.Tensor]]:
    """A state of ``rows`` requests of ``context`` tokens (tail pages resident, the rest on the
    host) and ``steps`` top-k tensors where each step redraws ``miss_rate`` of the columns."""
    g = torch.Generator().manual_seed(seed)
    B = block_size
    pages = -(-context // B)
    hb_per = -(-hot // B)
    i32 = torch.int32
    host_blocks = torch.arange(1, rows * pages + 1).view(rows, pages)
    resident = torch.zeros(rows, pages, dtype=torch.int64)
    tail = torch.arange(1, rows * ACTIVE_TAIL_PAGES + 1).view(rows, ACTIVE_TAIL_PAGES)
    resident[:, pages - ACTIVE_TAIL_PAGES:] = tail
    hot_blocks = torch.arange(rows * hb_per).view(rows, hb_per) + 1 + rows * ACTIVE_TAIL_PAGES
    state = dict(
        seq_lens=torch.full((rows,), context, dtype=i32),
        resident_blocks=resident.to(i32), host_blocks=host_blocks.to(i32),
        hot_blocks=hot_blocks.to(i32),
        slot_host_rows=torch.full((rows, hot), -1, dtype=i32),
        lru=torch.arange(hot, dtype=i32).expand(rows, hot).contiguous(),
    )
    state = {k: v.to(device) for k, v in state.items()}
    state["num_device_blocks"] = 1 + rows * (ACTIVE_TAIL_PAGES + hb_per)
    state["num_host_blocks"] = 1 + rows * pages
    state["block_size"] = B
    cur = torch.stack([torch.randperm(context, generator=g)[:top_k] for _ in range(rows)])
    trace = []
    for _ in range(steps):
        trace.append(cur.to(i32).to(device))
        redraw = torch.rand(cur.shape, generator=g) < miss_rate
        cur = torch.where(redraw, torch.randint(0, context, cur.shape, generator=g), cur)
    return state, trace


def stepper(fn: Callable, state: dict, trace: list[torch.Tensor], state_rows: torch.Tensor
            ) -> Callable[[], reference.ResolveResult]:
    """A no-argument callable running ``fn`` on the next top-k of the trace (cycling)."""
    it = [0]
    args = (state["seq_lens"], state["resident_blocks"], state["host_blocks"],
            state["hot_blocks"], state["slot_host_rows"], state["lru"])
    kw = dict(block_size=state["block_size"], num_device_blocks=state["num_device_blocks"],
              num_host_blocks=state["num_host_blocks"])

    def step() -> reference.ResolveResult:
        topk = trace[it[0] % len(trace)]
        it[0] += 1
        return fn(topk, state_rows, *args, **kw)
    return step


def wall_us(step: Callable, iters: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--hot", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--miss-rate", type=float, default=0.067)
    ap.add_argument("--steps", type=int, default=64,
                    help="trace length; the trace cycles, so keep it long enough to churn")
    ap.add_argument("--iters", type=int, default=10, help="timed calls (reference)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    shape = dict(rows=args.rows, topk=args.topk, hot=args.hot, block_size=args.block_size,
                 context=args.context, miss_rate=args.miss_rate)
    results = []

    def report(impl: str, us: float, stats: torch.Tensor | None = None) -> None:
        rec = dict(op="resolve", impl=impl, device=str(device), us=round(us, 2), **shape)
        if stats is not None:
            tot = stats.sum(0).tolist()
            rec["hit_miss_masked"] = tot
        print(json.dumps(rec))
        results.append(rec)

    srows = torch.arange(args.rows, dtype=torch.int32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    state, trace = build(args.rows, args.topk, args.hot, args.block_size, args.context,
                         args.miss_rate, args.steps, device)
    step = stepper(reference.resolve, state, trace, srows)
    for _ in range(len(trace)):  # warm the hot buffers to the steady state
        out = step()
    report("torch-reference", wall_us(step, args.iters, sync), step().stats)

    if device.type == "cuda":
        import triton.testing

        from hisparse_triton.kernels import resolve as kres
        state, trace = build(args.rows, args.topk, args.hot, args.block_size, args.context,
                             args.miss_rate, args.steps, device)
        step = stepper(kres.resolve, state, trace, srows)
        for _ in range(len(trace)):
            out = step()
        report("triton", triton.testing.do_bench(step, warmup=25, rep=200) * 1e3, out.stats)
        # Decode path: one captured call replayed (same top-k each replay: steady hits).
        topk = trace[0]
        kw = dict(block_size=state["block_size"], num_device_blocks=state["num_device_blocks"],
                  num_host_blocks=state["num_host_blocks"])
        call_args = (topk, srows, state["seq_lens"], state["resident_blocks"],
                     state["host_blocks"], state["hot_blocks"], state["slot_host_rows"],
                     state["lru"])
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph):
            kres.resolve(*call_args, **kw)
        torch.cuda.current_stream().wait_stream(s)
        report("triton-cudagraph-replay", triton.testing.do_bench(graph.replay, warmup=25,
                                                                  rep=200) * 1e3)
        base = next(r["us"] for r in results if r["impl"] == "torch-reference")
        for r in results[1:]:
            r["speedup_vs_torch"] = round(base / r["us"], 1)
            print(json.dumps({"impl": r["impl"], "speedup_vs_torch": r["speedup_vs_torch"]}))

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
