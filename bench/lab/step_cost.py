"""Host (Python) cost of a whole eager decode step, with the kernel launches stubbed out.

What a serving stack's CPU pays per decode step at DeepSeek-V3.2 structure (61 sparse
layers, every layer an index-group leader, the planner's 6 resident + 6 hot groups, block 64,
top-k 2048, a 4096-row hot buffer) and batch 64, measured on CPU tensors that stand in for
CUDA ones, with every Triton launch replaced by a counting stand-in
(``lab.launches.record_launches``), so what is left is the runtime's own Python:

- ``bookkeeping``: ``scheduler.append_decode`` + ``scheduler.step()`` + ``worker.apply`` +
  ``worker.mirror`` (the stack's path through the two halves), and the facade's
  ``append_slots`` per request + ``commit()`` for comparison;
- ``resolve_rows``: one ``worker.resolve_rows`` call (checks, dispatch, the two launchers);
- ``step``: bookkeeping + one ``resolve_rows`` per index group, and the kernel launches and
  torch operations one step issues.

Rows are shrunk to 64 B (latent) and 13 B (indexer) so the pools fit a CPU machine: the host
cost does not depend on row bytes. Times are the thread's CPU time (``time.thread_time``), so
other load on the machine inflates them little.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hisparse_triton.presets import ModelGeometry, build_kv_cache_spec

#: DeepSeek-V3.2's layer structure with small rows (see the module docstring).
GEOMETRY = ModelGeometry(name="dsv32-structure", description="DeepSeek-V3.2 structure, small rows",
                         num_layers=61, mla_head_size=64, mla_dtype="uint8",
                         max_model_len=163_840, indexer_head_size=13)

__all__ = ["GEOMETRY", "DecodeStep", "decode_step", "decode_step_host_cost",
           "launch_path_host_cost"]


class _OpCounter(TorchDispatchMode):
    """Counts the torch operations run inside it (each one a launch or a copy on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _interpreter_env() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` while the runtime is built: its Triton backend then accepts
    CPU tensors (no kernel runs: the launches are stubbed)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _cpu_times(fn: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return times


class _Counted:
    """``len()`` of the launches a stand-in received (the stand-in driver's counter)."""

    def __init__(self, launch: Any) -> None:
        self._launch, self._base = launch, 0

    def __len__(self) -> int:
        return self._launch.count - self._base

    def clear(self) -> None:
        self._base = self._launch.count


@contextmanager
def _standin_launches(read_addresses: bool = True) -> Iterator[_Counted]:
    """Triton's real Python launch path against the stand-in sm_90 driver
    (``lab.standin_driver``): real compiles, ``JITFunction.run`` per launch, the C
    launch replaced by a counting stand-in. The launchers
    accept CPU tensors as CUDA ones (their backend checks are lifted in the block). Needs a
    process whose kernels were imported without ``TRITON_INTERPRET=1``. ``read_addresses``:
    the stand-in's emulation of the C launcher's address reads
    (``StandInLaunch``)."""
    from triton.runtime.jit import JITFunction

    from hisparse_triton.kernels import gather
    from lab import launches
    from lab.standin_driver import standin_cuda_driver
    from hisparse_triton.ops import backends

    if os.environ.get("TRITON_INTERPRET") == "1" or not isinstance(
            gather.copy_rows_kernel, JITFunction):
        raise RuntimeError("the real launch path needs kernels imported without "
                           "TRITON_INTERPRET=1 (run it in a fresh process: "
                           "step_cost.launch_path_host_cost).")
    saved = [(backends, "_interpreting", backends._interpreting)]
    for module in launches.kernel_modules():
        if hasattr(module, "_check_backend"):
            saved.append((module, "_check_backend", module._check_backend))
    backends._interpreting = lambda: True
    for module, name, _ in saved[1:]:
        setattr(module, name, lambda device: None)
    try:
        with standin_cuda_driver(record=False, read_addresses=read_addresses) as launch:
            yield _Counted(launch)
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@contextmanager
def _launch_mode(mode: str) -> Iterator[Any]:
    """``"stubbed"``: launches replaced by counting stand-ins (the interpreter env lets the
    Triton backend accept CPU tensors); ``"standin"``: Triton's real launch path
    (``_standin_launches``); ``"standin_bare"``: the same without the stand-in's emulated
    address reads (Triton's Python launch path alone). Yields a ``len()``-able,
    ``clear()``-able launch count."""
    if mode == "stubbed":
        from lab.launches import record_launches

        with _interpreter_env(), record_launches(store=False) as launches:
            yield launches
    elif mode in ("standin", "standin_bare"):
        with _standin_launches(read_addresses=mode == "standin") as launches:
            yield launches
    else:
        raise ValueError(f"launches must be 'stubbed', 'standin' or 'standin_bare', got "
                         f"{mode!r}.")


class DecodeStep(NamedTuple):
    """The callables of one host-cost decode step (``decode_step``): ``split_step`` (the
    stack's path: ``bookkeeping`` + ``resolves`` + the mirror), ``resolves`` (one
    ``resolve_rows`` per index group), ``resolve_one`` (the first group's), ``bookkeeping``
    (the step without its resolves) and ``facade_step`` (the facade's ``append_slots`` per
    request + ``commit``); ``leaders``: the index groups' leader layers; ``launches``: the
    launch mode's ``len()``-able, ``clear()``-able launch count."""

    split_step: Callable[[], None]
    resolves: Callable[[], None]
    resolve_one: Callable[[], Any]
    bookkeeping: Callable[[], None]
    facade_step: Callable[[], None]
    leaders: tuple[str, ...]
    launches: Any


@contextmanager
def decode_step(batch: int = 64, steps: int = 40, *, top_k: int = 2048,
                device_buffer_size: int = 4096, prompt_len: int = 512,
                layers: int = GEOMETRY.num_layers,
                launches: str = "stubbed") -> Iterator[DecodeStep]:
    """A runtime at DeepSeek-V3.2 structure (see the module docstring) with ``batch``
    requests prefilled (offloaded: every resolve takes the hot path), room for ``steps``
    timed steps after two warm ones, under the launch mode ``launches`` (``_launch_mode``);
    yields its ``DecodeStep`` (the warm steps already run) and closes the runtime on exit."""
    from hisparse_triton.runtime import HiSparseRuntime
    from hisparse_triton.workload import plan_for_workload

    spec = build_kv_cache_spec(GEOMETRY, num_layers=layers)
    plan = plan_for_workload(spec, max_model_len=prompt_len + 4 * steps + 64,
                             num_requests=batch, topk=top_k,
                             device_buffer_size=device_buffer_size, prompt_len=prompt_len)
    ids = [f"r{i}" for i in range(batch)]
    with _launch_mode(launches) as counted:
        rt = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=batch,
                             device="cpu", backend="triton", free_block_watermark=1.0)
        try:
            scheduler, worker = rt.scheduler, rt.worker
            for rid in ids:  # prefill, offloaded: every resolve goes through the hot path
                rt.add_request(rid, prompt_len, 4 * steps + 64)
                rt.append_slots(rid, prompt_len)
                rt.commit()
            leaders = tuple(scheduler.leaders)
            state_rows = torch.from_numpy(scheduler.state_rows(ids))
            rng = np.random.default_rng(0)
            topk = torch.from_numpy(rng.integers(0, prompt_len, (batch, top_k),
                                                 dtype=np.int64).astype(np.int32))

            def planned() -> Any:
                scheduler.append_decode(ids)
                step_plan = scheduler.step()
                worker.apply(step_plan)
                return step_plan

            def resolves() -> None:
                for leader in leaders:
                    worker.resolve_rows(leader, state_rows, topk)

            def split_step() -> None:
                step_plan = planned()
                resolves()
                worker.mirror(step_plan)

            def bookkeeping() -> None:
                worker.mirror(planned())

            def facade_step() -> None:
                for rid in ids:
                    rt.append_slots(rid, 1)
                rt.commit()

            for _ in range(2):  # warm: caches, workspace sizes, persistent outputs
                split_step()
            yield DecodeStep(split_step, resolves,
                             lambda: worker.resolve_rows(leaders[0], state_rows, topk),
                             bookkeeping, facade_step, leaders, counted)
        finally:
            rt.close()


def decode_step_host_cost(batch: int = 64, steps: int = 40, *, top_k: int = 2048,
                          device_buffer_size: int = 4096, prompt_len: int = 512,
                          layers: int = GEOMETRY.num_layers,
                          launches: str = "stubbed") -> dict[str, Any]:
    """Host milliseconds / microseconds of a decode step (see the module docstring); medians
    over ``steps`` steps. Returns a JSON-able dict.

    ``launches``: ``"stubbed"`` (every Triton launch a counting stand-in: the runtime's own
    Python only) or ``"standin"`` (Triton's real Python launch path against the stand-in
    sm_90 driver; needs a fresh process, see ``launch_path_host_cost``) or ``"standin_bare"``
    (the same without the stand-in's Python emulation of the C launcher's address reads)."""
    mode = launches
    with decode_step(batch, steps, top_k=top_k, device_buffer_size=device_buffer_size,
                     prompt_len=prompt_len, layers=layers, launches=mode) as step:
        launches = step.launches
        launches.clear()
        counter = _OpCounter()
        with counter:
            step.split_step()
        step_launches, step_ops = len(launches), counter.count
        launches.clear()
        resolve_counter = _OpCounter()
        with resolve_counter:
            step.resolve_one()
        per_resolve_launches = len(launches)
        step_times = _cpu_times(step.split_step, steps)
        groups = len(step.leaders)
        resolve_times = [t / groups for t in _cpu_times(step.resolves, steps)]
        book_times = _cpu_times(step.bookkeeping, steps)
        facade_times = _cpu_times(step.facade_step, steps)
    median = statistics.median
    return {
        "geometry": f"DeepSeek-V3.2 structure: {layers} sparse layers, {groups} index "
                    f"groups, block 64, top-k {top_k}, hot buffer {device_buffer_size}",
        "batch": batch, "steps": steps, "index_groups": groups,
        "resolve_rows_us": round(1e6 * median(resolve_times), 1),
        "resolve_rows_launches": per_resolve_launches,
        "resolve_rows_torch_ops": resolve_counter.count,
        "bookkeeping_ms": round(1e3 * median(book_times), 3),
        "facade_bookkeeping_ms": round(1e3 * median(facade_times), 3),
        "step_ms": round(1e3 * median(step_times), 3),
        "step_ms_best": round(1e3 * min(step_times), 3),
        "step_launches": step_launches,
        "launch_path": _LAUNCH_PATHS[mode](),
        "step_torch_ops": step_ops,
    }


_LAUNCH_PATHS = {
    "stubbed": lambda: "stubbed (counting stand-ins: the runtime's own Python only)",
    "standin": lambda: ("Triton's Python launch path against the stand-in sm_90 driver "
                        "(real compiles, JITFunction.run per launch, C launch not run)"),
}
_LAUNCH_PATHS["standin_bare"] = lambda: (_LAUNCH_PATHS["standin"]() + "; the stand-in's "
                                         "emulated address reads left out")

_SUBPROCESS = """
import json, sys
from lab.step_cost import decode_step_host_cost
kwargs = json.loads(sys.argv[1])
mode = kwargs.pop("launches")
print(json.dumps(decode_step_host_cost(launches=mode, **kwargs)))
"""


def launch_path_host_cost(batch: int = 64, steps: int = 40, *,
                          read_addresses: bool = True, timeout: float = 1800,
                          **kwargs: Any) -> dict[str, Any]:
    """``decode_step_host_cost(launches="standin")`` in a fresh Python process (its kernels
    imported without ``TRITON_INTERPRET``): every launch through ``JITFunction.run``. The
    first run compiles the kernels for sm_90 (Triton's disk cache keeps them).
    ``read_addresses=False``: launch mode ``"standin_bare"`` (the stand-in does not emulate
    the C launcher's address reads: Triton's Python launch path alone).
    ``RuntimeError`` with the child's error output when it fails."""
    import json
    import subprocess
    import sys

    from lab import child_env

    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    args = json.dumps(dict(batch=batch, steps=steps,
                           launches="standin" if read_addresses else "standin_bare", **kwargs))
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the launch-path measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
