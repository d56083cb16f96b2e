"""Tensors a serving stack allocated itself, adopted as the worker's pools.

A stack that already allocated its KV memory (vLLM and SGLang size it from their own
planner) hands the worker two tensors instead of letting it allocate: a device tensor of at
least ``kv_cache_config.num_blocks * kv_cache_config.bytes_per_block`` bytes and a CPU tensor
of at least ``host_pool_bytes(kv_cache_config)`` bytes (``pool_bytes`` gives both). Each is
read as one contiguous byte buffer (any dtype and shape); the planner's ``KVCacheTensor``s
place every layer inside it exactly as in a pool the worker allocates.

``caller_bytes`` checks such a tensor (device, contiguity, size; not an autograd leaf that
requires grad, not an inference tensor: the worker writes it in place) and returns its bytes
as a ``uint8`` view. The worker never frees adopted memory: ``close()`` drops its references
(and undoes a registration it made itself); the caller's tensors stay valid.
"""

from __future__ import annotations

import torch

from hisparse_triton.specs import KVCacheConfig

__all__ = ["caller_bytes", "host_pool_bytes", "pool_bytes"]


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
