"""Cost of the vLLM 0.33 HiSparse ops (``hisparse_triton.integrations.vllm``) at vLLM's shapes.

``decode_call_args`` builds the arguments vLLM's runtime passes at one decode step of one
index group (``vllm/v1/hisparse/runtime.py``: ``_resolve_residency``, ``_swap_rows``, the
mirror's ``invalidate_written_slots``; DeepSeek-V3.2 defaults: batch 64, top-k 2048, 4096 hot
slots, 656 B rows, block 64) and a prefill chunk's FP8 up-convert gather with host rows.

``host_cost()`` (any machine, CPU tensors standing in for CUDA ones): the Python time of one
call of each op with the Triton launches stubbed out, through ``torch.ops._C_cache_ops``
(as vLLM calls them: the dispatcher plus our kernel wrapper) and through the launcher alone,
and the launches per call. ``device_time()`` (CUDA): each op's device time by
``triton.testing.do_bench``, the resolve at a chosen miss ratio (its hot state restored
before every call, that copy timed alone and subtracted).

    PYTHONPATH=bench python -m lab.vllm_ops --host            # JSON on stdout
    PYTHONPATH=bench python -m lab.vllm_ops --device cuda     # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["OPS", "decode_call_args", "device_time", "host_cost"]

#: The ops timed, in vLLM's call order within a step.
OPS = ("hisparse_resolve_residency", "hisparse_gather_compact", "hisparse_gather_plan",
       "hisparse_invalidate_written_slots", "cp_gather_and_upconvert_fp8_kv_cache")


def decode_call_args(batch: int = 64, top_k: int = 2048, hot_slots: int = 4096, *,
                     row_bytes: int = 656, block_size: int = 64, seq_len: int = 32768,
                     miss_ratio: float = 0.134, prefill_tokens: int = 8192,
                     device: torch.device | str = "cpu", seed: int = 0) -> dict[str, tuple]:
    """``op name -> positional arguments`` of one decode step's call of each op, in vLLM's
    layout: tables by input-batch row, hot state by state row (a permutation), ``lru_slots``
    int16, ``swap_*`` / attention outputs of ``[batch, top_k]``, the host cache on the CPU
    (pinned on CUDA). The hot state holds ``1 - miss_ratio`` of the selected host rows, so the
    resolve plans about ``miss_ratio * top_k`` misses per request. The FP8 gather is a
    ``prefill_tokens`` chunk of ``batch`` requests on the staging path."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    i32 = torch.int32
    pages = -(-seq_len // block_size)
    hot_blocks = -(-hot_slots // block_size)
    host_blocks = batch * pages + 1
    host_rows = host_blocks * block_size
    host = torch.zeros(host_rows, row_bytes, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    num_blocks = batch * hot_blocks + 1
    hot = torch.zeros(num_blocks, block_size, row_bytes, dtype=torch.uint8, device=device)
    hot_table = (torch.randperm(batch * hot_blocks, generator=gen).view(batch, hot_blocks)
                 + 1).to(i32)
    source = (torch.randperm(batch * pages, generator=gen).view(batch, pages) + 1).to(i32)
    states = torch.randperm(batch, generator=gen).to(i32)
    topk = torch.stack([torch.randperm(seq_len, generator=gen)[:top_k]
                        for _ in range(batch)]).to(i32)
    # The hot state: each request's slots hold a share of its selected host rows.
    g = source.long().gather(1, topk.long() // block_size) * block_size + topk % block_size
    dgi = torch.full((batch, hot_slots), -1, dtype=i32)
    held = int(round((1 - miss_ratio) * top_k))
    for q in range(batch):
        slots = torch.randperm(hot_slots, generator=gen)[:held]
        dgi[states[q], slots] = g[q, :held].to(i32)
    lru = torch.stack([torch.randperm(hot_slots, generator=gen)
                       for _ in range(batch)]).to(torch.int16)
    resident = torch.zeros(batch, pages, dtype=i32)
    out = lambda *shape, dtype=i32: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    d = lambda t: t.to(device)  # noqa: E731
    req_ids = torch.arange(batch, dtype=i32)
    resolve = (
        host, hot, d(hot_table), d(topk), out(batch, top_k), d(dgi), d(lru), d(states),
        hot_slots, top_k, None, torch.zeros(2, dtype=torch.uint64, device=device),
        out(batch, top_k), block_size, d(req_ids), d(source), block_size, None,
        out(batch), out(batch, top_k), out(batch, top_k), out(batch), d(resident),
        block_size, 0)
    plan_src = d(g.to(i32))
    plan_dst = d((hot_table.long()[:, :top_k // block_size].repeat_interleave(block_size, 1)
                  * block_size + torch.arange(top_k) % block_size).to(i32))
    misses = int(round(miss_ratio * top_k))
    counts = d(torch.full((batch,), misses, dtype=i32))
    mask = d((torch.arange(top_k) < misses).to(i32).repeat(batch, 1))
    written = d((g[:, 0] + 1).to(torch.int64))
    invalidate = (d(dgi), d(states), d(req_ids), written)
    per_request = prefill_tokens // batch
    staged_blocks = -(-per_request // block_size)
    staged = batch * staged_blocks
    fp8 = (hot, torch.empty(prefill_tokens, 576, dtype=torch.bfloat16, device=device),
           d(torch.arange(staged, dtype=i32).view(batch, staged_blocks)),
           d(torch.arange(batch, dtype=i32) * per_request), batch, None, host,
           d(torch.randint(0, host_rows, (1, staged * block_size), generator=gen,
                           dtype=i32)),
           d(torch.full((1, staged * block_size), -1, dtype=i32)))
    return {
        "hisparse_resolve_residency": resolve,
        "hisparse_gather_compact": (host, hot, plan_src, plan_dst, counts),
        "hisparse_gather_plan": (host, hot, plan_src, plan_dst, mask, d(states), None, 0),
        "hisparse_invalidate_written_slots": invalidate,
        "cp_gather_and_upconvert_fp8_kv_cache": fp8,
    }


def _kernel_modules() -> list:
    from hisparse_triton.kernels import vllm_fp8, vllm_gather, vllm_residency

    return [vllm_residency, vllm_gather, vllm_fp8]


@contextlib.contextmanager
def _stubbed_launches() -> Iterator[list]:
    """The vLLM kernels' launches append to the yielded list instead of running; CPU tensors
    are accepted as if on CUDA and the ops pick the Triton backend."""
    from triton.runtime.jit import KernelInterface

    from lab.launches import _Recorder

    launches: list = []
    saved = []
    for module in _kernel_modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, KernelInterface):
                saved.append((module, name, value))
                setattr(module, name, _Recorder(value, launches, [""], False))
    residency = _kernel_modules()[0]
    saved.append((residency, "_check_backend", residency._check_backend))
    residency._check_backend = lambda device: None
    env = {k: os.environ.get(k) for k in ("HISPARSE_TRITON_BACKEND", "TRITON_INTERPRET")}
    os.environ.update(HISPARSE_TRITON_BACKEND="triton", TRITON_INTERPRET="1")
    try:
        yield launches
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _median_us(fn: Callable[[], Any], iters: int, repeats: int) -> tuple[float, float]:
    """(median, best) microseconds per call over ``repeats`` runs of ``iters`` calls."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return round(statistics.median(runs), 1), round(min(runs), 1)


def host_cost(batch: int = 64, top_k: int = 2048, hot_slots: int = 4096, *, iters: int = 200,
              repeats: int = 5) -> dict[str, Any]:
    """Host microseconds per call of each op with the launches stubbed (see the module
    docstring): ``{"ops": {name: {"dispatch_us", "dispatch_best_us", "launcher_us",
    "launcher_best_us", "launches"}}, "step_us": resolve + compact gather + invalidate
    through the dispatcher (one index group's decode calls), shape...}``."""
    from hisparse_triton.integrations import vllm as plugin

    plugin.register()
    calls = decode_call_args(batch, top_k, hot_slots)
    launchers = {}
    for module in _kernel_modules():
        for name in OPS:
            if hasattr(module, name):
                launchers[name] = getattr(module, name)
    result: dict[str, Any] = {}
    with _stubbed_launches() as launches:
        for name in OPS:
            args = calls[name]
            op = getattr(torch.ops._C_cache_ops, name)
            launcher = launchers[name]
            launches.clear()
            op(*args)  # first use: shapes, caches
            count = len(launches)
            dispatch = _median_us(lambda: op(*args), iters, repeats)
            direct = _median_us(lambda: launcher(*args), iters, repeats)
            launches.clear()
            result[name] = {"dispatch_us": dispatch[0], "dispatch_best_us": dispatch[1],
                            "launcher_us": direct[0], "launcher_best_us": direct[1],
                            "launches": count}
    step = sum(result[name]["dispatch_us"] for name in OPS[:2] + OPS[3:4])
    return {"ops": result, "step_us": round(step, 1), "batch": batch, "top_k": top_k,
            "hot_slots": hot_slots, "providers": plugin.providers()}


def device_time(device: torch.device | str = "cuda", batch: int = 64, top_k: int = 2048,
                hot_slots: int = 4096, *, miss_ratio: float = 0.134, warmup_ms: float = 25,
                rep_ms: float = 100) -> dict[str, Any]:
    """Device microseconds per call of each op (CUDA; ``triton.testing.do_bench``, median).
    The resolve restores its hot state before every call (it mutates it): that copy is timed
    alone and subtracted (``resolve_us``; ``resolve_with_restore_us`` is the raw figure)."""
    import triton.testing

    from hisparse_triton.integrations import vllm as plugin

    plugin.register()
    device = torch.device(device)
    calls = decode_call_args(batch, top_k, hot_slots, miss_ratio=miss_ratio, device=device)
    times: dict[str, Any] = {}

    def bench(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median")) * 1e3

    args = calls["hisparse_resolve_residency"]
    dgi, lru = args[5], args[6]
    dgi0, lru0 = dgi.clone(), lru.clone()
    resolve = torch.ops._C_cache_ops.hisparse_resolve_residency

    def restore():
        dgi.copy_(dgi0)
        lru.copy_(lru0)

    def restored_resolve():
        restore()
        resolve(*args)

    raw, copy = bench(restored_resolve), bench(restore)
    times["resolve_with_restore_us"] = round(raw, 2)
    times["restore_us"] = round(copy, 2)
    times["resolve_us"] = round(raw - copy, 2)
    misses = args[21]
    restored_resolve()
    times["misses_per_request"] = round(float(misses.float().mean()), 1)
    for name in OPS[1:]:
        op = getattr(torch.ops._C_cache_ops, name)
        a = calls[name]
        times[f"{name}_us"] = round(bench(lambda: op(*a)), 2)
    return {"device": torch.cuda.get_device_name(device), "batch": batch, "top_k": top_k,
            "hot_slots": hot_slots, "miss_ratio": miss_ratio, "times": times,
            "providers": plugin.providers()}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", action="store_true", help="host cost, launches stubbed")
    parser.add_argument("--device", default=None, help="device time on this CUDA device")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--hot-slots", type=int, default=4096)
    parser.add_argument("--miss-ratio", type=float, default=0.134)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"schema": "hisparse-triton/vllm-ops", "version": 1}
    if args.host or args.device is None:
        report["host"] = host_cost(args.batch, args.top_k, args.hot_slots)
    if args.device is not None:
        report["device"] = device_time(args.device, args.batch, args.top_k, args.hot_slots,
                                       miss_ratio=args.miss_ratio)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
