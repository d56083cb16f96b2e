"""Device time of SGLang 0.5.23's HiSparse swap-in: this project's kernels in SGLang's form
(``hisparse_triton.kernels.sglang_swap_in``) against SGLang's own JIT kernel, at SGLang's
shapes, with a bit-for-bit comparison of the two on the GPU.

``swap_in_args`` builds the arguments SGLang's ``HiSparseCoordinator`` passes for one layer
of one decode step (DeepSeek-V3.2 defaults: batch 64, top-k 2048, 4096 hot slots, 656 B
rows, the miss plan recorded): every slot holds its own position, the slots of a request
hold ``1 - miss_ratio`` of its top-k positions, so each request plans about ``miss_ratio *
top_k`` misses. ``device_time`` (CUDA) times, by ``triton.testing.do_bench`` (median), with
the swap-in's state restored before every call (that copy timed alone and subtracted):

- ours: the swap-in (resolve + copy), the resolve alone (``skip_io``), the swap-in replayed
  from a CUDA graph, and the follower replay ``copy_cache_planned_mla``;
- SGLang's, when ``sglang.kernels.ops.kvcache.hisparse`` imports and its JIT kernel builds
  (nvcc, tvm_ffi): the same calls (its JIT build time recorded), and whether its outputs
  (locs, slot table, LRU, miss plan, device pool) equal ours bit for bit on the same inputs;
  otherwise the reason it was skipped.

    python -m hisparse_triton.benchmarks.sglang_swap_in --device cuda --json out.json
    python -m hisparse_triton.benchmarks.sglang_swap_in --device cpu   # the torch model once
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from typing import Any, Callable, Optional

import torch

__all__ = ["device_time", "main", "swap_in_args"]

SCHEMA = "hisparse-triton/sglang-swap-in"
#: Written-in-place arguments of the swap-in (positions in SGLang's argument order).
_MUTATED = (1, 5, 6, 9)         # device_buffer_tokens, device_buffer, top_k_device_locs, lru
_PAGE = 64


def swap_in_args(batch: int = 64, top_k: int = 2048, hot: int = 4096, *, row_bytes: int = 656,
                 seq_len: int = 8192, miss_ratio: float = 0.134,
                 device: torch.device | str = "cuda", seed: int = 0) -> tuple[tuple, dict]:
    """``(positional args, keyword args)`` of one ``load_cache_to_device_buffer_mla`` call in
    SGLang's layout (see the module docstring); the host pool is pinned on CUDA."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    width = hot + _PAGE
    states = batch + 1                  # row 0: SGLang's padding row
    n_hit = int(round((1 - miss_ratio) * top_k))
    top = torch.empty(batch, top_k, dtype=torch.int32)
    held = torch.full((states, width), -1, dtype=torch.int32)
    for b in range(batch):
        perm = torch.randperm(seq_len - 1, generator=g)[: top_k + hot - n_hit].to(torch.int32)
        top[b] = perm[:top_k]
        slots = torch.cat([perm[:n_hit], perm[top_k: top_k + hot - n_hit]])
        held[b + 1, :hot] = slots[torch.randperm(hot, generator=g)]
    locs = (torch.randperm(states * width, generator=g) + _PAGE).to(torch.int32)
    lru = torch.stack([torch.randperm(hot, generator=g) for _ in range(states)]).to(torch.int16)
    host_rows = states * seq_len
    hcl = torch.arange(host_rows, dtype=torch.int64).view(states, seq_len)
    host = torch.randint(0, 256, (host_rows, row_bytes), dtype=torch.uint8, generator=g)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = torch.zeros(states * width + _PAGE, row_bytes, dtype=torch.uint8, device=device)
    args = (top.to(device), held.to(device), hcl.to(device), locs.view(states, width).to(device),
            host, dev, torch.full((batch, top_k), -1, dtype=torch.int32, device=device),
            torch.arange(1, batch + 1, dtype=torch.int64, device=device),
            torch.full((batch,), seq_len, dtype=torch.int64, device=device), lru.to(device),
            row_bytes, top_k, hot)
    kwargs = dict(page_size=1, block_size=960,
                  num_real_reqs=torch.tensor([batch], dtype=torch.int32, device=device),
                  miss_src=torch.zeros(batch, top_k, dtype=torch.int64, device=device),
                  miss_dst=torch.zeros(batch, top_k, dtype=torch.int32, device=device),
                  miss_count=torch.zeros(batch, dtype=torch.int32, device=device))
    return args, kwargs


