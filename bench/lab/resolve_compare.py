"""Our hash resolve, our sorted resolve and vLLM's compiled resolve on the same inputs.

One decode step of one index group (``hisparse_triton.benchmarks.ResolveWorkload``: B
requests x top-k positions x H hot slots, a warmed LRU order, an exact miss ratio) is given
to every resolve in its own layout:

- ``hash`` / ``sorted``: ``kernels.resolve._resolve`` with the variant's knobs
  (``resolve_variants``), the workload's tensors as they are;
- ``vllm_compiled``: ``torch.ops._C_cache_ops.hisparse_resolve_residency`` when vLLM's
  compiled extension provides it (``integrations.vllm.providers()`` says ``"vllm"``; skipped
  with the reason otherwise);
- ``vllm_form_triton``: our Triton kernel of that op (``kernels.vllm_residency``), what vLLM
  runs on hisparse-triton.

``vllm_args(work)`` translates the workload into vLLM 0.33's arguments (one row per request:
``request_ids = arange(B)``, the source / hot block tables by request, the hot state and the
resident table by state row, ``lru_slots`` int16); ``check_same_step`` checks that both forms
resolve the step to the same rows, plans and state (vLLM's semantics and ours agree on one
row per request), so the times compare like for like.

``device_time(device)`` (CUDA): each resolve's device microseconds by
``triton.testing.do_bench`` (median), with the hot state restored before every call: the
restore is timed alone and subtracted (as ``lab.vllm_ops``). Each of ours is first checked bit
for bit against the torch reference; vLLM's compiled op is checked against ours and the
verdict recorded (a mismatch is reported, not raised: it is vLLM's kernel).

    PYTHONPATH=bench python -m lab.resolve_compare --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Optional

import torch

__all__ = ["check_same_step", "device_time", "vllm_args"]

#: Bytes per row of the stand-in host / hot caches (the resolve reads only their geometry).
_ROW_BYTES = 16


def vllm_args(work: Any) -> tuple:
    """vLLM 0.33's ``hisparse_resolve_residency`` arguments for ``work``'s step (see the module
    docstring); outputs freshly allocated on the workload's device. The hot state tensors are
    the workload's own (``slot_host_rows``) or a view of them (``lru`` as int16, a copy: call
    ``sync_lru`` after ``work.restore()``)."""
    topk, state_rows, seq_lens, resident, host_blocks, hot_blocks, slot_rows, lru = work.args()
    device = topk.device
    B, K = topk.shape
    H = lru.shape[1]
    block = work.kwargs["block_size"]
    host_rows = work.kwargs["num_host_blocks"] * block
    host = torch.zeros(host_rows, _ROW_BYTES, dtype=torch.uint8)
    if device.type == "cuda":
        host = host.pin_memory()
    hot = torch.zeros(work.kwargs["num_device_blocks"], block, _ROW_BYTES, dtype=torch.uint8,
                      device=device)
    i32 = torch.int32
    out = lambda *shape: torch.empty(*shape, dtype=i32, device=device)  # noqa: E731
    requests = torch.arange(B, dtype=i32, device=device)
    # by request (= row): the source and hot block tables of the row's state
    by_request = lambda t: t.index_select(0, state_rows.long()).contiguous()  # noqa: E731
    return (host, hot, by_request(hot_blocks), topk, out(B, K), slot_rows,
            lru.to(torch.int16), state_rows, H, K, None,
            torch.zeros(2, dtype=torch.uint64, device=device), out(B, K), block, requests,
            by_request(host_blocks), block, None, out(B), out(B, K), out(B, K), out(B),
            resident, block, 0)


def sync_lru(work: Any, args: tuple) -> None:
    """Copy the workload's (restored) LRU into the int16 ``lru_slots`` of ``args``."""
    args[6].copy_(work.lru)


def check_same_step(work: Any, op: Callable[..., Any], ours: Callable[[], Any]) -> bool:
    """Whether ``op`` (a ``hisparse_resolve_residency``: vLLM's compiled op, our Triton one
    or the torch model) and ``ours`` (one of our resolves on ``work``) resolve ``work``'s step
    alike: the same rows per column, misses per request, plans (host and device rows of
    each miss), held rows and LRU afterwards. Leaves the state restored."""
    args = vllm_args(work)
    work.restore()
    sync_lru(work, args)
    op(*args)
    theirs = (args[4].clone(), args[21].clone(), args[19].clone(), args[20].clone(),
              work.slot_host_rows.clone(), args[6].to(torch.int32))
    work.restore()
    got = ours()
    counts = got.miss_count
    same = torch.equal(theirs[0], got.rows) and torch.equal(theirs[1], counts) \
        and torch.equal(theirs[4], work.slot_host_rows) and torch.equal(theirs[5], work.lru)
    for r in range(got.rows.shape[0]):  # the plan entries up to each request's misses
        n = int(counts[r])
        same = same and torch.equal(theirs[2][r, :n], got.miss_src[r, :n]) \
            and torch.equal(theirs[3][r, :n], got.miss_dst[r, :n])
    work.restore()
    return bool(same)


