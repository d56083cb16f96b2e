"""The host (Python) cost of the decode path, on any machine: what an EAGER decode step costs
the CPU (a CUDA-graph replay pays none of the launches' Python; ``hisparse-triton bench
--decode-step`` times both on a GPU).

    python bench/host_cost.py [--quick] [--batch 64] [--top-k 2048] [--hot-slots 4096]
                              [--no-launch-path] [--instructions] [--json PATH|-]

1. every kernel launch stubbed out (``lab.launches``): ``ops.resolve`` + ``ops.copy_rows``
   per call (``lab.host_cost``), and a DeepSeek-V3.2-shaped step at the batch
   (``lab.step_cost``: bookkeeping + 61 index groups), with launches and torch ops per step;
2. the same step with Triton's real Python launch path against a stand-in sm_90 driver
   (``lab.standin_driver``: real compiles, nothing launched), with and without the
   stand-in's emulation of the C launcher's address reads (``--no-launch-path`` skips it:
   the first run compiles the kernels, about a minute);
3. ``--instructions``: the step, one ``resolve_rows`` and the bookkeeping counted in
   instructions under valgrind's callgrind (``lab.instructions``; deterministic where times
   move by tens of percent; needs valgrind, a few minutes).

The lab that measures the project itself: not part of the installed package.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from hisparse_triton.commands.argtypes import bounded_int
from hisparse_triton.commands.flags import set_torch_threads
from hisparse_triton.commands.output import json_document, report_stream, write_json

#: Host-cost targets: per ``resolve_rows`` (besides Triton's launch call), per eager decode
#: step of DeepSeek-V3.2 at batch 64, and kernel launches per step (3 per index group).
HOST_TARGETS = {"resolve_rows_us": 25.0, "step_ms": 3.0, "step_launches": 183}
#: Target of the same step with Triton's real Python launch path included (issue 20).
LAUNCH_PATH_TARGET_MS = 1.5


def run_host(args: argparse.Namespace) -> int:
    """The decode path's host cost with the launches stubbed out (see the module
    docstring)."""
    from lab.host_cost import resolve_host_cost
    from lab.step_cost import decode_step_host_cost

    set_torch_threads(args.threads or 1)
    batch = args.batch
    top_k = args.top_k or 2048
    hot = args.hot_slots or max(4096, 2 * top_k)
    steps = 10 if args.quick else 40
    ops_level = resolve_host_cost(batch, top_k, hot, iters=50 if args.quick else 200)
    step = decode_step_host_cost(batch, steps, top_k=top_k, device_buffer_size=hot)
    met = {name: step[name] <= limit for name, limit in HOST_TARGETS.items()}
    lines = [
        f"host cost, kernel launches stubbed (CPU): {step['geometry']}, batch {batch}",
        f"  ops.resolve + ops.copy_rows   {ops_level['us_per_call']:8.1f} us per call "
        f"({ops_level['launches_per_call']} launches)",
        f"  worker.resolve_rows           {step['resolve_rows_us']:8.1f} us per call "
        f"(target <= {HOST_TARGETS['resolve_rows_us']:g}; {step['resolve_rows_launches']} "
        f"launches, {step['resolve_rows_torch_ops']} torch ops)",
        f"  bookkeeping per step          {step['bookkeeping_ms']:8.3f} ms (append_decode + "
        f"step + apply + mirror; the in-process facade: {step['facade_bookkeeping_ms']:.3f} ms)",
        f"  whole eager decode step       {step['step_ms']:8.3f} ms (target <= "
        f"{HOST_TARGETS['step_ms']:g}); {step['step_launches']} kernel launches (target <= "
        f"{HOST_TARGETS['step_launches']}), {step['step_torch_ops']} torch ops",
    ]
    launch_path: dict = {}
    if not args.no_launch_path:
        from lab.step_cost import launch_path_host_cost

        lines.append("host cost with Triton's real Python launch path (JITFunction.run per "
                     "launch) against a STAND-IN sm_90 driver on CPU: real compiles, each "
                     "launch's tensor addresses read, nothing launched:")
        # bare: the stand-in's Python emulation of the C launcher's pointer address reads
        # left out (Triton's Python launch path alone)
        for label, reads in (("standin", True), ("bare", False)):
            try:
                launch_path[label] = launch_path_host_cost(batch, steps, top_k=top_k,
                                                           device_buffer_size=hot,
                                                           read_addresses=reads)
            except Exception as exc:  # the stubbed numbers above still stand
                launch_path[label] = {"error": str(exc)[-500:]}
                lines.append(f"  {label}: failed: {str(exc)[-200:]}")
                continue
            r = launch_path[label]
            how = "kernel[grid](...) per launch"
            if not reads:
                how += ", no emulated address reads"
            lines.append(
                f"  {label:10s} ({how}"
                f"): step {r['step_ms']:.3f} ms (target <= {LAUNCH_PATH_TARGET_MS:g}), "
                f"worker.resolve_rows {r['resolve_rows_us']:.1f} us, bookkeeping "
                f"{r['bookkeeping_ms']:.3f} ms, {r['step_launches']} launches")
    counts = _host_instructions(batch, top_k, hot, lines) if args.instructions else {}
    print("\n".join(lines), file=report_stream(args.json))
    if args.json:
        doc = {"ops": ops_level, "step": step, "targets": HOST_TARGETS, "met": met}
        if launch_path:
            doc["launch_path"] = dict(launch_path, target_step_ms=LAUNCH_PATH_TARGET_MS)
        if counts:
            doc["instructions"] = counts
        write_json(json_document("bench-host", 1, doc), args.json)
    return 0


def _host_instructions(batch: int, top_k: int, hot: int, lines: list[str]) -> dict:
    """``--instructions``: instructions per unit of the step with Triton's launch path
    against the stand-in driver (``lab.instructions``), and of the step
    without the stand-in's emulated address reads; appends the report's lines."""
    from lab.instructions import count_instructions

    lines.append("instructions (callgrind; Triton's launch path, stand-in sm_90 driver):")
    counts: dict = {}
    for label, unit, mode in (("step", "step", "standin"),
                              ("resolve_rows", "resolve_rows", "standin"),
                              ("bookkeeping", "bookkeeping", "standin"),
                              ("step_bare", "step", "standin_bare")):
        try:
            counts[label] = count_instructions(unit, launches=mode, batch=batch, top_k=top_k,
                                               device_buffer_size=hot)
        except Exception as exc:  # the times above still stand
            counts[label] = {"error": str(exc)[-500:]}
            lines.append(f"  {label}: failed: {str(exc)[-200:]}")
            continue
        note = ", no emulated address reads" if mode == "standin_bare" else ""
        lines.append(f"  {label:13s} {counts[label]['instructions']:>12,d} instructions per "
                     f"{unit}{note}")
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=bounded_int(1, 1 << 16), default=64)
    parser.add_argument("--top-k", type=bounded_int(1, 32768), default=None)
    parser.add_argument("--hot-slots", type=bounded_int(1, 32768), default=None)
    parser.add_argument("--quick", action="store_true", help="fewer steps and calls")
    parser.add_argument("--no-launch-path", action="store_true",
                        help="skip the runs through Triton's launch path (stand-in driver)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions under valgrind's callgrind")
    parser.add_argument("--threads", type=bounded_int(1, 1024), default=None,
                        help="torch CPU threads (default 1)")
    parser.add_argument("--json", default=None, metavar="PATH|-",
                        help="write the result as JSON (schema hisparse-triton/bench-host)")
    return run_host(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
