"""The decode-path checks of issue 20 in one call (``bench/gpu_check.py``'s ``decode-checks``
step): each section measures one point and records its own error, so one failing section
never loses the others.

Sections (``SECTIONS``; each ``fn(device, quick) -> dict``):

- ``launch_path``: host microseconds per eager launch of the decode gather through its
  bound launch (``BoundCopy``: checks once per plan layout) and through ``launch_copy``
  (checks every call), and of the bound resolve (``BoundResolve``) against ``ops.resolve``;
  all of them ``kernel[grid](...)`` launches; CUDA only;
- ``resolve_variants``: device microseconds of one resolve at R = 1, 8, 64 x K = 2048 x
  H = 4096 at two miss rates, for every variant ``kernels.resolve.resolve_variants`` lists
  (the shape's dispatch, hash, sorted), each checked against the reference first;
- ``resolve_vs_vllm``: our hash resolve, our sorted one, vLLM's compiled
  ``hisparse_resolve_residency`` (when vLLM's build provides it, else skipped with the
  reason) and our Triton form of it, on the same 64 x 2048 x 4096 step
  (``lab.resolve_compare``: do_bench, the state restored before every call);
- ``overlap_step``: a DeepSeek-V3.2 decode step at batch 64 with a stand-in compute kernel
  per layer (a bf16 matmul), without and with the side-stream mode (``resolve_rows(...,
  stream=)``), and with the gather grid uncapped vs capped (``gather_programs_per_sm``);
- ``split_gather``: ``lab.split_bench`` on CUDA: the split gather against the plain one on
  the same miss plans, on one GPU (the split's own cost) and, with 2+ GPUs, on every GPU
  (NCCL; recorded as skipped with the reason on one); fixed and auto capacity, serial and
  pipelined, exactness and bytes exchanged per step;
- ``vllm_ops``: ``lab.vllm_ops.device_time`` (the vLLM plugin's ops).

    PYTHONPATH=bench python -m lab.decode_checks --device cuda --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch

__all__ = ["SECTIONS", "run_checks"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_us(fn: Callable[[], Any], device: torch.device, n: int) -> float:
    """Host microseconds per call of ``fn`` over ``n`` calls (one sync at the end, so the
    figure is the enqueue cost while the device keeps up or not)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
        _sync(device)
    return round(best, 2)


# ----------------------------------------------------------------------------- launch path
def launch_path(device: torch.device, quick: bool) -> dict[str, Any]:
    """Host us per eager launch: bound vs checked every call, gather and resolve (see the
    module docstring)."""
    if device.type != "cuda":
        return {"skipped": "host cost on CPU: bench/host_cost.py (stand-in driver)"}
    from hisparse_triton import ops
    from lab.host_cost import _state, _tables
    from hisparse_triton.kernels import gather

    n = 200 if quick else 1000
    dev, host = _tables(1, 656, 64)
    dev = _on(dev, device)
    host = _pinned(host, device)
    R, K = 64, 2048
    src = torch.randint(0, host.num_rows, (R, K), dtype=torch.int32, device=device)
    dst = torch.randint(0, dev.num_rows, (R, K), dtype=torch.int32, device=device)
    counts = torch.full((R,), 32, dtype=torch.int32, device=device)
    bound = gather.BoundCopy(dev, host, pages=False, kernel="gather")
    out: dict[str, Any] = {
        "gather_bound_us": _host_us(lambda: bound(src, dst, counts), device, n),
        "gather_checked_us": _host_us(lambda: gather.launch_copy(
            dev, host, src, dst, counts, pages=False, kernel="gather"), device, n),
    }
    state = {k: v.to(device) for k, v in _state(R, K, 4096, 64).items()}
    sizes = dict(block_size=64, num_device_blocks=1 << 20, num_host_blocks=1 << 20)
    from hisparse_triton.kernels.resolve import BoundResolve

    ws = ops.ResolveWorkspace(device)
    counters = torch.zeros(3, dtype=torch.int64, device=device)
    rows = torch.empty(R, K, dtype=torch.int32, device=device)
    br = BoundResolve(state["seq_lens"], state["resident_blocks"], state["host_blocks"],
                      state["hot_blocks"], state["slot_host_rows"], state["lru"],
                      counters=counters, workspace=ws, **sizes)
    out["resolve_bound_us"] = _host_us(lambda: br(state["topk"], state["state_rows"], rows),
                                       device, n)
    args = tuple(state.values())
    out["resolve_ops_us"] = _host_us(lambda: ops.resolve(
        *args, **sizes, workspace=ws, out=rows, counters=counters, backend="triton"),
        device, n)
    out["note"] = ("host time per eager launch, best of 3 x n calls with one sync after; "
                   "the bound figures are what an eager decode step pays per launch (a "
                   "CUDA-graph replay pays none of it)")
    return out


def _on(table: Any, device: torch.device) -> Any:
    from hisparse_triton.row_table import RowTable

    return RowTable.build(table.pool.to(device), table.offsets, row_bytes=table.row_bytes,
                          block_size=table.block_size, block_stride=table.block_stride,
                          num_rows=table.num_rows, device=device)


def _pinned(table: Any, device: torch.device) -> Any:
    from hisparse_triton.row_table import RowTable

    return RowTable.build(table.pool.pin_memory(), table.offsets, row_bytes=table.row_bytes,
                          block_size=table.block_size, block_stride=table.block_stride,
                          num_rows=table.num_rows, device=device)