def _ours(work: Any) -> dict[str, Callable[[], Any]]:
    """Our resolves of ``work`` (``{variant: call}``: ``hash`` where it applies, ``sorted``),
    with a workspace and ``out`` as the runtime calls them."""
    from hisparse_triton.kernels import resolve as kres
    from hisparse_triton.ops.resolve.workspace import ResolveWorkspace

    topk = work.topk
    K, H = topk.shape[1], work.lru.shape[1]
    ws = ResolveWorkspace(topk.device)
    rows = torch.empty_like(topk, dtype=torch.int32)
    calls = {}
    for name, knobs in kres.resolve_variants(K, H, work.kwargs["block_size"],
                                             work.kwargs["num_host_blocks"]).items():
        if name == "default":
            continue
        calls[name] = (lambda knobs=knobs: kres._resolve(*work.args(), **work.kwargs,
                                                         out=rows, workspace=ws, **knobs))
    return calls


def device_time(device: torch.device | str = "cuda", batch: int = 64, top_k: int = 2048,
                hot_slots: int = 4096, seq_len: int = 32768, *,
                miss_ratios: tuple[float, ...] = (0.134, 1.0), warmup_ms: float = 25,
                rep_ms: float = 100) -> dict[str, Any]:
    """Device us per call of each resolve (see the module docstring) at each miss ratio:
    ``{"miss<r>": {"<name>_us": ..., "vllm_compiled_matches": bool, ...}, "vllm_compiled":
    provider note}``. CUDA only."""
    import triton.testing

    from hisparse_triton import benchmarks as bm
    from hisparse_triton.integrations import vllm as plugin
    from hisparse_triton.kernels import vllm_residency
    from hisparse_triton.ops.resolve import reference
    from hisparse_triton.ops.resolve.variants import time_resolve_variants

    device = torch.device(device)
    plugin.register()  # keeps vLLM's compiled ops where they exist
    compiled = plugin.providers().get("hisparse_resolve_residency") == "vllm"
    out: dict[str, Any] = {
        "batch": batch, "top_k": top_k, "hot_slots": hot_slots, "seq_len": seq_len,
        "timer": "triton.testing.do_bench median, the state restore timed alone and "
                 "subtracted",
        "vllm_compiled": "torch.ops._C_cache_ops.hisparse_resolve_residency (vLLM's build)"
        if compiled else "skipped: vLLM's compiled extension does not provide "
                         f"hisparse_resolve_residency (providers: {plugin.providers()})"}

    def bench(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median")) * 1e3

    for ratio in miss_ratios:
        work = bm.ResolveWorkload(batch, top_k, hot_slots, seq_len, ratio, device)
        times: dict[str, Any] = {}
        time_resolve_variants(work, lambda call: 0.0)  # ours: checked against the reference
        args = vllm_args(work)

        def restore(args=args, work=work):
            work.restore()
            sync_lru(work, args)

        base = bench(restore)
        times["restore_us"] = round(base, 2)
        calls = _ours(work)
        calls["vllm_form_triton"] = lambda args=args: vllm_residency.hisparse_resolve_residency(
            *args)
        if compiled:  # vLLM's kernel: an error of its own is recorded, ours still timed
            op = torch.ops._C_cache_ops.hisparse_resolve_residency
            try:
                times["vllm_compiled_matches_ours"] = check_same_step(work, op,
                                                                      calls["sorted"])
                calls["vllm_compiled"] = lambda args=args, op=op: op(*args)
            except Exception as exc:  # noqa: BLE001
                times["vllm_compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
        times["vllm_form_triton_matches_ours"] = check_same_step(
            work, vllm_residency.hisparse_resolve_residency, calls["sorted"])
        for name, call in calls.items():
            def timed(call=call, restore=restore):
                restore()
                call()
            times[f"{name}_us"] = round(bench(timed) - base, 2)
        work.restore()
        ref = reference.resolve(*work.args(), **work.kwargs)
        times["misses_per_request"] = round(float(ref.miss_count.float().mean()), 1)
        out[f"miss{ratio:g}"] = times
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="shorter timing runs")
    args = parser.parse_args(argv)
    result = device_time(args.device, args.batch, rep_ms=40 if args.quick else 100)
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
