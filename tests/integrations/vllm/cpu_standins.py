"""CPU stand-ins for the CUDA-only pieces vLLM's HiSparse worker touches (test fixtures only).

On a CPU every kernel runs to completion before the next line, so streams and events order
nothing and can be no-ops; pinned memory is ordinary memory; vLLM's batched DMA
(``swap_blocks_batch``: raw-pointer copies on a copy engine) becomes ``ctypes.memmove``.
The DMA copies are queued and run only when the harness says the step's copy stream has
drained (``HostDMA.drain``, after ``finish_forward``): a read that relied on a copy of the same
step would see stale bytes, as it could on a GPU, and fail the row checks.

Nothing here replaces a HiSparse op or any of vLLM's HiSparse logic.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any, Iterator

import pytest
import torch


class HostEvent:
    """``torch.Event`` / ``torch.cuda.Event`` on a CPU: always complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostStream:
    """``torch.Stream`` / ``torch.cuda.Stream`` on a CPU: work runs in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> HostEvent:
        return event if event is not None else HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "HostStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class HostDMA:
    """``vllm._custom_ops.swap_blocks_batch``: queued raw copies, run by ``drain()``."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, int]] = []
        self.copies = 0
        self.bytes = 0

    def swap_blocks_batch(self, src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor,
                          sizes: torch.Tensor, is_src_access_order_any: bool = False) -> None:
        self.pending.extend(zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()))

    def drain(self) -> None:
        for src, dst, size in self.pending:
            ctypes.memmove(dst, src, size)
            self.copies += 1
            self.bytes += size
        self.pending.clear()


_CURRENT_STREAM = HostStream()


def _current_stream() -> HostStream:
    return _CURRENT_STREAM


def _drop_pin_memory(function: Any) -> Any:
    @functools.wraps(function)
    def call(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return function(*args, **kwargs)
    return call


@contextlib.contextmanager
def _stream_context(stream: Any) -> Iterator[Any]:
    yield stream


def install(monkeypatch: pytest.MonkeyPatch) -> HostDMA:
    """Install the stand-ins for one test (``monkeypatch`` undoes them) and return the DMA
    queue the harness drains once per step."""
    from vllm import _custom_ops
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import worker as hisparse_worker
    from vllm.v1.attention.backends.mla import index_group
    from vllm.v1.hisparse import runtime

    monkeypatch.setattr(torch, "Event", HostEvent)
    monkeypatch.setattr(torch, "Stream", HostStream)
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    monkeypatch.setattr(torch.cuda, "Stream", HostStream)
    monkeypatch.setattr(torch.cuda, "stream", _stream_context)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch, "empty", _drop_pin_memory(torch.empty))
    monkeypatch.setattr(torch, "tensor", _drop_pin_memory(torch.tensor))
    for module in (runtime, index_group, hisparse_worker):
        monkeypatch.setattr(module, "current_stream", _current_stream)
    # cudaHostRegister of the host pool.
    monkeypatch.setattr(runtime, "pin_tensor", lambda tensor: None)
    # The layers' device comes from the accelerator's current index; here it is the CPU.
    monkeypatch.setattr(index_group, "create_hisparse_cache_handle",
                        functools.partial(runtime.create_hisparse_cache_handle, device="cpu"))
    dma = HostDMA()
    monkeypatch.setattr(_custom_ops, "swap_blocks_batch", dma.swap_blocks_batch)
    return dma