# ----------------------------------------------------------------------------- resolve
def resolve_variants(device: torch.device, quick: bool) -> dict[str, Any]:
    """Device us per resolve call for every variant the resolve family offers
    (``kernels.resolve.resolve_variants``: the shape's dispatch, hash, sorted), each checked
    against the torch reference first (``ops.resolve.variants.time_resolve_variants``)."""
    if device.type != "cuda":
        return {"skipped": "device timing needs CUDA"}
    from hisparse_triton.benchmarks.timing import L2Flush, event_time
    from hisparse_triton.ops.resolve.variants import time_resolve_variants
    from hisparse_triton.benchmarks.workloads import ResolveWorkload

    flush = L2Flush(device, 64 << 20)
    results: dict[str, Any] = {"timer": "ops.resolve.variants.time_resolve_variants"}
    for R in ((1, 64) if quick else (1, 8, 64)):
        for miss in (1.0, 0.134):
            key = f"R{R}_miss{miss:g}"
            try:
                work = ResolveWorkload(R, 2048, 4096, 32768, miss, device)

                def timer(call, work=work):
                    return round(event_time(call, work.restore, flush, warmup_ms=10,
                                            rep_ms=30 if quick else 80).median_ms * 1e3, 2)

                results[key] = {f"{name}_us": t for name, t in
                                time_resolve_variants(work, timer).items()}
            except Exception as exc:  # one shape failing keeps the others
                results[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    results["note"] = ("K=2048, H=4096, 32768-token histories; each variant checked against "
                       "the torch reference first; event time with the state restored and "
                       "L2 flushed before each call")
    return results


def resolve_vs_vllm(device: torch.device, quick: bool) -> dict[str, Any]:
    """``lab.resolve_compare.device_time`` (CUDA): hash, sorted and vLLM's compiled resolve
    on the same inputs."""
    if device.type != "cuda":
        return {"skipped": "device timing needs CUDA"}
    from lab import resolve_compare

    return resolve_compare.device_time(device, rep_ms=40 if quick else 100,
                                       miss_ratios=(0.134,) if quick else (0.134, 1.0))


# ----------------------------------------------------------------------------- overlap
def overlap_step(device: torch.device, quick: bool, **kwargs: Any) -> dict[str, Any]:
    """``hisparse_triton.benchmarks.decode_step.overlap_step`` (``bench --decode-step``'s
    serial vs side-stream step)."""
    from hisparse_triton.benchmarks.decode_step import overlap_step as step

    return step(device, quick, **kwargs)


# ----------------------------------------------------------------------------- split gather
def split_gather(device: torch.device, quick: bool) -> dict[str, Any]:
    """``lab.split_bench``: the split gather against the plain one on the same miss plans,
    on 1 rank and on every GPU (NCCL; a rank count above the GPUs is recorded as skipped
    with the reason)."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA (the split gather is exact on CPU: "
                           "tests/test_split_gather.py; its gloo figures: lab.split_bench "
                           "--device cpu)"}
    import os
    import subprocess

    from lab import child_env

    count = min(torch.cuda.device_count(), 8)
    ranks = sorted({1, max(2, count)})
    cmd = [sys.executable, "-m", "lab.split_bench", "--device", "cuda",
           "--ranks", ",".join(map(str, ranks)), "--steps", "16" if quick else "32"]
    if quick:
        cmd += ["--variants", "fixed-0.25-serial,auto-serial,auto"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=45 if quick else 70,
                          env=child_env(dict(os.environ)))
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- vLLM ops
def vllm_ops(device: torch.device, quick: bool) -> dict[str, Any]:
    """``lab.vllm_ops.device_time`` (CUDA)."""
    if device.type != "cuda":
        return {"skipped": "device timing needs CUDA"}
    from lab import vllm_ops as vo

    return vo.device_time(device, rep_ms=40 if quick else 100)


SECTIONS: dict[str, Callable[[torch.device, bool], dict[str, Any]]] = {
    "launch_path": launch_path, "resolve_variants": resolve_variants,
    "resolve_vs_vllm": resolve_vs_vllm,
    "overlap_step": overlap_step, "split_gather": split_gather, "vllm_ops": vllm_ops}


def run_checks(device: torch.device | str = "cuda", *, quick: bool = False,
               only: Optional[list[str]] = None,
               on_section: Optional[Callable[[dict[str, Any]], None]] = None
               ) -> dict[str, Any]:
    """Every section (or ``only`` those) on ``device``; a section that raises records
    ``{"error", "traceback"}`` and the next one runs. ``on_section(report)`` after each."""
    device = torch.device(device)
    report: dict[str, Any] = {"schema": "hisparse-triton/decode-checks", "version": 1,
                              "device": str(device), "quick": quick, "sections": {}}
    for name, fn in SECTIONS.items():
        if only and name not in only:
            continue
        start = time.time()
        try:
            result = fn(device, quick)
        except Exception as exc:  # noqa: BLE001 - one section must not lose the others
            result = {"error": f"{type(exc).__name__}: {exc}"[:1000],
                      "traceback": traceback.format_exc()[-3000:]}
        result["wall_s"] = round(time.time() - start, 1)
        report["sections"][name] = result
        if on_section is not None:
            on_section(report)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated sections")
    parser.add_argument("--json", default=None, help="write the report here (after each "
                                                     "section)")
    args = parser.parse_args(argv)

    def save(report: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump(report, out, indent=1)

    report = run_checks(args.device, quick=args.quick,
                        only=args.only.split(",") if args.only else None, on_section=save)
    save(report)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