def _fresh(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A copy of the call whose written arguments are new tensors (the host pool and the
    read-only tables are shared)."""
    out = list(args)
    for i in _MUTATED:
        out[i] = args[i].clone()
    kw = {k: (v.clone() if k.startswith("miss_") else v) for k, v in kwargs.items()}
    return tuple(out), kw


def _outputs(args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    counts = kwargs["miss_count"]
    width = int(counts.max()) if counts.numel() else 0
    return {"top_k_device_locs": args[6], "device_buffer_tokens": args[1], "lru_slots": args[9],
            "device_buffer": args[5], "miss_count": counts,
            "miss_src": kwargs["miss_src"][:, :width], "miss_dst": kwargs["miss_dst"][:, :width]}


def _sglang_swap_in() -> tuple[Optional[Callable[..., None]], Optional[Callable[..., None]],
                               Optional[str]]:
    """SGLang's own swap-in and replay (unwrapped from any plugin hook), or the reason they
    cannot run here."""
    try:
        from sglang.kernels.ops.kvcache import hisparse as theirs
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
        return None, None, f"sglang.kernels.ops.kvcache.hisparse does not import: " \
                           f"{type(exc).__name__}: {exc}"
    return (inspect.unwrap(theirs.load_cache_to_device_buffer_mla),
            inspect.unwrap(theirs.copy_cache_planned_mla), None)


def device_time(device: torch.device | str = "cuda", batch: int = 64, top_k: int = 2048,
                hot: int = 4096, *, row_bytes: int = 656, seq_len: int = 8192,
                miss_ratio: float = 0.134, warmup_ms: float = 25, rep_ms: float = 100,
                compare_sglang: bool = True) -> dict[str, Any]:
    """Device microseconds per call (see the module docstring) and the comparison with
    SGLang's kernel. On a CPU device: the torch model runs once, nothing is timed."""
    from hisparse_triton.integrations import sglang_reference
    from hisparse_triton.kernels import sglang_swap_in as ours

    device = torch.device(device)
    args, kwargs = swap_in_args(batch, top_k, hot, row_bytes=row_bytes, seq_len=seq_len,
                                miss_ratio=miss_ratio, device=device)
    report: dict[str, Any] = {"batch": batch, "top_k": top_k, "hot_slots": hot,
                              "row_bytes": row_bytes, "seq_len": seq_len,
                              "miss_ratio": miss_ratio}
    if device.type != "cuda":
        call, kw = _fresh(args, kwargs)
        sglang_reference.load_cache_to_device_buffer_mla(*call, **kw)
        report["misses_per_request"] = round(float(kw["miss_count"].float().mean()), 1)
        report["skipped"] = "no CUDA device: the torch model ran once, nothing was timed"
        return report
    import triton.testing

    report["device"] = torch.cuda.get_device_name(device)
    saved = {i: args[i].clone() for i in _MUTATED}

    def restore() -> None:
        for i, value in saved.items():
            args[i].copy_(value)

    def bench(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median")) * 1e3

    restore_us = bench(restore)
    times: dict[str, Any] = {"restore_us": round(restore_us, 2)}

    def timed(name: str, fn: Callable[..., None], **extra: Any) -> None:
        def run() -> None:
            restore()
            fn(*args, **{**kwargs, **extra})
        times[f"{name}_us"] = round(bench(run) - restore_us, 2)

    timed("ours_swap_in", ours.load_cache_to_device_buffer_mla)
    timed("ours_resolve_only", ours.load_cache_to_device_buffer_mla, skip_io=True)
    restore()
    ours.load_cache_to_device_buffer_mla(*args, **kwargs)
    report["misses_per_request"] = round(float(kwargs["miss_count"].float().mean()), 1)
    eager = {k: v.clone() for k, v in _outputs(args, kwargs).items()}
    plan = {k: kwargs[k] for k in ("miss_src", "miss_dst", "miss_count", "num_real_reqs")}
    follower = torch.zeros_like(args[5])
    times["ours_replay_us"] = round(bench(lambda: ours.copy_cache_planned_mla(
        **plan, host_cache=args[4], device_buffer=follower, item_size_bytes=row_bytes)), 2)
    report["graph"] = _graph(ours.load_cache_to_device_buffer_mla, args, kwargs, restore,
                             eager, bench, restore_us)
    if compare_sglang:
        report["sglang"] = _against_sglang(args, kwargs, restore, bench, restore_us, eager,
                                           plan, follower, row_bytes)
    report["times"] = times
    return report


def _graph(fn, args, kwargs, restore, eager, bench, restore_us) -> dict[str, Any]:
    """Our swap-in captured in a CUDA graph: replayed on the restored state, its outputs equal
    the eager call's; its replay time."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            restore()
            fn(*args, **kwargs)         # warm-up: compile and memoise outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        restore()
        with torch.cuda.graph(graph):
            fn(*args, **kwargs)
        restore()
        graph.replay()
        torch.cuda.synchronize()
        exact = all(torch.equal(v, eager[k]) for k, v in _outputs(args, kwargs).items())

        def replay() -> None:
            restore()
            graph.replay()
        return {"exact": exact, "replay_us": round(bench(replay) - restore_us, 2)}
    except Exception as exc:  # noqa: BLE001 - a failed capture is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def _against_sglang(args, kwargs, restore, bench, restore_us, eager, plan, follower,
                    row_bytes) -> dict[str, Any]:
    theirs, theirs_replay, why = _sglang_swap_in()
    if theirs is None:
        return {"skipped": why}
    out: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        restore()
        theirs(*args, **kwargs)                      # builds SGLang's JIT module
        torch.cuda.synchronize()
        out["jit_build_s"] = round(time.perf_counter() - start, 1)
    except Exception as exc:  # noqa: BLE001 - no nvcc / tvm_ffi: skipped with the reason
        return {"skipped": f"SGLang's JIT swap-in does not run here: "
                           f"{type(exc).__name__}: {exc}"[:500]}
    mine = _outputs(args, kwargs)
    out["exact"] = {k: bool(torch.equal(v, eager[k])) for k, v in mine.items()}

    def run() -> None:
        restore()
        theirs(*args, **kwargs)

    def run_probe() -> None:
        restore()
        theirs(*args, **{**kwargs, "skip_io": True})
    out["sglang_swap_in_us"] = round(bench(run) - restore_us, 2)
    out["sglang_resolve_only_us"] = round(bench(run_probe) - restore_us, 2)
    try:
        out["sglang_replay_us"] = round(bench(lambda: theirs_replay(
            **plan, host_cache=args[4], device_buffer=follower, item_size_bytes=row_bytes)), 2)
    except Exception as exc:  # noqa: BLE001
        out["sglang_replay_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda[:N], or cpu (the torch model "
                                                         "once, nothing timed)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--hot-slots", type=int, default=4096)
    parser.add_argument("--row-bytes", type=int, default=656)
    parser.add_argument("--miss-ratios", default="0.134,1",
                        help="comma-separated miss ratios (default 0.134,1)")
    parser.add_argument("--quick", action="store_true",
                        help="one miss ratio (0.134), shorter timing")
    parser.add_argument("--no-sglang", action="store_true", help="time ours only")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the report here (default: stdout)")
    args = parser.parse_args(argv)
    ratios = [0.134] if args.quick else [float(x) for x in args.miss_ratios.split(",") if x]
    small = torch.device(args.device).type != "cuda"
    report: dict[str, Any] = {"schema": SCHEMA, "version": 1, "runs": []}
    for ratio in ratios:
        try:
            run = device_time(args.device, 4 if small else args.batch,
                              64 if small else args.top_k, 128 if small else args.hot_slots,
                              row_bytes=args.row_bytes, seq_len=1024 if small else 8192,
                              miss_ratio=ratio, rep_ms=40 if args.quick else 100,
                              compare_sglang=not args.no_sglang)
        except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
            run = {"miss_ratio": ratio, "error": f"{type(exc).__name__}: {exc}"[:500]}
        report["runs"].append(run)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(report, handle, indent=1)
    if not args.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0 if all("error" not in r for r in report["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
