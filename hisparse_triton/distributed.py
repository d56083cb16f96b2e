"""Moving ``StepPlan``s over the serving stack's own ``torch.distributed`` group.

hisparse-triton runs no transport of its own: with tensor parallelism the stack runs ONE
``HiSparseScheduler`` (on the rank that schedules) and one ``HiSparseWorker`` per rank, and
each step it sends the scheduler's plan to every rank over the process group it already has.
``broadcast_plan`` does that with two ``torch.distributed.broadcast`` calls (the plan's byte
size, then its bytes as a ``uint8`` tensor), which works with gloo (CPU tensors) and NCCL
(pass the rank's CUDA device). A stack may as well ship ``plan.to_bytes()`` inside its own
per-step message; ``StepPlan.from_bytes`` reads it back.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from hisparse_triton.step_plan import StepPlan
from hisparse_triton.worker import shared_pool


def broadcast_plan(plan: Optional[StepPlan], *, src: int = 0, group: Any = None,
                   device: torch.device | str = "cpu") -> StepPlan:
    """Send rank ``src``'s ``plan`` to every rank of ``group``; returns it on every rank.

    ``plan``: the plan on ``src``, ignored elsewhere (pass None). ``device``: where the
    broadcast tensors live (``"cpu"`` for gloo, the rank's CUDA device for NCCL). A
    collective: every rank of the group must call it, in the same order.
    """
    rank = dist.get_rank(group)
    device = torch.device(device)
    if rank == src:
        if not isinstance(plan, StepPlan):
            raise ValueError(f"broadcast_plan: rank {src} (the source) must pass a StepPlan, "
                             f"got {type(plan).__name__}.")
        payload = torch.from_numpy(np.frombuffer(plan.to_bytes(), dtype=np.uint8).copy())
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    buffer = payload.to(device)
    dist.broadcast(buffer, src, group=group)
    if rank == src:
        return plan  # type: ignore[return-value]
    return StepPlan.from_bytes(buffer.cpu().numpy().tobytes())


def broadcast_host_pool_secret(secret: Optional[str], *, src: int = 0, group: Any = None,
                               device: torch.device | str = "cpu") -> str:
    """Send rank ``src``'s shared host pool secret (its ``worker.host_pool_secret``) to every
    rank of ``group``; returns it on every rank. Rank ``src`` builds its worker first (it
    creates the pool), the others pass the result as ``host_pool_secret``: the broadcast also
    orders the two (a rank returns only once ``src`` has sent). A collective."""
    rank = dist.get_rank(group)
    device = torch.device(device)
    if rank == src:
        raw = shared_pool.check_secret(secret)
        buffer = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    else:
        buffer = torch.zeros(shared_pool.SECRET_BYTES, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src, group=group)
    return bytes(buffer.cpu().tolist()).hex()


__all__ = ["broadcast_host_pool_secret", "broadcast_plan"]
