"""Tensors a serving stack allocated itself, adopted as the worker's pools.

A stack that already allocated its KV memory (vLLM and SGLang size it from their own
planner) hands the worker two tensors instead of letting it allocate: a device tensor of at
least ``kv_cache_config.num_blocks * kv_cache_config.bytes_per_block`` bytes and a CPU tensor
of at least ``host_pool_bytes(kv_cache_config)`` bytes (``pool_bytes`` gives both). Each is
read as one contiguous byte buffer (any dtype and shape); the planner's ``KVCacheTensor``s
place every layer inside it exactly as in a pool the worker allocates.

``caller_bytes`` checks such a tensor (device, contiguity, size; not an autograd leaf that
requires grad, not an inference tensor: the worker writes it in place) and returns its bytes
as a ``uint8`` view. ``check_disjoint`` refuses two adopted tensors whose used bytes overlap
(the same tensor twice, or overlapping views of one storage): the worker writes both pools,
so an overlap would make one pool's rows overwrite the other's. (The worker's own tables are
allocated after the pools are adopted, so they never share memory with a caller's tensor.)
The worker never frees adopted memory: ``close()`` drops its references (and undoes a
registration it made itself); the caller's tensors stay valid.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hisparse_triton.specs import KVCacheConfig

__all__ = ["caller_bytes", "check_disjoint", "host_pool_bytes", "pool_bytes", "used_range"]


def host_pool_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes the host pool of a HiSparse plan spans (every host ``KVCacheTensor``)."""
    sizes = [t.offset + t.size for t in kv_cache_config.kv_cache_tensors if t.host_resident]
    if not sizes:
        raise ValueError("the KVCacheConfig has no host-resident tensor (not a HiSparse "
                         "plan).")
    return max(sizes)


def pool_bytes(kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """``(device_bytes, host_bytes)``: the least bytes a caller's device and host tensors
    must hold for ``kv_cache_config``."""
    return (kv_cache_config.num_blocks * kv_cache_config.bytes_per_block,
            host_pool_bytes(kv_cache_config))


def caller_bytes(tensor: object, *, what: str, nbytes: int,
                 device: torch.device) -> torch.Tensor:
    """The first ``nbytes`` bytes of the caller's ``tensor`` as a ``[nbytes] uint8`` view (no
    copy); ``ValueError`` naming ``what`` unless it is a contiguous tensor on ``device`` of
    at least ``nbytes`` bytes that the worker may write in place."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.device != device:
        raise ValueError(f"{what} is on {tensor.device}; it must be on {device}.")
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError(f"{what} must be one contiguous buffer (got strides "
                         f"{tensor.stride()} for shape {tuple(tensor.shape)}).")
    if tensor.requires_grad:
        raise ValueError(f"{what} requires grad; pass a tensor without autograd (the worker "
                         f"writes it in place).")
    if tensor.is_inference():
        raise ValueError(f"{what} is an inference tensor (made under torch.inference_mode), "
                         f"which cannot be written in place outside it; allocate it outside "
                         f"inference mode.")
    have = tensor.numel() * tensor.element_size()
    if have < nbytes:
        raise ValueError(f"{what} holds {have} B; the plan needs at least {nbytes} B.")
    return tensor.view(-1).view(torch.uint8)[:nbytes]


def used_range(tensor: object, nbytes: int) -> Optional[tuple[int, int]]:
    """``[start, end)`` addresses of the bytes the worker uses of an adopted ``tensor`` (its
    first ``nbytes``, or all of it when smaller), or None when it has none to compare
    (``caller_bytes`` refuses such a tensor: not a contiguous strided tensor with storage)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided \
            or tensor.device.type == "meta" or not tensor.is_contiguous():
        return None
    have = min(nbytes, tensor.numel() * tensor.element_size())
    if have <= 0:
        return None
    start = tensor.data_ptr()
    return start, start + have


def check_disjoint(pools: Sequence[tuple[str, object, int]]) -> None:
    """``ValueError`` naming both byte ranges unless the used bytes of every pair of adopted
    tensors are disjoint. ``pools``: ``(what, tensor or None, bytes the worker uses)`` each.
    Reads no tensor value and allocates nothing (the worker calls it before anything else)."""
    ranges = [(what, used_range(tensor, nbytes)) for what, tensor, nbytes in pools
              if tensor is not None]
    for i, (what_a, a) in enumerate(ranges):
        for what_b, b in ranges[i + 1:]:
            if a is None or b is None or a[1] <= b[0] or b[1] <= a[0]:
                continue
            common = min(a[1], b[1]) - max(a[0], b[0])
            raise ValueError(
                f"{what_a} bytes [{a[0]:#x}, {a[1]:#x}) and {what_b} bytes "
                f"[{b[0]:#x}, {b[1]:#x}) overlap ({common} B in common): the worker writes "
                f"both pools, so they must be separate memory (views of one storage are "
                f"accepted when the bytes used do not overlap).")
