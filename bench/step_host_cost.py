"""Host (Python) cost of one decode step's bookkeeping at DeepSeek-V3.2 structure, batch 64.

Times, per decode step on CPU tensors, the facade (``append_slots(r, 1)`` for every running
request + ``commit()``) and a serving stack's path through the two halves
(``scheduler.append_decode`` + ``scheduler.step()`` + ``worker.apply`` + ``worker.mirror``), with the row-copy launches (the write-through mirror) replaced by
no-ops, so what is left is what the host pays: allocation, table updates, plan building.
Times are the thread's CPU time (``time.thread_time``), so other load on the machine
inflates them little. Also counts the torch operations one step issues on the runtime's tensors (on a GPU each is a
launch or a copy).

Geometry: DeepSeek-V3.2's STRUCTURE (61 sparse layers, every layer an index-group leader, the
planner's 6 resident + 6 hot groups of 12, 12, 12, 12, 12 and 1 layers, block 64, top-k 2048,
a 4096-row hot buffer) with rows shrunk to 64 B (latent) and 13 B (indexer) so the pools fit
a CPU machine: the bookkeeping does not depend on row bytes.

Run: ``python bench/step_host_cost.py [--batch 64] [--steps 200] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hisparse_triton import ops
from hisparse_triton.presets import ModelGeometry, build_kv_cache_spec
from hisparse_triton.runtime import HiSparseRuntime
from hisparse_triton.workload import plan_for_workload

#: DeepSeek-V3.2's layer structure with small rows (see the module docstring).
GEOMETRY = ModelGeometry(name="dsv32-structure", description="DeepSeek-V3.2 structure, small rows",
                         num_layers=61, mla_head_size=64, mla_dtype="uint8",
                         max_model_len=163_840, indexer_head_size=13)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def stubbed_copies() -> Iterator[None]:
    """Replace the row/page copy ops with no-ops (their launches are not host bookkeeping)."""
    saved = ops.copy_rows, ops.copy_pages
    ops.copy_rows = ops.copy_pages = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        ops.copy_rows, ops.copy_pages = saved


def build(batch: int, prompt: int, new_tokens: int) -> tuple[HiSparseRuntime, list[str]]:
    spec = build_kv_cache_spec(GEOMETRY)
    plan = plan_for_workload(spec, max_model_len=prompt + new_tokens, num_requests=batch,
                             topk=2048, device_buffer_size=4096, prompt_len=prompt)
    rt = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=batch,
                         device="cpu", backend="torch", offload_threshold_pages=1)
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        rt.add_request(rid, prompt, new_tokens)
        rt.append_slots(rid, prompt)
        rt.commit()
    return rt, ids


def _time(step, steps: int) -> dict:
    for _ in range(3):
        step()
    counter = _OpCounter()
    with counter:
        step()
    times = []
    for _ in range(steps):  # thread CPU time: robust to other load on the machine
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
    times.sort()
    return {"median_ms": 1e3 * times[len(times) // 2],
            "mean_ms": 1e3 * sum(times) / len(times), "torch_ops_per_step": counter.count}


def measure(batch: int = 64, steps: int = 200, prompt: int = 1024) -> dict:
    """Bookkeeping per decode step: the facade (``append_slots`` per request + ``commit``)
    and a serving stack's path (``append_decode`` + ``step`` + ``apply`` + ``mirror``)."""
    result: dict = {"batch": batch, "steps": steps, "layers": GEOMETRY.num_layers}
    with stubbed_copies():
        rt, ids = build(batch, prompt, 2 * steps + 16)
        try:
            def facade_step() -> None:
                for rid in ids:
                    rt.append_slots(rid, 1)
                rt.commit()

            scheduler, worker = rt.scheduler, rt.worker

            def split_step() -> None:
                scheduler.append_decode(ids)
                plan = scheduler.step()
                worker.apply(plan)
                worker.mirror(plan)

            result["facade"] = _time(facade_step, steps)
            result["split"] = _time(split_step, steps)
        finally:
            rt.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.batch, args.steps)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
