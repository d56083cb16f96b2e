"""Small host inputs onto the worker's device without a host sync.

A CPU tensor bound for CUDA is staged through pinned memory and copied ``non_blocking``, so
the CPU never waits for the device; on a CPU worker nothing is copied.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["array_on_device", "check_readable", "on_device"]


def check_readable(tensor: torch.Tensor, device: torch.device, name: str = "tensor") -> None:
    """``ValueError`` naming the device unless ``tensor`` is on ``device`` or the CPU (what
    ``on_device`` can place without a host sync)."""
    if tensor.device != device and tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; this worker runs on {device} (pass "
                         f"it there, or on the CPU).")


def on_device(tensor: torch.Tensor, device: torch.device, name: str = "tensor") -> torch.Tensor:
    """``tensor`` on ``device`` (itself when it is there already); ``ValueError`` naming the
    device for a tensor on a device the worker cannot read (meta, another accelerator or
    CUDA device)."""
    if tensor.device == device:
        return tensor
    check_readable(tensor, device, name)
    if device.type == "cuda":
        staged = tensor if tensor.is_pinned() else tensor.pin_memory()
        return staged.to(device, non_blocking=True)
    return tensor.to(device)


def array_on_device(values: np.ndarray, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A small CPU array as a ``dtype`` tensor on ``device`` (an ordinary tensor, whatever
    the caller's inference or grad mode)."""
    with torch.inference_mode(False), torch.no_grad():
        cpu = torch.as_tensor(values, dtype=dtype)
        if device.type == "cpu":
            return cpu
        return cpu.pin_memory().to(device, non_blocking=True)
