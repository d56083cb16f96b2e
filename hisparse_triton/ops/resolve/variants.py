"""Time every Triton resolve kernel variant a call shape can launch, each first checked bit
for bit against the torch reference (what ``bench/gpu_check.py`` runs on a GPU).

``time_resolve_variants(work, timer)``: ``work`` is a resolve workload (``args()``, ``kwargs``,
``restore()``: ``hisparse_triton.benchmarks.ResolveWorkload``), ``timer(call) -> float`` a
timer that restores the state between calls (``benchmarks.event_time`` with
``work.restore`` as its setup). The variants are ``kernels.resolve.resolve_variants``:
``default`` (the shape's dispatch), ``hash`` (where it applies) and ``sorted``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hisparse_triton.ops.resolve import reference
from hisparse_triton.ops.resolve.workspace import ResolveWorkspace

__all__ = ["time_resolve_variants"]


def _kernel_module() -> Any:
    from hisparse_triton.kernels import resolve

    return resolve


def time_resolve_variants(work: Any, timer: Callable[[Callable[[], Any]], float]
                          ) -> dict[str, float]:
    """Time every variant of ``resolve_variants`` on a resolve workload (anything with
    ``args()``, ``kwargs`` and ``restore()``, e.g. ``hisparse_triton.benchmarks.
    ResolveWorkload`` on a GPU): each variant is first checked bit for bit against the torch
    reference (outputs and state; ``AssertionError`` when it differs), then ``timer(call)``
    (e.g. an event timer that restores the state between calls) gives its time. Returns
    ``{variant: timer's figure}``."""
    args, kwargs = work.args(), dict(work.kwargs)
    topk = args[0]
    K, H = topk.shape[1], args[6].shape[1]
    work.restore()
    want = [t.clone() for t in reference.resolve(*work.args(), **kwargs)]
    want_state = (args[6].clone(), args[7].clone())
    times = {}
    ws = ResolveWorkspace(topk.device)
    kernel = _kernel_module()
    rows = torch.empty_like(want[0])
    for name, knobs in kernel.resolve_variants(K, H, kwargs["block_size"],
                                               kwargs["num_host_blocks"]).items():
        def call(knobs=knobs):
            return kernel._resolve(*work.args(), **kwargs, out=rows, workspace=ws, **knobs)
        work.restore()
        got = call()
        ok = all(torch.equal(g, w) for g, w in zip(got, want)) \
            and torch.equal(args[6], want_state[0]) and torch.equal(args[7], want_state[1])
        if not ok:
            raise AssertionError(f"resolve variant {name}: differs from the torch reference")
        times[name] = timer(call)
    return times
